"""`python run.py` / `--compare`: every strategy on one model, measured side by side.

Per strategy: final loss, max |dloss| vs the single-device reference (PASS/FAIL at the parity
tolerance), collectives per device per step from the compiled HLO (count and bytes by kind), the
cost model's prediction (measure/cost.py via the strategy's `cost`) and measured/predicted, the
all-to-all bytes over the routed minimum (`routed_bytes`: how much an EP exchange pads), params
+ optimizer-state bytes per device, XLA's argument/temp bytes, step time (CPU-simulated devices
are marked) and the dropped-assignment fraction. Writes table.json / table.csv / loss.png /
bytes.png with --report_dir. --compile_only skips running (collectives and memory only).
--full_parity holds every gradient and post-step parameter to the reference's too, by
measure/agreement.py's rule (float32; bfloat16: experts chosen by position on both sides), stated
in the header, and records each row's worst gradient / parameter / update error and its leaf.
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
from measure import agreement, cost, hlo
from modeling import model
from modeling.config import ConfigError
import report
from report import KINDS
from runtime import train
import strategies

LOSS_TOL = 1e-5          # |dloss| <= LOSS_TOL * (1 + |loss|) counts as PASS (fp32 parity)
# bf16 without --full_parity: a 1-ulp difference flips top-k choices near ties (tests/parity.py,
# "bf16 parity"), so losses drift apart over steps: measured up to 1.8e-3 relative after 3 steps
# (tiny, top-2, the 9 strategies). That check is losses only and no proof; --full_parity in bf16
# chooses the experts alike on both sides and holds gradients and updates to measure/agreement.py's
# bfloat16 rule.
LOSS_TOL_BF16 = 5e-3


def default_spec(strat, n: int, cfg=None, opts=None) -> str | None:
  """The comparison's mesh when --mesh is not given: the strategy's COMPARE_MESH as written when
  it has n devices, else its first axis scaled to n and then, for a strategy that names a
  GROW_AXIS (capped by the tiny presets: tp's tensor, ep_tp's expert by 2 KV heads), that axis
  doubled, from the first axis, while the model admits it (check(), on an abstract mesh); None
  (all devices on the main axis) without a COMPARE_MESH."""
  if not getattr(strat, "COMPARE_MESH", None):
    return None
  sizes = mesh_lib.parse_mesh_spec(strat.COMPARE_MESH)
  total = int(np.prod(list(sizes.values())))
  first = next(iter(sizes))
  if n != total and n % (total // sizes[first]) == 0:
    sizes[first] = n // (total // sizes[first])
    grow = getattr(strat, "GROW_AXIS", None)
    while grow and cfg is not None and sizes[first] % 2 == 0:
      bigger = {**sizes, first: sizes[first] // 2, grow: sizes.get(grow, 1) * 2}
      try:
        strat.check(cfg, mesh_lib.abstract_mesh({a: bigger.get(a, 1) for a in strat.AXES}), opts)
      except ConfigError:
        break
      sizes = bigger
  return ",".join(f"{k}:{v}" for k, v in sizes.items())


def _mesh_for(strat, spec: str | None, devices, cfg=None, opts=None):
  """--mesh if given, else default_spec, over `devices`."""
  if not strat.AXES:
    return None
  n = len(devices)
  return mesh_lib.for_strategy(strat, spec if spec is not None else
                               default_spec(strat, n, cfg, opts), n, devices)


def _mesh_str(mesh, strat=None, cfg=None) -> str:
  if mesh is None:
    return "1 device"
  out = ",".join(f"{k}:{v}" for k, v in mesh.shape.items() if v > 1) or "1 device"
  if hasattr(strat, "bubble"):                    # pipeline: its idle fraction, from the schedule
    out += f" M={cfg.microbatches} bubble {strat.bubble(cfg, mesh):.2f}"
  return out


def _fallback_meshes(strat, devices):
  """Main axis n, n/2, n/4, ... with the rest on the strategy's first axis, over the n `devices`:
  the largest degree of the strategy's own parallelism that the model admits (e.g. EP <= E)."""
  first, main, n = strat.AXES[0], strat.MAIN_AXIS, len(devices)
  m = n // 2
  while first != main and m >= 1:
    yield mesh_lib.for_strategy(strat, f"{first}:{n // m},{main}:{m}", n, devices)
    m //= 2


