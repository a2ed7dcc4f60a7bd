"""Per-device bytes of ep_tp's two routed-MoE exchanges (ring: AG-RS of
the tokens; folded: ep's all-to-all of the sequence-parallel tokens) and of tensor-parallel
experts (tp), compile only, each (kind, axes) from the compiled HLO beside the cost model. The
columns sum the result bytes of the collectives over the model axis alone (expert; tp: tensor):
the activation exchanges, with the norm-scale gradient sums (KiB); the gradient sums over
(data, model axis) are left out, and "worst" is over every (kind, axes) of the step.

Run from the repo root:  python bench/folded_exchange.py DEVICES MODEL LAYERS MESH [MESH ...]
  e.g. python bench/folded_exchange.py 8 mixtral-8x7b 2 data:2,expert:4 expert:8
A mesh names `expert`; tp runs on the same sizes with `tensor` in its place. The batch is one
sequence per data shard at the preset's seq_len, bf16, dropless (or --capacity_factor=F, any
place among the arguments); bytes are per device per step. --over=key=value,... overrides
the preset's fields (tiny: n_heads=8,n_kv_heads=8, so that its heads split 8 ways).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

CF = [float(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--capacity_factor=")]
OVER = dict(kv.split("=", 1) for a in sys.argv if a.startswith("--over=")
            for kv in a.removeprefix("--over=").split(","))
sys.argv = [a for a in sys.argv if not a.startswith(("--capacity_factor=", "--over="))]
jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

from layout import mesh as mesh_lib  # noqa: E402
from measure import cost, hlo  # noqa: E402
from modeling.config import get_config  # noqa: E402
from report import fmt_bytes  # noqa: E402
from runtime import train  # noqa: E402
import strategies  # noqa: E402


def point(name, opts, cfg, spec):
  strat = strategies.get(name)
  mesh = mesh_lib.for_strategy(strat, spec)
  job = train.build(strat, cfg, mesh, opts, compile_only=True)
  got = hlo.collective_stats_by_axes(job.hlo, job.mesh)
  table = cost.versus(cost.step_terms(strat, job.cfg, job.mesh, job.opts), got, by="axes")
  model_axis = "tensor" if name == "tp" else "expert"
  rows = {k: v for k, v in table.items() if k[1] == frozenset({model_axis})}
  total = lambda key: sum(v[key] for v in rows.values())
  worst = max(abs(v["ratio"] - 1) for v in table.values())
  detail = " ".join(f"{k[0]} {fmt_bytes(v['measured'], long=True)}"
                    for k, v in sorted(rows.items()))
  return total("measured"), total("predicted"), worst, detail


if __name__ == "__main__":
  n, model, layers, specs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
  print("| model | mesh | layout | over the model axis alone: measured (HLO) | predicted | "
        "worst meas/pred - 1, any (kind, axes) | per kind |\n|---|---|---|---|---|---|---|")
  for spec in specs:
    data = mesh_lib.parse_mesh_spec(spec).get("data", 1)
    cfg = get_config(model, n_layers=layers, batch=data, dtype="bfloat16",
                     capacity_factor=CF[-1] if CF else 0.0)
    cfg = cfg.replace(**{k: type(getattr(cfg, k))(v) for k, v in OVER.items()}).validate()
    ep_tp = strategies.get("ep_tp")
    for label, name, opts, s in (
        ("ep_tp ring", "ep_tp", ep_tp.Options(exchange="ring"), spec),
        ("ep_tp folded", "ep_tp", ep_tp.Options(exchange="folded"), spec),
        ("tp", "tp", None, spec.replace("expert", "tensor"))):
      m, p, worst, detail = point(name, opts, cfg, s)
      print(f"| {model} | {s} | {label} | {fmt_bytes(m, long=True)} | {fmt_bytes(p, long=True)} | "
            f"{worst:.3f} | {detail} |", flush=True)
