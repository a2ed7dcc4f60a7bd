"""The comparison as a person reads it: the table (render) and the report files (write_report:
table.json, table.csv, loss.png, bytes.png). Rows come from compare.py; nothing here measures."""
from __future__ import annotations

import csv
import json
import os

import numpy as np

from runtime import target as target_lib

KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute",
         "ragged-all-to-all")
SHORT = {"all-to-all": "a2a", "all-gather": "ag", "reduce-scatter": "rs", "all-reduce": "ar",
         "collective-permute": "cp", "ragged-all-to-all": "ra2a"}


def fmt_bytes(b, long: bool = False) -> str:
  """Bytes in the largest binary unit that keeps them at 1 or more: "1.3M"; long: two decimals
  and the unit's name, "1.25 MiB" (tables of exact figures)."""
  if b is None:
    return "-"
  for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
    if b >= div:
      return f"{b / div:.2f} {unit}iB" if long else f"{b / div:.1f}{unit}"
  return f"{b:.0f} B" if long else f"{b:.0f}"


def _collective_cell(row) -> str:
  parts = [f"{SHORT[k]}{v['count']}:{fmt_bytes(v['bytes'])}" for k, v in row["collectives"].items()
           if v["count"]]
  return " ".join(parts) or "none"


def _ratio(row) -> str:
  if "predicted" not in row:
    return "-"
  meas = sum(v["bytes"] for v in row["collectives"].values())
  pred = sum(row["predicted"].values())
  if not pred:
    return "1.00" if not meas else "inf"
  return f"{meas / pred:.2f}"


def render(rows: list[dict], compile_only: bool, simulated: bool, hbm_gb: float | None = None) -> str:
  head = ["strategy", "mesh", "final loss", "max dloss", "parity", "collectives/step (count:bytes)",
          "bytes/dev", "wire/dev", "meas/pred", "a2a/routed", "params+opt/dev", "temp/dev",
          "step ms" + ("*" if simulated else ""), "dropped"]
  fits = "fits" if hbm_gb is None else f"fits {hbm_gb:g}G"
  if hbm_gb is not None:
    head[head.index("temp/dev") + 1:head.index("temp/dev") + 1] = ["total/dev", fits]
  if compile_only:
    head = [h for h in head if h not in ("final loss", "max dloss", "parity", "step ms*", "step ms",
                                         "dropped")]
  lines = []
  for r in rows:
    if "error" in r:                    # a skipped row keeps the columns: its reason in one cell
      cells = dict.fromkeys(head, "-")
      cells.update({"strategy": r["strategy"], "mesh": r.get("mesh", "-"),
                    "collectives/step (count:bytes)": f"skipped: {r['error']}"})
      lines.append([cells[h] for h in head])
      continue
    cells = {
        "strategy": r["strategy"], "mesh": r["mesh"],
        "final loss": f"{r['losses'][-1]:.5f}" if r.get("losses") else "-",
        "max dloss": f"{r['max_dloss']:.1e}" if "max_dloss" in r else "-",
        "parity": (f"{r['parity']} ({r['parity_checked']})" if "parity_checked" in r
                   else r.get("parity", "-")),
        "collectives/step (count:bytes)": _collective_cell(r),
        "bytes/dev": fmt_bytes(sum(v["bytes"] for v in r["collectives"].values())),
        "wire/dev": fmt_bytes(r.get("wire_bytes")),
        "meas/pred": _ratio(r),
        "a2a/routed": f"{r['a2a_routed']:.2f}" if "a2a_routed" in r else "-",
        "params+opt/dev": fmt_bytes(r["param_bytes"] + r["opt_bytes"]),
        "temp/dev": fmt_bytes(r["memory"]["temp_bytes"]),
        "total/dev": fmt_bytes(r.get("total_bytes")),
        fits: {True: "yes", False: "NO"}.get(r.get("fits"), "-"),
        "step ms*": f"{1e3 * r['step_s']:.1f}" if "step_s" in r else "-",
        "step ms": f"{1e3 * r['step_s']:.1f}" if "step_s" in r else "-",
        "dropped": f"{r['dropped_frac']:.1%}" if "dropped_frac" in r else "-",
    }
    if "nonfinite_step" in r:           # never print nan as a result
      cells["final loss"] = cells["max dloss"] = "-"
      cells["parity"] = f"NON-FINITE at step {r['nonfinite_step']}"
    lines.append([cells[h] for h in head])
  return markdown_table(head, lines)


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
  """A Markdown table whose columns are padded to their widest cell."""
  widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
            for i, h in enumerate(head)]
  line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
  return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                   + [line(r) for r in rows])


