"""`python run.py --plan`: enumerate and rank (planning.plan) under the user's constraints
(planning.constraints), print the table (planning.render), then compile the best few
(planning.check). run.py has checked the flags before this runs."""
from __future__ import annotations

import collections
import math
import os
import sys
import time

from layout import mesh as mesh_lib
from planning import check, clusters, constraints, plan, render
from planning.constraints import Constraints, NoCandidate
import command_line as command
from command_line import UsageError
import strategies


OVERLAP_WORDS = {"none": "no overlap (--plan_overlap=none)",
                 "weights": "weight traffic and point-to-point sends under compute "
                            "(--plan_overlap=weights)",
                 "schedule": "weight traffic, point-to-point sends and 1f1b's all-to-alls under "
                             "compute (--plan_overlap=schedule)"}
ICI_WORDS = {"dimension": "a collective in a slice on one torus dimension's links "
                          "(--plan_ici=dimension)",
             "torus": "a collective in a slice on every torus dimension its group spans "
                      "(--plan_ici=torus)"}
# The step time's error at the planner's default terms against planning/published.py's runs
# (each at its own all-to-all and dtype): `python -m planning.published --overlap=weights`, held
# to that command's summary by tests/test_published.py
HELD = ("step time held to 13 published runs at these defaults: median error 0.105, worst 0.427 "
        "(python -m planning.published --overlap=weights)")
DEFAULTS = (plan.OVERLAP, plan.A2A, plan.GMM, plan.ICI, plan.EFFICIENCY, plan.IMBALANCE)


def latency_words(cluster) -> str:
  """The header's words for each collective's fixed time (planning.plan.latency_s)."""
  if cluster.protocols == clusters.NCCL:
    return "each collective's latency as NCCL's tuning model gives it (planning/clusters.py)"
  return (f"each collective's latency at {cluster.protocols[0].near * 1e6:g} us an ICI hop "
          "(planning/clusters.py)")


def imbalance_words(imbalance: float) -> str:
  """The header's words for --plan_imbalance."""
  if not imbalance:
    return "balanced routing (--plan_imbalance=0)"
  return (f"the busiest device's routed work {1 + imbalance:.2f}x balanced routing's, at most the "
          f"capacity factor (--plan_imbalance={imbalance:g})")
GMM_WORDS = {"flat": "grouped matmuls at that efficiency (--plan_gmm=flat)",
             "rows": f"grouped matmuls at r / (r + {plan.GMM_HALF_ROWS:g}) of it, r rows per "
                     "local expert (--plan_gmm=rows)"}


