"""ep — expert parallelism: experts split over `expert`; outside the MoE `expert` splits the batch.

Mesh axes: (data, fsdp, expert)   (MaxText's default "EP as FSDP/DP": every axis shards the batch)

| tensor                                   | sharding                                             |
|------------------------------------------|------------------------------------------------------|
| tokens / positions [B, S]                | (B_(data,fsdp,expert), S)                            |
| residual x [B, S, D]                     | (B_(data,fsdp,expert), S, D)                         |
| non-expert matrices (embed, attn, router,| D over fsdp, as fsdp.py (common/layouts.py); gathered|
|   shared expert, unembed)                |   before use, grads reduce-scattered                 |
| norms [D], router bias [E]               | replicated                                           |
| experts wi_0/wi_1 [E, D, F], wo [E, F, D]| [E_expert, D_fsdp, F], [E_expert, F, D_fsdp]: E over |
|                                          |   expert, D also FSDP over fsdp, all-gathered over   |
|                                          |   fsdp (never over expert) before the MoE            |
| dispatch buffer (the experts' input)     | [N_src, EP, C, D] @ P((data,fsdp), expert): batch dim|
|   and combine buffer                     |   on (data, fsdp) only, expert dim on expert (#4179) |

MoE (common/dispatch.py): route the local tokens, pack their K copies into a send buffer
[EP, C, D], all_to_all over expert, sort the received rows by local expert, SwiGLU gmm on the local experts,
all_to_all back, combine. cfg.dispatch: "a2a" (that; any backend), "ragged" (ragged_all_to_all:
moves only the routed rows, GPU/TPU only), "auto" (ragged on GPU/TPU, a2a on CPU). The padded
a2a moves EP*min(K,L)/K (<= EP) times the ragged bytes. C, rows per destination shard:
  capacity_factor 0 (dropless): T_loc*min(K, L), the exact worst case (tiny, EP 8: 4x the routed
    T_loc*K/EP; DeepSeek-V3 shape, EP 64: 32x)
  capacity_factor cf > 0: min(T_loc*min(K, L), b_loc*L*C_e), C_e = ceil(cf*S*K/E) slots per
    sequence and expert (the capacity rule already drops past them): about cf*T_loc*K/EP

Collectives per layer (d/f/e = data/fsdp/expert; C as above; L = E/EP):
  forward : 1. all-gather over f of attn wq/wk/wv/wo, router, shared wi_0/wi_1/wo  (fsdp_use)
            2. all-gather over f of wi_0, wi_1, wo ([E/EP, D, F] each)
            3. scalar/[E] all-reduce over (d, f, e) of the router statistics
            4. "dispatch_a2a": all-to-all over e of the counts [EP, L] (int32) and of the
               send buffer [EP, C, D]                                        [critical path]
            5. "combine_a2a": all-to-all over e of the expert outputs [EP, C, D] [critical path]
  backward: 6. all-to-all over e: the transposes of 4 and 5 ([EP, C, D] each)
            7. non-expert grads: reduce-scatter over f, then all-reduce over (d, e) of the
               1/f shard (gather_weight); norm grads all-reduced over (d, f, e)
            8. expert grads: reduce-scatter over f of [E/EP, D, F], all-reduce over d of the shard
  once per step: embed / final_norm / unembed like one layer's non-expert weights; loss scalars
            and [L, E] counts all-reduced over (d, f, e).
With fsdp = 1 the f collectives vanish (7 becomes a plain all-reduce over (d, e)).
Pick it when the experts do not fit on one device (E*3*D*F*4 B per layer), the global batch is at
least the device count and E divides by EP; cost: 4 token all-to-alls of EP*C*D per layer (fwd +
bwd), on the critical path, and worst-case padding unless ragged.

Dispatch fix (MaxText #4179), `dispatch_buffer_type` shows it without running the model:
  default                        [N_src@(data,fsdp), EP@expert, C, D]
  --dispatch_batch_on_expert     [N_src@(data,fsdp,expert), EP, C, D]
The literal mis-sharding P((data,fsdp,expert), expert, ..) raises DuplicateSpecError in JAX; the
flag builds what Flax's rule resolution made of it (batch keeps `expert`, E loses it): no token
moves, every device needs every expert, so the experts are all-gathered over (fsdp, expert) and
their grads reduce-scattered back — the AllGather+ReduceScatter fallback of #4179, here written
explicitly because shard_map in_specs must match exactly. Same losses; EP x the expert bytes
gathered per layer instead of the token exchange (and --dispatch is moot: nothing is exchanged).

HLO contract (every collective of the compiled step; size-1 axes drop out):
  all-gather over fsdp: weight matrices and experts (fwd)
  reduce-scatter over fsdp: their gradients
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over (data, expert): non-expert grad shards after the fsdp reduce-scatter
  all-reduce over data: expert grad shards
  all-reduce over expert: grad-norm partial sums of expert-sharded leaves
  all-reduce over (fsdp, expert): grad-norm partial sums of expert leaves
  all-reduce over fsdp: grad-norm partial sums of fsdp leaves
  all-reduce over (data, fsdp, expert): router stats, loss sums, norm-scale grads
HLO contract with --dispatch_batch_on_expert (no all-to-all at all):
  all-gather over (fsdp, expert): the experts [E, D, F] whole on every device (fwd)
  reduce-scatter over (fsdp, expert): their gradients
  all-reduce over data: expert grad shards
  plus every line of the default contract but the all-to-all

  python run.py --strategy=ep --mesh=data:2,expert:4 --devices=8 --steps=3 --hlo_stats
  python run.py --strategy=ep --mesh=fsdp:2,expert:4 --dispatch_batch_on_expert --hlo_stats
"""
import jax
from jax.sharding import PartitionSpec as P