# --mesh=search (with --compile_only --hbm_gb): per strategy, the meshes below are ranked without
# compiling, and at most SEARCH_COMPILES of them are compiled.
SEARCH_COMPILES = 3


def candidate_meshes(strat, cfg, devices, opts=None) -> list[dict]:
  """Every split of the n `devices` (power-of-two axis sizes) over the strategy's axes that its
  check() admits -> [{"mesh", "param_opt" (bytes/dev, analytic), "predicted" (cost-model wire
  bytes/dev: what each device sends)}]."""
  axes, out, shapes = strat.AXES, [], model.init_params_shapes(cfg)

  for sizes in mesh_lib.splits(len(devices), len(axes), powers_of_two=True):
    mesh = mesh_lib.make_mesh(dict(zip(axes, sizes)), devices)
    try:
      strat.check(cfg, mesh, opts)
    except ConfigError:
      continue
    mem = cost.param_memory(shapes, strat.param_specs(cfg, mesh, opts), mesh, cfg.optimizer)
    terms = cost.step_terms(strat, cfg, mesh, opts)
    gathered = sum(t.bytes for t in terms if t.kind == "all-gather" and t.phase == "fwd")
    out.append({"mesh": mesh, "param_opt": mem["param_bytes"] + mem["opt_bytes"],
                "predicted": sum(t.wire_bytes for t in terms),      # bytes each device sends
                # + what one layer holds at once for its gathered weights: the weights, their
                # cotangent and its float32 sum before the reduce-scatter (a heuristic)
                "memory_proxy": (mem["param_bytes"] + mem["opt_bytes"]
                                 + 3 * gathered / cfg.n_layers)})
  return out


def search(strat, cfg, hbm_gb: float, compile_only: bool, opts, devices):
  """The mesh search, over the candidate meshes whose params + optimizer state fit hbm_gb:
  first the one the cost model says sends the fewest wire bytes/dev; if XLA's temp bytes push it over,
  then the ones holding the least memory (`memory_proxy`: params + optimizer + 3 x one layer's
  gathered weights) -- until one fits, SEARCH_COMPILES compiles at most; else the one that came
  closest, over `devices`. -> (job, note for the mesh cell)."""
  cands = candidate_meshes(strat, cfg, devices, opts)
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
          opts=None, with_grads: bool = False, init=None, devices=None):
  """-> (row, job or None). Thread-safe: compare compiles several strategies at once. Without
  --mesh, a layout the model does not admit falls back to a smaller main axis (see above);
  mesh_spec "search": the mesh search (`search`). A strategy that fails to build, trace or
  compile becomes its row's error (one line); the other rows still run. devices: the meshes'
  (default jax.devices(); a --target's compile-only devices)."""
  devices = jax.devices() if devices is None else devices
  strat = strategies.of_entry(name)
  opts = strategies.parse_options([name], {})[name] if opts is None else opts   # its own options
  row = {"strategy": name}                   # the entry: "cp", or "cp:kv_exchange=ring"
  try:
    if mesh_spec == "search" and strat.AXES:
      job, note = search(strat, cfg, hbm_gb, compile_only, opts, devices)
      row["mesh"] = f"{_mesh_str(job.mesh, strat, cfg)} ({note})"
      return row, job
    mesh_spec = None if mesh_spec == "search" else mesh_spec
    mesh = _mesh_for(strat, mesh_spec, devices, cfg, opts)
    given = cfg
    stored = lambda m: strategies.stored_config(strat, given, m, opts)   # how its options
    cfg = stored(mesh)                                                    # store the model
    row["mesh"] = _mesh_str(mesh, strat, cfg)
    if mesh is not None:
      try:
        strat.check(cfg, mesh, opts)
      except ConfigError:
        if mesh_spec is not None:
          raise
        for m in _fallback_meshes(strat, devices):
          try:
            cfg = stored(m)
            strat.check(cfg, m, opts)
          except ConfigError:
            continue
          mesh, row["mesh"] = m, _mesh_str(m, strat, cfg)
          break
    layout_note = getattr(strat, "layout_note", None)      # pp: the layer layout it picked
    if layout_note is not None and mesh is not None and (lnote := layout_note(given, mesh, opts)):
      print(f"note: {lnote}", file=sys.stderr)
    if cfg.layer_slots != given.layer_slots:    # stored rows -> the given model's, for parity
      row["layer_rows"] = _rows_as_given(cfg, given)
    if cfg.dense_order is not None:             # the dense rows inside the stack, as theirs
      row["dense_rows"] = list(cfg.dense_order)
    return row, train.build(strat, cfg, mesh, opts, compile_only=compile_only,
                            with_grads=with_grads, init=init)
  except ConfigError as e:
    row["error"] = str(e)
    return row, None
  except Exception as e:                   # noqa: BLE001 -- a trace / compile failure: its row
    row["error"] = f"failed: {type(e).__name__}: {_first_line(e)}"
    return row, None


