"""`python run.py --plan`: enumerate and rank (planning.plan) under the user's constraints
(planning.constraints), print the table (planning.render), then compile the best few
(planning.check). run.py has checked the flags before this runs."""
from __future__ import annotations

import collections
import os
import sys
import time

from planning import check, clusters, plan, render
from planning.constraints import Constraints, NoCandidate


def main(cfg, model_name: str, n: int, cluster_name: str, hbm_bytes: float | None,
         limits: Constraints, compile_k: int, top: int, efficiency: float,
         report_dir: str | None, setup_devices, find: tuple | None = None,
         batch_source: str = "") -> list[plan.Candidate]:
  """limits: what the flags hold fixed (Constraints() = the whole grid). setup_devices(n):
  run.py's, called before anything could start JAX's backend when compile_k > 0 (the compiles
  need n simulated devices). find: (strategy, {axis: size}): also print where that layout's
  candidates rank, or why they were refused. batch_source: where cfg.batch came from, for the
  first line. Raises NoCandidate, before printing anything, when no candidate is admitted."""
  cluster = clusters.get(cluster_name)
  hbm = cluster.hbm_bytes if hbm_bytes is None else hbm_bytes
  if compile_k:
    setup_devices(n)
  t0 = time.perf_counter()
  print(f"planning {model_name} on {n} x {cluster.name} ...", file=sys.stderr, flush=True)
  cands = plan.enumerate_candidates(cfg, n, cluster, hbm, efficiency=efficiency,
                                    progress=plan.progress_line, **limits.kwargs())
  ranked = plan.rank(cands)
  dt = time.perf_counter() - t0
  if not ranked:
    raise NoCandidate(no_candidate(cands, limits))
  fit = sum(c.fits for c in ranked)
  source = f" ({batch_source})" if batch_source else ""
  print(f"ranked {len(ranked)} candidates ({fit} fit) in {dt:.1f} s; global batch {cfg.batch} x "
        f"{cfg.seq_len} tokens{source}")
  fixed = f"; held fixed: {limits.label()}" if limits.given else ""
  print(f"{model_name}, {n} devices of {cluster.name} ({cluster.doc}); memory per device "
        f"{hbm / 2**30:.1f} GiB; {cfg.dtype}, {cfg.optimizer}; compute at {efficiency:.0%} of "
        f"{cluster.peak_flops / 1e12:.1f} TFLOP/s, no overlap; {len(cands)} enumerated "
        f"(strategy x mesh x M x remat x capacity factor x axes inside a node of "
        f"{cluster.node_size}{fixed}). G = GiB.")
  print(render.table(ranked, top, hbm))
  print(render.refused(cands))
  best = next((c for c in ranked if c.fits), None)
  if best is None:
    c = min(ranked, key=lambda c: c.memory)
    print(f"verdict: nothing fits in {hbm / 2**30:.1f} GiB; the least memory is {c.layout()} at "
          f"{c.memory / 2**30:.1f} GiB (params+opt {c.param_opt / 2**30:.1f} GiB)")
  else:
    print(f"verdict: {best.layout()}: {best.step_s:.3f} s/step predicted, "
          f"{best.tokens_per_s:,.0f} tokens/s per device, MFU {best.mfu:.1%}, "
          f"{best.memory / 2**30:.1f} GiB per device; dominant: {best.dominant}")
  if find is not None:
    print(render.found(cands, ranked, *find))
  if report_dir:
    print(render.png(ranked, hbm, os.path.join(report_dir, "plan.png"),
                     f"{model_name} on {n} x {cluster.name}: {len(ranked)} candidates, {fit} fit"))
  else:
    print("no PNG: give --report_dir to write plan.png")
  if compile_k:
    results = []
    for i, c in enumerate(check.distinct([c for c in ranked if c.fits] or ranked, compile_k)):
      print(f"  compiling {i + 1}/{compile_k}: {c.layout()}", file=sys.stderr, flush=True)
      results.append(check.compile_candidate(c, cfg))
    print(render.checked(results))
    print(render.compiled_verdict(results, hbm))
  return cands


def no_candidate(cands: list[plan.Candidate], limits: Constraints) -> str:
  """The one line of an empty ranking: the constraints in force, what was enumerated under them
  and check()'s most frequent refusal."""
  by = f"left by {limits.label()}" if limits.given else "(no constraint given)"
  if not cands:
    return f"no candidate {by}: nothing to enumerate under them"
  (err, k), = collections.Counter(c.error for c in cands).most_common(1)
  return (f"no candidate {by}: {len(cands)} enumerated, every one refused by check() (the most "
          f"frequent, {k} x: {err})")
