"""Tests for common.optim: AdamW vs numpy, Newton-Schulz vs numpy, Muon views, momentum and
sharding."""

import chex
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from common import hlo, optim

V, D, H, KV, DH, E, F, FS = 8, 4, 2, 1, 3, 2, 6, 5
LR, WD, B1, B2, EPS, MU = 0.1, 0.05, 0.9, 0.95, 1e-8, 0.95


def _tree(rng, shared=True):
    """Tiny param tree with the model's structure (float32 numpy)."""
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    layer = {
        "attn_norm": r(D),
        "attn": {"wq": r(D, H, DH), "wk": r(D, KV, DH), "wv": r(D, KV, DH), "wo": r(H, DH, D)},
        "mlp_norm": r(D),
        "moe": {"router": r(D, E), "bias": r(E), "wi_0": r(E, D, F), "wi_1": r(E, D, F),
                "wo": r(E, F, D)},
    }
    if shared:
        layer["shared"] = {"wi_0": r(D, FS), "wi_1": r(D, FS), "wo": r(FS, D)}
    return {"embed": r(V, D), "layers": [layer, {**layer, "attn_norm": r(D)}],
            "final_norm": r(D), "unembed": r(D, V)}


def _numpy_adamw(params, grads_seq, wd=WD):
    """Reference AdamW (eps outside the sqrt, decoupled decay on ndim >= 2)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for i, (path, p) in enumerate(flat):
        p = p.astype(np.float64)
        if optim._is_frozen(path):
            out.append(p)
            continue
        m = v = np.zeros_like(p)
        for t, grads in enumerate(grads_seq, start=1):
            g = jax.tree.leaves(grads)[i].astype(np.float64)
            m, v = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g
            step = (m / (1 - B1 ** t)) / (np.sqrt(v / (1 - B2 ** t)) + EPS)
            p = p - LR * (step + (wd * p if p.ndim >= 2 else 0.0))
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
        optim.make_optimizer("sgd", 0.1)


def test_muon_kind():
    tree = _tree(np.random.default_rng(1))
    kinds = {jax.tree_util.keystr(p): optim.muon_kind(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}
    assert kinds["['layers'][0]['attn']['wq']"] == "matrix"
    assert kinds["['layers'][1]['attn']['wo']"] == "matrix"
    assert kinds["['layers'][0]['shared']['wo']"] == "matrix"
    assert kinds["['layers'][0]['moe']['wi_1']"] == "experts"
    for k in ("['embed']", "['unembed']", "['final_norm']", "['layers'][0]['attn_norm']",
              "['layers'][0]['moe']['router']", "['layers'][0]['moe']['bias']"):
        assert kinds[k] is None
    assert optim.muon_kind(("layers", 0, "moe", "wo")) == "experts"
    dims = lambda *path: tuple(optim.muon_dims(path) or ())
    assert dims("layers", 0, "moe", "wi_0") == ((1,), (2,))      # batched over E
    assert dims("layers", 0, "attn", "wk") == ((0,), (1, 2))     # [D, KV*Dh]
    assert dims("layers", 0, "attn", "wo") == ((0, 1), (2,))     # [H*Dh, D]
    assert dims("layers", 0, "shared", "wo") == ((0,), (1,))
    assert dims("layers", 0, "moe", "router") == ()


def test_adamw_matches_numpy(tiny):
    params, grads = tiny
    opt = optim.make_optimizer("adamw", LR, weight_decay=WD, b1=B1, b2=B2, eps=EPS)
    got = _run(opt, params, grads)
    chex.assert_trees_all_close(got, _numpy_adamw(params, grads), rtol=1e-5, atol=1e-6)
    for i in range(2):
        np.testing.assert_array_equal(got["layers"][i]["moe"]["bias"],
                                      params["layers"][i]["moe"]["bias"])


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
    g = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    tree = {"shared": {"wi_0": g}}
    o = jax.jit(lambda t: optim.orthogonalize().update(t, ())[0])(tree)["shared"]["wi_0"]
    assert o.shape == shape and o.dtype == np.float32
    np.testing.assert_allclose(o, _newton_schulz(g), rtol=1e-4, atol=1e-6)
    s = np.linalg.svd(np.asarray(o), compute_uv=False)
    assert s.min() > 0.5 and s.max() < 1.5, s


def _muon_2d(g, p):
    """Expected first-step Muon update of one 2-D view (with weight decay)."""
    rows, cols = g.shape
    d = (1 + MU) * g  # Nesterov first step: m = g, direction = g + mu * m
    return -LR * (np.sqrt(max(1.0, cols / rows)) * _newton_schulz(d) + WD * p)   # fan_out/fan_in


def test_muon_matrix_views(tiny):
    one_layer = lambda t: {**t, "layers": t["layers"][:1]}  # halves the compile
    params, g = one_layer(tiny[0]), one_layer(tiny[1][0])
    opt = optim.make_optimizer("muon", LR, weight_decay=WD, b1=B1, b2=B2, eps=EPS,
                               muon_momentum=MU)
    new = _run(opt, params, [g])
    delta = jax.tree.map(lambda a, b: np.asarray(a) - b, new, params)
    lay, glay, play = delta["layers"][0], g["layers"][0], params["layers"][0]
    # experts: each expert matrix independently
    for name in ("wi_0", "wo"):
        want = np.stack([_muon_2d(glay["moe"][name][e], play["moe"][name][e])
                         for e in range(E)])
        np.testing.assert_allclose(lay["moe"][name], want, rtol=1e-4, atol=1e-6)
    # attention: [D, H, Dh] as [D, H*Dh]; wo [H, Dh, D] as [H*Dh, D]
    want = _muon_2d(glay["attn"]["wq"].reshape(D, H * DH),
                    play["attn"]["wq"].reshape(D, H * DH)).reshape(D, H, DH)
    np.testing.assert_allclose(lay["attn"]["wq"], want, rtol=1e-4, atol=1e-6)
    want = _muon_2d(glay["attn"]["wo"].reshape(H * DH, D),
                    play["attn"]["wo"].reshape(H * DH, D)).reshape(H, DH, D)
    np.testing.assert_allclose(lay["attn"]["wo"], want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(lay["shared"]["wi_1"], _muon_2d(glay["shared"]["wi_1"], play["shared"]["wi_1"]),
                               rtol=1e-4, atol=1e-6)
    # AdamW leaves match the numpy reference; the bias never moves
    ref = _numpy_adamw(params, [g])
    for k in ("embed", "unembed", "final_norm"):
        np.testing.assert_allclose(new[k], ref[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["layers"][0]["moe"]["router"],
                               ref["layers"][0]["moe"]["router"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(lay["moe"]["bias"], 0.0)


def test_muon_nesterov_momentum_two_steps():
    """Step 2 orthogonalises g2 + mu * (mu * g1 + g2) (momentum m = mu * m + g)."""
    rng = np.random.default_rng(4)
    p, g1, g2 = (rng.standard_normal((FS, D)).astype(np.float32) for _ in range(3))
    opt = optim.make_optimizer("muon", LR, weight_decay=0.0, muon_momentum=MU)
    tree = lambda x: {"shared": {"wo": x}}
    got = _run(opt, tree(p), [tree(g1), tree(g2)])["shared"]["wo"]
    scale = np.sqrt(max(1.0, D / FS))
    p1 = p - LR * scale * _newton_schulz((1 + MU) * g1)
    want = p1 - LR * scale * _newton_schulz(g2 + MU * (MU * g1 + g2))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_muon_sharded_matches_unsharded_and_collectives():
    mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(3)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    experts = lambda: {"layers": [{"moe": {"wi_0": r(8, 4, 6)}}]}
    matrix = lambda: {"layers": [{"shared": {"wi_0": r(16, 8)}}]}
    specs = {"layers": [{"moe": {"wi_0": P(("expert", "fsdp"), None, None)},
                         "shared": {"wi_0": P("fsdp", None)}}]}
    params = {"layers": [{**experts()["layers"][0], **matrix()["layers"][0]}]}
    grads = {"layers": [{**experts()["layers"][0], **matrix()["layers"][0]}]}
    opt = optim.make_optimizer("muon", LR, weight_decay=WD, muon_momentum=MU)
    put = lambda t: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, specs)

    def step(g, p):
        return opt.update(g, opt.init(p), p)[0]

    want = jax.jit(step)(grads, params)
    got = jax.jit(step)(put(grads), put(params))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert got["layers"][0]["moe"]["wi_0"].sharding.spec == specs["layers"][0]["moe"]["wi_0"]

    def stats(key):
        sub = lambda t: {"layers": [{key: t["layers"][0][key]}]}
        sub_specs = sub(specs)
        args = [jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), sub(t),
                             sub_specs) for t in (grads, params)]
        return hlo.collective_stats(jax.jit(step).lower(*args).compile().as_text())

    expert_stats = stats("moe")
    assert all(s["count"] == 0 for s in expert_stats.values()), expert_stats
    assert stats("shared")["all-gather"]["count"] >= 1
