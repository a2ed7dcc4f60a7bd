"""Published MoE training runs as data, and the planner's step time held to each: the rows
below (publisher, hardware, layout in the publisher's notation and as the suite's mesh, shape,
measured speed, source), each predicted by planning.plan as `run.py --plan` would rank that one
layout, and the error printed beside it.

  python -m planning.published          # one line per row, then the summary line:
  published: N rows, median error X, worst error Y, Spearman R
  python -m planning.published --overlap=none --a2a=flat --no_fp8 --no_latency  # terms off

error = |predicted / measured - 1| over the quantity the publisher measured (step time, tokens/s
per device, or TFLOP/s per device counted with the suite's FLOPs, planning.plan.flops_per_step;
the suite's FLOPs per token is printed beside the publisher's where the row implies one).
R: Spearman's rank correlation of predicted and measured step time over the five Qwen3-235B-A22B
layouts on 256 H100 (rows 2a-2e). A row the suite cannot pose (a feature it lacks) says what it
waits for and is left out of the summary; none is dropped silently.

How each row is posed (the publisher's notation -> the suite's mesh): Megatron's DP x TP x PP x
CP with EP folded over DP x TP (ETP 1) is strategies/pp.py with `experts=fold`: EP =
|expert| x |tensor|, DP = |data| x |expert|; M = global batch / (DP x micro batch) sequences per
(data, expert) shard; VP (virtual pipeline stages) is `virtual_stages` under the 1f1b schedule
(Megatron's interleaved 1F1B). MaxText's FSDP over all devices is strategies/fsdp.py. Recompute:
Megatron's selective recompute (the published DeepSeek and Qwen3 rows) is posed as remat none,
its full recompute and MaxText's `remat_policy=full` as remat block. Megatron's exchanges
(dropless, forced-balanced or real routing) move the routed rows, not a worst-case buffer: its
rows are posed at the capacity factor where the padded all-to-all carries exactly the routed
bytes of balanced routing (`routed_cf`: 1, or 1 / (t c) under experts=fold; the dropless
worst case, capacity factor 0, pads each exchange to every token of the shard: row 2a posed so
is predicted at 91.1 s, 5.2x its measured step). A PP1 run (2b) is pp on one stage: its gpipe
is gradient accumulation, its weights split over data and gathered at use (Megatron's FSDP).
Megatron's load-balancing loss is computed per micro-batch: its rows run the suite's
per-sequence loss (`aux_loss_kind=sequence`), which has no counts pass over the step's
microbatches. FP8 rows price their matmuls at the cluster's FP8 peak (`Cluster.fp8_flops`),
the attention core at bf16's. Each row hides what its run overlaps (`Row.overlap`,
planning.plan.OVERLAPS): `schedule` (weight traffic, point-to-point sends and 1f1b's
all-to-alls), `weights` where the publisher turned the all-to-all overlap off (2c). Rows whose
run uses DeepEP or DeepSeek's node-forwarding exchange (2a, 2c, 8) price their cross-node
all-to-all `hierarchical` (planning.plan.A2AS), and the TPU rows (5, 6) run each collective on
every torus dimension its group spans (`ici="torus"`, planning.plan.ICIS). The compute
efficiency is the planner's default (planning.plan.EFFICIENCY), not fitted to these rows;
every row prices its grouped matmuls by their rows per expert (`gmm="rows"`,
planning.plan.GMMS), at the one quantity fitted to these rows, planning.plan.GMM_HALF_ROWS:

  python -m planning.published --fit_gmm    # the grid, the fit, each row's leave-one-out error

Routing: NVIDIA's tables force balanced routing unless a row is marked dropless (`Row.balanced`:
rows 1 and 2a-2e); the other rows route for real. `--imbalance=X` prices those at the busiest
device's routed work 1 + X times the balanced mean (planning.plan.routed_load, the planner's
--plan_imbalance), the forced-balanced rows at 1; the default, 0, prices every row balanced.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys

if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MEGATRON_QWEN3 = "Megatron MoE ModelZoo, best_practice/qwen3 (Qwen3-235B-A22B on 256 H100)"
MEGATRON_BRIDGE = "Megatron-Bridge 25.09 performance summary (DeepSeek-V3, 1,024 H100, FP8)"
MEGATRON_MOE = "Megatron-Core MoE README (Mixtral 8x7B, 64 H100)"
TPU_RECIPES = "AI-Hypercomputer tpu-recipes (MaxText)"


@dataclasses.dataclass(frozen=True)
class Row:
  row: str
  model: str                  # a preset (modeling/config.py PRESETS)
  cluster: str                # planning/clusters.py
  devices: int                # JAX devices (tpu-v7: two per chip)
  dtype: str                  # as published
  layout: str                 # the publisher's notation
  strategy: str
  mesh: dict                  # the suite's mesh, {axis: size}
  options: dict               # the strategy's Options
  microbatches: int
  remat: str
  capacity_factor: float      # 0 = dropless
  seq: int
  batch: int                  # global batch, sequences
  measure: str                # "step_s", "tokens_per_s" (per device) or "tflops" (per device)
  measured: float
  source: str
  waits: str = ""             # what the suite lacks to pose it: no prediction
  config: tuple = ()          # model config fields the publisher's run sets, ((field, value),)
  overlap: str = "schedule"   # planning.plan.OVERLAPS: what the run hides behind compute
  a2a: str = "flat"           # planning.plan.A2AS: "hierarchical" where the run uses DeepEP or
                              # DeepSeek's node-forwarding exchange
  gmm: str = "rows"           # planning.plan.GMMS: the grouped matmuls' cost of few rows
  ici: str = "torus"          # planning.plan.ICIS: a TPU slice's links (no effect off a torus)
  balanced: bool = False      # the publisher forced balanced routing (NVIDIA's tables, unless
                              # marked dropless); a real-routing row takes --imbalance
  imbalance: float = 0.0      # planning.plan.IMBALANCE where the routing is real
  capacity: bool = False      # capacity_factor is the run's capacity (MaxText's 1.25), which
                              # caps the busiest device's rows; else it sizes a dropless exchange
  latency: bool = True        # each collective's fixed time (planning.plan.latency_s)


# Megatron computes the load-balancing loss over each micro-batch's tokens: no counts pass over
# the step's microbatches first, as the suite's batch-wise loss runs; the per-sequence loss is
# the suite's statistic with no such pass
PER_MICROBATCH = (("aux_loss_kind", "sequence"),)


def routed_cf(mesh: dict, options: dict) -> float:
  """The capacity factor at which the suite's padded exchange carries the routed rows of
  balanced routing, the bytes a dropless exchange (Megatron's) moves: 1, but 1 / (t c) under
  pp's experts=fold, where a device routes S / (c t) positions of a sequence and the capacity
  rule bounds the copies it sends a shard by the whole sequence's slots (layout/dispatch.py:
  rows_bound), t c times its routed rows. The step's FLOPs do not read it."""
  if options.get("experts") != "fold":
    return 1.0
  return 1.0 / (mesh.get("tensor", 1) * mesh.get("context", 1))


