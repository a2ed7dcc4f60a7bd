"""ep_x_tp — Megatron-Core's MoE layout: tensor parallelism over `tensor` (attention heads, the
dense SwiGLUs' and every expert's width F), expert parallelism over `expert` (the routed
experts), the batch over (data, expert). EP and TP are separate axes, so EP4 x TP2 is a mesh
(expert:4,tensor:2), where ep_tp folds both onto one axis (TP = EP).

Mesh axes: (data, expert, tensor). EP = |expert|, t = |tensor|, e = E / EP local experts,
b = B / (|data| |expert|) local sequences, T = b*S tokens per device.

| tensor                                   | sharding                                        |
|------------------------------------------|-------------------------------------------------|
| attn wq [D, H, Dh], wk/wv [D, KV, Dh]    | column-parallel: [D, H_t, Dh], [D, KV_t, Dh]    |
| attn wo [H, Dh, D]                       | row-parallel: [H_t, Dh, D]                      |
| MLA wq_b / wkv_b, wq_a / wkv_a           | as tp.py: up-projections column, down replicated|
| experts wi_0/wi_1 [E, D, F], wo [E, F, D]| [E_expert, D, F_t] column, [E_expert, F_t, D]   |
| shared / dense wi_0/wi_1 [D, F], wo      | [D, F_t] column, [F_t, D] row                   |
| attn bq / bk / bv (GQA biases)           | as tp.py: with their heads over tensor          |
| embed, unembed, norms, router, bias,     | replicated (the shared gate runs where its      |
| shared gate wg [D]                       | tokens are: the residual layout)                |
| tokens / positions [B, S]                | (B_(data,expert), S)                            |
| residual x [B, S, D]                     | (B_(data,expert), S, D), replicated over tensor |
|   sequence_parallel                      | (B_(data,expert), S_tensor, D)                  |
| dispatch buffer [EP, C, D] per device    | one per tensor rank: each routes the same T     |
|   sequence_parallel                      | each tensor rank its own T/t tokens             |
| zero1: every matrix but the router, its  | also D over data: [E@x, D@d, F@t], [D@d, H@t,   |
|   float32 master and optimizer state     |   Dh], embed [V, D@d]; gathered once per step   |

MoE (one full-manual shard_map): every tensor rank routes the same T local tokens and sends
their copies through ep.py's padded all-to-all over `expert` (ep.moe_body, a2a exchange); the
receiving rank runs its e local experts on its F_t slice, so what comes back is a partial sum
over tensor; the weighted combine is linear, so ONE psum over tensor of y [T, D] finishes it
(as tp.py: T*D, not the K copies).

Collectives per layer (d/x/t = the data/expert/tensor axes; y bytes = T*D*act; C rows per
destination as ep.py: T*min(K, e) dropless, about cf*T*K/EP with a capacity factor):
  forward : 1. attention out  o[b,S,H_t,Dh] @ wo[H_t,Dh,D] {U_t} -> all-reduce over t (y bytes)
            2. "dispatch_a2a": all-to-all over x of the counts [EP, e] (int32) and of the send
               buffer [EP, C, D]                                           [critical path]
            3. "expert_gmm": SwiGLU of the e local experts on their F_t slices -> {U_t}
            4. "combine_a2a": all-to-all over x of [EP, C, D]; weighted combine -> y [T, D] {U_t}
            5. ONE all-reduce over t of y (y bytes); the shared expert's and dense layers' row-
               parallel outputs: one all-reduce over t each
            6. all-reduce over (d, x, t) of the router statistics (t rank 0's count)
  backward: 7. all-to-all over x: the transposes of 2 and 4 ([EP, C, D] each)
            8. ONE all-reduce over t per block input (2 per layer, y bytes each; MLA: its
               latents for attention), as tp.py's gather_in
            9. weight grads: attention / shared / dense / embed / norms all-reduced over (d, x);
               experts over d (x splits E); the router over (d, x, t)
Each tensor rank carries its own copy of the exchange, so the all-to-all bytes per device are
ep.py's at the same EP and T: TP divides the weights and the expert FLOPs by t, not the tokens
(sequence_parallel, below, splits them).

HLO contract (every collective of the compiled step; size-1 axes drop out; the cost model's
(kind, axes) set equals it; tests/test_strategies.py holds both to the program):
  all-reduce over tensor: activations and their gradients (above)
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over (data, expert): non-expert weight gradients, the CE sum
  all-reduce over data: expert weight gradients
  all-reduce over (data, expert, tensor): router grads, router statistics, grad norm
  all-gather over tensor [muon]: the tensor-split matrices' float32 directions, whole for
    Newton-Schulz, once per step

HLO contract, sequence_parallel:
  all-gather over tensor: the normed h (MLA: its latents) before attention, h before the shared
    expert and the dense FFN, the received rows [EP, C, D] and counts of every MoE layer,
    cotangents of the reduce-scatters; capacity_factor > 0: expert ids [b, S, K] and positions
    [b, S] (int32, the capacity rule's whole sequences); Muon: the tensor-split matrices'
    float32 directions, whole for Newton-Schulz, once per step
  reduce-scatter over tensor: attn wo, shared / dense FFN outputs, the experts' outputs
    [t*EP, C, D], cotangents of the gathers
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over tensor: norm-scale grads [D] and the CE sum (first half of XLA's split); the
    sequence-wise loss's [b, E]
  all-reduce over (data, expert): attention / shared / dense weight grads, norm-scale grads [D]
    and the CE sum (second half)
  all-reduce over data: expert weight gradients
  all-reduce over (data, expert, tensor): embed / unembed / MLA down-projection / router grads,
    router statistics, grad norm

HLO contract, zero1:
  all-gather over data: every matrix but the router, once per step before the forward, in the
    compute dtype; Muon: their float32 directions, whole for Newton-Schulz
  reduce-scatter over data: those matrices' gradients, once per step
  all-reduce over tensor: activations and their gradients (above)
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over expert: the non-expert matrices' gradient shards (after the reduce-scatter)
  all-reduce over (data, expert): norm-scale grads [D], the CE sum
  all-reduce over (data, expert, tensor): router grads, router statistics, grad norm
  all-gather over tensor [muon]: the tensor-split matrices' float32 directions, whole for
    Newton-Schulz, once per step

HLO contract, sequence_parallel, zero1:
  all-gather over data: every matrix but the router, once per step before the forward, in the
    compute dtype; Muon: their float32 directions, whole for Newton-Schulz
  reduce-scatter over data: those matrices' gradients, once per step
  all-gather over tensor: as sequence_parallel's (above)
  reduce-scatter over tensor: as sequence_parallel's
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over tensor: norm-scale grads [D] and the CE sum (first half of XLA's split); the
    sequence-wise loss's [b, E]
  all-reduce over expert: attention / shared / dense gradient shards (after the reduce-scatter)
  all-reduce over (expert, tensor): embed / unembed / MLA down-projection gradient shards
  all-reduce over (data, expert): norm-scale grads [D] and the CE sum (second half)
  all-reduce over (data, expert, tensor): router grads, router statistics, grad norm

Sequence parallelism (--opt=sequence_parallel=true, Megatron's --sequence-parallel, which it
requires for MoE with TP > 1): the residual is [B@(d,x), S@t, D], so the norms, the router and
the CE run on each tensor rank's own S/t positions. Attention and the dense / shared SwiGLUs
all-gather the normed h over tensor ("seq_ag") and reduce-scatter their row-parallel outputs
("seq_rs") in place of tp's all-reduces: the same wire bytes, activations at 1/t. The routed MoE
reads the residual layout (model.Parallelism.moe_in_residual): each tensor rank routes its own T/t
tokens and sends them through the all-to-all over expert (C for T/t tokens), then "tensor_ag" all-gathers the received rows over tensor, so each rank runs its F_t
slice of the e local experts on the t ranks' rows, and "tensor_rs" reduce-scatters the partial
outputs back to the rows this rank received; "combine_a2a" returns them. Per MoE layer and
direction that adds an all-gather and a reduce-scatter of t*EP*C*D over tensor. Dropless, C is
for T/t tokens: the all-to-all moves 1/t of the replicated layout's. Under the capacity rule
C's per-sequence bound b*e*C_e does not shrink with S/t (a rank's positions may fill a whole
sequence's slots of an expert), so its padded buffers stay the same size.

ZeRO-1 (--opt=zero1=true, Megatron's --use-distributed-optimizer): every matrix but the router
is stored split over data on D, with its float32 master and optimizer state (1/|data| of them
per device). Once per step, before the forward, each is cast to the compute dtype and
all-gathered over data (Parallelism.params, layout/fsdp.gather_once); the gathered copy lives through
the step, and its gradient is reduce-scattered over data once, after the backward, then
all-reduced over the rest of its token axes at 1/|data| of the size. In float32 the wire bytes
are those of the all-reduce over data they replace (a reduce-scatter plus an all-gather); under
--dtype=bfloat16 the gather moves bf16, the scatter float32. --remat never re-issues the
gathers. Gradient accumulation keeps them once per step, as Megatron does: both passes use
one gathered copy, each microbatch's gradient is added into a float32 sum at the copy's size
(Megatron's main_grad buffer), and that sum is reduce-scattered once, after the last
(runtime.train.accumulated_grads). Pick it when the replicated optimizer state does not fit:
each matrix value stores 12/|data| bytes in place of 12 (its float32 master and AdamW's two
moments), for a 2-byte bf16 copy live through the step, and under accumulation 4 more for the
float32 sum.

Pick it when the experts need EP but attention or each expert is too wide for one device, with
t inside a node (its activation all-reduces are on the critical path) and EP across what is
left; cost: ep's 4 exchanges of EP*C*D per layer plus tp's 4 all-reduces of T*D per layer.
Megatron-Core reports EP8 x TP1 faster than EP4 x TP2 for Mixtral 8x7B (docs/planner.md,
"Published setups"): both are meshes of this file.

  python run.py --strategy=ep_x_tp --mesh=data:2,expert:2,tensor:2 --devices=8 --steps=3 --hlo_stats
  python run.py --strategy=ep_x_tp --mesh=expert:4,tensor:2 --opt=sequence_parallel=true --hlo_stats
  python run.py --strategy=ep_x_tp --mesh=data:4,expert:2 --opt=zero1=true --hlo_stats
"""
import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from layout import context, dispatch, fsdp, mesh as mesh_lib, tensor
from layout.precision import moe_stored, stored_use
from measure import cost as cost_lib
from modeling import model
from modeling.config import ConfigError
from parallel import sharding
from strategies import BadInput, Case, ep

