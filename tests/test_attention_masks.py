"""Tests for attend()'s sliding window (gpt-oss), chunked local attention (Llama 4) and attention
sinks (gpt-oss): impl="chunked" and its ordered path against the impl="xla" oracle (outputs and
gradients of q, k, v, sinks, and MLA's q_r, k_r), the oracle against a numpy transcription of
transformers' gpt-oss eager attention, the ordered path's skipped pairs, ring attention, and
the dot_product_attention wrappers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from modeling import attention
from modeling.attention import attend

# float32: |chunked - xla| <= RTOL * (|xla| + max |xla|), as in tests/test_attention.py
RTOL = 1e-6
BF16_L2 = 2e-2      # bf16: relative L2 error of o and each gradient

GQA = (2, 37, 2, 3, 16, 8, None)      # B, S = T, KV, G, Dq, Dv, Dr
MLA = (2, 37, 4, 1, 24, 16, 8)        # G = 1, decoupled RoPE Dr = 8, Dv != Dq
NAMES = ["o", "dq", "dk", "dv", "dsinks", "dq_r", "dk_r"]


def _sinks(kv, g, seed=1):
  """Non-zero sink logits [KV, G], one large (8) and one dominant (30: exp(30) outweighs every
  row's keys, so that head's outputs are ~0)."""
  s = np.random.default_rng(seed).standard_normal((kv, g)) * 2
  s.flat[0], s.flat[-1] = 8.0, 30.0
  return jnp.asarray(s, jnp.float32)


def _data(shape, dtype=jnp.float32, seed=0):
  """q, k, v, sinks, q_r, k_r (None without Dr), positions 0..S-1 [B, S] and the loss weights
  w ~ o."""
  b, s, kv, g, dq, dv, dr = shape
  rng = np.random.default_rng(seed)
  f = lambda *sh: jnp.asarray(rng.standard_normal(sh), dtype)
  args = [f(b, s, kv, g, dq), f(b, s, kv, dq), f(b, s, kv, dv), _sinks(kv, g)]
  args += [f(b, s, kv, g, dr), f(b, s, dr)] if dr else [None, None]
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  return args, pos, f(b, s, kv, g, dv)


@functools.partial(jax.jit, static_argnames=("impl", "chunk", "ordered", "window",
                                             "local_chunk", "use_sinks"))
def _value_and_grads(q, k, v, sinks, q_r, k_r, pos, w, *, impl, chunk, ordered=False, window=0,
                     local_chunk=0, use_sinks=False):
  """(o, grads of sum(o * w) w.r.t. q, k, v, sinks (zeros without), q_r, k_r (if any))."""
  scale = float(q.shape[-1] + (0 if q_r is None else q_r.shape[-1])) ** -0.5

  def loss(q, k, v, sinks, q_r, k_r):
    o = attend(q, k, v, pos, pos, scale, impl, chunk, q_r, k_r, ordered, window=window,
               local_chunk=local_chunk, sinks=sinks if use_sinks else None)
    return jnp.sum(o.astype(jnp.float32) * w.astype(jnp.float32)), o
  argnums = (0, 1, 2, 3) if q_r is None else (0, 1, 2, 3, 4, 5)
  (_, o), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(q, k, v, sinks, q_r,
                                                                         k_r)
  return o, grads


def _run(shape, impl, chunk=8, ordered=False, dtype=jnp.float32, window=0, local_chunk=0,
         use_sinks=False):
  """[o, dq, dk, dv, dsinks (, dq_r, dk_r)] as float64 numpy."""
  args, pos, w = _data(shape, dtype)
  o, grads = _value_and_grads(*args, pos, w, impl=impl, chunk=chunk, ordered=ordered,
                              window=window, local_chunk=local_chunk, use_sinks=use_sinks)
  assert o.dtype == dtype
  return [np.asarray(x, np.float64) for x in (o, *grads)]


def _check_f32(got, want, rtol=RTOL):
  for name, a, b in zip(NAMES, got, want):
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
    print(f"{name}: max |chunked - xla| / max |xla| = {err:.2e}")
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max(), err_msg=name)


# window 11 and local chunk 12: neither a multiple of the chunks 5 or 8, nor divides S = 37
CASES = {
    "window": dict(window=11),
    "local_chunk": dict(local_chunk=12),
    "sinks": dict(use_sinks=True),
    "window_sinks": dict(window=11, use_sinks=True),
    "window_local_sinks": dict(window=6, local_chunk=16, use_sinks=True),
}


@functools.lru_cache(maxsize=None)
def _oracle(shape, case):
  return _run(shape, "xla", **CASES[case])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [5, 8, 37])
@pytest.mark.parametrize("ordered", [False, True], ids=["all", "ordered"])
def test_matches_xla_f32(case, chunk, ordered):
  """GQA, S = T = 37: outputs and gradients of q, k, v and sinks (dsinks: 0 without sinks)."""
  _check_f32(_run(GQA, "chunked", chunk, ordered, **CASES[case]), _oracle(GQA, case))


@pytest.mark.parametrize("case", ["window_sinks", "local_chunk"])
@pytest.mark.parametrize("ordered", [False, True], ids=["all", "ordered"])
def test_mla_matches_xla_f32(case, ordered):
  """MLA-like call (decoupled RoPE q_r, k_r; Dv != Dq): gradients of q_r and k_r too."""
  _check_f32(_run(MLA, "chunked", 8, ordered, **CASES[case]), _oracle(MLA, case))


def test_bf16_window_sinks():
  """bf16 inputs (float32 scores, statistics, sinks): relative L2 error, ordered path."""
  got = _run(GQA, "chunked", 8, True, jnp.bfloat16, window=11, use_sinks=True)
  want = _run(GQA, "xla", 8, False, jnp.bfloat16, window=11, use_sinks=True)
  for name, a, b in zip(NAMES, got, want):
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    print(f"bf16 {name}: |chunked - xla| / |xla| = {err:.2e}")
    assert err < BF16_L2, (name, err)


def _gpt_oss_eager(q, k, v, sinks, scale, window):
  """transformers' gpt-oss eager_attention_forward in numpy (float64), its own layout: heads
  H = KV x G, K/V repeated per query head (repeat_kv), the causal sliding-window mask added as
  the dtype's min, the sinks [H] concatenated as a last column, softmax, that column dropped.
  q [B, S, H, D], k, v [B, T, KV, D] -> [B, S, H, D]."""
  b, s, h, _ = q.shape
  rep = h // k.shape[2]
  key = np.repeat(k.transpose(0, 2, 1, 3), rep, axis=1)                     # [B, H, T, D]
  val = np.repeat(v.transpose(0, 2, 1, 3), rep, axis=1)                     # [B, H, T, D]
  weights = q.transpose(0, 2, 1, 3) @ key.transpose(0, 1, 3, 2) * scale      # [B, H, S, T]
  i, j = np.arange(s)[:, None], np.arange(s)[None, :]
  allowed = (j <= i) & (i - j < window)
  weights = weights + np.where(allowed, 0.0, np.finfo(np.float64).min)
  sink = np.broadcast_to(sinks.reshape(1, h, 1, 1), (b, h, s, 1))
  combined = np.concatenate([weights, sink], axis=-1)
  combined = combined - combined.max(axis=-1, keepdims=True)
  probs = np.exp(combined) / np.exp(combined).sum(axis=-1, keepdims=True)
  return (probs[..., :-1] @ val).transpose(0, 2, 1, 3)                       # [B, S, H, D]


def test_oracle_matches_gpt_oss_eager():
  """impl="xla" with window and sinks is transformers' gpt-oss eager attention: its heads are
  q's (KV, G) flattened KV-major, its sinks [H] the [KV, G] sinks flattened the same way."""
  (q, k, v, sinks, _, _), pos, _ = _data(GQA)
  b, s, kv, g, d = q.shape
  got = attend(q, k, v, pos, pos, 0.25, "xla", window=11, sinks=sinks)       # [B, S, KV, G, Dv]
  f64 = lambda x: np.asarray(x, np.float64)
  want = _gpt_oss_eager(f64(q).reshape(b, s, kv * g, d), f64(k), f64(v), f64(sinks).ravel(),
                        0.25, 11)
  np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask,clean", [(dict(window=6), 12), (dict(local_chunk=8), 8)],
                         ids=["window", "local_chunk"])
