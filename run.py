"""moe-sharding command line.

  python run.py                                   # compare every strategy (8 simulated CPU devices)
  python run.py --strategy=ep --mesh=data:2,expert:4 --steps=3 --metrics_file=m.jsonl
  python run.py --compare=dp,ep --model=deepseek-test --report_dir=report
  python run.py --compare=all --devices=64 --model=mixtral-8x7b --compile_only
  python run.py --strategy=ep --mesh=data:2,expert:4 --devices=4 \
      --coordinator_address=127.0.0.1:1234 --num_processes=2 --process_id=0   # and =1
  python run.py --strategy=ep --steps=3 --checkpoint_dir=ck                # then, any strategy:
  python run.py --strategy=fsdp --steps=2 --checkpoint_dir=ck --restore=latest
  python run.py --strategy=ep --opt=dispatch=none                          # a strategy's options
  python run.py --plan --model=mixtral-8x7b --devices=64 --cluster=h100   # rank layouts (planning/)
"""
from __future__ import annotations

import json
import os
import sys

from absl import app, flags

F = flags.FLAGS
flags.DEFINE_string("strategy", None, "strategy to train (see strategies/); omit to compare all")
flags.DEFINE_string("compare", None, "'all' or a comma list of strategies to compare; an "
                    "entry may carry its own options, NAME:key=value[:key=value] (e.g. "
                    "cp:kv_exchange=ring), which override --opt's for that row")
flags.DEFINE_string("model", "tiny", "model preset: tiny | mixtral-test | deepseek-test (these run "
                    "on CPU) | mixtral-8x7b | deepseek-v2-lite | deepseek-v3 (real shapes: "
                    "--compile_only on CPU)")
flags.DEFINE_integer("steps", None, "steps to run (after --restore: more steps; default 20; 3 in compare mode; 0 = compile "
                     "and report only)")
flags.DEFINE_integer("batch", None, "global batch (sequences); default from the preset")
flags.DEFINE_integer("seq", None, "sequence length; default from the preset")
flags.DEFINE_integer("layers", None, "override the number of layers")
flags.DEFINE_string("layer_layout", None, "pp: MoE layers per stage, in depth order, e.g. 4,4,3 "
                    "(stages may differ; the stack is padded to the largest with inert rows). "
                    "Default: L / P each; the reference takes it too, other strategies refuse it")
flags.DEFINE_integer("microbatches", 1, "M microbatches per step, one optimizer update: gradient "
                     "accumulation (each microbatch sharded like the batch); pp: its pipeline's")
flags.DEFINE_string("mesh", None, "e.g. data:2,expert:4; omitted axes get size 1; "
                    "no flag = all devices on the strategy's main axis; 'search' (compare with "
                    "--compile_only --hbm_gb): per strategy, the mesh over its axes that fits "
                    "(compare.py search)")
flags.DEFINE_integer("devices", 8, "simulated CPU devices per process (ignored on GPU/TPU hosts)")
flags.DEFINE_string("remat", "none", "jax.checkpoint of each layer: none | block (recompute the "
                    "layer) | dots_saveable | dots_with_no_batch_dims_saveable (jax policies)")
flags.DEFINE_string("dtype", "float32", "compute dtype: float32 | bfloat16 (mixed precision: "
                    "float32 master params and optimizer state; router, norms, losses in float32)")
flags.DEFINE_string("grad_reduce_dtype", "float32", "with --dtype=bfloat16: the dtype weight "
                    "gradients are summed across devices in: float32 | bfloat16")
flags.DEFINE_enum("optimizer", "adamw", ["adamw", "muon"], "optimizer")
flags.DEFINE_float("lr", None, "learning rate")
flags.DEFINE_float("adam_eps", None, "Adam epsilon (default from the preset, 1e-8)")
flags.DEFINE_float("capacity_factor", 0.0, "expert capacity factor; 0 = dropless")
flags.DEFINE_string("attention", None, "the attention core: xla (scores [B, H, S, T] "
                    "materialised) | chunked (online softmax over key chunks, memory linear in S) "
                    "| cudnn (GPU, GQA: jax.nn.dot_product_attention); default from the preset")
flags.DEFINE_integer("attention_chunk", None, "keys per chunk of --attention=chunked (default 512)")
flags.DEFINE_string("aux_loss_kind", None, "load-balance loss: batch (f, P over the step's tokens) "
                    "| sequence (per sequence, DeepSeek-V3's); default from the preset")