NAME = "ep_x_tp"
DATA, EXPERT, TENSOR = mesh_lib.DATA, mesh_lib.EXPERT, mesh_lib.TENSOR
AXES = (DATA, EXPERT, TENSOR)
MAIN_AXIS = EXPERT
BATCH = (DATA, EXPERT)                 # the axes that split the batch (= non-expert grad axes)
TOKENS = (DATA, EXPERT, TENSOR)        # router statistics and the router's grads: every rank routes
COMPARE_MESH = "data:2,expert:2,tensor:2"   # the presets' 2 KV heads cap TP at 2
GROW_AXIS = EXPERT                    # at scale EP grows while the experts admit it
X_SP = P(BATCH, TENSOR, None)          # sequence parallelism: the residual [B, S@t, D]
ROW_SP = P(BATCH, None, None, unreduced={TENSOR})   # row-parallel outputs before "seq_rs"
# replicated matrices that, under sequence parallelism, run on each rank's own positions: their
# gradient sums over every axis, one op (gather_weight), not XLA's split
REPLICATED_MATRICES = ("embed", "unembed", "attn_q_a", "attn_kv_a", "shared_gate")
# zero1: the matrices stored split over data on D (the router, its bias and the norms stay
# replicated: a [D, E] and vectors)
ZERO1_ROLES = tuple(r for r in model.D_DIM if r != "router")


