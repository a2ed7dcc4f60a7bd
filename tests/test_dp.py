"""dp: parity with the reference (two models), collective contract, cost model. dp has a single
mesh axis (data:8 on 8 devices); the other strategies cover multi-axis layouts."""
import pytest

from measure import hlo
from modeling.config import get_config
import strategies
from tests import parity

CASES = [("tiny", 8), ("deepseek-test", 8)]


@pytest.mark.parametrize("model,batch", CASES)
def test_parity(model, batch):
  parity.check("dp", get_config(model, batch=batch), "data:8")


@pytest.mark.parametrize("model,batch", CASES)
def test_collective_contract(model, batch):
  job = parity.assert_contract("dp", get_config(model, batch=batch), "data:8")
  by_axes = hlo.collective_stats_by_axes(job.compiled.as_text(), job.mesh)
  assert set(by_axes) == {("all-reduce", frozenset({"data"}))}     # nothing else moves


@pytest.mark.parametrize("model,batch", CASES)
def test_cost_model_within_10_percent(model, batch):
  parity.assert_cost_model("dp", get_config(model, batch=batch), "data:8")


def test_batch_not_divisible():
  from layout import mesh as mesh_lib
  from modeling.config import ConfigError
  with pytest.raises(ConfigError, match=r"^batch=12 is not divisible by mesh axis data=8$"):
    strategies.get("dp").check(get_config("tiny", batch=12), mesh_lib.make_mesh({"data": 8}))
