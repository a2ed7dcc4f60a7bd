"""What run.py's flags ask for, judged and built before anything compiles: the one-line
checks (UsageError, exit status 2), the strategies and their options, the model's Config, the
devices. Each function takes absl's FLAGS (`F`) as run.py defines them."""
from __future__ import annotations

import math
import os
import sys

from absl import flags

from modeling.config import ConfigError

# Simulated CPU devices cost host memory and compile time: 2048 of them compiled a DeepSeek-V3
# layout in 1.6 GB of host memory (shared/notes/field-2026.md); this bound is checked before JAX
# starts, so a typo never builds a runtime that grows without end.
MAX_DEVICES = 4096

# Flags that strategy options replaced: each is refused with its --opt form.
RETIRED = {"dispatch": "--opt=exchange=VALUE (ep)",
           "dispatch_batch_on_expert": "--opt=exchange=none (ep)",
           "expert_fsdp_mode": "--opt=mode=VALUE (shard_exp_on_fsdp)",
           "ep_tp_capacity": "--opt=capacity=VALUE (ep_tp)",
           "context_sharding": "nothing: cp shards the sequence over `context`, ep_as_cp over "
                               "`expert`"}


class UsageError(Exception):
  """Bad input, found before anything compiles: one `error:` line, exit status 2."""


class MemoryParser(flags.FloatParser):
  """A memory size -> GiB (2^30 B): a plain number is GiB; a unit says which: 80GB (10^9 B:
  74.5 GiB), 74.5GiB, 512MiB, 1TB."""
  UNITS = {"gib": 2**30, "gb": 1e9, "mib": 2**20, "mb": 1e6, "tib": 2**40, "tb": 1e12}

  def parse(self, argument):
    if isinstance(argument, str):
      text = argument.strip().lower().replace(" ", "")
      for unit, size in sorted(self.UNITS.items(), key=lambda u: -len(u[0])):
        if text.endswith(unit):
          return super().parse(text[:-len(unit)]) * size / 2**30
    return super().parse(argument)


def retired(argv: list[str]) -> None:
  """A retired flag in argv -> UsageError naming what replaced it."""
  for a in argv[1:]:
    name = a.lstrip("-").split("=")[0]
    name = name[2:] if name.startswith("no") and name[2:] in RETIRED else name
    if a.startswith("--") and name in RETIRED:
      raise UsageError(f"--{name} is retired: give {RETIRED[name]}")


