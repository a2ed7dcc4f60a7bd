"""tp: parity with the single-device reference (two meshes, both models), the HLO collective
contract of strategies/tp.py, its cost model, layout invariance and one-line config errors."""
import pytest

import strategies
from measure import hlo
from layout import mesh as mesh_lib
from modeling.config import ConfigError, get_config
from tests import parity

NAME = "tp"
# tiny has 4 heads / 2 kv heads; 8 / 4 lets the same model run on tensor:2 and tensor:4
TINY8 = get_config("tiny", n_heads=8, n_kv_heads=4)
DEEPSEEK = get_config("deepseek-test")
MESHES = ("tensor:2,data:4", "data:2,tensor:4")


def test_parity_tiny_tensor2():
  parity.check(NAME, TINY8, MESHES[0])


def test_parity_tiny_tensor4():
  parity.check(NAME, TINY8, MESHES[1])


def test_parity_deepseek():
  parity.check(NAME, DEEPSEEK, MESHES[0])


def test_layout_invariance():
  parity.assert_layout_invariance(NAME, TINY8, MESHES)


@pytest.mark.parametrize("mesh", MESHES)
def test_hlo_contract(mesh):
  job = parity.assert_contract(NAME, TINY8, mesh)
  stats = hlo.collective_stats(job.compiled.as_text())
  assert stats["all-gather"]["count"] == 0 and stats["all-to-all"]["count"] == 0
  # per layer exactly four all-reduces of one [B_d, S, D] (XLA may pack a few scalars in): forward
  # one per attention and one per MoE (after the unpermute, not [T*K, D]); backward one per
  # block input (q/k/v, MoE and combine-weight partials summed once through gather_in)
  by = hlo.collective_stats_by_axes(job.compiled.as_text(), job.mesh)
  x_bytes = TINY8.batch // job.mesh.shape["data"] * TINY8.seq_len * TINY8.d_model * 4
  x_sized = [op for op in hlo.collective_ops(job.compiled.as_text())
             if op.kind == "all-reduce" and hlo.op_axes(op, job.mesh) == {"tensor"}
             and x_bytes <= op.bytes < x_bytes + 1024]
  assert sum(op.count for op in x_sized) == 4 * TINY8.n_layers, x_sized
  assert by[("all-reduce", frozenset({"tensor"}))]["bytes"] < 4.5 * TINY8.n_layers * x_bytes


@pytest.mark.parametrize("mesh", MESHES)
def test_cost_model(mesh):
  parity.assert_cost_model(NAME, TINY8, mesh)


@pytest.mark.parametrize("over, msg", [
    (dict(n_heads=6, n_kv_heads=2), "n_heads=6 is not divisible by mesh axis tensor=4"),
    (dict(n_heads=8, n_kv_heads=2), "n_kv_heads=2 is not divisible by mesh axis tensor=4"),
    (dict(n_heads=8, n_kv_heads=4, d_ff=66), "d_ff=66 is not divisible by mesh axis tensor=4"),
    (dict(n_heads=8, n_kv_heads=4, batch=3), "batch=3 is not divisible by mesh axis data=2"),
])
def test_bad_input(over, msg):
  strat = strategies.get(NAME)
  m = mesh_lib.make_mesh(mesh_lib.mesh_shape(strat.AXES, strat.MAIN_AXIS, MESHES[1], 8, NAME))
  with pytest.raises(ConfigError) as e:
    strat.check(get_config("tiny", **over), m)
  assert str(e.value) == msg
