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
                                "ragged_dot_general" in ragged-contracting form
                                or "segment", a one-hot masked einsum; "auto" =
                                segment on CPU, where it ran as fast as or up to
                                1.4x faster than ragged_dot_general at the bench
                                shapes, else ragged_dot_general, which need not
                                materialize an [E, M, K] copy)
                Core kernel: "ragged_dot" (everywhere). Accelerator kernels and
                wgrads (e.g. "mgpu", Hopper) live in the `kernels` package, which
                imports this module and registers them (register_kernel /
                register_wgrad); this module never imports it.
  "scan"        one expert at a time under lax.scan, masked: exact, E x the FLOPs,
                [M, N] live. For compile-only memory studies on CPU (its ragged_dot
                lowering keeps an [E, M, K] buffer, see _scan_kernel).
  "mgpu"        "custom" with the Hopper kernel and wgrad "mgpu" (kernels/mgpu.py, which
                the caller imports: command_line.py does for --gmm=mgpu). Opt-in: no GPU run
                has held it to the suite's contracts yet.
  "auto"        "ragged_dot", the default, checked on CPU by every strategy's tests.

On CPU, lax.ragged_dot (and ragged_dot_general) lowers to a dense masked product
of E x the dense FLOPs; there "padded" with capacity = largest group is the
fastest backend (bench/gmm.py). CPU timings say nothing about GPU kernels.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from parallel import sharding

BACKENDS = ("ragged_dot", "padded", "custom", "scan")

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


def valid_rows(group_sizes, m):
  """[M] bool: rows covered by some group."""
  return jnp.arange(m) < jnp.sum(group_sizes)


def _out_dtype(x, w, preferred_element_type):
  return jnp.dtype(preferred_element_type or jnp.result_type(x.dtype, w.dtype))


# ---------------------------------------------------------------- kernels and weight grads
# A kernel maps (lhs [M, A], rhs [E, A, B] (or [E, B, A] with transpose_rhs), group_sizes,
# out_dtype) -> [M, B] with exact-zero tail rows. A wgrad maps (x [M, K], dy [M, N],
# group_sizes, out_dtype) -> dw [E, K, N], ignoring tail rows.


def ragged_dot_kernel(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs=False):
  rhs = rhs.transpose(0, 2, 1) if transpose_rhs else rhs
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)


def wgrad_ragged(x, dy, group_sizes, *, out_dtype):
  return jax.lax.ragged_dot_general(x, dy, group_sizes, _WGRAD_DIMS,
                                    preferred_element_type=out_dtype)


def _wgrad_segment(x, dy, group_sizes, *, out_dtype):
  """One-hot segment form: mask x per group ([E, M, K]), contract rows with dy."""
  gid, _ = _row_groups(group_sizes, x.shape[0])
  onehot = gid[None, :] == jnp.arange(group_sizes.shape[0])[:, None]
  xe = jnp.where(onehot[:, :, None], x[None], 0)
  return jnp.einsum("emk,mn->ekn", xe, dy.astype(x.dtype), preferred_element_type=out_dtype)


def _scan_kernel(lhs, rhs, group_sizes, *, out_dtype, transpose_rhs=False):
  """One expert at a time under lax.scan: y += rows of group e @ rhs[e]. Exact (each row gets
  one nonzero term), E x the FLOPs, but only [M, B] live, as in an accelerator's grouped GEMM.
  XLA:CPU lowers ragged_dot through an [E, M, K] buffer: one DeepSeek-V3 expert matmul
  (M 32768, K 7168, N 2048, E 256, bf16) compiles to 128 GB of temp (343 GB with its backward),
  so CPU compile-only memory studies use this (`--gmm=scan`)."""
  gid, _ = _row_groups(group_sizes, lhs.shape[0])

  def step(acc, r_i):
    r, i = r_i
    part = jnp.dot(lhs, r.T if transpose_rhs else r, preferred_element_type=out_dtype)
    return acc + jnp.where((gid == i)[:, None], part, 0).astype(out_dtype), None

  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  acc = sharding.to_varying(jnp.zeros((lhs.shape[0], n), out_dtype),
                            sharding.varying_axes(lhs) | sharding.varying_axes(rhs))
  return jax.lax.scan(step, acc, (rhs, jnp.arange(rhs.shape[0])))[0]


