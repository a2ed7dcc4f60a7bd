"""Compiling for hardware this host lacks (`--target=NAME --compile_only`): the target profiles
and their devices.

A profile names a chip and the topologies it is sold in. `devices(name, n)` asks XLA for a
topology of n such devices through `jax.experimental.topologies.get_topology_desc` and returns
its compile-only devices: a mesh built from them lowers and compiles with that chip's compiler
(XLA:TPU from libtpu, XLA:GPU from the CUDA plugin) on this CPU-only host, so the compiled step's
memory_analysis(), collectives and HLO are the target's. Nothing can run on such devices.

  python run.py --strategy=ep --model=mixtral-test --devices=8 --compile_only --target=tpu-v5p

Device counts each profile makes (one device is one chip, tpu-v7's two per chip):
  tpu-v5p        4, 8, 16, ..., 4096: slices 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4 (a cube, wrapped
                 into a torus on the axes that are multiples of 4), ... 16x16x16 chips, megacore
  tpu-v5e, v6e   4, 8, ..., 256: slices 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16 chips
  tpu-v7         8, 16, ..., 4096: slices 2x2x1 ... 8x16x16 chips, two devices per chip
  h100, h200,    2 .. 8 (one host) or a multiple of 8 up to 4096 (hosts of 8 GPUs)
  b200

Set-up, before JAX starts its backends (`configure`): this host's own backend is the CPU
(JAX_PLATFORMS=cpu; a plugin never probes for hardware), and the persistent compilation cache is
off (a cached or compiler-options compile tries to load the program onto a device, which XLA:GPU
cannot do here). XLA:GPU gets two flags:
  --xla_gpu_enable_cub_radix_sort=false   XLA's CUB radix-sort rewrite of a sort asks the CUDA
      runtime for the device at compile time; without it XLA's own sort is kept (the same
      results, maybe slower on the device: the routing's top-k sort);
  --xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false   an all-reduce over exactly 64
      devices otherwise aborts in LLVM.
XLA:GPU compiles without autotuning (no device to time kernels on): buffers and collectives are
the target's, kernel choices XLA's defaults.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Callable

from modeling.config import ConfigError

SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
GPU_FLAGS = ("--xla_gpu_enable_cub_radix_sort=false "
             "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false")


def _powers(lo: int, hi: int) -> list[int]:
  """The powers of two in [lo, hi]."""
  return [1 << k for k in range(lo.bit_length() - 1, hi.bit_length()) if lo <= 1 << k <= hi]


def _cube(chips: int) -> tuple[int, int, int]:
  """A 3-D slice of `chips` (a power of two >= 4): 2x2x1, then the last of the smallest axes
  doubled each time: 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ..."""
  dims = [2, 2, 1]
  while math.prod(dims) < chips:
    dims[max(i for i, d in enumerate(dims) if d == min(dims))] *= 2
  return tuple(dims)


def _plane(chips: int) -> tuple[int, int]:
  """A 2-D slice of `chips` (a power of two >= 4): 2x2, 2x4, 4x4, 4x8, 8x8, ..."""
  a = 1 << ((chips.bit_length() - 1) // 2)
  return a, chips // a


def _tpu3d(prefix: str, chip_config: str, per_chip: int) -> Callable[[int], dict]:
  """get_topology_desc's arguments for a 3-D torus generation: n devices, per_chip each chip."""
  def kwargs(n: int) -> dict:
    dims = _cube(n // per_chip)
    big = math.prod(dims) >= 64                  # cubes of 4x4x4 and up close their torus
    return dict(platform="tpu", topology_name=f"{prefix}:{'x'.join(map(str, dims))}",
                chip_config_name=chip_config, chips_per_host_bounds=(2, 2, 1), num_slices=1,
                wrap=tuple(big and d % 4 == 0 for d in dims))
  return kwargs


def _tpu2d(prefix: str) -> Callable[[int], dict]:
  """get_topology_desc's arguments for a 2-D generation (v5e, v6e): one device per chip."""
  def kwargs(n: int) -> dict:
    a, b = _plane(n)
    return dict(platform="tpu", topology_name=f"{prefix}:{a}x{b}", chip_config_name="default",
                chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False))
  return kwargs


