"""ep — expert parallelism: experts split over `expert`; outside the MoE `expert` splits the batch.

Mesh axes: (data, fsdp, expert)   (MaxText's default "EP as FSDP/DP": every axis shards the batch)

| tensor                                   | sharding                                             |
|------------------------------------------|------------------------------------------------------|
| tokens / positions [B, S]                | (B_(data,fsdp,expert), S)                            |
| residual x [B, S, D]                     | (B_(data,fsdp,expert), S, D)                         |
| non-expert matrices (embed, attn, router,| D over fsdp, as fsdp.py (layout/fsdp.py); gathered  |
|   shared expert, unembed)                |   before use, grads reduce-scattered                 |
| norms [D], router bias [E]               | replicated                                           |
| experts wi_0/wi_1 [E, D, F], wo [E, F, D]| [E_expert, D_fsdp, F], [E_expert, F, D_fsdp]: E over |
|                                          |   expert, D also FSDP over fsdp, all-gathered over   |
|                                          |   fsdp (never over expert) before the MoE            |
| dispatch buffer (the experts' input)     | [N_src, EP, C, D] @ P((data,fsdp), expert): batch dim|
|   and combine buffer                     |   on (data, fsdp) only, expert dim on expert (#4179) |

MoE: moe_ep, one full-manual shard_map whose body (moe_body, below) routes the local tokens,
plans where each of their K copies goes (layout/dispatch.py) and hands them to an exchange, the
option `exchange` (--opt=exchange=...):
  a2a (default)  packs the copies by destination shard into send [EP, C, D]; "dispatch_a2a":
                 all_to_all over expert (rows and the counts [EP, e]); "expert_gmm": sort the
                 received rows by local expert, SwiGLU gmm on the e = E/EP local experts;
                 "combine_a2a": all_to_all back; unpack. Checked on CPU (contract, cost model).
  ragged         ragged_all_to_all moves only the routed rows (GPU/TPU; XLA:CPU cannot compile
                 it, so it is opt-in and its contract below is unmeasured until a GPU run holds it)
  none           MaxText #4179's mis-sharding (below): no exchange at all
then combines the returned copies with the routing weights. ep_as_cp and shard_exp_on_fsdp call
moe_ep with the a2a exchange. The padded a2a moves EP*min(K,e)/K (<= EP) times the ragged
bytes. C, rows per destination shard (dispatch.send_rows):
  capacity_factor 0 (dropless): T_loc*min(K, e), the exact worst case (tiny, EP 8: 4x the routed
    T_loc*K/EP; DeepSeek-V3 shape, EP 64: 32x)
  capacity_factor cf > 0: min(T_loc*min(K, e), b_loc*e*C_e), C_e = ceil(cf*S*K/E) slots per
    sequence and expert (the capacity rule already drops past them): about cf*T_loc*K/EP

Collectives per layer (d/f/x = the data/fsdp/expert axes; C as above; e = E/EP local experts):
  forward : 1. all-gather over f of attn wq/wk/wv/wo, router, shared wi_0/wi_1/wo (layout.fsdp.use)
            2. all-gather over f of wi_0, wi_1, wo ([E/EP, D, F] each)
            3. scalar/[E] all-reduce over (d, f, x) of the router statistics
            4. "dispatch_a2a": all-to-all over x of the counts [EP, e] (int32) and of the
               send buffer [EP, C, D]                                        [critical path]
            5. "combine_a2a": all-to-all over x of the expert outputs [EP, C, D] [critical path]
  backward: 6. all-to-all over x: the transposes of 4 and 5 ([EP, C, D] each)
            7. non-expert grads: reduce-scatter over f, then all-reduce over (d, x) of the
               1/f shard (gather_weight); norm grads all-reduced over (d, f, x)
            8. expert grads: reduce-scatter over f of [E/EP, D, F], all-reduce over d of the shard
  once per step: embed / final_norm / unembed like one layer's non-expert weights; loss scalars
            and [L, E] counts all-reduced over (d, f, x).
With fsdp = 1 the f collectives vanish (7 becomes a plain all-reduce over (d, x)).
Pick it when the experts do not fit on one device (E*3*D*F*4 B per layer), the global batch is at
least the device count and E divides by EP; cost: 4 token all-to-alls of EP*C*D per layer (fwd +
bwd), on the critical path, and worst-case padding unless ragged.

Dispatch fix (MaxText #4179), `dispatch_buffer_type` shows it without running the model:
  exchange=a2a    [N_src@(data,fsdp), EP@expert, C, D]   (the a2a exchange's recv)
  exchange=none   [N_src@(data,fsdp,expert), EP, C, D]   (local_exchange's send)
The literal mis-sharding P((data,fsdp,expert), expert, ..) raises DuplicateSpecError in JAX;
exchange=none builds what Flax's rule resolution made of it (batch keeps `expert`, E loses it):
no token moves (local_exchange packs the send buffer and keeps it), every device needs every
expert, so the experts are all-gathered over fsdp, then expert, and their grads
reduce-scattered back — the AllGather+ReduceScatter fallback of #4179, here written explicitly
because shard_map in_specs must match exactly. Same losses; EP x the expert bytes gathered per
layer instead of the token exchange.

HLO contract (every collective of the compiled step; size-1 axes drop out; the cost model's
(kind, axes) set equals it, and tests/test_strategies.py holds both to the program, both ways;
tests/test_ep.py adds the all-to-alls' count and exact bytes and the dispatch buffers' specs):
  all-gather over fsdp: weight matrices and experts (fwd)
  reduce-scatter over fsdp: their gradients
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over (data, expert): non-expert grad shards after the fsdp reduce-scatter
  all-reduce over data: expert grad shards
  all-reduce over (data, fsdp, expert): router stats, loss sums, norm-scale grads, grad norm
HLO contract, exchange=none (no all-to-all at all):
  all-gather over fsdp: weight matrices and experts [E/EP, D/f, F] -> [E/EP, D, F] (fwd)
  reduce-scatter over fsdp: their gradients
  all-gather over expert: then the experts [E/EP, D, F] -> [E, D, F], whole on every device
  reduce-scatter over expert: their gradients (before the fsdp scatter)
  all-reduce over (data, expert): non-expert grad shards after the fsdp reduce-scatter
  all-reduce over data: expert grad shards
  all-reduce over (data, fsdp, expert): router stats, loss sums, norm-scale grads, grad norm
HLO contract, exchange=ragged (GPU/TPU; held to XLA:TPU's program, tests/test_target_contracts.py):
  all-gather over fsdp: weight matrices and experts (fwd)
  reduce-scatter over fsdp: their gradients
  all-gather over expert: the counts [EP_src, EP_dst, e] (int32) per layer
  ragged-all-to-all over expert: dispatch [EP*C, D] and combine [T*K, D] rows, fwd and bwd
  all-to-all over expert: the backward's sizes and offsets [EP] (int32), 4 per layer
  all-reduce over (data, expert): non-expert grad shards after the fsdp reduce-scatter
  all-reduce over data: expert grad shards
  all-reduce over (data, fsdp, expert): router stats, loss sums, norm-scale grads, grad norm

  python run.py --strategy=ep --mesh=data:2,expert:4 --devices=8 --steps=3 --hlo_stats
  python run.py --strategy=ep --mesh=fsdp:2,expert:4 --opt=exchange=none --hlo_stats
"""
import dataclasses
import functools