def _rows_as_given(stored, given) -> list[int]:
  """For each MoE-stack row of the model as given, the row of the stored stack that holds its
  layer (a padding row for a padding row): pp's interleaved storage read back for the
  reference's parity."""
  slots = stored.layer_slots
  where = {d: i for i, d in enumerate(slots) if d >= 0}
  pad = [i for i, d in enumerate(slots) if d < 0]
  return [where[d] if d >= 0 else pad[0] for d in given.layer_slots]


def _first_line(e: Exception) -> str:
  s = str(e).strip()
  return s.splitlines()[0][:200] if s else ""


def measure(row: dict, job, steps: int, compile_only: bool, full_parity: bool = False) -> dict:
  """Fill `row` from the compiled job; run `steps` steps unless compile_only. full_parity: keep
  each step's gradients and post-step params (row["trace"]) for the check against the
  reference."""
  if job is None:
    return row
  strat, cfg, mesh = strategies.of_entry(row["strategy"]), job.cfg, job.mesh
  row["compile_s"] = job.compile_s
  stats = hlo.compiled_stats(job.compiled, mesh, job.hlo)
  row["collectives"] = {k: stats["collectives"][k] for k in KINDS}
  row["wire_bytes"] = sum(v["wire_bytes"] for v in row["collectives"].values())
  if mesh is not None:
    row["collectives_by_axes"] = stats["collectives_by_axes"]
  row["flops"] = stats["flops"]
  row["memory"] = stats["memory"]
  specs = strat.param_specs(cfg, mesh, job.opts) if mesh is not None else None
  row.update(cost.param_memory(model.init_params_shapes(cfg), specs, mesh, cfg.optimizer))
  a2a = stats["collectives"]["all-to-all"]["bytes"]
  if a2a and mesh is not None:            # EP padding: a2a bytes / the routed copies' bytes
    row["a2a_routed"] = a2a / routed_bytes(cfg, mesh.size)
  if mesh is not None:
    terms = cost.step_terms(strat, cfg, mesh, job.opts)
    pred = cost.totals(terms)
    row["predicted"] = {k: pred[k] for k in KINDS}
    row["predicted_wire_bytes"] = sum(t.wire_bytes for t in terms)
    row["terms"] = terms
  if compile_only:
    return row
  losses, times, dropped, trace, per_step = [], [], 0.0, [], []
  reads = {k: row[r] for k, r in (("layers", "layer_rows"), ("dense_layers", "dense_rows"))
           if r in row}
  as_given = lambda t: {**t, **{k: jax.tree.map(lambda a, rows=rows: np.asarray(a)[rows], t[k])
                                for k, rows in reads.items()}}
  for i, params, _, m, dt in train.steps(job, steps):
    losses.append(float(m["loss"]))
    times.append(dt)
    dropped += float(m["dropped"])
    per_step.append(float(m["dropped"]))
    if full_parity:
      trace.append({**{k: m[k] for k in ("loss", "aux_loss", "ce_loss", "grad_norm", "dropped")},
                    "grads": as_given(m["grads"]),
                    "params": as_given(jax.tree.map(lambda a: np.asarray(train.to_host(a)),
                                                    params))})
    if not train.finite(m):
      row["nonfinite_step"], row["parity"] = i, "NON-FINITE"   # stop here, mark the row
      break
  row["losses"], row["dropped_steps"] = losses, per_step      # assignments dropped, per step
  if full_parity:
    row["trace"] = trace                 # the parameters both sides start from: bf16 updates
    row["params0"] = as_given(jax.tree.map(lambda a: np.asarray(train.to_host(a)), job.params))
  row["step_s"] = statistics.median(times[1:] or times)
  row["dropped_frac"] = dropped / (len(losses) * cfg.batch * cfg.seq_len * cfg.top_k
                                * cfg.n_moe_layers)
  return row


