"""cp beyond the shared table (tests/test_strategies.py): the load-balanced placement and the
exact K/V all-gather bytes."""

import numpy as np
import pytest

from layout import context
from measure import hlo
from modeling.config import get_config
from tests import parity

NAME = "cp"
TINY = get_config("tiny")
# deepseek with the capacity rule: the path where CP must gather the sequence's expert ids
DEEPSEEK_CAP = get_config("deepseek-test", capacity_factor=1.0)
MESHES = ("context:4,data:2", "fsdp:2,context:2,data:2")


def test_load_balanced_placement():
  # S=8, cp=2: chunks [01][23][45][67] -> rank0 holds positions [0 1 6 7], rank1 [2 3 4 5]
  np.testing.assert_array_equal(context.lb_positions(8, 2), [[0, 1, 6, 7], [2, 3, 4, 5]])
  job = parity.job(NAME, TINY, MESHES[0])
  cp = job.mesh.shape["context"]
  want = context.lb_positions(TINY.seq_len, cp)
  pos = job.batch(0)["positions"]
  for shard in pos.addressable_shards:
    rank = shard.index[1].start // (TINY.seq_len // cp)
    np.testing.assert_array_equal(np.asarray(shard.data), np.broadcast_to(want[rank], shard.data.shape))
  # every rank holds the same causal work: sum of (position + 1) keys attended
  work = (want + 1).sum(axis=1)
  assert (work == work[0]).all()


@pytest.mark.parametrize("mesh", MESHES)
def test_kv_gather_bytes(mesh):
  job = parity.job(NAME, TINY, mesh)
  by = hlo.collective_stats_by_axes(job.hlo, job.mesh)
  b_local = TINY.batch // (job.mesh.shape["data"] * job.mesh.shape["fsdp"])
  kv = b_local * TINY.seq_len * TINY.n_kv_heads * TINY.head_dim * 4       # one of K, V per layer
  kv_pos = b_local * TINY.seq_len * 4
  assert by[("all-gather", frozenset({"context"}))]["bytes"] == 2 * TINY.n_layers * kv + kv_pos
  assert hlo.collective_stats(job.hlo)["all-to-all"]["count"] == 0