import einops
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from layout import buffers, dispatch, fsdp, mesh as mesh_lib, options
from layout.precision import precision
from measure import cost as cost_lib
from modeling import model, moe
from modeling.config import ConfigError
from parallel.sharding import dim_axes, gather_weight, to_varying, varying_axes
from strategies import BadInput, Case

NAME = "ep"
DATA, FSDP, EXPERT = mesh_lib.DATA, mesh_lib.FSDP, mesh_lib.EXPERT
AXES = (DATA, FSDP, EXPERT)
MAIN_AXIS = EXPERT
TOKENS = (DATA, FSDP, EXPERT)                   # every axis splits the batch (= grad axes)
EXPERT_WEIGHTS = ("wi_0", "wi_1", "wo")
EXPERT_BIASES = ("bi_0", "bi_1", "bo")       # gpt-oss's, split over E as the matrices


@dataclasses.dataclass(frozen=True)
class Options:
  exchange: str = options.choice("a2a", ("a2a", "ragged", "none"),
                                 "the token exchange: padded all-to-all, ragged_all_to_all "
                                 "(GPU/TPU), none (MaxText #4179's mis-sharding)")


COMPARE_MESH = None
# the planner's grid on a TPU cluster: XLA:TPU compiles the ragged exchange and the planner's
# memory for it is held to that compile (docs/planner.md); on a GPU cluster, where asked
PLAN_PLATFORM_EXTRA = {"tpu": (dict(exchange="ragged"),)}
TEST_CASES = [Case("tiny", "expert:8"),
              # gradient accumulation's two passes (runtime/train.py: the batch-wise f from pass 1)
              Case("tiny", "data:2,expert:4", dict(batch=16, microbatches=2)),
              Case("deepseek-test", "fsdp:2,expert:4"),
              Case("tiny", "data:2,expert:4", opts=Options(exchange="none"))]
