"""Megatron tensor-parallel pieces: the column / row role table (tp, ep_x_tp) and sequence
parallelism's model.Parallelism hooks (ep_tp, ep_x_tp's sequence_parallel).

  attn wq [D, H@t, Dh]  wk/wv [D, KV@t, Dh]  (column)      attn wo [H@t, Dh, D]  (row)
  MLA wq_b [Rq, H@t, qk]  wkv_b [Rkv, H@t, nope + v]  (column; wq_a / wkv_a replicated)
  experts wi_0/wi_1 [E, D, F@t]  wo [E, F@t, D]            shared / dense [D, F@t], [F@t, D]
Embed, unembed, norms, router and bias are left out, i.e. replicated.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from layout.precision import cast_stored, precision
from parallel import sharding
from parallel.sharding import gather_weight, reduce_scatter


def table(axis: str) -> dict:
  """role -> PartitionSpec: heads and every SwiGLU width over `axis`."""
  return {"attn_q": P(None, axis, None), "attn_kv": P(None, axis, None),     # [D, H_t|KV_t, Dh]
          "attn_q_b": P(None, axis, None), "attn_kv_b": P(None, axis, None),  # MLA [R, H_t, .]
          "attn_q_bias": P(axis, None), "attn_kv_bias": P(axis, None),        # [H_t|KV_t, Dh]
          "attn_o": P(axis, None, None),                                      # [H_t, Dh, D] row
          "expert_in": P(None, None, axis),                                   # [E, D, F_t] column
          "expert_out": P(None, axis, None),                                  # [E, F_t, D] row
          "shared_in": P(None, axis), "shared_out": P(axis, None),
          "dense_in": P(None, axis), "dense_out": P(axis, None)}


def sequence_parallel(cfg, residual: P, gathered: P, axis: str, token_axes, grad_axes,
                      replicated, rs_scope: str = "seq_rs"):
  """Megatron's sequence parallelism as model.Parallelism hooks -> (gather_in, scatter_out, use):
    gather_in    the normed h [B, S@axis, D] (residual) all-gathered over `axis` to `gathered`
                 before the tensor-parallel blocks ("seq_ag"; backward: reduce-scatter)
    scatter_out  a row-parallel output [B, S, D], unreduced over `axis`, reduce-scattered back
                 to the residual layout (rs_scope; backward: all-gather)
    use          the `replicated` matrices, which run on each rank's own positions, typed
                 reduced over every token axis, so their gradient is one all-reduce (XLA would
                 split it); the other weights as stored, their gradient over grad_axes."""
  def gather_in(h):
    with jax.named_scope("seq_ag"):
      return gather_weight(h, gathered, (axis,))

  def scatter_out(y):
    with jax.named_scope(rs_scope):
      return reduce_scatter(y, residual)

  def use(role, w):
    if role in replicated:
      return gather_weight(w, P(), token_axes, **precision(cfg, role))
    return cast_stored(w, role, cfg, grad_axes)            # float32: w as stored

  return gather_in, scatter_out, use


def bias_once(p: dict, axis: str) -> dict:
  """Inside a MoE shard_map whose experts run F slices over `axis` (their outputs partial sums,
  psum'd after): gpt-oss's down-projection bias p["bo"] [e, D] kept on `axis` rank 0 and zeroed
  on the others, so that the sum adds it once; its gradient, summed over `axis`, is rank 0's.
  p as is without it."""
  if "bo" not in p:
    return p
  return {**p, "bo": p["bo"] * first_rank(axis, p["bo"].dtype)}


def finish_moe(y, stats, axis: str, token_axes):
  """Inside a MoE shard_map where every `axis` rank routed the same tokens and ran its F slice of
  the experts (tp, ep_x_tp): ONE psum over `axis` of the combined y [.., D] ("moe_psum_tensor"),
  not of the K routed copies; the router statistics counted once, by `axis` rank 0, and summed
  over token_axes, so the aux-loss gradient reaches the router through rank 0 only and is
  summed over `axis` with the rest of the router's gradient."""
  with jax.named_scope("moe_psum_tensor"):
    y = jax.lax.psum(y, axis)
  first = first_rank(axis)
  return y, jax.tree.map(
      lambda v: jax.lax.psum(sharding.to_varying(v, token_axes) * first, token_axes), stats)


def first_rank(axis: str, dtype=jnp.float32):
  """Inside a shard_map: 1 on `axis` rank 0, else 0, in `dtype`: what each rank multiplies a
  value by that every `axis` rank holds alike, so that a sum over `axis` counts it once."""
  return (jax.lax.axis_index(axis) == 0).astype(dtype)
