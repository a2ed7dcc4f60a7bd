"""ep_x_tp beyond the shared table (tests/test_strategies.py): tp's activation all-reduces over
tensor (one per MoE, after the combine, not one per routed copy) beside ep's all-to-alls over
expert, whose buffers are the [EP, C, D] of the tokens each tensor rank routes."""
from layout import dispatch
from measure import hlo
from modeling.config import get_config
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
