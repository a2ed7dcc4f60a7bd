"""Wall-clock timing, random data and the optional PyTorch baseline of the benchmarks."""
import time

import jax
import jax.numpy as jnp
import numpy as np


def best_wall_ms(fn, iters: int, wait=lambda out: None) -> float:
  """Best wall ms of fn() over `iters` calls after one warmup call; wait(out) blocks until the
  call's device work is done (jax.block_until_ready, or torch.cuda.synchronize for torch)."""
  wait(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    wait(fn())
    times.append(time.perf_counter() - t0)
  return 1e3 * min(times)


def best_ms(fn, args, iters: int) -> float:
  """Best wall ms of the JAX call fn(*args) over `iters` calls, after one warmup call (compile)."""
  return best_wall_ms(lambda: fn(*args), iters, jax.block_until_ready)


def random_problem(shape, dtype, seed=0):
  """(x [M, K], w [E, K, N] (normal / sqrt(K)), ct [M, N]) for shape (E, M, K, N), made in one
  jitted call (no f32 copy of w outside it): bench/gmm.py's and the tile autotuner's data."""
  e, m, k, n = shape
  keys = jax.random.split(jax.random.key(seed), 3)

  @jax.jit
  def make():
    x = jax.random.normal(keys[0], (m, k), dtype)
    w = (jax.random.normal(keys[1], (e, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    ct = jax.random.normal(keys[2], (m, n), dtype)
    return x, w, ct

  return make()


def grouped_mm_torch():
  """torch if it imports and has torch._grouped_mm (CUDA; CPU since torch 2.9), else None."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return torch if hasattr(torch, "_grouped_mm") else None
