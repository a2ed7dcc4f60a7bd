"""Expert-parallel (EP) token exchange, shared by ep, ep_as_cp and shard_exp_on_fsdp ("ep" mode).

API (call it in explicit-sharding mode, outside any shard_map):

  moe_ep(p, x, positions, cfg, *, ep_axes, method="a2a", batch_on_expert=False,
         gather_sequence=None, ragged_fn=None) -> (y, stats)
    The routed MoE with experts sharded over the mesh axes `ep_axes` (a tuple; one EP group is
    every device that differs only along them, shard index = their linear index, major first).
    x [B, S, D], positions [B, S]: any token sharding whose axes include ep_axes (read from
    jax.typeof(x); e.g. P(("data","fsdp","expert"), None, None) or P(("data","fsdp"), "expert", None)).
    p: router [D, E] and bias [E] whole (replicated or typed reduced, e.g. by gather_weight);
       wi_0 / wi_1 [E, D, F], wo [E, F, D] with E sharded over ep_axes *in that order* and D, F
       whole: gather FSDP shards first (common.sharding.gather_weight, grad_axes = token axes
       minus ep_axes). batch_on_expert=True: E whole as well (see below).
    method: "a2a" (capacity-padded all_to_all, any backend) | "ragged" (ragged_all_to_all,
       GPU/TPU only; XLA:CPU cannot run it). resolve_method / check_method map "auto".
    gather_sequence: moe.route_tokens' callable for the capacity rule when S is sharded.
    ragged_fn: stand-in for jax.lax.ragged_all_to_all (tests use a dense emulation on CPU).
    Returns y with x's sharding and router stats summed over every token axis (global sums).
  dispatch_spec(token_axes, ep_axes, batch_on_expert=False) -> PartitionSpec of the buffer below.
  dispatch_type(cfg, mesh, x_spec, ep_axes, ...) -> the buffer's ShapeDtypeStruct (sharding
    included), from jax.eval_shape of the real dispatch stage: no compile, no run.
  send(xt, experts, keep, ...) -> (buf, ids, meta) / receive(out, meta, ...) -> copy rows: the
    exchange alone, inside a full-manual shard_map body (no routing, no experts).
  Index helpers (tested on 2-3 shard cases): capacity, make_plan, pack, unpack, segment_ids,
    ragged_params.

Three full-manual shard_maps joined by the dispatch buffer, a global explicit-sharded array
  [N_src, EP, C, D] @ P(token_axes - ep_axes, ep_axes)    (a2a)
  [N_src/EP, EP, EP*C, D] @ same spec                       (ragged)
(N_src = token shards; dim 0 = who sent the rows, dim 1 = which EP shard owns their experts): its
batch dim is never on an EP axis and its expert dim always is (MaxText #4179's fix).
  1 "dispatch_a2a" : route local tokens, plan, pack, exchange          tokens -> buffer
  2 "expert_gmm"   : sort received rows by local expert, SwiGLU gmm, unsort   buffer -> buffer
  3 "combine_a2a"  : exchange back, gather each copy's row, weight, sum      buffer -> tokens

Send plan of one device (T local tokens, K copies each, EP shards of L = E/EP experts):
  copies (t, k) sorted stably by expert id (dropped copies -> id E, last); shard j's copies are
  one contiguous run, ordered by local expert. a2a: copy -> send[dst, slot], dst = e // L,
  slot = its rank in shard dst's run. Example EP=2, L=2, T=3, K=2, experts [[1,2],[0,3],[2,1]]:
    sorted copies (t,k:e) (1,0:0) (0,0:1) (2,1:1) | (0,1:2) (2,0:2) (1,1:3)
    send[0] = [x1, x0, x2, 0, 0, 0]   send[1] = [x0, x2, x1, 0, 0, 0]   counts [[1,2],[2,1]]
  The receiver gets rows [EP_src, C] and the counts [EP_src, L] (a tiny int all_to_all); row c of
  source i belongs to local expert #{l : cumsum(counts[i])[l] <= c} (L = padding).

Buffer bound (a2a, `capacity`): nothing is ever dropped by the exchange (the `dropped` metric is
the capacity rule's count only).
  dropless (capacity_factor 0): a token picks K distinct experts, so it sends at most min(K, L)
    copies to one shard: C = T * min(K, L), the exact worst case. Each device sends and receives
    EP*C rows per exchange, EP*min(K,L)/K (<= EP) times the T*K rows a ragged exchange moves.
  capacity_factor cf > 0: at most C_e = ceil(cf*S*K/E) copies of one sequence reach one expert,
    so a device holding b sequences (whole, or parts of them under ep_as_cp) sends at most
    b*L*C_e to one shard: C = min(T * min(K, L), b*L*C_e), about cf*T*K/EP, and the exchange
    moves about cf x the routed T*K rows (tiny, expert:8, cf 1: 1/4 of the dropless bytes).

batch_on_expert=True reproduces MaxText #4179's mis-sharding: the buffer's batch dim is sharded
over the token axes *including* ep_axes. P((.., "expert"), "expert") is inexpressible here (JAX
raises DuplicateSpecError: an axis may shard only one dim), so as with Flax's rule resolution the
expert dim loses the axis: [N_src, EP, C, D] @ P(token_axes, None). Then no exchange moves rows
and every device needs every expert's weights: the caller must gather E (the all-gather /
reduce-scatter fallback #4179 measured), since shard_map in_specs must match exactly and GSPMD
cannot slip the gather in silently.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from common import buffers, moe, routing
from common.config import ConfigError

METHODS = ("a2a", "ragged")


# ----------------------------------------------------------------------------- method / specs
def resolve_method(name: str, platform: str | None = None) -> str:
  """"auto" -> ragged on GPU/TPU, a2a on CPU."""
  platform = platform or jax.default_backend()
  if name == "auto":
    return "a2a" if platform == "cpu" else "ragged"
  if name not in METHODS:
    raise ConfigError(f"dispatch={name!r} must be auto, a2a or ragged")
  return name


def check_method(name: str, platform: str | None = None) -> None:
  platform = platform or jax.default_backend()
  if resolve_method(name, platform) == "ragged" and platform == "cpu":
    raise ConfigError("dispatch='ragged' needs ragged_all_to_all, which XLA:CPU does not "
                      "implement; use --dispatch=a2a (or auto)")


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def token_axes_of(x_spec) -> tuple[str, ...]:
  return tuple(a for e in x_spec for a in _axes(e))


def _entry(axes):
  return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def dispatch_spec(token_axes, ep_axes, batch_on_expert: bool = False) -> P:
  """[N_src, EP, rows, D]: batch over the token axes minus ep_axes, expert dim over ep_axes."""
  ep_axes = tuple(ep_axes)
  if batch_on_expert:                       # #4179: batch keeps `expert`, so E cannot have it
    return P(_entry(tuple(a for a in token_axes if a not in ep_axes) + ep_axes), None, None, None)
  return P(_entry(tuple(a for a in token_axes if a not in ep_axes)), _entry(ep_axes), None, None)


def capacity(t_local: int, top_k: int, n_local: int, seqs: int = 0, slots: int = 0) -> int:
  """C, the rows one device sends to one EP shard of n_local experts, at most.
  Dropless (slots = 0): T*min(K, L), the exact worst case (a token's K copies go to K distinct
  experts). With the capacity rule, at most `slots` = C_e = ceil(cf*S*K/E) copies of a sequence
  reach one expert, so a device holding (parts of) `seqs` sequences sends at most seqs*L*C_e
  copies to one shard: C is the smaller of the two. Neither bound ever drops a kept copy."""
  worst = t_local * min(top_k, n_local)
  return min(worst, seqs * n_local * slots) if slots > 0 else worst


def send_rows(cfg, b_loc: int, s_loc: int, ep: int) -> int:
  """C for a device holding [b_loc, s_loc] tokens (b_loc sequences, whole or in part)."""
  return capacity(b_loc * s_loc, cfg.top_k, cfg.n_experts // ep, seqs=b_loc,
                  slots=routing.capacity(cfg, cfg.seq_len))


# ----------------------------------------------------------------------------- index helpers
class Plan(NamedTuple):
  dst: jax.Array      # [T*K] destination EP shard of copy (t, k); EP for dropped copies
  slot: jax.Array     # [T*K] row in send[dst] (a2a)
  pos: jax.Array      # [T*K] row in the expert-sorted copy list (ragged)
  counts: jax.Array   # [EP, L] copies per (destination shard, local expert)


def _excl_cumsum(a, axis=-1):
  return jnp.cumsum(a, axis=axis) - a


def make_plan(experts, keep, n_experts: int, ep: int) -> Plan:
  """experts / keep [T, K] (local tokens) -> Plan; see the module docstring's example."""
  n_local = n_experts // ep
  flat = jnp.where(keep, experts, n_experts).reshape(-1)                 # [T*K], dropped -> E
  order = jnp.argsort(flat, stable=True)
  pos = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  counts = jnp.sum(jax.nn.one_hot(flat, n_experts, dtype=jnp.int32), axis=0).reshape(ep, n_local)
  sizes = jnp.sum(counts, axis=1)                                        # [EP] rows per shard
  start = jnp.concatenate([_excl_cumsum(sizes), jnp.sum(sizes, keepdims=True)])   # [EP+1]
  dst = flat // n_local                                                  # E // L = EP for dropped
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


