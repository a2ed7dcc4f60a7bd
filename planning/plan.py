"""Enumerate, predict and rank layouts for one model on N devices of one cluster, without a mesh
of devices and without compiling: every candidate is a strategy's `check`, `param_specs` and
`cost` evaluated on a `jax.sharding.AbstractMesh` (they read axis sizes only), plus arithmetic.

A candidate is (strategy, mesh sizes over its AXES, the strategy's options, microbatches, remat
policy, capacity factor, which axes lie inside a node). OPTION_GRID names the options varied:
the K/V exchange of cp and ep_as_cp, ep_tp's routed exchange, shard_exp_on_fsdp's mode, pp's
schedule (gpipe, 1f1b, and OPTION_EXTRA's interleaved and interleaved 1F1B with 2 chunks per
stage, their stack stored round-robin: pp.stored_config); the rest stay at their defaults
(exchange=none is a demonstration of a bug). ep's exchange=ragged is in a TPU cluster's grid
(OPTION_PLATFORM: its memory is held to XLA:TPU's compile), and planned on a GPU cluster where
asked, --opt=exchange=ragged: the candidates' meshes stand for the cluster's devices
(`Cluster.platform`, whose compiler has ragged_all_to_all) and its time prices the routed rows
it moves (measure.cost.Term.moved). The temp model was calibrated at the default options, and
pp's 1f1b. Microbatches: pp's pipeline M, every divisor of the sequences a (data, expert) shard
holds, up to PP_MAX_MICROBATCHES; elsewhere gradient accumulation's M, every divisor of the
sequences a batch shard holds, up to ACCUM_MAX_MICROBATCHES (its bytes measure.cost.accumulated:
M steps of B/M sequences, pass 1's forwards; its temp one microbatch's step plus the gradient carry,
`step_features`). Remat varies over none and block (the two policies the memory model below
is calibrated for). pp on a stage count that does not divide the MoE layers runs the balanced
uneven layout (`_layer_layout`, modeling.config.balanced_layout: DeepSeek-V3's 58 on 16 stages
as 4 x 10 + 3 x 6): its padded stack's rows count for memory, exchanges and the stage's
compute (every stage runs a chunk each tick, as long as the slowest chunk: `slowest_chunk`, the
largest group's rows, and where attention kinds fall unevenly on the chunks, the chunk with the
most keys per query). pp's tensor axis (TP
inside the stages) is enumerated up to the cluster's node size and at most NODE_TP = 8 (the
strategy's PLAN_INSIDE_NODE: its two all-reduces per layer each way stay on the fast links,
as Megatron keeps TP), with the experts split over tensor; `--opt=experts=fold` plans the folded
experts instead. pp's context axis (CP inside the stages) is enumerated where the sequence is
at least 8,192 tokens (PLAN_MIN_SEQ: Megatron Core's guide puts CP at long sequences, 8K+);
`--plan_find` names any. The flags given with
`run.py --plan` (--strategy, --mesh, --microbatches, --remat, --capacity_factor, --opt,
--layer_layout) narrow this grid to their values: planning/constraints.py.

Per candidate, per device:
  memory = params + optimizer state (exact: the strategy's param_specs, measure.cost.param_memory)
         + temp, a model of XLA's temporaries: TEMP_COEF . `temp_features`, bytes per device:
             logits            the float32 logits of the device's tokens, T_head x V_local x 4
             gathered          one layer's gathered weights (the cost model's forward
                               all-gathers of weights but the embedding's and head's, per layer),
                               x the layers of one scan step: a stack whose layers differ runs
                               as a scan over its repeated period (modeling.model.run_layers),
                               and XLA holds the period's gathered weights at once (Llama 4
                               Scout's peak holds its four layers' gathered experts, 5.6G);
                               outside pp, whose stages scan one layer a step or gather once
             gathered_head     the embedding's and head's gathered tables, whole: XLA gathers
                               them once per step (0 under pp, whose pp_weights count them)
             attn_chunk        one key chunk's float32 scores, T x H_local x chunk x 4; x chunk
                               / S where attention runs ordered (query blocks: every strategy
                               but cp and ep_as_cp, modeling/attention.py)
             saved_block       remat block: each of L_held layers keeps its input, T x D in the
                               compute dtype (the residual stream's)
             saved_none_res    remat none: each of L_held layers keeps its activations:
             saved_none_routed   T x D x 4 (res), R x D and R x F_local in the compute dtype,
             saved_none_rows_f   and its gathered weights (`gathered`: XLA keeps the copy for
             saved_none_gathered the backward rather than gather again)
             work_rows_d       one MoE layer's expert rows, R x D x 4, and at the expert's
             work_rows_f         hidden width, R x F_local x 4
             work_res          one pass's residual-width working set, T x D x 4: temp grows
                               linearly in the tokens a device holds, at fixed D, F and E,
                               beyond the expert rows' terms (measured: planning/full_scale.json's
                               batch sweep on 8 devices)
             pp_weights        pp: the weights a stage uses, each a copy in the compute dtype
                               plus its gradient sum, both live through the time loop
                               (strategies/pp.py): those its _use gathers once per step (over
                               data, the embedding and head over (stage, data)) at their
                               gathered size with a float32 sum; the others at their stored
                               size with a float32 sum under 1f1b (its table sums explicitly,
                               `_run_table`) and a compute-dtype one under gpipe and
                               interleaved (autodiff of the time loop sums the copy's cotangents);
                               0 where that loop has one tick (one stage, M = 1: XLA folds
                               the loop, the copies fuse into their uses and the sums are the
                               gradients, `_one_tick`; measured, XLA:CPU's 1.44 of the
                               compiled temp became 0.97, XLA:TPU's 1.287 of its total 1.01)
             step_weights      zero1 (ep_x_tp): the weights gathered once per step and what
                               lives beside them through the step, as the buffer assignment of
                               its compiled steps holds them: XLA:CPU's all-gather runs in
                               float32 and its output lives through the step (2 bytes per
                               gathered bf16 byte), beside the gathered copy's gradient in the
                               compute dtype (1), or under gradient accumulation its float32
                               sum (2; each microbatch's gradient is added to it as the
                               backward makes it); held at 1
             grads             the float32 gradients of the parameters the device stores (their
                               param_bytes): the optimizer reads them beside the state, which
                               the donated step overwrites in place; under zero1 those of the
                               leaves it gathers once come out of the reduce-scatter as the
                               gathered buffers die, and count in step_weights' place
             grad_accum        gradient accumulation (M > 1 outside pp): the float32 gradient
                               carry beside each microbatch's gradients, the stored parameters'
                               size (but zero1's gathered leaves': step_weights); the other
                               terms are one microbatch's (B/M sequences)
           T = tokens per device in the residual stream (pp: logits, attn_chunk and
           work_res count one pass's, T/M, the microbatch it runs at a time; gpipe's
           and interleaved's logits the step's T, which autodiff of the head's map keeps);
           R = rows of one MoE layer's expert
           computation on a device (the padded exchange buffer EP x C where tokens move by
           all-to-all, ep_tp's compaction bound, else T x K); L_held = the layers whose
           activations a device keeps (pp: rows / P x (M + P - 1) / M + the dense prefix under
           gpipe, (rows / P + the prefix) x min(M, P) / M under 1f1b, (vM + P - 1) / vM
           under interleaved).
           Not terms: the gathered (pre-reduction) gradients (weight 0 when fitted beside
           these), and R x T (rows by tokens: 0.05 beside work_res's 6.2 when both were
           offered; it grows as T^2 where XLA's temp grows linearly in T).
           XLA's temp is that of the step as a training loop runs it, its params and optimizer
           state donated (runtime/train.py compiles compile-only steps so): without donation XLA
           uses the outputs' buffers as scratch, and its temp leaves out up to a copy of the
           state (the gradients above among it).
           TEMP_COEFS["XLA:CPU"] (a GPU cluster's, TEMP_COEF): saved_block held at 1 (the
           calibration models have 4-5 layers, too few for
           the fit to see it) and pp_weights at 1 (both buffers are live through the loop; the
           small models' stages are too small for the fit to see them: fitted, it came out at
           0.69 and DeepSeek-V3's 1f1b rows at 0.84 and 0.88), step_weights at 1 (above); the
           rest fitted by non-negative
           least squares on relative error to XLA:CPU's temp bytes of 33 compiled steps on 8
           devices and 39 larger candidates (`python -m planning.calibrate
           --with=planning/full_scale.json`). The 33: --gmm=scan, bf16, small models shaped like
           Mixtral-8x7B and DeepSeek-V2-Lite (F at 1, 2 and 3.5 x D, vocabularies of 8,000 to
           64,000), pp under gpipe and 1f1b, gradient accumulation at M = 2, the other options
           at their defaults. The 39 (planning/full_scale.json, written by bench/plan_memory.py
           --save): Mixtral-8x7B on 64 devices, every strategy's best layout, remat none, pp's
           schedules, accumulation at batch 512, DeepSeek-V3's pp layouts on 2,048, and a batch
           sweep (2-layer Mixtral-8x7B on 8 devices, batch 16 to 128, ep, ep_x_tp EP4 x TP2, tp
           and fsdp: T from 8,192 to 131,072 tokens per device). Why all three: XLA's temp is
           the live set at its peak, which falls in one phase (the head's gathered tables and
           logits, or one MoE layer's expert rows, over the saved activations), and a sum of
           terms fitted where another phase peaks mis-weighs it: fitted on the 33 alone,
           Mixtral's ep at batch 512 came out at 1.11 and DeepSeek-V3's 1f1b at 0.88; and the
           small steps' T (2,048 to 8,192) cannot tell a term linear in T from one in R x T
           (quadratic), which the sweep can. On the 33 the fit is within -14% .. +22% of XLA's
           total (27 within 10%); on the 39, 35 within 10%: the misses are pp 1f1b with remat
           none (0.87), whose S = 4096 activations the small steps do not show, DeepSeek-V3's
           gpipe at M = 120 (0.72), fsdp with remat none (0.897) and a pp gpipe step (1.111).
           Held out (docs/planner.md, "Honesty"): tests/test_plan.py's small grid and the planner's
           picks, at 0.941 .. 1.007.
           TEMP_COEFS["XLA:TPU"] (a TPU cluster's): the same features fitted to XLA:TPU's temp
           bytes (ragged_dot as the TPU runs it, no --gmm=scan), saved_block and pp_weights held
           at 1, the four saved_none terms at XLA:CPU's (three small remat-none rows cannot
           fit four), step_weights fitted (XLA:TPU gathers bf16 weights as bf16); 18 of the 33
           steps compiled for 8 v5p chips (planning/tpu_v5p_cases.json) and 4 Mixtral-8x7B
           candidates on 64 (planning/tpu_v5p_scale.json, which also holds two held-out picks
           and two steps XLA:TPU refused, over its HBM, that no fit reads). 19 of the 22 within
           10% of XLA:TPU's total; held out, on 64 v5p chips: ep_x_tp data:8,expert:8 zero1
           1.037, pp data:4,expert:8,tensor:2 on one stage (gpipe, M = 1) 1.011, Llama 4
           Scout's ep fsdp:8,expert:8 1.004. Held out of XLA:CPU's fit
           (planning/full_scale.json): the first picks of gpt-oss-120b, Llama 4 Scout and
           Maverick on H100, 0.972, 0.962 and 0.987.
  step time = compute + the communication --plan_overlap leaves exposed (OVERLAPS: none adds
             every collective; weights, the default, hides weight traffic and point-to-point
             sends, schedule also 1f1b's all-to-alls; what is hidden hides up to the compute's
             length):
             compute = FLOPs per device / (efficiency x peak), FLOPs = 6 x active params x
               tokens + the attention core (causal: half of S x S; a sliding window's or local
               chunk's keys where a layer has one, `keys_per_query`), x 4/3 with remat block (the
               recomputed forward), + 1/3 for gradient accumulation's pass 1 under the
               batch-wise aux loss; pp: x (M + P - 1) / M (the bubble; interleaved's
               (vM + P - 1) / vM; 1f1b's lockstep ticks (P F + (2M + P - 2) B + its counts
               pre-pass's (M + P - 1) F) / (M (F + B)), B = 2F, 3F with remat block;
               interleaved 1F1B: its table's ticks, each of one chunk, `one_f_ticks`), x the
               slowest chunk's layer work over the mean (`slowest_chunk`), and its dense
               prefix run on every stage
             (a published FP8 run: the matmuls at the cluster's FP8 peak, the attention core
               at bf16's; a cluster without an FP8 peak, bf16's)
             (--plan_gmm=rows, the default: the routed experts' share of the FLOPs,
               `routed_share`, at efficiency x r / (r + GMM_HALF_ROWS), r the rows balanced
               routing gives a local expert in one MoE layer's call on a device
               (`balanced_rows`), whatever the candidate's capacity factor pads; GMM_HALF_ROWS
               fitted to planning/published.py's rows, `--fit_gmm`); x routed_load, the busiest
               device's routed rows over the balanced mean (--plan_imbalance, default 0, capped
               at a capacity factor)
             communication = per cost-model term (measure.cost.step_terms: kind, axes, bytes),
               its wire bytes over the bandwidth of the links its group spans: the node's when
               every axis of the group lies inside a node (a TPU slice's: one torus dimension's
               links, or at --plan_ici=torus, the default, those of every dimension the group spans,
               `ici_dims`), else the inter-node one; an all-to-all across nodes as --plan_a2a
               says (A2AS, `a2a_seconds`); + each collective's fixed time (`latency_s`: the
               least over the cluster's protocols, NCCL's ring and tree or a TPU slice's ICI
               hops, planning/clusters.py) x the collectives it issues (`calls_of`, merged as
               the cluster's compiler merges them: `link_loads`).
  MFU = model FLOPs (6 x active params x tokens + attention, no recompute) / (step time x peak).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import sys
import time

import numpy as np

from layout import mesh as mesh_lib, schedule as pp_schedule
from measure import cost
from modeling import model
from modeling.config import ConfigError
from parallel.sharding import dim_axes, entry_axes, spec_shards
import strategies

REMATS = ("none", "block")
CAPACITY_FACTORS = (0.0, 1.25)
PP_MAX_MICROBATCHES = 256     # pp's M: every divisor of its per-shard batch up to this
ACCUM_MAX_MICROBATCHES = 16   # gradient accumulation's M elsewhere, likewise
NAMES = tuple(n for n in strategies.NAMES if n != "reference")
EFFICIENCY = 0.5      # the fraction of peak FLOP/s the matmuls reach: an assumption, stated
# Strategy options the enumeration varies, each strategy's own PLAN_GRID ({field: values}, every
# combination) and PLAN_EXTRA (option sets beyond that product), declared in its file
OPTION_GRID = {n: getattr(strategies.get(n), "PLAN_GRID", {}) for n in NAMES}
OPTION_EXTRA = {n: getattr(strategies.get(n), "PLAN_EXTRA", ()) for n in NAMES}
# ... and those it adds on one platform's clusters ({platform: option sets}, PLAN_PLATFORM_EXTRA)
OPTION_PLATFORM = {n: getattr(strategies.get(n), "PLAN_PLATFORM_EXTRA", {}) for n in NAMES}
# Fitted by planning/calibrate.py (bytes of temp per byte of feature), one model per compiler
# (a cluster's `temp_model`), saved_block and pp_weights held at 1, XLA:CPU's step_weights too;
# see the module docstring. attn_chunk fits to 0 on XLA:CPU: at the fitted lengths (S up to
# 4,096) one key chunk's scores are small beside every row's other terms.
TEMP_COEFS = {
    "XLA:CPU": {"logits": 0.736, "gathered": 1.766, "gathered_head": 0.971, "attn_chunk": 0.000,
                "saved_none_res": 35.272, "saved_none_routed": 4.648,
                "saved_none_rows_f": 0.368, "saved_none_gathered": 0.446, "work_rows_d": 7.099,
                "work_rows_f": 2.201, "work_res": 6.638, "grads": 1.020, "grad_accum": 1.178,
                "saved_block": 1.000, "pp_weights": 1.000, "step_weights": 1.000},
}
TEMP_COEFS["XLA:TPU"] = {
    "logits": 0.040, "gathered": 2.601, "gathered_head": 1.145, "attn_chunk": 0.000,
    "saved_block": 1.000, "saved_none_res": 35.272, "saved_none_routed": 4.648,
    "saved_none_rows_f": 0.368, "saved_none_gathered": 0.446, "work_rows_d": 4.208,
    "work_rows_f": 0.478, "work_res": 21.135, "pp_weights": 1.000, "step_weights": 0.765,
    "grads": 1.512, "grad_accum": 0.961}
TEMP_COEF = TEMP_COEFS["XLA:CPU"]


@dataclasses.dataclass
class Candidate:
  strategy: str
  sizes: tuple                 # ((axis, size), ...) in the strategy's AXES order
  microbatches: int
  remat: str
  capacity_factor: float
  opts: object = None          # the strategy's Options
  inner: tuple = ()            # the axes (size > 1) that lie inside one node
  param_opt: float = 0.0       # bytes per device
  temp: float = 0.0
  compute_s: float = 0.0
  comm_s: float = 0.0          # exposed: what --plan_overlap leaves beside the compute
  serial_comm_s: float = 0.0   # every collective's time, none hidden (--plan_overlap=none)
  latency_s: float = 0.0       # ... of it, the collectives' fixed times (`latency_s`)
  dominant: str = ""           # the collective (kind over axes) that lengthens the step most
  dominant_s: float = 0.0      # ... its time (`timing`)
  dominant_hidden: bool = False  # ... every collective runs under the compute: the largest
  tokens_per_s: float = 0.0    # per device
  mfu: float = 0.0
  fits: bool = False
  error: str = ""              # why check() refused it (then nothing is predicted)
  layer_layout: str = ""       # pp: MoE layers per stage where they do not divide evenly
  layer_stages: int = 0        # pp interleaved: the stack stored round-robin over the stages
  expert_rows: float = 0.0     # rows per local expert of one MoE layer's call (--plan_gmm)

  @property
  def memory(self) -> float:
    return self.param_opt + self.temp

  @property
  def step_s(self) -> float:
    return self.compute_s + self.comm_s

  @property
  def mesh_str(self) -> str:
    return ",".join(f"{a}:{n}" for a, n in self.sizes if n > 1) or "1 device"

  def layout(self) -> str:
    """One line: strategy, mesh, M (pp), remat, capacity factor, the axes inside a node."""
    out = f"{self.strategy} {self.mesh_str}"
    for k, v in sorted(_varied(self.strategy, self.opts).items()):
      out += f" {k}={v}"
    if _pipelined(self.strategy) or self.microbatches > 1:
      out += f" M={self.microbatches}"
      if self.layer_layout:
        counts = [int(c) for c in self.layer_layout.split(",")]
        out += " layers=" + "+".join(f"{c}x{counts.count(c)}" for c in sorted(set(counts),
                                                                         reverse=True))
    out += f" remat={self.remat} cf={self.capacity_factor:g}"
    return out + f" node[{','.join(self.inner) or '-'}]"


def _varied(name: str, opts) -> dict:
  """The options of OPTION_GRID's fields for this strategy, as set in opts, then any other field
  where it is not at its default (OPTION_EXTRA's, or one --opt sets: planning/constraints.py)."""
  if opts is None:
    return {}
  out = {k: getattr(opts, k) for k in OPTION_GRID.get(name, {})}
  default = type(opts)()
  out.update({f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)
              if f.name not in out and getattr(opts, f.name) != getattr(default, f.name)})
  return out