def _qwen3(row, layout, mesh, options, m, measured, remat="none", strategy="pp", seq=4096,
           batch=2048, measure="step_s", waits="", overlap="schedule", a2a="flat", config=()):
  # NVIDIA's tables force balanced routing unless a row says dropless (real-world notes)
  return Row(row, "qwen3-235b-a22b", "h100", 256, "bf16", layout, strategy, mesh, options, m,
             remat, routed_cf(mesh, options), seq, batch, measure, measured, MEGATRON_QWEN3,
             waits, PER_MICROBATCH + config, overlap, a2a, balanced="dropless" not in layout)


FOLD_1F1B = {"experts": "fold", "schedule": "1f1b"}
BRIDGE_MESH = {"stage": 8, "data": 2, "expert": 32, "tensor": 2}
BRIDGE_OPTIONS = dict(FOLD_1F1B, virtual_stages=4)
ROWS = [
    Row("1", "deepseek-v3", "h100", 1024, "fp8", "TP2 PP8 VP4 EP64, MBS 1, forced-balanced",
        "pp", BRIDGE_MESH, BRIDGE_OPTIONS, 128, "none", routed_cf(BRIDGE_MESH, BRIDGE_OPTIONS),
        4096, 8192, "tokens_per_s", 1297.0, MEGATRON_BRIDGE, balanced=True),
    _qwen3("2a", "TP2 EP32 PP8 VPP4 DP16, DeepEP, 1F1B a2a overlap",
           {"stage": 8, "expert": 16, "tensor": 2}, dict(FOLD_1F1B, virtual_stages=4), 128, 17.6,
           a2a="hierarchical"),
    # PP1: pp on one stage, whose gpipe is gradient accumulation over M = 4 microbatches of MBS
    # 4, the weights split over data and gathered at use (Megatron's FSDP); EP 8 folded over
    # (expert, tensor) inside a node, as Megatron's parallel folding forms it from TP x DP
    _qwen3("2b", "TP2 EP8 PP1 FSDP, MBS 4, full recompute",
           {"stage": 1, "data": 32, "expert": 4, "tensor": 2},
           {"experts": "fold", "schedule": "gpipe"}, 4, 17.6, remat="block"),
    _qwen3("2c", "TP2 EP32 PP8 VPP4 DP16, no a2a overlap",
           {"stage": 8, "expert": 16, "tensor": 2}, dict(FOLD_1F1B, virtual_stages=4), 128, 19.7,
           overlap="weights", a2a="hierarchical"),
    # 94 layers on 32 x 3 chunks: posed as 96 layers, the lockstep of 96 equal slots; which two
    # slots Megatron leaves lighter (its options can count the embedding and the loss as a
    # layer each) the row does not say
    _qwen3("2d", "TP2 EP8 PP32 VPP3 DP4, plain a2a", {"stage": 32, "expert": 4, "tensor": 2},
           dict(FOLD_1F1B, virtual_stages=3), 512, 24.2, config=(("n_layers", 96),)),
    _qwen3("2e", "TP4 EP8 PP8 VPP4 DP8", {"stage": 8, "data": 4, "expert": 2, "tensor": 4},
           dict(FOLD_1F1B, virtual_stages=4), 256, 29.0),
    _qwen3("3a", "TP4 PP8 VPP4 EP8 CP1, 16K, dropless", {"stage": 8, "data": 4, "expert": 2,
                                                         "tensor": 4},
           dict(FOLD_1F1B, virtual_stages=4), 32, 237.0, seq=16384, batch=256, measure="tflops"),
    _qwen3("3b", "TP4 PP8 VPP4 EP8 CP2, 32K, dropless",
           {"stage": 8, "data": 2, "expert": 2, "context": 2, "tensor": 4},
           dict(FOLD_1F1B, virtual_stages=4), 64, 277.0, seq=32768, batch=256, measure="tflops"),
    _qwen3("3c", "TP4 PP8 VPP4 EP8 CP4, 64K, dropless",
           {"stage": 8, "expert": 2, "context": 4, "tensor": 4},
           dict(FOLD_1F1B, virtual_stages=4), 128, 320.0, seq=65536, batch=256, measure="tflops"),
    _qwen3("3d", "TP4 PP8 VPP4 EP8 CP8, 128K, dropless", {"stage": 8, "context": 8, "tensor": 4},
           dict(FOLD_1F1B, virtual_stages=4), 256, 357.0, seq=131072, batch=256,
           measure="tflops", waits="EP 8 folded over CP: the suite folds the experts over "
           "(expert, tensor) only, and CP8 x TP4 x PP8 leaves no expert axis"),
    Row("4", "mixtral-8x7b", "h100", 64, "bf16", "TP1 EP8 PP4 VP8, dropless", "pp",
        {"stage": 4, "data": 2, "expert": 8}, {"schedule": "1f1b", "virtual_stages": 8}, 16,
        "none", 1.0, 4096, 256, "tflops", 468.0, MEGATRON_MOE),
    Row("5", "mixtral-8x7b", "tpu-v6e", 256, "bf16", "FSDP 256, capacity 1.25", "fsdp",
        {"fsdp": 256}, {}, 1, "block", 1.25, 4096, 3072, "step_s", 13.48,
        TPU_RECIPES + ", Trillium Mixtral-8x7B (13.48 s, 3,645 tokens/s per chip)",
        capacity=True),
    Row("6", "deepseek-v3", "tpu-v7", 256, "bf16", "FSDP over 256 devices (128 chips), no EP",
        "fsdp", {"fsdp": 256}, {}, 1, "block", 0.0, 4096, 2048, "step_s", 27.02,
        TPU_RECIPES + ", Ironwood DeepSeek-V3 (27.02 s, 2,426 tokens/s per chip)"),
    Row("7", "gpt-oss-120b", "tpu-v7", 128, "bf16", "FSDP over 128 devices (64 chips)", "fsdp",
        {"fsdp": 128}, {}, 1, "block", 0.0, 8192, 1280, "step_s", 17.10,
        TPU_RECIPES + ", Ironwood gpt-oss-120b (17.10 s, 9,582 tokens/s per chip)"),
    Row("8", "deepseek-v3", "h800", 2048, "fp8", "PP16 DualPipe x EP64 x ZeRO-1 DP2", "pp",
        {"stage": 16, "data": 2, "expert": 64}, {"schedule": "1f1b"}, 120, "none", 1.0, 4096,
        15360, "tokens_per_s", 1540.0,
        "DeepSeek-V3 technical report: 180K H800 GPU-hours per trillion tokens",
        a2a="hierarchical"),
]
# the publisher's FLOPs per token, where its row gives TFLOP/s and tokens/s (real-world notes:
# TFLOP/s over tokens/s)
IMPLIED_FLOPS_PER_TOKEN = {("deepseek-v3", 4096): 260e9, ("qwen3-235b-a22b", 4096): 148e9}
RANKED = ("2a", "2b", "2c", "2d", "2e")


