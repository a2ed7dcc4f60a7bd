"""Permutation, the sorted-token MoE and the dense oracle; hand-worked index cases."""
import jax
import jax.numpy as jnp
import numpy as np

from modeling import model, moe
from modeling.config import get_config


def test_permute_hand_case():
  # experts [[1,0],[0,1]] -> flat [1,0,0,1] -> stable sort -> order [1,2,0,3]
  x = jnp.array([[10.0], [20.0]])
  experts = jnp.array([[1, 0], [0, 1]])
  keep = jnp.ones((2, 2), bool)
  xs, gs, order = moe.permute(x, experts, keep, 2)
  np.testing.assert_array_equal(np.asarray(order), [1, 2, 0, 3])
  np.testing.assert_array_equal(np.asarray(xs)[:, 0], [10, 20, 10, 20])
  np.testing.assert_array_equal(np.asarray(gs), [2, 2])


def test_permute_dropped_go_last():
  x = jnp.array([[1.0], [2.0], [3.0]])
  experts = jnp.array([[0], [0], [1]])
  keep = jnp.array([[True], [False], [True]])
  xs, gs, order = moe.permute(x, experts, keep, 2)
  np.testing.assert_array_equal(np.asarray(gs), [1, 1])             # the dropped copy is in no group
  np.testing.assert_array_equal(np.asarray(xs)[:, 0], [1, 3, 2])     # ... and sorts past sum(gs)


def test_permute_unpermute_round_trip_values_and_grads():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((6, 4)).astype(np.float32))
  experts = jnp.asarray(rng.integers(0, 3, size=(6, 2)))
  w = jnp.asarray(rng.random((6, 2)).astype(np.float32))
  keep = jnp.ones((6, 2), bool)

  def f(x, w):
    xs, _, order = moe.permute(x, experts, keep, 3)
    return moe.unpermute(xs, order, w)                                # identity experts

  y = f(x, w)
  np.testing.assert_allclose(np.asarray(y), np.asarray(x) * np.asarray(w).sum(1, keepdims=True),
                             rtol=1e-6)
  gx, gw = jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1))(x, w)
  gx_want, gw_want = jax.grad(lambda x, w: jnp.sum((x * w.sum(1, keepdims=True)) ** 2),
                              argnums=(0, 1))(x, w)
  np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_want), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(gw), np.asarray(gw_want), rtol=1e-5)


def _layer(cfg):
  p = model.layer_params(model.init_params(cfg), 0)["moe"]
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, cfg.seq_len, cfg.d_model)).astype(np.float32)
  pos = np.broadcast_to(np.arange(cfg.seq_len), (2, cfg.seq_len))
  return p, jnp.asarray(x), jnp.asarray(pos)


def test_sorted_moe_matches_dense_oracle_with_and_without_drops():
  for cf in (0.0, 1.0):
    cfg = get_config("deepseek-test", capacity_factor=cf, gmm_backend="ragged_dot")
    p, x, pos = _layer(cfg)
    f_sorted = jax.jit(lambda p, x: jnp.sum(moe.moe_local(p, x, pos, cfg)[0] ** 2))
    f_dense = jax.jit(lambda p, x: jnp.sum(moe.moe_dense(p, x, pos, cfg)[0] ** 2))
    np.testing.assert_allclose(float(f_sorted(p, x)), float(f_dense(p, x)), rtol=1e-5)
    g1 = jax.jit(jax.grad(f_sorted, argnums=(0, 1)))(p, x)
    g2 = jax.jit(jax.grad(f_dense, argnums=(0, 1)))(p, x)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    dropped = float(jax.jit(lambda p, x: moe.moe_local(p, x, pos, cfg)[1]["dropped"])(p, x))
    assert (dropped > 0) == (cf > 0)


def test_dropped_count_hand_case():
  # 1 sequence of 4 tokens all routed to experts {0, 1} (K=2, E=8), C = ceil(0.5*4*2/8) = 1:
  # each of experts 0 and 1 keeps 1 of 4 assignments -> 6 dropped.
  cfg = get_config("tiny", capacity_factor=0.5, seq_len=4)
  p = model.layer_params(model.init_params(cfg), 0)["moe"]
  p = dict(p, router=np.zeros_like(p["router"]), bias=np.zeros_like(p["bias"]))
  p["router"][:, 0] = 1.0
  p["router"][:, 1] = 0.5
  x = jnp.ones((1, 4, cfg.d_model))
  r, keep, stats = moe.route_tokens(p, x, jnp.arange(4)[None], cfg)
  np.testing.assert_array_equal(np.asarray(r.experts), [[0, 1]] * 4)
  assert float(stats["dropped"]) == 6.0
  np.testing.assert_array_equal(np.asarray(keep), [[True, True]] + [[False, False]] * 3)
