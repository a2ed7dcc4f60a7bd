"""fsdp beyond the shared table (tests/test_strategies.py): every weight matrix is gathered exactly
once per step and its gradient reduce-scattered back to 1/f, byte for byte."""
import numpy as np
import pytest

from measure import hlo
from modeling import model
from modeling.config import get_config
from tests import parity

TINY = get_config("tiny")


@pytest.mark.parametrize("mesh", ("fsdp:8", "data:2,fsdp:4"))
def test_each_weight_gathered_once(mesh):
  job = parity.job("fsdp", TINY, mesh)
  stats = hlo.collective_stats(job.hlo)
  assert stats["all-to-all"]["count"] == 0
  # the backward reuses the forward copy: one gather per matrix per step
  f = job.mesh.shape["fsdp"]
  mats = sum(int(np.prod(l.shape)) * 4 for l in model.param_leaves(TINY) if l.role in model.D_DIM)
  assert stats["all-gather"]["bytes"] == mats
  assert stats["reduce-scatter"]["bytes"] == mats // f