COST_CASES = TEST_CASES                          # accumulation: measure/cost.step_terms
# ragged_all_to_all compiles for TPU and GPU only; D = 128, one TPU lane width: XLA:TPU lays a
# [rows, 64] exchange out as [rows, 1, 128] and moves twice its bytes
TARGET_CASES = [Case("tiny", "expert:8", dict(d_model=128), Options(exchange="ragged")),
                Case("deepseek-test", "fsdp:2,expert:4", dict(d_model=128),
                     Options(exchange="ragged"))]
# bf16 mixed precision (tests/test_precision.py): the row holding its richest composition
BF16_CASE = Case("tiny", "data:2,expert:4", dict(remat="block", microbatches=2, batch=16))
BAD_INPUT = [
    BadInput(dict(n_experts=6, top_k=2), "expert:4,data:2", Options(),
             "n_experts=6 is not divisible by mesh axis expert=4"),
    BadInput(dict(batch=12), "data:2,expert:4", Options(),
             "batch=12 is not divisible by mesh axis dataxfsdpxexpert=8"),
    BadInput({}, "expert:8", Options(exchange="ragged"),
             "exchange=ragged needs ragged_all_to_all, which XLA:CPU does not implement; use "
             "exchange=a2a (the default)"),
]


def contract_variant(opts):
  """Which HLO contract block of the docstring this exchange compiles to."""
  return None if opts.exchange == "a2a" else f"exchange={opts.exchange}"


def check(cfg, mesh, opts):
  mesh_lib.require_divisible("n_experts", cfg.n_experts, mesh, EXPERT)
  mesh_lib.require_divisible("batch", cfg.batch, mesh, TOKENS)
  fsdp.check(cfg, mesh, FSDP)
  check_exchange(opts.exchange, mesh_lib.platform(mesh))


def param_specs(cfg, mesh, opts=None):
  """fsdp.py's table (D over fsdp) with the routed experts' E dim over expert."""
  return model.param_specs(cfg, {**fsdp.table(FSDP),
                                 "expert_in": P(EXPERT, FSDP, None),    # [E@e, D@f, F]
                                 "expert_out": P(EXPERT, None, FSDP)})  # [E@e, F, D@f]


def batch_spec(cfg, mesh):
  return P(TOKENS, None)                                            # [B, S] @ ((d, f, x), None)


def moe_weights(p, token_axes, cfg, whole=False):
  """Router gathered whole (float32); experts gathered over fsdp only -> [E@expert, D, F] (typed
  reduced over the batch axes; cfg.dtype, cast before the gather), or with whole=True
  (exchange=none) over fsdp and expert -> [E, D, F]."""
  e_entry, e_grad = (None, token_axes) if whole else (
      EXPERT, tuple(a for a in token_axes if a != EXPERT))
  out = {"router": gather_weight(p["router"], P(), token_axes), "bias": p["bias"]}
  if "router_b" in p:                                               # gpt-oss: [E] whole
    out["router_b"] = gather_weight(p["router_b"], P(), token_axes)
  for n in EXPERT_WEIGHTS + tuple(b for b in EXPERT_BIASES if b in p):
    entries = (e_entry,) + (None,) * (p[n].ndim - 2)                # [E/EP, D, F] | [E/EP, F]
    out[n] = gather_weight(p[n], P(*entries), e_grad, **precision(cfg, model.MOE_ROLES[n]))
  return out


