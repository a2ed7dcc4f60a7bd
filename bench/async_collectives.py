"""Which collectives a target compiler issues asynchronously in a strategy's step, and how much
compute it schedules under each: every strategy's first test row and its TARGET_CASES
(bench/target_contracts.py's rows: ep's ragged exchange) compiled for 8 devices of `--target`
on this host, its scheduled HLO read per collective kind: how many are start/done pairs, the
compute ops (fusions, dots, convolutions, custom calls) the schedule places between a start and
its done, and how many are synchronous.

What it says about --plan_overlap=weights (planning/plan.py): a start/done pair with compute
between is a collective the compiler overlaps with that compute; a synchronous one waits.

  python bench/async_collectives.py --target=h100 --strategy=fsdp,ep
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import target_contracts  # noqa: E402
from modeling.config import ConfigError  # noqa: E402
from runtime import target as target_lib  # noqa: E402

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
         "collective-permute")
COMPUTE = re.compile(r" (fusion|dot|convolution|custom-call)\(")
OP = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = .*? ([a-z-]+)\(")


def schedule(hlo_text: str) -> dict:
  """kind -> {"async": [compute ops between each start and its done], "sync": count}, over
  every computation of the scheduled module (instructions in schedule order)."""
  out = {k: {"async": [], "sync": 0} for k in KINDS}
  open_starts: dict = {}          # start's name -> [kind, compute ops seen since]
  for line in hlo_text.splitlines():
    if line.startswith("}"):
      open_starts.clear()         # a start and its done share a computation
      continue
    m = OP.match(line)
    if not m:
      continue
    name, op = m.groups()
    if op in KINDS:
      out[op]["sync"] += 1
    elif op.endswith("-start") and op[:-len("-start")] in KINDS:
      open_starts[name] = [op[:-len("-start")], 0]
    elif op.endswith("-done") and op[:-len("-done")] in KINDS:
      for started, (kind, n) in list(open_starts.items()):
        if f"%{started})" in line or f"%{started}," in line:
          out[kind]["async"].append(n)
          del open_starts[started]
    elif COMPUTE.search(line):
      for v in open_starts.values():
        v[1] += 1
  return {k: v for k, v in out.items() if v["async"] or v["sync"]}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--target", required=True, help=", ".join(target_lib.PROFILES))
  ap.add_argument("--strategy", default=None, help="NAME[,NAME...]: only these strategies")
  args = ap.parse_args(argv)
  try:
    target_lib.check(args.target, target_contracts.DEVICES)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  target_lib.configure(args.target)
  devices = target_lib.devices(args.target, target_contracts.DEVICES)
  print(f"{devices.compiler} ({args.target}, {devices.topology}): each strategy's first test "
        f"row and target rows, {target_contracts.DEVICES} devices")
  print("| row | collective | asynchronous | compute ops under each: min / median / max "
        "| synchronous |")
  print("|---|---|---|---|---|")
  for name, case, _ in target_contracts.rows(args.strategy, "first"):
    job = target_contracts.compile_row(name, case, devices.devices)[0]
    for kind, v in schedule(job.hlo).items():
      a = v["async"]
      spread = f"{min(a)} / {statistics.median(a):g} / {max(a)}" if a else "-"
      print(f"| {case.label(name)} | {kind} | {len(a)} | {spread} | {v['sync']} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
