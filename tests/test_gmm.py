"""Tests for modeling/gmm.py (every backend vs a numpy loop reference, the kernel registry) and
kernels/mgpu.py (the Hopper glue and tile autotuner, with stand-in kernels on CPU)."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import mgpu as mgpu_lib
from modeling import gmm as gmm_lib

M, K, N, E = 24, 8, 6, 4
# Uneven sizes with an empty group; the first leaves a padded tail (sum 17 < 24).
GROUP_SIZES = [np.array([5, 0, 9, 3], np.int32), np.array([0, 7, 10, 7], np.int32)]


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w = rng.standard_normal((E, K, N)).astype(np.float32)
  ct = rng.standard_normal((M, N)).astype(np.float32)  # nonzero in the tail too
  return x, w, ct


def _reference(x, w, gs, ct):
  """Loop reference for y, dx = ct @ w^T and dw = x^T ct, per group (float64)."""
  x, w, ct = (a.astype(np.float64) for a in (x, w, ct))
  y, dx, dw = np.zeros((M, N)), np.zeros((M, K)), np.zeros((E, K, N))
  start = 0
  for e, size in enumerate(gs):
    rows = slice(start, start + size)
    y[rows] = x[rows] @ w[e]
    dx[rows] = ct[rows] @ w[e].T
    dw[e] = x[rows].T @ ct[rows]
    start += size
  return y, dx, dw


@functools.cache
def _fwd_bwd(backend, **kw):
  """Jitted (x, w, gs, ct) -> (y, dx, dw); group_sizes is traced so values share a compile."""

  def f(x, w, gs, ct):
    y, vjp = jax.vjp(lambda x, w: gmm_lib.gmm(x, w, gs, backend=backend, **kw), x, w)
    return (y, *vjp(ct))

  return jax.jit(f)


CASES = [
    ("ragged_dot", {}),
    ("padded", {}),
    ("padded", {"capacity": 10}),  # capacity = max group size: nothing dropped
    ("custom", {"kernel": "ragged_dot", "wgrad": "ragged_dot_general"}),
    ("custom", {"kernel": "ragged_dot", "wgrad": "segment"}),
    ("scan", {}),
]


@pytest.mark.parametrize("backend,kw", CASES, ids=lambda c: str(c))
def test_matches_reference(backend, kw):
  x, w, ct = _data()
  f = _fwd_bwd(backend, **kw)
  for gs in GROUP_SIZES:
    with jax.default_matmul_precision("highest"):  # no TF32 if run on a GPU
      y, dx, dw = f(x, w, jnp.asarray(gs), ct)
    ref_y, ref_dx, ref_dw = _reference(x, w, gs, ct)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-5)
    total = int(gs.sum())
    np.testing.assert_array_equal(y[total:], 0)
    np.testing.assert_array_equal(dx[total:], 0)
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32


def test_custom_dtypes():
  """bf16 inputs with f32 output: cotangents keep the input dtypes."""
  x, w, ct = _data(1)
  x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  gs = jnp.asarray(GROUP_SIZES[0])
  f = jax.jit(lambda x, w, ct: jax.vjp(
      lambda x, w: gmm_lib.gmm(x, w, gs, backend="custom", kernel="ragged_dot",
                               preferred_element_type=jnp.float32), x, w)[1](ct))
  y = gmm_lib.gmm(x, w, gs, backend="custom", preferred_element_type=jnp.float32)
  dx, dw = f(x, w, ct)
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)


def test_backend_names():
  assert gmm_lib.available_backends() == ["ragged_dot", "padded", "custom", "scan"]
  assert gmm_lib.resolve_backend("padded") == "padded"
  assert gmm_lib.resolve_backend("auto") == "ragged_dot"           # the checked default, always
  with pytest.raises(ValueError, match="unknown gmm backend"):
    gmm_lib.resolve_backend("cutlass")
  assert gmm_lib.resolve_wgrad("auto") in gmm_lib.available_wgrads()
  x, w, _ = _data()
  gs = jnp.asarray(GROUP_SIZES[0])
  for kw in [{"backend": "nope"}, {"backend": "custom", "kernel": "nope"},
             {"backend": "custom", "wgrad": "nope"}]:
    with pytest.raises(ValueError, match="unknown gmm"):
      gmm_lib.gmm(x, w, gs, **kw)


def test_kernel_registry(monkeypatch):
  """modeling.gmm's kernel table: a registered kernel is used by name only ("auto" stays
  ragged_dot, whatever is registered); an unavailable one is still usable by name."""
  calls = []

  def toy(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs=False):
    calls.append(transpose_rhs)
    return gmm_lib.ragged_dot_kernel(lhs, rhs, group_sizes, out_dtype=out_dtype,
                                     transpose_rhs=transpose_rhs)

  assert "mgpu" in gmm_lib._KERNELS and "mgpu" in gmm_lib._WGRADS  # registered by kernels/
  monkeypatch.setitem(gmm_lib._KERNELS, "toy", (toy, lambda: True))
  assert gmm_lib.available_kernels()[-1] == "toy"
  assert gmm_lib.resolve_kernel("auto") == "ragged_dot" and gmm_lib.resolve_backend("auto") == "ragged_dot"
  x, w, ct = _data()
  gs = jnp.asarray(GROUP_SIZES[0])
  with jax.default_matmul_precision("highest"):
    y, vjp = jax.vjp(lambda x, w: gmm_lib.gmm(x, w, gs, backend="custom", kernel="toy"), x, w)
    dx, dw = vjp(ct)
  assert calls == [False, True]                               # forward, then dx
  for got, want in zip((y, dx, dw), _reference(x, w, GROUP_SIZES[0], ct)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  monkeypatch.setitem(gmm_lib._KERNELS, "toy", (toy, lambda: False))
  assert "toy" not in gmm_lib.available_kernels() and gmm_lib.resolve_kernel("toy") == "toy"
  assert gmm_lib.resolve_kernel("auto") != "toy"


def test_kernels_are_opt_in():
  """modeling.gmm never imports the `kernels` package: "mgpu" is registered only when a
  caller imports kernels.mgpu (command_line.py for --gmm=mgpu), and on CPU that imports no
  Pallas GPU module."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = ("import sys; from modeling import gmm\n"
          "print(gmm.available_kernels(), sorted(gmm._KERNELS), sorted(gmm._WGRADS))\n"
          "assert 'kernels' not in sys.modules\n"
          "try:\n  gmm.resolve_backend('mgpu')\nexcept ValueError as e:\n  print(e)\n"
          "import kernels.mgpu\n"
          "print(gmm.available_kernels(), sorted(gmm._KERNELS), gmm.resolve_backend('mgpu'))\n"
          "assert not [m for m in sys.modules if 'pallas.ops.gpu' in m]\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                       text=True, timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split("\n")[:3] == [
      "['ragged_dot'] ['ragged_dot'] ['ragged_dot_general', 'segment']",
      "gmm backend 'mgpu' needs kernels/mgpu.py: import kernels.mgpu first (run.py does for "
      "--gmm=mgpu)",
      "['ragged_dot'] ['mgpu', 'ragged_dot'] mgpu"], out.stdout


