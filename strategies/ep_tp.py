"""ep_tp — the expert axis is tensor parallelism for attention / shared expert, and expert
parallelism for the routed MoE, which uses the AG-RS ("ring of experts") exchange: no all-to-all.
MaxText #3600 (POC), plus the fix its text asks for: sort/permute/gmm sized by routed tokens.
Option exchange=folded (MaxText #4910, Megatron's parallel folding): the routed MoE
is ep.py's all-to-all over the same axis, on the sequence-parallel tokens (below).

Mesh axes: (data, expert). EP = |expert|, e = E / EP local experts, T = (B/|data|)*S tokens of a
data shard, T/EP of them per device in the residual stream.

| tensor                                   | sharding                                 |
|------------------------------------------|------------------------------------------|
| attn wq/wk/wv [D, H|KV, Dh]              | (None, expert, None)   column-parallel   |
| attn wo [H, Dh, D]                       | (expert, None, None)   row-parallel      |
| MLA wq_b [Rq, H, qk], wkv_b [Rkv, H, .]  | (None, expert, None)   column-parallel   |
| MLA wq_a [D, Rq], wkv_a [D, Rkv + rope]  | replicated, run on the T/EP local tokens |
| shared wi_0/wi_1 [D, Fs], wo [Fs, D]     | (None, expert), (expert, None)           |
| routed wi_0/wi_1 [E, D, F], wo [E, F, D] | (expert, None, None)   e whole experts   |
| attn bq [H, Dh], bk/bv [KV, Dh] (GQA)    | (expert, None)   with their heads        |
| shared gate wg [D] (Qwen2-MoE)           | replicated, run on the T/EP local tokens |
| embed, unembed, norms, router, bias      | replicated                               |
| tokens / targets / positions [B, S]      | (data, None)                             |
| residual x [B, S, D], norms, router, CE  | (data, expert, None)   sequence-parallel |
| gathered h [B, S, D] (attn, MoE, shared) | (data, None, None), typed reduced/expert |
| q [B, S, H, Dh], k/v [B, S, KV, Dh]      | (data, None, expert, None)               |
| attn wo / MoE + shared out [B, S, D]     | (data, None, None) {U_expert} -> RS      |
| MoE buffer xs [M, D] (per device)        | local: the copies routed to its e experts|
| folded: send / recv [EP, C, D] per device| by destination / source shard (ep.py)    |

Token layout (Megatron-SP). The residual is sequence-parallel: each device keeps T/EP tokens, so
the norms, the router and the CE run on 1/EP of the tokens (no redundant routing) and the
activations take 1/EP memory. Before attention and before the MoE the normed h is all-gathered
over expert (sequence dim); each row-parallel output (attn wo; the MoE combine plus the shared
expert, summed first: they share one) is typed unreduced over expert and reduce-scattered back.
MaxText #3600 shards D of these activations instead; the bytes are the same (an all-gather and a
reduce-scatter of [T, D] per block), but D-sharding needs an all-reduce of the norm statistics
and a sharded router contraction, while sequence sharding keeps both local. AG + RS of [T, D]
moves the same bytes as the one all-reduce of the replicated (Megatron) layout.
MLA: its down-projections are token-local, so they run on the T/EP local tokens before the
gather, and attention's all-gather moves the latents (normed c_Q, or h if q_lora_rank = 0,
normed c_KV and rotated k_r: Rq + Rkv + rope = 2,112 values per token at DeepSeek-V3's shape,
against D = 7,168) instead of h.

Routed MoE per device (named scopes): route the T/EP local tokens -> "route_ag": all-gather
their expert ids and combine weights [T, K] over expert (the tokens come gathered) -> "compact":
a prefix sum over the T*K copy flags picks the copies routed to the e local experts into M rows;
only those M are sorted (layout/compact.py) -> "expert_gmm" on [M, D] -> weighted scatter-add
into a partial [T, D] {U_expert} -> "combine_rs" (+ shared expert): reduce-scatter over expert.
The prefix sum is O(T*K) int work; the sort, the row gathers, the gmm and the scatter-add are
O(M), where MaxText #3600 sorts and permutes all T*K gathered copies. M = T*min(K, e) (worst
case, dropless, default) or ceil(capacity * T*min(K, e)) (option `capacity`, --opt=capacity=f) (balanced routing needs
T*K/EP); copies past slot M are dropped (earliest tokens win) and counted into `dropped`, which
is otherwise the reference's capacity-rule count (0 extra with the worst-case bound). With
capacity_factor cf > 0 the worst case itself shrinks to b*e*C_e (b sequences of the data shard,
C_e = ceil(cf*S*K/E) slots per sequence and expert), about cf*T*K/EP rows, with no extra drop.

Collectives per layer ([T, D] = one data shard's activations, f32; named scopes in quotes)
  forward : 1. "seq_ag": all-gather over expert of the normed h before q/k/v: [T/EP, D] -> [T, D]
               (MLA: of the latents, [T/EP, Rq + Rkv + rope] -> [T, ..])
            2. "combine_rs": reduce-scatter over expert of attention wo {U_expert} -> [T/EP, D]
            3. "seq_ag": all-gather over expert of the normed h before the MoE / shared expert
            4. "route_ag": all-gather over expert of expert ids + weights [T, K] (+ the raw ids
               for the capacity rule when capacity_factor > 0)
            5. "combine_rs": ONE reduce-scatter over expert of MoE combine + shared wo {U_expert}
            6. all-reduce over (data, expert) of the router statistics + overflow ([E], scalars)
  backward: the mirror: all-gather over expert of the cotangents of 2 and 5; reduce-scatter over
            expert of the cotangent of 1 (q, k, v partials summed first: one op, not three), of
            3 (MoE tokens, routing slice, shared wi_0/wi_1 summed first) and of the weights of 4
            ([T/EP, K]). Gradients: expert-sharded weights all-reduced over data; embed, unembed,
            MLA's wq_a / wkv_a (use -> gather_weight with grad_axes (data, expert): one op,
            where XLA splits the sum into an expert and a data all-reduce, twice the bytes;
            REPLICATED_MATRICES) and the router (shard_map
            input) over (data, expert); norm scales [D] (gather_weight's reduced type cannot
            meet an elementwise product) in XLA's split: over expert, then over data.
HLO contract (every collective of the compiled step; size-1 axes drop out; the cost model's
(kind, axes) set equals it, and tests/test_strategies.py holds both to the program, both ways;
tests/test_ep_tp.py adds the op counts per layer of both exchanges and the compaction's sizes):
  all-gather over expert: normed h, routing ids / weights, cotangents of the reduce-scatters
  reduce-scatter over expert: attn wo, MoE + shared outputs, cotangents of gathered h / weights
  all-reduce over expert: norm-scale grads [D] (first half of XLA's split); no activation is
    all-reduced
  all-reduce over data: expert-sharded weight grads, norm-scale grads [D] (second half)
  all-reduce over (data, expert): embed / unembed / MLA down-projection / router grads, router stats, overflow, loss
    sums, grad norm (with |data| = 1 these run over expert: data parallelism of replicated
    weights)
HLO contract, exchange=folded:
  all-gather over expert: normed h / MLA latents before attention, h before the shared expert
    and the dense FFN, cotangents of the reduce-scatters; capacity_factor > 0: expert ids
    [b, S, K] and positions [b, S] (int32, the capacity rule's whole sequences)
  reduce-scatter over expert: attn wo, shared / dense FFN outputs, cotangents of gathered h
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over expert: norm-scale grads [D] and the CE sum (first half of XLA's split); the
    sequence-wise loss's [b, E]
  all-reduce over data: expert-sharded weight grads, norm-scale grads [D] and the CE sum (second
    half)
  all-reduce over (data, expert): embed / unembed / MLA down-projection / router grads, router
    stats, grad norm

Folded exchange (--opt=exchange=folded). Attention (and the shared expert) stay tensor-parallel
as above; the routed MoE never gathers: model.block hands it the normed h in the residual layout
(Parallelism.moe_in_residual), and ep.moe_ep routes each device's T/EP local tokens, packs their
copies by destination shard into send [EP, C, D] ("dispatch_a2a": all-to-all over expert),
runs the e local experts ("expert_gmm"), returns them ("combine_a2a") and combines them into
y [B, S@expert, D], already in the residual layout: no all-gather of tokens or routing, no
reduce-scatter. C = dispatch.send_rows for b sequences x S/EP positions: the dropless worst
case (T/EP)*min(K, e), or with capacity_factor the b*e*C_e bound (nothing is dropped by the
exchange; `dropped` is the capacity rule's count). The capacity rule orders whole sequences,
so with capacity_factor > 0 the expert ids and positions are all-gathered (ints, as ep_as_cp).
The shared expert keeps its tensor-parallel weights (Fs over expert): it needs every token of
the data shard, so it keeps its own AG of h and RS of its output per MoE layer; a model without
one (Mixtral) has no MLP gather at all.
Per-device wire bytes of the routed exchange per MoE layer, forward (the backward mirrors it):
  ring   AG of h + RS of y, [T, D] each: 2*T*D*(EP-1)/EP (+ the [T, K] ids and weights)
  folded dispatch + combine of [EP, C, D]: 2*EP*C*D*(EP-1)/EP = 2*(T/EP)*K*D*(EP-1)/EP * pad,
         pad = EP*C / ((T/EP)*K), the buffer over the routed copies
  folded/ring = pad*K/EP: before padding folded moves less when EP > K. These padded buffers
  have pad = min(EP*min(K, e)/K, cf*EP) (the per-sequence bound does not shrink with S/EP), so
  here folded moves min(K, e) (dropless) or min(K, e, cf*K) times ring's bytes; an exchange of
  the routed rows only (ep's ragged exchange, GPU/TPU) would have pad = 1. With a shared
  expert ring's AG-RS is needed anyway (the MoE shares it): folded's all-to-alls come on top.

When to use: few tokens per step (inference-like) with many experts: no all-to-all, each
device holds E/EP experts, H/EP heads and T/EP tokens of the residual. Cost per layer and
direction: 2 x (AG to [T, D] + RS to [T/EP, D]), the same wire bytes as the 2 all-reduces of
the replicated-residual (Megatron) layout, 2r(EP-1)/EP each, with activations at 1/EP; plus the
[T, K] routing. Attention needs H and KV divisible by EP, the sequence S divisible by EP.

  python run.py --strategy=ep_tp --mesh=data:4,expert:2 --model=deepseek-test --steps=3
  python run.py --strategy=ep_tp --mesh=expert:2 --devices=2 --batch=1 --seq=8 --opt=capacity=0.5
  python run.py --strategy=ep_tp --mesh=data:4,expert:2 --model=mixtral-test --opt=exchange=folded
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from layout import buffers, compact, context, dispatch, mesh as mesh_lib, options, tensor
from layout.precision import moe_stored
from measure import cost as cost_lib
from modeling import model, moe, routing
from modeling.config import ConfigError
from strategies import BadInput, Case, ep

NAME = "ep_tp"
DATA, EXPERT = mesh_lib.DATA, mesh_lib.EXPERT
AXES = (DATA, EXPERT)
MAIN_AXIS = EXPERT
COMPARE_MESH = "data:4,expert:2"        # the presets have 2 KV heads: EP = 2 for the table
GROW_AXIS = EXPERT                    # at scale the model, not the preset, caps it
X_SPEC = P(DATA, EXPERT, None)          # residual [B, S, D]: sequence-parallel
FULL = P(DATA, None, None)              # gathered h [B, S, D]
TOKENS = (DATA, EXPERT)                 # the token axes = the grad axes
ROW = P(DATA, None, None, unreduced={EXPERT})   # row-parallel outputs before the RS
# replicated weight matrices whose gradient sums over every token: embed, unembed and MLA's
# down-projections (they run on the sequence-parallel tokens)
REPLICATED_MATRICES = ("embed", "unembed", "attn_q_a", "attn_kv_a", "shared_gate")


@dataclasses.dataclass(frozen=True)
class Options:
  capacity: float = options.number(0.0, "compaction buffer as a fraction of the worst case "
                                   "(0 = the worst case, dropless)", lo=0.0, hi=1.0)
  exchange: str = options.choice("ring", ("ring", "folded"),
                                 "the routed MoE's exchange: AG-RS of the gathered tokens (ring) "
                                 "or ep's all-to-all of the sequence-parallel tokens (folded)")


SMALL = dict(n_heads=8, n_kv_heads=8, batch=1, seq_len=8)   # 8 tokens; heads divisible by EP=8
FOLDED = Options(exchange="folded")
TEST_CASES = [Case("tiny", "data:2,expert:4", dict(n_kv_heads=4)),
              Case("deepseek-test", "data:4,expert:2"),
              Case("deepseek-test", "expert:8", SMALL),         # 1 token per device: inference-like
              # folded: Mixtral (no shared expert) under the capacity rule (whole sequences: ids
              # gathered); DeepSeek's shared expert and dense layer under it; DeepSeek dropless,
              # 1 token per device, recomputed; Mixtral dropless on EP 8 (one expert a device:
              # e = 1 < K), recomputed; Mixtral dropless on data:4,expert:2
              Case("mixtral-test", "data:2,expert:4", dict(n_kv_heads=4, capacity_factor=1.0),
                   FOLDED),
              Case("deepseek-test", "data:4,expert:2", dict(capacity_factor=1.0), FOLDED),
              Case("deepseek-test", "expert:8", {**SMALL, "remat": "block"}, FOLDED),
              Case("mixtral-test", "expert:8", dict(n_heads=8, n_kv_heads=8, remat="block"),
                   FOLDED),
              Case("mixtral-test", "data:4,expert:2", opts=FOLDED)]
COST_CASES = TEST_CASES
# bf16 mixed precision (tests/test_precision.py): the row holding its richest composition
BF16_CASE = Case("deepseek-test", "data:2,expert:4", dict(remat="block", microbatches=2),
                 FOLDED)
# the options the planner varies (planning/plan.py: every combination)
PLAN_GRID = {"exchange": ("ring", "folded")}
BAD_INPUT = [
    BadInput({}, "data:2,expert:4", Options(), "n_kv_heads=2 is not divisible by mesh axis expert=4"),
    BadInput(dict(n_heads=8, n_kv_heads=8, n_experts=4), "expert:8", Options(),
             "n_experts=4 is not divisible by mesh axis expert=8"),
    BadInput(dict(n_kv_heads=4, batch=3), "data:2,expert:4", Options(),
             "batch=3 is not divisible by mesh axis data=2"),
    BadInput(dict(n_heads=8, n_kv_heads=8, seq_len=12), "expert:8", Options(),
             "seq_len=12 is not divisible by mesh axis expert=8"),
    BadInput(dict(remat="dots_saveable"), "data:4,expert:2", Options(),
             "ep_tp does not compile with --remat=dots_saveable (jax has no unreduced rule for "
             "dynamic_slice); use --remat=block"),
    BadInput(dict(n_kv_heads=4), "data:2,expert:4", Options(capacity=1.5),
             "ep_tp option capacity=1.5: must be a finite number in [0, 1]"),
    BadInput(dict(n_kv_heads=4), "data:2,expert:4", Options(capacity=0.5, exchange="folded"),
             "ep_tp option capacity=0.5 sizes the ring exchange; exchange=folded sizes its "
             "all-to-all buffers by capacity_factor")]


def check(cfg, mesh, opts):
  mesh_lib.require_divisible("batch", cfg.batch, mesh, DATA)
  mesh_lib.require_divisible("seq_len", cfg.seq_len, mesh, EXPERT)
  mesh_lib.require_divisible("n_experts", cfg.n_experts, mesh, EXPERT)
  mesh_lib.require_head_split(cfg, mesh, EXPERT)
  if cfg.remat.startswith("dots"):     # jax 0.12: "unreduced rule for dynamic_slice is not
    raise ConfigError(f"ep_tp does not compile with --remat={cfg.remat} (jax has no unreduced "
                      "rule for dynamic_slice); use --remat=block")       # implemented"
  if not 0 <= opts.capacity <= 1:
    raise ConfigError(f"ep_tp option capacity={opts.capacity}: must be a finite number in [0, 1]")
  if opts.exchange == "folded" and opts.capacity:
    raise ConfigError(f"ep_tp option capacity={opts.capacity} sizes the ring exchange; "
                      "exchange=folded sizes its all-to-all buffers by capacity_factor")


def contract_variant(opts):
  """Which HLO contract block of the docstring this exchange compiles to."""
  return None if opts.exchange == "ring" else f"exchange={opts.exchange}"


def param_specs(cfg, mesh, opts=None):
  return model.param_specs(cfg, {
      "attn_q": P(None, EXPERT, None), "attn_kv": P(None, EXPERT, None),  # column-parallel
      "attn_q_b": P(None, EXPERT, None), "attn_kv_b": P(None, EXPERT, None),  # MLA, by head
      "attn_q_bias": P(EXPERT, None), "attn_kv_bias": P(EXPERT, None),       # GQA biases, by head
      "attn_o": P(EXPERT, None, None),                                       # row-parallel
      "shared_in": P(None, EXPERT), "shared_out": P(EXPERT, None),
      "dense_in": P(None, EXPERT), "dense_out": P(EXPERT, None),
      "expert_in": P(EXPERT, None, None), "expert_out": P(EXPERT, None, None)})  # e whole


def batch_spec(cfg, mesh):
  return P(DATA, None)                                              # [B, S] @ (data, None)


def buffer_rows(cfg, mesh, opts) -> int:
  """M, the per-device row budget of the compacted MoE buffer."""
  seqs = cfg.batch // mesh_lib.axis_size(mesh, DATA)                              # gathered: whole sequences
  n_local = cfg.n_experts // mesh_lib.axis_size(mesh, EXPERT)
  return compact.buffer_rows(seqs * cfg.seq_len, cfg.top_k, n_local, opts.capacity,
                             seqs=seqs, slots=routing.expert_slots(cfg, cfg.seq_len))


def moe_local_experts(p, x, positions, cfg, n_local: int, rows: int):
  """Shard_map body. x [b, S, D] gathered tokens (reduced over expert), p experts [e, D, F].
  -> (y [b, S, D] partial sum over expert, stats summed over (data, expert))."""
  b, s, d = x.shape
  t, k = b * s, cfg.top_k
  i, s_loc = jax.lax.axis_index(EXPERT), s // jax.lax.axis_size(EXPERT)
  ag = lambda a: jax.lax.all_gather(a, EXPERT, axis=1, tiled=True)  # [b, S/EP, ..] -> [b, S, ..]
  x_loc = jax.lax.dynamic_slice_in_dim(x, i * s_loc, s_loc, axis=1)   # [b, S/EP, D] own tokens
  pos_loc = jax.lax.dynamic_slice_in_dim(positions, i * s_loc, s_loc, axis=1)
  r, keep, stats = moe.route_tokens(                                  # [T/EP, K], local stats
      p, x_loc, pos_loc, cfg, experts_all=lambda e, _: (ag(e), positions), seq_axes=(EXPERT,))
  with jax.named_scope("route_ag"):
    experts = ag(jnp.where(keep, r.experts, -1).reshape(b, s_loc, k)).reshape(t, k)  # [T, K]
    w_all = ag(r.weights.reshape(b, s_loc, k)).reshape(t * k)                        # [T*K]
  with jax.named_scope("compact"):
    first = i * n_local
    c = compact.compact(experts, experts >= 0, first, n_local, rows)  # M rows, sorted
    tok = c.copy // k                                                  # [M], pad -> T
    xs = jnp.where(c.valid[:, None], x.reshape(t, d)[jnp.minimum(tok, t - 1)],
                   buffers.pad_value(x.dtype))                          # [M, D], pad rows
    w = jnp.where(c.valid, w_all[jnp.minimum(c.copy, t * k - 1)], 0)   # [M]
    if cfg.route_scale_input:                # Llama 4: the score scales the row, not its output
      xs = jnp.where(c.valid[:, None], xs * w[:, None].astype(xs.dtype), xs).astype(xs.dtype)
      w = c.valid.astype(w.dtype)
  with jax.named_scope("expert_gmm"):
    ys = moe.swiglu_experts(xs, c.group_sizes, p, cfg.gmm_backend, cfg)  # [M, D]
  y = jnp.zeros((t, d), ys.dtype).at[tok].add(ys * w[:, None].astype(ys.dtype), mode="drop")
  stats["dropped"] = stats["dropped"] + c.overflow
  stats = jax.tree.map(lambda v: jax.lax.psum(v, (DATA, EXPERT)), stats)
  y = jax.lax.pcast(y.reshape(b, s, d).astype(x.dtype), EXPERT, to="unreduced")
  return y, stats                                                     # y [b, S, D] {U_expert}


def layout(cfg, mesh, opts):
  n_local = cfg.n_experts // mesh_lib.axis_size(mesh, EXPERT)
  rows = buffer_rows(cfg, mesh, opts)

  def moe_fn(p, x, positions):                                         # x [B, S, D] gathered h
    body = lambda p, x, pos: moe_local_experts(p, x, pos, cfg, n_local, rows)
    # experts [E@expert, D, F] as stored (bf16: cast, typed reduced over data)
    p, p_specs = moe_stored(p, cfg, TOKENS)
    return jax.shard_map(
        body, in_specs=(p_specs, jax.typeof(x).sharding.spec, P(DATA, None)),
        out_specs=(ROW, P()))(p, x, positions)                         # y [B, S, D] {U_expert}

  # AG of the normed h [B, S@expert, D] -> [B, S, D] before attention / the MLP, RS of the
  # row-parallel outputs back; embed / unembed / MLA down-projections' grads in one op
  gather_in, scatter_out, use = tensor.sequence_parallel(
      cfg, X_SPEC, FULL, EXPERT, TOKENS, TOKENS, REPLICATED_MATRICES, rs_scope="combine_rs")

  gather_seq = context.sequence_gatherer(EXPERT) if cfg.capacity_factor > 0 else None

  def moe_folded(p, h, positions):       # h [B, S@expert, D] normed, the residual layout
    p, _ = moe_stored(p, cfg, TOKENS)     # experts [E@expert, D, F] as stored
    pos = jax.reshard(positions, P(DATA, EXPERT))   # [B, S@expert] (model.block's already are)
    return ep.moe_ep(p, h, pos, cfg, ep_axes=(EXPERT,),           # y [B, S@expert, D]
                     gather_sequence=gather_seq)

  folded = opts.exchange == "folded"
  return model.Parallelism(x=X_SPEC, use=use, moe=moe_folded if folded else moe_fn,
                      gather_in=gather_in, scatter_out=scatter_out, row_out=ROW,
                      moe_in_residual=folded)


def activation_shardings(cfg, mesh, opts):
  t = cfg.batch // mesh_lib.axis_size(mesh, DATA) * cfg.seq_len
  out = [("residual x [B, S, D]", "(data, expert, None)  sequence-parallel"),
         ("gathered h [B, S, D]", "(data, None, None) reduced over expert"),
         ("q [B, S, H, Dh]", "(data, None, expert, None)")]
  if opts.exchange == "folded":
    c = send_rows(cfg, mesh)
    return out + [("dispatch buffer [EP, C, D] per device", f"C={c} rows per destination "
                   f"(routed copies T/EP*K={t // mesh_lib.axis_size(mesh, EXPERT) * cfg.top_k})")]
  return out + [("moe buffer xs [M, D] per device",
                 f"M={buffer_rows(cfg, mesh, opts)} rows (all copies T*K={t * cfg.top_k})")]


def routed_rows(cfg, shape: dict) -> int:
  """The planner's hook (planning/plan.py): rows of one MoE layer's expert computation on a
  device, the compaction bound over the data shard's gathered tokens."""
  b = cfg.batch // shape.get(DATA, 1)
  return dispatch.rows_bound(b * cfg.seq_len, cfg.top_k, cfg.n_experts // shape.get(EXPERT, 1),
                             seqs=b, slots=routing.expert_slots(cfg, cfg.seq_len))


