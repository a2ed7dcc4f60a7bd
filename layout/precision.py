"""Mixed precision at the point of use (--dtype=bfloat16): which weights are cast, and how a
weight used as stored is cast so that its gradient is summed in float32.

The float32 master stays in the param tree; parallel.sharding.gather_weight casts the stored shard
to cfg.dtype before any gather (the all-gather moves bf16) and sums the gradient in
cfg.grad_reduce_dtype (float32 unless asked). model.KEEP_F32 roles (norms, router, bias) and
float32 runs are never cast: their programs are the same as without mixed precision.
"""
from __future__ import annotations

import jax

from modeling import model
from parallel.sharding import gather_weight, spec_axes


def precision(cfg, role: str) -> dict:
  """gather_weight's mixed-precision kwargs for a role ({} in float32 and for model.KEEP_F32):
  cast to cfg.dtype before the gather, gradient summed in cfg.grad_reduce_dtype."""
  if not cfg.mixed or role in model.KEEP_F32:
    return {}
  return {"dtype": cfg.dtype, "reduce_dtype": cfg.grad_reduce_dtype}


def cast_stored(w, role: str, cfg, grad_axes):
  """A weight used as stored (nothing to gather), under mixed precision: cast on its shard and
  typed reduced over the grad axes it is not split over, so its gradient is summed by
  gather_weight's backward in grad_reduce_dtype (XLA would sum the bf16 partials). float32: w,
  untouched (the same program as without mixed precision)."""
  kw = precision(cfg, role)
  if not kw:
    return w
  spec = jax.typeof(w).sharding.spec
  stored = set(spec_axes(spec))
  axes = grad_axes if not isinstance(grad_axes, str) else (grad_axes,)
  return gather_weight(w, spec, tuple(a for a in axes if a not in stored), **kw)


def stored_use(cfg, grad_axes):
  """Parallelism.use for weights used as stored (dp, tp, ep_tp): cast_stored on every role."""
  return lambda role, w: cast_stored(w, role, cfg, grad_axes)


def moe_stored(p, cfg, grad_axes, gathered=()):
  """A layer's "moe" params used as stored inside a shard_map (dp, tp, ep_tp): each leaf through
  cast_stored -> (params, their in_specs; reduced over grad_axes in bf16). Leaves whose role is
  in `gathered` pass as they come (already cast and typed reduced: layout/fsdp.gather_once)."""
  roles = {k: model.MOE_ROLES[k] for k in p}
  p = {k: v if roles[k] in gathered else cast_stored(v, roles[k], cfg, grad_axes)
       for k, v in p.items()}
  return p, {k: jax.typeof(v).sharding.spec for k, v in p.items()}


