"""cp: parity with the single-device reference (two meshes, both models, the capacity rule on
the sequence-sharded tokens), the load-balanced layout, the HLO collective contract of
strategies/cp.py (K/V gather bytes), its cost model, layout invariance and one-line errors."""

import numpy as np
import pytest

import strategies
from measure import hlo
from common import layouts
from layout import mesh as mesh_lib
from modeling.config import ConfigError, get_config
from tests import parity

NAME = "cp"
TINY = get_config("tiny")
# deepseek with the capacity rule: the path where CP must gather the sequence's expert ids
DEEPSEEK_CAP = get_config("deepseek-test", capacity_factor=1.0)
MESHES = ("context:4,data:2", "fsdp:2,context:2,data:2")


def test_parity_tiny_context4():
  parity.check(NAME, TINY, MESHES[0])


def test_parity_tiny_fsdp_context():
  parity.check(NAME, TINY, MESHES[1])


def test_parity_deepseek_capacity():
  got = parity.check(NAME, DEEPSEEK_CAP, MESHES[1])
  assert all(g["dropped"] > 0 for g in got)          # the capacity rule really dropped tokens


def test_layout_invariance():
  parity.assert_layout_invariance(NAME, TINY, MESHES)


def test_load_balanced_placement():
  # S=8, cp=2: chunks [01][23][45][67] -> rank0 holds positions [0 1 6 7], rank1 [2 3 4 5]
  np.testing.assert_array_equal(layouts.lb_positions(8, 2), [[0, 1, 6, 7], [2, 3, 4, 5]])
  job = parity.job(NAME, TINY, MESHES[0])
  cp = job.mesh.shape["context"]
  want = layouts.lb_positions(TINY.seq_len, cp)
  pos = job.batch(0)["positions"]
  for shard in pos.addressable_shards:
    rank = shard.index[1].start // (TINY.seq_len // cp)
    np.testing.assert_array_equal(np.asarray(shard.data), np.broadcast_to(want[rank], shard.data.shape))
  # every rank holds the same causal work: sum of (position + 1) keys attended
  work = (want + 1).sum(axis=1)
  assert (work == work[0]).all()


@pytest.mark.parametrize("mesh", MESHES)
def test_hlo_contract(mesh):
  job = parity.assert_contract(NAME, TINY, mesh)
  by = hlo.collective_stats_by_axes(job.compiled.as_text(), job.mesh)
  b_local = TINY.batch // (job.mesh.shape["data"] * job.mesh.shape["fsdp"])
  kv = b_local * TINY.seq_len * TINY.n_kv_heads * TINY.head_dim * 4       # one of K, V per layer
  kv_pos = b_local * TINY.seq_len * 4
  assert by[("all-gather", frozenset({"context"}))]["bytes"] == 2 * TINY.n_layers * kv + kv_pos
  assert hlo.collective_stats(job.compiled.as_text())["all-to-all"]["count"] == 0


@pytest.mark.parametrize("mesh", MESHES)
def test_cost_model(mesh):
  parity.assert_cost_model(NAME, TINY, mesh)


@pytest.mark.parametrize("over, msg", [
    (dict(seq_len=36), "seq_len=36 is not divisible by 2*context=8"),
    (dict(batch=3), "batch=3 is not divisible by mesh axis dataxfsdp=2"),
    (dict(context_sharding="expert"),
     "context_sharding='expert' must be 'context' for cp (ep_as_cp plays CP on the expert axis)"),
])
def test_bad_input(over, msg):
  strat = strategies.get(NAME)
  m = mesh_lib.make_mesh(mesh_lib.mesh_shape(strat.AXES, strat.MAIN_AXIS, MESHES[0], 8, NAME))
  with pytest.raises(ConfigError) as e:
    strat.check(get_config("tiny", **over), m)
  assert str(e.value) == msg