@dataclasses.dataclass(frozen=True)
class Options:
  sequence_parallel: bool = dataclasses.field(default=False, metadata={
      "doc": "Megatron's sequence parallelism: the residual's S over tensor, AG-RS around the "
             "tensor-parallel blocks, each tensor rank exchanging its own tokens"})
  zero1: bool = dataclasses.field(default=False, metadata={
      "doc": "ZeRO-1 (Megatron's distributed optimizer): the matrices, their float32 masters "
             "and optimizer state stored split over data, all-gathered once per step, their "
             "gradients reduce-scattered over data"})


SP = Options(sequence_parallel=True)
_TINY8 = dict(n_heads=8, n_kv_heads=4)
TEST_CASES = [Case("tiny", "data:2,expert:2,tensor:2", _TINY8),
              Case("deepseek-test", "expert:4,tensor:2", dict(optimizer="muon")),
              # sequence parallelism: Mixtral-style under the capacity rule (whole sequences
              # gathered); DeepSeek's MLA, dense layer, shared expert and sequence-wise loss,
              # recomputed, with Muon on the F-split experts
              Case("mixtral-test", "data:2,expert:2,tensor:2", dict(n_kv_heads=4, capacity_factor=1.0),
                   SP),
              Case("deepseek-test", "expert:4,tensor:2", dict(remat="block", optimizer="muon"), SP),
              # zero1: Megatron's distributed optimizer, without and with sequence parallelism
              Case("tiny", "data:2,expert:2,tensor:2", _TINY8, Options(zero1=True)),
              Case("deepseek-test", "data:2,expert:2,tensor:2", dict(optimizer="muon"),
                   Options(sequence_parallel=True, zero1=True))]
