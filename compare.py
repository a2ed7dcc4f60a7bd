"""`python run.py` / `--compare`: every strategy on one model, measured side by side.

Per strategy: final loss, max |dloss| vs the single-device reference (PASS/FAIL at the parity
tolerance), collectives per device per step from the compiled HLO (count and bytes by kind), the
cost model's prediction (measure/cost.py via the strategy's `cost`) and measured/predicted, the
all-to-all bytes over the routed minimum (`routed_bytes`: how much an EP exchange pads), params
+ optimizer-state bytes per device, XLA's argument/temp bytes, step time (CPU-simulated devices
are marked) and the dropped-assignment fraction. Writes table.json / table.csv / loss.png /
bytes.png with --report_dir. --compile_only skips running (collectives and memory only).
"""
from __future__ import annotations

import concurrent.futures
import os
import statistics
import sys
import time

import jax
import numpy as np

from layout import mesh as mesh_lib
from measure import cost, hlo
from modeling import model
from modeling.config import ConfigError
from report import KINDS, render, write_report
from runtime import train
import strategies

LOSS_TOL = 1e-5          # |dloss| <= LOSS_TOL * (1 + |loss|) counts as PASS (fp32 parity)
# bf16: a 1-ulp difference flips top-k choices near ties (tests/parity.py, "bf16 parity"), so
# losses drift apart over steps: measured up to 1.8e-3 relative after 3 steps (tiny, top-2, the 9
# strategies). The table checks losses only; tests/test_precision.py holds gradients and updates.
LOSS_TOL_BF16 = 5e-3


