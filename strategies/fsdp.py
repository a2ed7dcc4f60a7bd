"""fsdp — fully sharded data parallelism: batch over (data, fsdp), every weight sharded over fsdp.

Mesh axes: (data, fsdp)   (data = plain replicas, e.g. across slices; fsdp = the sharding group)

| tensor                                  | sharding                                         |
|-----------------------------------------|--------------------------------------------------|
| embed [V, D], unembed [D, V]            | D over fsdp: [V, D_f], [D_f, V]                  |
| attn wq/wk/wv [D, H/KV, Dh], wo [H,Dh,D]| D over fsdp                                      |
| router [D, E]                           | D over fsdp                                      |
| norms [D], router bias [E]              | replicated (see layout/fsdp.py)                  |
| experts wi_0/wi_1 [E, D, F], wo [E,F,D] | D over fsdp: [E, D_f, F], [E, F, D_f]            |
| shared wi_0/wi_1 [D, Fs], wo [Fs, D]    | D over fsdp                                      |
| optimizer state                         | like its parameter                               |
| tokens / positions [B, S]               | (B_(data,fsdp), S)                               |
| residual x [B, S, D]                    | (B_(data,fsdp), S, D)                            |
| MoE                                     | all experts local, on each device's own tokens   |

The MoE is layout/fsdp.py's moe_all_local: a full-manual shard_map running the single-device MoE
on each device's own tokens, fed the all-gathered expert weights. Every weight matrix is
all-gathered right before use with parallel.sharding.gather_weight. Its backward
is a real reduce-scatter, written as an explicit psum_scatter in a shard_map (XLA:CPU would
otherwise emit a full all-reduce plus a slice), followed by an all-reduce over `data` of the
1/f shard (gather_weight scatters first, so the data all-reduce moves 1/f of the weight).

Collectives per layer (fsdp = f, data = d):
  forward : 1. all-gather over f of each weight matrix: wq, wk, wv, wo, router, wi_0, wi_1, wo
               (+ shared wi_0, wi_1, wo)                                     [critical path]
            2. all-reduce over (d, f) of the router statistics ([E] counts / prob sums, scalars)
  backward: 3. no re-gather (XLA reuses the forward copy)
            4. reduce-scatter over f of each weight gradient {U_(d,f)} to [.., D_f, ..], then
            5. all-reduce over d of that 1/f shard (gather_weight scatters first)
            6. all-reduce over (d, f) of the norm-scale gradients
  once per step: embed / unembed like a layer's weights; loss sums; the grad norm (one scalar
            all-reduced over every axis, runtime.train.global_norm).
No all-to-all: tokens never leave their device.

HLO contract (kind over mesh axes; size-1 axes drop out; tests/test_strategies.py enforces both
ways, and the cost model's (kind, axes) set must equal it; tests/test_fsdp.py adds the bytes: each
weight matrix gathered once per step, its gradient reduce-scattered to 1/f):
  all-gather over fsdp: weight matrices before use
  reduce-scatter over fsdp: weight-matrix gradients
  all-reduce over data: the 1/f weight-gradient shards after the scatter
  all-reduce over (data, fsdp): norm-scale grads, router statistics, loss sums, grad norm

Pick it when parameters + optimizer state do not fit on one device but a full layer's weights do;
cost per step and device: 1x the weight bytes all-gathered + 1/f x reduce-scattered (+ 1/f x
all-reduced over data when d > 1), vs 1x all-reduced in dp; memory 1/f of weights and optimizer
state, plus the gathered copy of each weight held live through the backward.

  python run.py --strategy=fsdp --mesh=data:2,fsdp:4 --devices=8 --steps=3 --hlo_stats
"""
from jax.sharding import PartitionSpec as P

from layout import fsdp, mesh as mesh_lib
from layout.options import NoOptions
from measure import cost as cost_lib
from modeling import model
from strategies import BadInput, Case

NAME = "fsdp"
AXES = (mesh_lib.DATA, mesh_lib.FSDP)
MAIN_AXIS = mesh_lib.FSDP
TOKENS = (mesh_lib.DATA, mesh_lib.FSDP)         # the axes tokens are split over (= grad axes)
COMPARE_MESH = None
Options = NoOptions
TEST_CASES = [Case("tiny", "fsdp:8"), Case("tiny", "data:2,fsdp:4"),
              # gradient accumulation, the sequence-wise loss (no pass 1)
              Case("deepseek-test", "data:2,fsdp:4", dict(batch=16, microbatches=2))]
COST_CASES = TEST_CASES                          # accumulation: measure/cost.step_terms
# bf16 mixed precision (tests/test_precision.py): the row holding its richest composition
BF16_CASE = Case("tiny", "data:2,fsdp:4")        # gradient sums over two axes
INVARIANT_MESHES = ("tiny", ("fsdp:8", "data:2,fsdp:4"))   # one model, two meshes: same losses
BAD_INPUT = [BadInput(dict(batch=6), "fsdp:8", Options(),
                      "batch=6 is not divisible by mesh axis dataxfsdp=8"),
             BadInput(dict(d_model=36), "fsdp:8", Options(),
                      "d_model=36 is not divisible by mesh axis fsdp=8")]


def check(cfg, mesh, opts):
  mesh_lib.require_divisible("batch", cfg.batch, mesh, TOKENS)
  fsdp.check(cfg, mesh, mesh_lib.FSDP)


def param_specs(cfg, mesh, opts=None):
  # role -> spec: every matrix on its D dim over fsdp (embed [V, D@f], attn wq [D@f, H, Dh], attn
  # wo [H, Dh, D@f], experts [E, D@f, F] / [E, F, D@f], ...); norms and router bias replicated
  return model.param_specs(cfg, fsdp.table(mesh_lib.FSDP))


def batch_spec(cfg, mesh):
  return P(TOKENS, None)                                            # [B, S] @ ((data, fsdp), None)


def layout(cfg, mesh, opts):
  x_spec = P(TOKENS, None, None)                                    # [B, S, D] @ ((data, fsdp),)
  return model.Parallelism(x=x_spec, use=fsdp.use(TOKENS, cfg),
                      moe=fsdp.moe_all_local(cfg, x_spec, TOKENS))


def activation_shardings(cfg, mesh, opts):
  b = cfg.batch // mesh_lib.axis_size(mesh, *TOKENS)
  return [("residual x [B, S, D]", f"[{cfg.batch}@(data,fsdp), {cfg.seq_len}, {cfg.d_model}]"),
          ("gathered weight (use)", "replicated, reduced over (data, fsdp)"),
          ("MoE tokens per device", f"{b * cfg.seq_len} x top_{cfg.top_k}")]


def cost(cfg, mesh, opts):
  """Collective bytes per device per step (measure/cost.py): every D-sharded weight gathered whole
  before use (fsdp.use), norms used as stored; the router statistics."""
  return (cost_lib.weight_terms(cfg, mesh, param_specs(cfg, mesh), TOKENS,
                                gathered=cost_lib.fsdp_gathered(TOKENS))
          + cost_lib.stats_terms(cfg, mesh, TOKENS))
