"""Gradient accumulation (--microbatches=M): losses, aux loss, every gradient and the post-step
params equal the single-device reference's single pass (M = 1), for ep, fsdp, ep_as_cp and
ep_tp; the per-microbatch aux loss (local f) that this design avoids is measurably wrong. The
sequence-wise loss (deepseek-test's) runs without pass 1: ep_as_cp's case, its sequences split
over expert as well."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layout import mesh as mesh_lib
from measure import cost, hlo
from modeling import model
from modeling.config import get_config
from runtime import train
import strategies
from tests import parity

# (strategy, model, overrides, mesh, options): B % (M x batch axes) == 0 in each; ep's (tiny,
# M = 2, data:2,expert:4) and fsdp's (deepseek-test, M = 2, data:2,fsdp:4) rows are in their
# TEST_CASES (tests/test_strategies.py), sharing the table's compiles. ep_x_tp's zero1 gathers
# once for both passes and sums the gathered copies' gradients in float32 (runtime.train); it
# trains with Muon, whose Newton-Schulz reads the reduce-scattered sums.
CASES = [("ep_as_cp", "deepseek-test", dict(microbatches=4), "expert:8", {}),
         ("ep_tp", "tiny", dict(n_kv_heads=4, microbatches=4), "data:2,expert:4", {}),
         ("ep_x_tp", "tiny", dict(n_heads=8, n_kv_heads=4, microbatches=2, optimizer="muon"),
          "data:2,expert:2,tensor:2", {"zero1": True})]


def _opts(name, opts):
  return strategies.get(name).Options(**opts)


@pytest.mark.parametrize("name,model_name,over,mesh,opts", CASES, ids=[c[0] for c in CASES])
def test_parity(name, model_name, over, mesh, opts):
  parity.check(name, get_config(model_name, **over), mesh, steps=2, opts=_opts(name, opts))


@pytest.mark.parametrize("name,model_name,over,mesh,opts", CASES, ids=[c[0] for c in CASES])
def test_cost_model_counts_every_microbatch(name, model_name, over, mesh, opts):
  """The cost model per (kind, axes) within 1%, test_parity's compile: each microbatch's
  gradients are reduced over the devices (M x the weight traffic, measure/cost.step_terms), but
  zero1's, once per step; the batch-wise loss (tiny's) adds pass 1's forward. A cost model that
  priced one pass of the whole batch is off by M on every gradient reduction (ratio 4 here)."""
  parity.assert_cost_model(name, get_config(model_name, **over), mesh, _opts(name, opts))


def test_each_microbatch_keeps_the_batch_sharding():
  """ep on data:2,fsdp:4 keeps an expert axis of size 1 in its batch spec; the [B] -> [M, B/M]
  reshape alone moves it onto M, and rope then met positions over (data, fsdp) beside
  activations over (data, fsdp, expert): a ShardingTypeError, not a step."""
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 4, "expert": 1})
  spec = jax.sharding.PartitionSpec(("data", "fsdp", "expert"), None)
  batch = {"tokens": jax.device_put(jnp.zeros((16, 8), jnp.int32),
                                    jax.sharding.NamedSharding(mesh, spec))}
  with jax.set_mesh(mesh):
    mbs = jax.jit(lambda b: train.microbatches(b, 2))(batch)
  assert jax.typeof(mbs["tokens"]).sharding.spec == jax.sharding.PartitionSpec(None, *spec)


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


# Compile only, the batch-wise loss at M = 2 (tiny, bf16 as the planner's): cp (the head's
# weights stored over fsdp, the sequence split over context) and ep_x_tp's zero1 (weights
# gathered once per step, tokens replicated over tensor)
BATCHWISE_COST_CASES = [("cp", "fsdp:2,context:4", {}),
                        ("ep_x_tp", "data:2,expert:2,tensor:2", {"zero1": True})]


@pytest.mark.parametrize("name,mesh_spec,opts", BATCHWISE_COST_CASES,
                         ids=[c[0] for c in BATCHWISE_COST_CASES])
def test_batchwise_passes_cost_the_hlos_bytes(name, mesh_spec, opts):
  """Under the batch-wise loss the cost model prices both passes as XLA compiles them, every
  (kind, axes) within 1% of the HLO's bytes, both ways (measure.cost.accumulated): pass 1's
  forwards all-reduce the router counts alone and run no head (XLA removes the unembedding's
  gather and the loss sums: pricing them put cp's all-gather over fsdp at 1.02 x the HLO's and
  its statistics' all-reduce at 2.1 x); pass 2 reduces P and z per layer and its CE sum over the
  sequence's axes, then the batch's. zero1 gathers once for both passes and reduce-scatters the
  summed gradients once (gathering per microbatch, its all-gathers over data came to 2.9 x these
  at M = 2 and its reduce-scatters to 2 x)."""
  strat = strategies.get(name)
  opts = strat.Options(**opts)
  cfg = get_config("tiny", microbatches=2, dtype="bfloat16")
  mesh = mesh_lib.for_strategy(strat, mesh_spec)
  job = train.build(strat, cfg, mesh, opts, compile_only=True)
  got = hlo.collective_stats_by_axes(job.hlo, mesh)
  terms = cost.step_terms(strat, cfg, mesh, opts)
  table = cost.versus(terms, got, by="axes")
  bad = {k: v for k, v in table.items() if not 0.99 <= v["ratio"] <= 1.01}
  assert not bad, bad
  assert any(t.what.endswith(", counts pass") for t in terms)
  assert any(t.what.endswith(", once per step") for t in terms) == getattr(opts, "zero1", False)
