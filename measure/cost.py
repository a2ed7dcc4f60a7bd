"""Analytic cost model: collective bytes and per-device memory from the config and mesh.

Each strategy's `cost(cfg, mesh)` returns a list of `Term`s built from the helpers below; this
module never branches on a strategy name. A Term's `bytes` is the per-device RESULT size of the
collective summed over the whole train step — the same quantity measure.hlo reports, so model and
compiled program compare directly:
  all-gather -> gathered size, reduce-scatter -> scattered size, all-reduce -> full size,
  all-to-all -> the local buffer, collective-permute -> the buffer.
`wire_bytes` turns that into bytes a device actually sends (ring algorithms):
  all-gather r(n-1)/n, reduce-scatter r(n-1), all-reduce 2r(n-1)/n, all-to-all r(n-1)/n.

Bytes follow the dtype that crosses the wire (`act_bytes`, `weight_bytes`): activations and
exchanges in the compute dtype, gathered weights in it too (cast on the shard), weight-gradient
sums in grad_reduce_dtype, router / norms / statistics always float32.
One-line formulas (per device per step, f32 = 4 B, L layers, n = the axis size):
  FSDP all-gather of W           = bytes(W) per use (fwd; the bwd re-gather is CSE'd into the fwd one)
  FSDP grad reduce-scatter of W  = bytes(W)/n
  DP grad all-reduce             = bytes(replicated grads), combined into few ops by XLA
  EP all-to-all (padded)         = 2 (dispatch+combine) x 2 (fwd+bwd) x EP x C x D x 4 per layer
  TP all-reduce                  = 2 x B_loc x S x D x 4 per layer per row-parallel matmul (fwd+bwd)
  CP K/V all-gather              = 2 (K,V) x B_loc x S x KV x Dh x 4 per layer fwd (+ the bwd RS)
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.sharding import PartitionSpec as P

from measure import hlo
from parallel.sharding import axis_size, dim_axes, entry_axes, spec_axes, spec_shards

F32 = 4


@dataclasses.dataclass(frozen=True)
class Term:
  kind: str        # one of hlo.COLLECTIVE_KINDS
  phase: str       # "fwd" | "bwd" | "opt" | "step"
  what: str        # short description, e.g. "attn wq all-gather over fsdp"
  bytes: float     # per-device result bytes summed over the train step
  axes: tuple      # the mesh axes its groups span (size-1 axes dropped)
  group: int       # devices in one group: the product of those axes' sizes
  remat: tuple = ()  # the --remat policies whose backward issues it again (`step_terms`)
  params: str = ""   # a weight term's parameter group (weight_terms: "dense_layers", ...)
  calls: float = 0.0  # the collectives it counts over the step, where its site states them (0:
                      # one a layer run, planning.plan.calls_of)
  moved: float = 0.0  # where the data sets what moves (a ragged exchange: the routed rows, not
                      # its static buffer), the bytes balanced routing moves; 0: `bytes`

  @property
  def wire_bytes(self) -> float:
    """What a device sends for this term: hlo.wire_factor of its group size."""
    return self.bytes * hlo.wire_factor(self.kind, self.group)

  @property
  def sent_bytes(self) -> float:
    """What a device sends when the routing is balanced: wire_bytes, of `moved` where set (the
    planner's time; the compiled program's bytes are the buffer's, wire_bytes)."""
    return (self.moved or self.bytes) * hlo.wire_factor(self.kind, self.group)


def term(mesh, kind: str, phase: str, what: str, nbytes: float, axes, remat=(),
         params: str = "", calls: float = 0.0, moved: float = 0.0) -> list[Term]:
  """[Term] over mesh `axes` (a name or a tuple), or [] when they hold one device (nothing
  moves, and XLA emits nothing). remat: RECOMPUTED / BLOCK_ONLY for a forward collective inside
  the layer that --remat's recompute issues again; calls: the collectives nbytes adds up, where
  the caller counts them (Term.calls); moved: Term.moved."""
  axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if mesh.shape[a] > 1)
  if not axes or not nbytes:
    return []
  return [Term(kind, phase, what, nbytes, axes, axis_size(mesh, *axes), remat,
               params, calls, moved)]


# --remat recomputes each layer's forward inside the backward, collectives included, except what
# the policy saves and what no gradient needs (measured per strategy on tiny: tests/test_remat.py)
RECOMPUTED = ("block", "dots_saveable", "dots_with_no_batch_dims_saveable")  # weight gathers,
                                      # token exchanges, K/V gathers: no policy saves them
