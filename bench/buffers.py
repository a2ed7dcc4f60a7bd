"""Why XLA:CPU's memory differs from the hardware's: one strategy's step compiled by XLA:CPU (this
host's simulated devices, `--gmm=scan` as the planner compiles) and by a target's compiler
(`--target`, runtime/target.py), each buffer assignment read by measure/peak.py, the values live
at each compiler's peak grouped by what defines them (the jax op that names the instruction:
its named scope and primitive, forward or backward) and set side by side.

Run from the repo root:
  python bench/buffers.py --target=tpu-v5p --strategy=ep --model=mixtral-8x7b --layers=2 \\
      --devices=64 --mesh=fsdp:8,expert:8 [--top=15]
(bf16, remat block, the model's batch and sequence.) Per compiler: XLA's temp, the peak span
measure/peak.py finds in it; then the groups, largest first by the larger of the two.
"""
import argparse
import collections
import glob
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_META = re.compile(r"^\s+(?:ROOT )?%(\S+) = .*?op_name=\"([^\"]*)\"")


def op_names(dump_dir: str) -> dict[str, str]:
  """{instruction: its op_name metadata} of the dump's largest optimized module."""
  assignment = max(glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt")),
                   key=os.path.getsize)
  with open(assignment.replace("-buffer-assignment.txt", ".txt")) as f:
    return {m.group(1): m.group(2) for m in map(_META.match, f) if m}


def group(op_name: str, instruction: str, shape: str) -> str:
  """A readable group for a value: bwd/fwd, then its op_name's last named scope and primitive
  (`bwd expert_gmm/ragged_dot`, `fwd bsd,dkh->bskh/dot_general`); a value XLA made itself (no
  op_name) by its instruction's kind and element type (`XLA's own: copy f32`)."""
  if not op_name:
    return f"XLA's own: {re.sub(r'[.][0-9.]+$', '', instruction)} {shape.split('[')[0]}"
  side = "bwd" if "transpose(" in op_name else "fwd"
  parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "jvp(", "transpose("))
           and p not in ("while", "body", "eval_jaxpr", "checkpoint", "cond", "branch_0_fun",
                         "branch_1_fun", "rematted_computation")]
  return f"{side} {'/'.join(parts[-2:]) or op_name.rsplit('/', 1)[-1]}"


def compile_dump(strat, cfg, mesh, opts) -> str:
  from runtime import train
  dump = tempfile.mkdtemp(prefix="buffers-")
  train.build(strat, cfg, mesh, opts, compile_only=True, dump_dir=dump)
  return dump


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--target", required=True)
  ap.add_argument("--strategy", default="ep")
  ap.add_argument("--model", default="mixtral-8x7b")
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--devices", type=int, default=64)
  ap.add_argument("--mesh", default="fsdp:8,expert:8")
  ap.add_argument("--top", type=int, default=15)
  a = ap.parse_args(argv)
  from runtime import target as target_lib
  target_lib.check(a.target, a.devices)
  target_lib.configure(a.target)
  import jax
  jax.config.update("jax_num_cpu_devices", a.devices)
  from layout import mesh as mesh_lib
  from measure import peak
  from modeling.config import get_config
  import strategies
  strat = strategies.get(a.strategy)
  cfg = get_config(a.model, n_layers=a.layers, dtype="bfloat16", remat="block")
  opts = strat.Options()
  tgt = target_lib.devices(a.target, a.devices)
  runs = {
      "XLA:CPU": (cfg.replace(gmm_backend="scan"), jax.devices("cpu")),
      tgt.compiler: (cfg, tgt.devices),
  }
  groups, heads = collections.defaultdict(dict), []
  for compiler, (c, devs) in runs.items():
    print(f"compiling for {compiler} ...", file=sys.stderr, flush=True)
    dump = compile_dump(strat, c, mesh_lib.for_strategy(strat, a.mesh, a.devices, devs), opts)
    p, names = peak.peak(dump), op_names(dump)
    heads.append(f"{compiler}: temp {p.temp_bytes / 2**30:.2f} GiB, peak span "
                 f"{p.bytes / 2**30:.2f} GiB at {p.at}")
    for size, shape, name in p.buffers:
      g = groups[group(names.get(name, ""), name, shape)]
      g[compiler] = g.get(compiler, 0) + size
  cols = list(runs)
  print(f"{a.strategy} {a.model} {a.layers} layers on {a.mesh} ({a.devices} devices), bf16, "
        f"remat block; the values live at each compiler's peak, by the jax op defining them")
  for h in heads:
    print("  " + h)
  print("| group | " + " | ".join(f"{c} GiB" for c in cols) + " |")
  print("|---|" + "---|" * len(cols))
  order = sorted(groups, key=lambda g: -max(groups[g].values()))
  for g in order[:a.top]:
    print(f"| {g} | " + " | ".join(f"{groups[g].get(c, 0) / 2**30:.2f}" for c in cols) + " |")
  rest = {c: sum(groups[g].get(c, 0) for g in order[a.top:]) for c in cols}
  print("| the rest | " + " | ".join(f"{rest[c] / 2**30:.2f}" for c in cols) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
