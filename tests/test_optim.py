"""Tests for modeling.optim: AdamW vs numpy, Newton-Schulz vs numpy, Muon views, momentum and
sharding."""

import chex
import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from measure import hlo
from modeling import model, optim
from modeling.config import Config

V, D, H, KV, DH, E, F, L = 8, 4, 2, 1, 3, 2, 6, 2
FS = F                                       # one shared expert: Fs = F
LR, WD, B1, B2, EPS, MU = 0.1, 0.05, 0.9, 0.95, 1e-8, 0.95
CFG = Config(vocab=V, d_model=D, n_heads=H, n_kv_heads=KV, head_dim=DH, n_layers=L, n_experts=E,
      d_ff=F, n_shared_experts=1)
ROLES = model.param_roles(CFG)


def _tree(rng):
  """Random float32 numpy params with the model's structure: layers stacked [L, ...]."""
  return jax.tree.map(lambda l: rng.standard_normal(l.shape).astype(np.float32),
            model.init_params_shapes(CFG), is_leaf=lambda l: hasattr(l, "role"))


def _numpy_adamw(params, grads_seq, wd=WD):
  """Reference AdamW (eps outside the sqrt, decoupled decay but on norms; bias frozen)."""
  flat, treedef = jax.tree_util.tree_flatten(params)
  roles = jax.tree.leaves(ROLES)
  out = []
  for i, (role, p) in enumerate(zip(roles, flat)):
    p = p.astype(np.float64)
    if role == "bias":
      out.append(p)
      continue
    m = v = np.zeros_like(p)
    for t, grads in enumerate(grads_seq, start=1):
      g = jax.tree.leaves(grads)[i].astype(np.float64)
      m, v = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g
      step = (m / (1 - B1 ** t)) / (np.sqrt(v / (1 - B2 ** t)) + EPS)
      p = p - LR * (step + (0.0 if role in model.NORMS else wd * p))
    out.append(p)
  return jax.tree_util.tree_unflatten(treedef, out)


@pytest.fixture(scope="module")
def tiny():
  rng = np.random.default_rng(0)
  return _tree(rng), [_tree(rng), _tree(rng)]


def _run(opt, params, grads_seq):
  step = jax.jit(opt.update)
  state = jax.jit(opt.init)(params)
  for g in grads_seq:
    params, state = step(g, state, params)
  return params


def test_unknown_optimizer():
  with pytest.raises(ValueError, match="unknown optimizer"):
    optim.make_optimizer("sgd", ROLES, 0.1)


def test_muon_roles():
  """Which leaves Muon takes and their matrix views, read off the declared roles."""
  assert ROLES["layers"]["attn"]["wq"] == "attn_q" and ROLES["layers"]["moe"]["wo"] == "expert_out"
  dims = lambda role: tuple(optim.muon_dims(role) or ())
  assert dims("expert_in") == ((1,), (2,))           # one layer [E, D, F]: batched over E
  assert dims("attn_kv") == ((0,), (1, 2))           # [D, KV*Dh]
  assert dims("attn_o") == ((0, 1), (2,))            # [H*Dh, D]
  assert dims("shared_out") == ((0,), (1,))
  for role in ("embed", "unembed", "final_norm", "attn_norm", "router", "bias"):
    assert dims(role) == () and role not in optim.MUON_ROLES


def test_adamw_matches_numpy(tiny):
  params, grads = tiny
  opt = optim.make_optimizer("adamw", ROLES, LR, weight_decay=WD, b1=B1, b2=B2, eps=EPS)
  got = _run(opt, params, grads)
  chex.assert_trees_all_close(got, _numpy_adamw(params, grads), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got["layers"]["moe"]["bias"], params["layers"]["moe"]["bias"])


def _newton_schulz(g, steps=5):
  """Reference Newton-Schulz (float64): the quintic on the wide orientation."""
  a, b, c = optim.NS_COEFFS
  x = g.astype(np.float64)
  x = x / (np.linalg.norm(x) + optim.NS_EPS)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


