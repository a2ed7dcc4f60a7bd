"""--remat: jax.checkpoint on the per-layer block inside the layer scan. Parity with the
reference is unchanged (ep, fsdp), and XLA's temp bytes (compiled.memory_analysis()) go down."""
import pytest

from common.config import get_config
from tests import parity

CASES = [("ep", "tiny", "data:2,expert:4", "block"),
         ("fsdp", "tiny", "data:2,fsdp:4", "block"),
         ("fsdp", "deepseek-test", "data:2,fsdp:4", "dots_saveable")]


@pytest.mark.parametrize("name,model_name,mesh,remat", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_parity(name, model_name, mesh, remat):
  parity.check(name, get_config(model_name, remat=remat), mesh, steps=2)


def _temp(name, model_name, mesh, remat):
  j = parity.job(name, get_config(model_name, remat=remat), mesh)
  return j.compiled.memory_analysis().temp_size_in_bytes


def test_remat_lowers_temp_bytes():
  none, block = (_temp("fsdp", "tiny", "data:2,fsdp:4", r) for r in ("none", "block"))
  assert block < none, (block, none)