BLOCK_ONLY = ("block",)               # the reduction a row-parallel matmul ends in: a dot's
                                      # output, which the dots_* policies keep
# (the collective producing the layer's output is never re-issued: its own backward does not
# read it; nor are the router statistics, but for the sequence-wise loss's counts: stats_terms)


def step_terms(strategy, cfg, mesh, opts=None) -> list[Term]:
  """The strategy's cost model for the step as compiled: its terms, plus a backward copy of each
  forward term that cfg.remat's recompute issues again. opts: its Options (None = defaults).

  Gradient accumulation (cfg.microbatches = M > 1, runtime.train.accumulated_grads; pp runs its
  own microbatches and prices them in its cost): each microbatch is a whole forward and backward
  of B/M sequences, so the step is M times the cost of a B/M-sequence step, weight gathers and
  gradient reductions included (each microbatch's gradient is summed over the devices before
  the carry adds it), except the once-per-step "opt" terms. The batch-wise aux loss adds pass
  1: a forward of every microbatch for the step's counts, M more of its forward terms but the
  head's, and its statistics change (`accumulated`)."""
  opts = strategy.Options() if opts is None else opts
  lay = strategy.layout(cfg, mesh, opts)
  return finish(strategy.cost(microbatch(cfg, lay), mesh, opts), cfg, mesh, lay)


def accumulates(cfg, lay) -> bool:
  """The step accumulates gradients over cfg.microbatches forwards of the layout's model (a
  layout that runs the whole loss, pp's, runs its own microbatches)."""
  return cfg.microbatches > 1 and lay.loss is None


