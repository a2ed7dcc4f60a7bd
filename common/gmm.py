"""Grouped matmul (GMM) for Mixture-of-Experts layers.

Shapes legend:
  M  rows (tokens routed to this device, sorted by expert)
  K  input features, N output features
  E  groups (experts)

  x            [M, K]   rows sorted by group: group e owns rows
                        [offset_e, offset_e + group_sizes[e]), offsets = exclusive cumsum
  w            [E, K, N]
  group_sizes  [E] int32, sum(group_sizes) <= M
  y = gmm(...) [M, N]   y[r] = x[r] @ w[group(r)]

Zero-tail contract: rows r >= sum(group_sizes) (the capacity padding) of y are
exact zeros, and so are the same rows of the gradient wrt x, for every backend.
Tail rows of x and of the output cotangent never reach dw.

gmm is called on local (unsharded) arrays: on one device, or inside a
full-manual `jax.shard_map` body. It does not handle explicit sharding.

Backends:
  "ragged_dot"  jax.lax.ragged_dot; autodiff by JAX.
  "padded"      scatter rows into a capacity-padded [E, C, K] buffer (C = M by
                default, the worst case; rows past `capacity` are dropped),
                batched einsum with w, gather back. Same results as ragged_dot
                (up to summation order) when capacity >= the largest group.
  "custom"      jax.custom_vjp around a pluggable grouped kernel (`_KERNELS`):
                  forward  y  = kernel(x, w, gs)
                  dx          = kernel(dy, w.transpose(0, 2, 1), gs)
                  dw[e]       = x_e^T dy_e   (grouped reduction, `_WGRADS`:
                                "ragged_dot_general" in ragged-contracting form,
                                "segment", a one-hot masked einsum, or opt-in
                                "mgpu": transposed_ragged_dot_mgpu on Hopper;
                                "auto" = segment on CPU, where it ran as fast
                                as or up to 1.4x faster than ragged_dot_general
                                at the bench shapes, else ragged_dot_general,
                                which need not materialize an [E, M, K] copy)
                Kernels: "ragged_dot" (everywhere) and "mgpu"
                (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu, Hopper only,
                16-bit dtypes, output rounded to the input dtype before the
                cast to preferred_element_type; falls back to ragged_dot for
                other dtypes or shapes that its tiles do not divide).
                Tiles per kernel call: mgpu_config, from the per-shape table
                TILES_FILE that `python bench/gmm.py --autotune` writes on a
                Hopper GPU (autotune below), else MGPU_CONFIG.
  "auto"        "custom" with the mgpu kernel on a Hopper GPU where the kernel
                imports, else "ragged_dot".

Performance (measured by someone else on an H100): lax.ragged_dot wastes work
proportional to the number of groups, about 100 TFLOP/s at E=8 but about 6
TFLOP/s at E=64, while ragged_dot_mgpu ran at 608 (E=8) / 254 (E=64) TFLOP/s
forward. On CPU, lax.ragged_dot (and ragged_dot_general) lowers to a dense
masked product of E x the dense FLOPs; there "padded" with capacity = largest
group is the fastest backend (bench/gmm.py). CPU timings say nothing about GPU
kernels.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from common import sharding

BACKENDS = ("ragged_dot", "padded", "custom")

# Tile config of the Mosaic-GPU kernels where the tile table has no entry for a call's shape
# (needs K % block_k == 0 and N % block_n == 0; the weight gradient K % block_m == 0).
MGPU_CONFIG = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4)
# Per-shape tiles, written by `python bench/gmm.py --autotune` on a Hopper GPU (absent until a
# session with one runs it): {tile_key(...): {block_m, block_n, block_k, max_concurrent_steps}}.
TILES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mgpu_tiles.json")

# Dimension numbers: dw[g] = lhs[rows of g]^T @ rhs[rows of g] (ragged contracting dim).
_WGRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


# ---------------------------------------------------------------- helpers


def _row_groups(group_sizes, m):
  """Per-row group id ([M], E for tail rows) and position within its group."""
  ends = jnp.cumsum(group_sizes)
  rows = jnp.arange(m, dtype=ends.dtype)
  gid = jnp.sum(rows[:, None] >= ends[None, :], axis=1).astype(ends.dtype)
  starts = ends - group_sizes
  pos = rows - starts[jnp.minimum(gid, group_sizes.shape[0] - 1)]
  return gid, pos


def _valid_rows(group_sizes, m):
  """[M] bool: rows covered by some group."""
  return jnp.arange(m) < jnp.sum(group_sizes)


def _out_dtype(x, w, preferred_element_type):
  return jnp.dtype(preferred_element_type or jnp.result_type(x.dtype, w.dtype))


# ---------------------------------------------------------------- kernels
# A kernel maps (lhs [M, A], rhs [E, A, B] (or [E, B, A] with transpose_rhs),
# group_sizes, out_dtype) -> [M, B] with exact-zero tail rows.


def _ragged_dot_kernel(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs=False):
  rhs = rhs.transpose(0, 2, 1) if transpose_rhs else rhs
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)


def _on_hopper() -> bool:
  dev = jax.devices()[0]
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


@functools.cache
def _mgpu_module(name="ragged_dot_mgpu", fn="ragged_dot"):
  """jax.experimental.pallas.ops.gpu.<name> if it has <fn> and we run on Hopper, else None."""
  try:
    if not _on_hopper():
      return None
    import importlib  # pylint: disable=g-import-not-at-top
    mod = importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")
  except Exception:  # pylint: disable=broad-except
    return None
  return mod if hasattr(mod, fn) else None


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


_KERNELS: dict[str, Callable] = {"ragged_dot": _ragged_dot_kernel, "mgpu": _mgpu_kernel}


def available_kernels() -> list[str]:
  """Kernels usable by the "custom" backend in this process."""
  return ["ragged_dot"] + (["mgpu"] if _mgpu_module() is not None else [])


def available_wgrads() -> list[str]:
  """Weight-gradient reductions for "custom" that run natively here ("mgpu" falls back)."""
  mgpu = _mgpu_module("transposed_ragged_dot_mgpu", "transposed_ragged_dot") is not None
  return ["ragged_dot_general", "segment"] + (["mgpu"] if mgpu else [])


# ---------------------------------------------------------------- weight grads
# A wgrad maps (x [M, K], dy [M, N], group_sizes, out_dtype) -> dw [E, K, N].


def _wgrad_ragged(x, dy, group_sizes, *, out_dtype):
  return jax.lax.ragged_dot_general(x, dy, group_sizes, _WGRAD_DIMS,
                                    preferred_element_type=out_dtype)


def _wgrad_segment(x, dy, group_sizes, *, out_dtype):
  """One-hot segment form: mask x per group ([E, M, K]), contract rows with dy."""
  gid, _ = _row_groups(group_sizes, x.shape[0])
  onehot = gid[None, :] == jnp.arange(group_sizes.shape[0])[:, None]
  xe = jnp.where(onehot[:, :, None], x[None], 0)
  return jnp.einsum("emk,mn->ekn", xe, dy.astype(x.dtype), preferred_element_type=out_dtype)


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


_WGRADS: dict[str, Callable] = {"ragged_dot_general": _wgrad_ragged,
                                "segment": _wgrad_segment,
                                "mgpu": _wgrad_mgpu}


# ---------------------------------------------------------------- backends


def _gmm_padded(x, w, group_sizes, out_dtype, capacity=None):
  """Capacity-padded batched einsum (rows beyond `capacity` in a group are dropped)."""
  m, e = x.shape[0], w.shape[0]
  c = m if capacity is None else capacity
  gid, pos = _row_groups(group_sizes, m)
  valid = ((gid < e) & (pos < c))[:, None]
  buf = jnp.zeros((e, c, x.shape[1]), x.dtype).at[gid, pos].set(
      jnp.where(valid, x, 0), mode="drop")
  out = jnp.einsum("eck,ekn->ecn", buf, w, preferred_element_type=out_dtype)
  y = out.at[gid, pos].get(mode="fill", fill_value=0)
  return jnp.where(valid, y, 0).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm_custom(x, w, group_sizes, kernel, wgrad, out_dtype):
  return _KERNELS[kernel](x, w, group_sizes, out_dtype=out_dtype)


def _gmm_custom_fwd(x, w, group_sizes, kernel, wgrad, out_dtype):
  return _gmm_custom(x, w, group_sizes, kernel, wgrad, out_dtype), (x, w, group_sizes)


def _gmm_custom_bwd(kernel, wgrad, out_dtype, res, dy):
  del out_dtype
  x, w, group_sizes = res
  dy = dy.astype(jnp.result_type(x.dtype, w.dtype))
  dx = _KERNELS[kernel](dy, w, group_sizes, out_dtype=x.dtype, transpose_rhs=True)
  dw = _WGRADS[wgrad](x, dy, group_sizes, out_dtype=w.dtype)
  return dx, dw, None


_gmm_custom.defvjp(_gmm_custom_fwd, _gmm_custom_bwd)


def _same_vma(x, w):
  """Inside a shard_map, cast x and w to the union of their varying manual axes. A custom_vjp
  must return cotangents typed like its inputs: experts replicated over the axes the tokens
  vary over (dp, fsdp, cp) would otherwise get a varying dw back. The pcast's transpose is the
  psum of dw over those axes, exactly what autodiff of ragged_dot inserts."""
  union = sharding.varying_axes(x) | sharding.varying_axes(w)
  return sharding.to_varying(x, union), sharding.to_varying(w, union)


# ---------------------------------------------------------------- public API


def available_backends() -> list[str]:
  """Backends usable in this process (all are, on any platform)."""
  return list(BACKENDS)


def resolve_backend(name: str) -> str:
  """Maps a backend name ("auto" included) to a concrete backend."""
  if name == "auto":
    return "custom" if "mgpu" in available_kernels() else "ragged_dot"
  if name not in BACKENDS:
    raise ValueError(f"unknown gmm backend {name!r}; expected 'auto' or one of {BACKENDS}")
  return name


def resolve_wgrad(name: str) -> str:
  """"auto" -> "segment" on CPU (measured faster there), else "ragged_dot_general"."""
  if name == "auto":
    return "segment" if jax.default_backend() == "cpu" else "ragged_dot_general"
  if name not in _WGRADS:
    raise ValueError(f"unknown gmm wgrad {name!r}; expected 'auto' or one of {tuple(_WGRADS)}")
  return name


def gmm(x, w, group_sizes, *, backend="auto", preferred_element_type=None,
        capacity=None, kernel=None, wgrad="auto"):
  """Grouped matmul y[r] = x[r] @ w[group(r)]; see the module docstring.

  Args:
    x: [M, K] rows sorted by group.
    w: [E, K, N].
    group_sizes: [E] int32, sum <= M; rows past the sum give zeros.
    backend: "auto", "ragged_dot", "padded" or "custom".
    preferred_element_type: output dtype (default: result type of x and w).
    capacity: "padded" only; per-group row capacity C (default M).
    kernel: "custom" only; key of `_KERNELS` (default "mgpu" where available).
    wgrad: "custom" only; "auto" or a key of `_WGRADS`.
  Returns:
    [M, N] array.
  """
  name = resolve_backend(backend)
  out_dtype = _out_dtype(x, w, preferred_element_type)
  group_sizes = group_sizes.astype(jnp.int32)
  if name == "ragged_dot":
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=out_dtype)
  if name == "padded":
    return _gmm_padded(x, w, group_sizes, out_dtype, capacity)
  kernel = kernel or ("mgpu" if "mgpu" in available_kernels() else "ragged_dot")
  if kernel not in _KERNELS:
    raise ValueError(f"unknown gmm kernel {kernel!r}; expected one of {tuple(_KERNELS)}")
  x, w = _same_vma(x, w)
  return _gmm_custom(x, w, group_sizes, kernel, resolve_wgrad(wgrad), np.dtype(out_dtype))


# ---------------------------------------------------------------- tile autotuning (Hopper)

TILE_CANDIDATES = [dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=st)
                   for bm in (64, 128) for bn in (128, 256) for bk in (64, 128) for st in (2, 4)]


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


def random_problem(shape, dtype, seed=0):
  """(x [M, K], w [E, K, N] (normal / sqrt(K)), ct [M, N]) for shape (E, M, K, N), made in one
  jitted call (no f32 copy of w outside it): the benchmarks' and autotune's data."""
  e, m, k, n = shape
  keys = jax.random.split(jax.random.key(seed), 3)

  @jax.jit
  def make():
    x = jax.random.normal(keys[0], (m, k), dtype)
    w = (jax.random.normal(keys[1], (e, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    ct = jax.random.normal(keys[2], (m, n), dtype)
    return x, w, ct

  return make()


def autotune(shapes, dtype, iters: int, path: str, candidates=None, log=print) -> dict:
  """Tune tiles for shapes [(E, M, K, N)] with even groups: per kernel call, the fastest config
  of `candidates` that divides the shape and matches ragged_dot (rel. 2e-2); the winners are
  merged into the JSON table at `path` (keys: tile_key). Returns the table."""
  from common import timing  # pylint: disable=g-import-not-at-top
  try:
    with open(path) as f:
      table = json.load(f)
  except FileNotFoundError:
    table = {}
  for e, m, k, n in shapes:
    x, w, ct = random_problem((e, m, k, n), dtype)
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
