"""tp beyond the shared table (tests/test_strategies.py): per layer exactly four all-reduces of
one [B_d, S, D] activation over tensor, none of [T*K, D]."""
import pytest

from measure import hlo
from modeling.config import get_config
from tests import parity

NAME = "tp"
# tiny has 4 heads / 2 kv heads; 8 / 4 lets the same model run on tensor:2 and tensor:4
TINY8 = get_config("tiny", n_heads=8, n_kv_heads=4)
DEEPSEEK = get_config("deepseek-test")
MESHES = ("tensor:2,data:4", "data:2,tensor:4")


@pytest.mark.parametrize("mesh", MESHES)
def test_four_activation_all_reduces_per_layer(mesh):
  job = parity.job(NAME, TINY8, mesh)
  stats = hlo.collective_stats(job.hlo)
  assert stats["all-gather"]["count"] == 0 and stats["all-to-all"]["count"] == 0
  # per layer exactly four all-reduces of one [B_d, S, D] (XLA may pack a few scalars in): forward
  # one per attention and one per MoE (after the unpermute, not [T*K, D]); backward one per
  # block input (q/k/v, MoE and combine-weight partials summed once through gather_in)
  by = hlo.collective_stats_by_axes(job.hlo, job.mesh)
  x_bytes = TINY8.batch // job.mesh.shape["data"] * TINY8.seq_len * TINY8.d_model * 4
  x_sized = [op for op in hlo.collective_ops(job.hlo)
             if op.kind == "all-reduce" and hlo.op_axes(op, job.mesh) == {"tensor"}
             and x_bytes <= op.bytes < x_bytes + 1024]
  assert sum(op.count for op in x_sized) == 4 * TINY8.n_layers, x_sized
  assert by[("all-reduce", frozenset({"tensor"}))]["bytes"] < 4.5 * TINY8.n_layers * x_bytes
