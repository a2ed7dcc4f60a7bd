"""layout/dispatch.py's index helpers, hand-worked (send plans, buffers, ragged offsets, the
buffer bound), and the exchange that uses them (strategies/ep.py's moe_body with each
exchange: a2a_exchange; local_exchange, exchange=none; ragged_exchange through a dense emulation
of ragged_all_to_all, since XLA:CPU cannot run the real op) with routing and experts replaced by
stand-ins: the rows each expert receives on 2 and 3 shards, the round trip of every kept copy,
worst-case exactness, padding never read; then the whole EP MoE against moe_local."""
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from layout import buffers, dispatch, mesh as mesh_lib
from modeling import moe, routing
from modeling.config import ConfigError, get_config
import strategies

EP = strategies.get("ep")
A2A = "a2a"


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """ragged_all_to_all's documented semantics from a dense all_to_all (one slice per peer)."""
  n, rows_in, rows_out = input_offsets.shape[0], operand.shape[0], output.shape[0]
  r = jnp.arange(rows_in)
  idx = jnp.clip(input_offsets[:, None] + r[None, :], 0, rows_in - 1)
  valid = (r[None, :] < send_sizes[:, None])[..., None]
  slices = jnp.where(valid, operand[idx], 0)                              # [n, rows_in, D]
  recv = jax.lax.all_to_all(slices, axis_name, 0, 0, tiled=True)
  offs = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where my rows go
  for i in range(n):
    dst = jnp.where(r < recv_sizes[i], offs[i] + r, rows_out)
    output = output.at[dst].set(recv[i], mode="drop")
  return output


EXCHANGES = {A2A: EP.a2a_exchange,
              "ragged": functools.partial(EP.ragged_exchange, ragged_fn=emulated_ragged_all_to_all),
              "local": EP.local_exchange}


def exchange(monkeypatch, xs, experts, keep, n_experts, body=A2A):
  """Per shard i: tokens xs[i] [T, D] routed to experts / keep [T, K] through an exchange body,
  with stand-ins for the routing (combine weight 1000**k for kept copy k) and the experts (expert
  e multiplies its rows by e + 1). -> numpy per shard: the rows the experts get [EP*C, D] (sorted
  by expert, padding last), their group sizes, and y [T, D]."""
  ep, k = len(xs), np.shape(experts)[-1]
  cfg = get_config("tiny", n_experts=n_experts, top_k=k)                # dropless: C = T*min(K, L)
  seen = {}

  def route(p, x, positions, cfg, experts_all=None, seq_axes=()):
    w = jnp.where(p["keep"], 1000.0 ** jnp.arange(k), 0.0)
    return routing.Routing(p["experts"], w, None, None), p["keep"], {}

  def experts_fn(xs, gs, p, backend, cfg=None):             # gs: local experts, or all E
    seen.update(rows=xs, gs=gs)
    first = 0 if gs.shape[0] == n_experts else gs.shape[0] * jax.lax.axis_index("expert")
    return xs * (1 + first + dispatch.segment_ids(gs, xs.shape[0]))[:, None]

  monkeypatch.setattr(moe, "route_tokens", route)
  monkeypatch.setattr(moe, "swiglu_experts", experts_fn)

  def run(x, e, kp):                                           # x [1, T, D]: b = 1, s = T
    y, _ = EP.moe_body({"experts": e[0], "keep": kp[0]}, x, None, cfg=cfg, ep_axes=("expert",),
                       ep=ep, token_axes=("expert",), exchange=EXCHANGES[body])
    return seen["rows"][None], seen["gs"][None], y

  _need(ep)
  mesh = mesh_lib.make_mesh({"expert": ep})
  args = [jax.device_put(np.asarray(a), NamedSharding(mesh, P("expert")))
          for a in (np.asarray(xs, np.float32), np.asarray(experts, np.int32), np.asarray(keep))]
  f = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
  return [np.asarray(o) for o in f(*args)]


def round_trip(xs, experts, keep):
  """y of the stand-ins: sum over kept copies k of 1000**k * (e_tk + 1) * x_t."""
  w = np.asarray(keep) * 1000.0 ** np.arange(np.shape(experts)[-1]) * (np.asarray(experts) + 1)
  return np.sum(w, axis=-1, keepdims=True) * np.asarray(xs, np.float32)


# 2 shards, E=4 (L=2), K=2, T=3: the module docstring's example on shard 0.
X2 = [[[10.], [11.], [12.]], [[20.], [21.], [22.]]]
E2 = [[[1, 2], [0, 3], [2, 1]], [[3, 0], [1, 0], [3, 2]]]
K2 = np.ones((2, 3, 2), bool)


