"""FSDP pieces shared by the strategies that shard weights on their model dim D: the role ->
PartitionSpec table, the gather-before-use `Parallelism.use`, the all-experts-local MoE, and ZeRO-1's
storage (`over`) and once-per-step gather (`gather_once`, ep_x_tp's zero1).

FSDP dim per weight (the model dim D; MLA's up-projections have none: their rank). Replicated: the router bias (the step updates
it with global counts) and the norm scales [D] (tiny; JAX rejects an elementwise product of a
sharded activation with a weight typed reduced, which is what gather_weight returns).
  embed [V, D@f]   unembed [D@f, V]   router [D@f, E]
  attn wq [D@f, H, Dh]  wk/wv [D@f, KV, Dh]   attn wo [H, Dh, D@f]
  MLA wq_a [D@f, Rq]  wq_b [Rq@f, H, qk]  wkv_a [D@f, Rkv + rope]  wkv_b [Rkv@f, H, nope + v]
  dense layer FFN wi_0/wi_1 [D@f, Fd]  wo [Fd, D@f]
  moe wi_0/wi_1 [E, D@f, F]       moe wo [E, F, D@f]   shared wi_0/wi_1 [D@f, Fs]  shared wo [Fs, D@f]
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from layout import context, mesh as mesh_lib
from layout.precision import precision
from modeling import model, moe
from parallel.sharding import entry_axes, gather_weight, spec_axes, without_axis


def table(fsdp_axes, roles=None) -> dict:
  """role -> PartitionSpec: every matrix (or those of `roles`) on its model dim D
  (modeling.model.D_DIM) over `fsdp_axes` (str or tuple); norms and the router bias are left
  out, i.e. replicated."""
  return {role: P(*(None,) * d, fsdp_axes) for role, d in model.D_DIM.items()
          if roles is None or role in roles}


def over(specs: dict, axis: str, roles) -> dict:
  """A role -> PartitionSpec table with each of `roles` also split over `axis` on its model dim D
  (model.D_DIM), beside what `specs` splits (ZeRO-1's storage: ep_x_tp's zero1). A role absent
  from `specs` is otherwise replicated."""
  out = dict(specs)
  for role in roles:
    d, entries = model.D_DIM[role], list(specs.get(role, P()))
    entries += [None] * (d + 1 - len(entries))
    entries[d] = (*entry_axes(entries[d]), axis) if entries[d] is not None else axis
    out[role] = P(*entries)
  return out


def gather_once(cfg, axis: str, grad_axes) -> Callable:
  """Parallelism.params for ZeRO-1: every leaf stored split over `axis` is cast to the compute dtype
  and all-gathered over it once per step, before the forward, typed reduced over
  grad_axes(role) (the axes the step's tokens split it over); its gradient comes back
  reduce-scattered over `axis` and all-reduced over the rest of them, once
  (parallel.sharding.gather_weight). The gathered copy lives through the step; the float32
  master and the optimizer state stay split. Other leaves pass as stored."""
  def params(p):
    def one(w, role):
      spec = jax.typeof(w).sharding.spec
      if axis not in spec_axes(spec):
        return w
      return gather_weight(w, without_axis(spec, axis), grad_axes(role),      # [.., D, ..]
                           **precision(cfg, role))
    return jax.tree.map(one, p, model.param_roles(cfg))
  return params


def check(cfg, mesh, fsdp_axes) -> None:
  mesh_lib.require_divisible("d_model", cfg.d_model, mesh, fsdp_axes)
  for name in (("q_lora_rank", "kv_lora_rank") if cfg.mla else ()):   # MLA's up-projections
    if getattr(cfg, name):
      mesh_lib.require_divisible(name, getattr(cfg, name), mesh, fsdp_axes)


def use(grad_axes, cfg):
  """Parallelism.use: all-gather a D-sharded weight (backward: reduce-scatter over the gathered axes,
  all-reduce over the other grad axes — see parallel.sharding.gather_weight); norms pass. Mixed
  precision: the bf16 cast comes first, the all-gather moves bf16 (layout.precision)."""
  return lambda role, w: (gather_weight(w, P(), grad_axes, **precision(cfg, role))
                          if role in model.D_DIM else w)


def moe_all_local(cfg, x_spec: P, grad_axes, cp_axis: str | None = None):
  """Parallelism.moe for strategies whose MoE needs no token exchange: gather every expert weight
  (FSDP all-gather), then the single-device MoE on each device's own tokens in a full-manual
  shard_map. x_spec: the [B, S, D] residual spec; grad_axes: every mesh axis tokens are split
  over (router stats are psum'd over them); cp_axis: the axis splitting S (capacity rule needs
  the whole sequence's expert ids, gathered over it)."""
  pos_spec = P(*tuple(x_spec)[:2])
  gather_seq = context.sequence_gatherer(cp_axis) if (cp_axis and cfg.capacity_factor > 0) else None

  def moe_fn(p, x, positions):
    # [E, D@f, F] -> [E, D, F] (typed reduced over grad_axes); the bias is already replicated
    full = {k: (v if k == "bias" else gather_weight(v, P(), grad_axes,
                                                    **precision(cfg, model.MOE_ROLES[k])))
            for k, v in p.items()}
    specs = {k: jax.typeof(v).sharding.spec for k, v in full.items()}
    body = lambda p, x, pos: moe.moe_local(p, x, pos, cfg, token_axes=tuple(grad_axes),
                                           gather_sequence=gather_seq,
                                           seq_axes=(cp_axis,) if cp_axis else ())
    return jax.shard_map(body, in_specs=(specs, x_spec, pos_spec),
                         out_specs=(x_spec, P()))(full, x, positions)   # y [B, S, D] @ x_spec
  return moe_fn