flags.DEFINE_integer("seed", 0, "init and data seed")
flags.DEFINE_string("gmm", "ragged_dot", "grouped-matmul backend: ragged_dot (= auto) | padded | "
                    "custom | scan (exact, one expert at a time: for compile-only memory studies "
                    "on CPU) | mgpu (Hopper kernels, opt-in: unmeasured on hardware)")
flags.DEFINE_string("opt", None, "the strategy's own options, key=value,... (each strategy's "
                    "Options in strategies/NAME.py; e.g. ep: dispatch=a2a|ragged|none, "
                    "shard_exp_on_fsdp: mode=gather|ep, ep_tp: capacity=0..1)")
# Earlier flags, kept as aliases of strategy options: this table is the only place they live.
flags.DEFINE_string("dispatch", None, "alias of --opt=dispatch=... (ep)")
flags.DEFINE_bool("dispatch_batch_on_expert", None, "alias of --opt=dispatch=none (ep)")
flags.DEFINE_string("expert_fsdp_mode", None, "alias of --opt=mode=... (shard_exp_on_fsdp)")
flags.DEFINE_string("ep_tp_capacity", None, "alias of --opt=capacity=... (ep_tp)")
flags.DEFINE_string("context_sharding", None, "accepted for old commands: cp plays context "
                    "parallelism on `context`, ep_as_cp on `expert`, always")
ALIASES = {"dispatch": lambda v: ("dispatch", v),
           "dispatch_batch_on_expert": lambda v: ("dispatch", "none") if v else None,
           "expert_fsdp_mode": lambda v: ("mode", v),
           "ep_tp_capacity": lambda v: ("capacity", v)}
# Simulated CPU devices cost host memory and compile time: 2048 of them compiled a DeepSeek-V3
# layout in 1.6 GB of host memory (shared/notes/field-2026.md); this bound is checked before JAX
# starts, so a typo never builds a runtime that grows without end.
MAX_DEVICES = 4096
flags.DEFINE_string("metrics_file", None, "write JSON lines: one per step, then a summary")
flags.DEFINE_bool("describe", False, "print the model's total and activated-per-token parameter "
                  "counts (total_params N, activated_params N) and exit, compiling nothing")
flags.DEFINE_bool("dump_sharding", False, "print every parameter's and key activation's sharding")
flags.DEFINE_bool("hlo_stats", False, "with --strategy: print collectives, flops and memory of "
                  "the compiled step (the comparison table shows them for every strategy)")
flags.DEFINE_bool("compile_only", False, "compile from abstract shapes and report collectives and "
                  "memory without running (no parameter is allocated); compare mode or --strategy")
flags.DEFINE_bool("breakdown_all", False, "--breakdown naming every cost term in its 'what' "
                  "column (implies --breakdown)")
flags.DEFINE_bool("breakdown", False, "print each strategy's bytes per (kind, axes, phase) and per "
                  "layer: the cost model's named terms beside the compiled program's")
flags.DEFINE_bool("full_parity", False, "compare mode: hold every gradient and post-step parameter "
                  "to the reference's, not only the losses (Adam eps 1e-5 unless --adam_eps)")
flags.DEFINE_bool("overwrite_checkpoint", False, "let a run delete the steps of --checkpoint_dir "
                  "its saves would collide with (without it, such a run is refused)")


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


flags.DEFINE(MemoryParser(), "hbm_gb", None, "with --compile_only (and --plan): per-device memory to fit in, "
             "in GiB (2^30 B) or with a unit: 80GB (10^9 B = 74.5 GiB, an '80 GB' card), "
             "74.5GiB, 512MiB; adds total/dev = params + optimizer + XLA temp, and whether it "
             "fits", serializer=flags.ArgumentSerializer())
flags.DEFINE_string("report_dir", None, "compare mode: write table.json, table.csv and PNG plots here")
flags.DEFINE_string("coordinator_address", None, "multi-process: host:port of process 0's "
                    "coordinator (default: $JAX_COORDINATOR_ADDRESS or the cluster's)")
flags.DEFINE_integer("num_processes", None, "multi-process: number of processes")
flags.DEFINE_integer("process_id", None, "multi-process: this process's id in [0, num_processes)")
flags.DEFINE_string("checkpoint_dir", None, "save (and --restore) orbax checkpoints here")
flags.DEFINE_integer("save_every", 0, "save every N steps (0 = only after the last step)")
flags.DEFINE_string("restore", None, "'latest' or a step: resume from --checkpoint_dir, in any "
                    "strategy and mesh (same model and --optimizer)")