@dataclasses.dataclass
class Prediction:
  row: Row
  candidate: object = None      # planning.plan.Candidate (its best placement)
  predicted: float = 0.0        # in the row's measure
  flops_per_token: float = 0.0  # the suite's
  error: str = ""               # why it could not be posed (check()'s line, or row.waits)

  @property
  def ratio(self) -> float:
    return self.predicted / self.row.measured


def predict(row: Row) -> Prediction:
  """The planner's prediction of one row: its one layout enumerated (every placement of its
  axes on the cluster's nodes), the fastest placement kept."""
  from modeling.config import ConfigError, get_config
  from planning import clusters, plan
  import strategies
  if row.waits:
    return Prediction(row, error=row.waits)
  cluster = clusters.get(row.cluster)
  cfg = get_config(row.model, dtype="bfloat16").replace(seq_len=row.seq, batch=row.batch,
                                                        **dict(row.config))
  strat = strategies.get(row.strategy)
  try:
    cfg = cfg.validate()
    opts = strat.Options(**row.options)
  except (ConfigError, TypeError, ValueError) as e:
    return Prediction(row, error=str(e))
  mesh = {a: row.mesh.get(a, 1) for a in strat.AXES}
  cands = plan.enumerate_candidates(cfg, row.devices, cluster, cluster.hbm_bytes,
                                    names=(row.strategy,), remats=(row.remat,),
                                    capacity_factors=(row.capacity_factor,),
                                    microbatches=row.microbatches, only_mesh=mesh,
                                    options={row.strategy: [opts]}, overlap=row.overlap,
                                    fp8=row.dtype == "fp8", a2a=row.a2a, gmm=row.gmm,
                                    ici=row.ici, imbalance=0.0 if row.balanced else row.imbalance,
                                    capped=row.capacity, latency=row.latency)
  ok = [c for c in cands if not c.error]
  if not ok:
    return Prediction(row, error=cands[0].error if cands else "no candidate")
  c = min(ok, key=lambda c: c.step_s)
  flops = plan.flops_per_step(cfg) / (cfg.batch * cfg.seq_len)
  value = {"step_s": c.step_s, "tokens_per_s": c.tokens_per_s,
           "tflops": c.tokens_per_s * flops / 1e12}[row.measure]
  return Prediction(row, c, value, flops)