COST_CASES = TEST_CASES
# bf16 mixed precision (tests/test_precision.py): the row holding its richest composition
BF16_CASE = Case("deepseek-test", "data:2,expert:2,tensor:2", dict(microbatches=2),
                 Options(sequence_parallel=True, zero1=True))
# the options the planner varies (planning/plan.py: every combination)
PLAN_GRID = {"sequence_parallel": (False, True), "zero1": (False, True)}
BAD_INPUT = [
    BadInput(dict(n_heads=8, n_kv_heads=2), "expert:2,tensor:4", Options(),
             "n_kv_heads=2 is not divisible by mesh axis tensor=4"),
    BadInput(dict(n_experts=6, top_k=2), "expert:4,tensor:2", Options(),
             "n_experts=6 is not divisible by mesh axis expert=4"),
    BadInput(dict(batch=6), "data:2,expert:2,tensor:2", Options(),
             "batch=6 is not divisible by mesh axis dataxexpert=4"),
    BadInput(dict(n_heads=8, n_kv_heads=4, seq_len=30), "expert:2,tensor:4", SP,
             "seq_len=30 is not divisible by mesh axis tensor=4"),
    BadInput({}, "data:2,expert:4", SP, "ep_x_tp option sequence_parallel=true needs a tensor "
             "axis of size > 1 (without one it is the same program)"),
    BadInput({}, "expert:4,tensor:2", Options(zero1=True), "ep_x_tp option zero1=true needs a "
             "data axis of size > 1 (without one there is nothing to split the optimizer state "
             "over)")]


def check(cfg, mesh, opts):
  mesh_lib.require_divisible("n_experts", cfg.n_experts, mesh, EXPERT)
  mesh_lib.require_divisible("batch", cfg.batch, mesh, BATCH)
  mesh_lib.require_head_split(cfg, mesh, TENSOR, expert_ff=True)
  if opts.zero1:
    if mesh_lib.axis_size(mesh, DATA) == 1:
      raise ConfigError("ep_x_tp option zero1=true needs a data axis of size > 1 (without one "
                        "there is nothing to split the optimizer state over)")
    fsdp.check(cfg, mesh, DATA)
  if opts.sequence_parallel:
    if mesh_lib.axis_size(mesh, TENSOR) == 1:
      raise ConfigError("ep_x_tp option sequence_parallel=true needs a tensor axis of size > 1 "
                        "(without one it is the same program)")
    mesh_lib.require_divisible("seq_len", cfg.seq_len, mesh, TENSOR)


def contract_variant(opts):
  """Which HLO contract block of the docstring this layout compiles to."""
  names = [n for n, on in (("sequence_parallel", opts.sequence_parallel), ("zero1", opts.zero1))
           if on]
  return ", ".join(names) or None


