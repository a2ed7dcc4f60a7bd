"""Benchmark of the grouped-matmul backends in modeling/gmm.py (and torch._grouped_mm).

Run from the repo root:  python bench/gmm.py [--shapes=mixtral,deepseek_skew] [--scale=1]

For each shape it times forward and forward+backward of every backend and
prints the best-of---iters ms (robust on a shared machine), TFLOP/s (useful FLOPs: 2*M*K*N forward, 3x that fwd+bwd) and the
fraction of a dense [M,K]@[K,N] matmul's TFLOP/s measured in the same run.
"*_skew" shapes send half the rows to expert 0 and split the rest evenly.
On CPU the shapes are divided by --scale (default 16) so the run stays short.
The "padded" backend runs with capacity = the largest group (rounded up to 8).
Backend "custom:<wgrad>" selects the weight-gradient reduction of "custom".
Backend "torch" (default where torch has torch._grouped_mm; CUDA if torch sees it, else CPU)
runs on the same data, after a check of its forward against lax.ragged_dot.

--autotune (Hopper only): kernels.mgpu.autotune on the chosen shapes (even groups): for each
Mosaic-GPU kernel call of the custom backend (fwd x@w, dx dy@w^T, wgrad x^T dy) it times every
tile config of kernels.mgpu.TILE_CANDIDATES that divides the shape and agrees with ragged_dot, and
writes the fastest to kernels/mgpu_tiles.json (merged), which kernels.mgpu reads. Commit the file.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import time  # pylint: disable=g-import-not-at-top

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kernels import mgpu
from measure import timing
from modeling import gmm as gmm_lib

SHAPES = {  # name: (E, M, K, N)
    "mixtral": (8, 16384, 4096, 14336),
    "deepseek": (64, 32768, 2048, 1408),
}

_SHAPES = flags.DEFINE_list(
    "shapes", ["mixtral", "deepseek", "mixtral_skew", "deepseek_skew"],
    "Shapes: mixtral, deepseek, with an optional _skew suffix.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["bf16", "f32"], "Default: bf16 on GPU, f32 on CPU.")
_ITERS = flags.DEFINE_integer("iters", None, "Timed iterations (default: 20 GPU, 5 CPU).")
_SCALE = flags.DEFINE_integer("scale", None, "Divides M, K, N (default: 1 GPU, 16 CPU).")
_AUTOTUNE = flags.DEFINE_bool("autotune", False, "Tune the Mosaic-GPU tiles per shape (Hopper).")
_BACKENDS = flags.DEFINE_list(
    "backends", None,
    "Subset of ragged_dot, padded, custom, custom:<wgrad>, torch (default: all available).")


def _on_cpu():
  return jax.default_backend() == "cpu"


def default_backends():
  names = gmm_lib.available_backends()
  if "mgpu" in gmm_lib.available_wgrads():
    names.append("custom:mgpu")
  if timing.grouped_mm_torch() is not None:
    names.append("torch")
  return names


def group_sizes_for(name, e, m):
  """Even split (remainder to the last group) or, with _skew, half the rows to group 0."""
  if name.endswith("_skew"):
    rest = m - m // 2
    sizes = [m // 2] + [rest // (e - 1)] * (e - 1)
  else:
    sizes = [m // e] * e
  sizes[-1] += m - sum(sizes)
  return np.asarray(sizes, np.int32)


def scaled_shape(name, scale):
  e, m, k, n = SHAPES[name.removesuffix("_skew")]
  return e, max(e, m // scale), max(8, k // scale), max(8, n // scale)


def jax_fns(backend, gs_np):
  """(forward, forward+backward) jitted callables of (x, w, gs, ct)."""
  base, _, wgrad = backend.partition(":")
  kw = {"wgrad": wgrad} if wgrad else {}
  if base == "padded":
    kw["capacity"] = -(-int(gs_np.max()) // 8) * 8

  def fwd(x, w, gs, ct):
    del ct
    return gmm_lib.gmm(x, w, gs, backend=base, **kw)

  def fwd_bwd(x, w, gs, ct):
    y, vjp = jax.vjp(lambda x, w: gmm_lib.gmm(x, w, gs, backend=base, **kw), x, w)
    return y, vjp(ct)

  return jax.jit(fwd), jax.jit(fwd_bwd)


def torch_times(x, w, gs_np, ct, iters):
  """torch._grouped_mm forward and forward+backward best-of-iters ms, on the same data as the JAX
  rows (CUDA if torch sees it, else CPU). Raises if its forward disagrees with lax.ragged_dot."""
  torch = timing.grouped_mm_torch()
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  tdtype = {jnp.bfloat16: torch.bfloat16, jnp.float32: torch.float32}[jnp.dtype(x.dtype).type]
  to_t = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(dev, tdtype)
  xt = to_t(x).requires_grad_()
  wt = to_t(w.transpose(0, 2, 1)).requires_grad_()       # [E, N, K]: K-major, as CUTLASS wants
  ctt = to_t(ct)
  offs = torch.tensor(np.cumsum(gs_np), device=dev, dtype=torch.int32)  # group end rows
  gmm_t = lambda: torch._grouped_mm(xt, wt.transpose(-2, -1), offs=offs)  # pylint: disable=protected-access

  want = np.asarray(jax.lax.ragged_dot(x, w, jnp.asarray(gs_np), preferred_element_type=jnp.float32))
  with torch.no_grad():
    got = gmm_t().float().cpu().numpy()
  tol = 2e-2 if tdtype == torch.bfloat16 else 1e-3
  err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
  if not err <= tol:
    raise AssertionError(f"torch._grouped_mm differs from lax.ragged_dot: rel err {err:.2e}")

  def fwd():
    with torch.no_grad():
      return gmm_t()

  def fwd_bwd():
    return torch.autograd.grad(gmm_t(), (xt, wt), ctt)

  wait = (lambda _: torch.cuda.synchronize()) if dev == "cuda" else (lambda _: None)
  return tuple(timing.best_wall_ms(fn, iters, wait) for fn in (fwd, fwd_bwd))


def bench_shape(name, scale, dtype, iters, backends):
  """Rows (shape, backend, mode, ms, tflops, frac_dense) for one shape."""
  shape = scaled_shape(name, scale)
  e, m, k, n = shape
  gs_np = group_sizes_for(name, e, m)
  x, w, ct = timing.random_problem(shape, dtype)
  gs = jnp.asarray(gs_np)
  flops = 2.0 * int(gs_np.sum()) * k * n
  dense_ms = timing.best_ms(jax.jit(lambda a, b: a @ b), (x, w[0]), iters)
  dense_tflops = 2.0 * m * k * n / dense_ms / 1e9
  label = f"{name} E={e} M={m} K={k} N={n}"
  rows = [(label, "dense", "fwd", dense_ms, dense_tflops, 1.0)]
  for backend in backends:
    try:
      if backend == "torch":
        ms = torch_times(x, w, gs_np, ct, iters)
      else:
        ms = tuple(timing.best_ms(f, (x, w, gs, ct), iters) for f in jax_fns(backend, gs_np))
    except Exception as err:  # pylint: disable=broad-except
      print(f"  {label} {backend}: failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
      continue
    for mode, t, mult in zip(("fwd", "fwd+bwd"), ms, (1, 3)):
      tflops = mult * flops / t / 1e9
      rows.append((label, backend, mode, t, tflops, tflops / dense_tflops))
  return rows


def main(argv):
  del argv
  if _AUTOTUNE.value:
    if "mgpu" not in gmm_lib.available_kernels():
      raise app.UsageError("--autotune needs the Mosaic-GPU kernels (a Hopper GPU)")
    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[_DTYPE.value or "bf16"]
    names = dict.fromkeys(n.removesuffix("_skew") for n in _SHAPES.value)
    mgpu.autotune([scaled_shape(n, _SCALE.value or 1) for n in names], dtype,
                  _ITERS.value or 10, mgpu.TILES_FILE)
    return
  cpu = _on_cpu()
  dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[_DTYPE.value or ("f32" if cpu else "bf16")]
  iters = _ITERS.value or (5 if cpu else 20)
  scale = _SCALE.value or (16 if cpu else 1)
  backends = _BACKENDS.value or default_backends()
  for b in backends:
    if b != "torch":
      gmm_lib.resolve_backend(b.partition(":")[0])
  print(f"device={jax.devices()[0].device_kind} ({jax.default_backend()}, "
        f"{jax.device_count()} devices) jax={jax.__version__} dtype={jnp.dtype(dtype).name} "
        f"scale={scale} iters={iters} kernels={gmm_lib.available_kernels()}")
  header = f"{'shape':<42} {'backend':<18} {'mode':<8} {'ms':>9} {'TFLOP/s':>9} {'/dense':>7}"
  print(header)
  print("-" * len(header))
  t0 = time.perf_counter()
  for name in _SHAPES.value:
    if name.removesuffix("_skew") not in SHAPES:
      raise app.UsageError(f"unknown shape {name!r}")
    for row in bench_shape(name, scale, dtype, iters, backends):
      print(f"{row[0]:<42} {row[1]:<18} {row[2]:<8} {row[3]:>9.3f} {row[4]:>9.4f} {row[5]:>7.3f}")
  print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
  app.run(main)