def varied_fields(name: str) -> list[str]:
  """The option fields the planner varies for this strategy: OPTION_GRID's, then OPTION_EXTRA's."""
  fields = list(OPTION_GRID.get(name, {}))
  return fields + [k for extra in OPTION_EXTRA.get(name, ()) for k in extra if k not in fields]


NODE_TP = 8      # a PLAN_INSIDE_NODE axis: at most this, and a node (Megatron's TP <= 8)


def option_sets(name: str, platform: str | None = None) -> list:
  """Every combination of the strategy's OPTION_GRID values, then OPTION_EXTRA's sets, then on a
  `platform` cluster OPTION_PLATFORM's, as its Options."""
  strat = strategies.get(name)
  grid = OPTION_GRID.get(name, {})
  out = [strat.Options(**dict(zip(grid, values)))
         for values in itertools.product(*grid.values())] or [strat.Options()]
  extra = OPTION_EXTRA.get(name, ()) + OPTION_PLATFORM.get(name, {}).get(platform, ())
  return out + [strat.Options(**e) for e in extra]


def placements(sizes: dict, node: int) -> list[tuple]:
  """The distinct sets of axes that can lie inside a node of `node` devices: the mesh is laid
  out with some order of its axes, inner first (the innermost varies fastest over device ids);
  an axis lies inside the node when its size times the sizes of the axes inside it is <= node.
  -> [tuple of axes inside a node], each set once."""
  axes = [a for a, n in sizes.items() if n > 1]
  seen = []
  for order in itertools.permutations(axes):
    inside, span = [], 1
    for a in order:
      span *= sizes[a]
      if span > node:
        break
      inside.append(a)
    key = tuple(sorted(inside))
    if key not in seen:
      seen.append(key)
  return seen or [()]