# ----------------------------------------------------------------------------- the three stages
def _psum(tree, axes):
  return jax.tree.map(lambda v: jax.lax.psum(v, axes), tree)


def send(xt, experts, keep, *, n_experts, ep_axes, ep, method="a2a", exchange=True,
         ragged_fn=None, rows=None):
  """Shard_map body: local tokens xt [T, D] with their experts / keep [T, K] -> the experts'
  rows. Returns (buf, ids, meta):
    a2a      buf [EP_src, 1, C, D]: row c of source i (ids: its local expert, L = padding)
    no exch. buf [1, EP_dst, C, D]: this device's own send buffer (ids: global expert, E = pad)
    ragged   buf [1, 1, EP*C, D]: rows of source 0, 1, .. back to back, each run by expert
  meta: what `receive` needs to bring the rows back. rows: C (default: the dropless worst case;
  it must bound the kept copies this device sends to one shard)."""
  t, d = xt.shape
  k, n_local = experts.shape[1], n_experts // ep
  plan = make_plan(experts, keep, n_experts, ep)
  c = capacity(t, k, n_local) if rows is None else rows
  meta = {"dst": plan.dst, "slot": plan.slot, "pos": plan.pos}
  if method == "ragged":
    rows = jnp.repeat(xt, k, axis=0)                                     # [T*K, D] copy order
    xs = jnp.zeros_like(rows).at[plan.pos].set(rows)                     # expert-sorted
    g = jax.lax.all_gather(plan.counts, ep_axes, axis=0)                 # [EP_src, EP_dst, L]
    a = jnp.sum(g, axis=-1)                                              # [EP_src, EP_dst]
    me = jax.lax.axis_index(ep_axes)
    (io, ss, oo, rs), _ = ragged_params(a, me)
    recv = (ragged_fn or jax.lax.ragged_all_to_all)(
        xs, buffers.padded((ep * c, d), xt.dtype), io, ss, oo, rs, axis_name=ep_axes)  # [EP*C, D]
    seg = segment_ids(g[:, me, :].reshape(ep * n_local), ep * c)        # [EP*C] in 0..EP*L
    meta["a"] = a
    return recv[None, None], jnp.where(seg < ep * n_local, seg % n_local, n_local)[None, None], meta
  buf = pack(xt, plan, k, c)                                             # [EP, C, D]
  if not exchange:                                                       # batch_on_expert
    ids = segment_ids(plan.counts, c)                                    # [EP, C] in 0..L
    ids = jnp.where(ids < n_local, ids + n_local * jnp.arange(ep)[:, None], n_experts)
    return buf[None], ids[None], meta
  recv = jax.lax.all_to_all(buf, ep_axes, 0, 0, tiled=True)             # [EP_src, C, D]
  counts = jax.lax.all_to_all(plan.counts, ep_axes, 0, 0, tiled=True)   # [EP_src, L]
  return recv[:, None], segment_ids(counts, c)[:, None], meta