def param_specs(cfg, mesh, opts=None):
  """layout/tensor.py's table (as tp.py), with the routed experts' E dim over expert; zero1:
  every matrix but the router also split over data on D."""
  table = {**tensor.table(TENSOR),
           "expert_in": P(EXPERT, None, TENSOR),                 # [E@x, D, F@t] column
           "expert_out": P(EXPERT, TENSOR, None)}                # [E@x, F@t, D] row
  if opts is not None and opts.zero1:
    table = fsdp.over(table, DATA, ZERO1_ROLES)                  # [E@x, D@d, F@t], [D@d, H@t, Dh]
  return model.param_specs(cfg, table)


def _zero1(cfg, opts, use, replicated=()):
  """(model.Parallelism's params hook as keyword arguments, Parallelism.use, the roles gathered) under
  zero1: the matrices gathered over data once per step (layout/fsdp.gather_once), their
  gradients summed over the axes their tokens split them over (experts: data; `replicated`:
  every axis; the rest (data, expert)), then used as gathered; the other weights through `use`.
  Without zero1: ({}, use, ()), every weight as stored."""
  if not opts.zero1:
    return {}, use, ()
  gathered = lambda role, w: w if role in ZERO1_ROLES else use(role, w)
  grad_axes = functools.partial(_zero1_grad_axes, replicated=replicated)
  return {"params": fsdp.gather_once(cfg, DATA, grad_axes)}, gathered, ZERO1_ROLES


def _zero1_grad_axes(role, replicated=()):
  """The axes a zero1 matrix's gradient sums over: its tokens' (the experts: data, the rest of
  their tokens having been exchanged to them over expert; `replicated`: every axis)."""
  return (DATA,) if role in model.EXPERTS else TOKENS if role in replicated else BATCH


def _zero1_gathered(opts, replicated=()) -> dict | None:
  """weight_terms' `gathered` under zero1 (once per step): each matrix gathered over data to its
  stored spec without data, its gradient over _zero1_grad_axes."""
  if not opts.zero1:
    return None
  used = lambda role: lambda spec: (sharding.without_axis(spec, DATA),
                                    _zero1_grad_axes(role, replicated))
  return {role: used(role) for role in ZERO1_ROLES}


def batch_spec(cfg, mesh):
  return P(BATCH, None)                                   # [B, S] @ ((data, expert), None)


def layout(cfg, mesh, opts):
  if opts.sequence_parallel:
    return _sequence_parallel_layout(cfg, mesh, opts)
  x_spec = P(BATCH, None, None)                           # [B, S, D] @ ((d, x),), rep. over t
  # normed h as attention and the MLP read it: typed reduced over t (tp.py's gather_in)
  h_spec = P(BATCH, None, None, reduced=frozenset({TENSOR}))
  n_ep = mesh_lib.axis_size(mesh, EXPERT)

  def moe_fn(p, x, positions):
    def body(p, x, pos):                                  # x [b, S, D] local, same on all t
      xv = jax.lax.pcast(x, TENSOR, to="varying")         # cotangent summed once in gather_in
      # route, all-to-all over x, the e local experts on F_t, all-to-all back, combine
      y, stats = ep.moe_body(tensor.bias_once(p, TENSOR), xv, pos, cfg=cfg, ep_axes=(EXPERT,),
                             ep=n_ep, token_axes=(),
                             exchange=ep.a2a_exchange)   # y [b, S, D] {U_t}
      # one psum over t; the stats counted by t rank 0, summed over (d, x, t)
      y, stats = tensor.finish_moe(y, stats, TENSOR, TOKENS)   # y [b, S, D]
      return y.astype(x.dtype), stats
    # experts [E@x, D, F@t] / [E@x, F@t, D] as stored (bf16: cast, typed reduced over data)
    p, specs = moe_stored(p, cfg, (DATA,), moe_gathered)
    return jax.shard_map(body, in_specs=(specs, h_spec, P(BATCH, None)),
                         out_specs=(x_spec, P()))(p, x, positions)   # y [B, S, D] @ ((d, x),)
  gather_in = lambda h: sharding.gather_weight(h, x_spec, (TENSOR,))  # [B, S, D] -> h_spec
  zero1, use, moe_gathered = _zero1(cfg, opts, stored_use(cfg, BATCH))
  return model.Parallelism(x=x_spec, use=use, moe=moe_fn, gather_in=gather_in, **zero1)