def _forward_flops_per_token(cfg) -> tuple[float, float]:
  """(matmuls against weights, the attention core) of one token's forward: 2 x the active
  matmul params (every weight but the embedding lookup, top_k of the routed experts), and q.k
  and p.v over each layer's keys per query on average (`keys_per_query`)."""
  _, active = model.param_counts(cfg)
  active -= cfg.d_model                                 # the embedding row: a lookup
  return 2 * active, sum(attention_core_flops(cfg, kind) for kind, _ in cfg.layer_kinds)


def attention_core_flops(cfg, kind: str) -> float:
  """One token's q.k and p.v FLOPs in a layer of attention kind `kind`, over its keys per query
  (`keys_per_query`)."""
  qk = cfg.qk_head_dim if cfg.mla else cfg.head_dim
  v = cfg.v_head_dim if cfg.mla else cfg.head_dim
  return 2 * cfg.n_heads * (qk + v) * keys_per_query(cfg, kind)


def keys_per_query(cfg, kind: str) -> float:
  """The keys a query of a layer of attention kind `kind` attends to, averaged over the S
  positions, the diagonal counted half (as causal's S/2 counts it): causal, S/2; a sliding
  window W < S (gpt-oss: keys p - W + 1 .. p), W - W (W - 1) / 2S - 1/2 (positions before W
  see fewer); a local chunk C < S dividing S (Llama 4: keys of p's own chunk, causal), C/2."""
  s, w, c = cfg.seq_len, cfg.window_of(kind), cfg.local_chunk_of(kind)
  if w and w < s:
    return w - w * (w - 1) / (2 * s) - 0.5
  if c and c < s:
    return c / 2
  return s / 2


@functools.lru_cache(maxsize=256)
def flops_per_step(cfg) -> float:
  """Model FLOPs of one train step (forward + backward = 3 x forward, no recompute)."""
  return 3 * sum(_forward_flops_per_token(cfg)) * cfg.batch * cfg.seq_len


@functools.lru_cache(maxsize=256)
def attention_share(cfg) -> float:
  """The attention core's share of flops_per_step (the rest is matmuls against weights)."""
  mm, attn = _forward_flops_per_token(cfg)
  return attn / (mm + attn)


@functools.lru_cache(maxsize=256)
def routed_share(cfg) -> float:
  """The routed experts' share of flops_per_step: the grouped matmuls' (the rest: dense matmuls
  and the attention core)."""
  mm, attn = _forward_flops_per_token(cfg)
  routed = sum(math.prod(leaf.shape) for leaf in model.param_leaves(cfg.replace(layer_layout=""))
               if leaf.role in model.EXPERTS) * cfg.top_k // cfg.n_experts
  return 2 * routed / (mm + attn)


def _dense_flops_share(cfg) -> float:
  """The dense prefix's share of the model FLOPs (pp runs it on every stage)."""
  return cfg.first_k_dense_replace / cfg.n_layers