def receive(out, meta, *, ep_axes, method="a2a", exchange=True, ragged_fn=None):
  """Shard_map body, inverse of `send`: out (buf's layout) -> rows of the copies [T*K, D] in
  copy order (t, k), zeros for dropped copies."""
  d = out.shape[-1]
  if method == "ragged":
    me = jax.lax.axis_index(ep_axes)
    _, (io, ss, oo, rs) = ragged_params(meta["a"], me)
    back = (ragged_fn or jax.lax.ragged_all_to_all)(
        out.reshape(-1, d), buffers.padded((meta["pos"].shape[0], d), out.dtype), io, ss, oo, rs,
        axis_name=ep_axes)                                               # [T*K, D] expert-sorted
    sent = meta["dst"] < meta["a"].shape[0]                              # dropped copies: unsent
    return jnp.where(sent[:, None], back[meta["pos"]], 0)
  back = jax.lax.all_to_all(out[:, 0], ep_axes, 0, 0, tiled=True) if exchange else out[0]
  return unpack(back, Plan(meta["dst"], meta["slot"], meta["pos"], None))   # back [EP_dst, C, D]


def _dispatch_body(p, x, positions, *, cfg, ep_axes, ep, token_axes, method, exchange,
                   gather_sequence, ragged_fn):
  """Stage 1 (local tokens [b, s, D]): route, then `send`. -> (buf, ids, meta, stats)."""
  b, s, d = x.shape
  r, keep, stats = moe.route_tokens(p, x, positions, cfg, experts_all=gather_sequence)
  buf, ids, meta = send(x.reshape(b * s, d), r.experts, keep, n_experts=cfg.n_experts,
                        ep_axes=ep_axes, ep=ep, method=method, exchange=exchange,
                        ragged_fn=ragged_fn, rows=send_rows(cfg, b, s, ep))
  meta["weights"] = r.weights                                            # [T, K], 0 if dropped
  return buf, ids, meta, _psum(stats, token_axes)