from common import cost as cost_lib
from common import dispatch, layouts
from common import mesh as mesh_lib
from common import model
from common.sharding import gather_weight

NAME = "ep"
DATA, FSDP, EXPERT = mesh_lib.DATA, mesh_lib.FSDP, mesh_lib.EXPERT
AXES = (DATA, FSDP, EXPERT)
MAIN_AXIS = EXPERT
TOKENS = (DATA, FSDP, EXPERT)                   # every axis splits the batch (= grad axes)
EXPERT_WEIGHTS = ("wi_0", "wi_1", "wo")


def check(cfg, mesh):
  mesh_lib.require_divisible("n_experts", cfg.n_experts, mesh, EXPERT)
  mesh_lib.require_divisible("batch", cfg.batch, mesh, TOKENS)
  layouts.check_fsdp(cfg, mesh, FSDP)
  dispatch.check_method(cfg.dispatch)


def param_specs(cfg, mesh):
  """fsdp.py's table (D over fsdp) with the routed experts' E dim over expert."""
  return model.param_specs(cfg, {**layouts.fsdp_table(FSDP),
                                 "expert_in": P(EXPERT, FSDP, None),    # [E@e, D@f, F]
                                 "expert_out": P(EXPERT, None, FSDP)})  # [E@e, F, D@f]


def batch_spec(cfg, mesh):
  return P(TOKENS, None)                                            # [B, S] @ ((d, f, e), None)


def moe_weights(p, token_axes, batch_on_expert=False):
  """Router gathered whole; experts gathered over fsdp only -> [E@expert, D, F] (typed reduced
  over the batch axes), or with batch_on_expert over fsdp and expert -> [E, D, F]."""
  e_entry, e_grad = (None, token_axes) if batch_on_expert else (
      EXPERT, tuple(a for a in token_axes if a != EXPERT))
  out = {"router": gather_weight(p["router"], P(), token_axes), "bias": p["bias"]}
  for n in EXPERT_WEIGHTS:
    out[n] = gather_weight(p[n], P(e_entry, None, None), e_grad)     # [E/EP, D, F] local
  return out