def worst_line(r: dict) -> str:
  """--full_parity: a row's largest errors against the reference and their leaves, one line."""
  part = lambda k, what: f"{what} {r[k]:.1e} at {r[k + '_leaf']}"
  out = [part("grad_rel_l2", "grads: rel L2"), part("grad_max_abs", "max |diff|"),
         part("param_max_abs", "params: max |diff|")]
  if "update_rel_l2" in r:
    out.append(part("update_rel_l2", "updates: rel L2"))
  return f"{r['strategy']} worst: " + "; ".join(out)


def routed_bytes(cfg, n_devices: int) -> float:
  """The least an EP exchange can move per device per step: each of its T_loc*K routed copies
  [D] (in the compute dtype) once per direction (dispatch, combine) and pass (fwd, bwd), every
  MoE layer."""
  t_loc = cfg.batch * cfg.seq_len / n_devices
  return 4 * cfg.n_moe_layers * t_loc * cfg.top_k * cfg.d_model * cost.act_bytes(cfg)


def fit(row: dict, hbm_gb: float) -> None:
  """total/dev = params + optimizer state + XLA temp bytes per device (the step's outputs alias
  its donated inputs in a real run; the batch is negligible), and whether it fits hbm_gb GiB."""
  row["total_bytes"] = row["param_bytes"] + row["opt_bytes"] + row["memory"]["temp_bytes"]
  row["fits"] = row["total_bytes"] <= hbm_gb * 2**30


def parity_rule(cfg, full_parity: bool) -> str:
  """What PASS means, in one line (the header; table.json's settings)."""
  if full_parity:
    return agreement.rule(cfg)
  tol = LOSS_TOL_BF16 if cfg.mixed else LOSS_TOL
  return (f"losses within {tol:g} x (1 + |loss|)"
          + ("; bf16 routing may differ near ties, so this is no proof: --full_parity"
             if cfg.mixed else ""))


def settings(cfg, model_name: str, steps: int, compile_only: bool, opts: dict,
             full_parity: bool = False, devices=None) -> dict:
  """What a report was measured under (table.json / table.csv / table.md and the header).
  devices: the runtime.target.Target compiled for (None: this host's): its compiler (whose
  memory_analysis the temp column is), its --target name and topology."""
  if devices is None:
    from runtime import target
    devices = target.host(jax.devices())
  return {"model": model_name, "devices": len(devices.devices), "backend": devices.platform,
          "compiler": devices.compiler, "target": devices.name or None,
          "topology": devices.topology or None,
          "steps": 0 if compile_only else steps, "batch": cfg.batch, "seq_len": cfg.seq_len,
          "layers": cfg.n_layers, "dtype": cfg.dtype, "remat": cfg.remat,
          "microbatches": cfg.microbatches, "capacity_factor": cfg.capacity_factor,
          "seed": cfg.seed, "data": cfg.data or "synthetic",
          "optimizer": cfg.optimizer, "adam_eps": cfg.adam_eps,
          "gmm": cfg.gmm_backend, "options": {n: vars(o) for n, o in opts.items() if vars(o)},
          "parity": ("losses, grads, params" if full_parity else "losses") if not compile_only
                    else None,
          "parity_rule": parity_rule(cfg, full_parity) if not compile_only else None,
          "expert_choice": cfg.expert_choice, "jax": jax.__version__}


