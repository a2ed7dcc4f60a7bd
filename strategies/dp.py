"""dp — data parallelism: batch split over `data`, every parameter replicated.

Mesh axes: (data,)

| tensor                          | sharding                  |
|---------------------------------|---------------------------|
| every parameter, optimizer state| replicated  P()           |
| tokens / positions [B, S]       | (data, None)              |
| residual x [B, S, D]            | (data, None, None)        |
| expert inputs xs [T*K, D]       | local to each data shard  |

Collectives per layer
  forward : none (attention and the MoE are local to each batch shard); one scalar all-reduce
            per router statistic (psum of counts / prob sums for the global aux loss)
  backward: all-reduce of every parameter gradient over `data` (XLA combines them into a few
            tuple all-reduces); loss / grad-norm scalars.
Pick it when the model and its optimizer state fit on one device; it is the baseline every
other strategy is compared with. Cost: 2x parameter bytes of all-reduce traffic per step, and
full parameter + optimizer memory on every device.

  python run.py --strategy=dp --mesh=data:8 --devices=8 --steps=3
"""
import jax
from jax.sharding import PartitionSpec as P

from common import mesh as mesh_lib
from common import cost as cost_lib
from common import model, moe

NAME = "dp"
AXES = (mesh_lib.DATA,)
MAIN_AXIS = mesh_lib.DATA


def check(cfg, mesh):
  mesh_lib.require_divisible("batch", cfg.batch, mesh, AXES)


def param_specs(cfg, mesh):
  return model.param_specs(cfg, {})                                 # every role replicated


def batch_spec(cfg, mesh):
  return P("data", None)                                            # [B, S] @ (data, None)


def layout(cfg, mesh):
  def moe_fn(p, x, positions):
    # Local tokens, all experts local: the single-device MoE inside a full-manual shard_map.
    body = lambda p, x, pos: moe.moe_local(p, x, pos, cfg, token_axes=("data",))
    return jax.shard_map(
        body, in_specs=(jax.tree.map(lambda _: P(), p), P("data", None, None), P("data", None)),
        out_specs=(P("data", None, None), P()))(p, x, positions)     # y [B, S, D] @ (data,), stats P()
  return model.Layout(x=P("data", None, None), moe=moe_fn)


def activation_shardings(cfg, mesh):
  b = cfg.batch // mesh.shape["data"]
  return [("residual x [B, S, D]", f"[{cfg.batch}@data, {cfg.seq_len}, {cfg.d_model}]"),
          ("MoE tokens per device", f"{b * cfg.seq_len} x top_{cfg.top_k}, all {cfg.n_experts} experts local")]


def cost(cfg, mesh):
  """Analytic collective bytes per device per step (common/cost.py)."""
  n = mesh.shape["data"]
  grads = cost_lib.leaves_bytes(model.init_params_shapes(cfg))
  return [cost_lib.router_stats(cfg, n),
          cost_lib.Term("all-reduce", "bwd", "gradient all-reduce over data", grads, n)]
