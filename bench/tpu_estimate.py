"""XLA:TPU's own time estimate of a step beside the planner's: for each strategy, the planner's
first candidate on `--devices` chips of the TPU cluster compiled for that target on this host,
and printed with the planner's compute and step time, XLA:TPU's estimate counted over the
step's loops (measure/tpu_estimate.py) and its `optimal_seconds` (a loop's body once).

  python bench/tpu_estimate.py --target=tpu-v5p --strategy=ep,fsdp
      [--model=mixtral-8x7b --layers=2 --batch=8 --seq=2048 --devices=8]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modeling.config import ConfigError  # noqa: E402
from runtime import target as target_lib  # noqa: E402


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--target", default="tpu-v5p", help="a TPU profile of runtime/target.py")
  ap.add_argument("--strategy", default="ep,fsdp", help="NAME[,NAME...]")
  ap.add_argument("--model", default="mixtral-8x7b")
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--devices", type=int, default=8)
  args = ap.parse_args(argv)
  try:
    target_lib.check(args.target, args.devices)
    if not args.target.startswith("tpu"):
      raise ConfigError(f"--target={args.target}: XLA:TPU's estimate needs a TPU target")
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  target_lib.configure(args.target)
  from layout import mesh as mesh_lib
  from measure import tpu_estimate
  from modeling.config import get_config
  from planning import clusters, plan
  from runtime import train
  import strategies
  devices = target_lib.devices(args.target, args.devices)
  cluster = clusters.get(args.target)
  cfg = get_config(args.model, dtype="bfloat16", n_layers=args.layers, batch=args.batch,
                   seq_len=args.seq)
  spc = tpu_estimate.seconds_per_cycle(devices.devices[0])
  print(f"{args.model}, {args.layers} layers, {args.batch} x {args.seq}, bf16, {args.devices} "
        f"devices of {args.target} ({devices.compiler}); a cycle = {spc:.3e} s (one "
        "[2048, 8192] @ [8192, 8192] bf16 matmul's optimal_seconds over its cycles)")
  print("| candidate | planner compute s | planner step s | XLA:TPU over the loops s | "
        "optimal_seconds | ops not estimated | compile s |")
  print("|---|---|---|---|---|---|---|")
  for name in args.strategy.split(","):
    cands = [c for c in plan.enumerate_candidates(cfg, args.devices, cluster, cluster.hbm_bytes,
                                                  names=(name,), remats=("block",),
                                                  capacity_factors=(1.25,))
             if not c.error and c.microbatches == 1]
    if not cands:
      print(f"| {name}: no candidate | | | | | | |")
      continue
    c = plan.rank(cands)[0]
    strat = strategies.get(name)
    mesh = mesh_lib.make_mesh(dict(c.sizes), devices.devices)
    t0 = time.perf_counter()
    job = train.build(strat, plan.config_for(c, cfg), mesh, c.opts, compile_only=True)
    took = time.perf_counter() - t0
    cycles, unknown = tpu_estimate.step_cycles(job.hlo)
    print(f"| {c.layout()} | {c.compute_s:.4f} | {c.step_s:.4f} | {cycles * spc:.4f} | "
          f"{tpu_estimate.optimal_seconds(job.compiled):.4f} | {unknown} | {took:.0f} |",
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