def test_mgpu_plumbing_traces(monkeypatch):
  """Traces (no run) the mgpu kernel path on any platform: fwd and dx go through the kernel.

  The "mgpu" wgrad cannot be traced on CPU (it reads the GPU core count).
  """
  pytest.importorskip("jax.experimental.pallas.ops.gpu.ragged_dot_mgpu")
  monkeypatch.setattr(mgpu_lib, "_mgpu_module", mgpu_lib._mgpu_module.__wrapped__)
  monkeypatch.setattr(mgpu_lib, "_on_hopper", lambda: True)
  spec = jax.ShapeDtypeStruct
  x, w = spec((256, 256), jnp.bfloat16), spec((4, 256, 384), jnp.bfloat16)
  gs, ct = spec((4,), jnp.int32), spec((256, 384), jnp.float32)

  def f(x, w, gs, ct):
    y, vjp = jax.vjp(lambda x, w: gmm_lib.gmm(
        x, w, gs, backend="custom", kernel="mgpu", wgrad="ragged_dot_general",
        preferred_element_type=jnp.float32), x, w)
    return (y, *vjp(ct))

  jaxpr = jax.make_jaxpr(f)(x, w, gs, ct)
  assert str(jaxpr).count("ragged_dot_general[") == 1  # only the weight gradient
  assert [(a.shape, a.dtype) for a in jaxpr.out_avals] == [
      ((256, 384), jnp.float32), ((256, 256), jnp.bfloat16), ((4, 256, 384), jnp.bfloat16)]


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="ragged_dot_mgpu needs a GPU")
def test_mgpu_kernel_matches_ragged_dot():
  if "mgpu" not in gmm_lib.available_kernels():
    pytest.skip("ragged_dot_mgpu unavailable (needs a Hopper GPU)")
  m, k, n, e = 512, 256, 256, 4
  gs = jnp.asarray([100, 0, 250, 90], jnp.int32)  # sum 440 < 512
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((e, k, n)) / 16, jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)

  def run(**kw):                               # traced: numpy only on what jit returns
    y, vjp = jax.vjp(lambda x, w: gmm_lib.gmm(x, w, gs, **kw), x, w)
    return (y, *vjp(ct))

  host = lambda out: [np.asarray(a, np.float32) for a in out]
  want = host(jax.jit(lambda: run(backend="ragged_dot"))())
  for wgrad in ["ragged_dot_general", "mgpu"]:
    got = host(jax.jit(lambda: run(backend="custom", kernel="mgpu", wgrad=wgrad))())
    for g, r in zip(got, want):
      np.testing.assert_allclose(g, r, rtol=2e-2, atol=2e-1)
    np.testing.assert_array_equal(got[0][440:], 0)
    np.testing.assert_array_equal(got[1][440:], 0)
  assert gmm_lib.resolve_backend("mgpu") == "mgpu"


