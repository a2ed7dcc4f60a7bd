"""ep_as_cp — the expert axis plays context parallelism everywhere except inside the core MoE
(MaxText #3656's ep-as-cp rule): tokens are split over `expert` along the *sequence*.

Mesh axes: (data, fsdp, expert). The expert axis is the one playing CP.

| tensor                                  | sharding                                            |
|-----------------------------------------|-----------------------------------------------------|
| tokens / targets / positions [B, S]     | (B_(data,fsdp), S_expert), load-balanced order      |
| residual x [B, S, D], q [B, S, H, Dh]   | (B_(data,fsdp), S_expert, ..)                       |
| k / v [B, T, KV, Dh], kv_pos [B, T]     | (B_(data,fsdp), T, ..): all-gathered over expert    |
|   MLA: latent c_KV + k_r [B, T, Rkv+rope]| the same, gathered instead of K/V (as cp.py)        |
| weights, experts                        | as ep.py: matrices D over fsdp; experts [E_expert,   |
|                                         |   D_fsdp, F], gathered over fsdp before the MoE     |
| dispatch / combine buffer               | [N_src, EP, C, D] @ P((data,fsdp), expert)          |
Non-expert weights are FSDP over fsdp only (MaxText's rule also shards them over expert), so the
weight layout equals cp.py's and FSDP=2+CP=2 vs FSDP=2+EP-as-CP=2 compares like for like.

Only between the two exchanges are tokens "sharded over expert as the experts' inputs": the
MoE is ep.py's moe_ep (one shard_map, its all_to_all exchange) on the local b x S/EP tokens.
Load balancing as cp.py (layout/context.py): S cut into 2*EP chunks, rank i holds chunks i and
2EP-1-i. The capacity rule needs whole sequences: the expert ids and positions (ints) are
all-gathered over expert (moe_ep's gather_sequence).
Because S is split over expert, the global batch only needs to divide by data*fsdp: batch 2 on
fsdp:2,expert:4 gives each device a quarter of one sequence (a fractional per-device batch).

Collectives per layer (d/f/x = the data/fsdp/expert axes; kv = B_loc*S*KV*Dh*4; C as in ep.py, b_loc the
sequences a device holds parts of)
  forward : 1. all-gather over f of the weight matrices and experts (as ep.py)
            2. all-gather over x of K and V (2 x kv; MLA: its latent, as cp.py)  [critical path]
            3. "dispatch_a2a" / "combine_a2a": all-to-all over x of the counts and of
               [EP, C, D] twice                                               [critical path]
            4. router statistics all-reduced over (d, f, x); with capacity_factor > 0 the
               expert ids [b, S, K] and positions [b, S] all-gathered over x
  backward: 5. all-to-all over x x2 (transposes of 3); dK/dV reduce-scattered over x (2 x kv/EP,
               model._gather_kv); weight grads as ep.py
  once per step: kv_pos all-gathered over x; embed / unembed like one layer's matrices.
Pick it for long sequences, or a global batch smaller than the device count (strong scaling);
cost vs ep.py: the K/V all-gathers, and attention work that no longer shrinks with EP.

HLO contract (every collective of the compiled step; size-1 axes drop out; the cost model's
(kind, axes) set equals it, and tests/test_strategies.py holds both to the program, both ways;
tests/test_ep_as_cp.py adds what moves over `expert`: tokens and K/V, no weight):
  all-gather over fsdp: weight matrices and experts (fwd)
  reduce-scatter over fsdp: their gradients
  all-gather over expert: K, V, kv_pos (fwd); expert ids + positions (capacity_factor > 0)
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  reduce-scatter over expert: dK/dV
  all-reduce over expert: norm-scale grads and the CE sum, summed over the sequence axis first
    (XLA's split)
  all-reduce over (data, fsdp): then over the batch axes
  all-reduce over (data, expert): non-expert grad shards after the fsdp reduce-scatter
  all-reduce over data: expert grad shards
  all-reduce over (data, fsdp, expert): router stats, grad norm
HLO contract, kv_exchange=ring (cp.py's ring, on expert; without the capacity rule, as tested
in bf16: with capacity_factor > 0 the expert ids + positions join kv_pos's all-gather):
  collective-permute over expert: the K/V blocks (MLA: latent) around the ring, n - 1 sends per
    layer forward; backward again with the float32 d(K/V) sums, +1 home
  all-gather over expert: kv_pos once (each visit slices its block's positions from it)
  all-gather over fsdp: weight matrices and experts (fwd)
  reduce-scatter over fsdp: their gradients
  all-to-all over expert: counts, dispatch and combine buffers, fwd and bwd
  all-reduce over expert: norm-scale grads and the CE sum, summed over the sequence axis first
    (XLA's split)
  all-reduce over (data, fsdp): then over the batch axes
  all-reduce over (data, expert): non-expert grad shards after the fsdp reduce-scatter
  all-reduce over data: expert grad shards
  all-reduce over (data, fsdp, expert): router stats, grad norm
K/V exchange: --opt=kv_exchange=allgather|ring, the bytes and when each wins as in cp.py.

  python run.py --strategy=ep_as_cp --mesh=fsdp:2,expert:2,data:2 --steps=3
  python run.py --strategy=ep_as_cp --mesh=fsdp:2,expert:4 --batch=2
  python run.py --strategy=ep_as_cp --mesh=data:2,expert:4 --opt=kv_exchange=ring
"""
from jax.sharding import PartitionSpec as P