def microbatch(cfg, lay):
  """The config whose strategy.cost `finish` reads: one microbatch's (B/M sequences) where the
  step accumulates gradients, else the step's."""
  if not accumulates(cfg, lay):
    return cfg
  return cfg.replace(batch=cfg.batch // cfg.microbatches, microbatches=1)


def finish(raw, cfg, mesh, lay) -> list[Term]:
  """step_terms from raw, the strategy's cost of microbatch(cfg, lay): the CE sum's own
  reductions (`with_ce`), gradient accumulation (`accumulated`) or remat's copies."""
  if accumulates(cfg, lay):
    return accumulated(raw, cfg, mesh, lay)
  terms = with_ce(raw, mesh, lay)
  return terms + recomputed(terms, cfg)


def with_ce(terms, mesh, lay) -> list[Term]:
  """terms with the CE sum of each forward's statistics (STATS) reduced as XLA reduces the mean
  of the [B, S] losses: over the residual's sequence axes, then its batch axes (`ce_terms`)."""
  return terms + [t for s in terms if s.what == STATS for t in ce_terms(mesh, lay, s.axes)]


def accumulated(per_mb, cfg, mesh, lay) -> list[Term]:
  """step_terms of gradient accumulation from the cost of one microbatch's step (B/M sequences,
  without remat's copies): M of its forward and backward terms with their recompute, pass 1's
  forwards under the batch-wise aux loss, and its once-per-step "opt" terms. mesh, lay: the
  step's mesh and the strategy's model.Parallelism (runtime.train.accumulated_grads).
  Under the batch-wise loss:
    pass 1 wants the router counts alone: XLA removes the head (its weights' gathers, HEAD_ROLES)
      and the other statistics, so its forwards all-reduce the counts [L, E] (COUNTS);
    pass 2 takes the step's counts as given, so its own are dead: per MoE layer it all-reduces
      P [E] and z (ACCUMULATED) and the dropped counts over the token axes, and the CE sum over
      the residual's sequence axes, then its batch axes (`ce_terms`).

  A layout that gathers its weights once per step (lay.gathers_once, ZeRO-1) gathers them once
  for both passes and reduce-scatters (and all-reduces) their summed gradients once. In float32
  (no cast before a gather) XLA hoists the gathers of the leaves outside the layer stack
  (OUTSIDE_ROLES) out of the microbatch loop and shares them with pass 1, those of the stacked
  layers that run in scans of one step (no loop: `unlooped_share`), and the dropped counts'
  constant all-reduce (HOISTED): once per step."""
  m = cfg.microbatches
  times = lambda ts, k, note: [dataclasses.replace(t, bytes=t.bytes * k, calls=t.calls * k,
                                                  moved=t.moved * k, what=t.what + note)
                               for t in ts]
  step = [t for t in per_mb if t.phase != "opt"]
  opt = [t for t in per_mb if t.phase == "opt"]
  once = []
  if lay.gathers_once:
    roles = {weight_role(t) for t in step if is_weight_gather(t)}
    once = [t for t in step if is_weight_gather(t) or (t.phase == "bwd" and t.what.endswith(
        " grads") and weight_role(t) in roles)]
  elif not cfg.mixed:
    once = [t for t in step if (is_weight_gather(t) and weight_role(t) in OUTSIDE_ROLES)
            or t.what == HOISTED]
    # a stacked leaf's gathers in runs of one scan step: their share of its bytes, once; the
    # rest per microbatch
    share = [unlooped_share(cfg, t.params) if is_weight_gather(t) else 0.0 for t in step]
    part = lambda t, k: dataclasses.replace(t, bytes=t.bytes * k, calls=t.calls * k,
                                            moved=t.moved * k)
    once += [part(t, k) for t, k in zip(step, share) if k]
    step = [part(t, 1 - k) if k else t for t, k in zip(step, share) if k < 1]
  once_ids = {id(t) for t in once}    # `once` takes every term its predicates name: equal ones too
  step = [t for t in step if id(t) not in once_ids]
  pass1 = []
  if counts_pass(cfg):
    stats = lambda ts, which: [dataclasses.replace(t, bytes=stats_bytes(cfg, which),
                                                   calls=stats_calls(cfg, which))
                               if t.what == STATS else t for t in ts]
    pass1 = stats([t for t in step if t.phase == "fwd" and t.what not in (DROPPED, HOISTED)
                   and not (is_weight_gather(t) and weight_role(t) in HEAD_ROLES)], COUNTS)
    step = stats(step, ACCUMULATED)                                         # pass 2's
  step = with_ce(step, mesh, lay)
  return (times(step + recomputed(step, cfg), m, f", x{m} microbatches")
          + times(pass1, m, ", counts pass") + times(once, 1, ", once per step") + opt)


def ce_terms(mesh, lay, token_axes) -> list[Term]:
  """A forward's CE sum (`with_ce`), one float32: the mean of the [B, S] losses, laid out as the
  residual [B, S, D] (lay.x), all-reduced over the axes of token_axes splitting its sequence
  dim, then over those splitting its batch dim (all of token_axes at once where the layout
  leaves x unstated)."""
  if lay.x is None:
    return term(mesh, "all-reduce", "fwd", "CE sum", F32, token_axes)
  split = lambda d: tuple(a for a in dim_axes(lay.x, d) if a in token_axes)
  return [t for axes in (split(1), split(0)) if axes
          for t in term(mesh, "all-reduce", "fwd", "CE sum", F32, axes)]


# The head: what a forward runs after the layers, dead where only the router counts are wanted
HEAD_ROLES = ("final_norm", "unembed")
# The leaves outside the layer stack, gathered whole once per forward
OUTSIDE_ROLES = ("embed", "unembed")


# Terms a step issues a fixed number of times whatever its depth (per step or per microbatch):
# the loss and norm sums, the grad norm, the hoisted dropped count (HOISTED, up to its comma),
# and pipeline's stage-to-stage sends (strategies/pp.py)
PER_STEP_WHATS = ("CE sum", "grad norm", "dropped count", "aux / z / dropped sums",
                  "activations to the next stage", "cotangents to the previous stage")


def per_step(t: Term) -> bool:
  """A term that is not issued by each layer: the optimizer's, the weights outside the layer
  stack (embed, unembed, final norm), those the step gathers once (ZeRO-1, hoisted), and
  PER_STEP_WHATS. The rest grow with the layers (--breakdown's per-layer column)."""
  return (t.phase == "opt" or t.params in OUTSIDE_ROLES + ("final_norm",)
          or "once per step" in t.what or t.what.split(",")[0] in PER_STEP_WHATS)


def is_weight_gather(t: Term) -> bool:
  """A forward all-gather of a weight before its use (weight_terms' "<role> gathered")."""
  return t.kind == "all-gather" and t.phase == "fwd" and t.what.endswith("gathered")


def weight_role(t: Term) -> str:
  """The role a weight_terms term moves ("<role> gathered", "<role> grads")."""
  return t.what.split()[0]


def unlooped_share(cfg, group: str) -> float:
  """The share of a stacked param group's rows ("dense_layers", "layers"; 0 for any other
  group) whose layers run in a scan of one step (config.layer_segments): XLA unrolls those, so
  their weights' gathers are loop-invariant (a one-layer DeepSeek prefix; a stack of one
  period, as gpt-oss-test's)."""
  if group not in ("dense_layers", "layers") or cfg.layer_layout:
    return 0.0
  is_moe = group == "layers"
  rows = [(reps, reps * sum(1 for _, m in period if m == is_moe))
          for period, reps in cfg.layer_segments]
  total = sum(n for _, n in rows)
  return sum(n for reps, n in rows if reps == 1) / total if total else 0.0


def counts_pass(cfg) -> bool:
  """Gradient accumulation runs pass 1, a forward of every microbatch for the step's expert
  counts, when the aux loss is batch-wise (runtime.train.accumulated_grads)."""
  return cfg.microbatches > 1 and cfg.aux_loss_kind == "batch" and bool(cfg.aux_loss_coef)


def recomputed(terms, cfg) -> list[Term]:
  """A backward copy of each forward term that cfg.remat's recompute issues again."""
  return [dataclasses.replace(t, phase="bwd", what=f"{t.what}, recomputed", remat=())
          for t in terms if cfg.remat in t.remat]


# ----------------------------------------------------------------------------- dtypes on the wire
_ITEMSIZE = {"float32": 4, "bfloat16": 2}


def act_bytes(cfg) -> int:
  """Bytes per element of an activation (and its cotangent) on the wire: the compute dtype."""
  return _ITEMSIZE[cfg.dtype]


def weight_bytes(cfg, role: str) -> tuple[int, int]:
  """(a weight's bytes per element when gathered, its gradient's when summed) for a role:
  mixed precision gathers cfg.dtype (cast on the shard first) and sums grad_reduce_dtype;
  model.KEEP_F32 roles (norms, router, bias) and float32 runs move float32 both ways."""
  from modeling import model
  if not cfg.mixed or role in model.KEEP_F32:
    return F32, F32
  return _ITEMSIZE[cfg.dtype], _ITEMSIZE[cfg.grad_reduce_dtype]


def totals(terms: list[Term]) -> dict[str, float]:
  out = {k: 0.0 for k in hlo.COLLECTIVE_KINDS}
  for t in terms:
    out[t.kind] += t.bytes
  return out


def by_axes(terms: list[Term]) -> dict[tuple[str, frozenset], float]:
  """{(kind, frozenset(axes)): bytes}: the key measure.hlo.collective_stats_by_axes uses."""
  out: dict = {}
  for t in terms:
    key = (t.kind, frozenset(t.axes))
    out[key] = out.get(key, 0.0) + t.bytes
  return out


def versus(terms: list[Term], measured: dict, by: str = "kind") -> dict:
  """Predicted against measured bytes for every key either side has. by="kind": measured is
  hlo.collective_stats; by="axes": hlo.collective_stats_by_axes, keys (kind, frozenset(axes)).
  -> {key: {predicted, measured, ratio}}."""
  pred = by_axes(terms) if by == "axes" else totals(terms)
  out = {}
  for k in sorted(set(pred) | set(measured), key=str):
    p, m = pred.get(k, 0.0), measured.get(k, {}).get("bytes", 0)
    if p or m:
      out[k] = {"predicted": p, "measured": m, "ratio": (m / p) if p else float("inf")}
  return out


def nbytes(shape, itemsize: int = F32) -> int:
  return int(math.prod(shape)) * itemsize


def param_memory(param_shapes, specs, mesh, optimizer: str) -> dict[str, float]:
  """Per-device bytes of params and optimizer state from the param specs (mesh None: one
  device, everything whole).

  AdamW keeps 2 f32 moments per param; Muon keeps 1 momentum for its matrices and AdamW's 2
  moments for the rest (the roles in modeling.optim.MUON_ROLES)."""
  from modeling import optim
  flat = jax.tree.leaves(param_shapes, is_leaf=lambda l: hasattr(l, "role"))
  flat_specs = ([None] * len(flat) if mesh is None else
                jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
  params = opt = 0.0
  for leaf, spec in zip(flat, flat_specs):
    b = nbytes(leaf.shape) / (1 if mesh is None else spec_shards(spec, mesh))
    params += b
    if optimizer == "muon" and leaf.role in optim.MUON_ROLES:
      opt += b
    else:
      opt += 2 * b
  return {"param_bytes": params, "opt_bytes": opt}


def weight_terms(cfg, mesh, specs, grad_axes, gathered=None, grads=None,
                 once=False) -> list[Term]:
  """The weight traffic of a train step, derived once for every strategy from each parameter's
  role, stored spec (`specs`, the strategy's param_specs) and how the step uses it:

    gathered[role] = (used_spec, g), or a function of the leaf's stored spec returning them (a
      role whose leaves are stored differently: pp's MoE stack and dense prefix): the weight
      is all-gathered to used_spec before use
      (parallel.sharding.gather_weight(w, used_spec, g)): per dim stored on axes it is not used
      on, an all-gather over them (fwd; the minor dim first, each op's bytes the size it gathers
      to); its gradient comes back reduce-scattered over them (bwd; the major dim first, as
      gather_weight's backward runs) and is all-reduced over the rest of g (the stored size).
    otherwise the weight is used as stored: its gradient is a partial sum over the grad axes it
      is not split over, all-reduced at the stored size. grads[role] overrides `grad_axes` for a
      role; a tuple of axis tuples is reduced one group after the other (XLA splits the sum of
      a norm scale that meets a batch- and sequence-sharded activation: sequence axes first).
  once: the gathers run once per step outside the layers (pp, zero1), so --remat never
  re-issues them, and a gathered leaf's collectives are one a step; else a stacked leaf's are
  one a layer (its rows).
  Plus the gradient norm: one scalar all-reduced over every mesh axis (runtime.train.global_norm).
  The router bias gets no gradient (stop_gradient), hence no traffic."""
  from modeling import model
  gathered, grads = gathered or {}, grads or {}
  leaves = model.param_leaves(cfg, with_paths=True)
  flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  out = []
  for (path, leaf), spec in zip(leaves, flat_specs):
    stack = path[0].key                                    # "dense_layers", "layers", ..
    calls = (1 if (once and leaf.role in gathered) or stack not in ("dense_layers", "layers")
             else leaf.shape[0])
    place = functools.partial(term, params=stack, calls=calls)
    if leaf.role == "bias":
      continue
    w_size, g_size = weight_bytes(cfg, leaf.role)
    full, grad, stored = nbytes(leaf.shape, w_size), nbytes(leaf.shape, g_size), spec_axes(spec)
    local = grad / spec_shards(spec, mesh)
    if leaf.role in gathered:
      used, g = _used(gathered[leaf.role], spec)
      moves = [m for m in (tuple(a for a in entry_axes(e) if a not in spec_axes(used))
                           for e in spec) if m]                  # per dim, major first
      shards = spec_shards(spec, mesh)
      for m in reversed(moves):
        shards //= axis_size(mesh, *m)
        out += place(mesh, "all-gather", "fwd", f"{leaf.role} gathered", full / shards, m,
                    RECOMPUTED if leaf.role in model.LAYER_ROLES and not once else ())
      for m in moves:
        shards *= axis_size(mesh, *m)
        out += place(mesh, "reduce-scatter", "bwd", f"{leaf.role} grads", grad / shards, m)
      moved = {a for m in moves for a in m}
      groups = (tuple(a for a in g if a not in moved),)
    else:
      g = grads.get(leaf.role, grad_axes)
      groups = g if g and not isinstance(g[0], str) else (tuple(g),)
    for group in groups:
      out += place(mesh, "all-reduce", "bwd", f"{leaf.role} grads",
                  local, tuple(a for a in group if a not in stored))
  return out + term(mesh, "all-reduce", "opt", "grad norm", F32, tuple(mesh.axis_names))


def _used(entry, spec) -> tuple:
  """weight_terms' gathered[role] for one leaf: (used_spec, g), or a function of its spec."""
  return entry(spec) if callable(entry) else entry


def muon_terms(cfg, mesh, specs, axes) -> list[Term]:
  """Muon's Newton-Schulz runs on whole matrices (modeling.optim.orthogonalize): each Muon leaf
  whose matrix dims are stored split over some of `axes` has its float32 direction all-gathered
  over them once per step (the batch dims, layers and experts, stay split), one all-gather per
  split dim, the minor dim first, each op's bytes the size it gathers to. [] unless Muon."""
  from modeling import model, optim
  if cfg.optimizer != "muon":
    return []
  flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  out = []
  for leaf, spec in zip(model.param_leaves(cfg), flat):
    if leaf.role not in optim.MUON_ROLES:
      continue
    dims = optim.muon_dims(leaf.role)
    shift = 1 if leaf.role in model.LAYER_ROLES else 0
    matrix = {d + shift for d in dims.reduction_axis + dims.output_axis}
    entries = tuple(spec) + (None,) * (len(leaf.shape) - len(spec))
    moves = [m for m in (tuple(a for a in entry_axes(entries[d]) if a in axes)
                         for d in sorted(matrix)) if m]                   # per matrix dim
    size = nbytes(leaf.shape) / spec_shards(spec, mesh)                 # the stored shard
    for m in reversed(moves):           # one all-gather per split dim, the minor first
      size *= axis_size(mesh, *m)
      out += term(mesh, "all-gather", "opt", f"{leaf.role} whole for Newton-Schulz", size, m)
  return out


def fsdp_gathered(grad_axes) -> dict:
  """weight_terms' `gathered` for layout.fsdp.use: every D-sharded role gathered whole, its
  gradient a partial sum over grad_axes."""
  from modeling import model
  return {role: (P(), _tuple(grad_axes)) for role in model.D_DIM}


def cp_norm_grads(cp_axis: str, batch_axes) -> dict:
  """weight_terms' `grads` for the norm scales under CP: XLA sums their gradient over the
  sequence axis first, then over the batch axes."""
  from modeling import model
  return {role: ((cp_axis,), _tuple(batch_axes)) for role in model.NORMS}


def kv_values(cfg) -> int:
  """Values per token that context parallelism gathers per layer: K and V (GQA, 2 x KV x Dh),
  or MLA's latent and shared RoPE key (kv_lora + rope; modeling.model.mla)."""
  return (cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.mla
          else 2 * cfg.n_kv_heads * cfg.head_dim)


def attn_gather_values(cfg) -> int:
  """Values per token a sequence- or tensor-parallel attention gathers (gather_in): the normed
  h (GQA, D), or MLA's latents after its token-local down-projections (normed c_Q, or h when
  q_lora_rank = 0, then normed c_KV and the RoPE key; modeling.model.mla)."""
  if not cfg.mla:
    return cfg.d_model
  return (cfg.q_lora_rank or cfg.d_model) + cfg.kv_lora_rank + cfg.qk_rope_head_dim


def cp_terms(cfg, mesh, cp_axis: str, batch_axes, ring: bool = False) -> list[Term]:
  """K and V (MLA: the latent and RoPE key) all-gathered over cp_axis per layer (fwd), their
  gradients reduce-scattered over it (bwd, model._gather_kv), kv_pos gathered once per step
  (model.layer_positions, before the layer scans), and with
  the capacity rule the sequence's expert ids per MoE layer and its positions once (CSE'd
  across layers). ring (kv_exchange=ring, modeling/ring_attention.py): instead, per layer the
  blocks sent n - 1 times forward and again backward with their float32 gradient sums, which
  take one more send home; the positions are all-gathered once, as kv_pos."""
  b = cfg.batch // _size(mesh, _tuple(batch_axes))
  kv = b * cfg.seq_len * kv_values(cfg) * act_bytes(cfg)                  # K and V of a layer
  return (kv_exchange_terms(cfg, mesh, cp_axis, kv, cfg.n_layers, ring)
          + term(mesh, "all-gather", "fwd", "kv_pos", b * cfg.seq_len * 4, cp_axis)
          + capacity_gather_terms(cfg, mesh, cp_axis, b * cfg.seq_len))


def kv_exchange_terms(cfg, mesh, cp_axis: str, kv: float, calls: int,
                      ring: bool = False) -> list[Term]:
  """The K/V exchange of `calls` attention runs over cp_axis, kv = the bytes of one run's whole
  sequences' K and V (MLA: latent + RoPE key) in the compute dtype: the all-gather forward
  (--remat gathers again) and the reduce-scatter of d(K/V) backward; ring: n - 1 blocks of kv/n
  forward, backward again with n float32 d(K/V) blocks (one more send home)."""
  cp = _size(mesh, (cp_axis,))
  what = "latent c_KV + RoPE key" if cfg.mla else "K/V"
  if ring:
    block = kv / cp
    d_block = block * F32 / act_bytes(cfg)
    # a block is two sends, K's and V's (MLA: the latent's and the RoPE key's)
    return (term(mesh, "collective-permute", "fwd", f"{what} blocks around the ring",
                 calls * (cp - 1) * block, cp_axis, RECOMPUTED, calls=2 * calls * (cp - 1))
            + term(mesh, "collective-permute", "bwd", f"{what} blocks + float32 d({what})",
                   calls * ((cp - 1) * block + cp * d_block), cp_axis,
                   calls=2 * calls * (2 * cp - 1)))
  return (term(mesh, "all-gather", "fwd", what, calls * kv, cp_axis, RECOMPUTED, calls=calls)
          + term(mesh, "reduce-scatter", "bwd", f"d({what})", calls * kv / cp, cp_axis,
                 calls=calls))


def capacity_gather_terms(cfg, mesh, axis: str, tokens: int) -> list[Term]:
  """The capacity rule orders whole sequences: where `axis` splits them, with capacity_factor > 0
  each MoE layer's expert ids [T, K] and the positions [T] (once: the same in every layer, CSE'd)
  are all-gathered over it as int32, T = tokens of the gathered sequences (cp, ep_tp folded,
  ep_x_tp's sequence parallelism)."""
  if cfg.capacity_factor <= 0:
    return []
  return term(mesh, "all-gather", "fwd", "expert ids per layer + positions (capacity)",
              (cfg.n_moe_layers * cfg.top_k + 1) * tokens * 4, axis, calls=cfg.n_moe_layers + 1)


def sequence_parallel_terms(cfg, mesh, axis: str, tokens: int, mlp_layers: int,
                            attn_layers: int | None = None) -> list[Term]:
  """Megatron's sequence parallelism over `axis` (ep_tp, ep_x_tp's sequence_parallel; pp's per
  layer run), T = tokens of the gathered [T, D]: per attention (attn_layers, default every
  layer), forward, the all-gather of its normed h (MLA: its latents) and, in mlp_layers layers,
  of the MLP's h, the reduce-scatter of attention wo and of those MLPs' outputs; backward, the
  mirror (all-gather of the reduce-scatters' cotangents, reduce-scatter of the gathered
  inputs')."""
  n = _size(mesh, (axis,))
  attn = cfg.n_layers if attn_layers is None else attn_layers
  act = nbytes((tokens, cfg.d_model), act_bytes(cfg))              # one gathered [T, D]
  gathered = attn * act * attn_gather_values(cfg) // cfg.d_model + mlp_layers * act
  both = attn + mlp_layers                                          # the blocks' calls
  return (term(mesh, "all-gather", "fwd", "attention's h or MLA latents, the MLP's h", gathered,
               axis, RECOMPUTED, calls=both)
          + term(mesh, "reduce-scatter", "fwd", "attn wo", attn * act / n, axis, BLOCK_ONLY,
                 calls=attn)
          + term(mesh, "reduce-scatter", "fwd", "the MLPs' outputs", mlp_layers * act / n, axis,
                 calls=mlp_layers)
          + term(mesh, "all-gather", "bwd", "cotangents of the reduce-scatters",
                 both * act, axis, calls=both)
          + term(mesh, "reduce-scatter", "bwd", "cotangents of the gathered h / latents",
                 gathered / n, axis, calls=both))


def tensor_terms(cfg, mesh, tensor_axis: str, b_loc: int) -> list[Term]:
  """Megatron's activation all-reduces over tensor_axis (tp, ep_x_tp), b_loc sequences per
  device: forward, the row-parallel outputs (attention wo; the MoE after its combine, the shared
  expert, the dense layers); backward, the normed input of every block, which attention and the
  MLP read typed reduced (MLA: attention's latents instead of h)."""
  x = b_loc * cfg.seq_len * cfg.d_model * act_bytes(cfg)           # one [b, S, D] activation
  sh = 1 if cfg.n_shared_experts else 0
  mlps = cfg.n_moe_layers * (1 + sh) + cfg.n_dense_layers
  return (term(mesh, "all-reduce", "fwd", "attention wo output", cfg.n_layers * x, tensor_axis,
               BLOCK_ONLY, calls=cfg.n_layers)
          + term(mesh, "all-reduce", "fwd", "MoE / shared / dense FFN wo outputs", mlps * x,
                 tensor_axis, calls=mlps)
          + term(mesh, "all-reduce", "bwd", "d(normed h) of the MLP blocks and of "
                 "attention's h or MLA latents",
                 cfg.n_layers * x * (attn_gather_values(cfg) + cfg.d_model) // cfg.d_model,
                 tensor_axis, calls=2 * cfg.n_layers))


def _tuple(axes) -> tuple[str, ...]:
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _size(mesh, axes) -> int:
  return axis_size(mesh, *axes)


STATS = "router stats"
DROPPED, HOISTED = "dropped counts", "dropped count, constant 0 (hoisted)"      # stats_terms
STEP, ACCUMULATED, COUNTS = "step", "accumulated", "counts"     # which forward's (stats_bytes)


def stats_values(cfg) -> int:
  """Router statistics per MoE layer, the dropped count aside (DROPPED): counts [E], z, and the
  batch-wise loss's prob sums [E] or the sequence-wise loss's sum (routing.sequence_aux_sum)."""
  return cfg.n_experts + 1 + (1 if cfg.aux_loss_kind == "sequence" else cfg.n_experts)


def stats_bytes(cfg, which: str = STEP) -> int:
  """Bytes of one forward's STATS all-reduce, its dropped counts (DROPPED) and CE sum
  (ce_terms) aside. STEP: stats_values per MoE layer; under gradient accumulation with the
  batch-wise loss (`accumulated`), ACCUMULATED: pass 2's forwards, the step's counts given (P [E]
  and z per layer); COUNTS: pass 1's, the counts [E] per layer alone."""
  layers = cfg.n_moe_layers
  return {STEP: layers * stats_values(cfg), ACCUMULATED: layers * (cfg.n_experts + 1),
          COUNTS: layers * cfg.n_experts}[which] * F32


# The all-reduces of one MoE layer's STATS: one for each of its statistics (counts, z, and the
# loss's prob sums or sum; ACCUMULATED: P and z; COUNTS: the counts)
STATS_OPS = {STEP: 3, ACCUMULATED: 2, COUNTS: 1}


def stats_calls(cfg, which: str = STEP) -> int:
  """The all-reduces of one forward's STATS (stats_bytes): STATS_OPS per MoE layer."""
  return cfg.n_moe_layers * STATS_OPS[which]


def stats_terms(cfg, mesh, token_axes, seq_axes=(), drops: bool | None = None) -> list[Term]:
  """Router statistics and the dropped counts, all-reduced over the token axes (global
  statistics: the aux loss is layout-independent; the CE sum is step_terms', `with_ce`); with
  the sequence-wise loss and a sequence split over seq_axes, first each sequence's counts and
  prob sums [b, E] over seq_axes. drops: whether a token can be dropped (default: under the
  capacity rule, capacity_factor > 0): each MoE layer's dropped count; else each is the
  constant 0, and XLA hoists its all-reduce out of the layer scan: one (HOISTED)."""
  drops = cfg.capacity_factor > 0 if drops is None else drops
  out = (term(mesh, "all-reduce", "fwd", STATS, stats_bytes(cfg), token_axes,
              calls=stats_calls(cfg))
         + term(mesh, "all-reduce", "fwd", DROPPED if drops else HOISTED,
                (cfg.n_moe_layers if drops else 1) * F32, token_axes))
  if cfg.aux_loss_kind == "sequence" and seq_axes:
    b = cfg.batch // _size(mesh, tuple(a for a in _tuple(token_axes) if a not in seq_axes))
    one = cfg.n_moe_layers * b * cfg.n_experts * F32
    # the loss's gradient reads the counts (d/dP = coef x f), so --remat's recompute sums them
    # again; the prob sums enter linearly and are not re-summed
    out += (term(mesh, "all-reduce", "fwd", "per-sequence counts [b, E]", one, seq_axes,
                 RECOMPUTED)
            + term(mesh, "all-reduce", "fwd", "per-sequence prob sums [b, E]", one, seq_axes)
            # the sum is cast varying over seq_axes for the psum over all token axes: the
            # cast's transpose sums each layer's cotangent over them
            + term(mesh, "all-reduce", "bwd", "sequence sums' cotangents",
                   cfg.n_moe_layers * F32, seq_axes))
  return out
