"""shard_exp_on_fsdp — FSDP shards the *expert* dim of the routed experts (MaxText #3988), mixed
with EP: every device stores whole expert matrices, so a matrix-wise optimizer (Muon's
Newton-Schulz per expert) updates them with no communication.

Mesh axes: (fsdp, expert). EP = |expert|, n_f = |fsdp|, N = n_f*EP devices; F = d_ff.

| tensor                                   | sharding                                          |
|------------------------------------------|---------------------------------------------------|
| experts wi_0/wi_1 [E, D, F], wo [E, F, D]| (("expert", "fsdp"), None, None): E/N whole       |
|                                          |   experts per device, expert-major                |
| embed, unembed, router, attn, shared     | D over (fsdp, expert) (layout/fsdp.py),           |
|                                          |   gathered before use, grads reduce-scattered     |
| norms [D], router bias [E]               | replicated                                        |
| tokens [B, S], residual x [B, S, D]      | (B_(fsdp,expert), S[, D])                         |
| dispatch buffer                          | gather: [N_src, EP, C, D] @ (fsdp, expert)        |
|                                          | ep    : [N_src, N, C', D] @ (None, (expert, fsdp)) |

Expert-major storage: device (f, x) holds experts block x*n_f + f, so gathering over fsdp leaves
device x with the contiguous block x its EP shard owns:
  E=8, n_f=2, EP=2: (f0,x0) e0-1, (f1,x0) e2-3, (f0,x1) e4-5, (f1,x1) e6-7 -> over fsdp: x0 e0-3
Muon (modeling/optim.py) reshards a stacked expert leaf [L, E, D, F] to P(None, spec[1], None, None)
and runs Newton-Schulz batched over E (per layer). Here E is the only sharded dim, so that
reshard is a no-op and the optimizer step on the experts issues no collective (plain fsdp shards
D: Muon all-gathers every expert matrix whole).

Option `mode` (--opt=mode=gather|ep), T = B*S/N local tokens:
  "gather" (MaxText): all-gather the experts over fsdp at the MoE input -> [E@expert, D, F];
     fsdp is data parallelism for the MoE, tokens move over expert only (all_to_all, as ep.py);
     expert grads reduce-scatter back over fsdp. Per layer 3*E/EP*D*F*4 B gathered (fwd) and
     3*E/N*D*F*4 B scattered (bwd); token buffers [EP, C, D], C as in ep.py
     (T*min(K, E/EP) dropless; about cf*T*K/EP with capacity factor cf).
  "ep": fsdp x expert is one EP group of N (ep.py's moe_ep over (expert, fsdp)): experts
     never move, no weight collective and no expert-grad reduction at all. Tokens: each routed
     copy still goes to exactly one device (a ragged exchange moves the same T*K rows; (N-1)/N
     of them leave the device vs (EP-1)/EP); the padded buffer [N, C', D], C' = T*min(K, E/N),
     holds T*min(N*K, E) rows vs gather's T*min(EP*K, E): equal when E <= EP*K. The price: the
     all-to-all spans all N devices, fsdp links included, with more and smaller messages.
     Pick it when the fsdp axis is on fast links; "gather" keeps the token exchange on the
     expert axis and pays the weight traffic over fsdp instead.

Collectives per layer (f = fsdp, x = expert)
  forward : all-gather over (f, x) of attn / shared / router weights (layout.fsdp.use);
            gather: all-gather over f of wi_0, wi_1, wo, all-to-all over x of the counts,
            dispatch and combine buffers;  ep: the all-to-alls over (x, f), no expert gather;
            all-reduce over (f, x) of router statistics
  backward: the all-to-all transposes; reduce-scatter over (f, x) of the non-expert grads;
            gather: reduce-scatter over f of the expert grads;  ep: nothing for the experts
  optimizer (Muon): all-gather over (f, x) of attn / shared matrices (Newton-Schulz needs them
            whole); nothing for the experts
HLO contract (gather mode; every collective of the compiled step; size-1 axes drop out; the cost
model's (kind, axes) set equals it, and tests/test_strategies.py holds both to the program;
tests/test_shard_exp_on_fsdp.py adds the two modes' weight traffic and Muon's expert update):
  all-gather over (fsdp, expert): non-expert weight matrices before use (and Muon's matrices)
  reduce-scatter over (fsdp, expert): their gradients
  all-gather over fsdp: experts [E/N, D, F] -> [E/EP, D, F]
  reduce-scatter over fsdp: expert gradients
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over (fsdp, expert): router statistics, loss sums, norm-scale grads, grad norm
HLO contract, mode=ep:
  all-gather over (fsdp, expert): non-expert weight matrices before use (and Muon's matrices)
  reduce-scatter over (fsdp, expert): their gradients
  all-to-all over (fsdp, expert): counts, dispatch and combine buffers, fwd and bwd
  all-reduce over (fsdp, expert): router statistics, loss sums, norm-scale grads, grad norm
When to use: Muon (or any matrix-wise optimizer) on MoE weights with FSDP, E divisible by N.
Cost: like ep + fsdp; gather mode holds E/EP gathered experts per layer during the step.

  python run.py --strategy=shard_exp_on_fsdp --mesh=fsdp:2,expert:4 --optimizer=muon --steps=3
  python run.py --strategy=shard_exp_on_fsdp --mesh=fsdp:2,expert:4 --opt=mode=ep
"""
import dataclasses