def test_plan_hand_worked():
  plan = dispatch.make_plan(jnp.array(E2[0]), jnp.array(K2[0]), 4, 2)
  # sorted copies (t,k:e): (1,0:0) (0,0:1) (2,1:1) | (0,1:2) (2,0:2) (1,1:3)
  np.testing.assert_array_equal(plan.dst, [0, 1, 0, 1, 1, 0])            # copy order (t, k)
  np.testing.assert_array_equal(plan.slot, [1, 0, 0, 2, 1, 2])
  np.testing.assert_array_equal(plan.pos, [1, 3, 0, 5, 4, 2])
  np.testing.assert_array_equal(plan.counts, [[1, 2], [2, 1]])
  send = dispatch.pack(jnp.array(X2[0]), plan, 2, dispatch.rows_bound(3, 2, 2))
  np.testing.assert_array_equal(send[..., 0], [[11, 10, 12, 0, 0, 0], [10, 12, 11, 0, 0, 0]])
  np.testing.assert_array_equal(dispatch.segment_ids(plan.counts, 6),
                                [[0, 1, 1, 2, 2, 2], [0, 0, 1, 2, 2, 2]])


@pytest.mark.parametrize("body", [A2A, "ragged"])
def test_two_shards_rows_per_expert_and_round_trip(monkeypatch, body):
  """Each expert gets the rows of every source of its EP group, source 0's first (a2a: rows
  [EP_src, C] sorted by local expert; ragged: source runs back to back): the same rows."""
  rows, gs, y = exchange(monkeypatch, X2, E2, K2, 4, body)
  # shard 0 owns experts 0, 1: source 0 sends [x1 | x0 x2], source 1 [x0 x1 | x1]
  np.testing.assert_array_equal(rows[0, :, 0], [11, 20, 21, 10, 12, 21] + [0] * 6)
  # shard 1 owns experts 2, 3: source 0 sends [x0 x2 | x1], source 1 [x2 | x0 x2]
  np.testing.assert_array_equal(rows[1, :, 0], [10, 12, 22, 11, 20, 22] + [0] * 6)
  np.testing.assert_array_equal(gs, [[3, 3], [3, 3]])
  np.testing.assert_array_equal(y, round_trip(X2, E2, K2))                 # every copy home


def test_ragged_params_hand_worked():
  a = jnp.array([[1, 2], [3, 0]])          # a[i, j]: copies shard i sends to shard j
  (io, ss, oo, rs), (cio, css, coo, crs) = dispatch.ragged_params(a, 0)
  np.testing.assert_array_equal(np.stack([io, ss, oo, rs]), [[0, 1], [1, 2], [0, 0], [1, 3]])
  np.testing.assert_array_equal(np.stack([cio, css, coo, crs]), [[0, 1], [1, 3], [0, 0], [1, 2]])
  (io, ss, oo, rs), (cio, css, coo, crs) = dispatch.ragged_params(a, 1)
  # shard 1's 3 rows for shard 0 land after shard 0's own row there; shard 1 gets shard 0's 2
  np.testing.assert_array_equal(np.stack([io, ss, oo, rs]), [[0, 3], [3, 0], [1, 2], [2, 0]])
  # back: shard 1 returns shard 0's 2 rows to offset 1 there (after its row for expert shard 0)
  np.testing.assert_array_equal(np.stack([cio, css, coo, crs]), [[0, 2], [2, 0], [1, 3], [3, 0]])


# 3 shards, E=6 (L=2), K=2, T=2; shard 1's copy (1, 1) is dropped by the capacity rule.
X3 = [[[1.], [2.]], [[10.], [11.]], [[20.], [21.]]]
E3 = [[[5, 0], [2, 3]], [[1, 4], [4, 5]], [[0, 1], [3, 2]]]
K3 = np.array([[[1, 1], [1, 1]], [[1, 1], [1, 0]], [[1, 1], [1, 1]]], bool)


@pytest.mark.parametrize("body", [A2A, "ragged"])
def test_three_shards_with_a_dropped_copy(monkeypatch, body):
  rows, gs, y = exchange(monkeypatch, X3, E3, K3, 6, body)              # C = T*min(K,L) = 4
  np.testing.assert_array_equal(rows[0, :, 0], [1, 20, 10, 20] + [0] * 8)  # e0: x0 of 0, of 2
  np.testing.assert_array_equal(rows[1, :, 0], [2, 21, 2, 21] + [0] * 8)   # none from shard 1
  np.testing.assert_array_equal(rows[2, :, 0], [10, 11, 1] + [0] * 9)      # e5 misses 1's copy
  np.testing.assert_array_equal(gs, [[2, 2], [2, 2], [2, 1]])
  np.testing.assert_array_equal(y, round_trip(X3, E3, K3))               # dropped copy: nothing