def header(info: dict, simulated: bool) -> str:
  """The line above the table: what was measured, under which settings, in which units."""
  opts = "; ".join(f"{n} {', '.join(f'{k}={v}' for k, v in o.items())}"
                   for n, o in info["options"].items())
  data = f", data {info['data']}" if info.get("data", "synthetic") != "synthetic" else ""
  target = info.get("target")
  where = (f" ({target}, topology {info['topology']}: compiled on this host)" if target else
           " (simulated on this host: times are not hardware times)" if simulated else "")
  # compile only: the temp column is this compiler's memory_analysis()
  memory = (f", memory: {target_lib.memory_label(info['compiler'], target, info['devices'])}"
            if not info["steps"] and info.get("compiler") else "")
  return (f"\n{info['model']}, {info['devices']} {info['backend'].upper()} devices{where}, "
          f"{'compile only' if not info['steps'] else str(info['steps']) + ' steps'}{memory}, "
          f"global batch {info['batch']} x seq {info['seq_len']}, {info['layers']} layers, "
          f"{info['dtype']}, remat {info['remat']}, microbatches {info['microbatches']}, "
          f"capacity factor {info['capacity_factor'] or 'dropless'}, {info['optimizer']}, "
          f"seed {info['seed']}{data}, gmm {info['gmm']}{', options: ' + opts if opts else ''}, "
          f"jax {info['jax']}. Collectives per device per train step: count:result bytes "
          f"(a2a all-to-all, ag all-gather, rs reduce-scatter, ar all-reduce, cp collective-permute, "
          f"ra2a ragged-all-to-all); bytes/dev = result bytes, wire/dev = bytes each device "
          f"sends; G = GiB = 2^30 B, M = MiB, K = KiB; dropped = the fraction of routed "
          f"(token, expert) assignments the capacity rule dropped; "
          + (f"parity: {info['parity']} against the single-device reference"
             + (f"; {info['parity_rule']}." if info.get("parity_rule") else ".")
             if info["parity"] else "parity: not checked (compile only)."))


def verdict(rows: list[dict], hbm_gb: float | None, cfg, searched: bool = False) -> str:
  """One line beginning `verdict:`: which layouts fit (with --hbm_gb), which sends the fewest
  wire bytes, which holds the least memory; when nothing fits, the closest one's dominant
  memory term and the flags that address it."""
  ok = [r for r in rows if "error" not in r and r["strategy"] != "reference"
        and r.get("parity", "PASS") != "FAIL" and "nonfinite_step" not in r]
  if not ok:
    return "verdict: no strategy built and passed here; see the rows' reasons"
  mem = lambda r: r.get("total_bytes", r["param_bytes"] + r["opt_bytes"] + r["memory"]["temp_bytes"])
  wire, least = min(ok, key=lambda r: r["wire_bytes"]), min(ok, key=mem)
  fewest = (f"fewest wire bytes: {wire['strategy']} on {wire['mesh']} "
            f"({fmt_bytes(wire['wire_bytes'])}/step/device)")
  memory = (f"least memory: {least['strategy']} on {least['mesh']} ({fmt_bytes(mem(least))}/device,"
            f" params + optimizer + XLA temp)")
  if hbm_gb is None:
    return f"verdict: {fewest}; {memory}"
  fits = [r for r in ok if r.get("fits")]
  if fits:
    best = min(fits, key=lambda r: r["wire_bytes"])
    return (f"verdict: fit in {hbm_gb:g} GiB: {', '.join(r['strategy'] for r in fits)}; of those "
            f"{best['strategy']} on {best['mesh']} sends the fewest wire bytes "
            f"({fmt_bytes(best['wire_bytes'])}/step/device); {memory}")
  static, temp = least["param_bytes"] + least["opt_bytes"], least["memory"]["temp_bytes"]
  if static >= temp:
    term = f"params + optimizer state ({fmt_bytes(static)})"
    flags = [] if searched else ["--mesh=search (more devices on the sharding axes)"]
    if cfg.optimizer == "adamw":
      flags.append("--optimizer=muon (one moment for the matrices)")
  else:
    term = f"XLA temp ({fmt_bytes(temp)}: activations, gathered weights, exchange buffers)"
    flags = [f for f, on in (("--remat=block", cfg.remat == "none"),
                             ("--dtype=bfloat16", cfg.dtype == "float32"),
                             ("--microbatches=M", cfg.microbatches == 1),
                             ("--capacity_factor=1.25 (EP buffers sized by the capacity rule)",
                              cfg.capacity_factor == 0),
                             ("--gmm=scan (CPU compile-only: ragged_dot's CPU lowering)",
                              cfg.gmm_backend != "scan"),
                             ("--mesh=search", not searched)) if on]
  return (f"verdict: nothing fits in {hbm_gb:g} GiB; closest: {least['strategy']} on "
          f"{least['mesh']} at {fmt_bytes(mem(least))}, dominated by {term}"
          + (f"; try {', '.join(flags)}" if flags else ""))


