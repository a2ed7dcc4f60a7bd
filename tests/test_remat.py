"""--remat: jax.checkpoint on the per-layer block inside the layer scan. Every strategy keeps
parity with the reference under it, XLA's temp bytes (compiled.memory_analysis()) go down, and
each strategy's cost model counts the collectives the recompute issues again. Remat on the
DeepSeek shapes (MLA, the dense prefix) runs in the strategy table's rows (pp's 1f1b, ep_tp's
folded exchange, ep_x_tp's sequence parallelism) and in bf16 (tests/test_precision.py)."""
import pytest

from measure import cost
from modeling.config import ConfigError, get_config
import strategies
from tests import parity

# every registered strategy on its comparison mesh, and tp under a dots_* policy too: one compile
# each, for parity and for the cost model
REMAT_MESHES = [(n, strategies.get(n).COMPARE_MESH, "block") for n in strategies.NAMES
                if n != "reference"] + [("tp", "data:4,tensor:2", "dots_saveable")]


@pytest.mark.parametrize("name,mesh,remat", REMAT_MESHES,
                         ids=[f"{n}-{r}" for n, _, r in REMAT_MESHES])
def test_parity_and_the_cost_of_the_recompute(name, mesh, remat):
  """The reference's losses, gradients and updates; the contract; the cost model per (kind,
  axes), both ways, within 1%, counting what the recompute issues again (measure/cost.py
  step_terms): the compiled bytes less the model's bytes without remat (each strategy's model
  equals its compiled step without remat: tests/test_strategies.py) are the recompute terms."""
  cfg = get_config("tiny", remat=remat)
  parity.check(name, cfg, mesh, steps=2)
  parity.assert_contract(name, cfg, mesh)
  table = parity.assert_cost_model(name, cfg, mesh)
  j = parity.job(name, cfg, mesh)
  terms = cost.step_terms(strategies.get(name), j.cfg, j.mesh, j.opts)
  extra = sum(t.bytes for t in terms if t.what.endswith("recomputed"))
  none = sum(t.bytes for t in terms) - extra
  measured = sum(v["measured"] for v in table.values())
  assert abs(measured - none - extra) <= 0.01 * none, (measured, none, extra)


def test_remat_lowers_temp_bytes():
  """fsdp on fsdp:8: the remat row above against the strategy table's tiny row."""
  temp = {r: parity.job("fsdp", get_config("tiny", remat=r), m).compiled.memory_analysis()
          .temp_size_in_bytes for r, m in (("none", "fsdp:8"), ("block", None))}
  assert temp["block"] < temp["none"], temp


def test_ep_tp_rejects_dots_policies():
  from layout import mesh as mesh_lib
  s = strategies.get("ep_tp")
  with pytest.raises(ConfigError, match="use --remat=block"):
    s.check(get_config("tiny", remat="dots_saveable"), mesh_lib.for_strategy(s, "data:4,expert:2"),
            s.Options())
