"""--remat: jax.checkpoint on the per-layer block inside the layer scan. Parity with the
reference is unchanged (ep, fsdp, ep_as_cp, ep_tp, pp), XLA's temp bytes (compiled.memory_analysis()) go down,
and each strategy's cost model counts the collectives the recompute issues again."""
import pytest

from measure import cost
from modeling.config import ConfigError, get_config
import strategies
from tests import parity

# the tiny block rows on the comparison meshes: the compiles test_cost_model_counts_the_recompute
# makes (parity.job's cache)
CASES = [("ep", "tiny", "expert:8", "block"),
         ("fsdp", "tiny", "fsdp:8", "block"),
         ("fsdp", "deepseek-test", "data:2,fsdp:4", "dots_saveable"),
         ("ep_as_cp", "deepseek-test", "data:2,expert:4", "block"),
         ("ep_tp", "tiny", "data:4,expert:2", "block"),
         ("pp", "tiny", "data:1,stage:2,expert:4", "block")]          # pp's own stage scan


@pytest.mark.parametrize("name,model_name,mesh,remat", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_parity(name, model_name, mesh, remat):
  parity.check(name, get_config(model_name, remat=remat), mesh, steps=2)


def _temp(name, model_name, mesh, remat):
  j = parity.job(name, get_config(model_name, remat=remat), mesh)
  return j.compiled.memory_analysis().temp_size_in_bytes


def test_remat_lowers_temp_bytes():
  none, block = (_temp("fsdp", "tiny", "data:2,fsdp:4", r) for r in ("none", "block"))
  assert block < none, (block, none)


# Every strategy's cost model counts the collectives its recompute issues again
# (measure/cost.py step_terms): per (kind, axes), both ways, within 1%.
# every registered strategy on its comparison mesh, and tp under a dots_* policy too
REMAT_MESHES = [(n, strategies.get(n).COMPARE_MESH, "block") for n in strategies.NAMES
                if n != "reference"] + [("tp", "data:4,tensor:2", "dots_saveable")]


@pytest.mark.parametrize("name,mesh,remat", REMAT_MESHES,
                         ids=[f"{n}-{r}" for n, _, r in REMAT_MESHES])
def test_cost_model_counts_the_recompute(name, mesh, remat):
  cfg = get_config("tiny", remat=remat)
  parity.assert_contract(name, cfg, mesh)
  table = parity.assert_cost_model(name, cfg, mesh)
  # what remat adds to the compiled step is what the model's recompute terms say it adds: the
  # compiled bytes less the model's bytes without remat (each strategy's model equals its
  # compiled step without remat: tests/test_strategies.py) are the recompute terms, to 1%
  j = parity.job(name, cfg, mesh)
  terms = cost.step_terms(strategies.get(name), j.cfg, j.mesh, j.opts)
  extra = sum(t.bytes for t in terms if t.what.endswith("recomputed"))
  none = sum(t.bytes for t in terms) - extra
  measured = sum(v["measured"] for v in table.values())
  assert abs(measured - none - extra) <= 0.01 * none, (measured, none, extra)


def test_ep_tp_rejects_dots_policies():
  from layout import mesh as mesh_lib
  s = strategies.get("ep_tp")
  with pytest.raises(ConfigError, match="use --remat=block"):
    s.check(get_config("tiny", remat="dots_saveable"), mesh_lib.for_strategy(s, "data:4,expert:2"),
            s.Options())