def _sequence_parallel_layout(cfg, mesh, opts):
  """Megatron's sequence parallelism (docstring): the residual [B, S@t, D]; AG-RS over tensor
  around attention and the dense / shared SwiGLUs; the MoE on each rank's own tokens."""
  # AG of the normed h [B, S@t, D] -> [B, S, D] before the tensor-parallel blocks, RS of their
  # row-parallel outputs back; replicated matrices' grads summed over (d, x, t) in one op
  gather_in, scatter_out, use = tensor.sequence_parallel(
      cfg, X_SP, P(BATCH, None, None), TENSOR, TOKENS, BATCH, REPLICATED_MATRICES)
  zero1, use, moe_gathered = _zero1(cfg, opts, use, REPLICATED_MATRICES)

  gather_seq = context.sequence_gatherer(TENSOR) if cfg.capacity_factor > 0 else None

  def moe_fn(p, h, positions):                            # h [B, S@t, D] normed, the residual
    p, _ = moe_stored(p, cfg, (DATA,), moe_gathered)      # experts [E@x, D, F@t]
    pos = jax.reshard(positions, P(BATCH, TENSOR))        # [B, S@t]: a local slice
    return ep.moe_ep(p, h, pos, cfg, ep_axes=(EXPERT,), gather_sequence=gather_seq,
                     exchange=_tensor_exchange)          # y [B, S@t, D]

  return model.Parallelism(x=X_SP, use=use, moe=moe_fn, gather_in=gather_in, scatter_out=scatter_out,
                      row_out=ROW_SP, moe_in_residual=True, **zero1)


def _tensor_experts(p, recv, counts, c, cfg):
  """The received rows of this tensor rank -> their expert outputs: all-gather the tensor
  group's rows, run this rank's F_t slice of the local experts on all of them, reduce-scatter
  the partial sums back to its own rows."""
  with jax.named_scope("tensor_ag"):
    rows = jax.lax.all_gather(recv, TENSOR, axis=0, tiled=True)      # [t*EP, C, D]
    counts = jax.lax.all_gather(counts, TENSOR, axis=0, tiled=True)  # [t*EP, e]
  out = ep.local_experts(tensor.bias_once(p, TENSOR), rows, counts, c,
                         cfg)                                        # [t*EP, C, D] {U_t}: F_t
  with jax.named_scope("tensor_rs"):
    return jax.lax.psum_scatter(out, TENSOR, scatter_dimension=0, tiled=True)  # [EP, C, D]


# ep.py's padded all-to-all with the experts' F split over tensor
_tensor_exchange = functools.partial(ep.a2a_exchange, experts=_tensor_experts)


def dispatch_buffer_type(cfg, mesh, opts):
  """The experts' input buffer (ShapeDtypeStruct with its sharding) for this cfg and mesh:
  every tensor rank's own under sequence parallelism, one per tensor rank (the same) without."""
  return ep.buffer_type(cfg, mesh, X_SP if opts.sequence_parallel else P(BATCH, None, None),
                        (EXPERT,))


def activation_shardings(cfg, mesh, opts):
  t = dispatch_buffer_type(cfg, mesh, opts)
  seq = f"{cfg.seq_len}@tensor" if opts.sequence_parallel else f"{cfg.seq_len}"
  return [("residual x [B, S, D]", f"[{cfg.batch}@(data,expert), {seq}, {cfg.d_model}]"),
          ("q [B, S, H, Dh]", f"[{cfg.batch}@(data,expert), {cfg.seq_len}, "
                              f"{cfg.n_heads}@tensor, {cfg.head_dim}]"),
          ("dispatch buffer [N_src, EP, C, D]", f"{t.shape} @ {t.sharding.spec}"
           + ("" if opts.sequence_parallel else ", the same on every tensor rank")),
          ("expert hidden [EP*C, F]", f"F={cfg.d_ff}@tensor inside the MoE shard_map")]