flags.DEFINE_bool("plan", False, "rank every admissible layout of --model on --devices devices of "
                  "--cluster by predicted step time, among those whose predicted memory fits "
                  "--hbm_gb (default: the cluster's), then compile the best --plan_compile "
                  "(planning/). Given with it, --strategy / --compare, --mesh, --microbatches, "
                  "--remat (none | block), --capacity_factor, --opt=key=value and --layer_layout "
                  "(pp only) restrict what it enumerates to their values")
flags.DEFINE_string("cluster", "h100", "--plan: the cluster profile (planning/clusters.py): h100 | h800")
flags.DEFINE_integer("plan_compile", 2, "--plan: compile (compile only) this many of the best "
                     "layouts and print predicted vs compiled memory and bytes (0 = none)")
flags.DEFINE_integer("plan_top", 15, "--plan: rows of the ranked table to print")
flags.DEFINE_string("plan_find", None, "--plan: also print where one layout ranks, or why it "
                    "was refused: STRATEGY@MESH, e.g. pp@stage:16,data:2,expert:64")
flags.DEFINE_float("plan_efficiency", 0.5, "--plan: the fraction of peak FLOP/s the step's "
                   "matmuls are assumed to reach")
flags.DEFINE_string("compilation_cache", "~/.cache/moe-sharding/jax",
                    "persistent XLA compilation cache ('' = off); reruns skip compiles")


class UsageError(Exception):
  pass


def check_plan_flags():
  """--plan's flags, judged before JAX starts. --strategy / --compare, --mesh, --microbatches,
  --remat, --capacity_factor, --opt and --layer_layout restrict what it enumerates (plan()
  checks them against the strategies, planning/constraints.py); a training run's flags are
  errors."""
  import math

  from planning import clusters
  for flag in ("coordinator_address", "num_processes", "process_id", "checkpoint_dir",
               "restore", "metrics_file", "steps"):
    if getattr(F, flag) is not None:
      raise UsageError(f"--{flag} does not apply to --plan (it ranks layouts and trains none)")
  for flag in ALIASES:
    if getattr(F, flag) is not None:
      raise UsageError(f"--{flag}: with --plan, give the strategy option as --opt=key=value")
  if F.compile_only or F.full_parity or F.breakdown or F.hlo_stats:
    raise UsageError("--plan compiles its best candidates itself (--plan_compile); it takes no "
                     "--compile_only, --full_parity, --breakdown or --hlo_stats")
  cluster = clusters.get(F.cluster)
  if not 2 <= F.devices <= MAX_DEVICES:
    raise UsageError(f"--devices={F.devices} must be in [2, {MAX_DEVICES}] for --plan")
  if F.devices % cluster.node_size and cluster.node_size % F.devices:
    raise UsageError(f"--devices={F.devices}: whole nodes of {cluster.node_size} "
                     f"({cluster.name}), or part of one")
  for name in ("batch", "seq", "layers"):
    v = getattr(F, name)
    if v is not None and v < 1:
      raise UsageError(f"--{name}={v} must be >= 1")
  if F.hbm_gb is not None and not (math.isfinite(F.hbm_gb) and F.hbm_gb > 0):
    raise UsageError(f"--hbm_gb={F.hbm_gb} must be a finite number > 0")
  if F.plan_compile < 0:
    raise UsageError(f"--plan_compile={F.plan_compile} must be >= 0")
  if F.plan_top < 1:
    raise UsageError(f"--plan_top={F.plan_top} must be >= 1")
  if not (math.isfinite(F.plan_efficiency) and 0 < F.plan_efficiency <= 1):
    raise UsageError(f"--plan_efficiency={F.plan_efficiency} must be in (0, 1]")
  if F.report_dir:
    _writable_dir("report_dir", F.report_dir)
  return plan_find()