def _gpu(spec: str) -> Callable[[int], dict]:
  """get_topology_desc's arguments for GPUs described by XLA's `spec` (runtime/targets/):
  partitions x hosts x devices per host, hosts of 8."""
  def kwargs(n: int) -> dict:
    with open(os.path.join(SPECS, spec)) as f:
      text = f.read()
    hosts, per_host = (1, n) if n <= 8 else (n // 8, 8)
    return dict(platform="cuda", target_config=text, topology=f"1x{hosts}x{per_host}")
  return kwargs


@dataclasses.dataclass(frozen=True)
class Profile:
  name: str
  compiler: str                 # whose memory_analysis() the report shows
  packages: tuple[str, ...]     # modules of which one must be importable
  needs: str                    # its pip package, as the error names it
  requirements: str             # the requirements file that installs it
  counts: tuple[int, ...]       # the device counts it makes
  counts_said: str              # those, in words
  topology: Callable[[int], dict]


_TPU = dict(compiler="XLA:TPU", packages=("libtpu",), needs="libtpu",
            requirements="requirements-tpu.txt")
# the CUDA 12 plugin (requirements-gpu.txt) or CUDA 13's: either compiles for the GPU descriptions
_GPU = dict(compiler="XLA:GPU", packages=("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"), needs="jax-cuda12-plugin",
            requirements="requirements-gpu.txt")
_GPU_COUNTS = tuple(range(2, 8)) + tuple(range(8, 4097, 8))
PROFILES = {p.name: p for p in (
    Profile("tpu-v5p", **_TPU, counts=tuple(_powers(4, 4096)),
            counts_said="4, 8, 16, ..., 4096 (a power of two >= 4: slices of 2x2x1 chips and up)",
            topology=_tpu3d("v5", "megacore", 1)),
    Profile("tpu-v5e", **_TPU, counts=tuple(_powers(4, 256)),
            counts_said="4, 8, 16, ..., 256 (a power of two: slices of 2x2 to 16x16 chips)",
            topology=_tpu2d("v5e")),
    Profile("tpu-v6e", **_TPU, counts=tuple(_powers(4, 256)),
            counts_said="4, 8, 16, ..., 256 (a power of two: slices of 2x2 to 16x16 chips)",
            topology=_tpu2d("v6e")),
    Profile("tpu-v7", **_TPU, counts=tuple(_powers(8, 4096)),
            counts_said="8, 16, ..., 4096 (a power of two >= 8: slices of 2x2x1 chips and up, "
                        "two devices per chip)",
            topology=_tpu3d("tpu7x", "default", 2)),
    Profile("h100", **_GPU, counts=_GPU_COUNTS,
            counts_said="2 to 8 (one host), or a multiple of 8 up to 4096 (hosts of 8)",
            topology=_gpu("h100_sxm.txtpb")),
    Profile("h200", **_GPU, counts=_GPU_COUNTS,
            counts_said="2 to 8 (one host), or a multiple of 8 up to 4096 (hosts of 8)",
            topology=_gpu("h200.txtpb")),
    Profile("b200", **_GPU, counts=_GPU_COUNTS,
            counts_said="2 to 8 (one host), or a multiple of 8 up to 4096 (hosts of 8)",
            topology=_gpu("b200.txtpb")),
)}


@dataclasses.dataclass(frozen=True)
class Target:
  """The devices a run's meshes are built from, and whose compiler compiles them."""
  name: str                     # the profile ("" = this host's own devices)
  compiler: str                 # "XLA:TPU", "XLA:GPU", "XLA:CPU"
  platform: str                 # the devices' platform: "tpu", "gpu", "cpu"
  topology: str                 # as XLA was asked for it ("" for this host)
  devices: tuple

  def memory_label(self) -> str:
    """Whose memory a compile-only report shows (`memory_label`)."""
    return memory_label(self.compiler, self.name, len(self.devices))


def memory_label(compiler: str, name: str, n: int) -> str:
  """`XLA:TPU (tpu-v5p, 64 devices)` for target `name`, `XLA:CPU` for this host's (name "")."""
  return f"{compiler} ({name}, {n} devices)" if name else compiler


def profile(name: str) -> Profile:
  """The profile `name`, or one-line ConfigError for an unknown one."""
  if name not in PROFILES:
    raise ConfigError(f"--target={name}: unknown target; choose from {', '.join(PROFILES)}")
  return PROFILES[name]


def check(name: str, n: int) -> Profile:
  """The profile `name` for n devices, judged before JAX starts: an unknown name, a count the
  profile does not make, or its package missing -> one-line ConfigError."""
  p = profile(name)
  if n not in p.counts:
    raise ConfigError(f"--target={name} --devices={n}: {name} makes {p.counts_said} devices")
  if not any(_importable(m) for m in p.packages):
    raise ConfigError(f"--target={name} needs {p.needs}: pip install -r {p.requirements}")
  return p


def _importable(module: str) -> bool:
  """Whether `module` can be imported (its parent package too), without importing it."""
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):
    return False


