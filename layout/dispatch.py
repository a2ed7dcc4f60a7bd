"""Index helpers of the expert-parallel (EP) token exchange, each with hand-worked tests
(tests/test_dispatch.py). The exchange itself is strategies/ep.py's shard_map body, moe_body,
with its exchanges (padded all-to-all, ragged, none); ep_as_cp, shard_exp_on_fsdp and pp call it.

  rows_bound / send_rows -> C, make_plan -> Plan, pack, unpack, segment_ids, ragged_params.

Send plan of one device (T local tokens, K copies each, EP shards of e = E/EP experts):
  copies (t, k) sorted stably by expert id (dropped copies -> id E, last); shard j's copies are
  one contiguous run, ordered by local expert. a2a: copy -> send[dst, slot], dst = expert // e,
  slot = its rank in shard dst's run. Example EP=2, e=2, T=3, K=2, experts [[1,2],[0,3],[2,1]]:
    sorted copies (t,k:e) (1,0:0) (0,0:1) (2,1:1) | (0,1:2) (2,0:2) (1,1:3)
    send[0] = [x1, x0, x2, 0, 0, 0]   send[1] = [x0, x2, x1, 0, 0, 0]   counts [[1,2],[2,1]]
  The receiver gets rows [EP_src, C] and the counts [EP_src, e] (a tiny int all_to_all); row c of
  source i belongs to local expert #{l : cumsum(counts[i])[l] <= c} (e = padding).

Buffer bound (a2a, `rows_bound`): nothing is ever dropped by the exchange (the `dropped` metric is
the capacity rule's count only).
  dropless (capacity_factor 0): a token picks K distinct experts, so it sends at most min(K, e)
    copies to one shard: C = T * min(K, e), the exact worst case. Each device sends and receives
    EP*C rows per exchange, EP*min(K,e)/K (<= EP) times the T*K rows a ragged exchange moves.
  capacity_factor cf > 0: at most C_e = ceil(cf*S*K/E) copies of one sequence reach one expert,
    so a device holding b sequences (whole, or parts of them under ep_as_cp) sends at most
    b*e*C_e to one shard: C = min(T * min(K, e), b*e*C_e), about cf*T*K/EP, and the exchange
    moves about cf x the routed T*K rows (tiny, expert:8, cf 1: 1/4 of the dropless bytes).
"""
from __future__ import annotations

from typing import NamedTuple

import einops
import jax
import jax.numpy as jnp

from layout import buffers
from modeling import routing


def rows_bound(t_local: int, top_k: int, n_local: int, seqs: int = 0, slots: int = 0) -> int:
  """C, the rows one device sends to one EP shard of n_local experts, at most.
  Dropless (slots = 0): T*min(K, e), the exact worst case (a token's K copies go to K distinct
  experts). With the capacity rule, at most `slots` = C_e = ceil(cf*S*K/E) copies of a sequence
  reach one expert, so a device holding (parts of) `seqs` sequences sends at most seqs*e*C_e
  copies to one shard: C is the smaller of the two. Neither bound ever drops a kept copy."""
  worst = t_local * min(top_k, n_local)
  return min(worst, seqs * n_local * slots) if slots > 0 else worst


def send_rows(cfg, b_loc: int, s_loc: int, ep: int) -> int:
  """C for a device holding [b_loc, s_loc] tokens (b_loc sequences, whole or in part)."""
  return rows_bound(b_loc * s_loc, cfg.top_k, cfg.n_experts // ep, seqs=b_loc,
                  slots=routing.expert_slots(cfg, cfg.seq_len))


# ----------------------------------------------------------------------------- index helpers
class Plan(NamedTuple):
  dst: jax.Array      # [T*K] destination EP shard of copy (t, k); EP for dropped copies
  slot: jax.Array     # [T*K] row in send[dst] (a2a)
  pos: jax.Array      # [T*K] row in the expert-sorted copy list (ragged)
  counts: jax.Array   # [EP, e] copies per (destination shard, local expert)


def _excl_cumsum(a, axis=-1):
  return jnp.cumsum(a, axis=axis) - a


def make_plan(experts, keep, n_experts: int, ep: int) -> Plan:
  """experts / keep [T, K] (local tokens) -> Plan; see the module docstring's example."""
  n_local = n_experts // ep
  flat = jnp.where(keep, experts, n_experts).reshape(-1)                 # [T*K], dropped -> E
  order = jnp.argsort(flat, stable=True)
  pos = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  per_expert = jnp.sum(jax.nn.one_hot(flat, n_experts, dtype=jnp.int32), axis=0)   # [E]
  counts = einops.rearrange(per_expert, "(x e) -> x e", x=ep)           # expert id = x*e + local
  sizes = jnp.sum(counts, axis=1)                                        # [EP] rows per shard
  start = jnp.concatenate([_excl_cumsum(sizes), jnp.sum(sizes, keepdims=True)])   # [EP+1]
  dst = flat // n_local                                                  # E // e = EP for dropped
  return Plan(dst, pos - start[dst], pos, counts)


def pack(x, plan: Plan, k: int, c: int):
  """x [T, D] -> send [EP, C, D]: copy (t, k) at [dst, slot]; dropped copies nowhere."""
  ep = plan.counts.shape[0]
  rows = jnp.repeat(x, k, axis=0)                                        # [T*K, D] copy order
  return buffers.padded((ep, c, x.shape[1]), x.dtype).at[plan.dst, plan.slot].set(rows, mode="drop")


def unpack(back, plan: Plan):
  """back [EP, C, D] (rows returned to their slots) -> per-copy rows [T*K, D] (0 if dropped)."""
  return back.at[plan.dst, plan.slot].get(mode="fill", fill_value=0)


def segment_ids(counts, rows: int):
  """counts [..., n] segment sizes laid out back to back -> segment id of each of `rows` rows
  [..., rows] (n for padding rows past the last segment)."""
  ends = jnp.cumsum(counts, axis=-1)                                     # [..., n]
  r = jnp.arange(rows)
  return jnp.sum(r[:, None] >= ends[..., None, :], axis=-1).astype(jnp.int32)


def ragged_params(a, me):
  """a [EP_src, EP_dst] copies sent i -> j (same on every shard of the group), me = this shard.
  -> (dispatch, combine) argument tuples (input_offsets, send_sizes, output_offsets, recv_sizes)
  for ragged_all_to_all. Dispatch sends my expert-sorted copies: run j (a[me, j] rows) lands in
  shard j after the rows of sources i < me. Combine sends them back to the same places."""
  send = a[me]
  dispatch = (_excl_cumsum(send), send, _excl_cumsum(a, axis=0)[me], a[:, me])
  back = a[:, me]
  combine = (_excl_cumsum(back), back, _excl_cumsum(a, axis=1)[:, me], send)
  return dispatch, combine
