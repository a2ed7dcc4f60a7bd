"""The comparison as a person reads it: the table (render) and the report files (write_report:
table.json, table.csv, loss.png, bytes.png). Rows come from compare.py; nothing here measures."""
from __future__ import annotations

import csv
import json
import os

import numpy as np

KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute",
         "ragged-all-to-all")
SHORT = {"all-to-all": "a2a", "all-gather": "ag", "reduce-scatter": "rs", "all-reduce": "ar",
         "collective-permute": "cp", "ragged-all-to-all": "ra2a"}


def _fmt_bytes(b) -> str:
  if b is None:
    return "-"
  for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
    if b >= div:
      return f"{b / div:.1f}{unit}"
  return f"{b:.0f}"


def _collective_cell(row) -> str:
  parts = [f"{SHORT[k]}{v['count']}:{_fmt_bytes(v['bytes'])}" for k, v in row["collectives"].items()
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
          "bytes/dev", "meas/pred", "a2a/routed", "params+opt/dev", "temp/dev", "step ms" + ("*" if simulated else ""),
          "dropped"]
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
        "parity": r.get("parity", "-"),
        "collectives/step (count:bytes)": _collective_cell(r),
        "bytes/dev": _fmt_bytes(sum(v["bytes"] for v in r["collectives"].values())),
        "meas/pred": _ratio(r),
        "a2a/routed": f"{r['a2a_routed']:.2f}" if "a2a_routed" in r else "-",
        "params+opt/dev": _fmt_bytes(r["param_bytes"] + r["opt_bytes"]),
        "temp/dev": _fmt_bytes(r["memory"]["temp_bytes"]),
        "total/dev": _fmt_bytes(r.get("total_bytes")),
        fits: {True: "yes", False: "NO"}.get(r.get("fits"), "-"),
        "step ms*": f"{1e3 * r['step_s']:.1f}" if "step_s" in r else "-",
        "step ms": f"{1e3 * r['step_s']:.1f}" if "step_s" in r else "-",
        "dropped": f"{r['dropped_frac']:.1%}" if "dropped_frac" in r else "-",
    }
    if "nonfinite_step" in r:           # never print nan as a result
      cells["final loss"] = cells["max dloss"] = "-"
      cells["parity"] = f"NON-FINITE at step {r['nonfinite_step']}"
    lines.append([cells[h] for h in head])
  widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h)
            for i, h in enumerate(head)]
  out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
         "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
  out += ["| " + " | ".join(c.ljust(w) for c, w in zip(l, widths)) + " |" for l in lines]
  return "\n".join(out)


def write_report(rows, report_dir: str, model_name: str) -> None:
  os.makedirs(report_dir, exist_ok=True)
  with open(os.path.join(report_dir, "table.json"), "w") as f:
    json.dump(rows, f, indent=1, default=float)
  fields = ["strategy", "mesh", "final_loss", "max_dloss", "parity", "step_s", "dropped_frac",
            "a2a_routed",
            "param_bytes", "opt_bytes", "temp_bytes", "compile_s", "total_bytes", "fits"] + \
           [f"{k}_{x}" for k in KINDS for x in ("count", "bytes", "predicted")]
  with open(os.path.join(report_dir, "table.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      if "error" in r:
        w.writerow({"strategy": r["strategy"], "mesh": r.get("mesh", "")})
        continue
      flat = {k: r.get(k) for k in fields}
      flat["final_loss"] = r["losses"][-1] if r.get("losses") and "nonfinite_step" not in r else None
      flat["temp_bytes"] = r["memory"]["temp_bytes"]
      for k in KINDS:
        flat[f"{k}_count"] = r["collectives"][k]["count"]
        flat[f"{k}_bytes"] = r["collectives"][k]["bytes"]
        flat[f"{k}_predicted"] = r.get("predicted", {}).get(k)
      w.writerow(flat)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ok = [r for r in rows if "error" not in r]
  if any("losses" in r for r in ok):
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(r for r in ok if "losses" in r):
      ax.plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", ms=3,
              ls=["-", "--", ":", "-."][i % 4], label=f"{r['strategy']} ({r['mesh']})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"loss per step, {model_name} (curves overlap when parity holds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(report_dir, "loss.png"), dpi=120)
    plt.close(fig)
  fig, ax = plt.subplots(figsize=(9, 4))
  bottom = np.zeros(len(ok))
  for k in KINDS:
    vals = np.array([r["collectives"][k]["bytes"] for r in ok], float) / 2**20
    ax.bar([r["strategy"] for r in ok], vals, bottom=bottom, label=k)
    bottom += vals
  ax.set_ylabel("MiB per device per step")
  ax.set_title(f"collective bytes by kind (compiled HLO), {model_name}")
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
  fig.tight_layout()
  fig.savefig(os.path.join(report_dir, "bytes.png"), dpi=120)
  plt.close(fig)