def check_flags(F):
  """Every flag value that can be judged without JAX, before anything compiles -> the
  jax.distributed arguments of a multi-process run (None: one process)."""
  from runtime import distributed
  dist = distributed.settings(F.coordinator_address, F.num_processes, F.process_id)
  if dist is not None and not F.strategy:
    raise UsageError("multi-process runs need --strategy (compare mode is single-process)")
  if dist is not None and F.strategy == "reference":
    raise UsageError("the reference runs on one device: not multi-process")
  if not 1 <= F.devices <= MAX_DEVICES:
    raise UsageError(f"--devices={F.devices} must be in [1, {MAX_DEVICES}] (simulated CPU devices)")
  if dist is None and F.devices == 1 and F.strategy != "reference":
    raise UsageError("--devices=1: one device is the reference's layout (--strategy=reference); "
                     "the strategies need 2 or more (on one device XLA drops the sharding "
                     "constraints their unreduced gradient types are checked against)")
  if F.steps is not None and F.steps < 0:
    raise UsageError(f"--steps={F.steps} must be >= 0")
  if F.steps == 0 and not F.strategy:
    raise UsageError("--steps=0 in compare mode: use --compile_only to compare without running")
  check_sizes(F, ("batch", "seq", "layers", "microbatches"))
  if F.lr is not None and not (math.isfinite(F.lr) and F.lr > 0):
    raise UsageError(f"--lr={F.lr} must be a finite number > 0")
  if F.adam_eps is not None and not (math.isfinite(F.adam_eps) and F.adam_eps > 0):
    raise UsageError(f"--adam_eps={F.adam_eps} must be a finite number > 0")
  if not (math.isfinite(F.capacity_factor) and F.capacity_factor >= 0):
    raise UsageError(f"--capacity_factor={F.capacity_factor} must be a finite number >= 0")
  if F.hbm_gb is not None:
    if not F.compile_only:
      raise UsageError("--hbm_gb needs --compile_only (the fit table is a compile-only study)")
  if F.hlo_stats and not F.strategy:
    raise UsageError("--hlo_stats is for --strategy: the comparison table shows every strategy's "
                     "collectives (add --breakdown for them per kind, axes and phase)")
  if F.full_parity and (F.strategy or F.compile_only):
    raise UsageError("--full_parity is a compare-mode check against the reference: it needs "
                     "steps to run, and no --strategy")
  if F.mesh == "search" and (F.strategy or not F.compile_only or F.hbm_gb is None):
    raise UsageError("--mesh=search is a compare-mode study: it needs --compile_only and --hbm_gb "
                     "(and no --strategy)")
  if F.metrics_file:                         # fail now, not after a long compile
    d = os.path.dirname(os.path.abspath(F.metrics_file))
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
      raise UsageError(f"--metrics_file={F.metrics_file}: directory {d} does not exist or "
                       "is not writable")
  if F.target is not None:
    check_target(F, dist)
  if F.compile_only and (F.checkpoint_dir or F.metrics_file and not F.strategy):
    raise UsageError("--compile_only runs no step: it takes no --checkpoint_dir (and in compare "
                     "mode no --metrics_file; --report_dir writes the table)")
  if F.overwrite_checkpoint and not F.checkpoint_dir:
    raise UsageError("--overwrite_checkpoint needs --checkpoint_dir")
  if F.save_every < 0:
    raise UsageError(f"--save_every={F.save_every} must be >= 0")
  if (F.checkpoint_dir or F.restore) and not F.strategy:
    raise UsageError("--checkpoint_dir and --restore need --strategy")
  check_hf_flags(F)
  if F.restore is not None:
    if not F.checkpoint_dir:
      raise UsageError("--restore needs --checkpoint_dir")
    if F.restore != "latest" and not F.restore.isdigit():
      raise UsageError(f"--restore={F.restore}: expected 'latest' or a step number")
    if os.path.exists(F.checkpoint_dir) and not os.path.isdir(F.checkpoint_dir):
      raise UsageError(f"--checkpoint_dir={F.checkpoint_dir} is a file, not a directory")
    if not os.path.isdir(F.checkpoint_dir):
      raise UsageError(f"--checkpoint_dir={F.checkpoint_dir} does not exist")
  for flag in ("checkpoint_dir", "report_dir"):
    if getattr(F, flag):
      writable_dir(flag, getattr(F, flag))
  return dist


def check_target(F, dist=None) -> None:
  """--target=NAME (runtime/target.py): a compile-only study, compare mode's or one strategy's,
  single-process, of --devices devices the profile makes, its package installed; one line
  otherwise, before JAX starts. With --plan the target's compiler compiles the best
  --plan_compile candidates: the target is the --cluster's chip (--cluster defaults to it)."""
  from runtime import target
  target.profile(F.target)
  if F.attention == "cudnn":
    raise UsageError(f"--attention=cudnn is not compiled for --target={F.target}: jax asks the "
                     "installed cuDNN for its version as it lowers; use --attention=chunked")
  if F.plan:
    if not F["cluster"].present:
      F.cluster = plan_cluster(F.target)
    elif plan_cluster(F.target, F.cluster) != F.cluster:
      raise UsageError(f"--target={F.target} compiles for another chip than --cluster={F.cluster}")
    if F.plan_compile < 1:
      raise UsageError(f"--target={F.target} with --plan compiles its best candidates: it needs "
                       f"--plan_compile >= 1 (given {F.plan_compile})")
    target.check(F.target, F.devices)
    return
  if not F.compile_only:
    raise UsageError(f"--target={F.target} compiles for hardware this host lacks: it needs "
                     "--compile_only (nothing can run on the target's devices)")
  if F.strategy == "reference":
    raise UsageError(f"--target={F.target} compiles a strategy's mesh; the reference runs on "
                     "one device of this host")
  if dist is not None:
    raise UsageError(f"--target={F.target} compiles on this host alone: not multi-process")
  target.check(F.target, F.devices)


def plan_target(F) -> str | None:
  """--plan without --target on a TPU cluster: the cluster's chip compiles the --plan_compile
  candidates, as the temp model it predicts with is XLA:TPU's, when this host can compile for it
  (its target profile makes --devices devices and libtpu is installed); None otherwise (XLA:CPU
  compiles them, and planning/cli.py says the two compilers differ)."""
  from planning import clusters
  from runtime import target
  c = clusters.PROFILES.get(F.cluster)
  if (c is None or c.temp_model != "XLA:TPU" or F.plan_compile < 1
      or F.cluster not in target.PROFILES):
    return None
  try:
    target.check(F.cluster, F.devices)
  except ConfigError:
    return None
  return F.cluster