def test_capacity_factor_bound_hand_worked():
  """E 8 over EP 4 (L 2), K 2, one sequence of S 8 on this device, capacity factor 1:
  C_e = ceil(1*8*2/8) = 2 slots per expert, so C = b*L*C_e = 1*2*2 = 4 rows per shard, where the
  dropless worst case T*min(K, L) = 16 is 4x larger. Every token picks experts 0 and 1 (both on
  shard 0): the capacity rule keeps 2 copies each, and shard 0 receives exactly the bound."""
  cfg = get_config("tiny", n_experts=8, top_k=2, seq_len=8, capacity_factor=1.0)
  c = dispatch.send_rows(cfg, 1, 8, 4)
  assert c == 4 and dispatch.rows_bound(8, 2, 2) == 16
  experts = jnp.array([[0, 1]] * 8)
  keep = routing.capacity_keep(experts[None], jnp.arange(8)[None], 2, 8).reshape(8, 2)
  np.testing.assert_array_equal(keep, [[True, True]] * 2 + [[False, False]] * 6)
  plan = dispatch.make_plan(experts, keep, 8, 4)
  np.testing.assert_array_equal(plan.counts, [[2, 2], [0, 0], [0, 0], [0, 0]])
  send = dispatch.pack(jnp.arange(10., 18.)[:, None], plan, 2, c)       # token t has value 10+t
  np.testing.assert_array_equal(send[..., 0], [[10, 11, 10, 11]] + [[0] * 4] * 3)  # full: = C


@pytest.mark.parametrize("body", [A2A, "ragged"])
def test_round_trip_never_reads_padding(monkeypatch, body):
  """Every padded buffer starts as NaN (layout/buffers.py): the padding is really there (NaN in
  the rows the experts get), and no padding row reaches a token (ragged: unsent copies masked)."""
  with buffers.poisoned():
    rows, _, y = exchange(monkeypatch, X3, E3, K3, 6, body)
  assert np.isnan(rows).any()
  np.testing.assert_array_equal(y, round_trip(X3, E3, K3))


def test_no_exchange_keeps_rows_local(monkeypatch):
  """exchange=none (local_exchange): the send buffer stays put and every device's
  own rows go through all E experts (E = padding)."""
  rows, gs, y = exchange(monkeypatch, X2, E2, K2, 4, "local")
  np.testing.assert_array_equal(rows[0, :, 0], [11, 10, 12, 10, 12, 11] + [0] * 6)
  np.testing.assert_array_equal(rows[1, :, 0], [20, 21, 21, 22, 20, 22] + [0] * 6)
  np.testing.assert_array_equal(gs, [[1, 2, 2, 1], [2, 1, 1, 2]])
  np.testing.assert_array_equal(y, round_trip(X2, E2, K2))


