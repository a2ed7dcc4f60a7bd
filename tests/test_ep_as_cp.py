"""ep_as_cp beyond the shared table (tests/test_strategies.py): a fractional per-device batch,
MaxText #3656's own check (FSDP=2 + CP=2 with cp.py vs FSDP=2 + EP-as-CP=2, plus data=2 to fill
8 devices: equal per-step losses), and what moves over `expert` (tokens and K/V, no weight)."""

import jax
import numpy as np
import pytest

from layout import context
from measure import cost, hlo
from modeling.config import get_config
import strategies
from tests import parity

EPCP = strategies.get("ep_as_cp")
MAXTEXT_3656_MESH = "fsdp:2,expert:2,data:2"
# tiny-batch2: 2 sequences on 8 devices, a quarter of a sequence each; with the capacity rule,
# which needs the whole sequence (expert ids and positions all-gathered over expert).
CASES = [("deepseek-test", {}, MAXTEXT_3656_MESH),
         ("tiny", dict(batch=2, capacity_factor=1.0), "fsdp:2,expert:4")]
IDS = ["deepseek-maxtext-3656-mesh", "tiny-batch2"]


def _cfg(model, **over):
  return get_config(model, **over)


def _mesh(spec):
  return parity.make_mesh("ep_as_cp", spec)


def test_fractional_per_device_batch():
  """batch 2 < 8 devices: each device holds one quarter (8 positions) of one sequence."""
  cfg = _cfg("tiny", **CASES[1][1])
  job = parity.job("ep_as_cp", cfg, CASES[1][2])
  tokens = job.batch(0)["tokens"]
  assert cfg.batch < jax.device_count()
  assert {s.data.shape for s in tokens.addressable_shards} == {(1, 8)}
  order = context.load_balance_order(cfg.seq_len, 4)                      # [0..3, 28..31 | 4..7, ..]
  np.testing.assert_array_equal(np.asarray(job.batch(0)["positions"])[0], order)


def test_matches_cp_fsdp2_cp2():
  """MaxText #3656's correctness check: same model and data, FSDP=2 + CP=2 (cp.py on context) vs
  FSDP=2 + EP-as-CP=2 (ep_as_cp.py on expert); both load-balance the same way."""
  cp = parity.run("cp", get_config("deepseek-test"), "fsdp:2,context:2,data:2", 3)
  epcp = parity.run("ep_as_cp", _cfg("deepseek-test"), MAXTEXT_3656_MESH, 3)
  for i, (a, b) in enumerate(zip(cp, epcp)):
    for k in ("loss", "ce_loss", "aux_loss", "grad_norm"):
      np.testing.assert_allclose(b[k], a[k], rtol=parity.LOSS_RTOL, atol=parity.LOSS_ATOL,
                                 err_msg=f"step {i} {k}")


@pytest.mark.parametrize("model,over,mesh", CASES, ids=IDS)
def test_expert_axis_moves_tokens_and_kv(model, over, mesh):
  job = parity.job("ep_as_cp", _cfg(model, **over), mesh)
  got = hlo.collective_stats_by_axes(job.hlo, job.mesh)
  e = frozenset({"expert"})
  assert got[("all-to-all", e)]["count"] == 5 * 2                     # 3 fwd + 2 bwd per layer
  assert got[("all-gather", e)]["count"] >= 2 * 2                     # K and V per layer
  # only K, V and ints are gathered over expert (never a weight): at most cp's K/V model (XLA
  # merges kv_pos with the capacity rule's positions gather)
  kv_terms = cost.cp_terms(job.cfg, job.mesh, "expert", ("data", "fsdp"))
  kv = [t.bytes for t in kv_terms if t.kind == "all-gather"]
  assert kv[0] <= got[("all-gather", e)]["bytes"] <= sum(kv)