def breakdown(row: dict, n_layers: int, every_what: bool = False) -> str:
  """--breakdown: the cost model's terms summed per (kind, axes, phase), with what they move,
  beside the compiled program's bytes per (kind, axes) (the HLO has no phases). per layer: the
  bytes of the terms each layer issues / L; the terms issued once per step or per microbatch
  (measure.cost.per_step: embed / head / norm weights, loss sums, stage sends) are shown apart
  as `+ X/step`, not spread over the layers. every_what: name every term, not the first 3."""
  from measure.cost import per_step
  measured = row.get("collectives_by_axes", {})
  groups: dict = {}
  for t in row["terms"]:
    groups.setdefault((t.kind, frozenset(t.axes)), {}).setdefault(t.phase, []).append(t)
  lines = [f"\n{row['strategy']} on {row['mesh']}: bytes per device per step "
           f"(per layer = the layers' terms / {n_layers} layers, + the once-per-step terms; "
           "wire = bytes sent)",
           "| kind over axes | phase | predicted | per layer | wire | what | measured (HLO) | count |",
           "|---|---|---|---|---|---|---|---|"]
  for key in sorted(set(groups) | set(measured), key=lambda k: (k[0], sorted(k[1]))):
    kind, axes = key
    m = measured.get(key, {})
    label = f"{kind} over ({', '.join(sorted(axes))})"
    phases = groups.get(key, {}) or {"-": []}
    for n, (phase, terms) in enumerate(sorted(phases.items())):
      total = sum(t.bytes for t in terms)
      once = sum(t.bytes for t in terms if per_step(t))
      layers = total - once
      per_layer = " + ".join(([fmt_bytes(layers / n_layers)] if layers or not once else [])
                             + ([f"{fmt_bytes(once)}/step"] if once else []))
      whats = list(dict.fromkeys(t.what for t in terms))
      shown = whats if every_what else whats[:3]
      what = ", ".join(shown) + (f" (+{len(whats) - 3} more: --breakdown_all)"
                                 if len(whats) > len(shown) else "")
      cells = [label if n == 0 else "", phase, fmt_bytes(total), per_layer,
               fmt_bytes(sum(t.wire_bytes for t in terms)), what or "(no term)",
               fmt_bytes(m.get("bytes", 0)) if n == 0 else "", str(m.get("count", 0)) if n == 0 else ""]
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _json_row(r: dict) -> dict:
  """A row as table.json holds it: what is not data (the cost terms, a parity trace) left out."""
  return {k: v for k, v in r.items()
          if k not in ("terms", "trace", "params0", "collectives_by_axes")}