from layout import context, fsdp, mesh as mesh_lib
from measure import cost as cost_lib
from modeling import model
from strategies import BadInput, Case, ep

NAME = "ep_as_cp"
DATA, FSDP, EXPERT = mesh_lib.DATA, mesh_lib.FSDP, mesh_lib.EXPERT
AXES = (DATA, FSDP, EXPERT)
MAIN_AXIS = EXPERT
BATCH = (DATA, FSDP)
CP = EXPERT
TOKENS = (DATA, FSDP, EXPERT)                 # axes tokens are split over (= grad axes)
COMPARE_MESH = None
# `python run.py` (compare 'all') shows the ring K/V exchange as a second row beside the default
COMPARE_VARIANTS = ("kv_exchange=ring",)
Options = context.Options                     # kv_exchange=allgather|ring, as cp.py's
contract_variant = context.contract_variant
MAXTEXT_3656_MESH = "fsdp:2,expert:2,data:2"   # MaxText #3656's FSDP=2 + EP-as-CP=2 (+ data=2)
# tiny batch 2: 2 sequences on 8 devices, a quarter of a sequence each, with the capacity rule,
# which needs the whole sequence (expert ids and positions all-gathered over expert)
TEST_CASES = [Case("deepseek-test", MAXTEXT_3656_MESH),
              Case("tiny", "fsdp:2,expert:4", dict(batch=2, capacity_factor=1.0))]
COST_CASES = TEST_CASES
# bf16 mixed precision (tests/test_precision.py): the row holding its richest composition
BF16_CASE = Case("deepseek-test", "data:2,expert:4", opts=Options(kv_exchange="ring"))
# the options the planner varies (planning/plan.py: every combination)
PLAN_GRID = {"kv_exchange": ("allgather", "ring")}
BAD_INPUT = [
    BadInput(dict(seq_len=36), "expert:8", Options(), "seq_len=36 is not divisible by 2*expert=16"),
    BadInput(dict(batch=3), "fsdp:2,expert:4", Options(),
             "batch=3 is not divisible by mesh axis dataxfsdp=2"),
    BadInput(dict(n_experts=6, top_k=2), "expert:4,data:2", Options(),
             "n_experts=6 is not divisible by mesh axis expert=4")]


def check(cfg, mesh, opts):
  mesh_lib.require_divisible("n_experts", cfg.n_experts, mesh, EXPERT)
  mesh_lib.require_divisible("batch", cfg.batch, mesh, BATCH)
  context.check(cfg, mesh, CP)
  context.check_options(cfg, opts)
  fsdp.check(cfg, mesh, FSDP)


def param_specs(cfg, mesh, opts=None):
  return ep.param_specs(cfg, mesh)


def batch_spec(cfg, mesh):
  return P(BATCH, CP)                                               # [B, S] @ ((d, f), expert)


def prepare_batch(b, cfg, mesh):
  return context.prepare_batch(b, cfg, mesh, CP)


def layout(cfg, mesh, opts):
  x_spec = P(BATCH, CP, None)                                       # [B, S, D] @ ((d, f), e, None)
  kv, kv_pos = context.kv_specs(BATCH)                              # [B, T, KV, Dh] @ ((d, f),)
  gather_seq = context.sequence_gatherer(CP) if cfg.capacity_factor > 0 else None

  def moe_fn(p, x, positions):                                      # ep.py's exchange, S split
    return ep.moe_ep(ep.moe_weights(p, TOKENS, cfg), x, positions, cfg, ep_axes=(EXPERT,),
                     gather_sequence=gather_seq)
  return model.Parallelism(x=x_spec, kv=kv, kv_pos=kv_pos, kv_ring=opts.kv_exchange == "ring",
                      use=fsdp.use(TOKENS, cfg), moe=moe_fn)


def dispatch_buffer_type(cfg, mesh):
  return ep.buffer_type(cfg, mesh, P(BATCH, CP, None), (EXPERT,))


def activation_shardings(cfg, mesh, opts):
  t = dispatch_buffer_type(cfg, mesh)
  cp = mesh_lib.axis_size(mesh, CP)
  return [("residual x [B, S, D]", f"[{cfg.batch}@(data,fsdp), {cfg.seq_len}@expert, {cfg.d_model}]"),
          ("k/v [B, T, KV, Dh]", f"[{cfg.batch}@(data,fsdp), {cfg.seq_len}, {cfg.n_kv_heads}, "
                                 f"{cfg.head_dim}]"),
          ("dispatch buffer [N_src, EP, C, D]", f"{t.shape} @ {t.sharding.spec}"),
          ("load-balanced positions per expert rank",
           str(context.lb_positions(cfg.seq_len, cp).tolist()))]


def cost(cfg, mesh, opts):
  return (ep.cost(cfg, mesh, ep.Options(), token_axes=TOKENS, batch_axes=BATCH,
                  grads=cost_lib.cp_norm_grads(CP, BATCH))
          + cost_lib.cp_terms(cfg, mesh, CP, BATCH, ring=opts.kv_exchange == "ring"))