def _mesh_for(strat, spec: str | None, n: int):
  """--mesh if given; else the strategy's COMPARE_MESH (its first axis scaled to n devices);
  else all devices on its main axis."""
  if not strat.AXES:
    return None
  if spec is None and getattr(strat, "COMPARE_MESH", None):
    sizes = mesh_lib.parse_mesh_spec(strat.COMPARE_MESH)
    total = int(np.prod(list(sizes.values())))
    first = next(iter(sizes))
    if n % (total // sizes[first]) == 0:
      sizes[first] = n // (total // sizes[first])
      spec = ",".join(f"{k}:{v}" for k, v in sizes.items())
  return mesh_lib.for_strategy(strat, spec, n)


def _mesh_str(mesh, strat=None, cfg=None) -> str:
  if mesh is None:
    return "1 device"
  out = ",".join(f"{k}:{v}" for k, v in mesh.shape.items() if v > 1) or "1 device"
  if hasattr(strat, "bubble"):                    # pipeline: its idle fraction, from the schedule
    out += f" M={cfg.microbatches} bubble {strat.bubble(cfg, mesh):.2f}"
  return out


def _fallback_meshes(strat, n: int):
  """Main axis n, n/2, n/4, ... with the rest on the strategy's first axis: the largest degree of
  the strategy's own parallelism that the model admits (e.g. EP <= E)."""
  first, main = strat.AXES[0], strat.MAIN_AXIS
  m = n // 2
  while first != main and m >= 1:
    yield mesh_lib.for_strategy(strat, f"{first}:{n // m},{main}:{m}", n)
    m //= 2


# --mesh=search (with --compile_only --hbm_gb): per strategy, the meshes below are ranked without
# compiling, and at most SEARCH_COMPILES of them are compiled.
SEARCH_COMPILES = 3


def candidate_meshes(strat, cfg, n: int, opts=None) -> list[dict]:
  """Every split of n devices (power-of-two axis sizes) over the strategy's axes that its check()
  admits -> [{"mesh", "param_opt" (bytes/dev, analytic), "predicted" (cost-model bytes/dev)}]."""
  axes, out, shapes = strat.AXES, [], model.init_params_shapes(cfg)

  def splits(left: int, k: int):
    if k == 1:
      yield (left,)
      return
    d = 1
    while d <= left:
      if left % d == 0:
        for rest in splits(left // d, k - 1):
          yield (d,) + rest
      d *= 2
  for sizes in splits(n, len(axes)):
    mesh = mesh_lib.make_mesh(dict(zip(axes, sizes)))
    try:
      strat.check(cfg, mesh, opts)
    except ConfigError:
      continue
    mem = cost.param_memory(shapes, strat.param_specs(cfg, mesh), mesh, cfg.optimizer)
    terms = cost.step_terms(strat, cfg, mesh, opts)
    gathered = sum(t.bytes for t in terms if t.kind == "all-gather" and t.phase == "fwd")
    out.append({"mesh": mesh, "param_opt": mem["param_bytes"] + mem["opt_bytes"],
                "predicted": sum(t.bytes for t in terms),
                # + what one layer holds at once for its gathered weights: the weights, their
                # cotangent and its float32 sum before the reduce-scatter (a heuristic)
                "memory_proxy": (mem["param_bytes"] + mem["opt_bytes"]
                                 + 3 * gathered / cfg.n_layers)})
  return out


def search(strat, cfg, hbm_gb: float, compile_only: bool, opts):
  """The mesh search, over the candidate meshes whose params + optimizer state fit hbm_gb:
  first the one the cost model says moves the fewest bytes/dev; if XLA's temp bytes push it over,
  then the ones holding the least memory (`memory_proxy`: params + optimizer + 3 x one layer's
  gathered weights) -- until one fits, SEARCH_COMPILES compiles at most; else the one that came
  closest. -> (job, note for the mesh cell)."""
  cands = candidate_meshes(strat, cfg, jax.device_count(), opts)
  if not cands:
    raise ConfigError("no mesh over its axes admits this model")
  hbm = hbm_gb * 2**30
  fitting = [c for c in cands if c["param_opt"] <= hbm]
  if fitting:
    first = min(fitting, key=lambda c: c["predicted"])
    ranked = [first] + sorted((c for c in fitting if c is not first),
                              key=lambda c: (c["memory_proxy"], c["predicted"]))
  else:
    ranked = sorted(cands, key=lambda c: c["param_opt"])[:1]
  best, tried = None, 0
  for c in ranked[:SEARCH_COMPILES]:
    tried += 1
    job = train.build(strat, cfg, c["mesh"], opts, compile_only=compile_only)
    total = c["param_opt"] + job.compiled.memory_analysis().temp_size_in_bytes
    if best is None or total < best[0]:
      best = (total, job)
    if total <= hbm:
      break
  return best[1], f"compiled {tried} of {len(cands)}"


def build(name: str, cfg, mesh_spec, compile_only: bool, hbm_gb: float | None = None,
          opts=None):
  """-> (row, job or None). Thread-safe: compare compiles several strategies at once. Without
  --mesh, a layout the model does not admit falls back to a smaller main axis (see above);
  mesh_spec "search": the mesh search (`search`). A strategy that fails to build, trace or
  compile becomes its row's error (one line); the other rows still run."""
  strat = strategies.get(name)
  opts = strat.Options() if opts is None else opts
  row = {"strategy": name}
  try:
    if mesh_spec == "search" and strat.AXES:
      job, note = search(strat, cfg, hbm_gb, compile_only, opts)
      row["mesh"] = f"{_mesh_str(job.mesh, strat, cfg)} ({note})"
      return row, job
    mesh_spec = None if mesh_spec == "search" else mesh_spec
    mesh = _mesh_for(strat, mesh_spec, jax.device_count())
    row["mesh"] = _mesh_str(mesh, strat, cfg)
    if mesh is not None:
      try:
        strat.check(cfg, mesh, opts)
      except ConfigError:
        if mesh_spec is not None:
          raise
        for m in _fallback_meshes(strat, jax.device_count()):
          try:
            strat.check(cfg, m, opts)
          except ConfigError:
            continue
          mesh, row["mesh"] = m, _mesh_str(m, strat, cfg)
          break
    return row, train.build(strat, cfg, mesh, opts, compile_only=compile_only)
  except ConfigError as e:
    row["error"] = str(e)
    return row, None
  except Exception as e:                   # noqa: BLE001 -- a trace / compile failure: its row
    row["error"] = f"failed: {type(e).__name__}: {_first_line(e)}"
    return row, None


def _first_line(e: Exception) -> str:
  s = str(e).strip()
  return s.splitlines()[0][:200] if s else ""


def measure(row: dict, job, steps: int, compile_only: bool) -> dict:
  """Fill `row` from the compiled job; run `steps` steps unless compile_only."""
  if job is None:
    return row
  strat, cfg, mesh = strategies.get(row["strategy"]), job.cfg, job.mesh
  row["compile_s"] = job.compile_s
  stats = hlo.compiled_stats(job.compiled, mesh, job.hlo)
  row["collectives"] = {k: stats["collectives"][k] for k in KINDS}
  row["flops"] = stats["flops"]
  row["memory"] = stats["memory"]
  specs = strat.param_specs(cfg, mesh) if mesh is not None else None
  row.update(cost.param_memory(model.init_params_shapes(cfg), specs, mesh, cfg.optimizer))
  a2a = stats["collectives"]["all-to-all"]["bytes"]
  if a2a and mesh is not None:            # EP padding: a2a bytes / the routed copies' bytes
    row["a2a_routed"] = a2a / routed_bytes(cfg, mesh.size)
  if mesh is not None and hasattr(strat, "cost"):
    pred = cost.totals(cost.step_terms(strat, cfg, mesh, job.opts))
    row["predicted"] = {k: pred[k] for k in KINDS}
  if compile_only:
    return row
  losses, times, dropped = [], [], 0.0
  for i, _, _, m, dt in train.steps(job, steps):
    losses.append(float(m["loss"]))
    times.append(dt)
    dropped += float(m["dropped"])
    if not train.finite(m):
      row["nonfinite_step"], row["parity"] = i, "NON-FINITE"   # stop here, mark the row
      break
  row["losses"] = losses
  row["step_s"] = statistics.median(times[1:] or times)
  row["dropped_frac"] = dropped / (len(losses) * cfg.batch * cfg.seq_len * cfg.top_k * cfg.n_layers)
  return row


def routed_bytes(cfg, n_devices: int) -> float:
  """The least an EP exchange can move per device per step: each of its T_loc*K routed copies
  [D] (in the compute dtype) once per direction (dispatch, combine) and pass (fwd, bwd), every
  layer."""
  t_loc = cfg.batch * cfg.seq_len / n_devices
  return 4 * cfg.n_layers * t_loc * cfg.top_k * cfg.d_model * cost.act_bytes(cfg)


def fit(row: dict, hbm_gb: float) -> None:
  """total/dev = params + optimizer state + XLA temp bytes per device (the step's outputs alias
  its donated inputs in a real run; the batch is negligible), and whether it fits hbm_gb GiB."""
  row["total_bytes"] = row["param_bytes"] + row["opt_bytes"] + row["memory"]["temp_bytes"]
  row["fits"] = row["total_bytes"] <= hbm_gb * 2**30


def main(cfg, names: list[str], mesh_spec: str | None, steps: int, report_dir: str | None,
         compile_only: bool, model_name: str, hbm_gb: float | None = None,
         opts: dict | None = None) -> list[dict]:
  """names: the strategies to compare (run.py resolves 'all'); opts: {name: its Options}."""
  wanted, opts = list(names), opts or {}
  if compile_only:                         # nothing to check parity against; the dense oracle is
    wanted = [n for n in wanted if n != "reference"]     # E x the FLOPs of the layer it checks
  elif "reference" not in wanted:
    wanted = ["reference"] + wanted
  simulated = jax.default_backend() == "cpu"
  t_start = time.perf_counter()
  # Compile concurrently (XLA compiles outside the GIL), then run one at a time so step times
  # are not disturbed.
  print(f"compiling {len(wanted)} strategies ({'compile only' if compile_only else f'then {steps} steps each'}):",
        file=sys.stderr, flush=True)
  built = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
    futs = {pool.submit(build, n, cfg, mesh_spec if n != "reference" else None, compile_only,
                        hbm_gb, opts.get(n)): n for n in wanted}
    for done, fut in enumerate(concurrent.futures.as_completed(futs), 1):
      n = futs[fut]
      built[n] = fut.result()
      row, job = built[n]
      status = f"skipped ({row['error']})" if job is None else f"compiled in {job.compile_s:.1f}s"
      print(f"  [{done}/{len(wanted)}] {n} {status}  ({time.perf_counter() - t_start:.0f}s)",
            file=sys.stderr, flush=True)
  rows = [measure(*built[n], steps, compile_only) for n in wanted]
  if hbm_gb is not None:
    for r in rows:
      if "error" not in r:
        fit(r, hbm_gb)
  ref = next((r for r in rows if r["strategy"] == "reference" and "losses" in r), None)
  for r in rows:
    if ref is not None and "losses" in r and "nonfinite_step" not in r \
        and "nonfinite_step" not in ref:
      d = np.abs(np.array(r["losses"]) - np.array(ref["losses"]))
      r["max_dloss"] = float(d.max())
      tol = LOSS_TOL_BF16 if cfg.mixed else LOSS_TOL
      r["parity"] = "PASS" if np.all(d <= tol * (1 + np.abs(ref["losses"]))) else "FAIL"
  print(f"\n{model_name}, {jax.device_count()} {jax.default_backend().upper()} devices"
        f"{' (simulated on this host: times are not hardware times)' if simulated else ''}, "
        f"{'compile only' if compile_only else f'{steps} steps'}, {cfg.dtype}"
        f"{', remat ' + cfg.remat if cfg.remat != 'none' else ''}, global batch {cfg.batch} x "
        f"seq {cfg.seq_len}; bytes are per device per train step "
        f"(a2a all-to-all, ag all-gather, rs reduce-scatter, ar all-reduce, cp collective-permute)")
  print(render(rows, compile_only, simulated, hbm_gb))
  if report_dir:
    write_report(rows, report_dir, model_name)
    print(f"wrote {report_dir}/table.json, table.csv" + ("" if compile_only else ", loss.png") +
          ", bytes.png")
  print(f"total {time.perf_counter() - t_start:.1f}s", file=sys.stderr)
  return rows
