"""cp — context parallelism: the sequence split over `context`, weights FSDP-sharded over `fsdp`.

Mesh axes: (data, fsdp, context)

| tensor                                  | sharding                                          |
|-----------------------------------------|---------------------------------------------------|
| every weight matrix                     | D over fsdp, as in fsdp.py (layout/fsdp.py)       |
| norms [D], router bias [E]              | replicated                                        |
| tokens / targets / positions [B, S]     | (B_(data,fsdp), S_context), load-balanced order   |
| residual x [B, S, D], q [B, S, H, Dh]   | (B_(data,fsdp), S_context, ..)                    |
| k / v [B, T, KV, Dh], kv_pos [B, T]     | (B_(data,fsdp), T, ..): all-gathered over context |
| MLA latent c_KV + k_r [B, T, Rkv + rope]| the same: gathered instead of K/V, then up-projected|
| MoE                                     | all experts local, on each device's own tokens    |

Load balancing: the global sequence is cut into 2cp chunks and context rank i holds chunks i and
2cp-1-i (prepare_batch reorders tokens, targets and positions together, layout/context.py; the model masks
with the true positions), so every rank has the same causal work:
  S=8, cp=2: chunks [01][23][45][67] -> rank0 [0 1 6 7], rank1 [2 3 4 5]

Collectives per layer (c = context, f = fsdp, d = data; kv bytes = B_(d,f)*S*KV*Dh*4):
  forward : 1. FSDP all-gather over f of each weight matrix (see fsdp.py)
            2. all-gather over c of K and of V: 2 x kv bytes                       [critical path]
            3. all-reduce over (d, f, c) of the router statistics
            (all-gather over c of kv_pos [B, T] int32, once per step; with capacity_factor > 0
             also of the sequence's expert ids [b, S, K] per layer and positions once: ints)
  backward: 4. reduce-scatter over c of dK and dV (2 x kv/c bytes): every context rank's queries
               read all of K/V, so each holds a partial dK/dV; model._gather_kv reduce-scatters it
               explicitly (XLA:CPU would write the transpose of the gather as all-reduce + slice)
  MLA: 2 and 4 move the normed latent c_KV and the rotated RoPE key instead (Rkv + rope values
  per token, 576 at DeepSeek-V3's shape, where the up-projected K and V would be H x (nope + v)
  + rope = 32,832: 57x fewer bytes); each rank up-projects the whole gathered latent (an extra
  B*T*Rkv*H*(nope + v) multiply-adds per layer), its K/V typed reduced over c so that dK/dV stay
  partial sums until the latent's one reduce-scatter (sharding.partial_einsum)
            5. FSDP gradient (gather_weight): reduce-scatter over f of each weight gradient,
               then all-reduce over (d, c) of the 1/f shard
            6. norm-scale gradients: all-reduce over c, then over (d, f)

HLO contract (kind over mesh axes; size-1 axes drop out; tests/test_strategies.py enforces both
ways, and the cost model's (kind, axes) set must equal it; tests/test_cp.py adds the balanced
placement, the exact K/V all-gather bytes and the ring's skipped blocks):
  all-gather over context: K, V, kv_pos (and the capacity rule's ints)
  all-gather over fsdp: weight matrices before use
  reduce-scatter over fsdp: weight-matrix gradients
  reduce-scatter over context: dK, dV (MLA: d(latent))
  all-reduce over context: norm-scale grad partials, the CE sum (over the sequence first)
  all-reduce over (data, context): the 1/f weight-gradient shards after the scatter
  all-reduce over (data, fsdp): norm-scale grads, the CE sum
  all-reduce over (data, fsdp, context): router statistics, grad norm

HLO contract, kv_exchange=ring (K/V, MLA: the latent, travel instead of being gathered):
  collective-permute over context: the K/V blocks (MLA: latent), n - 1 sends per layer forward;
    backward again, with the float32 d(K/V) sums, and one more send home
  all-gather over context: kv_pos once (each visit slices its block's positions from it); expert
    ids + positions (capacity_factor > 0; every ring case sets it)
  all-gather over fsdp: weight matrices before use
  reduce-scatter over fsdp: weight-matrix gradients
  all-reduce over context: norm-scale grad partials, the CE sum (over the sequence first)
  all-reduce over (data, context): the 1/f weight-gradient shards after the scatter
  all-reduce over (data, fsdp): norm-scale grads, the CE sum
  all-reduce over (data, fsdp, context): router statistics, grad norm

K/V exchange (--opt=kv_exchange=allgather|ring; modeling/ring_attention.py draws the ring).
n = |context|, kv = one device's K/V block (MLA: latent) of a layer, in the compute dtype:
  allgather (default, MaxText's): forward one all-gather, n - 1 blocks in on each device's
    wire; backward the reduce-scatter of d(K/V), n - 1 blocks out. Each device holds the whole
    sequence's K/V (n blocks) and scores its queries against it in one chunked-attention pass.
  ring: forward n - 1 collective-permutes of a block; backward n - 1 again plus n of its
    float32 d(kv) sum: (3n - 2)/(2n - 2) the all-gather's wire bytes in float32, (4n - 2)/(2n - 2)
    in bf16 (1.67x and 2.33x at n = 4). Each device holds 2 blocks (its own and the visitor):
    K/V memory O(S/n), and on hardware each send hides behind the previous block's attention.
  Pick ring when the gathered K/V of a layer does not fit (long S, GQA with many KV heads) or
  when attention compute per block exceeds a send; the all-gather otherwise: fewer, larger
  messages and fewer bytes. With MLA the gathered latent is small (576 values per token at
  DeepSeek-V3's shape), so the all-gather stays the better choice far into long contexts.

The MoE needs no exchange: routing is per token, so local tokens are routed, permuted and run
through all (gathered) experts where they are.
Pick it for long sequences whose activations (or attention) do not fit at the batch a device can
hold, or when the global batch is smaller than the device count; cost: K/V all-gathers that grow
with S*KV*Dh per layer (cheap with GQA), on top of FSDP's weight traffic.

  python run.py --strategy=cp --mesh=fsdp:2,context:2,data:2 --devices=8 --steps=3 --hlo_stats
"""
from jax.sharding import PartitionSpec as P

