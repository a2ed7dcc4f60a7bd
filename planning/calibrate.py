"""Fit planning.plan.TEMP_COEFS, one temp model per compiler: compile CASES (compile only, 8
devices, bf16), read XLA's temp bytes, and solve temp = features . coef by non-negative least
squares, each case weighted by 1 / its temp (relative errors).

  python -m planning.calibrate            # XLA:CPU (8 simulated devices, --gmm=scan): prints
                                          # the coefficients and each case's error
  python -m planning.calibrate --save=F   # also writes each case's temp bytes to F (JSON), after
      # each compile; an F that exists resumes: its cases are not compiled again
  python -m planning.calibrate --with=F1,F2  # fits beside CASES the rows of F1, F2: full-scale
      # candidates that bench/plan_memory.py --save compiled on their own device counts
  python -m planning.calibrate --cases=planning/cpu_cases.json --with=planning/full_scale.json
      # XLA:CPU's fit from the saved temps, nothing compiled (tests/test_plan.py holds it)
  python -m planning.calibrate --target=tpu-v5p --save=planning/tpu_v5p_cases.json \
      --with=planning/tpu_v5p_scale.json
      # XLA:TPU: CASES compiled for 8 v5p chips (libtpu, runtime/target.py), ragged_dot as the
      # TPU runs it
  python -m planning.calibrate --target=tpu-v5p --cases=planning/tpu_v5p_cases.json \
      --with=planning/tpu_v5p_scale.json
      # the same fit from the saved temps, nothing compiled (tests/test_plan.py holds it)
A --with row marked "held_out": true is not fitted: it is printed beside the fitted ones, the
model's error on a compile it has not seen.

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


# XLA:TPU's fit compiles these 18 of the 33 (one compile takes about 2 minutes on this 2-core
# host): every strategy, both remat policies, the capacity rule, accumulation, pp under gpipe and
# 1f1b, both model shapes, F at 3.5 x D and the 8,000 and 64,000 vocabularies.
TPU_CASES = [CASES[i] for i in (0, 1, 2, 3, 4, 5, 6, 9, 10, 13, 15, 16, 19, 22, 23, 26, 28, 32)]


def case_config(case, compiler: str = "XLA:CPU"):
  """A case's Config: XLA:CPU's with --gmm=scan (its ragged_dot is an [E, M, K] buffer no
  accelerator holds), an accelerator's with the default ragged_dot."""
  from modeling.config import get_config
  (preset, over), _, _, remat, m, cf, *_ = case
  gmm = {"gmm_backend": "scan"} if compiler == "XLA:CPU" else {}
  return get_config(preset, **over, dtype="bfloat16", **gmm, remat=remat, microbatches=m,
                    capacity_factor=cf)


def options(case) -> dict:
  return case[6] if len(case) > 6 else {}


def case_features(case, compiler: str = "XLA:CPU") -> tuple[dict, float]:
  """A case's temp features and params + optimizer bytes, on an abstract mesh (no compile)."""
  from layout import mesh as mesh_lib
  from planning import plan
  import strategies
  _, name, spec, *_ = case
  strat = strategies.get(name)
  mesh = mesh_lib.abstract_mesh(mesh_lib.mesh_shape(strat.AXES, strat.MAIN_AXIS, spec, 8, name))
  feats, mem = plan.features(name, case_config(case, compiler), mesh,
                             strat.Options(**options(case)))
  return feats, mem["param_bytes"] + mem["opt_bytes"]


def measure(case, devices=None) -> tuple[dict, float, float]:
  """Compile one case -> (its temp features, XLA's temp bytes, params + optimizer bytes).
  devices: a runtime.target.Target (None: this host's 8 simulated CPU devices)."""
  from layout import mesh as mesh_lib
  from runtime import train
  import strategies
  _, name, spec, *_ = case
  compiler = devices.compiler if devices is not None else "XLA:CPU"
  cfg, strat = case_config(case, compiler), strategies.get(name)
  opts = strat.Options(**options(case))
  mesh = mesh_lib.for_strategy(strat, spec, 8, devices.devices if devices is not None else None)
  job = train.build(strat, cfg, mesh, opts, compile_only=True)
  feats, po = case_features(case, compiler)
  return feats, job.compiled.memory_analysis().temp_size_in_bytes, po


# Held at 1 rather than fitted: under remat block every layer keeps its input, whatever the fit
# says; the calibration models have 4-5 layers, too few for the fit to see it (it set it to 0).
# pp's weights: its stage's copy and gradient sum are both live through the time loop; fitted,
# the small models' stages put it at 0.69, and DeepSeek-V3's 1f1b rows came out 12-16% under.
# zero1's weights gathered once per step (ep_x_tp), which no calibration row has: the feature
# is the bytes its compiled steps' buffer assignments hold for them (planning/plan.py).
# XLA:TPU gathers in bf16, so step_weights is fitted there, to its full-scale zero1 rows. Its
# remat-none terms are held at XLA:CPU's: the activations a layer keeps for its backward are the
# same tensors on both, and the TPU rows hold three small remat-none steps (XLA:TPU refuses the
# full-scale ones, over its HBM), too few to fit four coefficients (fitted, the planner's first
# pick on 64 v5p chips, pp interleaved with remat none, came out at 55.9G of temp where XLA:TPU
# asked for 129.8G).
SAVED_NONE = ("saved_none_res", "saved_none_routed", "saved_none_rows_f", "saved_none_gathered")


def fixed(compiler: str) -> dict:
  """The coefficients a compiler's fit holds rather than fits (above)."""
  from planning import plan
  if compiler == "XLA:TPU":
    return {"saved_block": 1.0, "pp_weights": 1.0,
            **{k: plan.TEMP_COEFS["XLA:CPU"][k] for k in SAVED_NONE}}
  return {"saved_block": 1.0, "pp_weights": 1.0, "step_weights": 1.0}