def main(cfg, names: list[str], mesh_spec: str | None, steps: int, report_dir: str | None,
         compile_only: bool, model_name: str, hbm_gb: float | None = None,
         opts: dict | None = None, full_parity: bool = False, breakdown: bool = False,
         every_what: bool = False, init=None, devices=None) -> list[dict]:
  """names: the strategies to compare (run.py resolves 'all'); opts: {name: its Options};
  full_parity: hold every gradient and post-step parameter to the reference's, not only the
  losses (measure/agreement.py; in bf16 every row, the reference's too, then runs at
  agreement.parity_config: experts chosen by position); breakdown: print bytes per (kind, axes,
  phase) and per layer, naming every cost term with every_what (--breakdown_all). init: cfg ->
  numpy params, every row's starting point (--init_from), else model.init_params. devices: the
  runtime.target.Target whose devices the meshes are built from (None: this host's)."""
  if devices is None:
    from runtime import target
    devices = target.host(jax.devices())
  wanted, opts = list(names), opts or {}
  if full_parity and not compile_only:
    cfg = agreement.parity_config(cfg)
  if compile_only:                         # nothing to check parity against; the dense oracle is
    wanted = [n for n in wanted if n != "reference"]     # E x the FLOPs of the layer it checks
  elif "reference" not in wanted:
    wanted = ["reference"] + wanted
  simulated = devices.platform == "cpu"
  t_start = time.perf_counter()
  if mesh_spec not in (None, "search"):
    for n in wanted:
      note = mesh_lib.order_note(strategies.of_entry(n), mesh_spec)
      if note:
        print(f"note: {note}", file=sys.stderr)
  # Compile concurrently (XLA compiles outside the GIL), then run one at a time so step times
  # are not disturbed.
  print(f"compiling {len(wanted)} strategies ({'compile only' if compile_only else f'then {steps} steps each'}):",
        file=sys.stderr, flush=True)
  built = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
    futs = {pool.submit(build, n, cfg, mesh_spec if n != "reference" else None, compile_only,
                        hbm_gb, opts.get(n), full_parity, init, devices.devices): n
            for n in wanted}
    for done, fut in enumerate(concurrent.futures.as_completed(futs), 1):
      n = futs[fut]
      built[n] = fut.result()
      row, job = built[n]
      status = f"skipped ({row['error']})" if job is None else f"compiled in {job.compile_s:.1f}s"
      print(f"  [{done}/{len(wanted)}] {n} {status}  ({time.perf_counter() - t_start:.0f}s)",
            file=sys.stderr, flush=True)
  rows = [measure(*built[n], steps, compile_only, full_parity) for n in wanted]
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
      r["parity_checked"] = "losses"
      if full_parity and r is not ref:
        off = (agreement.disagreements_bf16(r["trace"], ref["trace"], r["params0"]) if cfg.mixed
               else agreement.disagreements(r["trace"], ref["trace"]))
        r["parity_checked"] = "losses, grads, params"
        r["parity"] = "PASS" if r["parity"] == "PASS" and not off else "FAIL"
        r["disagreements"] = off[:20]
        r.update(agreement.worst(r["trace"], ref["trace"], r["params0"]))
  info = settings(cfg, model_name, steps, compile_only, opts, full_parity, devices)
  for r in rows:
    r["settings"] = info
  print(report.header(info, simulated))
  print(report.render(rows, compile_only, simulated, hbm_gb))
  line = report.verdict(rows, hbm_gb, cfg, searched=mesh_spec == "search")
  print(line)
  for r in rows:
    if "grad_rel_l2" in r:
      print(worst_line(r))
  for r in rows:
    if r.get("disagreements"):
      print(f"{r['strategy']}: " + "; ".join(r["disagreements"][:5]))
  if breakdown:
    for r in rows:
      if "terms" in r:
        print(report.breakdown(r, cfg.n_layers, every_what=every_what))
  if report_dir:
    report.write_report(rows, report_dir, model_name, info, line, hbm_gb, compile_only, simulated)
    print(f"wrote {report_dir}/table.json, table.csv, table.md" +
          ("" if compile_only else ", loss.png") + ", bytes.png")
  print(f"total {time.perf_counter() - t_start:.1f}s", file=sys.stderr)
  return rows


def outcome(rows: list[dict], compile_only: bool) -> tuple[list[str], list[str]]:
  """Compare mode's exit status, from its rows -> (failures, skipped), each a list of
  `name: reason`. A failure: a row whose parity is not PASS (FAIL, NON-FINITE, or unchecked), a
  row that failed to trace or compile, and no strategy row measured at all. Skipped: a row whose
  strategy refused the model or mesh (its check() error); a failure too unless compile_only (a
  compile-only study reports what compiled)."""
  failures, skipped = [], []
  measured = [r for r in rows if "error" not in r and r["strategy"] != "reference"]
  for r in rows:
    name = r["strategy"]
    if "error" in r:
      (failures if r["error"].startswith("failed:") else skipped).append(f"{name}: {r['error']}")
    elif not compile_only and r.get("parity") != "PASS" and name != "reference":
      why = r.get("parity") or "parity not checked (the reference did not run)"
      if "nonfinite_step" in r:
        why = f"NON-FINITE at step {r['nonfinite_step']}"
      failures.append(f"{name}: {why}" + (f" ({r['parity_checked']})"
                                          if r.get("parity") == "FAIL" else ""))
  if not compile_only:
    failures += skipped
  if not measured:
    failures.append("nothing was compared: no strategy built" + ("" if compile_only
                                                                  else " and ran"))
  return failures, skipped