def layout(cfg, mesh, opts):
  x_spec = P(TOKENS, None, None)                                    # [B, S, D] @ ((d, f, x),)
  whole = opts.exchange == "none"

  def moe_fn(p, x, positions):
    return moe_ep(moe_weights(p, TOKENS, cfg, whole), x, positions, cfg, ep_axes=(EXPERT,),
                  exchange=EXCHANGES[opts.exchange])
  return model.Parallelism(x=x_spec, use=fsdp.use(TOKENS, cfg), moe=moe_fn)


# ----------------------------------------------------------------------------- the EP exchange
def moe_ep(p, x, positions, cfg, *, ep_axes, exchange=None, gather_sequence=None):
  """The routed MoE with experts sharded over the mesh axes `ep_axes`, as one full-manual
  shard_map (also ep_as_cp's and shard_exp_on_fsdp's MoE). Call in explicit-sharding mode.
  An EP group = the devices that differ only along ep_axes; shard index = their linear index
  (major first).
    p: router [D, E], bias [E] whole; wi_0 / wi_1 [E, D, F], wo [E, F, D] with E over ep_axes in
       that order, D and F whole (moe_weights gathers the FSDP shards).
    x [B, S, D], positions [B, S]: any token sharding whose axes include ep_axes, e.g.
       [B, S, D] @ ((data, fsdp, expert), None, None) or ((data, fsdp), expert, None) (ep_as_cp).
    exchange: how the copies reach their experts and come back (a2a_exchange by default).
    gather_sequence: the capacity rule's whole-sequence gather when S is sharded.
  -> (y with x's sharding, router stats summed over every token axis)."""
  mesh, x_spec = jax.typeof(x).sharding.mesh, _spec(x)
  ep_axes = tuple(ep_axes)
  body = functools.partial(moe_body, cfg=cfg, ep_axes=ep_axes, ep=mesh_lib.axis_size(mesh, *ep_axes),
                           token_axes=_token_axes(x_spec), exchange=exchange or a2a_exchange,
                           gather_sequence=gather_sequence, seq_axes=dim_axes(x_spec, 1))
  y, stats = jax.shard_map(body, mesh=mesh,
                           in_specs=(jax.tree.map(_spec, p), x_spec, P(*tuple(x_spec)[:2])),
                           out_specs=(x_spec, P()))(p, x, positions)   # y [B, S, D] @ x_spec
  return y.astype(x.dtype), stats


def moe_body(p, x, positions, *, cfg, ep_axes, ep, token_axes, exchange, gather_sequence=None,
             seq_axes=()):
  """One device: local tokens x [b, s, D] -> (y [b, s, D], stats summed over token_axes; seq_axes:
  those of them splitting S, for the sequence-wise loss).
  route -> plan -> exchange (the copies through their experts and back) -> weighted combine."""
  b, s, d = x.shape
  t, k = b * s, cfg.top_k
  r, keep, stats = moe.route_tokens(p, x, positions, cfg, experts_all=gather_sequence,
                                    seq_axes=seq_axes)                   # [T, K]
  xin, r = moe.scaled_input(x, r, keep, cfg)            # Llama 4: the score scales the input
  c = dispatch.send_rows(cfg, b, s, ep)                 # C: rows for one shard, never exceeded
  plan = dispatch.make_plan(r.experts, keep, cfg.n_experts, ep)          # copy (t, k) -> dst, slot
  ycopy = exchange(p, xin.reshape(t, d), plan, c, cfg=cfg, ep_axes=ep_axes, ep=ep)  # [T*K, D]
  ycopy = einops.rearrange(ycopy, "(t k) d -> t k d", k=k)               # 0 where not sent
  y = jnp.einsum("tkd,tk->td", ycopy, r.weights.astype(ycopy.dtype))     # weights 0 if dropped
  return y.reshape(b, s, d), jax.tree.map(lambda v: jax.lax.psum(v, token_axes), stats)