def main(cfg, model_name: str, n: int, cluster_name: str, hbm_bytes: float | None,
         limits: Constraints, compile_k: int, top: int, efficiency: float,
         report_dir: str | None, setup_devices, find: tuple | None = None,
         batch_source: str = "", overlap: str = plan.OVERLAP,
         a2a: str = plan.A2A, gmm: str = plan.GMM,
         ici: str = plan.ICI, imbalance: float = plan.IMBALANCE) -> list[plan.Candidate]:
  """limits: what the flags hold fixed (Constraints() = the whole grid). setup_devices(n):
  run.py's, called before anything could start JAX's backend when compile_k > 0: the
  runtime.target.Target the compiles use (n simulated devices of this host, or a --target's).
  find: (strategy, {axis: size}): also print where that layout's candidates rank, or why they
  were refused. batch_source: where cfg.batch came from, for the first line. Raises
  NoCandidate, before printing anything, when no candidate is admitted."""
  cluster = clusters.get(cluster_name)
  hbm = cluster.hbm_bytes if hbm_bytes is None else hbm_bytes
  devices = setup_devices(n) if compile_k else None
  t0 = time.perf_counter()
  print(f"planning {model_name} on {n} x {cluster.name} ...", file=sys.stderr, flush=True)
  cands = plan.enumerate_candidates(cfg, n, cluster, hbm, efficiency=efficiency,
                                    overlap=overlap, a2a=a2a, gmm=gmm, ici=ici,
                                    imbalance=imbalance, progress=plan.progress_line,
                                    **limits.kwargs())
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
        f"{hbm / 2**30:.1f} GiB, temp as {cluster.temp_model} holds it; {cfg.dtype}, "
        f"{cfg.optimizer}; compute at {efficiency:.0%} of "
        f"{cluster.peak_flops / 1e12:.1f} TFLOP/s, {OVERLAP_WORDS[overlap]}; {a2a} "
        f"all-to-all across nodes (--plan_a2a); {GMM_WORDS[gmm]}; "
        f"{ICI_WORDS[ici] + '; ' if cluster.torus_dims else ''}"
        f"{latency_words(cluster)}; {imbalance_words(imbalance)}; "
        f"{HELD + '; ' if (overlap, a2a, gmm, ici, efficiency, imbalance) == DEFAULTS else ''}"
        f"{len(cands)} enumerated "
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
          f"{best.memory / 2**30:.1f} GiB per device; dominant: "
          f"{render.dominant(best)}")
  if find is not None:
    print(render.found(cands, ranked, *find))
  if report_dir:
    print(render.png(ranked, hbm, os.path.join(report_dir, "plan.png"),
                     f"{model_name} on {n} x {cluster.name}: {len(ranked)} candidates, {fit} fit"))
  else:
    print("no PNG: give --report_dir to write plan.png")
  if compile_k:
    results, passed = [], []
    pool = check.compilable([c for c in ranked if c.fits] or ranked, cfg, devices, passed)
    for i, c in enumerate(check.distinct(pool, compile_k)):
      print(f"  compiling {i + 1}/{compile_k}: {c.layout()}", file=sys.stderr, flush=True)
      results.append(check.compile_candidate(c, cfg, devices=devices))
    print(f"compiled by {devices.memory_label()}; the temp model is fitted to "
          f"{cluster.temp_model}'s (docs/planner.md)")
    if passed:
      print(f"passed over {len(passed)} candidates {devices.compiler} does not compile (the "
            f"first: {passed[0][0].layout()}: {passed[0][1]})")
    if devices.compiler != cluster.temp_model:
      print(f"note: the ratios below set {devices.compiler}'s temp against {cluster.temp_model}'s "
            f"model; {cluster.name} compiles with its own compiler where this host has it "
            "(TPU: pip install -r requirements-tpu.txt) and --devices is a slice it makes")
    if not results:
      print(f"compiled none: {devices.compiler} compiles none of the {len(passed)} candidates")
      return cands
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


def check_flags(F):
  """--plan's flags, judged before JAX starts. --strategy / --compare, --mesh, --microbatches,
  --remat, --capacity_factor, --opt and --layer_layout restrict what it enumerates (plan()
  checks them against the strategies, planning/constraints.py); a training run's flags are
  errors."""
  for flag in ("coordinator_address", "num_processes", "process_id", "checkpoint_dir",
               "restore", "metrics_file", "steps"):
    if getattr(F, flag) is not None:
      raise UsageError(f"--{flag} does not apply to --plan (it ranks layouts and trains none)")
  if F.compile_only or F.full_parity or F.breakdown or F.breakdown_all or F.hlo_stats:
    raise UsageError("--plan compiles its best candidates itself (--plan_compile); it takes no "
                     "--compile_only, --full_parity, --breakdown(_all) or --hlo_stats")
  cluster = clusters.get(F.cluster)
  if not 2 <= F.devices <= command.MAX_DEVICES:
    raise UsageError(f"--devices={F.devices} must be in [2, {command.MAX_DEVICES}] for --plan")
  if F.devices % cluster.node_size and cluster.node_size % F.devices:
    raise UsageError(f"--devices={F.devices}: whole nodes of {cluster.node_size} "
                     f"({cluster.name}), or part of one")
  command.check_sizes(F, ("batch", "seq", "layers"))
  if F.plan_compile < 0:
    raise UsageError(f"--plan_compile={F.plan_compile} must be >= 0")
  if F.plan_top < 1:
    raise UsageError(f"--plan_top={F.plan_top} must be >= 1")
  if not (math.isfinite(F.plan_efficiency) and 0 < F.plan_efficiency <= 1):
    raise UsageError(f"--plan_efficiency={F.plan_efficiency} must be in (0, 1]")
  if not (math.isfinite(F.plan_imbalance) and F.plan_imbalance >= 0):
    raise UsageError(f"--plan_imbalance={F.plan_imbalance} must be >= 0")
  for flag, choices in (("plan_overlap", plan.OVERLAPS), ("plan_a2a", plan.A2AS),
                        ("plan_ici", plan.ICIS), ("plan_gmm", plan.GMMS)):
    if getattr(F, flag) not in choices:
      raise UsageError(f"--{flag}={getattr(F, flag)}: choose from {' | '.join(choices)}")
  if F.report_dir:
    command.writable_dir("report_dir", F.report_dir)
  return find_flag(F)