@pytest.mark.parametrize("shape", [(16, 32), (32, 16)])
def test_newton_schulz_singular_values(shape):
  g = np.random.default_rng(2).standard_normal((1,) + shape).astype(np.float32)
  tree = {"shared": {"wi_0": g}}                       # one layer of a stacked [L, D, Fs]
  roles = {"shared": {"wi_0": "shared_in"}}
  o = jax.jit(lambda t: optim.orthogonalize(roles).update(t, ())[0])(tree)["shared"]["wi_0"][0]
  assert o.shape == shape and o.dtype == np.float32
  np.testing.assert_allclose(o, _newton_schulz(g[0]), rtol=1e-4, atol=1e-6)
  s = np.linalg.svd(np.asarray(o), compute_uv=False)
  assert s.min() > 0.5 and s.max() < 1.5, s


def _muon_2d(g, p):
  """Expected first-step Muon update of one 2-D view (with weight decay)."""
  rows, cols = g.shape
  d = (1 + MU) * g  # Nesterov first step: m = g, direction = g + mu * m
  return -LR * (np.sqrt(max(1.0, cols / rows)) * _newton_schulz(d) + WD * p)   # fan_out/fan_in


def test_muon_matrix_views(tiny):
  params, g = tiny[0], tiny[1][0]
  opt = optim.make_optimizer("muon", ROLES, LR, weight_decay=WD, b1=B1, b2=B2, eps=EPS,
               muon_momentum=MU)
  new = _run(opt, params, [g])
  delta = jax.tree.map(lambda a, b: np.asarray(a) - b, new, params)
  lay, glay, play = delta["layers"], g["layers"], params["layers"]
  for i in range(L):                                   # each layer independently
    # experts: each expert matrix independently
    for name in ("wi_0", "wo"):
      want = np.stack([_muon_2d(glay["moe"][name][i, e], play["moe"][name][i, e])
              for e in range(E)])
      np.testing.assert_allclose(lay["moe"][name][i], want, rtol=1e-4, atol=1e-6)
    # attention: [D, H, Dh] as [D, H*Dh]; wo [H, Dh, D] as [H*Dh, D]
    want = _muon_2d(glay["attn"]["wq"][i].reshape(D, H * DH),
            play["attn"]["wq"][i].reshape(D, H * DH)).reshape(D, H, DH)
    np.testing.assert_allclose(lay["attn"]["wq"][i], want, rtol=1e-4, atol=1e-6)
    want = _muon_2d(glay["attn"]["wo"][i].reshape(H * DH, D),
            play["attn"]["wo"][i].reshape(H * DH, D)).reshape(H, DH, D)
    np.testing.assert_allclose(lay["attn"]["wo"][i], want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(lay["shared"]["wi_1"][i],
                 _muon_2d(glay["shared"]["wi_1"][i], play["shared"]["wi_1"][i]),
                 rtol=1e-4, atol=1e-6)
  # AdamW leaves match the numpy reference; the bias never moves
  ref = _numpy_adamw(params, [g])
  for k in ("embed", "unembed", "final_norm"):
    np.testing.assert_allclose(new[k], ref[k], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new["layers"]["moe"]["router"], ref["layers"]["moe"]["router"],
               rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(lay["moe"]["bias"], 0.0)


def test_muon_nesterov_momentum_two_steps():
  """Step 2 orthogonalises g2 + mu * (mu * g1 + g2) (momentum m = mu * m + g)."""
  rng = np.random.default_rng(4)
  p, g1, g2 = (rng.standard_normal((1, FS, D)).astype(np.float32) for _ in range(3))
  opt = optim.make_optimizer("muon", {"shared": {"wo": "shared_out"}}, LR, weight_decay=0.0,
               muon_momentum=MU)
  tree = lambda x: {"shared": {"wo": x}}
  got = _run(opt, tree(p), [tree(g1), tree(g2)])["shared"]["wo"][0]
  p, g1, g2 = p[0], g1[0], g2[0]
  scale = np.sqrt(max(1.0, D / FS))
  p1 = p - LR * scale * _newton_schulz((1 + MU) * g1)
  want = p1 - LR * scale * _newton_schulz(g2 + MU * (MU * g1 + g2))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_muon_sharded_matches_unsharded_and_collectives():
  mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(AxisType.Explicit,) * 2)
  rng = np.random.default_rng(3)
  r = lambda *s: rng.standard_normal(s).astype(np.float32)
  roles = {"moe": {"wi_0": "expert_in"}, "shared": {"wi_0": "shared_in"}}
  specs = {"moe": {"wi_0": P(None, ("expert", "fsdp"), None, None)},    # [L, E@(e,f), D, F]
      "shared": {"wi_0": P(None, "fsdp", None)}}                   # [L, D@f, Fs]
  tree = lambda: {"moe": {"wi_0": r(1, 8, 4, 6)}, "shared": {"wi_0": r(1, 16, 8)}}
  params, grads = tree(), tree()
  opt = optim.make_optimizer("muon", roles, LR, weight_decay=WD, muon_momentum=MU)
  put = lambda t, sp: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, sp)

  def step(g, p):
    return opt.update(g, opt.init(p), p)[0]

  want = jax.jit(step)(grads, params)
  got = jax.jit(step)(put(grads, specs), put(params, specs))
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  assert got["moe"]["wi_0"].sharding.spec == specs["moe"]["wi_0"]

  def stats(key):
    sub_opt = optim.make_optimizer("muon", {key: roles[key]}, LR, weight_decay=WD,
                   muon_momentum=MU)
    sub_step = lambda g, p: sub_opt.update(g, sub_opt.init(p), p)[0]
    args = [put({key: t[key]}, {key: specs[key]}) for t in (grads, params)]
    return hlo.collective_stats(jax.jit(sub_step).lower(*args).compile().as_text())

  expert_stats = stats("moe")
  assert all(s["count"] == 0 for s in expert_stats.values()), expert_stats
  assert stats("shared")["all-gather"]["count"] >= 1