def _expert_body(w, buf, ids, *, backend):
  """Stage 2: rows of the local buffer through their expert (ids index w's E dim; = e: pad)."""
  shape, d = buf.shape, buf.shape[-1]
  rows, gid = buf.reshape(-1, d), ids.reshape(-1)                        # [M, D], [M]
  n = w["wi_0"].shape[0]
  order = jnp.argsort(gid, stable=True)
  gs = jnp.sum(jax.nn.one_hot(gid, n, dtype=jnp.int32), axis=0)          # [e], padding excluded
  ys = moe.swiglu_experts(rows[order], gs, w, backend)                   # [M, D], zero tail
  return jnp.zeros_like(rows).at[order].set(ys.astype(rows.dtype)).reshape(shape)


def _combine_body(out, meta, *, cfg, ep_axes, method, exchange, ragged_fn, out_shape, **_):
  """Stage 3: `receive` the rows, weight the K copies of each token, sum."""
  b, s, d = out_shape
  ycopy = receive(out, meta, ep_axes=ep_axes, method=method, exchange=exchange,
                  ragged_fn=ragged_fn).reshape(b * s, cfg.top_k, d)     # [T, K, D]
  y = jnp.einsum("tkd,tk->td", ycopy, meta["weights"].astype(ycopy.dtype))
  return y.reshape(b, s, d)


def _spec(a):
  return jax.typeof(a).sharding.spec