def a2a_exchange(p, x, plan, c, *, cfg, ep_axes, ep, experts=None):
  """Padded all-to-all: x [T, D] local tokens -> their copies' expert outputs [T*K, D].
  experts(p, recv, counts, c, cfg) -> out: what runs the received rows (local_experts by
  default; ep_x_tp's sequence-parallel exchange gathers them over tensor first)."""
  send = dispatch.pack(x, plan, cfg.top_k, c)                            # [EP, C, D] by dst shard
  with jax.named_scope("dispatch_a2a"):
    recv = jax.lax.all_to_all(send, ep_axes, 0, 0, tiled=True)           # [EP, C, D] by src shard
    counts = jax.lax.all_to_all(plan.counts, ep_axes, 0, 0, tiled=True)  # [EP, e] by src shard
  with jax.named_scope("expert_gmm"):
    out = (experts or local_experts)(p, recv, counts, c, cfg)            # [EP, C, D]
  with jax.named_scope("combine_a2a"):
    back = jax.lax.all_to_all(out, ep_axes, 0, 0, tiled=True)            # [EP, C, D] by dst shard
  return dispatch.unpack(back, plan)                                     # [T*K, D], 0 if dropped


def local_experts(p, rows, counts, c, cfg):
  """rows [N, C, D], each source's C rows sorted by local expert, counts [N, e] -> the e local
  experts' SwiGLU of them, [N, C, D] (padding rows out as 0)."""
  ids = dispatch.segment_ids(counts, c)                                  # [N, C] in 0..e (e = pad)
  return moe.experts_ffn(p, rows, ids, counts.shape[-1], cfg.gmm_backend, cfg)


def ragged_exchange(p, x, plan, c, *, cfg, ep_axes, ep, ragged_fn=jax.lax.ragged_all_to_all):
  """ragged_all_to_all (GPU/TPU): only the routed rows move. The copies, sorted by expert
  (plan.pos), are one contiguous run per destination shard; the counts are all-gathered so
  every shard knows a[i, j], the rows shard i sends j, and the offsets follow
  (dispatch.ragged_params). ragged_fn: a stand-in for the op (tests, on CPU)."""
  t, d = x.shape
  k, n_local = cfg.top_k, cfg.n_experts // ep
  rows = jnp.repeat(x, k, axis=0)                                        # [T*K, D] copy order
  xs = jnp.zeros_like(rows).at[plan.pos].set(rows)                       # expert-sorted
  g = jax.lax.all_gather(plan.counts, ep_axes, axis=0)                   # [EP_src, EP_dst, e]
  me = jax.lax.axis_index(ep_axes)
  there, home = dispatch.ragged_params(jnp.sum(g, axis=-1), me)          # offsets and sizes
  # the output buffers typed varying as their operand is: the result takes its buffer's type,
  # and an invariant one would be cast to varying where it meets the rows, whose transpose
  # all-reduces each cotangent over the devices
  like = lambda shape, a: to_varying(buffers.padded(shape, a.dtype), varying_axes(a))
  with jax.named_scope("dispatch_a2a"):
    recv = ragged_fn(xs, like((ep * c, d), xs), *there, axis_name=ep_axes)
  with jax.named_scope("expert_gmm"):
    seg = dispatch.segment_ids(g[:, me, :].reshape(ep * n_local), ep * c)  # (source, local expert)
    ids = jnp.where(seg < ep * n_local, seg % n_local, n_local)          # local expert, e = pad
    out = moe.experts_ffn(p, recv, ids, n_local, cfg.gmm_backend, cfg)        # [EP*C, D]
  with jax.named_scope("combine_a2a"):
    back = ragged_fn(out, like((t * k, d), out), *home,
                     axis_name=ep_axes)                                  # [T*K, D] expert-sorted
  sent = plan.dst < ep                                                   # dropped copies: unsent
  return jnp.where(sent[:, None], back[plan.pos], 0)                     # [T*K, D] copy order