def plan_find():
  """--plan_find=STRATEGY@MESH -> (strategy, {axis: size}) or None; one-line errors."""
  import math

  from layout import mesh as mesh_lib
  import strategies
  if F.plan_find is None:
    return None
  name, sep, spec = F.plan_find.partition("@")
  if not sep:
    raise UsageError(f"--plan_find={F.plan_find}: expected STRATEGY@MESH, e.g. ep@fsdp:8,expert:8")
  strat = strategies.get(name)
  sizes = mesh_lib.parse_mesh_spec(spec)
  mesh_lib.mesh_shape(strat.AXES, strat.MAIN_AXIS, spec, math.prod(sizes.values()), name)
  if math.prod(sizes.values()) != F.devices:
    raise UsageError(f"--plan_find={F.plan_find} has {math.prod(sizes.values())} devices, "
                     f"not --devices={F.devices}")
  return name, sizes


def plan(argv_names, find) -> None:
  """--plan: the planner (planning/cli.py) on the model's config, bf16 unless --dtype, with a
  global batch of max(the preset's, --devices) sequences unless --batch, over the candidates
  its constraint flags leave (planning/constraints.py: a bad one is a one-line error, exit 2;
  constraints that leave no candidate, one line, exit 1)."""
  from modeling.config import PRESETS
  from planning import cli, constraints
  given = {f: getattr(F, f) if F[f].present else None
           for f in ("capacity_factor", "remat", "microbatches")}
  # make_config would hold --microbatches to the preset's batch; the candidates take M from the
  # constraints, each judged by check() on the batch planned here
  m, F.microbatches = F.microbatches, 1
  try:
    cfg = make_config()
  finally:
    F.microbatches = m
  if not F["dtype"].present:
    cfg = cfg.replace(dtype="bfloat16")
  source = "--batch"
  if F.batch is None:
    preset = PRESETS[F.model].batch
    cfg = cfg.replace(batch=max(preset, F.devices))
    source = f"max of the preset's {preset} and --devices={F.devices}"
  cfg = cfg.validate()
  chosen = (f"--strategy={F.strategy}" if F.strategy else
            f"--compare={F.compare}" if F.compare and F.compare != "all" else "")
  try:
    limits = constraints.build(F.devices, argv_names, strategy_names() if chosen else [],
                               chosen=chosen, mesh=F.mesh, opt=F.opt,
                               layer_layout=F.layer_layout, **given)
    cli.main(cfg, F.model, F.devices, F.cluster,
             None if F.hbm_gb is None else F.hbm_gb * 2**30, limits, F.plan_compile,
             F.plan_top, F.plan_efficiency, F.report_dir, lambda n: _setup_devices(n, None),
             find, batch_source=source)
  except constraints.NoCandidate as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


def check_flags():
  """Every flag value that can be judged without JAX, before anything compiles -> the
  jax.distributed arguments of a multi-process run (None: one process)."""
  import math
  import os

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
  for name in ("batch", "seq", "layers", "microbatches"):
    v = getattr(F, name)
    if v is not None and v < 1:
      raise UsageError(f"--{name}={v} must be >= 1")
  if F.lr is not None and not (math.isfinite(F.lr) and F.lr > 0):
    raise UsageError(f"--lr={F.lr} must be a finite number > 0")
  if F.adam_eps is not None and not (math.isfinite(F.adam_eps) and F.adam_eps > 0):
    raise UsageError(f"--adam_eps={F.adam_eps} must be a finite number > 0")
  if not (math.isfinite(F.capacity_factor) and F.capacity_factor >= 0):
    raise UsageError(f"--capacity_factor={F.capacity_factor} must be a finite number >= 0")
  if F.context_sharding not in (None, "context", "expert"):
    raise UsageError(f"--context_sharding={F.context_sharding}: cp plays context parallelism on "
                     "`context` and ep_as_cp on `expert`; the flag takes no other axis")
  if F.hbm_gb is not None:
    if not (math.isfinite(F.hbm_gb) and F.hbm_gb > 0):
      raise UsageError(f"--hbm_gb={F.hbm_gb} must be a finite number > 0")
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
  if F.compile_only and (F.checkpoint_dir or F.metrics_file and not F.strategy):
    raise UsageError("--compile_only runs no step: it takes no --checkpoint_dir (and in compare "
                     "mode no --metrics_file; --report_dir writes the table)")
  if F.overwrite_checkpoint and not F.checkpoint_dir:
    raise UsageError("--overwrite_checkpoint needs --checkpoint_dir")
  if F.save_every < 0:
    raise UsageError(f"--save_every={F.save_every} must be >= 0")
  if (F.checkpoint_dir or F.restore) and not F.strategy:
    raise UsageError("--checkpoint_dir and --restore need --strategy")
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
      _writable_dir(flag, getattr(F, flag))
  return dist