from jax.sharding import PartitionSpec as P

from layout import fsdp, mesh as mesh_lib, options
from layout.precision import cast_stored, precision
from measure import cost as cost_lib
from modeling import model
from parallel.sharding import gather_weight
from strategies import BadInput, Case, ep
from strategies.ep import buffer_type, moe_ep

NAME = "shard_exp_on_fsdp"
FSDP, EXPERT = mesh_lib.FSDP, mesh_lib.EXPERT
AXES = (FSDP, EXPERT)
MAIN_AXIS = FSDP
COMPARE_MESH = "fsdp:2,expert:4"        # the mixed FSDP + EP layout for the comparison table
TOKENS = (FSDP, EXPERT)                         # every axis splits the batch (= grad axes)
EXPERT_WEIGHTS = ("wi_0", "wi_1", "wo")
STORED = P((EXPERT, FSDP), None, None)          # [E@(expert,fsdp), ., .], expert-major


@dataclasses.dataclass(frozen=True)
class Options:
  mode: str = options.choice("gather", ("gather", "ep"),
                             "gather: experts all-gathered over fsdp, tokens exchanged over "
                             "expert (MaxText); ep: fsdp x expert is one EP group")


F8, F2E4 = "fsdp:8,expert:1", "fsdp:2,expert:4"
TEST_CASES = [Case("tiny", F2E4), Case("deepseek-test", F8),
              Case("deepseek-test", F2E4, dict(optimizer="muon")),
              Case("tiny", F2E4, opts=Options(mode="ep"))]
# gpt-oss in bf16: every bias's gradient summed across devices in float32 (its q/k/v biases too)
COST_CASES = [*TEST_CASES, Case("gpt-oss-test", F2E4, dict(dtype="bfloat16", remat="block"))]
# bf16 mixed precision (tests/test_precision.py): the row holding its richest composition
BF16_CASE = Case("tiny", "fsdp:2,expert:4")
# the options the planner varies (planning/plan.py: every combination)
PLAN_GRID = {"mode": ("gather", "ep")}
BAD_INPUT = [
    BadInput(dict(n_experts=4, top_k=2), F2E4, Options(),
             "n_experts=4 is not divisible by mesh axis expertxfsdp=8"),
    BadInput(dict(n_experts=4, top_k=2), F8, Options(),
             "n_experts=4 is not divisible by mesh axis expertxfsdp=8"),
    BadInput(dict(batch=4), F2E4, Options(), "batch=4 is not divisible by mesh axis fsdpxexpert=8")]


def contract_variant(opts):
  """Which HLO contract block of the docstring this mode compiles to."""
  return "mode=ep" if opts.mode == "ep" else None


