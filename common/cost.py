"""Analytic cost model: collective bytes and per-device memory from the config and mesh.

Each strategy's `cost(cfg, mesh)` returns a list of `Term`s built from the helpers below; this
module never branches on a strategy name. A Term's `bytes` is the per-device RESULT size of the
collective summed over the whole train step — the same quantity common.hlo reports, so model and
compiled program compare directly:
  all-gather -> gathered size, reduce-scatter -> scattered size, all-reduce -> full size,
  all-to-all -> the local buffer, collective-permute -> the buffer.
`wire_bytes` turns that into bytes a device actually sends (ring algorithms):
  all-gather r(n-1)/n, reduce-scatter r(n-1), all-reduce 2r(n-1)/n, all-to-all r(n-1)/n.

One-line formulas (per device per step, f32 = 4 B, L layers, n = the axis size):
  FSDP all-gather of W           = bytes(W) per use (fwd; the bwd re-gather is CSE'd into the fwd one)
  FSDP grad reduce-scatter of W  = bytes(W)/n
  DP grad all-reduce             = bytes(replicated grads), combined into few ops by XLA
  EP all-to-all (padded)         = 2 (dispatch+combine) x 2 (fwd+bwd) x EP x C x D x 4 per layer
  TP all-reduce                  = 2 x B_loc x S x D x 4 per layer per row-parallel matmul (fwd+bwd)
  CP K/V all-gather              = 2 (K,V) x B_loc x S x KV x Dh x 4 per layer fwd (+ the bwd RS)
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from common import hlo

F32 = 4


@dataclasses.dataclass(frozen=True)
class Term:
  kind: str        # one of hlo.COLLECTIVE_KINDS
  phase: str       # "fwd" | "bwd" | "opt" | "step"
  what: str        # short description, e.g. "attn wq all-gather over fsdp"
  bytes: float     # per-device result bytes summed over the train step
  group: int       # devices in the collective's group

  @property
  def wire_bytes(self) -> float:
    n = max(self.group, 1)
    factor = {"all-gather": (n - 1) / n, "reduce-scatter": n - 1, "all-reduce": 2 * (n - 1) / n,
              "all-to-all": (n - 1) / n, "ragged-all-to-all": (n - 1) / n,
              "collective-permute": 1.0}[self.kind]
    return self.bytes * factor


def totals(terms: list[Term]) -> dict[str, float]:
  out = {k: 0.0 for k in hlo.COLLECTIVE_KINDS}
  for t in terms:
    out[t.kind] += t.bytes
  return out


def versus(terms: list[Term], measured: dict) -> dict[str, dict]:
  """{kind: {predicted, measured, ratio}} for every kind either side has."""
  pred = totals(terms)
  out = {}
  for k in hlo.COLLECTIVE_KINDS:
    p, m = pred[k], measured.get(k, {}).get("bytes", 0)
    if p or m:
      out[k] = {"predicted": p, "measured": m, "ratio": (m / p) if p else float("inf")}
  return out


def nbytes(shape, itemsize: int = F32) -> int:
  return int(math.prod(shape)) * itemsize


def spec_shards(spec, mesh) -> int:
  """How many ways a PartitionSpec splits an array on this mesh."""
  n = 1
  for entry in (spec or ()):
    for a in ((entry,) if isinstance(entry, str) else (entry or ())):
      n *= mesh.shape[a]
  return n


def param_memory(param_shapes, specs, mesh, optimizer: str) -> dict[str, float]:
  """Per-device bytes of params and optimizer state from the param specs (mesh None: one
  device, everything whole).

  AdamW keeps 2 f32 moments per param; Muon keeps 1 momentum for its matrices and AdamW's 2
  moments for the rest (the roles in common.optim.MUON_ROLES)."""
  from common import optim
  flat = jax.tree.leaves(param_shapes, is_leaf=lambda l: hasattr(l, "role"))
  flat_specs = ([None] * len(flat) if mesh is None else
                jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
  params = opt = 0.0
  for leaf, spec in zip(flat, flat_specs):
    b = nbytes(leaf.shape) / (1 if mesh is None else spec_shards(spec, mesh))
    params += b
    if optimizer == "muon" and leaf.role in optim.MUON_ROLES:
      opt += b
    else:
      opt += 2 * b
  return {"param_bytes": params, "opt_bytes": opt}


def leaves_bytes(tree) -> int:
  return int(sum(np.prod(getattr(l, "shape", l)) for l in jax.tree.leaves(tree)) * F32)


def router_stats(cfg, group: int) -> Term:
  """psum of the per-layer router statistics (counts [E], prob sums [E], z, dropped)."""
  return Term("all-reduce", "fwd", "router stats psum", cfg.n_layers * (2 * cfg.n_experts + 2) * F32,
              group)