def send_rows(cfg, mesh) -> int:
  """exchange=folded: C, ep's rows per destination shard for the T/EP local tokens (b sequences
  of the data shard, S/EP positions of each)."""
  ep = mesh_lib.axis_size(mesh, EXPERT)
  return dispatch.send_rows(cfg, cfg.batch // mesh_lib.axis_size(mesh, DATA), cfg.seq_len // ep, ep)


def cost(cfg, mesh, opts):
  """Per-device collective bytes per step (measure/cost.py; the docstring's schedule)."""
  n_moe, folded = cfg.n_moe_layers, opts.exchange == "folded"
  b = cfg.batch // mesh_lib.axis_size(mesh, DATA)
  t = b * cfg.seq_len
  # the layers whose MLP gathers h and reduce-scatters its output: all (ring); the dense ones
  # and, with a shared expert, the MoE ones (folded: the shared expert's own)
  mlp = cfg.n_layers if not folded else cfg.n_layers - (0 if cfg.n_shared_experts else n_moe)
  rk = cost_lib.nbytes((t, cfg.top_k))                              # one [T, K] of routing
  ids = (2 if cfg.capacity_factor > 0 else 1) * rk                  # expert ids (+ raw, capacity)
  route = 0 if folded else n_moe * rk                               # ring: the weights [T, K]
  # weights: expert-split ones' grads over data; embed / unembed (gather_weight) and the router
  # (shard_map input) over (data, expert); XLA splits the norm scales' sum: expert, then data
  weights = cost_lib.weight_terms(cfg, mesh, param_specs(cfg, mesh), TOKENS,
                                  grads=dict.fromkeys(model.NORMS + ("attn_o_bias",), ((EXPERT,), (DATA,))))
  term = functools.partial(cost_lib.term, mesh)
  # the ring's compaction counts what its buffer would drop (nothing under the worst-case
  # bound, but a count XLA cannot fold): a dropped count per MoE layer
  drops = None if folded else True
  terms = (weights + cost_lib.stats_terms(cfg, mesh, TOKENS, (EXPERT,), drops=drops)
           + cost_lib.sequence_parallel_terms(cfg, mesh, EXPERT, t, mlp)
           + term("all-gather", "fwd", "routing ids + weights (ring's MoE layers)",
                  0 if folded else n_moe * ids + route, EXPERT, cost_lib.RECOMPUTED,
                  calls=(ids // rk + 1) * n_moe)
           + term("reduce-scatter", "bwd", "cotangents of the routing weights",
                  route / mesh_lib.axis_size(mesh, EXPERT), EXPERT, calls=n_moe))
  if folded:
    # ep's exchange of the T/EP local tokens: [EP, C, D] out and back, the counts [EP, e]
    terms += (ep.exchange_terms(cfg, mesh, "a2a", b, t // mesh_lib.axis_size(mesh, EXPERT))
              + cost_lib.capacity_gather_terms(cfg, mesh, EXPERT, t))
  return terms