def local_exchange(p, x, plan, c, *, cfg, ep_axes, ep):
  """exchange=none (MaxText #4179): the send buffer [EP, C, D] is never exchanged (its batch dim
  keeps `expert`): every device runs its own rows through every expert, so p's experts must be
  whole [E, D, F] (moe_weights(whole=True) gathers them over expert too)."""
  del ep_axes
  n_local = cfg.n_experts // ep
  send = dispatch.pack(x, plan, cfg.top_k, c)                            # [EP, C, D], stays here
  with jax.named_scope("expert_gmm"):
    local = dispatch.segment_ids(plan.counts, c)                         # [EP, C] in 0..e (e = pad)
    first = einops.repeat(jnp.arange(ep) * n_local, "x -> x c", c=c)     # shard x's first expert
    ids = jnp.where(local < n_local, first + local, cfg.n_experts)       # global ids, E = pad
    out = moe.experts_ffn(p, send, ids, cfg.n_experts, cfg.gmm_backend, cfg)
  return dispatch.unpack(out, plan)                                      # [T*K, D]


EXCHANGES = {"a2a": a2a_exchange, "ragged": ragged_exchange, "none": local_exchange}


def check_exchange(name: str, platform: str | None = None) -> None:
  """ragged_all_to_all does not compile on XLA:CPU: refuse it there, before any compile."""
  if name == "ragged" and (platform or jax.default_backend()) == "cpu":
    raise ConfigError("exchange=ragged needs ragged_all_to_all, which XLA:CPU does not "
                      "implement; use exchange=a2a (the default)")


def _spec(a):
  return jax.typeof(a).sharding.spec


def _token_axes(x_spec) -> tuple[str, ...]:
  return tuple(a for i in range(len(x_spec)) for a in dim_axes(x_spec, i))


def buffer_spec(token_axes, ep_axes, batch_on_expert: bool = False) -> P:
  """[N_src, EP, rows, D]: batch over the token axes minus ep_axes, expert dim over ep_axes."""
  ep_axes = tuple(ep_axes)
  entry = lambda axes: None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))
  rest = tuple(a for a in token_axes if a not in ep_axes)
  if batch_on_expert:                       # #4179: batch keeps `expert`, so E cannot have it
    return P(entry(rest + ep_axes), None, None, None)
  return P(entry(rest), entry(ep_axes), None, None)


def buffer_type(cfg, mesh, x_spec, ep_axes, *, exchange_name="a2a", dtype=jnp.float32):
  """The experts' input buffer as one global array [N_src, EP, rows, D] (ShapeDtypeStruct with
  its sharding; N_src = token shards, dim 0 = who sent the rows, dim 1 = whose experts they are
  for): each device's body holds one block of it, a2a's recv [EP_src, C, D] (ragged:
  [EP*C, D]; none: its own send [EP_dst, C, D]). Computed from the shapes: nothing is traced."""
  token_axes, ep = _token_axes(x_spec), mesh_lib.axis_size(mesh, *ep_axes)
  n = mesh_lib.axis_size(mesh, *token_axes)
  b_loc = cfg.batch // mesh_lib.axis_size(mesh, *dim_axes(x_spec, 0))
  s_loc = cfg.seq_len // mesh_lib.axis_size(mesh, *dim_axes(x_spec, 1))
  c = dispatch.send_rows(cfg, b_loc, s_loc, ep)
  shape = (n // ep, ep, ep * c, cfg.d_model) if exchange_name == "ragged" else (n, ep, c, cfg.d_model)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
      mesh, buffer_spec(token_axes, ep_axes, exchange_name == "none")))


def dispatch_buffer_type(cfg, mesh, opts):
  """The experts' input buffer (ShapeDtypeStruct with its sharding) for this cfg and mesh."""
  return buffer_type(cfg, mesh, P(TOKENS, None, None), (EXPERT,), exchange_name=opts.exchange)


def activation_shardings(cfg, mesh, opts):
  t = dispatch_buffer_type(cfg, mesh, opts)
  return [("residual x [B, S, D]", f"[{cfg.batch}@(data,fsdp,expert), {cfg.seq_len}, {cfg.d_model}]"),
          ("dispatch buffer [N_src, EP, C, D]", f"{t.shape} @ {t.sharding.spec}")]


