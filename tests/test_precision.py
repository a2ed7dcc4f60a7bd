"""--dtype=bfloat16 mixed precision: every strategy against the bf16 reference (tolerances and
why: tests/parity.py, "bf16 parity"); its collectives are still its docstring contract and its
cost model per (kind, axes) within 1%, now in bf16 bytes; activations and gathered weights
move half the float32 bytes in the HLO, weight gradients are summed in float32 unless
--grad_reduce_dtype says otherwise; float32 programs hold no bf16 at all."""
import numpy as np
import pytest

from measure import hlo
from modeling.config import get_config
import strategies
from tests import parity

# (strategy, mesh): every registered strategy on its comparison mesh (run.py --compare); fsdp,
# cp and ep_as_cp with a data axis too, so their gradient sums span two axes; pp with one, so its
# stage weights are gathered over data in bf16 and their gradients reduce-scattered in float32
MESHES = [(n, {"fsdp": "data:2,fsdp:4", "cp": "data:2,context:4", "ep_as_cp": "data:2,expert:4",
               "pp": "stage:2,data:2,expert:2"}.get(n, strategies.get(n).COMPARE_MESH))
          for n in strategies.NAMES if n != "reference"]
IDS = [m[0] for m in MESHES]
# ep_as_cp runs its ring K/V exchange here (MLA's latent around the ring in bf16); cp's all-gather;
# pp its 1f1b schedule
OPTS = {"ep_as_cp": strategies.get("ep_as_cp").Options(kv_exchange="ring"),
        "pp": strategies.get("pp").ONE_F}           # pp's explicit per-stage vjp in bf16
TINY = get_config("tiny")
DEEPSEEK = get_config("deepseek-test")   # MLA, a dense layer, groups, a shared expert, bias update


@pytest.mark.parametrize("name,mesh", MESHES, ids=IDS)
def test_bf16_parity(name, mesh):
  parity.check_bf16(name, DEEPSEEK, mesh, opts=OPTS.get(name))


@pytest.mark.parametrize("name,mesh", MESHES, ids=IDS)
def test_bf16_contract_and_cost_model(name, mesh):
  cfg = parity.bf16_config(DEEPSEEK)
  parity.assert_contract(name, cfg, mesh, OPTS.get(name))
  parity.assert_cost_model(name, cfg, mesh, OPTS.get(name))


def _bytes(name, mesh, **kw) -> dict:
  """bf16 (or **kw) collective bytes per (kind, axes): the bf16 run is test_bf16_parity's compile."""
  j = parity.job(name, parity.bf16_config(DEEPSEEK).replace(**kw), dict(MESHES)[name])
  return {k: v["bytes"] for k, v in hlo.collective_stats_by_axes(j.hlo, j.mesh).items()}


# (strategy, mesh, kind, axes, bf16 / float32 bytes): activations and gathered weights halve
# (a little over where float32 / int32 rides along: the router, routing ids); the weight
# gradients' sums stay float32. Measured against a float32 compile of the same program, for an
# exchange (ep) and a weight gather (fsdp); every strategy's bf16 bytes per (kind, axes) are
# held to its cost model, which prices activations at 2 bytes, by the test above
RATIOS = [("ep", None, "all-to-all", {"expert"}, 0.5, 0.501),                  # tokens (+ counts)
          ("ep", None, "all-reduce", {"expert"}, 1.0, 1.0),                    # grads (+ stats)
          ("fsdp", "data:2,fsdp:4", "all-gather", {"fsdp"}, 0.5, 0.502),       # weights (+ router)
          ("fsdp", "data:2,fsdp:4", "reduce-scatter", {"fsdp"}, 1.0, 1.0)]     # their grads


@pytest.mark.parametrize("name,mesh,kind,axes,lo,hi", RATIOS,
                         ids=[f"{r[0]}-{r[2]}-{'+'.join(sorted(r[3]))}" for r in RATIOS])
def test_bf16_halves_activations_and_gathers(name, mesh, kind, axes, lo, hi):
  key = (kind, frozenset(axes))
  bf16, f32 = _bytes(name, mesh)[key], _bytes(name, mesh, dtype="float32")[key]
  assert lo - 1e-3 <= bf16 / f32 <= hi + 1e-3, (bf16, f32, bf16 / f32)


def test_grad_reduce_dtype_bfloat16_halves_the_gradient_sums():
  """--grad_reduce_dtype=bfloat16 (MaxText's and FSDP2's default behaviour): the weight
  gradients are summed in bf16, half the bytes (the float32 router's a little over)."""
  for key in (("reduce-scatter", frozenset({"fsdp"})), ("all-reduce", frozenset({"data"}))):
    f32_sums = _bytes("fsdp", "data:2,fsdp:4")[key]
    bf16_sums = _bytes("fsdp", "data:2,fsdp:4", grad_reduce_dtype="bfloat16")[key]
    assert 0.5 <= bf16_sums / f32_sums <= 0.51, (key, bf16_sums, f32_sums)


def test_float32_programs_hold_no_bf16():
  j = parity.job("ep", parity.bf16_config(DEEPSEEK).replace(dtype="float32"), None)  # RATIOS'
  assert "bf16[" not in j.compiled.as_text()
  assert j.hlo == j.compiled.as_text()            # nothing dumped: the final HLO is counted


def test_bf16_with_remat_and_microbatches():
  """Mixed precision composes with --remat and --microbatches (one update, the whole step's
  router statistics): still the bf16 reference's losses, gradients and updates."""
  parity.check_bf16("ep", TINY.replace(remat="block", microbatches=2, batch=16),
                    "data:2,expert:4")


def test_bf16_memory_drops():
  """bf16 activations: XLA's temp bytes of the compiled step fall (params stay float32); the
  bf16 step is test_bf16_parity's, the float32 one the RATIOS'."""
  mem = {dt: parity.job("fsdp", parity.bf16_config(DEEPSEEK).replace(dtype=dt),
                        "data:2,fsdp:4").compiled.memory_analysis()
         for dt in ("bfloat16", "float32")}
  temp = {dt: m.temp_size_in_bytes for dt, m in mem.items()}
  assert temp["bfloat16"] < 0.8 * temp["float32"], temp
  assert mem["bfloat16"].argument_size_in_bytes == mem["float32"].argument_size_in_bytes
  assert np.isfinite(temp["bfloat16"])
