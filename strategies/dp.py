"""dp — data parallelism: batch split over `data`, every parameter replicated.

Mesh axes: (data,)

| tensor                          | sharding                  |
|---------------------------------|---------------------------|
| every parameter, optimizer state| replicated  P()           |
| tokens / positions [B, S]       | (data, None)              |
| residual x [B, S, D]            | (data, None, None)        |
| expert inputs xs [T*K, D]       | local to each data shard  |

Collectives per step (all over data; XLA combines them into a few tuple all-reduces)
  forward : none (attention and the MoE are local to each batch shard) but the router
            statistics: [L, E] counts and prob sums, z, dropped (global aux loss) and loss sums
  backward: all-reduce of every parameter gradient (the router bias has none), at full size

HLO contract (kind over mesh axes; size-1 axes drop out; tests/test_strategies.py enforces it
both ways, and the cost model's (kind, axes) set must equal it):
  all-reduce over data: every parameter gradient, router statistics, loss sums, grad norm

Pick it when the model and its optimizer state fit on one device; it is the baseline every
other strategy is compared with. Cost: 2x parameter bytes of all-reduce traffic per step, and
full parameter + optimizer memory on every device.

  python run.py --strategy=dp --mesh=data:8 --devices=8 --steps=3
"""
import jax
from jax.sharding import PartitionSpec as P

from layout import mesh as mesh_lib
from layout.options import NoOptions
from layout.precision import moe_stored, stored_use
from measure import cost as cost_lib
from modeling import model, moe
from strategies import BadInput, Case

NAME = "dp"
AXES = (mesh_lib.DATA,)
MAIN_AXIS = mesh_lib.DATA
DATA = mesh_lib.DATA
COMPARE_MESH = None
Options = NoOptions
TEST_CASES = [Case("tiny", "data:8"), Case("deepseek-test", "data:8")]
COST_CASES = TEST_CASES
# bf16 mixed precision (tests/test_precision.py): the row holding its richest composition
BF16_CASE = Case("tiny", None)
BAD_INPUT = [BadInput(dict(batch=12), "data:8", Options(),
                      "batch=12 is not divisible by mesh axis data=8")]


def check(cfg, mesh, opts):
  mesh_lib.require_divisible("batch", cfg.batch, mesh, AXES)


def param_specs(cfg, mesh, opts=None):
  return model.param_specs(cfg, {})                                 # every role replicated


def batch_spec(cfg, mesh):
  return P(DATA, None)                                              # [B, S] @ (data, None)


def layout(cfg, mesh, opts):
  def moe_fn(p, x, positions):
    # Local tokens, all experts local: the single-device MoE inside a full-manual shard_map.
    # (bf16: the experts cast and typed reduced over data, so their gradient sums in float32)
    p, p_specs = moe_stored(p, cfg, (DATA,))
    body = lambda p, x, pos: moe.moe_local(p, x, pos, cfg, token_axes=(DATA,))
    return jax.shard_map(
        body, in_specs=(p_specs, P(DATA, None, None), P(DATA, None)),
        out_specs=(P(DATA, None, None), P()))(p, x, positions)       # y [B, S, D] @ (data,), stats P()
  return model.Parallelism(x=P(DATA, None, None), use=stored_use(cfg, (DATA,)), moe=moe_fn)


def activation_shardings(cfg, mesh, opts):
  b = cfg.batch // mesh_lib.axis_size(mesh, DATA)
  return [("residual x [B, S, D]", f"[{cfg.batch}@data, {cfg.seq_len}, {cfg.d_model}]"),
          ("MoE tokens per device", f"{b * cfg.seq_len} x top_{cfg.top_k}, all {cfg.n_experts} experts local")]


def cost(cfg, mesh, opts):
  """Collective bytes per device per step (measure/cost.py): every gradient over data, replicated
  weights used as stored; the router statistics."""
  return (cost_lib.weight_terms(cfg, mesh, param_specs(cfg, mesh), (DATA,))
          + cost_lib.stats_terms(cfg, mesh, (DATA,)))
