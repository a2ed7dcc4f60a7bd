"""ep_tp beyond the shared table (tests/test_strategies.py): the compaction (hand-worked, sort
size = the buffer bound, overflow = dropped) and the AG-RS exchange's op counts (all-gather +
reduce-scatter over expert, no all-to-all, no activation all-reduce); exchange=folded: the MoE's
only exchanges are all-to-alls (its traced fwd + bwd), the step's op counts per layer, and bf16
parity with --remat=block and --microbatches=2 in one compile."""

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from layout import compact
from measure import hlo
from modeling import model, routing
from modeling.config import get_config
from parallel.sharding import put
import strategies
from tests import parity

EP_TP = strategies.get("ep_tp")
SMALL = EP_TP.SMALL
IDS = ["tiny-d2e4", "deepseek-d4e2", "deepseek-b1s8-e8",          # EP_TP.TEST_CASES
       "folded-mixtral-cap-d2e4", "folded-deepseek-cap-d4e2", "folded-deepseek-b1s8-e8-remat",
       "folded-mixtral-e8-remat", "folded-mixtral-d4e2"]
RING, FOLDED = [0, 1, 2], [3, 4, 5, 6, 7]


def test_compact_hand_worked():
  # layout/compact.py docstring: experts [[0,2],[3,1],[2,0]], local experts {2, 3}, M = 4
  c = compact.compact(jnp.array([[0, 2], [3, 1], [2, 0]]), jnp.ones((3, 2), bool), 2, 2, 4)
  np.testing.assert_array_equal(c.copy, [1, 4, 2, 6])           # pad row = T*K = 6, sorted last
  np.testing.assert_array_equal(c.valid, [True, True, True, False])
  np.testing.assert_array_equal(c.group_sizes, [2, 1])
  assert float(c.overflow) == 0
  c = compact.compact(jnp.array([[0, 2], [3, 1], [2, 0]]), jnp.ones((3, 2), bool), 2, 2, 2)
  np.testing.assert_array_equal(c.copy, [1, 2])                 # copy 4 (token 2) overflows
  np.testing.assert_array_equal(c.group_sizes, [1, 1])
  assert float(c.overflow) == 1


def test_buffer_rows():
  assert compact.buffer_rows(128, 2, 2) == 256                  # worst case T*min(K, e)
  assert compact.buffer_rows(8, 4, 2) == 16                     # e < K: below T*K = 32, dropless
  assert compact.buffer_rows(128, 2, 2, 0.5) == 128
  assert compact.buffer_rows(10, 3, 8, 0.34) == 11              # ceil(0.34 * 30)


def _sort_shapes(jaxpr: Jaxpr) -> list[tuple]:
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "sort":
      out.append(tuple(eqn.invars[0].aval.shape))
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        if isinstance(sub, (ClosedJaxpr, Jaxpr)):
          out += _sort_shapes(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub)
  return out


def _moe_inputs(cfg, mesh, seed=1):
  """Layer-0 MoE params and a random normalised-scale input, placed like the strategy's
  (x sequence-parallel like the residual stream)."""
  specs = jax.tree.map(lambda s: P(*tuple(s)[1:]), EP_TP.param_specs(cfg, mesh)["layers"]["moe"])
  params = put(model.layer_params(model.init_params(cfg), 0)["moe"], specs, mesh)
  x = np.random.default_rng(seed).standard_normal((cfg.batch, cfg.seq_len, cfg.d_model))
  pos = np.broadcast_to(np.arange(cfg.seq_len), (cfg.batch, cfg.seq_len)).astype(np.int32)
  return (params, jax.device_put(x.astype(np.float32), NamedSharding(mesh, EP_TP.X_SPEC)),
          jax.device_put(pos, NamedSharding(mesh, P("data", None))))


def _moe_block(cfg, mesh, opts):
  """The MoE as model.forward runs it: gather_in -> moe -> scatter_out (no shared expert)."""
  lay = EP_TP.layout(cfg, mesh, opts)

  def f(p, x, pos):
    y, st = lay.moe(p, lay.gather_in(x), pos)
    return lay.scatter_out(y), st
  return f


@pytest.mark.parametrize("model_name,over,capacity,mesh,rows", [
    ("tiny", dict(n_kv_heads=4), 0.5, "data:2,expert:4", 128),   # T*K = 256
    ("tiny", SMALL, 0.0, "expert:8", 8),                          # T*K = 16
    ("deepseek-test", SMALL, 0.0, "expert:8", 16)])               # T*K = 32
def test_sort_is_sized_by_routed_bound(model_name, over, capacity, mesh, rows):
  """The only sort in the MoE runs on the M-row buffer, not on the T*K gathered copies."""
  cfg, opts = get_config(model_name, **over), EP_TP.Options(capacity=capacity)
  mesh = parity.make_mesh("ep_tp", mesh)
  assert EP_TP.buffer_rows(cfg, mesh, opts) == rows
  with jax.set_mesh(mesh):
    p, x, pos = _moe_inputs(cfg, mesh)
    jaxpr = jax.make_jaxpr(_moe_block(cfg, mesh, opts))(p, x, pos)
  tokens = cfg.batch // mesh.shape["data"] * cfg.seq_len
  assert _sort_shapes(jaxpr.jaxpr) == [(rows,)]
  assert rows < tokens * cfg.top_k


