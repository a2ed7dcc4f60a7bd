"""ep beyond the shared table (tests/test_strategies.py): the all-to-all count and exact bytes, no
expert weight moving over `expert`, the capacity rule sizing the exchange, and MaxText
#4179's dispatch fix (buffer specs without running the model; what exchange=none compiles to)."""

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from layout import dispatch
from measure import cost, hlo
from modeling.config import get_config
import strategies
from tests import parity

EP = strategies.get("ep")
CASES = [("tiny", "expert:8"), ("tiny", "data:2,expert:4"), ("deepseek-test", "fsdp:2,expert:4")]
FLAG = ("tiny", "data:2,expert:4")        # the #4179 comparison: same model and mesh, flag on/off
A2A, AG, RS = "all-to-all", "all-gather", "reduce-scatter"
NONE = EP.Options(exchange="none")


def _cfg(model):
  return get_config(model)


def _mesh(spec):
  return parity.make_mesh("ep", spec)


def _axes(entry):
  return set((entry,) if isinstance(entry, str) else (entry or ()))


def _collectives(model, mesh, flag=False):
  job = parity.job("ep", _cfg(model), mesh, NONE if flag else None)
  return hlo.collective_stats_by_axes(job.hlo, job.mesh), job.mesh


@pytest.mark.parametrize("model,mesh", CASES)
def test_all_to_all_moves_tokens_not_weights(model, mesh):
  got, m = _collectives(model, mesh)
  # the all-to-all bytes are exact: 4 x [EP, C, D] + counts per layer
  a2a = parity.assert_cost_model("ep", _cfg(model), mesh)[(A2A, frozenset({"expert"}))]
  assert a2a["predicted"] == a2a["measured"]
  assert got[(A2A, frozenset({"expert"}))]["count"] == 5 * 2          # 3 fwd + 2 bwd per layer
  # no expert-sized tensor is gathered or scattered over `expert`: tokens move, weights do not
  assert not [k for k in got if k[0] in (AG, RS) and "expert" in k[1]], got


def test_capacity_factor_sizes_the_exchange():
  """capacity_factor 1.0 on tiny, expert:8: C = b_loc*L*C_e = 1*1*8 = 8 rows per shard instead of
  the dropless T_loc*min(K, L) = 32, so the all-to-alls move <= 30% of the dropless bytes; parity
  (dropped counts included) holds and the cost model is still exact."""
  cfg = get_config("tiny", capacity_factor=1.0)
  got = parity.check("ep", cfg, "expert:8")
  assert any(r["dropped"] > 0 for r in got)                        # the capacity rule bites
  a2a = lambda c: hlo.collective_stats(parity.job("ep", c, "expert:8").hlo)[A2A]
  capped, dropless = a2a(cfg), a2a(_cfg("tiny"))
  assert capped["count"] == dropless["count"] == 5 * cfg.n_layers
  assert capped["bytes"] <= 0.3 * dropless["bytes"], (capped, dropless)
  a2a = parity.assert_cost_model("ep", cfg, "expert:8")[(A2A, frozenset({"expert"}))]
  assert a2a["predicted"] == a2a["measured"]


