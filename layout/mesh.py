"""Explicit meshes from `--mesh=data:2,expert:4` specs, with one-line validation errors."""
from __future__ import annotations

import math

import jax
from jax.sharding import AxisType

from modeling.config import ConfigError
from parallel.sharding import axis_size, dim_axes  # noqa: F401  (axis_size: mesh_lib.axis_size)

# Mesh axis names used anywhere in the suite.
DATA, FSDP, TENSOR, EXPERT, CONTEXT, STAGE = "data", "fsdp", "tensor", "expert", "context", "stage"


def parse_mesh_spec(spec: str) -> dict[str, int]:
  """'data:2,expert:4' -> {'data': 2, 'expert': 4} (order kept)."""
  out: dict[str, int] = {}
  for part in filter(None, (p.strip() for p in (spec or "").split(","))):
    name, sep, size = part.partition(":")
    if not sep or not size.strip().isdigit() or int(size) < 1:
      raise ConfigError(f"bad mesh entry {part!r}: expected name:size with size >= 1")
    if name in out:
      raise ConfigError(f"mesh axis {name!r} given twice")
    out[name.strip()] = int(size)
  return out


def mesh_shape(axes: tuple[str, ...], main_axis: str, spec: str | None, n_devices: int,
               strategy: str = "") -> dict[str, int]:
  """Sizes for every axis the strategy uses; omitted axes get 1, no spec puts all on main_axis."""
  given = parse_mesh_spec(spec) if spec else {main_axis: n_devices}
  unknown = [a for a in given if a not in axes]
  if unknown:
    raise ConfigError(f"mesh axis {unknown[0]!r} is not used by strategy {strategy!r} "
                      f"(its axes: {', '.join(axes) or 'none'})")
  shape = {a: given.get(a, 1) for a in axes}
  total = math.prod(shape.values())
  if total != n_devices:
    raise ConfigError(f"mesh {spec or shape} has {total} devices but {n_devices} are available")
  return shape


def for_strategy(strat, spec: str | None, n_devices: int | None = None, devices=None):
  """The one mesh builder (run.py, compare, tests): `spec` ('data:2,expert:4', omitted axes 1;
  None = every device on the strategy's main axis) -> an explicit Mesh over the first devices of
  `devices` (default jax.devices(); a --target's compile-only devices), or None for a strategy
  with no axes (the single-device reference), which takes no spec."""
  name = getattr(strat, "NAME", "")
  if not strat.AXES:
    if spec:
      raise ConfigError(f"strategy {name!r} runs on one device and takes no --mesh")
    return None
  n = jax.device_count() if n_devices is None else n_devices
  return make_mesh(mesh_shape(strat.AXES, strat.MAIN_AXIS, spec, n, name), devices)


def make_mesh(shape: dict[str, int], devices=None) -> jax.sharding.Mesh:
  """An explicit mesh of these axis sizes over the first prod(sizes) of `devices` (default
  jax.devices()), laid out by jax.make_mesh for their topology. On a TPU torus whose axes the
  mesh's sizes do not each match (fsdp:8,expert:8 on 4x4x4 chips), a mesh axis may span part
  of a physical axis (mesh_utils' allow_split_physical_axes)."""
  n = math.prod(shape.values())
  devices = list(jax.devices() if devices is None else devices)[:n]
  types = (AxisType.Explicit,) * len(shape)
  try:
    return jax.make_mesh(tuple(shape.values()), tuple(shape), devices=devices, axis_types=types)
  except NotImplementedError:
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_device_mesh(tuple(shape.values()), devices,
                                         allow_split_physical_axes=True)
    return jax.sharding.Mesh(grid, tuple(shape), axis_types=types)


def platform(mesh) -> str:
  """The platform a mesh compiles for: its devices' ('cpu', 'gpu', 'tpu'; a --target's
  compile-only devices are the target's), an abstract mesh's that names one (the planner's, for
  its cluster: `abstract_mesh`), else the default backend's."""
  if isinstance(mesh, jax.sharding.Mesh):
    return mesh.devices.flat[0].platform
  device = getattr(mesh, "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()


def abstract_mesh(shape: dict[str, int], platform: str | None = None) -> jax.sharding.AbstractMesh:
  """A mesh of these sizes without devices: enough for a strategy's check(). platform: the
  devices' kind it stands for ('gpu', 'tpu'; None: this host's backend), which `platform`
  reads back."""
  device = (None if platform is None else
            jax.sharding.AbstractDevice(device_kind=platform, num_cores=None, platform=platform))
  return jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape),
                                   axis_types=(AxisType.Explicit,) * len(shape),
                                   abstract_device=device)


def require_divisible(dim_name: str, dim: int, mesh, axes) -> None:
  """One-line error when `dim` is not divisible by the product of mesh `axes`."""
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  n = axis_size(mesh, *axes)
  if dim % n:
    label = "x".join(axes)
    raise ConfigError(f"{dim_name}={dim} is not divisible by mesh axis {label}={n}")


def require_head_split(cfg, mesh, axis: str, expert_ff: bool = False) -> None:
  """Megatron's column / row split over `axis` (tp, ep_tp): attention heads, KV heads, the
  routed experts' width d_ff if they are split too (expert_ff: tp), and the dense SwiGLUs'
  widths (shared expert, leading dense layers) divisible by it."""
  require_divisible("n_heads", cfg.n_heads, mesh, axis)
  require_divisible("n_kv_heads", cfg.n_kv_heads, mesh, axis)
  if expert_ff:
    require_divisible("d_ff", cfg.d_ff, mesh, axis)
  if cfg.n_shared_experts:
    require_divisible("shared_d_ff", cfg.shared_d_ff, mesh, axis)
  if cfg.n_dense_layers:
    require_divisible("dense_d_ff", cfg.dense_d_ff, mesh, axis)


def require_microbatches(cfg, mesh, bspec) -> None:
  """Each microbatch is sharded like the whole batch: B % (M x the batch axes' size) == 0."""
  if cfg.microbatches <= 1:
    return
  axes = dim_axes(bspec, 0) if mesh is not None and bspec is not None else ()   # B's axes
  n = axis_size(mesh, *axes) if axes else 1
  if cfg.batch % (cfg.microbatches * n):
    label = "x".join(axes) or "none"
    raise ConfigError(f"batch={cfg.batch} is not divisible by microbatches={cfg.microbatches} x "
                      f"mesh axis {label}={n}")


def order_note(strat, spec: str | None) -> str | None:
  """A mesh is laid out in the strategy's axis order (the last axis varies fastest over the
  device ids, so it lands inside a host); when `spec` names its axes in another order, the one
  line that says so (None when the order is kept or there is no spec)."""
  if not spec or not strat.AXES:
    return None
  given = [a for a in parse_mesh_spec(spec) if a in strat.AXES]
  used = [a for a in strat.AXES if a in given]
  if given == used:
    return None
  return (f"mesh axes are laid out in {strat.NAME}'s order ({', '.join(strat.AXES)}), not as given "
          f"({', '.join(given)}): the last axis varies fastest over devices (inside a host)")


def splits(n: int, k: int, powers_of_two: bool = False):
  """Every ordered k-tuple of positive integers whose product is n: the ways to lay n devices
  over k mesh axes; with powers_of_two, the first k - 1 sizes are powers of two (the last takes
  what is left)."""
  if k == 1:
    yield (n,)
    return
  d = 1
  while d <= n:
    if n % d == 0:
      for rest in splits(n // d, k - 1, powers_of_two):
        yield (d,) + rest
    d = d * 2 if powers_of_two else d + 1

