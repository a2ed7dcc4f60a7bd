"""ep's token exchange over jax.lax.ragged_all_to_all (--dispatch=ragged, and "auto" on GPU/TPU).
Not a strategy: the shard_map body ep.moe_ep runs instead of ep.moe_body for every EP strategy.

It moves only the routed rows (T*K per device and direction) where moe_body's padded all_to_all
moves EP*C. XLA:CPU cannot compile the op: on CPU it is checked through a dense emulation and
lowered, never run (tests/test_dispatch.py). Same steps as moe_body but for the transport:
  copies sorted by expert (plan.pos), so shard j's copies are one contiguous run
  counts all-gathered -> a[i, j] rows shard i sends j -> offsets (dispatch.ragged_params)
  "dispatch_a2a": ragged_all_to_all -> [EP*C, D]: source 0's run, source 1's, .., padding
  "expert_gmm": segment ids over (source, local expert) -> local expert; SwiGLU gmm
  "combine_a2a": ragged_all_to_all back to the copies' expert-sorted rows [T*K, D]
  unsent (dropped) copies' rows are padding: masked to 0 before the weighted combine
"""
import jax
import jax.numpy as jnp

from common import buffers, dispatch, moe
from strategies.ep import experts_ffn


def moe_body(p, x, positions, *, cfg, ep_axes, ep, token_axes, gather_sequence=None,
             ragged_fn=jax.lax.ragged_all_to_all):
  """ep.moe_body with ragged transport. ragged_fn: a stand-in for the op (tests, on CPU)."""
  b, s, d = x.shape
  t, k, n_local = b * s, cfg.top_k, cfg.n_experts // ep
  r, keep, stats = moe.route_tokens(p, x, positions, cfg, experts_all=gather_sequence)  # [T, K]
  c = dispatch.send_rows(cfg, b, s, ep)
  plan = dispatch.make_plan(r.experts, keep, cfg.n_experts, ep)
  rows = jnp.repeat(x.reshape(t, d), k, axis=0)                          # [T*K, D] copy order
  xs = jnp.zeros_like(rows).at[plan.pos].set(rows)                       # expert-sorted
  g = jax.lax.all_gather(plan.counts, ep_axes, axis=0)                   # [EP_src, EP_dst, e]
  me = jax.lax.axis_index(ep_axes)
  there, home = dispatch.ragged_params(jnp.sum(g, axis=-1), me)          # offsets and sizes
  with jax.named_scope("dispatch_a2a"):
    recv = ragged_fn(xs, buffers.padded((ep * c, d), x.dtype), *there, axis_name=ep_axes)
  with jax.named_scope("expert_gmm"):
    seg = dispatch.segment_ids(g[:, me, :].reshape(ep * n_local), ep * c)  # [EP*C] in 0..EP*e
    ids = jnp.where(seg < ep * n_local, seg % n_local, n_local)          # local expert, e = pad
    out = experts_ffn(p, recv, ids, n_local, cfg.gmm_backend)            # [EP*C, D]
  with jax.named_scope("combine_a2a"):
    back = ragged_fn(out, buffers.padded((t * k, d), out.dtype), *home,
                     axis_name=ep_axes)                                  # [T*K, D] expert-sorted
  sent = plan.dst < ep                                                   # dropped copies: unsent
  ycopy = jnp.where(sent[:, None], back[plan.pos], 0).reshape(t, k, d)   # [T, K, D]
  y = jnp.einsum("tkd,tk->td", ycopy, r.weights.astype(ycopy.dtype))
  return y.reshape(b, s, d), jax.tree.map(lambda v: jax.lax.psum(v, token_axes), stats)