def test_muon_on_stage_sharded_layers():
  """pp stores layer params [L@stage, ...]: Newton-Schulz maps over each stage's own layers
  (a shard_map manual over stage), with the same result as on one device and no collective."""
  mesh = jax.make_mesh((2, 4), ("stage", "expert"), axis_types=(AxisType.Explicit,) * 2)
  rng = np.random.default_rng(4)
  r = lambda *s: rng.standard_normal(s).astype(np.float32)
  roles = {"moe": {"wi_0": "expert_in"}, "attn": {"wq": "attn_q"}}
  specs = {"moe": {"wi_0": P("stage", "expert", None, None)},          # [L@stage, E@e, D, F]
      "attn": {"wq": P("stage", None, None, None)}}                # [L@stage, D, H, Dh]
  tree = lambda: {"moe": {"wi_0": r(2, 8, 4, 6)}, "attn": {"wq": r(2, 8, 2, 3)}}
  params, grads = tree(), tree()
  opt = optim.make_optimizer("muon", roles, LR, weight_decay=WD, muon_momentum=MU)
  put = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, specs)

  def step(g, p):
    return opt.update(g, opt.init(p), p)[0]

  want = jax.jit(step)(grads, params)
  with jax.set_mesh(mesh):
    compiled = jax.jit(step).lower(put(grads), put(params)).compile()
    got = compiled(put(grads), put(params))
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  assert got["attn"]["wq"].sharding.spec == specs["attn"]["wq"]
  stats = hlo.collective_stats(compiled.as_text())
  assert all(v["count"] == 0 for v in stats.values()), stats