def write_report(rows, report_dir: str, model_name: str, info: dict, verdict_line: str,
                 hbm_gb=None, compile_only: bool = False, simulated: bool = True) -> None:
  """table.json (rows, each with its settings), table.csv, table.md (the header, the table and
  the verdict, as printed), loss.png, bytes.png."""
  os.makedirs(report_dir, exist_ok=True)
  with open(os.path.join(report_dir, "table.json"), "w") as f:
    json.dump([_json_row(r) for r in rows], f, indent=1, default=float)
  with open(os.path.join(report_dir, "table.md"), "w") as f:
    f.write(header(info, simulated).strip() + "\n\n" + render(rows, compile_only, simulated, hbm_gb)
            + "\n\n" + verdict_line + "\n")
  settings_cols = ["model", "devices", "steps", "batch", "seq_len", "layers", "dtype", "remat",
                   "microbatches", "capacity_factor", "seed", "optimizer", "jax", "compiler",
                   "target"]
  fields = ["strategy", "mesh", "final_loss", "max_dloss", "parity", "step_s", "dropped_frac",
            "a2a_routed",
            "param_bytes", "opt_bytes", "temp_bytes", "compile_s", "total_bytes", "fits",
            "wire_bytes", "predicted_wire_bytes", "parity_checked"] + \
           [f"{t}_{m}{leaf}" for t, ms in (("grad", ("max_abs", "rel_l2")),
                                           ("param", ("max_abs", "rel_l2")),
                                           ("update", ("rel_l2",)))
            for m in ms for leaf in ("", "_leaf")] + \
           [f"{k}_{x}" for k in KINDS for x in ("count", "bytes", "predicted", "wire_bytes")] + \
           settings_cols
  with open(os.path.join(report_dir, "table.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      if "error" in r:
        w.writerow({"strategy": r["strategy"], "mesh": r.get("mesh", ""),
                    **{k: info[k] for k in settings_cols}})
        continue
      flat = {k: r.get(k) for k in fields}
      flat.update({k: info[k] for k in settings_cols})
      flat["final_loss"] = r["losses"][-1] if r.get("losses") and "nonfinite_step" not in r else None
      flat["temp_bytes"] = r["memory"]["temp_bytes"]
      for k in KINDS:
        flat[f"{k}_count"] = r["collectives"][k]["count"]
        flat[f"{k}_bytes"] = r["collectives"][k]["bytes"]
        flat[f"{k}_wire_bytes"] = r["collectives"][k]["wire_bytes"]
        flat[f"{k}_predicted"] = r.get("predicted", {}).get(k)
      w.writerow(flat)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator
  ok = [r for r in rows if "error" not in r]
  ran = [r for r in ok if "losses" in r]
  ref = next((r for r in ran if r["strategy"] == "reference"), None)
  if ran:
    fig, axes = plt.subplots(1, 2 if ref else 1, figsize=(11 if ref else 7, 4), squeeze=False)
    ax, dax = axes[0][0], (axes[0][1] if ref else None)
    for i, r in enumerate(ran):
      steps = range(1, len(r["losses"]) + 1)
      ax.plot(steps, r["losses"], marker="o", ms=3, ls=["-", "--", ":", "-."][i % 4],
              label=f"{r['strategy']} ({r['mesh']})")
      if dax is not None and r is not ref:
        n = min(len(r["losses"]), len(ref["losses"]))
        d = np.abs(np.array(r["losses"][:n]) - np.array(ref["losses"][:n]))
        dax.plot(range(1, n + 1), np.maximum(d, 1e-12), marker="o", ms=3,
                 ls=["-", "--", ":", "-."][i % 4], label=r["strategy"])
    ax.set_xlabel("steps done")
    ax.set_ylabel("loss")
    ax.set_title(f"loss, {model_name} (curves overlap when parity holds)", fontsize=9)
    ax.legend(fontsize=7)
    for a in axes[0]:
      a.xaxis.set_major_locator(MaxNLocator(integer=True))
    if dax is not None:
      dax.set_yscale("log")
      dax.set_xlabel("steps done")
      dax.set_ylabel("|loss - reference loss|")
      dax.set_title("distance to the single-device reference", fontsize=9)
      dax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(report_dir, "loss.png"), dpi=120)
    plt.close(fig)
  fig, ax = plt.subplots(figsize=(9, 4))
  bottom = np.zeros(len(ok))
  for k in KINDS:
    vals = np.array([r["collectives"][k]["bytes"] for r in ok], float) / 2**20
    ax.bar([r["strategy"] for r in ok], vals, bottom=bottom, label=k)
    bottom += vals
  ax.set_ylabel("MiB per device per step (result bytes)")
  ax.set_title(f"collective bytes by kind (compiled HLO), {model_name}")
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
  fig.tight_layout()
  fig.savefig(os.path.join(report_dir, "bytes.png"), dpi=120)
  plt.close(fig)


def shardings(job, strat, with_batch: bool = True) -> list[tuple[str, list]]:
  """--dump_sharding: [(kind, [(path, sharding)])] for the parameters, a batch (a run that
  steps) and the strategy's key activations (its optional `activation_shardings` hook)."""
  from parallel.sharding import describe
  out = [("param", describe(job.params))]
  if with_batch:
    out.append(("batch", describe(job.batch(0))))
  if hasattr(strat, "activation_shardings"):
    out.append(("act", list(strat.activation_shardings(job.cfg, job.mesh, job.opts))))
  return out


def hlo_lines(stats: dict) -> str:
  """--hlo_stats: flops, XLA's memory and each collective kind of the compiled step."""
  lines = [f"  flops/device {stats['flops']:.3e}  memory {stats['memory']}"]
  for kind, v in stats["collectives"].items():
    if v["count"]:
      lines.append(f"  {kind:<20s} count {v['count']:>4d}  bytes/device {v['bytes']:>15,d}  "
                   f"wire bytes/device {v['wire_bytes']:>17,.0f}")
  return "\n".join(lines)


def fit_line(cfg, strat, mesh, opts, stats: dict, hbm_gb: float | None) -> str:
  """--compile_only: params + optimizer state (from the param specs) + XLA temp per device, and
  with hbm_gb whether that fits."""
  from measure import cost
  from modeling import model
  mem = cost.param_memory(model.init_params_shapes(cfg), strat.param_specs(cfg, mesh, opts), mesh,
                          cfg.optimizer)
  total = mem["param_bytes"] + mem["opt_bytes"] + stats["memory"]["temp_bytes"]
  fits = "" if hbm_gb is None else (f": fits in {hbm_gb:g} GiB" if total <= hbm_gb * 2**30
                                    else f": does NOT fit in {hbm_gb:g} GiB")
  return (f"  per device: params+opt {fmt_bytes(mem['param_bytes'] + mem['opt_bytes'])}, "
          f"XLA temp {fmt_bytes(stats['memory']['temp_bytes'])}, total {fmt_bytes(total)}{fits} "
          "(G = GiB = 2^30 B)")
