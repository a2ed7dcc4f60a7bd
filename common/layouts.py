"""Layout pieces shared by fsdp / cp (and importable by ep_as_cp): FSDP parameter specs, the
all-experts-local MoE shard_map, and the context-parallel (CP) batch order / K/V gather.

Every CP helper takes the CP mesh axis as a parameter (`cp_axis`), so a strategy that plays CP on
another physical axis (ep_as_cp: `expert`) reuses them unchanged.

FSDP dim per weight (the model dim D everywhere). Replicated: the router bias (the step updates
it with global counts) and the norm scales [D] (tiny; JAX rejects an elementwise product of a
sharded activation with a weight typed reduced, which is what gather_weight returns).
  embed [V, D@f]   unembed [D@f, V]   router [D@f, E]
  attn wq [D@f, H, Dh]  wk/wv [D@f, KV, Dh]   attn wo [H, Dh, D@f]
  moe wi_0/wi_1 [E, D@f, F]       moe wo [E, F, D@f]   shared wi_0/wi_1 [D@f, Fs]  shared wo [Fs, D@f]
"""
from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from common import cost as cost_lib
from common import data as data_lib
from common import mesh as mesh_lib
from common import model, moe
from common.config import ConfigError
from common.sharding import gather_weight

def fsdp_table(fsdp_axes) -> dict:
  """role -> PartitionSpec: every matrix on its model dim D (common.model.D_DIM) over
  `fsdp_axes` (str or tuple); norms and the router bias are left out, i.e. replicated."""
  return {role: P(*(None,) * d, fsdp_axes) for role, d in model.D_DIM.items()}


def check_fsdp(cfg, mesh, fsdp_axes) -> None:
  mesh_lib.require_divisible("d_model", cfg.d_model, mesh, fsdp_axes)


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
  stored = set(cost_lib.spec_axes(spec))
  return gather_weight(w, spec, tuple(a for a in _axes(grad_axes) if a not in stored), **kw)


def stored_use(cfg, grad_axes):
  """Layout.use for weights used as stored (dp, tp, ep_tp): cast_stored on every role."""
  return lambda role, w: cast_stored(w, role, cfg, grad_axes)


def moe_stored(p, cfg, grad_axes):
  """A layer's "moe" params used as stored inside a shard_map (dp, tp, ep_tp): each leaf through
  cast_stored -> (params, their in_specs; reduced over grad_axes in bf16)."""
  p = {k: cast_stored(v, model.MOE_ROLES[k], cfg, grad_axes) for k, v in p.items()}
  return p, {k: jax.typeof(v).sharding.spec for k, v in p.items()}


def fsdp_use(grad_axes, cfg):
  """Layout.use: all-gather a D-sharded weight (backward: reduce-scatter over the gathered axes,
  all-reduce over the other grad axes — see common.sharding.gather_weight); norms pass. Mixed
  precision: the bf16 cast comes first, the all-gather moves bf16 (`precision`)."""
  return lambda role, w: (gather_weight(w, P(), grad_axes, **precision(cfg, role))
                          if role in model.D_DIM else w)


def moe_all_local(cfg, x_spec: P, grad_axes, cp_axis: str | None = None):
  """Layout.moe for strategies whose MoE needs no token exchange: gather every expert weight
  (FSDP all-gather), then the single-device MoE on each device's own tokens in a full-manual
  shard_map. x_spec: the [B, S, D] residual spec; grad_axes: every mesh axis tokens are split
  over (router stats are psum'd over them); cp_axis: the axis splitting S (capacity rule needs
  the whole sequence's expert ids, gathered over it)."""
  pos_spec = P(*tuple(x_spec)[:2])
  gather_seq = sequence_gatherer(cp_axis) if (cp_axis and cfg.capacity_factor > 0) else None

  def moe_fn(p, x, positions):
    # [E, D@f, F] -> [E, D, F] (typed reduced over grad_axes); the bias is already replicated
    full = {k: (v if k == "bias" else gather_weight(v, P(), grad_axes,
                                                    **precision(cfg, model.MOE_ROLES[k])))
            for k, v in p.items()}
    specs = {k: jax.typeof(v).sharding.spec for k, v in full.items()}
    body = lambda p, x, pos: moe.moe_local(p, x, pos, cfg, token_axes=tuple(grad_axes),
                                           gather_sequence=gather_seq)
    return jax.shard_map(body, in_specs=(specs, x_spec, pos_spec),
                         out_specs=(x_spec, P()))(full, x, positions)   # y [B, S, D] @ x_spec
  return moe_fn


# ----------------------------------------------------------------------------- context parallelism
def check_cp(cfg, mesh, cp_axis: str) -> None:
  """The load-balanced order cuts S into 2*cp chunks."""
  cp = mesh_lib.axis_size(mesh, cp_axis)
  if cfg.seq_len % (2 * cp):
    raise ConfigError(f"seq_len={cfg.seq_len} is not divisible by 2*{cp_axis}={2 * cp}")


