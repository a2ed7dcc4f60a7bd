"""Hopper grouped-matmul kernels for modeling/gmm.py's "mgpu" backend (registered as "mgpu" when this
module is imported: command_line.py imports it for --gmm=mgpu, bench/ always).

  kernel "mgpu"  jax.experimental.pallas.ops.gpu.ragged_dot_mgpu: forward x @ w and dx = dy @ w^T
                 (transpose_rhs where the kernel has it, else a transposed copy of w)
  wgrad  "mgpu"  transposed_ragged_dot_mgpu: dw[e] = x_e^T dy_e, tail rows zeroed first
Hopper GPUs only, 16-bit dtypes; output rounded to the input dtype before the cast to
preferred_element_type, tail rows masked to exact zeros (the kernels leave them unwritten).
Elsewhere, for other dtypes or for shapes that the tiles do not divide, each falls back to
modeling.gmm's ragged_dot kernel / ragged_dot_general wgrad.

Tiles per kernel call: mgpu_config, from the per-shape table TILES_FILE (kernels/mgpu_tiles.json)
that `python bench/gmm.py --autotune` writes on a Hopper GPU (autotune below; no table is in the
repo), else MGPU_CONFIG.

Performance (an outside measurement on an H100, not repeated here; docs/gpu.md holds this suite's
own): lax.ragged_dot wastes work proportional to the number of groups, about 100 TFLOP/s at E=8
but about 6 TFLOP/s at E=64, while ragged_dot_mgpu ran at 608 (E=8) / 254 (E=64) TFLOP/s forward.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from measure import timing
from modeling import gmm as gmm_lib

# modeling.gmm's core kernel, wgrad and tail mask: the fallbacks and the autotuner's references.
_ragged_dot_kernel = gmm_lib.ragged_dot_kernel
_wgrad_ragged = gmm_lib.wgrad_ragged
_valid_rows = gmm_lib.valid_rows

# Tile config where the tile table has no entry for a call's shape
# (needs K % block_k == 0 and N % block_n == 0; the weight gradient K % block_m == 0).
MGPU_CONFIG = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4)
# Per-shape tiles, written by `python bench/gmm.py --autotune` on a Hopper GPU (absent until it
# runs there): {tile_key(...): {block_m, block_n, block_k, max_concurrent_steps}}.
TILES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mgpu_tiles.json")
TILE_CANDIDATES = [dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=st)
                   for bm in (64, 128) for bn in (128, 256) for bk in (64, 128) for st in (2, 4)]


def _on_hopper() -> bool:
  dev = jax.devices()[0]
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


@functools.cache
def _mgpu_module(name="ragged_dot_mgpu", fn="ragged_dot"):
  """jax.experimental.pallas.ops.gpu.<name> if it has <fn> and we run on Hopper, else None."""
  try:
    if not _on_hopper():
      return None
    mod = importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")
  except Exception:  # pylint: disable=broad-except
    return None
  return mod if hasattr(mod, fn) else None


# ---------------------------------------------------------------- tile table


def tile_key(kind: str, e: int, m: int, a: int, b: int, dtype) -> str:
  """Key of one kernel call in the tile table. kind: "fwd" (x [M, A] @ w [E, A, B]), "dx"
  (dy [M, A] @ w^T, A = N, B = K) or "wgrad" (dw [E, A, B] = x^T dy over M rows)."""
  return f"{kind} {jnp.dtype(dtype).name} E{e} M{m} A{a} B{b}"


@functools.cache
def _tile_table(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return {}


def mgpu_config(kind: str, e: int, m: int, a: int, b: int, dtype) -> dict:
  """Tiles for one kernel call: the tile table's entry for its shape, else MGPU_CONFIG."""
  return dict(MGPU_CONFIG, **_tile_table(TILES_FILE).get(tile_key(kind, e, m, a, b, dtype), {}))


def mgpu_fits(kind: str, a: int, b: int, cfg: dict) -> bool:
  """Whether tiles `cfg` divide a kernel call of tile_key's (kind, A, B)."""
  return a % cfg["block_m" if kind == "wgrad" else "block_k"] == 0 and b % cfg["block_n"] == 0