# ----------------------------------------------------------------------------- MaxText #4179
@pytest.mark.parametrize("mesh", ["expert:8", "data:2,expert:4", "fsdp:2,expert:4"])
def test_dispatch_buffer_batch_does_not_steal_expert(mesh):
  """Pure sharding check (strategies.ep.buffer_type, nothing traced): the experts' input as one
  global [N_src, EP, C, D] array. Default: each device's block is the recv of
  strategies.ep.a2a_exchange, rows from the EP sources of its group for its own experts; the
  flag (exchange=none): the send of strategies.ep.local_exchange, its own rows for every EP
  shard's experts (tests/test_dispatch.py shows both exchanges' rows)."""
  cfg, m = _cfg("tiny"), _mesh(mesh)
  ep = m.shape["expert"]
  c = dispatch.send_rows(cfg, 1, cfg.seq_len, ep)                      # one sequence per device
  t = EP.dispatch_buffer_type(cfg, m, EP.Options())                    # [N_src, EP, C, D]
  spec = tuple(t.sharding.spec)
  assert _axes(spec[1]) == {"expert"} and "expert" not in _axes(spec[0]), spec
  assert t.shape[:2] == (8, ep)
  assert t.sharding.shard_shape(t.shape) == (ep, 1, c, cfg.d_model)    # recv [EP_src, C, D]
  b = EP.dispatch_buffer_type(cfg, m, NONE)
  bad = tuple(b.sharding.spec)
  assert "expert" in _axes(bad[0]) and bad[1] is None, bad            # the mis-sharded variant
  assert b.sharding.shard_shape(b.shape) == (1, ep, c, cfg.d_model)    # send [EP_dst, C, D]


def test_buffer_specs():
  t = ("data", "fsdp", "expert")
  assert EP.buffer_spec(t, ("expert",)) == P(("data", "fsdp"), "expert", None, None)
  assert EP.buffer_spec(t, ("expert",), True) == P(t, None, None, None)
  assert EP.buffer_spec(t, ("fsdp", "expert")) == P("data", ("fsdp", "expert"), None, None)
  assert EP.buffer_spec(("expert",), ("expert",)) == P(None, "expert", None, None)


def test_literal_mis_sharding_is_inexpressible():
  """P((data, fsdp, expert), expert, ..): one mesh axis on two dims of one tensor."""
  m = _mesh("fsdp:2,expert:4")
  with jax.set_mesh(m):
    x = jax.device_put(np.zeros((8, 4, 2, 2), np.float32), P(("data", "fsdp", "expert")))
    with pytest.raises(Exception, match="duplicate entries for `expert`"):
      jax.reshard(x, P(("data", "fsdp", "expert"), "expert", None, None))


def test_flag_compiles_to_the_all_gather_fallback():
  """Default: token all-to-alls, no expert-weight traffic over `expert`. Flag: no all-to-all;
  the experts [E, D, F] are all-gathered over expert and their grads reduce-scattered back."""
  cfg = _cfg(FLAG[0])
  good, m = _collectives(*FLAG)
  bad, _ = _collectives(*FLAG, flag=True)
  ex = frozenset({"expert"})
  expert_bytes = 3 * cfg.n_layers * cfg.n_experts * cfg.d_model * cfg.d_ff * 4   # wi_0, wi_1, wo
  assert good[(A2A, ex)]["count"] > 0 and (AG, ex) not in good and (RS, ex) not in good
  assert not [k for k in bad if k[0] == A2A], bad
  assert bad[(AG, ex)]["bytes"] == expert_bytes
  assert bad[(RS, ex)]["bytes"] == expert_bytes // m.shape["expert"]
  bcost = cost.totals(EP.cost(cfg, m, NONE))
  assert bcost[AG] == expert_bytes and bcost[A2A] == 0


# ----------------------------------------------------------------------------- bad input


def test_ragged_contract_block_matches_its_cost_model():
  """exchange=ragged cannot compile on XLA:CPU, so its HLO is unmeasured here; its docstring
  block and its cost terms are still one set (tests/test_target_contracts.py holds both to
  XLA:TPU's program). Its only all-to-alls are the backward's int32 sizes and offsets."""
  cfg, m, opts = _cfg("tiny"), _mesh("data:2,expert:4"), EP.Options(exchange="ragged")
  declared = parity.declared("ep", opts, m)
  model = cost.by_axes(cost.step_terms(EP, cfg, m, opts))
  assert declared == set(model), (declared ^ set(model))
  assert ("ragged-all-to-all", frozenset({"expert"})) in model
  assert model[(A2A, frozenset({"expert"}))] == cfg.n_moe_layers * 4 * m.shape["expert"] * 4