def fit(rows, fixed: dict) -> dict:
  """rows: [(features, temp)] -> {feature: coefficient}: `fixed` as given, the rest by NNLS on
  relative errors."""
  import numpy as np
  from scipy.optimize import nnls
  keys = [k for k in rows[0][0] if k not in fixed]
  a = np.array([[f[k] / t for k in keys] for f, t in rows])
  b = np.array([1 - sum(v * f[k] for k, v in fixed.items()) / t for f, t in rows])
  coef, _ = nnls(a, b)
  return {k: float(coef[keys.index(k)]) if k in keys else fixed[k] for k in rows[0][0]}


def main() -> None:
  import json
  from planning import plan
  name, compiler, devices = _arg("target"), "XLA:CPU", None
  if name:
    from runtime import target
    target.check(name, 8)
    target.configure(name)
    compiler = target.PROFILES[name].compiler
  else:
    import jax
    jax.config.update("jax_compilation_cache_dir",
                      os.path.expanduser("~/.cache/moe-sharding/jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  if _arg("cases"):
    rows = case_rows(_arg("cases"), compiler)
  else:
    devices = target.devices(name, 8) if name else None
    save, rows, done = _arg("save"), [], []
    if save and os.path.exists(save):      # a save file resumes: its cases are not compiled again
      done = case_rows(save, compiler)
    for case in (TPU_CASES if compiler == "XLA:TPU" else CASES):
      if any(label == _label(case) for *_, label in done):
        rows += [r for r in done if r[3] == _label(case)]
        continue
      feats, temp, po = measure(case, devices)
      rows.append((feats, temp, po, _label(case)))
      print(f"  {_label(case)}: temp {temp / 2**20:.0f} MiB", file=sys.stderr, flush=True)
      if save:                                # after each case: a long run keeps what it has
        with open(save, "w") as f:
          json.dump([{"label": label, "compiler": compiler, "temp": t}
                     for _, t, _, label in rows], f, indent=1)
  held = []
  for path in filter(None, (_arg("with") or "").split(",")):
    rows += full_scale_rows(path, keep=lambda r: not r.get("held_out"), compiler=compiler)
    held += full_scale_rows(path, keep=lambda r: r.get("held_out"), compiler=compiler)
  coef = fit([(f, t) for f, t, _, _ in rows], fixed(compiler))
  print(f'TEMP_COEFS["{compiler}"] = {{'
        + ", ".join(f'"{k}": {v:.3f}' for k, v in coef.items()) + "}")
  for title, group in (("fitted", rows), ("held out (rows marked held_out, not fitted)", held)):
    print(f"{title}: {len(group)}")
    for f, t, po, label in group:
      pred = sum(coef[k] * f.get(k, 0.0) for k in coef)
      print(f"{label:<110}  temp {t / 2**20:8.0f} MiB pred {pred / 2**20:8.0f} "
            f"({pred / t - 1:+.0%})  total {(t + po) / 2**20:8.0f} pred "
            f"{(pred + po) / 2**20:8.0f} ({(pred + po) / (t + po) - 1:+.0%})")
  del plan


def case_rows(path: str, compiler: str) -> list:
  """The CASES' temps `--save` wrote -> [(features, temp, params + optimizer, label)], each
  case's features from the planner's current temp_features; a label CASES lacks, or a file of
  another compiler's temps -> ValueError."""
  import json
  by_label = {_label(c): c for c in CASES}
  out = []
  with open(path) as f:
    for r in json.load(f):
      if r["label"] not in by_label or r["compiler"] != compiler:
        raise ValueError(f"{path}: {r['label']!r} ({r['compiler']}) is not a {compiler} case")
      feats, po = case_features(by_label[r["label"]], compiler)
      out.append((feats, r["temp"], po, r["label"]))
  return out


def full_scale_rows(path: str, keep=None, compiler: str = "XLA:CPU") -> list:
  """The rows bench/plan_memory.py --save wrote (a candidate of a model on N devices, XLA's
  temp bytes) -> [(its features, temp, params + optimizer, label)]: the candidate enumerated
  again (planning.check.find), its features from the planner's current temp_features.
  keep: a predicate on the saved row (a dict); the rows it refuses are not enumerated.
  compiler: the fit's; a row another compiler compiled (XLA:CPU where it names none) ->
  ValueError. A step XLA:TPU refused (`refused_over_hbm`: the HBM it had) is left out: its
  figure is what the compiler asked for when it gave up, not a compiled program's temp."""
  import json
  from modeling.config import get_config
  from planning import check, clusters, plan
  with open(path) as f:
    saved = [r for r in json.load(f) if (keep is None or keep(r))
             and not r.get("refused_over_hbm")]
  for r in saved:
    if r.get("compiler", "XLA:CPU") != compiler:
      raise ValueError(f"{path}: {r['candidate']} was compiled by {r.get('compiler', 'XLA:CPU')},"
                       f" not {compiler}")
  out, enumerated = [], {}
  for r in saved:
    cfg = get_config(r["model"], dtype="bfloat16").replace(batch=r["batch"], **r["over"]).validate()
    name, sizes, *_ = check.parse(r["candidate"])
    key = (cfg, r["devices"], r["cluster"], name, tuple(sorted(sizes.items())))
    if key not in enumerated:                 # the candidate's own mesh, not every split
      cluster = clusters.get(r["cluster"])
      enumerated[key] = plan.enumerate_candidates(cfg, r["devices"], cluster, cluster.hbm_bytes,
                                                  names=(name,), only_mesh=sizes)
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