def _grid_block_n(n, block_n):
  """Largest n-swizzle (4, 2 or 1) dividing the number of n tiles."""
  return next(g for g in (4, 2, 1) if (n // block_n) % g == 0)


# ---------------------------------------------------------------- kernel and wgrad


def _mgpu_kernel(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs=False, config=None):
  """Pallas Mosaic-GPU grouped matmul (Hopper); tail rows masked to zero. config: tiles
  (default: mgpu_config for this call)."""
  mod = _mgpu_module()
  dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  a, b = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else rhs.shape[1:]
  kind = "dx" if transpose_rhs else "fwd"
  cfg = dict(config or mgpu_config(kind, rhs.shape[0], lhs.shape[0], a, b, dtype))
  if mod is None or dtype not in (jnp.bfloat16, jnp.float16) or not mgpu_fits(kind, a, b, cfg):
    return _ragged_dot_kernel(lhs, rhs, group_sizes, out_dtype=out_dtype,
                              transpose_rhs=transpose_rhs)
  params = inspect.signature(mod.ragged_dot).parameters
  cfg["grid_block_n"] = _grid_block_n(b, cfg["block_n"])
  if transpose_rhs and "transpose_rhs" in params:
    cfg["transpose_rhs"] = True
  elif transpose_rhs:
    rhs = rhs.transpose(0, 2, 1)
  y = mod.ragged_dot(lhs.astype(dtype), rhs.astype(dtype),
                     group_sizes=group_sizes.astype(jnp.int32), **cfg)
  # The kernel leaves rows past sum(group_sizes) unwritten.
  valid = _valid_rows(group_sizes, lhs.shape[0])[:, None]
  return jnp.where(valid, y, 0).astype(out_dtype)


def _wgrad_mgpu(x, dy, group_sizes, *, out_dtype, config=None):
  """Pallas Mosaic-GPU transposed ragged dot (Hopper, 16-bit); else ragged_dot_general."""
  mod = _mgpu_module("transposed_ragged_dot_mgpu", "transposed_ragged_dot")
  dtype = jnp.result_type(x.dtype, dy.dtype)
  (m, k), n = x.shape, dy.shape[1]
  cfg = dict(config or mgpu_config("wgrad", group_sizes.shape[0], m, k, n, dtype))
  if mod is None or dtype not in (jnp.bfloat16, jnp.float16) or not mgpu_fits("wgrad", k, n, cfg):
    return _wgrad_ragged(x, dy, group_sizes, out_dtype=out_dtype)
  cfg["grid_block_n"] = _grid_block_n(n, cfg["block_n"])
  # Zero the tail rows so they cannot leak into the last group's tile.
  valid = _valid_rows(group_sizes, m)[:, None]
  x, dy = (jnp.where(valid, a, 0).astype(dtype) for a in (x, dy))
  dw = mod.transposed_ragged_dot(x, dy, group_sizes=group_sizes.astype(jnp.int32), **cfg)
  return dw.astype(out_dtype)


# Looked up by name at each call, so tests can stand in for _mgpu_module.
gmm_lib.register_kernel("mgpu", _mgpu_kernel, lambda: _mgpu_module() is not None)
gmm_lib.register_wgrad("mgpu", _wgrad_mgpu, lambda: _mgpu_module(
    "transposed_ragged_dot_mgpu", "transposed_ragged_dot") is not None)


# ---------------------------------------------------------------- tile autotuning (Hopper)


def _kernel_calls(dtype) -> dict:
  """{kind: (mgpu call(config, x, w, gs, ct), ragged_dot reference(x, w, gs, ct))}: the three
  Mosaic-GPU kernel calls of the custom backend."""
  out = dict(out_dtype=dtype)
  return {
      "fwd": (lambda c, x, w, gs, ct: _mgpu_kernel(x, w, gs, config=c, **out),
              lambda x, w, gs, ct: _ragged_dot_kernel(x, w, gs, **out)),
      "dx": (lambda c, x, w, gs, ct: _mgpu_kernel(ct, w, gs, transpose_rhs=True, config=c, **out),
             lambda x, w, gs, ct: _ragged_dot_kernel(ct, w, gs, transpose_rhs=True, **out)),
      "wgrad": (lambda c, x, w, gs, ct: _wgrad_mgpu(x, ct, gs, config=c, **out),
                lambda x, w, gs, ct: _wgrad_ragged(x, ct, gs, **out)),
  }


def autotune(shapes, dtype, iters: int, path: str, candidates=None, log=print) -> dict:
  """Tune tiles for shapes [(E, M, K, N)] with even groups: per kernel call, the fastest config
  of `candidates` that divides the shape and matches ragged_dot (rel. 2e-2); the winners are
  merged into the JSON table at `path` (keys: tile_key). Returns the table."""
  try:
    with open(path) as f:
      table = json.load(f)
  except FileNotFoundError:
    table = {}
  for e, m, k, n in shapes:
    x, w, ct = timing.random_problem((e, m, k, n), dtype)
    args = (x, w, jnp.full((e,), m // e, jnp.int32).at[-1].add(m % e), ct)
    for kind, (call, ref) in _kernel_calls(dtype).items():
      a, b = (n, k) if kind == "dx" else (k, n)
      want = np.asarray(jax.jit(ref)(*args), np.float32)
      scale = float(np.max(np.abs(want))) + 1e-30
      best = None
      for cfg in candidates or TILE_CANDIDATES:
        if not mgpu_fits(kind, a, b, cfg):
          continue
        fn = jax.jit(functools.partial(call, cfg))
        try:
          err = float(np.max(np.abs(np.asarray(fn(*args), np.float32) - want))) / scale
          if not err <= 2e-2:
            raise AssertionError(f"rel err {err:.1e} vs ragged_dot")
          ms = timing.best_ms(fn, args, iters)
        except Exception as exc:  # pylint: disable=broad-except
          log(f"  {kind} E{e} M{m} K{k} N{n} {cfg}: skipped: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:100]}")
          continue
        if best is None or ms < best[0]:
          best = (ms, cfg)
      key = tile_key(kind, e, m, a, b, dtype)
      if best is None:
        log(f"{key}: no candidate ran")
        continue
      log(f"{key}: {best[1]}  {best[0]:.3f} ms")
      table[key] = best[1]
  with open(path, "w") as f:
    json.dump(table, f, indent=1, sort_keys=True)
    f.write("\n")
  _tile_table.cache_clear()
  return table