def check(cfg, mesh, opts):
  mesh_lib.require_divisible("n_experts", cfg.n_experts, mesh, (EXPERT, FSDP))
  mesh_lib.require_divisible("batch", cfg.batch, mesh, TOKENS)
  fsdp.check(cfg, mesh, TOKENS)


def param_specs(cfg, mesh, opts=None):
  # D over (fsdp, expert) for every matrix but the experts, stored whole on their E dim
  return model.param_specs(cfg, {**fsdp.table(TOKENS), "expert_in": STORED,
                                 "expert_out": STORED})


def batch_spec(cfg, mesh):
  return P(TOKENS, None)                                            # [B, S] @ ((f, x), None)


def moe_weights(p, cfg, opts):
  """gather: experts [E@(e,f)] -> [E@e, D, F] (all-gather over fsdp, typed reduced over it:
  the expert grads are partial over fsdp's token shards and come back reduce-scattered).
  ep: experts as stored (mixed precision: cast on the shard). The router is gathered whole in
  both, in float32; the experts move in cfg.dtype."""
  out = {"router": gather_weight(p["router"], P(), TOKENS), "bias": p["bias"]}
  if "router_b" in p:                                               # gpt-oss: [E] whole
    out["router_b"] = gather_weight(p["router_b"], P(), TOKENS)
  for n in EXPERT_WEIGHTS + tuple(b for b in ep.EXPERT_BIASES if b in p):
    role, entries = model.MOE_ROLES[n], (None,) * (p[n].ndim - 1)
    out[n] = (gather_weight(p[n], P(EXPERT, *entries), (FSDP,), **precision(cfg, role))
              if opts.mode == "gather" else cast_stored(p[n], role, cfg, ()))
  return out


def ep_axes(opts):
  return (EXPERT,) if opts.mode == "gather" else (EXPERT, FSDP)


def layout(cfg, mesh, opts):
  x_spec = P(TOKENS, None, None)                                    # [B, S, D] @ ((f, x),)

  def moe_fn(p, x, positions):                                      # ep.py's exchange
    return moe_ep(moe_weights(p, cfg, opts), x, positions, cfg, ep_axes=ep_axes(opts))
  return model.Parallelism(x=x_spec, use=fsdp.use(TOKENS, cfg), moe=moe_fn)


def activation_shardings(cfg, mesh, opts):
  t = buffer_type(cfg, mesh, P(TOKENS, None, None), ep_axes(opts))
  return [("residual x [B, S, D]", f"[{cfg.batch}@(fsdp,expert), {cfg.seq_len}, {cfg.d_model}]"),
          ("experts in the MoE [E, D, F]",
           "E@expert (gathered over fsdp)" if opts.mode == "gather" else "E@(expert,fsdp)"),
          ("dispatch buffer", f"{t.shape} @ {t.sharding.spec}")]


def cost(cfg, mesh, opts):
  """Per-device collective bytes per step (measure/cost.py; the docstring's schedule)."""
  gather = opts.mode == "gather"
  gathered = cost_lib.fsdp_gathered(TOKENS)                 # every matrix but the experts
  for role in model.EXPERTS:                                # gather: E@(e,f) -> E@e, grads over f
    gathered[role] = (P(EXPERT, None, None), (FSDP,)) if gather else (STORED, ())
  if gather:                                                # gpt-oss's expert biases, as theirs
    gathered.update(dict.fromkeys(model.EXPERT_BIASES, (P(EXPERT, None), (FSDP,))))
  specs = param_specs(cfg, mesh)
  terms = (cost_lib.weight_terms(cfg, mesh, specs, TOKENS, gathered)
           + cost_lib.stats_terms(cfg, mesh, TOKENS)
           # Newton-Schulz on whole matrices: the D-split ones gathered, the experts (split on E
           # only) not
           + cost_lib.muon_terms(cfg, mesh, specs, TOKENS))
  b_loc = cfg.batch // mesh_lib.axis_size(mesh, *TOKENS)
  return terms + ep.exchange_terms(cfg, mesh, "a2a", b_loc, b_loc * cfg.seq_len, ep_axes(opts))