def temp_features(name: str, cfg, mesh, terms, opts=None, param_bytes: float = 0.0,
                  accumulates: bool = False) -> dict:
  """The features of the temp model (module docstring), in bytes per device. terms: the
  strategy's cost terms (without remat's copies); opts: its Options (None = the defaults);
  param_bytes: the parameters a device stores (measure.cost.param_memory's param_bytes);
  accumulates: the step runs gradient accumulation, cfg its microbatch (`grad_accum`)."""
  strat = strategies.get(name)
  shape = dict(mesh.shape)
  lay = strat.layout(cfg, mesh, strat.Options() if opts is None else opts)
  bspec = strat.batch_spec(cfg, mesh)
  t = cfg.batch * cfg.seq_len / spec_shards(bspec, mesh)
  # residual-stream sequence splits that batch_spec does not show (ep_tp's [B@data, S@expert,
  # D], ep_x_tp's sequence parallelism)
  tok_axes = (dim_axes(lay.x, 0), dim_axes(lay.x, 1)) if lay.x is not None else ((), ())
  t /= math.prod(shape.get(a, 1) for a in tok_axes[1] if a not in dim_axes(bspec, 1))
  # pp runs a pass on one microbatch at a time: its working set is a microbatch's tokens, and
  # so is the head's under 1f1b (its vjp in the same phase); gpipe's and interleaved's autodiff
  # of the head's map keeps every microbatch's logits
  t_pass = t / cfg.microbatches if _pipelined(name) else t
  t_head = t_pass if _pipelined(name) and _one_f(opts) else t
  specs = strat.param_specs(cfg, mesh, opts)
  v_loc = cfg.vocab / _dim_shards(specs["unembed"], 1, mesh)
  f_axes = dim_axes(specs["layers"]["moe"]["wi_0"], 3)           # the axes splitting F
  f_loc = cfg.d_ff / math.prod(shape[a] for a in f_axes)
  gathers = [x for x in terms if cost.is_weight_gather(x)]
  # weights gathered once per step (ep_x_tp's zero1) are live through it: `step_weights`; their
  # float32 gradients at the stored size come out of the reduce-scatter after the backward, as
  # the gathered buffers die, so `grads` counts only the other leaves' (a term's bytes are its
  # output's: the stored gradient)
  once = sum(x.bytes for x in gathers) if lay.gathers_once else 0.0
  scattered = sum(x.bytes for x in terms if x.kind == "reduce-scatter"
                  and x.what.endswith("grads")) if lay.gathers_once else 0.0
  wide = once * 4 / cost.act_bytes(cfg)          # the gathered copies at float32's size
  gathers = [] if lay.gathers_once else gathers
  # the leaves outside the layer stack: their gathers are live whole, not one layer's at a time
  head = [x.bytes for x in gathers if cost.weight_role(x) in cost.OUTSIDE_ROLES]
  gathered = (sum(x.bytes for x in gathers) - sum(head)) / cfg.n_layers
  # a scan step of the layer stack runs a period of layer kinds (gpt-oss's 2, Llama 4's 4:
  # config.layer_segments), whose layers' gathers XLA holds at once (module docstring)
  period = 1 if _pipelined(name) else max(len(kinds) for kinds, _ in cfg.layer_segments)
  res = t * cfg.d_model * 4
  # experts whose F is split over an axis that also splits the residual's tokens run on that
  # axis' gathered rows (ep_x_tp's sequence parallelism)
  rows = _routed_rows(name, cfg, shape, t, terms, opts) * math.prod(
      shape[a] for a in f_axes if a in tok_axes[0] + tok_axes[1])
  held = _layers_held(name, cfg, shape, opts)
  block, none = cfg.remat == "block", cfg.remat == "none"
  heads = cfg.n_heads / shape.get("tensor", 1)
  chunk = min(cfg.attention_chunk, cfg.seq_len) if cfg.attention_impl == "chunked" else cfg.seq_len
  # attention runs ordered, in query blocks of the chunk, wherever the layout gathers no K/V
  # (model.gqa / model.mla: ordered=not lay.splits_sequence); cp's reordered, split sequence
  # (pp's with a context axis) does not
  ordered = not lay.splits_sequence
  blocks = chunk / cfg.seq_len if cfg.attention_impl == "chunked" and ordered else 1
  return {"logits": t_head * v_loc * 4, "gathered": gathered * period,
          "gathered_head": sum(head) * (not _pipelined(name)),
          "attn_chunk": t_pass * heads * chunk * 4 * blocks,
          "saved_block": held * t * cfg.d_model * cost.act_bytes(cfg) * block,
          "saved_none_res": held * res * none,
          "saved_none_routed": held * rows * cfg.d_model * cost.act_bytes(cfg) * none,
          "saved_none_rows_f": held * rows * f_loc * cost.act_bytes(cfg) * none,
          "saved_none_gathered": held * gathered * none, "work_rows_d": rows * cfg.d_model * 4,
          "work_rows_f": rows * f_loc * 4,
          "work_res": t_pass * cfg.d_model * 4,
          "pp_weights": _pp_weight_bytes(name, cfg, mesh, opts),
          "step_weights": wide + (wide if accumulates else once),
          "grads": param_bytes - scattered, "grad_accum": (param_bytes - scattered) * accumulates}


def _pipelined(name: str) -> bool:
  """A strategy that runs its microbatches in its own pipeline over `stage` (its PIPELINE
  declaration: pp), where the others accumulate gradients over them."""
  return getattr(strategies.get(name), "PIPELINE", False)


def _accumulates(name: str, cfg) -> bool:
  """Gradient accumulation: M > 1 outside pp (pp runs its microbatches in its pipeline)."""
  return cfg.microbatches > 1 and not _pipelined(name)


