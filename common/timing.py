"""Wall-clock timing for the benchmarks, and their optional PyTorch baseline."""
import time

import jax


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


def grouped_mm_torch():
  """torch if it imports and has torch._grouped_mm (CUDA; CPU since torch 2.9), else None."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return torch if hasattr(torch, "_grouped_mm") else None