def find_flag(F):
  """--plan_find=STRATEGY@MESH -> (strategy, {axis: size}) or None; one-line errors."""
  if F.plan_find is None:
    return None
  name, sep, spec = F.plan_find.partition("@")
  if not sep:
    raise UsageError(f"--plan_find={F.plan_find}: expected STRATEGY@MESH, e.g. ep@fsdp:8,expert:8")
  strat = strategies.get(name)
  sizes = mesh_lib.parse_mesh_spec(spec)
  mesh_lib.mesh_shape(strat.AXES, strat.MAIN_AXIS, spec, math.prod(sizes.values()), name)
  if math.prod(sizes.values()) != F.devices:
    raise UsageError(f"--plan_find={F.plan_find} has {math.prod(sizes.values())} devices, "
                     f"not --devices={F.devices}")
  return name, sizes


def run(F, argv_names: list[str], find) -> None:
  """--plan: the planner (main, above) on the model's config, bf16 unless --dtype, with a
  global batch of max(the preset's, --devices) sequences unless --batch, over the candidates
  its constraint flags leave (planning/constraints.py: a bad one is a one-line error, exit 2;
  constraints that leave no candidate raise NoCandidate: one line, exit 1). With --target the
  compiled candidates are that chip's compiler's (command_line.check_target)."""
  given = {f: getattr(F, f) if F[f].present else None
           for f in ("capacity_factor", "remat", "microbatches")}
  # make_config would hold --microbatches to the preset's batch; the candidates take M from the
  # constraints, each judged by check() on the batch planned here
  m, F.microbatches = F.microbatches, 1
  try:
    cfg = command.make_config(F)
  finally:
    F.microbatches = m
  if not F["dtype"].present:
    cfg = cfg.replace(dtype="bfloat16")
  source = "--batch"
  if F.batch is None:
    preset = cfg.batch                    # the model's own: make_config had no --batch
    cfg = cfg.replace(batch=max(preset, F.devices))
    source = f"max of the preset's {preset} and --devices={F.devices}"
  cfg = cfg.validate()
  chosen = (f"--strategy={F.strategy}" if F.strategy else
            f"--compare={F.compare}" if F.compare and F.compare != "all" else "")
  limits = constraints.build(F.devices, argv_names, command.strategy_names(F) if chosen else [],
                             chosen=chosen, mesh=F.mesh, opt=F.opt,
                             layer_layout=F.layer_layout, **given)
  main(cfg, F.model, F.devices, F.cluster, None if F.hbm_gb is None else F.hbm_gb * 2**30,
       limits, F.plan_compile, F.plan_top, F.plan_efficiency, F.report_dir,
       lambda n: command.setup_devices(n, None, F.compilation_cache, F.target), find,
       batch_source=source, overlap=F.plan_overlap, a2a=F.plan_a2a, gmm=F.plan_gmm,
       imbalance=F.plan_imbalance,
       ici=F.plan_ici)
