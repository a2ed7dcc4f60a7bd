"""--dtype=bfloat16 mixed precision: every strategy against the bf16 reference (tolerances and
why: tests/parity.py, "bf16 parity"); its collectives are still its docstring contract and its
cost model per (kind, axes) within 1%, now in bf16 bytes; activations and gathered weights
move half the float32 bytes in the HLO, weight gradients are summed in float32 unless
--grad_reduce_dtype says otherwise; float32 programs hold no bf16 at all."""
import numpy as np
import pytest

from measure import hlo
import strategies
from tests import parity

# (model, mesh, options) per strategy: each strategy's BF16_CASE, declared in its file, on its
# richest composition. The strategies that split attention (cp, ep_as_cp, tp, ep_tp, ep_x_tp) and
# pp run deepseek-test (MLA, a dense layer, groups, a shared expert, the bias update); dp, fsdp,
# ep and shard_exp_on_fsdp tiny. fsdp, cp and ep_as_cp have a data axis too, so their gradient
# sums span two axes; pp one, so its stage weights are gathered over data in bf16 and their
# gradients reduce-scattered in float32. ep, ep_tp (its folded exchange) recompute
# (--remat=block) and accumulate microbatches; ep_x_tp runs sequence parallelism with zero1 (its
# gathers move bf16, its reduce-scatters sum the microbatches' float32 gradients once per step);
# ep_as_cp its ring K/V exchange (MLA's latent around the ring in bf16); cp its all-gather; pp its
# 1f1b schedule (its explicit per-stage vjp; interleaved with remat: tests/test_pp.py).
ROWS = {n: (c.config(), c.mesh, c.opts) for n in strategies.NAMES
        if (c := getattr(strategies.get(n), "BF16_CASE", None)) is not None}
IDS = [n for n in strategies.NAMES if n != "reference"]
assert sorted(ROWS) == sorted(IDS)


@pytest.mark.parametrize("name", IDS)
def test_bf16_parity(name):
  model, mesh, opts = ROWS[name]
  parity.check_bf16(name, model, mesh, opts=opts)


@pytest.mark.parametrize("name", IDS)
def test_bf16_contract_and_cost_model(name):
  model, mesh, opts = ROWS[name]
  cfg = parity.bf16_config(model)
  parity.assert_contract(name, cfg, mesh, opts)
  parity.assert_cost_model(name, cfg, mesh, opts)


def _bytes(name, **kw) -> dict:
  """bf16 (or **kw) collective bytes per (kind, axes): the bf16 run is test_bf16_parity's compile."""
  model, mesh, opts = ROWS[name]
  j = parity.job(name, parity.bf16_config(model).replace(**kw), mesh, opts)
  return {k: v["bytes"] for k, v in hlo.collective_stats_by_axes(j.hlo, j.mesh).items()}


# (strategy, kind, axes, bf16 / float32 bytes), on ROWS' model and mesh: activations and
# gathered weights halve (a little over where float32 / int32 rides along: the router, routing
# ids); the weight gradients' sums stay float32. Measured against a float32 compile of the same
# program, for an exchange (ep) and a weight gather (fsdp); every strategy's bf16 bytes per
# (kind, axes) are held to its cost model, which prices activations at 2 bytes, by the test above
RATIOS = [("ep", "all-to-all", {"expert"}, 0.5, 0.501),                  # tokens (+ counts)
          ("ep", "all-reduce", {"data", "expert"}, 1.0, 1.0),            # grads (+ stats)
          ("fsdp", "all-gather", {"fsdp"}, 0.5, 0.502),                  # weights (+ router)
          ("fsdp", "reduce-scatter", {"fsdp"}, 1.0, 1.0)]                # their grads


@pytest.mark.parametrize("name,kind,axes,lo,hi", RATIOS,
                         ids=[f"{r[0]}-{r[1]}-{'+'.join(sorted(r[2]))}" for r in RATIOS])
def test_bf16_halves_activations_and_gathers(name, kind, axes, lo, hi):
  key = (kind, frozenset(axes))
  bf16, f32 = _bytes(name)[key], _bytes(name, dtype="float32")[key]
  assert lo - 1e-3 <= bf16 / f32 <= hi + 1e-3, (bf16, f32, bf16 / f32)


def test_grad_reduce_dtype_bfloat16_halves_the_gradient_sums():
  """--grad_reduce_dtype=bfloat16 (MaxText's and FSDP2's default behaviour): the weight
  gradients are summed in bf16, half the bytes (the float32 router's a little over)."""
  for key in (("reduce-scatter", frozenset({"fsdp"})), ("all-reduce", frozenset({"data"}))):
    f32_sums = _bytes("fsdp")[key]
    bf16_sums = _bytes("fsdp", grad_reduce_dtype="bfloat16")[key]
    assert 0.5 <= bf16_sums / f32_sums <= 0.51, (key, bf16_sums, f32_sums)


def test_float32_programs_hold_no_bf16():
  model, mesh, _ = ROWS["ep"]
  j = parity.job("ep", parity.bf16_config(model).replace(dtype="float32"), mesh)     # RATIOS'
  assert "bf16[" not in j.compiled.as_text()
  assert j.hlo == j.compiled.as_text()            # nothing dumped: the final HLO is counted


def test_bf16_memory_drops():
  """bf16 activations: XLA's temp bytes of the compiled step fall (params stay float32); the
  bf16 step is test_bf16_parity's, the float32 one the RATIOS'."""
  model, mesh, _ = ROWS["fsdp"]
  mem = {dt: parity.job("fsdp", parity.bf16_config(model).replace(dtype=dt), mesh)
         .compiled.memory_analysis()
         for dt in ("bfloat16", "float32")}
  temp = {dt: m.temp_size_in_bytes for dt, m in mem.items()}
  assert temp["bfloat16"] < 0.8 * temp["float32"], temp
  assert mem["bfloat16"].argument_size_in_bytes == mem["float32"].argument_size_in_bytes
  assert np.isfinite(temp["bfloat16"])