def spearman(a: list[float], b: list[float]) -> float:
  """Spearman's rank correlation of two equal-length lists (ties get their mean rank)."""
  def ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
      j = i
      while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
        j += 1
      for k in range(i, j + 1):
        r[order[k]] = (i + j) / 2
      i = j + 1
    return r
  ra, rb = ranks(a), ranks(b)
  ma, mb = statistics.fmean(ra), statistics.fmean(rb)
  cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
  var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
  return cov / var if var else 0.0


def summary(preds: list[Prediction]) -> str:
  """The last line: `published: N rows, median error X, worst error Y, Spearman R`."""
  posed = [p for p in preds if not p.error]
  errors = [abs(p.ratio - 1) for p in posed]
  ranked = {p.row.row: p for p in posed if p.row.row in RANKED}
  r = (spearman([ranked[k].candidate.step_s for k in RANKED],
                [ranked[k].row.measured for k in RANKED])
       if len(ranked) == len(RANKED) else float("nan"))
  return (f"published: {len(posed)} rows, median error {statistics.median(errors):.3f}, "
          f"worst error {max(errors):.3f}, Spearman {r:.2f}")


GMM_GRID = (0, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 4096, 6144)


def fit_gmm(rows: list[Row], grid=GMM_GRID) -> tuple[float, dict, list[str]]:
  """planning.plan.GMM_HALF_ROWS fitted to the posed rows: the grid value with the least mean
  |log(predicted / measured)|; and each row's leave-one-out error (its error at the value fitted
  to the others), {row: error}; and one line per grid value (its summary)."""
  from planning import plan
  saved, table, lines = plan.GMM_HALF_ROWS, {}, []
  try:
    for v in grid:
      plan.GMM_HALF_ROWS = float(v)
      preds = [predict(dataclasses.replace(r, gmm="rows")) for r in rows]
      table[v] = {p.row.row: math.log(p.ratio) for p in preds if not p.error}
      lines.append(f"GMM_HALF_ROWS {v:>5}: {summary(preds)}")
  finally:
    plan.GMM_HALF_ROWS = saved

  def best(leave: str = "") -> float:
    return min(grid, key=lambda v: statistics.fmean(
        abs(e) for k, e in table[v].items() if k != leave))
  loo = {k: abs(math.exp(table[best(k)][k]) - 1) for k in table[grid[0]]}
  return best(), loo, lines


