"""ep_x_tp beyond the shared table (tests/test_strategies.py): tp's activation all-reduces over
tensor (one per MoE, after the combine, not one per routed copy) beside ep's all-to-alls over
expert, whose buffers are the [EP, C, D] of the tokens each tensor rank routes; zero1's storage
and its once-per-step gathers."""
import jax
from jax.sharding import PartitionSpec as P

from layout import dispatch
from measure import cost, hlo
from modeling import model
from modeling.config import get_config
from parallel.sharding import spec_shards
import strategies
from tests import parity

NAME = "ep_x_tp"
TINY8 = get_config("tiny", n_heads=8, n_kv_heads=4)       # the table's first row: shared compile
MESH = "data:2,expert:2,tensor:2"


def test_tensor_all_reduces_and_expert_all_to_alls():
  job = parity.job(NAME, TINY8, MESH)
  sizes = job.mesh.shape
  b = TINY8.batch // (sizes["data"] * sizes["expert"])
  x_bytes = b * TINY8.seq_len * TINY8.d_model * 4                   # one [b, S, D] activation
  ops = hlo.collective_ops(job.hlo)
  assert not [op for op in ops if op.kind in ("all-gather", "reduce-scatter")], ops
  # per layer four all-reduces of one [b, S, D] over tensor: forward after attention and once
  # after the MoE's combine; backward once per block input
  x_sized = [op for op in ops if op.kind == "all-reduce" and hlo.op_axes(op, job.mesh) == {"tensor"}
             and x_bytes <= op.bytes < x_bytes + 1024]
  assert sum(op.count for op in x_sized) == 4 * TINY8.n_layers, x_sized
  # the exchange: ep's padded [EP, C, D] buffers over expert only, C for this rank's b x S tokens
  ep = sizes["expert"]
  buf = ep * dispatch.send_rows(TINY8, b, TINY8.seq_len, ep) * TINY8.d_model * 4
  a2a = [op for op in ops if op.kind == "all-to-all"]
  assert {frozenset(hlo.op_axes(op, job.mesh)) for op in a2a} == {frozenset({"expert"})}
  assert sum(op.count for op in a2a if op.bytes == buf) == 4 * TINY8.n_layers, a2a


def test_sequence_parallel_exchanges_each_ranks_own_tokens():
  """sequence_parallel: each tensor rank routes its own S/t positions, so dropless the all-to-all
  buffers are [EP, C, D] for b x S/t tokens (C half of the replicated layout's at t = 2); the
  received rows are all-gathered over tensor and the experts' outputs reduce-scattered back;
  no activation is all-reduced over tensor (only the norm scales' [D] gradients are)."""
  ep_x_tp = strategies.get(NAME)
  case = next(c for c in ep_x_tp.TEST_CASES if c.opts == ep_x_tp.SP and not c.config().capacity_factor)
  cfg = case.config()
  job = parity.job(NAME, cfg, case.mesh, case.opts)
  sizes = job.mesh.shape
  b, t, n_ep = cfg.batch // (sizes["data"] * sizes["expert"]), sizes["tensor"], sizes["expert"]
  c = dispatch.send_rows(cfg, b, cfg.seq_len // t, n_ep)
  assert c * t == dispatch.send_rows(cfg, b, cfg.seq_len, n_ep)      # dropless: T/t tokens
  buf = n_ep * c * cfg.d_model * 4
  ops = hlo.collective_ops(job.hlo)
  a2a = [op for op in ops if op.kind == "all-to-all"]
  # dispatch and combine, forward and backward; remat block runs the forward two again
  per_layer = 6 if cfg.remat == "block" else 4
  assert sum(op.count for op in a2a if op.bytes == buf) == per_layer * cfg.n_moe_layers, a2a
  on_tensor = lambda kind: [op for op in ops if op.kind == kind
                            and hlo.op_axes(op, job.mesh) == {"tensor"}]
  assert any(op.bytes == t * buf for op in on_tensor("all-gather")), on_tensor("all-gather")
  assert any(op.bytes == buf for op in on_tensor("reduce-scatter")), on_tensor("reduce-scatter")
  assert all(op.bytes <= 4 * cfg.d_model * 8 for op in on_tensor("all-reduce")), on_tensor("all-reduce")


def test_zero1_stores_the_matrices_over_data_and_gathers_them_once_per_step():
  """zero1 (Megatron's distributed optimizer) on the table's tiny mesh: the step's arguments
  (float32 params and AdamW state) are smaller by exactly what measure.cost.param_memory says,
  every matrix but the router now split over data; each such leaf is all-gathered over data
  once per step (the [L] stacks whole, not per layer) and its gradient reduce-scattered once;
  no weight gradient is all-reduced over data at its full size any more."""
  ep_x_tp = strategies.get(NAME)
  zero1 = ep_x_tp.Options(zero1=True)
  case = next(c for c in ep_x_tp.TEST_CASES if c.opts == zero1)
  cfg = case.config()
  assert (cfg, case.mesh) == (TINY8, MESH)                         # beside the first row's compile
  jobs = {z: parity.job(NAME, cfg, MESH, ep_x_tp.Options(zero1=z)) for z in (False, True)}
  mesh = jobs[True].mesh
  shapes = model.init_params_shapes(cfg)
  mem = {z: cost.param_memory(shapes, ep_x_tp.param_specs(cfg, mesh, ep_x_tp.Options(zero1=z)),
                              mesh, cfg.optimizer) for z in (False, True)}
  stored = {z: m["param_bytes"] + m["opt_bytes"] for z, m in mem.items()}
  args = {z: j.compiled.memory_analysis().argument_size_in_bytes for z, j in jobs.items()}
  assert stored[True] < 0.6 * stored[False], stored                  # data:2 halves the matrices
  assert args[False] - args[True] == stored[False] - stored[True], (args, stored)
  leaves = [l for l in model.param_leaves(cfg) if l.role in ep_x_tp.ZERO1_ROLES]
  ops = hlo.collective_ops(jobs[True].hlo)
  on_data = lambda kind: [op for op in ops if op.kind == kind and hlo.op_axes(op, mesh) == {"data"}]
  assert sum(op.count for op in on_data("all-gather")) == len(leaves), on_data("all-gather")
  assert sum(op.count for op in on_data("reduce-scatter")) == len(leaves), on_data("reduce-scatter")
  # the all-reduces over axes with data lose exactly those matrices' float32 gradients
  specs = jax.tree.leaves(ep_x_tp.param_specs(cfg, mesh), is_leaf=lambda x: isinstance(x, P))
  grads = sum(cost.nbytes(l.shape) / spec_shards(spec, mesh)
              for l, spec in zip(model.param_leaves(cfg), specs) if l.role in ep_x_tp.ZERO1_ROLES)
  over_data = {z: sum(op.bytes * op.count for op in hlo.collective_ops(j.hlo)
                      if op.kind == "all-reduce" and "data" in hlo.op_axes(op, mesh))
               for z, j in jobs.items()}
  assert over_data[False] - over_data[True] == grads, (over_data, grads)