def test_overflow_is_dropped_and_counted():
  """M = 0.25 of the worst case (= the balanced load): the copies past slot M on each device are
  dropped (earliest tokens win), counted in `dropped`, and y is the oracle without them."""
  cfg, opts = get_config("tiny", n_kv_heads=4), EP_TP.Options(capacity=0.25)
  mesh = parity.make_mesh("ep_tp", "data:2,expert:4")
  with jax.set_mesh(mesh):
    p, x, pos = _moe_inputs(cfg, mesh)
    y, st = jax.jit(_moe_block(cfg, mesh, opts))(p, x, pos)
  assert jax.typeof(y).sharding.spec == EP_TP.X_SPEC
  p = jax.tree.map(np.asarray, p)
  dp, ep, rows = mesh.shape["data"], mesh.shape["expert"], EP_TP.buffer_rows(cfg, mesh, opts)
  n_local, k = cfg.n_experts // ep, cfg.top_k
  want, overflow = [], 0
  for xd in np.split(np.asarray(x), dp):                       # one data shard: T tokens
    xt = xd.reshape(-1, cfg.d_model)
    r = routing.route(xt, p["router"], p["bias"], cfg)
    e, w = np.asarray(r.experts), np.asarray(r.weights)
    keep = np.ones(e.size, bool)
    for j in range(ep):
      mine = (e // n_local == j).reshape(-1)
      drop = mine & (np.cumsum(mine) - 1 >= rows)
      keep &= ~drop
      overflow += drop.sum()
    h = np.einsum("td,edf->tef", xt, p["wi_0"])
    act = h / (1 + np.exp(-h)) * np.einsum("td,edf->tef", xt, p["wi_1"])
    ye = np.einsum("tef,efd->ted", act, p["wo"])                # [T, E, D]
    comb = np.zeros((xt.shape[0], cfg.n_experts))
    np.add.at(comb, (np.repeat(np.arange(xt.shape[0]), k), e.reshape(-1)),
              (w.reshape(-1) * keep))
    want.append(np.einsum("ted,te->td", ye, comb).reshape(xd.shape))
  assert overflow > 0
  assert float(st["dropped"]) == overflow
  np.testing.assert_allclose(np.asarray(y), np.concatenate(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", RING, ids=IDS[:3])
def test_ag_rs_counts_per_layer(case):
  """The AG-RS exchange over expert, no all-to-all; what all-reduces over expert alone is the
  norm-scale grads [D] and scalars (with data > 1)."""
  c = EP_TP.TEST_CASES[case]
  cfg = c.config()
  job = parity.job("ep_tp", cfg, c.mesh)
  got = hlo.collective_stats_by_axes(job.hlo, job.mesh)
  expert = frozenset({"expert"})
  assert {("all-gather", expert), ("reduce-scatter", expert)} <= set(got)
  assert not any(kind == "all-to-all" for kind, _ in got)
  # per layer: AG of the normed h x2, of expert ids + weights (MoE layers), of the 2 RS
  # cotangents (bwd); RS of attn wo and MoE + shared or the dense FFN (fwd), of the 2
  # gathered-h cotangents and the weights (MoE layers) (bwd)
  moe, dense = cfg.n_moe_layers, cfg.first_k_dense_replace
  assert got[("all-gather", expert)]["count"] == 6 * moe + 4 * dense
  assert got[("reduce-scatter", expert)]["count"] == 5 * moe + 4 * dense
  if job.mesh.shape["data"] > 1:   # norm-scale grads, the sequence-wise loss's [b, E], scalars
    norms = sum(4 * np.prod(l.shape) for l in model.param_leaves(cfg) if l.role in model.NORMS)
    if cfg.aux_loss_kind == "sequence":
      norms += moe * 2 * cfg.batch // job.mesh.shape["data"] * cfg.n_experts * 4
    assert got[("all-reduce", expert)]["bytes"] <= norms + 64 * 4
  else:                                            # + the replicated weights' grads and stats
    shapes = jax.tree.leaves(model.init_params_shapes(cfg), is_leaf=lambda l: hasattr(l, "shape"))
    specs = jax.tree.leaves(EP_TP.param_specs(cfg, job.mesh), is_leaf=lambda l: isinstance(l, P))
    replicated = sum(4 * np.prod(l.shape) for l, s in zip(shapes, specs) if not any(s))
    assert got[("all-reduce", expert)]["bytes"] <= replicated + 1024


# ----------------------------------------------------------------------------- exchange=folded
_COLLECTIVES = ("psum", "all_gather", "all_to_all", "reduce_scatter", "ppermute", "pmax", "pmin")


def _collectives(jaxpr: Jaxpr, out: list) -> list:
  """(primitive, axes, operand shapes, dtypes) of every collective in a jaxpr, sub-jaxprs too."""
  for eqn in jaxpr.eqns:
    if any(w in eqn.primitive.name for w in _COLLECTIVES):
      axes = eqn.params.get("axis_name", eqn.params.get("axes"))
      axes = (axes,) if isinstance(axes, str) else tuple(axes)
      out.append((eqn.primitive.name, axes, [v.aval.shape for v in eqn.invars],
                  [v.aval.dtype for v in eqn.invars]))
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        if isinstance(sub, (ClosedJaxpr, Jaxpr)):
          _collectives(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub, out)
  return out


@pytest.mark.parametrize("case", FOLDED[:2], ids=IDS[3:5])
def test_folded_moe_exchanges_only_by_all_to_all(case):
  """The folded MoE as model.block calls it (the sequence-parallel normed h in, y in the same
  layout out), traced forward and backward: over expert, the dispatch / counts / combine
  all-to-alls and their two transposes; otherwise only sums of router statistics, the
  sequence-wise loss's [b, E], weight gradients (router [D, E]; experts over data alone) and,
  with the capacity rule, the int expert ids and positions of whole sequences. No token or
  routing weight is gathered, scattered or all-reduced."""
  c = EP_TP.TEST_CASES[case]
  cfg, mesh = c.config(), parity.make_mesh("ep_tp", c.mesh)
  lay = EP_TP.layout(cfg, mesh, c.opts)
  assert lay.moe_in_residual
  with jax.set_mesh(mesh):
    p, x, pos = _moe_inputs(cfg, mesh)

    def loss(p, x):
      y, st = lay.moe(p, x, pos)
      assert jax.typeof(y).sharding.spec == EP_TP.X_SPEC        # back on its sequence shard
      return jnp.sum(y * y) + jnp.sum(st["counts"])
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(p, x)
  over_expert = [o for o in _collectives(jaxpr.jaxpr, []) if "expert" in o[1]]
  assert [o[2][0] for o in over_expert if o[0] == "all_to_all"] == [
      (mesh.shape["expert"], EP_TP.send_rows(cfg, mesh), cfg.d_model),          # dispatch
      (mesh.shape["expert"], cfg.n_experts // mesh.shape["expert"]),            # counts
      *[(mesh.shape["expert"], EP_TP.send_rows(cfg, mesh), cfg.d_model)] * 3]   # combine, 2 bwd
  for prim, axes, shapes, dtypes in over_expert:
    if prim == "all_to_all":
      continue
    if prim == "all_gather":                      # the capacity rule's ids [b, S/EP, K], positions
      assert cfg.capacity_factor > 0 and all(jnp.issubdtype(d, jnp.integer) for d in dtypes)
      continue
    assert "psum" in prim, (prim, axes, shapes)
    assert all(np.prod(s) <= cfg.d_model * cfg.n_experts for s in shapes), (prim, axes, shapes)


@pytest.mark.parametrize("case", FOLDED, ids=IDS[3:])
def test_folded_counts_per_layer(case):
  """The compiled step (the table's compile): over expert, attention's all-gather and
  reduce-scatter (+ their mirrors) per layer, the MLP's only in the dense layers and for the
  shared expert; 5 all-to-alls per MoE layer (dispatch, counts, combine, 2 transposes; --remat
  recomputes the forward's 3); the capacity rule's id gathers (+ positions, once)."""
  c = EP_TP.TEST_CASES[case]
  cfg = c.config()
  job = parity.job("ep_tp", cfg, c.mesh, c.opts)
  got = hlo.collective_stats_by_axes(job.hlo, job.mesh)
  expert = frozenset({"expert"})
  mlp = cfg.first_k_dense_replace + (cfg.n_moe_layers if cfg.n_shared_experts else 0)
  moe, remat = cfg.n_moe_layers, cfg.remat == "block"
  assert got[("all-to-all", expert)]["count"] == (5 + 3 * remat) * moe
  if not remat:
    capacity = moe + 1 if cfg.capacity_factor > 0 else 0
    assert got[("all-gather", expert)]["count"] == 2 * (cfg.n_layers + mlp) + capacity
    assert got[("reduce-scatter", expert)]["count"] == 2 * (cfg.n_layers + mlp)


def test_folded_bf16_remat_cost_at_one_microbatch():
  """exchange=folded in bf16 with --remat=block at M = 1 (at M = 2 its parity, contract and cost
  model are tests/test_precision.py's ep_tp row): the recompute's second sum of the
  per-sequence counts [b, E] over expert is an eighth of that axis's all-reduce bytes, which the
  cost model prices within 1%."""
  cfg = get_config("deepseek-test", remat="block")
  one = parity.assert_cost_model("ep_tp", parity.bf16_config(cfg), "data:2,expert:4", EP_TP.FOLDED)
  assert abs(one[("all-reduce", frozenset({"expert"}))]["ratio"] - 1) < 0.01, one
