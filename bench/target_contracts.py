"""Each strategy's collectives on a target compiler's program: its test rows (TEST_CASES, the
tiny models tests/test_strategies.py holds to XLA:CPU) compiled for 8 devices of `--target` on
this host, each compiled (kind, mesh axes, bytes) held to the docstring's contract and the cost
model, in measure.compilers' normal form (a reduce-scatter counted as the all-reduce XLA:TPU may
issue in its place; one all-reduce over A+B in place of the model's A then B, and an all-gather
issued as an all-reduce, each found and named).

Run from the repo root:
  python bench/target_contracts.py --target=tpu-v5p [--rows=first|all] [--strategy=NAME]
                                   [--json=FILE]      (--strategy=fsdp,cp: those strategies)
Then each strategy's TARGET_CASES, rows XLA:CPU cannot compile (ep's ragged exchange).
Per row: the compile's seconds; the (kind, axes) set against the contract; the reduce-scatters
the compiler kept and those it issued as all-reduces; the merged all-reduces; and any key that
still disagrees (then the exit status is 1).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modeling.config import ConfigError  # noqa: E402
from runtime import target as target_lib  # noqa: E402

DEVICES = 8


def rows(pick: str | None, which: str):
  """(strategy name, row, "first" | "test" | "target"): each strategy's TEST_CASES (the first,
  or all) in the strategy table's order, then its TARGET_CASES (rows XLA:CPU cannot compile)."""
  import strategies
  for name in strategies.NAMES:
    if name == "reference" or (pick and name not in pick.split(",")):
      continue
    strat = strategies.get(name)
    cases = strat.TEST_CASES[:1] if which == "first" else strat.TEST_CASES
    yield from ((name, c, "first" if i == 0 else "test") for i, c in enumerate(cases))
    yield from ((name, c, "target") for c in getattr(strat, "TARGET_CASES", ()))


def compile_row(name: str, case, devices):
  """One row compiled for `devices` (f32 at "highest" matmul precision, measure/compilers.py):
  (job, its config, mesh, options, compile seconds)."""
  import jax
  from layout import mesh as mesh_lib
  from runtime import train
  import strategies
  from tests import parity
  strat = strategies.get(name)
  cfg = parity.parity_config(case.config())
  opts = strat.Options() if case.opts is None else case.opts
  mesh = mesh_lib.for_strategy(strat, case.mesh, DEVICES, devices)
  t0 = time.perf_counter()
  with jax.default_matmul_precision("highest"):
    job = train.build(strat, cfg, mesh, opts, compile_only=True)
  return job, cfg, mesh, opts, time.perf_counter() - t0


def check_row(name: str, case, devices, compiler: str) -> dict:
  """One row compiled for `devices` by `compiler` (runtime.target.Target's), its collectives
  held to the cost model."""
  from measure import compilers, cost, hlo
  from planning import clusters, plan
  import strategies
  from tests import parity
  strat = strategies.get(name)
  job, cfg, mesh, opts, seconds = compile_row(name, case, devices)
  stats = hlo.collective_stats_by_axes(job.hlo, mesh)
  measured = hlo.bytes_by_axes(stats)
  terms = cost.step_terms(strat, cfg, mesh, opts)
  predicted = cost.by_axes(terms)
  calls = plan.term_calls(terms, cfg, name, dict(mesh.shape), opts, clusters.MERGES[compiler])
  declared = parity.declared(name, opts, mesh, cfg.optimizer, cfg)
  off, merges, gathers = compilers.agreement(predicted, measured, mesh)
  said = lambda keys: sorted("/".join(sorted(a)) for _, a in keys)
  rs = {k for k in predicted if k[0] == "reduce-scatter"}
  return {
      "row": case.label(name),
      "compile_s": round(seconds, 1),
      "model_is_contract": set(predicted) == declared,
      "rs_kept": said(rs & set(measured)),
      "rs_as_all_reduce": said(rs - set(measured)),
      "merged": [["/".join(a), "/".join(b), x] for a, b, x in merges],
      "gathered_as_all_reduce": [["/".join(a), x] for a, x in gathers],
      "off": {f"{k[0]} {'/'.join(sorted(k[1]))}": list(v) for k, v in off.items()},
      # the collectives issued per step: the planner's count (merged as this compiler
      # merges, planning.clusters.MERGES) and the program's
      "calls": [sum(calls.values()), sum(v["count"] for v in stats.values())],
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--target", required=True, help=", ".join(target_lib.PROFILES))
  ap.add_argument("--rows", choices=("first", "all"), default="first")
  ap.add_argument("--strategy", default=None, help="NAME[,NAME...]: only these strategies")
  ap.add_argument("--json", default=None, help="also write the rows here, one JSON per line")
  args = ap.parse_args(argv)
  try:
    target_lib.check(args.target, DEVICES)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  target_lib.configure(args.target)
  devices = target_lib.devices(args.target, DEVICES)
  print(f"{devices.compiler} ({args.target}, {devices.topology}): each strategy's test rows, "
        f"f32, {DEVICES} devices")
  print("| row | compile s | model = contract | reduce-scatters kept | as all-reduces | "
        "merged all-reduces (A + B: bytes), all-gathers as all-reduces | disagreeing |")
  print("|---|---|---|---|---|---|---|")
  out, bad = [], 0
  for name, case, kind in rows(args.strategy, args.rows):
    r = dict(check_row(name, case, devices.devices, devices.compiler), kind=kind)
    out.append(r)
    bad += bool(r["off"]) or not r["model_is_contract"]
    merged = ", ".join([f"{a} + {b}: {x:.0f}" for a, b, x in r["merged"]]
                       + [f"all-gather {a} as one: {x:.0f}"
                          for a, x in r["gathered_as_all_reduce"]]) or "-"
    print(f"| {r['row']} | {r['compile_s']} | {'yes' if r['model_is_contract'] else 'NO'} | "
          f"{', '.join(r['rs_kept']) or '-'} | {', '.join(r['rs_as_all_reduce']) or '-'} | "
          f"{merged} | {r['off'] or '-'} |", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in out)
  print(f"{len(out)} rows, {len(out) - bad} agree with the model")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
