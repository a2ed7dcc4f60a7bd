"""Fit planning.plan.TEMP_COEF: compile CASES (compile only, 8 simulated CPU devices, bf16,
--gmm=scan), read XLA's temp bytes, and solve temp = features . coef by non-negative least
squares, each case weighted by 1 / its temp (relative errors).

  python -m planning.calibrate            # prints the coefficients and each case's error
  python -m planning.calibrate --save=F   # also writes each case's features and bytes to F (JSON)
  python -m planning.calibrate --with=F1,F2  # fits beside CASES the rows of F1, F2: full-scale
      # candidates that bench/plan_memory.py --save compiled on their own device counts

Two small models stand in for the presets' shapes: Mixtral-8x7B's (GQA, 8 experts top-2) and
DeepSeek-V2-Lite's (MLA, 64 experts top-6, shared experts, a dense first layer), narrowed and
shortened so that one compile takes seconds.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIXTRAL = ("mixtral-8x7b", dict(d_model=1024, n_heads=8, n_kv_heads=8, head_dim=128, d_ff=2048,
                                n_layers=4, seq_len=1024, batch=16))
MIXTRAL_V8K = ("mixtral-8x7b", dict(MIXTRAL[1], vocab=8000, d_ff=1024))
V2LITE = ("deepseek-v2-lite", dict(d_model=512, n_heads=8, n_kv_heads=8, d_ff=512, n_layers=5,
                                   dense_d_ff=2048, seq_len=1024, batch=16, vocab=16000))
# Mixtral's expert width to model width (3.5): rows x F against rows x D
MIXTRAL_F35 = ("mixtral-8x7b", dict(MIXTRAL[1], d_ff=3584))
# a vocabulary large against the layers, as DeepSeek-V3's: the head's gathered tables
MIXTRAL_V64K = ("mixtral-8x7b", dict(MIXTRAL[1], vocab=64000, seq_len=512))
# (model, strategy, mesh, remat, microbatches, capacity factor[, the strategy's options])
CASES = [
    (MIXTRAL, "ep", "fsdp:2,expert:4", "block", 1, 0.0),
    (MIXTRAL, "ep", "data:2,expert:4", "none", 1, 0.0),
    (MIXTRAL, "fsdp", "fsdp:8", "block", 1, 0.0),
    (MIXTRAL, "fsdp", "fsdp:8", "none", 1, 0.0),
    (MIXTRAL, "tp", "data:2,tensor:4", "block", 1, 0.0),
    (MIXTRAL, "ep_tp", "data:2,expert:4", "block", 1, 0.0),
    (MIXTRAL, "pp", "stage:2,expert:4", "block", 2, 0.0),
    (MIXTRAL, "pp", "stage:4,expert:2", "none", 4, 0.0),
    (MIXTRAL, "dp", "data:8", "block", 1, 0.0),
    (MIXTRAL, "cp", "fsdp:2,context:4", "block", 1, 0.0),
    (MIXTRAL, "ep", "data:2,expert:4", "block", 1, 1.25),
    (MIXTRAL, "shard_exp_on_fsdp", "fsdp:1,expert:8", "none", 1, 0.0),
    (MIXTRAL, "ep", "expert:8", "block", 1, 0.0),
    (MIXTRAL_V8K, "ep", "expert:8", "block", 1, 0.0),
    (MIXTRAL_V8K, "fsdp", "data:2,fsdp:4", "block", 1, 1.25),
    (V2LITE, "ep", "fsdp:2,expert:4", "block", 1, 0.0),
    (V2LITE, "fsdp", "fsdp:8", "none", 1, 0.0),
    (V2LITE, "shard_exp_on_fsdp", "fsdp:2,expert:4", "block", 1, 0.0),
    (V2LITE, "ep_as_cp", "fsdp:2,expert:4", "block", 1, 0.0),
    (V2LITE, "tp", "data:4,tensor:2", "block", 1, 0.0),
    (V2LITE, "ep", "data:2,expert:4", "block", 1, 1.25),
    (V2LITE, "ep_tp", "data:1,expert:8", "none", 1, 0.0),
    (V2LITE, "pp", "stage:2,data:2,expert:2", "block", 4, 0.0),
    (MIXTRAL, "ep", "fsdp:2,expert:4", "block", 2, 0.0),
    (MIXTRAL, "fsdp", "data:2,fsdp:4", "block", 2, 1.25),
    (V2LITE, "ep", "data:2,expert:4", "block", 2, 1.25),
    (MIXTRAL, "pp", "stage:2,expert:4", "block", 4, 0.0, {"schedule": "1f1b"}),
    (V2LITE, "pp", "stage:2,data:2,expert:2", "block", 4, 0.0, {"schedule": "1f1b"}),
    (MIXTRAL_F35, "ep", "fsdp:2,expert:4", "block", 1, 0.0),
    (MIXTRAL_F35, "ep", "expert:8", "block", 1, 1.25),
    (MIXTRAL_F35, "fsdp", "fsdp:8", "block", 1, 0.0),
    (MIXTRAL_V64K, "shard_exp_on_fsdp", "fsdp:1,expert:8", "block", 1, 1.25),
    (MIXTRAL_V64K, "ep", "fsdp:4,expert:2", "block", 1, 0.0),
]


def case_config(case):
  from modeling.config import get_config
  (preset, over), _, _, remat, m, cf, *_ = case
  return get_config(preset, **over, dtype="bfloat16", gmm_backend="scan", remat=remat,
                    microbatches=m, capacity_factor=cf)


def options(case) -> dict:
  return case[6] if len(case) > 6 else {}


def measure(case) -> tuple[dict, float, float]:
  """Compile one case -> (its temp features, XLA's temp bytes, params + optimizer bytes)."""
  from layout import mesh as mesh_lib
  from planning import plan
  from runtime import train
  import strategies
  _, name, spec, *_ = case
  cfg, strat = case_config(case), strategies.get(name)
  opts = strat.Options(**options(case))
  mesh = mesh_lib.for_strategy(strat, spec)
  job = train.build(strat, cfg, mesh, opts, compile_only=True)
  feats, mem = plan.features(name, cfg, mesh, opts)
  return feats, job.compiled.memory_analysis().temp_size_in_bytes, \
      mem["param_bytes"] + mem["opt_bytes"]


# Held at 1 rather than fitted: under remat block every layer keeps its input, whatever the fit
# says; the calibration models have 4-5 layers, too few for the fit to see it (it set it to 0).
# pp's weights: its stage's copy and gradient sum are both live through the time loop; fitted,
# the small models' stages put it at 0.69, and DeepSeek-V3's 1f1b rows came out 12-16% under.
# zero1's weights gathered once per step (ep_x_tp), which no calibration row has: the feature
# is the bytes its compiled steps' buffer assignments hold for them (planning/plan.py).
FIXED = {"saved_block": 1.0, "pp_weights": 1.0, "step_weights": 1.0}


def fit(rows) -> dict:
  """rows: [(features, temp)] -> {feature: coefficient}: FIXED as given, the rest by NNLS on
  relative errors."""
  import numpy as np
  from scipy.optimize import nnls
  keys = [k for k in rows[0][0] if k not in FIXED]
  a = np.array([[f[k] / t for k in keys] for f, t in rows])
  b = np.array([1 - sum(FIXED[k] * f[k] for k in FIXED) / t for f, t in rows])
  coef, _ = nnls(a, b)
  return {**dict(zip(keys, (float(c) for c in coef))), **FIXED}


def main() -> None:
  import jax
  from planning import plan
  jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/moe-sharding/jax"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  rows = []
  for case in CASES:
    feats, temp, po = measure(case)
    rows.append((feats, temp, po, case))
    print(f"  {case[1]} {case[2]} remat={case[3]} M={case[4]} cf={case[5]} {options(case)}: temp "
          f"{temp / 2**20:.0f} MiB", file=sys.stderr, flush=True)
  import json
  save = _arg("save")
  if save:
    with open(save, "w") as f:
      json.dump([{"case": repr(c), "features": fe, "temp": t, "param_opt": po}
                 for fe, t, po, c in rows], f, indent=1)
  rows = [(f, t, po, _label(c)) for f, t, po, c in rows]
  for path in filter(None, (_arg("with") or "").split(",")):
    rows += full_scale_rows(path)
  coef = fit([(f, t) for f, t, _, _ in rows])
  print("TEMP_COEF = {" + ", ".join(f'"{k}": {v:.3f}' for k, v in coef.items()) + "}")
  for f, t, po, label in rows:
    pred = sum(coef[k] * f.get(k, 0.0) for k in coef)
    print(f"{label:<110}  temp {t / 2**20:8.0f} MiB pred {pred / 2**20:8.0f} "
          f"({pred / t - 1:+.0%})  total {(t + po) / 2**20:8.0f} pred {(pred + po) / 2**20:8.0f} "
          f"({(pred + po) / (t + po) - 1:+.0%})")
  del plan


def full_scale_rows(path: str, keep=None) -> list:
  """The rows bench/plan_memory.py --save wrote (a candidate of a model on N devices, XLA's
  temp bytes) -> [(its features, temp, params + optimizer, label)]: the candidate enumerated
  again (planning.check.find), its features from the planner's current temp_features.
  keep: a predicate on the saved row (a dict); the rows it refuses are not enumerated."""
  import json
  from modeling.config import get_config
  from planning import check, clusters, plan
  with open(path) as f:
    saved = [r for r in json.load(f) if keep is None or keep(r)]
  out, enumerated = [], {}
  for r in saved:
    cfg = get_config(r["model"], dtype="bfloat16").replace(batch=r["batch"], **r["over"]).validate()
    key = (cfg, r["devices"], r["cluster"], check.parse(r["candidate"])[0])
    if key not in enumerated:
      cluster = clusters.get(r["cluster"])
      enumerated[key] = plan.enumerate_candidates(cfg, r["devices"], cluster, cluster.hbm_bytes,
                                                  names=key[3:])
    c = check.find(enumerated[key], r["candidate"])
    over = "".join(f" {k}={v}" for k, v in r["over"].items())
    out.append((plan.candidate_features(c, cfg), r["temp"], c.param_opt,
                f"{r['model']} N={r['devices']} B={r['batch']}{over} {r['candidate']}"))
  return out


def _arg(name: str):
  return next((a.removeprefix(f"--{name}=") for a in sys.argv[1:]
               if a.startswith(f"--{name}=")), None)


def _label(case) -> str:
  over = case[0][1]
  model = f"{case[0][0]} D{over['d_model']} F{over['d_ff']} V{over.get('vocab', 'preset')}"
  name = case[1] + "".join(f" {k}={v}" for k, v in options(case).items())
  return f"{model:<38} {name:<18} {case[2]:<24} remat={case[3]:<5} M={case[4]} cf={case[5]:<4}"


if __name__ == "__main__":
  main()