def cost(cfg, mesh, opts, token_axes=TOKENS, batch_axes=TOKENS, grads=None):
  """Per-device collective bytes per step (measure/cost.py; the docstring's schedule). The weight
  traffic from moe_weights / fsdp.use; the exchange; router statistics. batch_axes: the axes
  splitting B (ep_as_cp: (data, fsdp); the rest of token_axes split S); grads: overrides of
  cost.weight_terms' gradient axes (ep_as_cp's norms)."""
  whole = opts.exchange == "none"
  expert_use = (P(), token_axes) if whole else (
      P(EXPERT, None, None), tuple(a for a in token_axes if a != EXPERT))
  bias_use = (P(*expert_use[0][:2]), expert_use[1])                # gpt-oss's [E, F] / [E, D]
  gathered = {**cost_lib.fsdp_gathered(token_axes), **dict.fromkeys(model.EXPERTS, expert_use),
              **dict.fromkeys(model.EXPERT_BIASES, bias_use)}
  terms = (cost_lib.weight_terms(cfg, mesh, param_specs(cfg, mesh), token_axes, gathered, grads)
           + cost_lib.stats_terms(cfg, mesh, token_axes,
                                  tuple(a for a in token_axes if a not in batch_axes)))
  b_loc = cfg.batch // mesh_lib.axis_size(mesh, *batch_axes)
  t_loc = cfg.batch * cfg.seq_len // mesh_lib.axis_size(mesh, *token_axes)
  return terms + exchange_terms(cfg, mesh, opts.exchange, b_loc, t_loc)


def exchange_terms(cfg, mesh, exchange_name, b_loc, t_loc, axes=(EXPERT,), calls=None):
  """The token exchange over `axes` (one EP group) per step, `calls` runs of moe_body with that
  exchange (default: one per MoE layer; pp: per stage pass and local layer): b_loc sequences
  and t_loc tokens routed per device and run. ep's, ep_x_tp's, shard_exp_on_fsdp's and pp's."""
  calls = cfg.n_moe_layers if calls is None else calls
  e = mesh_lib.axis_size(mesh, *axes)
  c = dispatch.send_rows(cfg, b_loc, t_loc // b_loc, e)
  act, term = cost_lib.act_bytes(cfg), functools.partial(cost_lib.term, mesh)
  # the combine's output is read by the backward only for the weights' gradient: where the
  # weights are the constant kept mask (Llama 4's input-scaled routing), remat does not redo it
  combine_remat = () if cfg.route_scale_input else cost_lib.RECOMPUTED
  if exchange_name == "a2a":
    buf = e * c * cfg.d_model * act                              # [EP, C, D]
    return (term("all-to-all", "fwd", "dispatch buffers, counts [EP, e] (int32)",
                 calls * (buf + cfg.n_experts * 4), axes, cost_lib.RECOMPUTED, calls=2 * calls)
            + term("all-to-all", "fwd", "combine buffers", calls * buf, axes, combine_remat,
                   calls=calls)
            + term("all-to-all", "bwd", "their transposes", calls * 2 * buf, axes,
                   calls=2 * calls))
  if exchange_name == "ragged":                    # output buffers: [EP*C, D] and [T*K, D]
    send, back = e * c * cfg.d_model * act, t_loc * cfg.top_k * cfg.d_model * act
    # the rows it moves: the routed copies (balanced routing; the capacity rule drops past
    # them), into a receive buffer of the worst case
    routed = min(send, back)
    return (term("all-gather", "fwd", "counts [EP, EP, e] (int32)", calls * e * cfg.n_experts * 4,
                 axes, cost_lib.RECOMPUTED, calls=calls)
            + term("ragged-all-to-all", "fwd", "dispatch rows", calls * send, axes,
                   cost_lib.RECOMPUTED, calls=calls, moved=calls * routed)
            + term("ragged-all-to-all", "fwd", "combine rows", calls * back, axes, combine_remat,
                   calls=calls, moved=calls * routed)
            + term("ragged-all-to-all", "bwd", "their transposes", calls * (send + back), axes,
                   calls=2 * calls, moved=calls * 2 * routed)
            + term("all-to-all", "bwd", "the transposes' sizes and offsets [EP] (int32)",
                   calls * 4 * e * 4, axes, calls=calls))
  return []
