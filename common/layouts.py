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


def fsdp_use(grad_axes):
  """Layout.use: all-gather a D-sharded weight (backward: reduce-scatter over the gathered axes,
  all-reduce over the other grad axes — see common.sharding.gather_weight); norms pass."""
  return lambda role, w: gather_weight(w, P(), grad_axes) if role in model.D_DIM else w


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
    full = {k: (v if k == "bias" else gather_weight(v, P(), grad_axes)) for k, v in p.items()}
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




def stats_cost(cfg, mesh, token_axes) -> list[cost_lib.Term]:
  """Router statistics (counts, prob sums [E] + z, dropped per layer) and the loss sums,
  all-reduced over the token axes."""
  n = mesh_lib.axis_size(mesh, *_axes(token_axes))
  if n == 1:
    return []
  per_layer = (2 * cfg.n_experts + 2) * cost_lib.F32
  return [cost_lib.Term("all-reduce", "fwd", "router stats + loss sums",
                        cfg.n_layers * per_layer + cost_lib.F32, n)]


def fsdp_cost(cfg, mesh, fsdp_axes, grad_axes) -> list[cost_lib.Term]:
  """FSDP weight traffic of fsdp_table + gather_weight, per device per step:
  all-gather of every matrix (fwd; the bwd reuses it), reduce-scatter of its gradient over
  fsdp_axes, an all-reduce of the scattered (1/f) gradient over the other grad axes
  (gather_weight scatters first), norm-scale gradients and statistics all-reduced over all grad axes,
  and one grad-norm partial sum per sharded leaf."""
  fsdp_axes, grad_axes = _axes(fsdp_axes), _axes(grad_axes)
  f = mesh_lib.axis_size(mesh, *fsdp_axes)
  rest = tuple(a for a in grad_axes if a not in fsdp_axes)
  r, n = mesh_lib.axis_size(mesh, *rest), mesh_lib.axis_size(mesh, *grad_axes)
  leaves = model.param_leaves(cfg)
  mats = [cost_lib.nbytes(l.shape) for l in leaves if l.role in model.D_DIM]
  norms = sum(cost_lib.nbytes(l.shape) for l in leaves if l.role in model.NORMS)
  terms = []
  if f > 1:
    terms += [cost_lib.Term("all-gather", "fwd", f"weights over {fsdp_axes}", sum(mats), f),
              cost_lib.Term("reduce-scatter", "bwd", f"weight grads over {fsdp_axes}",
                            sum(mats) / f, f),
              cost_lib.Term("all-reduce", "opt", "grad-norm partial sums", 4 * len(mats), f)]
  if r > 1:
    terms.append(cost_lib.Term("all-reduce", "bwd", f"scattered weight grads over {rest}",
                               sum(mats) / f, r))
  if n > 1:
    terms.append(cost_lib.Term("all-reduce", "bwd", "norm-scale grads", norms, n))
  return terms + stats_cost(cfg, mesh, grad_axes)


def cp_kv_cost(cfg, mesh, cp_axis: str, batch_axes) -> list[cost_lib.Term]:
  """K and V all-gathered over cp_axis per layer (fwd), their gradients reduce-scattered over it
  (bwd, model._gather_kv), kv_pos gathered once, and with the capacity rule the sequence's
  expert ids per layer and its positions once (CSE'd across layers)."""
  cp = mesh_lib.axis_size(mesh, cp_axis)
  if cp == 1:
    return []
  b = cfg.batch // mesh_lib.axis_size(mesh, *_axes(batch_axes))
  kv = b * cfg.seq_len * cfg.n_kv_heads * cfg.head_dim * cost_lib.F32     # one of K, V
  terms = [cost_lib.Term("all-gather", "fwd", f"K/V over {cp_axis}", 2 * cfg.n_layers * kv, cp),
           cost_lib.Term("all-gather", "fwd", f"kv_pos over {cp_axis}", b * cfg.seq_len * 4, cp),
           cost_lib.Term("reduce-scatter", "bwd", f"dK/dV over {cp_axis}",
                         2 * cfg.n_layers * kv // cp, cp)]
  if mesh_lib.axis_size(mesh, *_axes(batch_axes)) > 1:     # XLA splits the norm-grad reduction
    norms = (2 * cfg.n_layers + 1) * cfg.d_model * cost_lib.F32
    terms.append(cost_lib.Term("all-reduce", "bwd", f"norm-scale grads over {cp_axis}", norms, cp))
  if cfg.capacity_factor > 0:
    terms.append(cost_lib.Term("all-gather", "fwd", "expert ids per layer + positions (capacity)",
                               (cfg.n_layers * cfg.top_k + 1) * b * cfg.seq_len * 4, cp))
  return terms


# ----------------------------------------------------------------------------- HLO contract
_CONTRACT = re.compile(r"^\s*(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
                       r"\s+over\s+\(?([\w, ]+?)\)?\s*:", re.M)


def declared_collectives(doc: str, mesh) -> set:
  """{(kind, frozenset(axes))} from a docstring's 'HLO contract' lines
  ('  all-gather over (data, fsdp): why'), size-1 axes dropped (no data moves over them)."""
  block = doc.split("HLO contract", 1)[1]
  out = set()
  for kind, axes in _CONTRACT.findall(block):
    live = frozenset(a.strip() for a in axes.split(",") if mesh.shape.get(a.strip(), 1) > 1)
    if live:
      out.add((kind, live))
  return out