def configure(name: str) -> None:
  """Before JAX starts its backends: this host compiles with the CPU as its own backend; libtpu
  reads the topology it is given instead of probing this host (TPU_SKIP_MDS_QUERY and the
  host's bounds, left as set where set) and neither takes nor waits for its one-process lock
  (/tmp/libtpu_lockfile, which guards a chip this host does not have: two compiles for a TPU
  run side by side); XLA:GPU gets GPU_FLAGS; no persistent cache."""
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_enable_compilation_cache", False)
  if PROFILES[name].compiler == "XLA:TPU":
    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                       ("TPU_HOST_BOUNDS", "1,1,1"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
      os.environ.setdefault(key, value)
  else:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + GPU_FLAGS).strip()


def devices(name: str, n: int) -> Target:
  """n compile-only devices of profile `name` (checked by `check`; `configure` done)."""
  from jax.experimental import topologies
  kwargs = PROFILES[name].topology(n)
  topo = topologies.get_topology_desc(**kwargs)
  devs = tuple(topo.devices)
  if len(devs) != n:
    raise ConfigError(f"--target={name}: XLA made {len(devs)} devices for {n}")
  return Target(name, PROFILES[name].compiler, devs[0].platform,
                kwargs.get("topology_name") or kwargs["topology"], devs)


_HBM_OOM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM "
                      r"\(([\d.]+)([KMGT])\)")


class OverHBM(Exception):
  """A target's compiler refused the step: its temporaries exceed a device's HBM (one line,
  exit status 1: `run.py --compile_only --target`)."""


def hbm_oom(error: Exception) -> tuple[float, float] | None:
  """XLA:TPU refuses to compile a program whose temporaries exceed the chip's HBM
  (RESOURCE_EXHAUSTED, E1000 CompileTimeHbmOom: "the total memory required for HLO temporaries
  (113.60G) exceeds available HBM (95.73G)", binary units). -> (the temp bytes it needs, the
  bytes it has), or None for any other error."""
  m = _HBM_OOM.search(str(error))
  if m is None:
    return None
  scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
  return float(m[1]) * scale[m[2]], float(m[3]) * scale[m[4]]


def host(devs) -> Target:
  """This host's own devices (no --target): XLA:CPU, XLA:GPU or XLA:TPU as they are."""
  platform = devs[0].platform
  return Target("", {"cpu": "XLA:CPU", "gpu": "XLA:GPU", "tpu": "XLA:TPU"}.get(
      platform, f"XLA:{platform.upper()}"), platform, "", tuple(devs))


def without_accelerator() -> bool:
  """Whether this host shows no TPU, NVIDIA or AMD GPU (jax's own probes of the PCI bus and
  device nodes). With libtpu or a CUDA plugin installed, jax would otherwise start them on such
  a host, warn and fall back to the CPU."""
  try:
    from jax._src import hardware_utils as hw
    return (hw.num_available_tpu_chips_and_device_id()[0] == 0 and not hw.has_visible_nvidia_gpu()
            and hw.num_available_amd_gpus(stop_at=1) == 0)
  except (ImportError, AttributeError, OSError):
    return False