def test_custom_backend_inside_strategy_matches_reference():
  """The custom_vjp backend (the GPU path; kernel = ragged_dot here) inside a strategy's MoE
  shard_map, against the single-device reference: experts replicated over an axis the tokens
  vary over (tp: data; the expert F is split over tensor, so w varies over tensor only) need dw
  psum'd over it. Regression: the bwd returned a varying dw for an invariant w, and tracing
  failed with a manual-axis type error (dp, fsdp, cp, ep_tp hit the same case; one compile here
  keeps the suite fast)."""
  from modeling.config import get_config
  from tests import parity
  parity.check("tp", get_config("tiny", gmm_backend="custom"), "data:4,tensor:2")


class _FakeMgpu:
  """Stands in for jax.experimental.pallas.ops.gpu.{ragged_dot_mgpu, transposed_ragged_dot_mgpu}
  on CPU, with the real signatures and shape checks, computed by ragged_dot. Like the real
  kernels it leaves the output tail rows unwritten (NaN here) and reads x/dy tail rows into the
  last group's tiles, so the glue's masking is what keeps results right."""

  @staticmethod
  def ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps,
                 grid_block_n, transpose_rhs=False, load_group_sizes_to_register=True):
    del block_m, max_concurrent_steps, load_group_sizes_to_register
    assert lhs.dtype == rhs.dtype == jnp.bfloat16
    rhs = rhs.transpose(0, 2, 1) if transpose_rhs else rhs
    (m, k), n = lhs.shape, rhs.shape[2]
    assert k % block_k == 0 and n % block_n == 0 and (n // block_n) % grid_block_n == 0
    y = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return jnp.where(jnp.arange(m)[:, None] < group_sizes.sum(), y, jnp.nan).astype(lhs.dtype)

  @staticmethod
  def transposed_ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k,
                            max_concurrent_steps, grid_block_n):
    del block_k, max_concurrent_steps, grid_block_n
    assert lhs.dtype == rhs.dtype == jnp.bfloat16
    assert lhs.shape[1] % block_m == 0 and rhs.shape[1] % block_n == 0
    leaky = group_sizes.at[-1].add(lhs.shape[0] - group_sizes.sum())  # tail -> last group
    return jax.lax.ragged_dot_general(lhs, rhs, leaky, gmm_lib._WGRAD_DIMS,
                                      preferred_element_type=jnp.float32).astype(lhs.dtype)