def test_ordered_skips_pairs_outside_the_window(mask, clean):
  """NaN keys and values in the first chunk (positions 0..3, chunk 4): window 6 -> query 12's
  first key is 7 (chunk 1), local chunk 8 -> query 8's is 8 (chunk 2); so the query blocks
  from position `clean` on never visit chunk 0, and the key chunks from there are visited only
  by those blocks. Their outputs, dq, dk and dv equal the oracle's on finite data (the pairs are
  skipped: a masked NaN would still give NaN); without ordered every row visits chunk 0."""
  args, pos, w = _data(GQA)
  run = lambda k, v, impl, ordered: _value_and_grads(
      args[0], k, v, *args[3:], pos, w, impl=impl, chunk=4, ordered=ordered, use_sinks=True,
      window=mask.get("window", 0), local_chunk=mask.get("local_chunk", 0))
  want = run(args[1], args[2], "xla", False)
  k, v = (a.at[:, :4].set(jnp.nan) for a in args[1:3])
  got = run(k, v, "chunked", True)
  for name, a, b in zip(NAMES, (got[0], *got[1][:3]), (want[0], *want[1][:3])):
    np.testing.assert_allclose(np.asarray(a[:, clean:]), np.asarray(b[:, clean:]), rtol=1e-5,
                               atol=1e-6, err_msg=name)
  assert np.isnan(np.asarray(run(k, v, "chunked", False)[0][:, clean:])).all()