def plan_cluster(target_name: str, cluster: str | None = None) -> str:
  """The planner's cluster profile (planning/clusters.py) of --target's chip: the one of that
  name, or `cluster` when given and it is that chip (h800: an H100 with fewer NVLinks). One line
  when the planner has no profile of the chip."""
  from planning import clusters
  if cluster in {"h100": ("h100", "h800")}.get(target_name, (target_name,)):
    return cluster
  if target_name not in clusters.PROFILES:
    raise UsageError(f"--target={target_name} with --plan: the planner has no cluster profile of "
                     f"{target_name} (it has {', '.join(clusters.PROFILES)})")
  return target_name


def check_hf_flags(F) -> None:
  """--init_from=DIR (a Hugging Face checkpoint: the model and the starting weights) and
  --export_hf=DIR (the trained weights, written after the last step): what can be judged
  without JAX. --init_from makes DIR the model (--model omitted, or naming DIR or its
  config.json); its tensors are checked against it in runtime/session.py, before compiling."""
  from modeling import convert, export_hf
  src, out = F.init_from, F.export_hf
  if out is not None and not F.strategy:
    raise UsageError("--export_hf needs --strategy (compare mode trains one copy per row)")
  if src is not None and F.compile_only:
    raise UsageError("--init_from loads weights a --compile_only run never allocates: give "
                     "--model=DIR to compile its shapes")
  if out is not None and F.compile_only:
    raise UsageError("--export_hf writes the trained weights: --compile_only trains none")
  if src is not None:
    if F.restore is not None:
      raise UsageError("--init_from and --restore both give the starting weights: give one")
    if not os.path.isdir(src):
      raise UsageError(f"--init_from={src} is not a directory (a Hugging Face checkpoint: "
                       "config.json + safetensors)")
    try:
      convert.read_config(src)
      export_hf.checkpoint_files(src)
    except (ValueError, KeyError, OSError) as e:
      raise UsageError(f"--init_from={src}: {e}") from None
    if F["model"].present:
      same = {os.path.realpath(src), os.path.realpath(os.path.join(src, "config.json"))}
      if os.path.realpath(F.model) not in same:
        raise UsageError(f"--model={F.model} and --init_from={src} name different models: "
                         "omit --model (the model is the checkpoint's config.json)")
    F.model = src
  if out is not None:
    if F.layer_layout:
      raise UsageError(f"--export_hf: --layer_layout={F.layer_layout} pads the MoE stack, which "
                       "has no Hugging Face form; export from a run without it")
    if src is not None and os.path.realpath(src) == os.path.realpath(out):
      raise UsageError(f"--export_hf={out} is --init_from's directory: write a new one")
    if os.path.isdir(out) and any(n == "config.json" or n.endswith(".safetensors")
                                  or n.endswith(".safetensors.index.json") for n in os.listdir(out)):
      raise UsageError(f"--export_hf={out} already holds a checkpoint: give an empty or new "
                       "directory")
    writable_dir("export_hf", out)


def check_sizes(F, names) -> None:
  """The size flags `names`, each >= 1 where given, and --hbm_gb a finite number > 0 (the checks
  --plan's flags share: planning/cli.py)."""
  for name in names:
    v = getattr(F, name)
    if v is not None and v < 1:
      raise UsageError(f"--{name}={v} must be >= 1")
  if F.hbm_gb is not None and not (math.isfinite(F.hbm_gb) and F.hbm_gb > 0):
    raise UsageError(f"--hbm_gb={F.hbm_gb} must be a finite number > 0")


def strategy_names(F) -> list[str]:
  """The strategies this run builds: --strategy, or --compare's list ('all': every one)."""
  import strategies
  if F.strategy:
    strategies.get(F.strategy)                 # unknown name -> one-line error
    return [F.strategy]
  names = F.compare or "all"
  wanted = ([e for n in strategies.available() for e in strategies.compare_entries(n)]
            if names == "all" else [n.strip() for n in names.split(",") if n.strip()])
  for n in wanted:
    strategies.split_entry(n)                  # unknown name or bad option pair -> one line
  return wanted


def strategy_options(F, names: list[str]) -> dict:
  """{name: its Options} from --opt (one-line errors, before JAX starts)."""
  from layout import options
  import strategies
  pairs = options.split(F.opt)
  return strategies.parse_options(names, pairs)


