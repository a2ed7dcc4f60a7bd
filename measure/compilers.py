"""What the target compilers do to the collectives a strategy's cost model declares, so that its
terms are held to XLA:TPU's and XLA:GPU's programs (`--target`, runtime/target.py) as they are to
XLA:CPU's (tests/test_target_contracts.py, `python bench/target_contracts.py`). The docs'
account, with the measurements: docs/cost-model.md, "On the target's compiler".

Three rewrites separate the compiled program from the model's terms; each keeps what is computed:

  a reduce-scatter as an all-reduce
      XLA:TPU's reduce-scatter-decomposer pass turns a reduce-scatter whose shape or group its
      reduce-scatter kernel (AllReduceScatterFusion) does not take into an all-reduce of the
      whole operand and a slice of it: the group's |A| x the result bytes, as an all-reduce over
      the same axes. Turning the pass off fails the compile ("AllReduceScatterFusion not
      implemented for 2nd-minor compaction"); which groups keep their reduce-scatter depends on
      the slice's torus (a psum_scatter of f32[4096, 1024] over 8 of 16 v5p chips stays one; over
      all 16 it is decomposed). `normal_form` counts every reduce-scatter as that all-reduce, on
      both sides.
  one all-reduce over A+B
      where XLA:CPU's partitioner sums a replicated value's gradient over the axes A and then over
      B (two terms of the model: the norm scales' gradients, the router's statistics), XLA:TPU's
      and XLA:GPU's issue one all-reduce over both: the same bytes once, one term fewer.
      `agreement` finds each such merge: AR(A) and AR(B) short by x bytes and AR(A+B) over by x.
  an all-gather as an all-reduce
      XLA:TPU gathers a small array (ep's ragged exchange's int32 counts) as an all-reduce of
      the zero-padded operand: the same result bytes, over the same axes. `agreement` finds each
      (AG(A) short by x, AR(A) over by x).

A third difference is avoided, not modelled: an f32 program at XLA:TPU's default matmul precision
(bf16 passes) lets XLA move a gradient's conversion across its collective, so an f32 term travels
as bf16; the checks compile f32 programs at "highest" precision (`jax.default_matmul_precision`).
"""
from __future__ import annotations

import itertools
import math

Key = tuple  # (collective kind, frozenset of mesh axes), as measure.hlo.collective_stats_by_axes


def normal_form(by_key: dict[Key, float], mesh) -> dict[Key, float]:
  """{(kind, axes): bytes} with each reduce-scatter counted as the all-reduce XLA:TPU may issue in
  its place: |axes| x its result bytes, over the same axes."""
  out: dict = {}
  for (kind, axes), b in by_key.items():
    if kind == "reduce-scatter":
      kind, b = "all-reduce", b * math.prod(mesh.shape[a] for a in axes)
    out[(kind, axes)] = out.get((kind, axes), 0.0) + b
  return out


def agreement(predicted: dict[Key, float], measured: dict[Key, float], mesh,
              tol: float = 0.01) -> tuple[dict, list, list]:
  """The model's bytes against a target's compiled bytes, both in `normal_form`, per (kind, axes),
  with the merged all-reduces and the all-gathers issued as all-reduces explained. -> ({key:
  (predicted, measured)} that disagree by more than `tol` and nothing explains, [(axes A, axes B,
  bytes merged into one all-reduce over A+B)], [(axes, bytes gathered as an all-reduce)])."""
  pred, got = normal_form(predicted, mesh), normal_form(measured, mesh)
  keys = set(pred) | set(got)
  delta = {k: got.get(k, 0.0) - pred.get(k, 0.0) for k in keys}
  slack = {k: tol * max(pred.get(k, 0.0), got.get(k, 0.0)) for k in keys}
  off = {k for k in keys if abs(delta[k]) > slack[k]}
  merges = []
  unions = [k for k in keys if k[0] == "all-reduce" and delta[k] > 0 and len(k[1]) > 1]
  for union in sorted(unions, key=lambda k: (-len(k[1]), sorted(k[1]))):
    x, axes = delta[union], sorted(union[1])
    for a in (frozenset(c) for r in range(1, len(axes)) for c in itertools.combinations(axes, r)):
      parts = (("all-reduce", a), ("all-reduce", union[1] - a))
      if (any(p in off for p in parts)
          and all(abs(delta.get(p, 0.0) + x) <= tol * x + 1 for p in parts)):
        merges.append((tuple(sorted(a)), tuple(sorted(union[1] - a)), x))
        off -= {union, *parts}
        break
  gathers = []
  for key in sorted((k for k in off if k[0] == "all-gather" and delta[k] < 0), key=str):
    x, reduce = -delta[key], ("all-reduce", key[1])
    if abs(delta.get(reduce, 0.0) - x) <= tol * x + 1:
      gathers.append((tuple(sorted(key[1])), x))
      off -= {key, reduce}
  return {k: (pred.get(k, 0.0), got.get(k, 0.0)) for k in sorted(off, key=str)}, merges, gathers


def said(result: tuple[dict, list, list]) -> str:
  """agreement's result in one line: whether every key agrees in the normal form, what it
  explained."""
  off, merges, gathers = result
  merged = "".join(f"; all-reduces over {'/'.join(a)} and {'/'.join(b)} merged ({x:,.0f} B)"
                   for a, b, x in merges)
  merged += "".join(f"; an all-gather over {'/'.join(a)} as an all-reduce ({x:,.0f} B)"
                    for a, x in gathers)
  if not off:
    return "in measure.compilers' normal form every (kind, axes) agrees" + merged
  keys = ", ".join(f"{k} over {'/'.join(sorted(a)) or '-'}" for k, a in off)
  return f"in measure.compilers' normal form {len(off)} disagree: {keys}" + merged
