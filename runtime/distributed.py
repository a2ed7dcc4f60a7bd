"""Multi-process runs on JAX's own runtime (jax.distributed).

Every process runs the same program: it builds the same global batch (runtime/data.py is
deterministic), feeds only its addressable shards (parallel/sharding.put) and sees the global
mesh. `initialize` must run before anything touches JAX devices. On CPU the processes talk
through gloo (jax_cpu_collectives_implementation); each contributes its own local devices.
"""
from __future__ import annotations

import os
import re

from modeling.config import ConfigError

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def settings(coordinator_address: str | None, num_processes: int | None,
             process_id: int | None) -> dict | None:
  """Validated jax.distributed.initialize arguments, or None for a single-process run.
  Flags first, then JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; with none of
  them, a cluster JAX detects itself (SLURM, Open MPI, TPU pods, ...) gives {} (auto-detect)."""
  addr = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  n, pid = num_processes, process_id
  for name, env, v in (("num_processes", "JAX_NUM_PROCESSES", n), ("process_id", "JAX_PROCESS_ID", pid)):
    if v is None and os.environ.get(env):
      if not os.environ[env].strip().isdigit():
        raise ConfigError(f"{env}={os.environ[env]!r} must be an integer")
      if name == "num_processes":
        n = int(os.environ[env])
      else:
        pid = int(os.environ[env])
  if addr is None and n is None and pid is None:
    return {} if _cluster_detected() else None
  if n is not None and n < 1:
    raise ConfigError(f"--num_processes={n} must be >= 1")
  if pid is not None and (pid < 0 or (n is not None and pid >= n)):
    raise ConfigError(f"--process_id={pid} must be in [0, --num_processes={n})")
  if addr is not None and not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", addr):
    raise ConfigError(f"--coordinator_address={addr!r}: expected host:port")
  if (addr is None or n is None or pid is None) and not _cluster_detected():
    raise ConfigError("multi-process needs --coordinator_address, --num_processes and "
                      "--process_id (or a cluster JAX detects)")
  if n == 1 and addr is None:
    return None
  return {k: v for k, v in (("coordinator_address", addr), ("num_processes", n),
                            ("process_id", pid)) if v is not None}


def _cluster_detected() -> bool:
  """A launcher environment jax.distributed.initialize() would auto-detect (SLURM, MPI, TPU)."""
  try:
    from jax._src import clusters  # private; absent -> no auto-detection
    return any(not c.opt_in_only_method and c.is_env_present()
               for c in clusters.ClusterEnv._cluster_types)
  except Exception:                                   # noqa: BLE001
    return False


def initialize(kw: dict) -> None:
  """Start the runtime (before any device is touched). CPU collectives go through gloo."""
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU backend only
  jax.distributed.initialize(**kw)


def is_main() -> bool:
  """Process 0 prints, writes the metrics file and reports."""
  import jax
  return jax.process_index() == 0
