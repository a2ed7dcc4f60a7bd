"""shard_exp_on_fsdp beyond the shared table (tests/test_strategies.py): Muon's update of the
experts issues no collective (plain fsdp all-gathers them), and the two modes trade the expert
weight traffic for a wider token exchange."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from measure import hlo
from modeling import model, optim
from modeling.config import get_config
import strategies
from tests import parity

NAME = "shard_exp_on_fsdp"
STRAT = strategies.get(NAME)
F8, F2E4 = "fsdp:8,expert:1", "fsdp:2,expert:4"
EXPERTS = ("wi_0", "wi_1", "wo")


def _job(opts):
  return parity.job(NAME, get_config("tiny"), F2E4, opts)


def _muon_expert_update(name, mesh_spec, cfg):
  """Collectives of Muon's update alone, on the expert leaves placed with `name`'s param_specs."""
  mesh = parity.make_mesh(name, mesh_spec)
  pick = lambda t: {"layers": {"moe": {n: t["layers"]["moe"][n] for n in EXPERTS}}}
  params = jax.tree.map(
      lambda s, spec: jax.ShapeDtypeStruct(s.shape, jnp.float32,
                                           sharding=NamedSharding(mesh, spec)),
      pick(model.init_params_shapes(cfg)), pick(strategies.get(name).param_specs(cfg, mesh)))
  opt = optim.make_optimizer("muon", pick(model.param_roles(cfg)), lr=cfg.lr)
  with jax.set_mesh(mesh):
    state = jax.eval_shape(opt.init, params)
    compiled = jax.jit(opt.update).lower(params, state, params).compile()
  return hlo.collective_stats(compiled.as_text())


def test_muon_expert_update_needs_no_collective():
  cfg = get_config("deepseek-test", optimizer="muon")
  expert_bytes = 3 * cfg.n_moe_layers * cfg.n_experts * cfg.d_model * cfg.d_ff * 4
  for mesh in (F8, F2E4):
    got = _muon_expert_update(NAME, mesh, cfg)
    assert all(v["count"] == 0 for v in got.values()), (mesh, got)
  # plain fsdp stores [E, D@fsdp, F]: Newton-Schulz needs each [D, F] whole -> all-gathers
  got = _muon_expert_update("fsdp", "fsdp:8", cfg)
  assert got["all-gather"]["bytes"] == expert_bytes, got       # every expert matrix, whole


def test_modes_trade_weight_traffic_for_a_wider_exchange():
  """tiny on fsdp:2,expert:4: E = 8 <= EP*K = 8, so both modes' padded token buffers are equal;
  ep mode drops the expert all-gather (E/EP experts per device) and its grad reduce-scatter."""
  gather, ep = (hlo.collective_stats_by_axes(_job(o).hlo, _job(o).mesh)
                for o in (STRAT.Options(), STRAT.Options(mode="ep")))
  cfg, f = get_config("tiny"), frozenset({"fsdp"})
  experts = 3 * cfg.n_layers * cfg.n_experts * cfg.d_model * cfg.d_ff * 4
  assert gather[("all-gather", f)]["bytes"] == experts // 4
  assert gather[("reduce-scatter", f)]["bytes"] == experts // 8
  assert ("all-gather", f) not in ep and ("reduce-scatter", f) not in ep
  assert (ep[("all-to-all", frozenset({"fsdp", "expert"}))]["bytes"]
          == gather[("all-to-all", frozenset({"expert"}))]["bytes"])