@pytest.mark.parametrize("ep,n_experts,k", [(2, 4, 2), (4, 4, 2), (3, 6, 2)])
def test_worst_case_is_exact(monkeypatch, ep, n_experts, k):
  """Every token of every shard picks the first experts: the fullest possible send to shard 0
  (or shards 0 and 1 when L < K) fills C = T*min(K, L) exactly and nothing is lost."""
  t = 5
  rng = np.random.default_rng(ep)
  xs = rng.standard_normal((ep, t, 3)).astype(np.float32)
  experts = np.broadcast_to(np.arange(k), (ep, t, k))
  keep = np.ones((ep, t, k), bool)
  rows, gs, y = exchange(monkeypatch, xs, experts, keep, n_experts)
  c = dispatch.rows_bound(t, k, n_experts // ep)
  assert rows.shape == (ep, ep * c, 3)
  assert gs[0].sum() == ep * c                                           # shard 0's rows: full
  np.testing.assert_allclose(y, round_trip(xs, experts, keep), rtol=1e-6)


def test_capacity_bound():
  assert dispatch.rows_bound(10, 2, 1) == 10       # L=1: at most one copy per shard per token
  assert dispatch.rows_bound(10, 4, 8) == 40       # L>=K: all K copies can go to one shard


def test_exchange_choice():
  """The default is the a2a exchange, checked on CPU; ragged is opt-in and refused on CPU."""
  assert EP.Options().exchange == A2A
  assert EP.EXCHANGES == {A2A: EP.a2a_exchange, "ragged": EP.ragged_exchange,
                           "none": EP.local_exchange}
  EP.check_exchange("ragged", "gpu")
  with pytest.raises(ConfigError, match=r"^exchange=ragged needs ragged_all_to_all"):
    EP.check_exchange("ragged", "cpu")


@functools.lru_cache(maxsize=None)
def _moe_case():
  from modeling import model
  cfg = get_config("tiny", batch=8, seq_len=8, n_layers=1)
  p = model.layer_params(model.init_params(cfg), 0)["moe"]
  x = np.random.default_rng(0).standard_normal((8, 8, cfg.d_model)).astype(np.float32)
  pos = np.broadcast_to(np.arange(8, dtype=np.int32), (8, 8)).copy()
  return cfg, p, x, pos


def _need(n: int) -> None:
  """Skip where this host has fewer than n devices (a GPU host of one device; CPU runs 8)."""
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices, this host has {jax.device_count()}")


def _moe_ep(exchange, mesh=None, ep_axes=("expert",)):
  """Jitted ep.moe_ep on a mesh with tokens over every axis and experts over ep_axes."""
  cfg, p, x, pos = _moe_case()
  if mesh is None:
    _need(8)
  mesh = mesh or mesh_lib.make_mesh({"data": 2, "expert": 4})
  tok = tuple(mesh.axis_names)
  e_entry = ep_axes[0] if len(ep_axes) == 1 else ep_axes
  with jax.set_mesh(mesh):
    pp = {k: jax.device_put(v, P(e_entry, None, None) if v.ndim == 3 else P()) for k, v in p.items()}
    f = jax.jit(lambda p, x, pos: EP.moe_ep(p, x, pos, cfg, ep_axes=ep_axes, exchange=exchange))
    args = (pp, jax.device_put(x, P(tok, None, None)), jax.device_put(pos, P(tok, None)))
    return f, args


@pytest.mark.parametrize("body,mesh,ep_axes", [
    (A2A, None, ("expert",)),
    ("ragged", None, ("expert",)),
    (A2A, {"data": 2, "fsdp": 2, "expert": 2}, ("expert", "fsdp")),   # shard_exp_on_fsdp "ep"
], ids=["a2a", "emulated-ragged", "two-ep-axes"])
def test_moe_ep_matches_moe_local(body, mesh, ep_axes):
  """Forward of the whole EP MoE (one shard_map) equals the single-device moe_local; an EP group
  may span several mesh axes (shard index = their linear index in ep_axes order)."""
  cfg, p, x, pos = _moe_case()
  want, want_stats = moe.moe_local(p, jnp.asarray(x), jnp.asarray(pos), cfg)
  _need(8)
  f, args = _moe_ep(EXCHANGES[body], mesh_lib.make_mesh(mesh) if mesh else None, ep_axes)
  y, stats = f(*args)
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(stats["counts"]), np.asarray(want_stats["counts"]))


def test_ragged_lowers_to_ragged_all_to_all():
  """The real op lowers on CPU (XLA:CPU cannot compile/run it; GPU/TPU only)."""
  f, args = _moe_ep(EP.ragged_exchange)
  assert f.lower(*args).as_text().count("ragged_all_to_all") == 2       # dispatch + combine


@pytest.mark.skipif(jax.default_backend() == "cpu",
                    reason="ragged_all_to_all is not implemented by XLA:CPU (GPU/TPU only)")
def test_ragged_runs_on_accelerator():
  """The real ragged_all_to_all, forward, against the single-device moe_local, on every device of
  this host as the expert axis (one GPU: a group of one, the op still compiled and run)."""
  cfg, p, x, pos = _moe_case()
  want, _ = moe.moe_local(p, jnp.asarray(x), jnp.asarray(pos), cfg)
  n = jax.device_count()
  f, args = _moe_ep(EP.ragged_exchange,
                    mesh_lib.make_mesh({"data": 1, "expert": n}) if n < 8 else None)
  # float32 on the GPU sums in another order than moe_local's one-device products: on one H100
  # 9 of 4,096 outputs differed by up to 2.05e-5 (values of order 1); a lost or misrouted row
  # would differ by its whole value
  np.testing.assert_allclose(np.asarray(f(*args)[0]), np.asarray(want), rtol=1e-4, atol=1e-4)