@pytest.mark.parametrize("mask", [attention.Mask(), attention.Mask(window=20),
                                  attention.Mask(local_chunk=24),
                                  attention.Mask(window=13, local_chunk=32)], ids=str)
def test_ordered_spans_are_the_nonempty_pairs(mask):
  """_spans (which (query block, key chunk) pairs the ordered path visits, S = 64, chunk 8)
  against a brute-force mask: exactly the pairs with a visible key; with a window, at most
  ceil(window / C) + 1 chunks per block."""
  s, c = 64, 8
  n = s // c
  lo, hi = attention._spans(n, c, mask)
  p = np.arange(s)
  visible = np.asarray(attention._visible(p[:, None], p[None, :], mask))    # [S, T]
  nonempty = visible.reshape(n, c, n, c).any(axis=(1, 3))                    # [blocks, chunks]
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  np.testing.assert_array_equal(nonempty, (j >= lo[:, None]) & (j <= i))
  np.testing.assert_array_equal(nonempty, (i >= j) & (i <= hi[None, :]))
  if mask.window:
    assert (np.arange(n) - lo + 1).max() <= -(-mask.window // c) + 1


def test_sharded_sinks():
  """Under a data:2 x tensor:2 mesh, heads (KV) split over tensor and the sinks [KV, G] with
  them: the ordered path's values and gradients are the oracle's, each gradient typed with the
  sharding the oracle's autodiff gives it."""
  from layout import mesh as mesh_lib
  (q, k, v, sinks, _, _), pos, w = _data((2, 16, 2, 3, 8, 8, None))
  mesh = mesh_lib.make_mesh({"data": 2, "tensor": 2})
  with jax.set_mesh(mesh):
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    q, w = put(q, "data", None, "tensor"), put(w, "data", None, "tensor")
    k, v = put(k, "data", None, "tensor"), put(v, "data", None, "tensor")
    sinks, pos = put(sinks, "tensor"), put(pos, "data")
    results = [_value_and_grads(q, k, v, sinks, None, None, pos, w, impl=impl, chunk=4,
                                ordered=impl == "chunked", window=5, local_chunk=0,
                                use_sinks=True) for impl in ("chunked", "xla")]
  got, want = (jax.tree.leaves(r) for r in results)
  for a, b in zip(got, want):
    assert jax.typeof(a).sharding.spec == jax.typeof(b).sharding.spec, (jax.typeof(a),
                                                                         jax.typeof(b))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_dot_product_attention_wrapper():
  """impl="dpa_xla" (impl="cudnn"'s wrapper, run by XLA on CPU) takes the window and local
  chunk in its mask by true positions: the oracle's outputs and gradients."""
  for mask in (dict(window=11), dict(local_chunk=12)):
    got, want = (_run(GQA[:5] + (16, None), impl, **mask) for impl in ("dpa_xla", "xla"))
    for name, a, b in zip(NAMES, got, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{mask} {name}")


def test_refusals():
  (q, k, v, sinks, _, _), pos, _ = _data((1, 4, 2, 3, 8, 8, None))
  for impl in ("cudnn", "dpa_xla"):
    with pytest.raises(ValueError, match=f"attention impl {impl} takes no attention sinks"):
      attend(q, k, v, pos, pos, 1.0, impl, sinks=sinks)
  with pytest.raises(ValueError, match=r"sinks are \[KV, G\] = \(2, 3\) .*got \(6,\)"):
    attend(q, k, v, pos, pos, 1.0, sinks=sinks.reshape(6))
  with pytest.raises(ValueError, match="window and local_chunk are >= 0"):
    attend(q, k, v, pos, pos, 1.0, window=-1)


def _ring_grads(mask, balanced, mla=False, nan=False):
  """ring_attend on context:4 (GQA: x tensor:2, heads and sinks split over tensor) in the
  load-balanced order, S = 32 (half-chunks of 4 positions), chunk 4, and the xla oracle on the
  same tokens in position order: ([o, dq, dk, dv, dsinks (, dq_r, dk_r)] ring, .. oracle), the
  ring's put back in position order. nan: keys and values at positions 0..3 NaN for the ring
  (the oracle keeps them finite)."""
  from layout import context, mesh as mesh_lib
  n, s = 4, 32
  shape = (1, s, 2, 2, 8, 8, 4 if mla else None)
  args, pos, w = _data(shape)
  want = _value_and_grads(*args, pos, w, impl="xla", chunk=4, use_sinks=True, **mask)
  if nan:
    args[1], args[2] = (a.at[:, :4].set(jnp.nan) for a in args[1:3])
  q, k, v, sinks, q_r, k_r = args
  scale = float(shape[4] + (shape[6] or 0)) ** -0.5
  order = context.load_balance_order(s, n)                  # ranks' tokens, in device order
  mesh = mesh_lib.make_mesh({"context": n} if mla else {"context": n, "tensor": 2})
  heads = None if mla else "tensor"
  with jax.set_mesh(mesh):
    put = lambda x, *spec: jax.device_put(x[:, order], NamedSharding(mesh, P(None, "context",
                                                                             *spec)))
    q, w, k, v = (put(x, heads) for x in (q, w, k, v))
    p = put(pos)
    sinks = jax.device_put(sinks, NamedSharding(mesh, P(heads)))
    kv, expand = ((k, v), lambda kv, _: (*kv, None)) if k_r is None else (
        (k, v, put(k_r)), lambda kv, _: kv)
    q_r = None if q_r is None else put(q_r)

    @jax.jit
    def run(q, kv, sinks, q_r):
      def loss(q, kv, sinks, q_r):
        from modeling import ring_attention
        o = ring_attention.ring_attend(q, kv, (), expand, p, p, scale, 4, ("context",), q_r=q_r,
                                       balanced=balanced, sinks=sinks, **mask)
        return jnp.sum(o * w), o
      argnums = (0, 1, 2) if q_r is None else (0, 1, 2, 3)
      return jax.value_and_grad(loss, argnums=argnums, has_aux=True)(q, kv, sinks, q_r)

    (_, o), grads = run(q, kv, sinks, q_r)
  dq, dkv, dsinks = grads[:3]
  inv = np.argsort(order)
  back = lambda x: np.asarray(x, np.float64)[:, inv]
  got = [back(o), back(dq), back(dkv[0]), back(dkv[1]), np.asarray(dsinks, np.float64)]
  if mla:
    got += [back(grads[3]), back(dkv[2])]
  return got, [np.asarray(x, np.float64) for x in (want[0], *want[1])]


@pytest.mark.parametrize("mask,balanced,mla", [
    (dict(window=6), True, False), (dict(local_chunk=8), True, False),
    (dict(window=6, local_chunk=16), False, False), (dict(window=10), True, True)],
    ids=["window-balanced", "local-balanced", "window_local-ring", "window-balanced-mla"])
def test_ring_matches_xla(mask, balanced, mla):
  """ring_attend with sinks and a window / local chunk: outputs and gradients (q, k, v, sinks;
  MLA-like: q_r, k_r) are the oracle's."""
  got, want = _ring_grads(mask, balanced, mla)
  _check_f32(got, want)


def test_ring_balanced_skips_half_blocks_outside_the_window():
  """Window 4, NaN keys and values at positions 0..3 (rank 0's first half): queries from 8 on
  never see them (query 8's first key is 5), and keys from 8 on are seen only by those queries;
  balanced, their outputs and gradients are the oracle's, since no visit folds that half-block
  into them (masked, it would still give NaN); unbalanced, every block is folded whole."""
  got, want = _ring_grads(dict(window=4), True, nan=True)
  for name, a, b in zip(NAMES[:4], got, want):
    np.testing.assert_allclose(a[:, 8:], b[:, 8:], rtol=1e-5, atol=1e-6, err_msg=name)
  unbalanced, _ = _ring_grads(dict(window=4), False, nan=True)
  assert np.isnan(unbalanced[0][:, 8:]).all()
