"""Gradient accumulation (--microbatches=M): losses, aux loss, every gradient and the post-step
params equal the single-device reference's single pass (M = 1), for ep, fsdp, ep_as_cp and
ep_tp; the per-microbatch aux loss (local f) that this design avoids is measurably wrong. The
sequence-wise loss (deepseek-test's) runs without pass 1: ep_as_cp's case, its sequences split
over expert as well."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from modeling import model
from modeling.config import get_config
from runtime import train
from tests import parity

# (strategy, model, overrides, mesh): B % (M x batch axes) == 0 in each; ep's (tiny, M = 2,
# data:2,expert:4) and fsdp's (deepseek-test, M = 2, data:2,fsdp:4) rows are in their
# TEST_CASES (tests/test_strategies.py), sharing the table's compiles
CASES = [("ep_as_cp", "deepseek-test", dict(microbatches=4), "expert:8"),
         ("ep_tp", "tiny", dict(n_kv_heads=4, microbatches=4), "data:2,expert:4")]


@pytest.mark.parametrize("name,model_name,over,mesh", CASES, ids=[c[0] for c in CASES])
def test_parity(name, model_name, over, mesh):
  parity.check(name, get_config(model_name, **over), mesh, steps=2)


@pytest.mark.parametrize("name,model_name,over,mesh", CASES, ids=[c[0] for c in CASES])
def test_cost_model_counts_every_microbatch(name, model_name, over, mesh):
  """The cost model per (kind, axes) within 10%, test_parity's compile: each microbatch's
  gradients are reduced over the devices (M x the weight traffic, measure/cost.step_terms), and
  ep_tp's batch-wise loss adds pass 1's forward. A cost model that priced one pass of the whole
  batch is off by M on every gradient reduction (ratio 4 here)."""
  parity.assert_cost_model(name, get_config(model_name, **over), mesh)


def test_local_aux_loss_differs():
  """Why pass 1 exists: summing each microbatch's own aux loss (f from its own counts) is not
  the step's aux loss; the global-f sum is (to float32 rounding)."""
  cfg = get_config("tiny", aux_loss_coef=1.0)
  lay = model.reference_layout(cfg)
  params = jax.tree.map(jnp.asarray, model.init_params(cfg))
  from runtime import data
  batch = {k: jnp.asarray(v) for k, v in data.batch(0, cfg.batch, cfg.seq_len, cfg.vocab,
                                                       cfg.seed).items()}
  aux = jax.jit(lambda b: model.loss_fn(params, b, cfg, lay)[1]["aux_loss"])
  whole = aux(batch)
  mbs = train.microbatches(batch, 2)                                   # [2, B/2, S]
  local = sum(aux(jax.tree.map(lambda a: a[i], mbs)) for i in range(2)) / 2
  accum = jax.jit(lambda b: train.accumulated_grads(params, b, cfg.replace(microbatches=2),
                                                    lay)[0]["aux_loss"])(batch)
  np.testing.assert_allclose(accum, whole, rtol=1e-6)
  assert abs(local - whole) > 1e-4 * abs(whole), (local, whole)
