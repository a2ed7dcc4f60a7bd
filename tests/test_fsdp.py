"""fsdp: parity with the single-device reference (two meshes, both models), the HLO collective
contract of strategies/fsdp.py, its cost model, layout invariance and one-line config errors."""
import numpy as np
import pytest

from tests import parity
import strategies
from measure import hlo
from modeling import model
from modeling.config import ConfigError, get_config
from layout import mesh as mesh_lib

NAME = "fsdp"
TINY = get_config("tiny")
DEEPSEEK = get_config("deepseek-test")
MESHES = ("fsdp:8", "data:2,fsdp:4")


@pytest.mark.parametrize("cfg, mesh", [(TINY, MESHES[0]), (TINY, MESHES[1]),
                                       (DEEPSEEK, MESHES[1])], ids=["tiny-fsdp8", "tiny-d2f4",
                                                                    "deepseek-d2f4"])
def test_parity(cfg, mesh):
  parity.check(NAME, cfg, mesh, steps=3)


def test_layout_invariance():
  parity.assert_layout_invariance(NAME, TINY, MESHES)


@pytest.mark.parametrize("mesh", MESHES)
def test_hlo_contract(mesh):
  job = parity.assert_contract(NAME, TINY, mesh)
  stats = hlo.collective_stats(job.compiled.as_text())
  assert stats["all-to-all"]["count"] == 0
  # every weight matrix gathered exactly once (the backward reuses the forward copy), and its
  # gradient reduce-scattered back to 1/f
  f = job.mesh.shape["fsdp"]
  mats = sum(int(np.prod(l.shape)) * 4 for l in model.param_leaves(TINY) if l.role in model.D_DIM)
  assert stats["all-gather"]["bytes"] == mats
  assert stats["reduce-scatter"]["bytes"] == mats // f


@pytest.mark.parametrize("mesh", MESHES)
def test_cost_model(mesh):
  parity.assert_cost_model(NAME, TINY, mesh)


@pytest.mark.parametrize("cfg, mesh, msg", [
    (TINY.replace(batch=6), "fsdp:8", "batch=6 is not divisible by mesh axis dataxfsdp=8"),
    (TINY.replace(d_model=36), "fsdp:8", "d_model=36 is not divisible by mesh axis fsdp=8"),
])
def test_bad_input(cfg, mesh, msg):
  strat = strategies.get(NAME)
  m = mesh_lib.make_mesh(mesh_lib.mesh_shape(strat.AXES, strat.MAIN_AXIS, mesh, 8, NAME))
  with pytest.raises(ConfigError) as e:
    strat.check(cfg, m)
  assert str(e.value) == msg