def _local_shape(shape, spec, mesh):
  entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  return tuple(n // int(np.prod([mesh.shape[a] for a in _axes(e)])) for n, e in zip(shape, entries))


def _setup(mesh, x_spec, cfg, ep_axes, method, batch_on_expert, ragged_fn):
  """Static arguments of the stage bodies and the specs joining the stages."""
  ep_axes = tuple(ep_axes)
  token_axes = token_axes_of(x_spec)
  method = "a2a" if batch_on_expert else method        # nothing is exchanged either way
  kw = dict(cfg=cfg, ep_axes=ep_axes, ep=int(np.prod([mesh.shape[a] for a in ep_axes])),
            method=method, exchange=not batch_on_expert,
            ragged_fn=ragged_fn or jax.lax.ragged_all_to_all)
  buf_spec = dispatch_spec(token_axes, ep_axes, batch_on_expert)
  dev = _entry(token_axes)                              # per-device metadata [N_dev, ...]
  meta_specs = {"dst": P(dev, None), "slot": P(dev, None), "pos": P(dev, None),
                "weights": P(dev, None, None)}
  if method == "ragged":
    meta_specs["a"] = P(dev, None, None)
  return token_axes, kw, buf_spec, P(*tuple(buf_spec)[:3]), meta_specs


def _stage1(route_p, x, positions, mesh, x_spec, token_axes, kw, buf_spec, ids_spec, meta_specs,
            gather_sequence):
  """shard_map of stage 1: tokens -> (buf, ids, per-device meta, global stats)."""
  def body(q, xl, pl):
    buf, ids, meta, stats = _dispatch_body(q, xl, pl, token_axes=token_axes,
                                           gather_sequence=gather_sequence, **kw)
    return buf, ids, jax.tree.map(lambda v: v[None], meta), stats
  with jax.named_scope("dispatch_a2a"):
    return jax.shard_map(
        body, mesh=mesh, in_specs=(jax.tree.map(_spec, route_p), x_spec, P(*tuple(x_spec)[:2])),
        out_specs=(buf_spec, ids_spec, meta_specs, P()))(route_p, x, positions)


def moe_ep(p, x, positions, cfg, *, ep_axes, method: str = "a2a", batch_on_expert: bool = False,
           gather_sequence=None, ragged_fn=None):
  """The routed MoE with an EP token exchange; see the module docstring. -> (y, stats)."""
  mesh, x_spec = jax.typeof(x).sharding.mesh, _spec(x)
  token_axes, kw, buf_spec, ids_spec, meta_specs = _setup(mesh, x_spec, cfg, ep_axes, method,
                                                          batch_on_expert, ragged_fn)
  route_p = {"router": p["router"], "bias": p["bias"]}
  w = {n: p[n] for n in ("wi_0", "wi_1", "wo")}        # [E/EP, D, F] local (E whole: no exchange)
  buf, ids, meta, stats = _stage1(route_p, x, positions, mesh, x_spec, token_axes, kw, buf_spec,
                                  ids_spec, meta_specs, gather_sequence)
  with jax.named_scope("expert_gmm"):
    out = jax.shard_map(lambda wl, bl, il: _expert_body(wl, bl, il, backend=cfg.gmm_backend),
                        mesh=mesh, in_specs=(jax.tree.map(_spec, w), buf_spec, ids_spec),
                        out_specs=buf_spec)(w, buf, ids)                 # same layout as buf
  out_shape = _local_shape(x.shape, x_spec, mesh)
  with jax.named_scope("combine_a2a"):
    y = jax.shard_map(
        lambda ol, ml: _combine_body(ol, jax.tree.map(lambda v: v[0], ml), out_shape=out_shape,
                                     **kw),
        mesh=mesh, in_specs=(buf_spec, meta_specs), out_specs=x_spec)(out, meta)
  return y.astype(x.dtype), stats


def dispatch_type(cfg, mesh, x_spec, ep_axes, *, method="a2a", batch_on_expert=False,
                  dtype=jnp.float32):
  """ShapeDtypeStruct (with sharding) of the dispatch buffer for a [B, S, D] batch laid out as
  x_spec: jax.eval_shape of the real dispatch stage, no compile or run."""
  def shaped(shape, spec, dt=dtype):
    return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
  setup = _setup(mesh, x_spec, cfg, ep_axes, method, batch_on_expert, None)
  q = {"router": shaped((cfg.d_model, cfg.n_experts), P()), "bias": shaped((cfg.n_experts,), P())}
  x = shaped((cfg.batch, cfg.seq_len, cfg.d_model), x_spec)
  pos = shaped((cfg.batch, cfg.seq_len), P(*tuple(x_spec)[:2]), jnp.int32)
  with jax.set_mesh(mesh):
    return jax.eval_shape(lambda q, x, pos: _stage1(q, x, pos, mesh, x_spec, *setup, None)[0],
                          q, x, pos)