def _wgrad_scan(x, dy, group_sizes, *, out_dtype):
  """dw[e] = x_e^T dy_e one expert at a time: [K, N] live per step, no [E, M, K] copy."""
  gid, _ = _row_groups(group_sizes, x.shape[0])

  def step(_, i):
    xe = jnp.where((gid == i)[:, None], x, 0)
    return None, jnp.einsum("mk,mn->kn", xe, dy.astype(x.dtype), preferred_element_type=out_dtype)
  return jax.lax.scan(step, None, jnp.arange(group_sizes.shape[0]))[1]


def _native() -> bool:
  return True


# name -> (fn, available() -> whether it runs natively in this process). Registered kernels
# must fall back to a core one where they are unavailable, so every name works everywhere.
_KERNELS: dict[str, tuple[Callable, Callable[[], bool]]] = {
    "ragged_dot": (ragged_dot_kernel, _native)}
_WGRADS: dict[str, tuple[Callable, Callable[[], bool]]] = {
    "ragged_dot_general": (wgrad_ragged, _native), "segment": (_wgrad_segment, _native)}
_SCAN = {"kernel": _scan_kernel, "wgrad": _wgrad_scan}   # backend "scan", not an "auto" choice


def _kernel_fn(name):
  return _SCAN["kernel"] if name == "scan" else _KERNELS[name][0]


def _wgrad_fn(name):
  return _SCAN["wgrad"] if name == "scan" else _WGRADS[name][0]


def register_kernel(name: str, fn: Callable, available: Callable[[], bool]) -> None:
  """Adds a "custom" kernel (see the contract above); available() is checked at each lookup."""
  _KERNELS[name] = (fn, available)


def register_wgrad(name: str, fn: Callable, available: Callable[[], bool]) -> None:
  """Adds a "custom" weight-gradient reduction; available() is checked at each lookup."""
  _WGRADS[name] = (fn, available)


def available_kernels() -> list[str]:
  """Kernels that run natively in this process, in registration order ("ragged_dot" first)."""
  return [name for name, (_, available) in _KERNELS.items() if available()]


def available_wgrads() -> list[str]:
  """Weight-gradient reductions that run natively in this process."""
  return [name for name, (_, available) in _WGRADS.items() if available()]


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
  return _kernel_fn(kernel)(x, w, group_sizes, out_dtype=out_dtype)


def _gmm_custom_fwd(x, w, group_sizes, kernel, wgrad, out_dtype):
  return _gmm_custom(x, w, group_sizes, kernel, wgrad, out_dtype), (x, w, group_sizes)


def _gmm_custom_bwd(kernel, wgrad, out_dtype, res, dy):
  del out_dtype
  x, w, group_sizes = res
  dy = dy.astype(jnp.result_type(x.dtype, w.dtype))
  dx = _kernel_fn(kernel)(dy, w, group_sizes, out_dtype=x.dtype, transpose_rhs=True)
  dw = _wgrad_fn(wgrad)(x, dy, group_sizes, out_dtype=w.dtype)
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


def resolve_kernel(name: str | None) -> str:
  """None or "auto" -> "ragged_dot"; else a registered kernel's name."""
  if name in (None, "auto"):
    return "ragged_dot"
  if name not in _KERNELS:
    raise ValueError(f"unknown gmm kernel {name!r}; expected 'auto' or one of {tuple(_KERNELS)}")
  return name


def resolve_backend(name: str) -> str:
  """Maps a backend name ("auto" included) to a concrete backend."""
  if name == "auto":
    return "ragged_dot"
  if name == "mgpu":
    if "mgpu" not in _KERNELS or "mgpu" not in _WGRADS:
      raise ValueError("gmm backend 'mgpu' needs kernels/mgpu.py: import kernels.mgpu first "
                       "(run.py does for --gmm=mgpu)")
    return "mgpu"
  if name not in BACKENDS:
    raise ValueError(f"unknown gmm backend {name!r}; expected 'auto', 'mgpu' or one of {BACKENDS}")
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
    backend: "auto" (= "ragged_dot"), "ragged_dot", "padded", "custom", "scan" or "mgpu".
    preferred_element_type: output dtype (default: result type of x and w).
    capacity: "padded" only; per-group row capacity C (default M).
    kernel: "custom" only; a registered kernel (default: "ragged_dot").
    wgrad: "custom" only; "auto" or a registered wgrad.
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
  if name in ("scan", "mgpu"):
    kernel = wgrad = name
  else:
    kernel, wgrad = resolve_kernel(kernel), resolve_wgrad(wgrad)
  x, w = _same_vma(x, w)
  return _gmm_custom(x, w, group_sizes, kernel, wgrad, np.dtype(out_dtype))