def cp_prepare_batch(b: dict, cfg, mesh, cp_axis: str) -> dict:
  """Reorder the global [B, S] batch so device i of cp_axis holds chunks i and 2cp-1-i
  (tokens, targets and positions alike; the model uses the true positions)."""
  order = data_lib.load_balance_order(cfg.seq_len, mesh_lib.axis_size(mesh, cp_axis))
  return data_lib.reorder_sequence(b, order)


def cp_kv_specs(batch_axes) -> tuple[P, P]:
  """(Layout.kv, Layout.kv_pos): K/V [B, T, KV, Dh] and kv_pos [B, T] whole along T, i.e. an
  all-gather over the CP axis (whichever axis splits S in Layout.x)."""
  return P(batch_axes, None, None, None), P(batch_axes, None)


def sequence_gatherer(cp_axis: str):
  """moe_local's gather_sequence inside a full-manual shard_map: the whole sequence's expert ids
  [b, S, K] and positions [b, S] (int32, all-gathered over cp_axis in device order)."""
  def gather(experts, positions):
    ag = lambda a: jax.lax.all_gather(a, cp_axis, axis=1, tiled=True)
    return ag(experts), ag(positions)
  return gather


def lb_positions(seq_len: int, cp: int) -> np.ndarray:
  """Positions held by each CP rank after load balancing, [cp, S/cp] (for docs and tests)."""
  return data_lib.load_balance_order(seq_len, cp).reshape(cp, -1)


# ----------------------------------------------------------------------------- cost model
def _axes(a) -> tuple[str, ...]:
  return (a,) if isinstance(a, str) else tuple(a)




def fsdp_gathered(grad_axes) -> dict:
  """cost.weight_terms' `gathered` for fsdp_use: every D-sharded role gathered whole, its
  gradient a partial sum over grad_axes."""
  return {role: (P(), _axes(grad_axes)) for role in model.D_DIM}


def cp_terms(cfg, mesh, cp_axis: str, batch_axes) -> list[cost_lib.Term]:
  """K and V all-gathered over cp_axis per layer (fwd), their gradients reduce-scattered over it
  (bwd, model._gather_kv), kv_pos gathered once, and with the capacity rule the sequence's
  expert ids per layer and its positions once (CSE'd across layers)."""
  b = cfg.batch // mesh_lib.axis_size(mesh, *_axes(batch_axes))
  kv = b * cfg.seq_len * cfg.n_kv_heads * cfg.head_dim * cost_lib.act_bytes(cfg)  # K or V
  cp, term = mesh_lib.axis_size(mesh, cp_axis), cost_lib.term
  out = (term(mesh, "all-gather", "fwd", "K/V", 2 * cfg.n_layers * kv, cp_axis, cost_lib.RECOMPUTED)
         + term(mesh, "all-gather", "fwd", "kv_pos", b * cfg.seq_len * 4, cp_axis)
         + term(mesh, "reduce-scatter", "bwd", "dK/dV", 2 * cfg.n_layers * kv / cp, cp_axis))
  if cfg.capacity_factor > 0:
    out += term(mesh, "all-gather", "fwd", "expert ids per layer + positions (capacity)",
                (cfg.n_layers * cfg.top_k + 1) * b * cfg.seq_len * 4, cp_axis)
  return out


def cp_norm_grads(cp_axis: str, batch_axes) -> dict:
  """cost.weight_terms' `grads` for the norm scales under CP: XLA sums their gradient over the
  sequence axis first, then over the batch axes."""
  return {role: ((cp_axis,), _axes(batch_axes)) for role in model.NORMS}


# ----------------------------------------------------------------------------- HLO contract
_CONTRACT = re.compile(r"^\s*(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
                       r"\s+over\s+\(?([\w, ]+?)\)?\s*:", re.M)


def declared_collectives(doc: str, mesh, variant: str | None = None) -> set:
  """{(kind, frozenset(axes))} from a docstring's 'HLO contract' block
  ('  all-gather over (data, fsdp): why'), size-1 axes dropped (no data moves over them).
  A docstring may hold several blocks, one per variant: 'HLO contract' alone is the default,
  'HLO contract, <variant>:' another (the strategy's contract_variant(cfg) names it)."""
  blocks = re.split(r"^HLO contract", doc, flags=re.M)[1:]
  header = lambda b: b.split("\n", 1)[0]
  pick = [b for b in blocks if (variant is None and not header(b).startswith(","))
          or (variant is not None and header(b).startswith(f", {variant}"))]
  assert len(pick) == 1, (variant, [header(b) for b in blocks])
  out = set()
  for kind, axes in _CONTRACT.findall(pick[0]):
    live = frozenset(a.strip() for a in axes.split(",") if mesh.shape.get(a.strip(), 1) > 1)
    if live:
      out.add((kind, live))
  return out