UNITS = {"step_s": "s/step", "tokens_per_s": "tokens/s/dev", "tflops": "TFLOP/s/dev"}


def line(p: Prediction) -> str:
  r = p.row
  head = (f"{r.row:<3} {r.model} on {r.devices} {r.cluster} ({r.dtype}), {r.layout}, "
          f"{r.seq} x {r.batch}")
  if p.error:
    return f"{head}\n    not posed: {p.error}"
  c = p.candidate
  implied = IMPLIED_FLOPS_PER_TOKEN.get((r.model, r.seq))
  flops = (f"; FLOPs/token {p.flops_per_token / 1e9:.0f}G"
           + (f" (publisher's {implied / 1e9:.0f}G)" if implied else ""))
  return (f"{head}\n    as {c.layout()}: predicted {p.predicted:,.2f} {UNITS[r.measure]}, "
          f"measured {r.measured:,.2f}, ratio {p.ratio:.3f}; step {c.step_s:.2f} s = compute "
          f"{c.compute_s:.2f}{' (FP8 matmuls)' if r.dtype == 'fp8' else ''} + exposed comm "
          f"{c.comm_s:.2f} of {c.serial_comm_s:.2f}, latency {c.latency_s:.2f} of it "
          f"(overlap {r.overlap}, {r.a2a} all-to-all; "
          f"dominant {c.dominant} {c.dominant_s:.2f} s{', hidden' if c.dominant_hidden else ''})"
          f"{flops}\n    source: {r.source}")


def main() -> None:
  import argparse
  ap = argparse.ArgumentParser(description="the planner's step time against published runs")
  from planning import plan
  ap.add_argument("--overlap", choices=("row",) + plan.OVERLAPS, default="row",
                  help="what every row hides behind compute (default: each run's own)")
  ap.add_argument("--a2a", choices=("row",) + plan.A2AS, default="row",
                  help="how every row's cross-node all-to-all moves (default: each run's own)")
  ap.add_argument("--gmm", choices=("row",) + plan.GMMS, default="row",
                  help="what every row's grouped matmuls cost at few rows (default: each row's)")
  ap.add_argument("--ici", choices=("row",) + plan.ICIS, default="row",
                  help="what a TPU slice's torus gives a group (default: each row's)")
  ap.add_argument("--no_fp8", action="store_true", help="FP8 rows at bf16's peak")
  ap.add_argument("--no_latency", action="store_true",
                  help="no collective's fixed time, its bytes alone (planning.plan.latency_s)")
  ap.add_argument("--imbalance", type=float, default=plan.IMBALANCE,
                  help="the busiest device's routed work over balanced routing's, minus 1, on "
                  "every row whose routing is real (not forced-balanced)")
  ap.add_argument("--fit_gmm", action="store_true",
                  help="fit planning.plan.GMM_HALF_ROWS to the rows, with leave-one-out errors")
  a = ap.parse_args()
  given = {k: getattr(a, k) for k in ("overlap", "a2a", "gmm", "ici") if getattr(a, k) != "row"}
  given["imbalance"] = a.imbalance
  given["latency"] = not a.no_latency
  rows = [dataclasses.replace(r, **given,
                              dtype="bf16" if a.no_fp8 and r.dtype == "fp8" else r.dtype)
          for r in ROWS]
  if a.fit_gmm:
    value, loo, lines = fit_gmm(rows)
    print("\n".join(lines))
    print("leave-one-out: " + ", ".join(f"{k} {e:.3f}" for k, e in loo.items()))
    print(f"fitted GMM_HALF_ROWS {value} (planning.plan: {plan.GMM_HALF_ROWS:g}); leave-one-out "
          f"median error {statistics.median(loo.values()):.3f}, worst {max(loo.values()):.3f}")
    return
  preds = [predict(r) for r in rows]
  for p in preds:
    print(line(p), flush=True)
  print(summary(preds))


if __name__ == "__main__":
  main()