def cost(cfg, mesh, opts):
  """Per-device collective bytes per step (measure/cost.py; the docstring's schedule): weights
  used as stored, grads over (data, expert) (experts over data, the router over every axis);
  tp.py's activation all-reduces over tensor; ep.py's exchange over expert; router statistics."""
  b_loc = cfg.batch // mesh_lib.axis_size(mesh, *BATCH)
  if opts.sequence_parallel:
    return _sequence_parallel_cost(cfg, mesh, b_loc, opts)
  specs = param_specs(cfg, mesh, opts)
  return (cost_lib.weight_terms(cfg, mesh, specs, BATCH, _zero1_gathered(opts),
                                grads={"router": TOKENS, **BIAS_GRADS}, once=True)
          + cost_lib.muon_terms(cfg, mesh, specs, (TENSOR, DATA))
          + cost_lib.stats_terms(cfg, mesh, TOKENS)
          + cost_lib.tensor_terms(cfg, mesh, TENSOR, b_loc)
          + ep.exchange_terms(cfg, mesh, "a2a", b_loc, b_loc * cfg.seq_len))


# gpt-oss's router bias is summed over every axis, as the router; its expert down bias over
# tensor inside the MoE (tensor.bias_once), then over the batch axes
BIAS_GRADS = {"router_bias": TOKENS, "expert_out_bias": ((TENSOR,), BATCH)}


def _sequence_parallel_cost(cfg, mesh, b_loc, opts):
  """cost() under sequence parallelism: the AG-RS over tensor around the tensor-parallel blocks
  (ep_tp's folded schedule, over tensor), ep's exchange of T/t tokens, the received rows'
  AG-RS over tensor; replicated matrices and the router summed over every axis, the norm
  scales in XLA's split (tensor, then data and expert)."""
  n_moe, t = cfg.n_moe_layers, mesh_lib.axis_size(mesh, TENSOR)
  tok = b_loc * cfg.seq_len                                  # the batch shard's tokens
  mlp = cfg.n_layers - (0 if cfg.n_shared_experts else n_moe)   # layers with a tensor-parallel SwiGLU
  grads = {**dict.fromkeys(REPLICATED_MATRICES + ("router",), TOKENS), **BIAS_GRADS,
           **dict.fromkeys(model.NORMS + ("attn_o_bias",), ((TENSOR,), BATCH))}
  n_ep = mesh_lib.axis_size(mesh, EXPERT)
  c = dispatch.send_rows(cfg, b_loc, cfg.seq_len // t, n_ep)
  rows = n_ep * c * cfg.d_model * cost_lib.act_bytes(cfg)   # one received [EP, C, D]
  term = functools.partial(cost_lib.term, mesh)
  specs = param_specs(cfg, mesh, opts)
  return (cost_lib.weight_terms(cfg, mesh, specs, BATCH, _zero1_gathered(opts, REPLICATED_MATRICES),
                                grads=grads, once=True)
          + cost_lib.muon_terms(cfg, mesh, specs, (TENSOR, DATA))
          + cost_lib.stats_terms(cfg, mesh, TOKENS, (TENSOR,))
          + cost_lib.sequence_parallel_terms(cfg, mesh, TENSOR, tok, mlp)
          + ep.exchange_terms(cfg, mesh, "a2a", b_loc, tok // t)
          + term("all-gather", "fwd", "received rows [EP, C, D] + counts [EP, e] (int32)",
                 n_moe * t * (rows + cfg.n_experts * 4), TENSOR, cost_lib.RECOMPUTED)
          + term("reduce-scatter", "fwd", "the experts' outputs [t*EP, C, D]", n_moe * rows,
                 TENSOR, cost_lib.RECOMPUTED)
          + term("all-gather", "bwd", "cotangents of the outputs' reduce-scatter",
                 n_moe * t * rows, TENSOR)
          + term("reduce-scatter", "bwd", "cotangents of the gathered rows", n_moe * rows, TENSOR)
          + cost_lib.capacity_gather_terms(cfg, mesh, TENSOR, tok))