from layout import context, fsdp, mesh as mesh_lib
from measure import cost as cost_lib
from modeling import model
from strategies import BadInput, Case

NAME = "cp"
AXES = (mesh_lib.DATA, mesh_lib.FSDP, mesh_lib.CONTEXT)
MAIN_AXIS = mesh_lib.CONTEXT
CP = mesh_lib.CONTEXT
BATCH = (mesh_lib.DATA, mesh_lib.FSDP)           # the axes splitting B
TOKENS = (mesh_lib.DATA, mesh_lib.FSDP, CP)      # every axis tokens are split over (= grad axes)
COMPARE_MESH = None
# `python run.py` (compare 'all') shows the ring K/V exchange as a second row beside the default
COMPARE_VARIANTS = ("kv_exchange=ring",)

Options = context.Options            # kv_exchange=allgather|ring: the K/V exchange (layout/context.py)
contract_variant = context.contract_variant
TEST_CASES = [Case("tiny", "context:4,data:2"), Case("tiny", "fsdp:2,context:2,data:2"),
              # kv_exchange=ring, GQA and MLA (its latent around the ring), with the capacity
              # rule's drops: CP must gather the sequence's expert ids. MLA's all-gathered latent:
              # ep_as_cp's table and cp's bf16 case (tests/test_precision.py)
              Case("tiny", "context:4,data:2", dict(capacity_factor=1.0),
                   Options(kv_exchange="ring")),
              Case("deepseek-test", "context:8", dict(capacity_factor=1.0),
                   Options(kv_exchange="ring"))]
COST_CASES = TEST_CASES
# bf16 mixed precision (tests/test_precision.py): the row holding its richest composition
BF16_CASE = Case("deepseek-test", "data:2,context:4")
# the options the planner varies (planning/plan.py: every combination)
PLAN_GRID = {"kv_exchange": ("allgather", "ring")}
INVARIANT_MESHES = ("tiny", ("context:4,data:2", "fsdp:2,context:2,data:2"))
BAD_INPUT = [BadInput(dict(seq_len=36), "context:4,data:2", Options(),
                      "seq_len=36 is not divisible by 2*context=8"),
             BadInput(dict(batch=3), "context:4,data:2", Options(),
                      "batch=3 is not divisible by mesh axis dataxfsdp=2")]


def check(cfg, mesh, opts):
  mesh_lib.require_divisible("batch", cfg.batch, mesh, BATCH)
  context.check(cfg, mesh, CP)
  context.check_options(cfg, opts)
  fsdp.check(cfg, mesh, mesh_lib.FSDP)


def param_specs(cfg, mesh, opts=None):
  return model.param_specs(cfg, fsdp.table(mesh_lib.FSDP))        # fsdp.py's table


def batch_spec(cfg, mesh):
  return P(BATCH, CP)                                               # [B, S] @ ((data, fsdp), context)


def prepare_batch(b, cfg, mesh):
  return context.prepare_batch(b, cfg, mesh, CP)


def layout(cfg, mesh, opts):
  x_spec = P(BATCH, CP, None)                                       # [B, S, D] @ (.., context, None)
  kv, kv_pos = context.kv_specs(BATCH)                              # [B, T, KV, Dh] @ (.., None, ..)
  return model.Parallelism(x=x_spec, kv=kv, kv_pos=kv_pos, kv_ring=opts.kv_exchange == "ring",
                      use=fsdp.use(TOKENS, cfg), moe=fsdp.moe_all_local(cfg, x_spec, TOKENS, cp_axis=CP))


def activation_shardings(cfg, mesh, opts):
  return [("residual x [B, S, D]", f"[{cfg.batch}@(data,fsdp), {cfg.seq_len}@context, {cfg.d_model}]"),
          ("k/v [B, T, KV, Dh]", f"[{cfg.batch}@(data,fsdp), {cfg.seq_len}, {cfg.n_kv_heads}, {cfg.head_dim}]"),
          ("load-balanced positions per context rank",
           str(context.lb_positions(cfg.seq_len, mesh_lib.axis_size(mesh, CP)).tolist()))]


def cost(cfg, mesh, opts):
  """Collective bytes per device per step (measure/cost.py): fsdp's weight traffic over the grad
  axes, the norm-scale grads summed over context first; K/V gathers; router statistics."""
  return (cost_lib.weight_terms(cfg, mesh, param_specs(cfg, mesh), TOKENS,
                                gathered=cost_lib.fsdp_gathered(TOKENS),
                                grads=cost_lib.cp_norm_grads(CP, BATCH))
          + cost_lib.cp_terms(cfg, mesh, CP, BATCH, ring=opts.kv_exchange == "ring") + cost_lib.stats_terms(cfg, mesh, TOKENS, (CP,)))