def per_microbatch(name: str, cfg):
  """The step one microbatch runs: B/M sequences where the step accumulates, else the step."""
  if not _accumulates(name, cfg):
    return cfg
  return cfg.replace(batch=cfg.batch // cfg.microbatches, microbatches=1)


def step_features(name: str, cfg, mesh, raw, opts=None, param_bytes: float = 0.0) -> dict:
  """temp_features of a candidate from raw, the strategy's cost of per_microbatch(name, cfg):
  an accumulating step holds one microbatch's working set, plus its float32 gradient carry
  (`grad_accum`, the stored parameters' size: runtime.train.accumulated_grads)."""
  return temp_features(name, per_microbatch(name, cfg), mesh, raw, opts, param_bytes,
                       _accumulates(name, cfg))


def _pp_weight_bytes(name: str, cfg, mesh, opts) -> float:
  """pp_weights (module docstring): each value a stage uses, a compute-dtype copy plus its
  gradient sum: float32 for those _use gathers (strategies/pp.py), and for the others under
  1f1b; the compute dtype for the others under autodiff's time loop. 0 outside pp."""
  if not _pipelined(name) or _one_tick(cfg, mesh, opts):
    return 0.0
  gathered, local = _pp_gathered(name, cfg.replace(microbatches=1, capacity_factor=0.0,
                                                   remat="none"), tuple(dict(mesh.shape).items()))
  act = cost.act_bytes(cfg)
  return gathered * (act + 4) + local * (act + (4 if _one_f(opts) else act))


def _one_tick(cfg, mesh, opts) -> bool:
  """pp's gpipe (or interleaved) time loop of one tick (one stage, one microbatch, one chunk):
  XLA folds a loop of one trip, its weight copies fuse into their uses and their sums are the
  gradients themselves (`grads`), so pp_weights is 0 there."""
  v = 1 if opts is None else opts.virtual_stages
  return (not _one_f(opts) and mesh_lib.axis_size(mesh, "stage") == 1
          and v * cfg.microbatches == 1)


@functools.lru_cache(maxsize=256)
def _pp_gathered(name: str, cfg, shape: tuple) -> tuple[float, float]:
  """pp: (the values a device holds gathered by _use: each leaf stored split over data, or
  (stage, data), at its size times those shards; the values of the other leaves, which _use
  only casts)."""
  import jax
  from jax.sharding import PartitionSpec
  strat = strategies.get(name)
  mesh = mesh_lib.abstract_mesh(dict(shape))
  leaves = jax.tree.leaves(model.init_params_shapes(cfg), is_leaf=lambda l: hasattr(l, "role"))
  specs = jax.tree.leaves(strat.param_specs(cfg, mesh),
                          is_leaf=lambda x: isinstance(x, PartitionSpec))
  gathered = local = 0.0
  for leaf, spec in zip(leaves, specs):
    n = mesh_lib.axis_size(mesh, *(a for e in spec for a in entry_axes(e)
                                   if strat.DATA in entry_axes(e) and a in strat.SPREAD))
    if n > 1:
      gathered += math.prod(leaf.shape) / spec_shards(spec, mesh) * n
    else:
      local += math.prod(leaf.shape) / spec_shards(spec, mesh)
  return gathered, local


def _routed_rows(name: str, cfg, shape: dict, t: float, terms, opts=None) -> float:
  """Rows of one MoE layer's expert computation on a device: the padded exchange buffer
  [EP, C] where tokens move by all-to-all (C from its cost terms: the forward all-to-all bytes
  of one layer's dispatch, per row of D values), the ragged exchange's receive buffer [EP*C]
  likewise (its forward bytes: that buffer and the combine's [T*K] routed copies); ep_tp's
  compaction bound over the data shard's gathered tokens; else the device's T x K routed
  copies."""
  row = cfg.d_model * cost.act_bytes(cfg)
  calls = cfg.n_layer_slots * _runs(name, cfg, shape, opts)
  a2a = sum(x.bytes for x in terms if x.kind == "all-to-all" and x.phase == "fwd")
  if a2a:
    return a2a / (2 * calls) / row                                 # dispatch + combine per call
  ragged = sum(x.bytes for x in terms if x.kind == "ragged-all-to-all" and x.phase == "fwd")
  if ragged:
    return ragged / calls / row - t * cfg.top_k
  hook = getattr(strategies.get(name), "routed_rows", None)
  if hook is not None:
    return hook(cfg, shape)
  return t * cfg.top_k


def balanced_rows(cfg, shape: dict, local_e: float, f_split: int) -> float:
  """The rows per local expert of one MoE layer's call on a device under balanced routing
  (--plan_gmm): a call's tokens (the batch over its M microbatches) route K copies each, spread
  evenly over the devices that compute a layer's experts on distinct rows (every device of a
  stage, over the shards of the experts' hidden width, which compute the same rows), then over
  the local_e experts a device holds. Not the exchange's padded buffer: a capacity factor pads
  it (dropless to the worst case, a split sequence to the whole sequence's slots), while each
  expert's matmul runs on the rows routed to it."""
  devices = math.prod(shape.values()) / shape.get("stage", 1) / f_split
  return cfg.batch * cfg.seq_len / cfg.microbatches * cfg.top_k / devices / local_e


def _dim_shards(spec, dim: int, mesh) -> int:
  if spec is None or dim >= len(spec) or spec[dim] is None:
    return 1
  axes = (spec[dim],) if isinstance(spec[dim], str) else spec[dim]
  return mesh_lib.axis_size(mesh, *axes)


def _chunks(cfg) -> int:
  """pp's chunks per stage: v where the stack is stored for the interleaved schedule, else 1."""
  return pp_schedule.chunks(cfg)


def _runs(name: str, cfg, shape: dict, opts=None) -> float:
  """How many exchanges of one layer the forward a2a terms add up, per MoE layer of the model:
  pp runs each of a stage's layers once per stage pass (layout/schedule.py's stage_passes, the
  counts pre-pass's included), a pass one chunk of the stage's v."""
  if not _pipelined(name):
    return 1
  opts = strategies.get(name).Options() if opts is None else opts
  steps, pre = pp_schedule.stage_passes(cfg, shape["stage"], opts)
  return (steps + pre) / (shape["stage"] * _chunks(cfg))


@functools.lru_cache(maxsize=1024)
def slowest_chunk(cfg, p: int) -> float:
  """pp on p stages: the work of the slowest chunk of stored rows over the mean MoE layer's
  work per chunk (what a tick lasts, over what it would last were the layers spread evenly).
  A chunk (one of a stage's v) holds n_layer_slots / (p v) rows; padding rows compute as a
  layer does, so an uneven layout's largest group sets the tick; where rows of different
  attention kinds fall unevenly on the chunks (pp.slot_kinds: gpt-oss's sliding and full
  layers on 9 layers a stage; Maverick's NoPE layers on 3 (dense, MoE) pairs a stage), the
  chunk with the most keys per query sets it. A row costs a layer's matmuls (the model's mean)
  plus its kind's attention core (keys_per_query)."""
  slots = np.asarray(cfg.layer_slots)
  real = slots >= 0
  n_chunks = p * _chunks(cfg)
  period = len(cfg.layer_attentions)
  if period == 1:
    return len(slots) / real.sum()
  kinds = strategies.get("pp").slot_kinds(cfg, p, _chunks(cfg))
  if cfg.dense_inside:                  # every layer a stage row, its kind by its depth
    real = np.ones(len(kinds), bool)
  if kinds is None:                     # every chunk starts on a period: the static kinds
    per = len(slots) // n_chunks
    kinds = (cfg.first_k_dense_replace + np.arange(len(slots)) % per) % period
  mm, _ = _forward_flops_per_token(cfg)
  attn = [attention_core_flops(cfg, k) for k in cfg.layer_attentions]
  row = mm / cfg.n_layers + np.asarray(attn)[kinds]
  return float(row.reshape(n_chunks, -1).sum(1).max() * n_chunks / row[real].sum())


def _one_f(opts) -> bool:
  """pp's 1f1b schedule."""
  return opts is not None and opts.schedule == "1f1b"


@functools.lru_cache(maxsize=None)
def one_f_ticks(p: int, m: int, v: int) -> tuple[int, int, int]:
  """pp's 1f1b table on P stages, M microbatches, v chunks per stage -> (its ticks where no
  stage runs a backward, its ticks where one does, its ring's slots). v = 1: the closed form
  of Megatron's table, (P, 2M + P - 2, min(M, P)) (tests/test_plan.py holds it to the table);
  v > 1 reads the table (layout/schedule.py's schedule, one lockstep walk per (P, M, v))."""
  if v == 1:
    return p, 2 * m + p - 2, min(m, p)
  table = pp_schedule.schedule("1f1b", p, m, v)
  backward = (np.asarray(table["B"]) >= 0).any(axis=1)
  return int((~backward).sum()), int(backward.sum()), pp_schedule.in_flight(table)


def _in_flight(cfg, shape: dict, opts) -> float:
  """pp: microbatches whose activations a stage holds, per microbatch of the step: gpipe's
  time loop keeps M + P - 1, 1f1b's ring min(M, P) (interleaved 1F1B: its ring's chunk slots,
  1/v of a microbatch each) (strategies/pp.py)."""
  p, m, v = shape["stage"], cfg.microbatches, _chunks(cfg)
  if _one_f(opts):
    return one_f_ticks(p, m, v)[2] / v / m
  return (v * m + p - 1) / (v * m)           # interleaved: v*M+P-1 ticks of one chunk each


def _layers_held(name: str, cfg, shape: dict, opts=None) -> float:
  """Layers whose saved activations a device holds through the backward (module docstring)."""
  if not _pipelined(name):
    return cfg.n_layers
  # 1f1b: stage 0 runs the prefix inside its phases, its residuals in the ring too
  prefix = _in_flight(cfg, shape, opts) if _one_f(opts) else 1
  # a stage's rows: its MoE rows and the dense layers inside the stack it holds with them
  rows = (cfg.n_layer_slots + len(cfg.dense_inside)) / shape["stage"]
  return rows * _in_flight(cfg, shape, opts) + cfg.first_k_dense_replace * prefix


def predict_temp(features: dict, temp_model: str = "XLA:CPU") -> float:
  """XLA's temp bytes per device as the compiler `temp_model` (a key of TEMP_COEFS) holds them."""
  coef = TEMP_COEFS[temp_model]
  return sum(coef[k] * v for k, v in features.items())


# --plan_overlap: what communication the step time lets run under compute (module docstring)
OVERLAPS = ("none",       # every collective serial with the compute: the upper bound
            "weights",    # weight traffic (gathers, gradient reductions, the optimizer's) and
                          # point-to-point sends (pp's stage permutes, ring attention's K/V)
            "schedule")   # those, and the exchanges of schedules that pair two microbatches in a
                          # tick (1f1b: one's all-to-all runs under the other's compute)
# the planner's default (--plan_overlap): XLA:GPU issues the weights' collectives as
# asynchronous start/done pairs with compute between them (bench/async_collectives.py), and the
# published runs overlap them; the suite's schedules do not pair two microbatches' exchanges
OVERLAP = "weights"


EXCHANGES = ("all-to-all", "ragged-all-to-all")
# the collectives XLA's combiners merge (link_loads)
COMBINED = ("all-reduce", "all-gather", "reduce-scatter")


def overlap_class(t) -> str:
  """Which --plan_overlap hides a cost term behind compute: "weights" (a weight's gather or
  gradient reduction, the optimizer's, a point-to-point send), "paired" (the tokens' exchange,
  an all-to-all ragged or padded: only a schedule that runs two microbatches in a tick hides
  it) or "" (on the critical path: tensor parallelism's reductions, the routing's
  statistics)."""
  if t.params or t.phase == "opt" or t.kind == "collective-permute":
    return "weights"
  return "paired" if t.kind in EXCHANGES else ""


def link_loads(terms, calls=None, merges: tuple = COMBINED) -> tuple:
  """A step's cost terms summed per collective and overlap class: (("kind over axes", axes,
  wire bytes a device sends, overlap_class, collectives issued), ...), in the order the terms
  first name them; what `timing` prices on each placement. calls: a term -> the collectives it
  counts (calls_of); None: none counted (no latency). merges: the kinds the compiler merges
  (clusters.Cluster.merges)."""
  loads: dict = {}
  for x in terms:
    key = (x.kind, x.axes, overlap_class(x))
    b, n = loads.get(key, (0.0, {}))
    if calls:
      # XLA's combiners merge the independent all-reduces, all-gathers and reduce-scatters one
      # layer run issues over one group (its weights', its router statistics', the step's
      # sums) into one: a phase's calls are its most frequent such term's issues; activations'
      # collectives, exchanges and sends wait on each other's results and stay apart
      merge = x.kind in merges and (x.params or x.what.startswith(cost.STATS)
                                    or _issued(x.what, x.phase, x.params)[1])
      site = (x.phase, x.what if not merge else "")
      n[site] = max(n.get(site, 0.0), calls(x, merge)) if merge else n.get(site, 0.0) + calls(x)
    loads[key] = (b + x.sent_bytes, n)
  return tuple((f"{kind} over {','.join(axes)}", axes, b, cls, sum(n.values()))
               for (kind, axes, cls), (b, n) in loads.items())


# --plan_a2a: how an all-to-all whose group crosses nodes moves its rows (module docstring)
A2AS = ("flat",           # every routed copy over the inter-node link, one per destination
        "hierarchical")   # DeepEP / DeepSeek-V3: a token crosses to each destination node once,
                          # and NVLink fans it out to that node's experts
A2A = "flat"

# --plan_gmm: what the grouped matmuls' rows per expert cost (module docstring)
GMMS = ("flat",           # every matmul at the efficiency, whatever its rows
        "rows")           # the routed experts' at efficiency x r / (r + GMM_HALF_ROWS)
GMM = "rows"
# The rows per expert at which a grouped matmul runs at half the dense matmuls' efficiency:
# fitted to the posed rows of planning/published.py (`--fit_gmm`), its leave-one-out error in
# docs/planner.md
GMM_HALF_ROWS = 1024.0


# --plan_imbalance: how much more routed work the busiest device does than balanced routing gives
# it (module docstring); 0: balanced, as the forced-balanced published runs route
IMBALANCE = 0.0


def routed_load(imbalance: float, capacity_factor: float, capped: bool = True) -> float:
  """The busiest device's routed rows over balanced routing's: 1 + imbalance, capped at a
  capacity factor (the rows past an expert's capacity are dropped; 0: dropless, no cap).
  capped=False: the capacity factor sizes an exchange that drops nothing (a published dropless
  run's, planning/published.py: routed_cf), no cap."""
  load = 1.0 + imbalance
  return min(load, max(1.0, capacity_factor)) if capped and capacity_factor else load


def gmm_efficiency(rows: float, gmm: str = GMM) -> float:
  """The grouped matmul's efficiency relative to a dense matmul's at `rows` rows per local
  expert (one MoE layer's call on a device): 1 under flat; r / (r + GMM_HALF_ROWS) under rows,
  a kernel's fixed cost per expert tile beside work linear in its rows."""
  if gmm == "flat" or rows <= 0:
    return 1.0
  return rows / (rows + GMM_HALF_ROWS)


# --plan_ici: what a TPU slice's torus gives a group inside it (module docstring)
ICIS = ("dimension",      # one torus dimension's links, whatever the group's size
        "torus")          # the links of every dimension the group spans (ici_dims)
ICI = "torus"
TORUS_RING = 4            # chips along one dimension of the smallest slice a group fills


def ici_dims(group: int, cluster, ici: str = ICI) -> int:
  """How many torus dimensions' links a collective over `group` devices inside a TPU slice runs
  on: 1 under --plan_ici=dimension or off a torus; under torus, the group laid out as compactly
  as slices are (rings of TORUS_RING chips a dimension: 4 chips span one, 16 two, 64 three),
  min(dims, ceil(log_4(chips))), each dimension's rings running at once."""
  if ici == "dimension" or not cluster.torus_dims:
    return 1
  chips = max(1, group // cluster.chip_devices)
  span = math.ceil(math.log(chips, TORUS_RING) - 1e-9) if chips > 1 else 1
  return max(1, min(cluster.torus_dims, span))


def latency_s(key: str, group: int, in_node: int, cluster, ici: str = ICI,
              per_call: float = 0.0) -> float:
  """One collective's fixed time (alpha) over `group` devices of which `in_node` share a node (a
  TPU slice), per_call the seconds its bytes take at the links' bandwidth: the least over the
  cluster's protocols (clusters.Protocol) of its fixed time plus what its share of the bandwidth
  adds to per_call, as NCCL picks one. A ring all-gather or reduce-scatter over n devices on
  `nodes` nodes runs n - 1 steps, nodes - 1 of them between nodes (NCCL's ring); an all-reduce
  twice that, or a tree's 2 (in_node - 1 + log2(nodes)). On a TPU slice the ring runs along each
  torus dimension the group spans (ici_dims): d (r - 1) steps of r chips a dimension, then
  nodes - 1 between slices. An all-to-all posts its sends at once and a collective-permute is
  one send: one step, across nodes where the group crosses them (inside a torus, its diameter,
  d r / 2 hops)."""
  at = (key, group, in_node, id(cluster), ici)
  if at not in _LATENCIES:
    _LATENCIES[at] = (cluster, _protocol_latencies(key.split(" over ")[0], group, in_node,
                                                   cluster, ici))
  return min(fixed + extra * per_call for fixed, extra in _LATENCIES[at][1])


_LATENCIES: dict = {}      # latency_s's cache, by the cluster's id (kept alive beside it)


def _protocol_latencies(kind: str, group: int, in_node: int, cluster, ici: str) -> tuple:
  """latency_s's ((fixed time, 1 / bandwidth share - 1) of each protocol that runs `kind`)."""
  nodes = max(1, group // max(1, in_node))
  if cluster.torus_dims:
    chips = max(1, in_node // cluster.chip_devices)
    d = ici_dims(in_node, cluster, ici)
    r = chips ** (1 / d)
    ring, across = d * (r - 1), d * r / 2
  else:
    ring, across = group - nodes, 1
  out = []
  for p in cluster.protocols:
    if kind in COMBINED:                 # the ring collectives
      k = 2 if kind == "all-reduce" else 1
      if p.tree and kind != "all-reduce":
        continue
      steps = (2 * ((in_node - 1) * p.near + math.log2(nodes) * p.far) if p.tree else
               k * (ring * p.near + (nodes - 1) * p.far))
    elif p.tree:
      continue
    elif kind in EXCHANGES or kind == "collective-permute":
      steps = p.far if nodes > 1 else across * p.near
    else:
      steps = 0.0
    out.append((p.call + steps, 1 / p.share - 1))
  return tuple(out)


def a2a_seconds(wire: float, group: int, top_k: int, cluster, a2a: str) -> float:
  """An all-to-all over `group` devices that crosses nodes, of `wire` bytes a device sends (its
  copies to every other member). flat: all of it at the inter-node bandwidth. hierarchical:
  the group filling whole nodes of cluster.node_size, each token's top_k copies land on
  distinct nodes (uniform over the group's nodes): the bytes to other nodes shrink to one copy
  per distinct remote node, over InfiniBand, while NVLink carries the node's own copies and
  fans the arrivals out; the slower of the two links sets the time."""
  node = cluster.node_size
  if a2a == "flat" or group <= node:
    return wire / cluster.inter_bw
  nodes = group // node
  remote = wire * (group - node) / (group - 1)        # the bytes of copies to other nodes
  copies = top_k * (nodes - 1) / nodes                 # a token's copies to other nodes
  distinct = (nodes - 1) * (1 - (1 - 1 / nodes) ** top_k)   # ... and their distinct nodes
  ib = remote * distinct / copies / cluster.inter_bw
  nvlink = (wire * (node - 1) / (group - 1) + remote) / cluster.intra_bw
  return max(ib, nvlink)


def hidden(cls: str, overlap: str, paired: bool) -> bool:
  """Whether a load of overlap class `cls` runs under compute at --plan_overlap=overlap; paired:
  the candidate's schedule runs two microbatches in a tick."""
  return (cls == "weights" and overlap != "none"
          or cls == "paired" and paired and overlap == "schedule")


# what a collective must add to the step, as a fraction of it, to be named dominant over the
# largest hidden one (render: "(hidden)")
DOMINANT_EXPOSED = 0.01


def timing(c: Candidate, cfg, loads, cluster, efficiency: float,
           overlap: str = OVERLAP, fp8: bool = False, a2a: str = A2A,
           gmm: str = GMM, expert_rows: float = 0.0, ici: str = ICI,
           imbalance: float = IMBALANCE, capped: bool = True) -> None:
  """Fill c's compute, communication (exposed: what overlap leaves on the critical path),
  dominant collective, tokens/s and MFU (module docstring). loads: link_loads of the step's
  cost terms. fp8: the matmuls run in FP8 (a published run's; the suite trains in bf16);
  a2a: A2AS, how a cross-node all-to-all moves its rows; gmm: GMMS, with expert_rows the rows
  per local expert of one MoE layer's call on a device; ici: ICIS, a TPU slice's links;
  imbalance: the busiest device's routed work over the balanced mean, minus 1 (routed_load:
  its grouped matmuls' FLOPs, at the balanced rows' efficiency; the exchanges' bytes are the
  cost model's buffers), capped at c's capacity factor unless capped=False."""
  model_flops = flops_per_step(cfg)
  n = math.prod(s for _, s in c.sizes)
  # forward + backward = 3 forwards; remat block recomputes one, and gradient accumulation's
  # pass 1 runs one more under the batch-wise aux loss (measure.cost.counts_pass)
  extra = (cfg.remat == "block") + (not _pipelined(c.strategy) and cost.counts_pass(cfg))
  work = model_flops / n * (3 + extra) / 3
  shape = dict(c.sizes)
  if _pipelined(c.strategy):
    p, m = shape["stage"], cfg.microbatches
    if _one_f(c.opts):
      # lockstep: its forward-only ticks and those that hold a backward (b forwards long),
      # the counts pre-pass's forward ticks (pp_schedule.stage_passes), each of one chunk (1/v of a
      # stage), against M passes of 1 + b (v = 1: P, 2M+P-2 and M+P-1)
      b, v = (3 if cfg.remat == "block" else 2), _chunks(cfg)
      fwd, bwd, _ = one_f_ticks(p, m, v)
      pre = pp_schedule.stage_passes(cfg, p, c.opts)[1]
      pipe = (fwd + bwd * b + pre) / (v * m * (1 + b))
    else:
      vm = _chunks(cfg) * m                                      # ticks of 1/v (interleaved)
      pipe = (vm + p - 1) / vm
    # every stage runs a chunk each tick, and the tick lasts as long as the slowest chunk
    pipe *= slowest_chunk(cfg, p)
    work *= (1 - _dense_flops_share(cfg)) * pipe + _dense_flops_share(cfg) * p
  # the matmuls at the FP8 peak where the run is FP8, the attention core (softmax(q k^T) v) at
  # bf16's; the routed experts' grouped matmuls at gmm_efficiency of the others'
  a, r = attention_share(cfg), routed_share(cfg)
  c.expert_rows = expert_rows
  mm_peak = cluster.fp8_flops if fp8 and cluster.fp8_flops else cluster.peak_flops
  load = routed_load(imbalance, c.capacity_factor, capped)
  c.compute_s = work * (a / cluster.peak_flops + (1 - a - r) / mm_peak
                        + r * load / (mm_peak * gmm_efficiency(expert_rows, gmm))) / efficiency
  own: dict = {}                # collective -> its time; under: of it, what runs under compute
  under_of: dict = {}
  paired = _pipelined(c.strategy) and _one_f(c.opts)
  under = exposed = c.latency_s = 0.0
  for key, axes, wire, cls, *calls in loads:  # the node's links where every axis lies inside
    group = math.prod(shape[a] for a in axes)
    if all(a in c.inner for a in axes):
      t = wire / (cluster.intra_bw * ici_dims(group, cluster, ici))
    elif cls == "paired":                # the tokens' exchange (overlap_class)
      t = a2a_seconds(wire, group, cfg.top_k, cluster, a2a)
    else:
      t = wire / cluster.inter_bw
    if calls and calls[0]:               # each collective's fixed time (alpha)
      in_node = math.prod(shape[a] for a in axes if a in c.inner)
      alpha = calls[0] * latency_s(key, group, in_node, cluster, ici, t / calls[0])
      c.latency_s += alpha
      t += alpha
    own[key] = own.get(key, 0.0) + t
    if hidden(cls, overlap, paired):
      under_of[key] = under_of.get(key, 0.0) + t
      under += t
    else:
      exposed += t
  # what runs under compute is hidden up to the compute's length; the rest is exposed
  c.serial_comm_s = under + exposed
  c.comm_s = exposed + max(0.0, under - c.compute_s)
  # the dominant collective: the one that adds the most time to the step (the first of a tie),
  # a hidden one adding its share of what overflows the compute; where none adds
  # DOMINANT_EXPOSED of the step, the largest by its own time, marked hidden
  overflow = max(0.0, under - c.compute_s) / under if under else 0.0
  adds = {k: t - under_of.get(k, 0.0) * (1 - overflow) for k, t in own.items()}
  if own:
    key = max(adds, key=adds.get)
    c.dominant_hidden = adds[key] < DOMINANT_EXPOSED * c.step_s
    if c.dominant_hidden:
      key = max(own, key=own.get)
    c.dominant, c.dominant_s = key, own[key]
  c.tokens_per_s = cfg.batch * cfg.seq_len / c.step_s / n
  c.mfu = model_flops / (c.step_s * n * cluster.peak_flops)


def enumerate_candidates(cfg, n: int, cluster, hbm_bytes: float, names=NAMES,
                         remats=REMATS, capacity_factors=CAPACITY_FACTORS,
                         pp_max_microbatches=PP_MAX_MICROBATCHES,
                         accum_max_microbatches=ACCUM_MAX_MICROBATCHES,
                         efficiency: float = EFFICIENCY, overlap: str = OVERLAP,
                         fp8: bool = False, a2a: str = A2A, gmm: str = GMM, ici: str = ICI,
                         imbalance: float = IMBALANCE, capped: bool = True,
                         latency: bool = True, progress=None,
                         microbatches: int | None = None, only_mesh: dict | None = None,
                         options: dict | None = None) -> list[Candidate]:
  """Every candidate of the grid (module docstring), predicted; refused ones carry `error`
  (check()'s one line) and no prediction. overlap, fp8, a2a, gmm, ici, imbalance, capped:
  `timing`'s; latency: each collective's fixed time (`latency_s`), else its bytes alone.
  progress: called as progress(done, name, kept) now and then. The user's constraints
  (planning/constraints.py):
  microbatches, one M in place of the divisors; only_mesh, {axis: size} in place of every
  split of n (a strategy without one of its axes is skipped); options, {strategy: [Options]}
  in place of option_sets(strategy)."""
  shapes = model.init_params_shapes(cfg)
  out, last = [], time.perf_counter()
  for name in names:
    strat = strategies.get(name)
    if only_mesh and not set(only_mesh) <= set(strat.AXES):
      continue
    inside = getattr(strat, "PLAN_INSIDE_NODE", ())   # axes it enumerates up to a node only
    long_only = getattr(strat, "PLAN_MIN_SEQ", {})   # axes it splits only from a sequence length
    for sizes in ([tuple(only_mesh.get(a, 1) for a in strat.AXES)] if only_mesh else
                  mesh_lib.splits(n, len(strat.AXES))):
      shape = dict(zip(strat.AXES, sizes))
      if not only_mesh and any(shape[a] > min(cluster.node_size, NODE_TP) for a in inside):
        continue
      if not only_mesh and any(shape[a] > 1 and cfg.seq_len < length
                               for a, length in long_only.items()):
        continue
      mesh = mesh_lib.abstract_mesh(shape, cluster.platform)
      mems = {}                                # params + optimizer state per stored model
      layers = _layer_layout(name, cfg, shape)
      m_cfg = cfg.replace(layer_layout=layers)
      m_shapes = shapes if not layers else model.init_params_shapes(m_cfg)
      for opts in (options[name] if options and name in options else
                   option_sets(name, cluster.platform)):
        # the model as this option set stores it (pp interleaved: round-robin chunks), from
        # the model as given (its own layout)
        o_cfg, o_error = m_cfg, ""
        try:
          stored = strategies.stored_config(strat, cfg, mesh, opts)
          o_cfg = m_cfg if stored is cfg else stored
        except ConfigError as e:
          o_error = str(e)
        o_layers = o_cfg.layer_layout
        for m in ([microbatches] if microbatches else
                  _pp_microbatches(cfg, shape, pp_max_microbatches) if _pipelined(name) else
                  _accum_microbatches(cfg, strat, mesh, accum_max_microbatches)):
          for cf in capacity_factors:
            base = o_cfg.replace(microbatches=m, capacity_factor=cf)
            key = (name, tuple(shape.items()), m, cf, opts)
            try:
              if o_error:
                raise ConfigError(o_error)
              base.validate()
              strat.check(base, mesh, opts)
              # as runtime.train.build: each microbatch sharded like the batch (a fixed M,
              # planning/constraints.py, may not divide a batch shard)
              mesh_lib.require_microbatches(base, mesh, strat.batch_spec(base, mesh))
            except ConfigError as e:
              out += [Candidate(*key[:3], remat, cf, opts, error=str(e), layer_layout=o_layers,
                                layer_stages=o_cfg.layer_stages)
                      for remat in remats]
              continue
            if (o_cfg, opts) not in mems:          # opts may store the params (ep_x_tp's zero1)
              o_shapes = m_shapes if o_cfg is m_cfg else model.init_params_shapes(o_cfg)
              specs = strat.param_specs(o_cfg, mesh, opts)
              # the routed experts a device holds, and the shards of their hidden width
              wi = specs["layers"]["moe"]["wi_0"]
              mems[o_cfg, opts] = (cost.param_memory(o_shapes, specs, mesh, cfg.optimizer),
                                   o_cfg.n_experts / _dim_shards(wi, 1, mesh),
                                   _dim_shards(wi, 3, mesh))
            o_mem, local_e, f_split = mems[o_cfg, opts]
            lay = strat.layout(base, mesh, opts)
            raw = strat.cost(cost.microbatch(base, lay), mesh, opts)   # what cost.finish reads
            for remat in remats:
              c_cfg = base.replace(remat=remat)
              terms = cost.finish(raw, c_cfg, mesh, lay)               # cost.step_terms
              loads = (step_loads(terms, c_cfg, name, shape, opts, cluster.merges) if latency
                       else link_loads(terms))
              feats = step_features(name, c_cfg, mesh, raw, opts, o_mem["param_bytes"])
              temp = predict_temp(feats, cluster.temp_model)
              rows = balanced_rows(c_cfg, shape, local_e, f_split)
              for inner in placements(shape, cluster.node_size):
                c = Candidate(*key[:3], remat, cf, opts, inner,
                              param_opt=o_mem["param_bytes"] + o_mem["opt_bytes"], temp=temp,
                              layer_layout=o_layers, layer_stages=o_cfg.layer_stages)
                timing(c, c_cfg, loads, cluster, efficiency, overlap, fp8, a2a, gmm, rows,
                       ici, imbalance, capped)
                c.fits = c.memory <= hbm_bytes
                out.append(c)
      if progress is not None and time.perf_counter() - last > 2:
        progress(len(out), name, sum(1 for c in out if not c.error))
        last = time.perf_counter()
  return out


def _layer_layout(name: str, cfg, shape: dict) -> str:
  """pp on a stage count that does not divide the MoE layers: the balanced uneven layout
  (modeling.config.balanced_layout; the larger stages first). "" otherwise."""
  p = shape.get("stage", 1)
  if not _pipelined(name) or cfg.layer_layout or cfg.n_moe_layers % p == 0 or p > cfg.n_moe_layers:
    return cfg.layer_layout
  from modeling.config import balanced_layout
  return balanced_layout(cfg.n_moe_layers, p)


def _accum_microbatches(cfg, strat, mesh, most: int) -> list[int]:
  """Gradient accumulation's M outside pp: 1 and every divisor of the sequences one batch shard
  holds, up to `most` (mesh.require_microbatches: each microbatch is sharded like the batch)."""
  return _divisors(cfg.batch // spec_shards(strat.batch_spec(cfg, mesh), mesh), most)


def _pp_microbatches(cfg, shape: dict, most: int) -> list[int]:
  """pp's M: every divisor of the sequences one (data, expert) shard holds, up to `most` (a
  batch the shard does not divide gets M = 1, for check() to refuse)."""
  b, rest = divmod(cfg.batch, shape.get("data", 1) * shape.get("expert", 1))
  return [1] if rest else _divisors(b, most)


def _divisors(b: int, most: int) -> list[int]:
  """Every divisor of b up to `most` ([1] when b < 1)."""
  return [m for m in range(1, min(b, most) + 1) if b % m == 0] or [1]


def rank(cands: list[Candidate]) -> list[Candidate]:
  """The admitted candidates, those that fit first, each group by predicted step time (then
  memory)."""
  return sorted((c for c in cands if not c.error),
                key=lambda c: (not c.fits, c.step_s, c.memory))


def config_for(c: Candidate, cfg):
  """The Config a candidate runs: its microbatches, remat and capacity factor."""
  return cfg.replace(microbatches=c.microbatches, remat=c.remat,
                     capacity_factor=c.capacity_factor, layer_layout=c.layer_layout,
                     layer_stages=c.layer_stages)


def features(name: str, cfg, mesh, opts) -> tuple[dict, dict]:
  """A step's temp-model features (step_features, as enumerate_candidates computes them) and
  its measure.cost.param_memory, for calibrate.py's rows."""
  strat = strategies.get(name)
  mem = cost.param_memory(model.init_params_shapes(cfg), strat.param_specs(cfg, mesh, opts), mesh,
                          cfg.optimizer)
  raw = strat.cost(per_microbatch(name, cfg), mesh, opts)
  return step_features(name, cfg, mesh, raw, opts, mem["param_bytes"]), mem


def candidate_features(c: Candidate, cfg) -> dict:
  """features of a candidate, on its abstract mesh."""
  return features(c.strategy, config_for(c, cfg), mesh_lib.abstract_mesh(dict(c.sizes)),
                  c.opts)[0]


def progress_line(done: int, name: str, kept: int) -> None:
  print(f"  ... {done} candidates so far ({kept} admitted), at {name}", file=sys.stderr,
        flush=True)


_MICROBATCHES = re.compile(r", x(\d+) microbatches")


@functools.lru_cache(maxsize=4096)
def _issued(what: str, phase: str, params: str) -> tuple[int, bool]:
  """(gradient accumulation's M where a term `what` is one microbatch's, else 1; whether it is
  issued once per step or microbatch: measure.cost.per_step)."""
  m = _MICROBATCHES.search(what)
  return (int(m.group(1)) if m else 1,
          cost.per_step(cost.Term("", phase, what, 0.0, (), 1, params=params)))


def layer_counts(cfg) -> dict:
  """calls_of's layers: a term's layer runs per pass by its parameter group ("" for the rest)."""
  return {"dense_layers": cfg.n_dense_layers, "layers": cfg.n_moe_layers, "": cfg.n_layers}


def calls_of(t, layers: dict, runs: float = 1.0, merged: bool = False) -> float:
  """How many collectives cost term t counts over the step: t.calls where its site counts
  them (the token exchange's, the K/V exchange's, pp's stage sends, a weight's), else one per
  layer run (`layer_counts`, x runs a layer: `_runs`; the MoE layers for an exchange; once per
  step for a per-step term: measure.cost.per_step), x gradient accumulation's M where the term
  is one microbatch's. merged: the times it is issued, the collectives of one issue merged
  into one (the router statistics' three), at most one per layer run."""
  if t.calls and not merged:
    return t.calls
  k, once = _issued(t.what, t.phase, t.params)
  if once:
    return k
  group = "layers" if t.kind in EXCHANGES else t.params if t.params in layers else ""
  issues = k * layers[group] * runs
  return min(t.calls, issues) if t.calls else issues


def step_loads(terms, cfg, name: str, shape: dict, opts=None, merges: tuple = COMBINED) -> tuple:
  """link_loads of a candidate's step terms, each load with its collectives (calls_of)."""
  layers, runs = layer_counts(cfg), _runs(name, cfg, shape, opts)
  return link_loads(terms, lambda t, merged=False: calls_of(t, layers, runs, merged), merges)


def term_calls(terms, cfg, name: str, shape: dict, opts=None, merges: tuple = ()) -> dict:
  """{(kind, frozenset(axes)): collectives per step}, the key of
  measure.hlo.collective_stats_by_axes: each term's calls_of, the kinds `merges` names merged
  as link_loads counts them (() for XLA:CPU, which merges none; clusters.Cluster.merges)."""
  out: dict = {}
  if merges:
    for t in terms:
      out.setdefault((t.kind, frozenset(t.axes)), 0.0)
    for key, axes, _, _, n in step_loads(terms, cfg, name, shape, opts, merges):
      kind = key.split(" over ")[0]
      out[(kind, frozenset(axes))] += n
    return out
  layers, runs = layer_counts(cfg), _runs(name, cfg, shape, opts)
  for t in terms:
    key = (t.kind, frozenset(t.axes))
    out[key] = out.get(key, 0.0) + calls_of(t, layers, runs)
  return out