def test_mgpu_glue_numerics_with_fake_kernels(monkeypatch):
  """The mgpu path's glue (tile checks, transposed weights for dx, tail masking, dtype casts)
  runs on CPU with the Hopper kernels replaced by _FakeMgpu, against the ragged_dot backend."""
  monkeypatch.setattr(mgpu_lib, "_mgpu_module", lambda *a, **k: _FakeMgpu)
  assert gmm_lib.available_kernels() == ["ragged_dot", "mgpu"]
  assert gmm_lib.resolve_backend("auto") == "ragged_dot"            # mgpu is opt-in
  m, k, n = 256, 128, 256
  gs = jnp.asarray([60, 0, 100, 50], jnp.int32)          # sum 210 < 256: a 46-row tail
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4, k, n)) / 16, jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def run(**kw):
    y, vjp = jax.vjp(lambda x, w: gmm_lib.gmm(x, w, gs, preferred_element_type=jnp.float32,
                                              **kw), x, w)
    return [np.asarray(a, np.float32) for a in (y, *vjp(ct))]

  want = run(backend="ragged_dot")
  for wgrad in ("mgpu", "ragged_dot_general"):
    got = run(backend="custom", kernel="mgpu", wgrad=wgrad)
    for g, r, name in zip(got, want, ("y", "dx", "dw")):
      np.testing.assert_allclose(g, r, rtol=2e-2, atol=5e-2, err_msg=f"{wgrad} {name}")
    np.testing.assert_array_equal(got[0][210:], 0)
    np.testing.assert_array_equal(got[1][210:], 0)


def test_autotune_table_reaches_the_kernels(monkeypatch, tmp_path):
  """autotune (fake Hopper kernels) writes one entry per kernel call; gmm then hands exactly
  those tiles to the kernels. Candidates that do not divide the shape are never tried."""
  seen = []

  class Recording(_FakeMgpu):
    @staticmethod
    def ragged_dot(lhs, rhs, *, transpose_rhs=False, **kw):
      seen.append(("dx" if transpose_rhs else "fwd", kw["block_n"], kw["block_k"]))
      return _FakeMgpu.ragged_dot(lhs, rhs, transpose_rhs=transpose_rhs, **kw)

    @staticmethod
    def transposed_ragged_dot(lhs, rhs, **kw):
      seen.append(("wgrad", kw["block_n"], kw["block_m"]))
      return _FakeMgpu.transposed_ragged_dot(lhs, rhs, **kw)

  monkeypatch.setattr(mgpu_lib, "_mgpu_module", lambda *a, **k: Recording)
  monkeypatch.setattr(mgpu_lib, "TILES_FILE", str(tmp_path / "tiles.json"))
  cands = [dict(block_m=64, block_n=64, block_k=32, max_concurrent_steps=2),
           dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4),
           dict(block_m=512, block_n=512, block_k=512, max_concurrent_steps=2)]  # never fits
  e, m, k, n = 4, 256, 128, 192                        # n = 192: block_n 128 does not divide it
  table = mgpu_lib.autotune([(e, m, k, n)], jnp.bfloat16, 1, mgpu_lib.TILES_FILE, cands,
                            log=lambda s: None)
  assert not [s for s in seen if 512 in s]
  fwd, dx, wgrad = (mgpu_lib.tile_key(kind, e, m, a, b, jnp.bfloat16)
                    for kind, a, b in (("fwd", k, n), ("dx", n, k), ("wgrad", k, n)))
  assert set(table) == {fwd, dx, wgrad}, table
  assert table[fwd] == table[wgrad] == cands[0], table   # block_n 128 does not divide N = 192
  assert table[dx] in cands[:2], table                   # both divide dx's (A, B) = (192, 128)
  seen.clear()
  gs = jnp.asarray([64, 64, 64, 64], jnp.int32)
  x = jnp.ones((m, k), jnp.bfloat16)
  w = jnp.ones((e, k, n), jnp.bfloat16)
  jax.grad(lambda x, w: jnp.sum(gmm_lib.gmm(x, w, gs, backend="mgpu")),
           argnums=(0, 1))(x, w)
  dx_cfg = table[dx]
  assert sorted(seen) == sorted([("fwd", 64, 32), ("dx", dx_cfg["block_n"], dx_cfg["block_k"]),
                                 ("wgrad", 64, 64)]), seen


def test_scan_backend_parity_in_a_strategy():
  """--gmm=scan (the compile-only memory backend) inside a sharded step: the reference's
  losses, gradients and updates (its weights arrive typed reduced in fsdp's shard_map)."""
  from modeling.config import get_config
  from tests import parity
  parity.check("fsdp", get_config("tiny", gmm_backend="scan"), "data:2,fsdp:4", steps=2)