def strategy_names() -> list[str]:
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


def strategy_options(names: list[str]) -> dict:
  """{name: its Options} from --opt and the alias flags (one-line errors, before JAX starts)."""
  from layout import options
  import strategies
  pairs = options.split(F.opt)
  for flag, to_pair in ALIASES.items():
    value = getattr(F, flag)
    pair = None if value is None else to_pair(value)
    if pair is not None:
      if pair[0] in pairs and pairs[pair[0]] != pair[1]:
        raise UsageError(f"--{flag} and --opt={pair[0]}=... disagree")
      pairs[pair[0]] = pair[1]
  if pairs.get("dispatch") == "auto":
    pairs["dispatch"] = "a2a"                  # old commands' default: the checked a2a
  return strategies.parse_options(names, pairs)


def _writable_dir(flag: str, path: str) -> None:
  """Create --flag's directory now, or stop with one line, before anything compiles."""
  import os
  if os.path.exists(path) and not os.path.isdir(path):
    raise UsageError(f"--{flag}={path} is a file, not a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise UsageError(f"--{flag}={path}: {e.strerror}") from None
  if not os.access(path, os.W_OK):
    raise UsageError(f"--{flag}={path} is not writable")


class NonFinite(Exception):
  pass


class CheckFailed(Exception):
  """A check the run was asked for did not pass (exit status 1)."""


def compare_outcome(rows: list[dict], compile_only: bool) -> tuple[list[str], list[str]]:
  """Compare mode's exit status, from its rows -> (failures, skipped), each a list of
  `name: reason`. A failure: a row whose parity is not PASS (FAIL, NON-FINITE, or unchecked), a
  row that failed to trace or compile, and no strategy row measured at all. Skipped: a row whose
  strategy refused the model or mesh (its check() error); a failure too unless compile_only (a
  compile-only study reports what compiled)."""
  failures, skipped = [], []
  measured = [r for r in rows if "error" not in r and r["strategy"] != "reference"]
  for r in rows:
    name = r["strategy"]
    if "error" in r:
      (failures if r["error"].startswith("failed:") else skipped).append(f"{name}: {r['error']}")
    elif not compile_only and r.get("parity") != "PASS" and name != "reference":
      why = r.get("parity") or "parity not checked (the reference did not run)"
      if "nonfinite_step" in r:
        why = f"NON-FINITE at step {r['nonfinite_step']}"
      failures.append(f"{name}: {why}" + (f" ({r['parity_checked']})"
                                          if r.get("parity") == "FAIL" else ""))
  if not compile_only:
    failures += skipped
  if not measured:
    failures.append("nothing was compared: no strategy built" + ("" if compile_only
                                                                  else " and ran"))
  return failures, skipped


def _setup_devices(n: int, dist) -> None:
  """n CPU devices per process; starts the multi-process runtime first when asked (dist)."""
  import os

  import jax
  jax.config.update("jax_num_cpu_devices", n)
  if F.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(F.compilation_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    # a size limit turns on the cache's file lock: concurrent runs never read a half-written
    # entry (jax writes entries in place; XLA:CPU crashed on a partial one)
    jax.config.update("jax_compilation_cache_max_size", 64 * 2**30)
  if dist is not None:
    from runtime import distributed
    distributed.initialize(dist)
  if jax.default_backend() == "cpu" and jax.local_device_count() != n:
    raise UsageError(f"asked for {n} CPU devices, got {jax.local_device_count()}")


def make_config():
  from modeling.config import ConfigError, get_config
  over = dict(optimizer=F.optimizer, capacity_factor=F.capacity_factor, seed=F.seed,
              gmm_backend=F.gmm, microbatches=F.microbatches,
              remat=F.remat, dtype=F.dtype, grad_reduce_dtype=F.grad_reduce_dtype)
  for flag, key in (("batch", "batch"), ("seq", "seq_len"), ("layers", "n_layers"), ("lr", "lr"),
                    ("adam_eps", "adam_eps"), ("aux_loss_kind", "aux_loss_kind"),
                    ("attention", "attention_impl"), ("attention_chunk", "attention_chunk"),
                    ("layer_layout", "layer_layout")):
    if getattr(F, flag) is not None:
      over[key] = getattr(F, flag)
  from modeling import gmm
  if F.gmm == "mgpu":
    import kernels.mgpu  # noqa: F401  (registers the Hopper kernel and wgrad with modeling.gmm)
  try:
    gmm.resolve_backend(F.gmm)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return get_config(F.model, **over)


def compile_only_gmm(cfg):
  """--compile_only on XLA:CPU without --gmm: the grouped matmul lowers through `scan`, whose
  buffers are what a grouped-matmul kernel holds (XLA:CPU densifies ragged_dot into an
  [E, M, K] buffer no accelerator allocates), as the planner compiles. Said on stderr."""
  import jax
  if not F.compile_only or F["gmm"].present or jax.default_backend() != "cpu":
    return cfg
  print("note: --compile_only on XLA:CPU: gmm scan (XLA:CPU densifies ragged_dot over the "
        "experts, memory no kernel holds); --gmm=ragged_dot compiles that instead",
        file=sys.stderr)
  return cfg.replace(gmm_backend="scan")


def _host_bytes() -> int:
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_allocation(cfg, strat, mesh, opts=None) -> None:
  """Refuse, before anything is allocated, a run whose float32 parameters (built whole on the
  host by modeling.model.init_params) plus, on simulated CPU devices, every device's parameter
  and optimizer shards would not fit this host's memory: such a study is --compile_only."""
  import jax

  from measure import cost
  from modeling import model
  full = sum(cost.nbytes(l.shape) for l in model.param_leaves(cfg))           # numpy init
  need = full
  if jax.default_backend() == "cpu":
    specs = strat.param_specs(cfg, mesh, opts) if mesh is not None else None
    mem = cost.param_memory(model.init_params_shapes(cfg), specs, mesh, cfg.optimizer)
    need += (mem["param_bytes"] + mem["opt_bytes"]) * (mesh.size if mesh is not None else 1)
  have = _host_bytes()
  if need > 0.8 * have:
    raise UsageError(f"model {F.model} would allocate {need / 2**30:,.1f} GiB of float32 "
                     f"parameters and optimizer state on this host ({have / 2**30:.0f} GiB): "
                     "use --compile_only to study it without allocating")


def train_one(cfg, opts) -> None:
  import jax

  from layout import mesh as mesh_lib
  from measure import cost, hlo
  from modeling import model
  from parallel.sharding import describe
  import report
  from runtime import preempt, train
  import strategies
  main = jax.process_index() == 0               # only process 0 prints and writes files
  say = print if main else (lambda *a, **k: None)
  strat = strategies.get(F.strategy)
  mesh = mesh_lib.for_strategy(strat, F.mesh)
  layout_note = getattr(strat, "layout_note", None)          # pp: the layer layout it picked
  if layout_note is not None and (lnote := layout_note(cfg, mesh, opts)):
    say(f"note: {lnote}")
  cfg = strategies.stored_config(strat, cfg, mesh, opts)     # how its options store the model
  note = mesh_lib.order_note(strat, F.mesh)
  if note:
    say(f"note: {note}")
  steps = 20 if F.steps is None else F.steps
  start, state, saver = 0, None, None
  if not F.compile_only:
    check_allocation(cfg, strat, mesh, opts)
  if F.checkpoint_dir:                        # checked (and read) before anything compiles
    from runtime import checkpoint
    if F.restore is not None:
      start = checkpoint.check(F.checkpoint_dir, F.restore, cfg)
    planned = checkpoint.planned_saves(start, steps, F.save_every)
    doomed = checkpoint.check_plan(F.checkpoint_dir, start, planned, F.restore is not None,
                                   F.overwrite_checkpoint)
    if F.restore is not None:
      state = checkpoint.restore(F.checkpoint_dir, start, cfg, strat, mesh, opts)
      unfinished = checkpoint.incomplete_after(F.checkpoint_dir, start)
      say(f"restoring step {start}, the newest committed step of {F.checkpoint_dir}"
          if F.restore == "latest" else f"restoring step {start} of {F.checkpoint_dir}",
          end="")
      say(f" (a newer save was incomplete: {', '.join(unfinished)})" if unfinished else "")
    if doomed and main:
      checkpoint.delete_steps(F.checkpoint_dir, doomed)
      say(f"deleted step(s) {', '.join(map(str, doomed))} of {F.checkpoint_dir} "
          "(--overwrite_checkpoint)")
  job = train.build(strat, cfg, mesh, opts, state=state, compile_only=F.compile_only)
  mesh_desc = ",".join(f"{k}:{v}" for k, v in mesh.shape.items()) if mesh is not None else "single"
  say(f"{F.strategy} on mesh {mesh_desc}, model {F.model}, gmm {cfg.gmm_backend}: compiled in "
      f"{job.compile_s:.1f}s"
      + (f", restored step {start} from {F.checkpoint_dir}" if F.restore is not None else ""),
      flush=True)
  if F.dump_sharding:
    for path, t in describe(job.params):
      say(f"  param {path:<40s} {t}")
    if not F.compile_only:
      for path, t in describe(job.batch(0)):
        say(f"  batch {path:<40s} {t}")
    if hasattr(strat, "activation_shardings"):
      for name, t in strat.activation_shardings(cfg, mesh, opts):
        say(f"  act   {name:<40s} {t}")
  stats = hlo.compiled_stats(job.compiled, mesh, job.hlo)
  if F.hlo_stats or F.compile_only:
    say(f"  flops/device {stats['flops']:.3e}  memory {stats['memory']}")
    for kind, v in stats["collectives"].items():
      if v["count"]:
        say(f"  {kind:<20s} count {v['count']:>4d}  bytes/device {v['bytes']:>15,d}  "
            f"wire bytes/device {v['wire_bytes']:>17,.0f}")
  if F.compile_only and mesh is not None:
    mem = cost.param_memory(model.init_params_shapes(cfg), strat.param_specs(cfg, mesh, opts), mesh,
                            cfg.optimizer)
    total = mem["param_bytes"] + mem["opt_bytes"] + stats["memory"]["temp_bytes"]
    fits = "" if F.hbm_gb is None else (
        f": fits in {F.hbm_gb:g} GiB" if total <= F.hbm_gb * 2**30 else f": does NOT fit in {F.hbm_gb:g} GiB")
    say(f"  per device: params+opt {report.fmt_bytes(mem['param_bytes'] + mem['opt_bytes'])}, "
        f"XLA temp {report.fmt_bytes(stats['memory']['temp_bytes'])}, total "
        f"{report.fmt_bytes(total)}{fits} (G = GiB = 2^30 B)")
  if (F.breakdown or F.breakdown_all) and mesh is not None:
    row = {"strategy": F.strategy, "mesh": mesh_desc, "terms": cost.step_terms(strat, cfg, mesh, opts),
           "collectives_by_axes": stats["collectives_by_axes"]}
    say(report.breakdown(row, cfg.n_layers, every_what=F.breakdown_all))
  # line-buffered and flushed per step: a kill loses at most the step in flight
  out = open(F.metrics_file, "w", buffering=1) if F.metrics_file and main else None
  tokens = cfg.batch * cfg.seq_len
  if F.checkpoint_dir and not F.compile_only:
    saver = checkpoint.Saver(F.checkpoint_dir, cfg, say=say, strategy=F.strategy, mesh=mesh_desc)
  params, opt_state, done = job.params, job.opt_state, start
  with preempt.Stop(multi_process=jax.process_count() > 1) as stop:
    try:
      for i, params, opt_state, m, dt in train.steps(job, 0 if F.compile_only else steps, start):
        m = {k: float(v) for k, v in m.items() if k != "counts"}
        done = i + 1
        # "step" is the index of the batch this step trained on (0-based); after it, i + 1
        # steps are done, which the console shows as [i + 1/N] and the metrics as steps_done
        rec = {"step": i, "loss": m["loss"], "ce_loss": m["ce_loss"], "aux_loss": m["aux_loss"],
               "grad_norm": m["grad_norm"], "dropped": m["dropped"], "step_time_s": dt,
               "tokens_per_s": tokens / dt, "steps_done": done}
        say(f"[{done:>4d}/{start + steps}] loss {m['loss']:.4f} ce {m['ce_loss']:.4f} "
            f"aux {m['aux_loss']:.4f} gnorm {m['grad_norm']:.3f} dropped {m['dropped']:.0f} "
            f"{tokens / dt:,.0f} tok/s", flush=True)
        if out:
          out.write(json.dumps(rec) + "\n")
          out.flush()
        if not train.finite(m):
          raise NonFinite(f"non-finite loss at step {i}")
        if stop.requested(done) and done != start + steps:
          break
        if saver and done in planned and done != start + steps:
          saver.save(done, params, opt_state)       # done steps: resumes at batch done
      if saver and not F.compile_only:
        saver.save(done, params, opt_state)
    finally:
      if saver:
        saver.close()                            # waits until the last save is committed
  if stop.signal:
    say(f"stopped by {stop.signal} after step {done}"
        + (f": saved step {done} to {F.checkpoint_dir}; resume with --restore=latest"
           if saver else " (no --checkpoint_dir: nothing saved)"), flush=True)
  if out:
    out.write(json.dumps({"summary": True, "strategy": F.strategy, "mesh": mesh_desc,
                          "model": F.model, "dtype": cfg.dtype, "compile_s": job.compile_s,
                          "flops": stats["flops"],
                          "memory": {k: stats["memory"][k] for k in
                                     ("argument_bytes", "output_bytes", "temp_bytes")},
                          "collectives": stats["collectives"],
                          "steps": 0 if F.compile_only else steps, "first_step": start,
                          "steps_done": done, "stopped_by": stop.signal,
                          "batch": cfg.batch, "seq_len": cfg.seq_len, "layers": cfg.n_layers,
                          "remat": cfg.remat, "microbatches": cfg.microbatches,
                          "capacity_factor": cfg.capacity_factor, "seed": cfg.seed,
                          "aux_loss_kind": cfg.aux_loss_kind,
                          "attention": cfg.attention_impl, "gmm": cfg.gmm_backend,
                          "optimizer": cfg.optimizer, "options": vars(opts),
                          "compile_only": F.compile_only, "jax": jax.__version__}) + "\n")
  if out:
    out.close()


def main(argv):
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if F.strategy and F.compare:
    raise UsageError("give --strategy or --compare, not both")
  if F.plan:
    find = check_plan_flags()
    import strategies
    bases = dict.fromkeys(strategies.split_entry(n)[0] for n in strategy_names())
    plan([n for n in bases if n != "reference"], find)
    return
  dist = check_flags()
  names = strategy_names()
  opts = strategy_options(names)
  cfg = make_config()
  if F.describe:
    from modeling import model
    total, active = model.param_counts(cfg)
    print(f"total_params {total}\nactivated_params {active}")
    return
  if F.full_parity and F.adam_eps is None:
    from measure import agreement
    cfg = cfg.replace(adam_eps=agreement.PARITY_ADAM_EPS)   # see measure/agreement.py
  _setup_devices(F.devices, dist)
  cfg = compile_only_gmm(cfg)
  if cfg.attention_impl == "cudnn":
    import jax
    from modeling.config import ConfigError
    if jax.default_backend() != "gpu":
      raise ConfigError(f"--attention=cudnn needs a GPU (this host's backend: "
                        f"{jax.default_backend()}); use --attention=chunked")
  if F.strategy:
    train_one(cfg, opts[F.strategy])
  else:
    import compare
    rows = compare.main(cfg, names=names, mesh_spec=F.mesh,
                        steps=3 if F.steps is None else F.steps, report_dir=F.report_dir,
                        compile_only=F.compile_only, model_name=F.model, hbm_gb=F.hbm_gb,
                        opts=opts, full_parity=F.full_parity,
                        breakdown=F.breakdown or F.breakdown_all)
    failures, skipped = compare_outcome(rows, F.compile_only)
    for line in skipped:
      print(f"skipped: {line}", file=sys.stderr)
    if failures:
      raise CheckFailed("compare did not pass: " + "; ".join(failures))


HELP = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def _parse_flags(argv):
  """absl's parse, with its two exits made this tool's: a bad flag value is a one-line error
  (exit 2, where absl exits 1 with a usage banner), and asked-for help exits 0."""
  try:
    return F(argv)
  except flags.Error as e:
    raise UsageError(str(e)) from None
  except SystemExit:
    if any(a.split("=")[0] in HELP for a in argv[1:]):
      sys.exit(0)
    raise


def _run():
  """Exit status: 0 what was asked ran and passed; 1 a check failed (parity, a non-finite
  loss, a strategy that failed to build, nothing compared, a failed save); 2 bad input, before
  anything compiles (docs/command-line.md, "Exit status")."""
  from modeling.config import ConfigError
  from runtime.checkpoint import SaveError
  try:
    app.run(main, flags_parser=_parse_flags)
  except (ConfigError, UsageError, NonFinite, CheckFailed, SaveError) as e:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2 if isinstance(e, (ConfigError, UsageError)) else 1)


if __name__ == "__main__":
  _run()
