"""The planner's predicted memory per device against XLA's, for chosen candidates: each is
enumerated as `python run.py --plan` does (bf16, global batch max(the preset's, N)), then
compiled only (planning.check.compile_candidate) on N simulated devices.

Run from the repo root:
  python bench/plan_memory.py --model=mixtral-8x7b --devices=64 --cluster=h100 \
      pp@stage:4,data:2,expert:8/M=4/block/schedule=1f1b ...
A candidate is STRATEGY@MESH/M=m/REMAT[/option=value...]; capacity factor 1.25.
--layers=L compiles the model L layers deep (what one layer adds, against the full depth);
--vocab=V with a vocabulary of V (what the logits add); --set=FIELD=VALUE (repeatable) any other
config field, e.g. --set=d_ff=7168 (what the expert rows' hidden width adds).
--save=F writes each candidate and XLA's temp bytes to F (JSON), rows that
`python -m planning.calibrate --with=F` fits beside its own (planning/full_scale.json).
--target=NAME compiles them with that chip's compiler (runtime/target.py; --cluster defaults
to the chip's profile), as `run.py --plan --target` does: planning/tpu_v5p_scale.json.
--peak=K prints, under each candidate, the K largest buffers live at XLA's temp peak
(measure/peak.py, from the step's buffer assignment).
--bytes adds a second table: the planner's predicted step time and the compiled program's
bytes per (kind, axes), with the worst predicted-vs-HLO ratio.
"""
import argparse
import os
import sys
import tempfile
import time

ARGS = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ARGS.add_argument("--model", default="mixtral-8x7b")
ARGS.add_argument("--devices", type=int, default=64)
ARGS.add_argument("--cluster", default=None, help="default: the --target's chip, else h100")
ARGS.add_argument("--target", default=None, help="compile with this chip's compiler")
ARGS.add_argument("--bytes", action="store_true")
ARGS.add_argument("--batch", type=int, default=None, help="global batch (default: the planner's)")
ARGS.add_argument("--layers", type=int, default=None,
                  help="the model's depth (default: the preset's), to see what a layer adds")
ARGS.add_argument("--vocab", type=int, default=None,
                  help="the model's vocabulary (default: the preset's), to see what logits add")
ARGS.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                  help="a config field's value (int), e.g. d_ff=7168")
ARGS.add_argument("--save", default=None, help="JSON file for calibrate.py --with")
ARGS.add_argument("--peak", type=int, default=0, help="list the K largest buffers at the peak")
ARGS.add_argument("candidates", nargs="+")
A = ARGS.parse_args()
A.cluster = A.cluster or A.target or "h100"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not A.target:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={A.devices}")

import dataclasses  # noqa: E402

from modeling.config import PRESETS, ConfigError, get_config  # noqa: E402
from measure import peak  # noqa: E402
from planning import check, clusters, plan, render  # noqa: E402
from runtime import target  # noqa: E402

G = 2**30


def config():
  """The model's Config with --batch, --layers, --vocab and --set; ConfigError on bad input."""
  if A.model not in PRESETS:
    raise ConfigError(f"unknown model {A.model!r}; choose from {', '.join(PRESETS)}")
  cfg = get_config(A.model, dtype="bfloat16")
  cfg = cfg.replace(batch=A.batch or max(PRESETS[A.model].batch, A.devices))
  over = {k: v for k, v in (("n_layers", A.layers), ("vocab", A.vocab)) if v}
  fields = {f.name for f in dataclasses.fields(cfg)}
  for kv in A.set:
    k, _, v = kv.partition("=")
    if k not in fields or not v.lstrip("-").isdigit():
      raise ConfigError(f"--set={kv}: want FIELD=INTEGER, FIELD a config field")
    over[k] = int(v)
  return cfg.replace(**over).validate(), over


try:                  # every input checked before the first compile
  cfg, over = config()
  cluster = clusters.get(A.cluster)
  if A.target:
    target.check(A.target, A.devices)
    target.configure(A.target)
  cands = plan.enumerate_candidates(cfg, A.devices, cluster, cluster.hbm_bytes,
                                   names=tuple({check.parse(t)[0] for t in A.candidates}))
  chosen = [(text, check.find(cands, text)) for text in A.candidates]
  for text, c in chosen:
    if c is None:
      raise ConfigError(f"{text} is not among the planner's admitted candidates")
except ConfigError as e:
  print(f"error: {e}", file=sys.stderr)
  sys.exit(2)
devices = target.devices(A.target, A.devices) if A.target else None
compiler = devices.compiler if devices else "XLA:CPU"
checked = []
print("| candidate | params+opt | predicted | compiled | ratio | temp predicted | temp compiled |")
print("|---|---|---|---|---|---|---|")
for text, c in chosen:
  t = time.time()
  with tempfile.TemporaryDirectory() as dump:
    r = check.compile_candidate(c, cfg, dump_dir=dump if A.peak else None, devices=devices)
    top = peak.peak(dump) if A.peak else None
  checked.append((text, r))
  print(f"| {text} | {c.param_opt / G:.1f}G | {c.memory / G:.1f}G | {r.compiled_memory / G:.1f}G "
        f"| {r.memory_ratio:.3f} | {c.temp / G:.1f}G | {r.compiled_temp / G:.1f}G |", flush=True)
  if top is not None:
    print(f"  peak {top.bytes / G:.2f}G of XLA's {top.temp_bytes / G:.2f}G temp, at {top.at}:")
    for size, shape, name in top.buffers[:A.peak]:
      print(f"    {size / 2**20:9.1f} MiB  {shape:<32} {name}")
  print(f"  ({time.time() - t:.0f} s)", file=sys.stderr)

if A.save:
  import json
  with open(A.save, "w") as f:
    json.dump([{"model": A.model, "devices": A.devices, "cluster": A.cluster,
                "batch": cfg.batch, "over": over, "candidate": text, "temp": r.compiled_temp,
                "compiler": compiler, **({"refused_over_hbm": r.refused_over}
                                         if r.refused_over else {})}
               for text, r in checked], f, indent=1)

if A.bytes:
  print("\n| candidate | step s (predicted) | dominant | bytes per device (HLO) | worst HLO/cost - 1 |")
  print("|---|---|---|---|---|")
  for text, r in checked:
    c = r.candidate
    got = ", ".join(f"{k} over {','.join(sorted(a))} {v['measured'] / G:.2f}G"
                    for (k, a), v in r.bytes_by_axes.items() if v["measured"] > 1e6)
    worst = max((abs(v["ratio"] - 1) for v in r.bytes_by_axes.values()), default=float("nan"))
    print(f"| {text} | {c.step_s:.3f} | {render.dominant(c)} "
          f"| {got} | {worst:.3f} |")