def writable_dir(flag: str, path: str) -> None:
  """Create --flag's directory now, or stop with one line, before anything compiles."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise UsageError(f"--{flag}={path} is a file, not a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise UsageError(f"--{flag}={path}: {e.strerror}") from None
  if not os.access(path, os.W_OK):
    raise UsageError(f"--{flag}={path} is not writable")


def make_config(F):
  """The model preset with the flags' overrides (one-line ConfigError on a bad value)."""
  from modeling.config import get_config
  over = dict(optimizer=F.optimizer, capacity_factor=F.capacity_factor, seed=F.seed,
              gmm_backend=F.gmm, microbatches=F.microbatches,
              remat=F.remat, dtype=F.dtype, grad_reduce_dtype=F.grad_reduce_dtype)
  for flag, key in (("batch", "batch"), ("seq", "seq_len"), ("layers", "n_layers"), ("lr", "lr"),
                    ("adam_eps", "adam_eps"), ("aux_loss_kind", "aux_loss_kind"),
                    ("attention", "attention_impl"), ("attention_chunk", "attention_chunk"),
                    ("layer_layout", "layer_layout")):
    if getattr(F, flag) is not None:
      over[key] = getattr(F, flag)
  if F.data:
    over["data"] = F.data                      # a token file: runtime.data.check_run reads it
  from modeling import gmm
  if F.gmm == "mgpu":
    import kernels.mgpu  # noqa: F401  (registers the Hopper kernel and wgrad with modeling.gmm)
  try:
    gmm.resolve_backend(F.gmm)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  try:
    return get_config(F.model, **over)         # --init_from=DIR: F.model is DIR (check_hf_flags)
  except ConfigError as e:
    said = f"--model={F.model}:"
    if F.init_from and str(e).startswith(said):
      raise ConfigError(f"--init_from={F.init_from}:" + str(e)[len(said):]) from None
    raise


def host_backend_only() -> None:
  """On a host with no accelerator and JAX_PLATFORMS unset, JAX starts only its CPU backend:
  an installed libtpu or CUDA plugin is not probed for (each would log a failed start on
  stderr). Before anything starts a backend."""
  import jax
  from runtime import target
  if not jax.config.jax_platforms and target.without_accelerator():
    jax.config.update("jax_platforms", "cpu")


def setup_devices(n: int, dist, cache: str = "", target_name: str | None = None):
  """-> the Target whose devices the run's meshes are built from (runtime/target.py): with
  target_name, n compile-only devices of that profile (no persistent cache); else this host's
  own, n CPU devices per process, the multi-process runtime started first when asked (dist);
  cache: the persistent compilation cache's directory ('' = off). On a host with no accelerator
  and JAX_PLATFORMS unset, JAX starts only its CPU backend: an installed libtpu or CUDA plugin is
  not probed for."""
  import jax
  from runtime import target
  if target_name:
    target.configure(target_name)
    return target.devices(target_name, n)
  host_backend_only()
  jax.config.update("jax_num_cpu_devices", n)
  if cache:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    # a size limit turns on the cache's file lock: concurrent runs never read a half-written
    # entry (jax writes entries in place; XLA:CPU crashed on a partial one)
    jax.config.update("jax_compilation_cache_max_size", 64 * 2**30)
  if dist is not None:
    from runtime import distributed
    distributed.initialize(dist)
  if jax.default_backend() == "cpu" and jax.local_device_count() != n:
    raise UsageError(f"asked for {n} CPU devices, got {jax.local_device_count()}")
  return target.host(jax.devices())


def compile_only_gmm(F, cfg, devices):
  """--compile_only on XLA:CPU without --gmm: the grouped matmul lowers through `scan`, whose
  buffers are what a grouped-matmul kernel holds (XLA:CPU densifies ragged_dot into an
  [E, M, K] buffer no accelerator allocates), as the planner compiles. Said on stderr. For a
  --target (devices: its Target), the default ragged_dot is the target compiler's own lowering,
  kept, and said."""
  if not F.compile_only or F["gmm"].present:
    return cfg
  if devices.platform != "cpu":
    if devices.name:
      print(f"note: --compile_only for {devices.name}: gmm {cfg.gmm_backend}, as "
            f"{devices.compiler} lowers it (no --gmm=scan stand-in)", file=sys.stderr)
    return cfg
  print("note: --compile_only on XLA:CPU: gmm scan (XLA:CPU densifies ragged_dot over the "
        "experts, memory no kernel holds); --gmm=ragged_dot compiles that instead",
        file=sys.stderr)
  return cfg.replace(gmm_backend="scan")