def layout(cfg, mesh):
  x_spec = P(TOKENS, None, None)                                    # [B, S, D] @ ((d, f, e),)
  method = dispatch.resolve_method(cfg.dispatch)

  def moe_fn(p, x, positions):
    return dispatch.moe_ep(moe_weights(p, TOKENS, cfg.dispatch_batch_on_expert), x, positions,
                           cfg, ep_axes=(EXPERT,), method=method,
                           batch_on_expert=cfg.dispatch_batch_on_expert)
  return model.Layout(x=x_spec, use=layouts.fsdp_use(TOKENS), moe=moe_fn)


def dispatch_buffer_type(cfg, mesh):
  """The experts' input buffer (ShapeDtypeStruct with its sharding) for this cfg and mesh."""
  return dispatch.dispatch_type(cfg, mesh, P(TOKENS, None, None), (EXPERT,),
                                method=dispatch.resolve_method(cfg.dispatch),
                                batch_on_expert=cfg.dispatch_batch_on_expert)


def activation_shardings(cfg, mesh):
  t = dispatch_buffer_type(cfg, mesh)
  return [("residual x [B, S, D]", f"[{cfg.batch}@(data,fsdp,expert), {cfg.seq_len}, {cfg.d_model}]"),
          ("dispatch buffer [N_src, EP, C, D]", f"{t.shape} @ {t.sharding.spec}")]


def cost(cfg, mesh, token_axes=TOKENS, batch_axes=TOKENS):
  """Per-device collective bytes per step (see the docstring's schedule). batch_axes: the axes
  splitting B (ep_as_cp: (data, fsdp); the rest of token_axes split S)."""
  f, e = mesh_lib.axis_size(mesh, FSDP), mesh_lib.axis_size(mesh, EXPERT)
  d, n = mesh_lib.axis_size(mesh, DATA), mesh_lib.axis_size(mesh, *token_axes)
  flag = cfg.dispatch_batch_on_expert
  leaves = model.param_leaves(cfg)
  expert = [cost_lib.nbytes(l.shape) / (1 if flag else e) for l in leaves
            if l.role in model.EXPERTS]                              # gathered size
  mats = [cost_lib.nbytes(l.shape) for l in leaves
          if l.role in model.D_DIM and l.role not in model.EXPERTS]
  norms = sum(cost_lib.nbytes(l.shape) for l in leaves if l.role in model.NORMS)
  ge = f * e if flag else f                                   # the experts' gather group
  T = cost_lib.Term
  terms = []
  if f > 1:
    terms += [T("all-gather", "fwd", "weight matrices over fsdp", sum(mats), f),
              T("reduce-scatter", "bwd", "weight-matrix grads over fsdp", sum(mats) / f, f)]
  if ge > 1:
    terms += [T("all-gather", "fwd", "experts", sum(expert), ge),
              T("reduce-scatter", "bwd", "expert grads", sum(expert) / ge, ge)]
  if n // f > 1:
    terms.append(T("all-reduce", "bwd", "matrix grad shards over (data, expert)", sum(mats) / f,
                   n // f))
  if d > 1:
    terms.append(T("all-reduce", "bwd", "expert grad shards over data", sum(expert) / ge, d))
  if n > 1:
    terms.append(T("all-reduce", "bwd", "norm-scale grads", norms, n))
  terms.append(T("all-reduce", "opt", "grad-norm partial sums", 4 * (len(mats) + len(expert)), n))
  terms += layouts.stats_cost(cfg, mesh, token_axes)
  if not flag and e > 1:
    b_loc = cfg.batch // mesh_lib.axis_size(mesh, *batch_axes)
    c = dispatch.send_rows(cfg, b_loc, cfg.batch * cfg.seq_len // n // b_loc, e)
    buf = e * c * cfg.d_model * cost_lib.F32                     # [EP, C, D]
    terms += [T("all-to-all", "fwd", "dispatch + combine buffers, counts [EP, L] (int32)",
                cfg.n_layers * (2 * buf + cfg.n_experts * 4), e),
              T("all-to-all", "bwd", "their transposes", cfg.n_layers * 2 * buf, e)]
  return terms
