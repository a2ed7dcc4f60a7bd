"""moe-sharding command line.

  python run.py                                   # compare every strategy (8 simulated CPU devices)
  python run.py --strategy=ep --mesh=data:2,expert:4 --steps=3 --metrics_file=m.jsonl
  python run.py --compare=dp,ep --model=deepseek-test --report_dir=report
  python run.py --compare=all --devices=64 --model=mixtral-8x7b --compile_only
  python run.py --strategy=ep --mesh=data:2,expert:4 --devices=4 \
      --coordinator_address=127.0.0.1:1234 --num_processes=2 --process_id=0   # and =1
  python run.py --strategy=ep --steps=3 --checkpoint_dir=ck                # then, any strategy:
  python run.py --strategy=fsdp --steps=2 --checkpoint_dir=ck --restore=latest
"""
from __future__ import annotations

import json
import sys

from absl import app, flags

F = flags.FLAGS
flags.DEFINE_string("strategy", None, "strategy to train (see strategies/); omit to compare all")
flags.DEFINE_string("compare", None, "'all' or a comma list of strategies to compare")
flags.DEFINE_string("model", "tiny", "model preset: tiny | mixtral-test | deepseek-test (these run "
                    "on CPU) | mixtral-8x7b | deepseek-v2-lite | deepseek-v3 (real shapes: "
                    "--compile_only on CPU)")
flags.DEFINE_integer("steps", None, "steps to run (after --restore: more steps; default 20; 3 in compare mode; 0 = compile "
                     "and report only)")
flags.DEFINE_integer("batch", None, "global batch (sequences); default from the preset")
flags.DEFINE_integer("seq", None, "sequence length; default from the preset")
flags.DEFINE_integer("layers", None, "override the number of layers")
flags.DEFINE_integer("microbatches", 1, "M microbatches per step, one optimizer update: gradient "
                     "accumulation (each microbatch sharded like the batch); pp: its pipeline's")
flags.DEFINE_string("mesh", None, "e.g. data:2,expert:4; omitted axes get size 1; "
                    "no flag = all devices on the strategy's main axis; 'search' (compare with "
                    "--compile_only --hbm_gb): per strategy, the mesh over its axes that fits "
                    "(common/compare.py search)")
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
flags.DEFINE_integer("seed", 0, "init and data seed")
flags.DEFINE_string("gmm", "auto", "grouped-matmul backend: auto | ragged_dot | padded | custom | "
                    "scan (exact, one expert at a time: for compile-only memory studies on CPU)")
flags.DEFINE_enum("dispatch", "auto", ["auto", "a2a", "ragged"], "EP token exchange")
flags.DEFINE_bool("dispatch_batch_on_expert", False,
                  "ep: also shard the dispatch batch dim over expert (MaxText #4179 bug, for demos)")
flags.DEFINE_string("context_sharding", "context", "mesh axis that plays context parallelism")
flags.DEFINE_enum("expert_fsdp_mode", "gather", ["gather", "ep"], "shard_exp_on_fsdp exchange")
flags.DEFINE_float("ep_tp_capacity", 0.0, "ep_tp buffer as a fraction of the worst case (0 = worst)")
flags.DEFINE_string("metrics_file", None, "write JSON lines: one per step, then a summary")
flags.DEFINE_bool("dump_sharding", False, "print every parameter's and key activation's sharding")
flags.DEFINE_bool("hlo_stats", False, "print collectives, flops and memory of the compiled step")
flags.DEFINE_bool("compile_only", False, "compare mode: compile, report collectives/memory, don't run")
flags.DEFINE_float("hbm_gb", None, "with --compile_only: per-device memory (GiB, 2^30 B) to fit in; "
                   "adds total/dev = params + optimizer + XLA temp, and whether it fits")
flags.DEFINE_string("report_dir", None, "compare mode: write table.json, table.csv and PNG plots here")
flags.DEFINE_string("coordinator_address", None, "multi-process: host:port of process 0's "
                    "coordinator (default: $JAX_COORDINATOR_ADDRESS or the cluster's)")
flags.DEFINE_integer("num_processes", None, "multi-process: number of processes")
flags.DEFINE_integer("process_id", None, "multi-process: this process's id in [0, num_processes)")
flags.DEFINE_string("checkpoint_dir", None, "save (and --restore) orbax checkpoints here")
flags.DEFINE_integer("save_every", 0, "save every N steps (0 = only after the last step)")
flags.DEFINE_string("restore", None, "'latest' or a step: resume from --checkpoint_dir, in any "
                    "strategy and mesh (same model and --optimizer)")
flags.DEFINE_string("compilation_cache", "~/.cache/moe-sharding/jax",
                    "persistent XLA compilation cache ('' = off); reruns skip compiles")


class UsageError(Exception):
  pass


def check_flags() -> None:
  """Every flag value that can be judged without JAX, before anything compiles."""
  import math
  import os
  global _dist
  from common import distributed
  _dist = distributed.settings(F.coordinator_address, F.num_processes, F.process_id)
  if _dist is not None and not F.strategy:
    raise UsageError("multi-process runs need --strategy (compare mode is single-process)")
  if _dist is not None and F.strategy == "reference":
    raise UsageError("the reference runs on one device: not multi-process")
  if F.devices < 1:
    raise UsageError(f"--devices={F.devices} must be >= 1")
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
  if F.hbm_gb is not None:
    if not (math.isfinite(F.hbm_gb) and F.hbm_gb > 0):
      raise UsageError(f"--hbm_gb={F.hbm_gb} must be a finite number > 0")
    if not F.compile_only:
      raise UsageError("--hbm_gb needs --compile_only (the fit table is a compile-only study)")
  if F.mesh == "search" and (F.strategy or not F.compile_only or F.hbm_gb is None):
    raise UsageError("--mesh=search is a compare-mode study: it needs --compile_only and --hbm_gb "
                     "(and no --strategy)")
  if F.metrics_file:                         # fail now, not after a long compile
    d = os.path.dirname(os.path.abspath(F.metrics_file))
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
      raise UsageError(f"--metrics_file={F.metrics_file}: directory {d} does not exist or "
                       "is not writable")
  if F.save_every < 0:
    raise UsageError(f"--save_every={F.save_every} must be >= 0")
  if (F.checkpoint_dir or F.restore) and not F.strategy:
    raise UsageError("--checkpoint_dir and --restore need --strategy")
  if F.restore is not None:
    if not F.checkpoint_dir:
      raise UsageError("--restore needs --checkpoint_dir")
    if F.restore != "latest" and not F.restore.isdigit():
      raise UsageError(f"--restore={F.restore}: expected 'latest' or a step number")
    if not os.path.isdir(F.checkpoint_dir):
      raise UsageError(f"--checkpoint_dir={F.checkpoint_dir} does not exist")
  for flag in ("checkpoint_dir", "report_dir"):
    if getattr(F, flag):
      _writable_dir(flag, getattr(F, flag))


def _writable_dir(flag: str, path: str) -> None:
  """Create --flag's directory now, or stop with one line, before anything compiles."""
  import os
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise UsageError(f"--{flag}={path}: {e.strerror}") from None
  if not os.access(path, os.W_OK):
    raise UsageError(f"--{flag}={path} is not writable")


class NonFinite(Exception):
  pass


_dist = None      # jax.distributed.initialize arguments of a multi-process run (check_flags)


def _setup_devices(n: int) -> None:
  """n CPU devices per process; starts the multi-process runtime first when asked."""
  import os
  import jax
  jax.config.update("jax_num_cpu_devices", n)
  if F.compilation_cache:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(F.compilation_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  if _dist is not None:
    from common import distributed
    distributed.initialize(_dist)
  if jax.default_backend() == "cpu" and jax.local_device_count() != n:
    raise UsageError(f"asked for {n} CPU devices, got {jax.local_device_count()}")


def make_config():
  from common.config import ConfigError, get_config
  if F.capacity_factor < 0:
    raise ConfigError(f"--capacity_factor={F.capacity_factor} must be >= 0")
  over = dict(optimizer=F.optimizer, capacity_factor=F.capacity_factor, seed=F.seed,
              gmm_backend=F.gmm, dispatch=F.dispatch,
              dispatch_batch_on_expert=F.dispatch_batch_on_expert,
              context_sharding=F.context_sharding, expert_fsdp_mode=F.expert_fsdp_mode,
              ep_tp_capacity=F.ep_tp_capacity, microbatches=F.microbatches,
              remat=F.remat, dtype=F.dtype, grad_reduce_dtype=F.grad_reduce_dtype)
  for flag, key in (("batch", "batch"), ("seq", "seq_len"), ("layers", "n_layers"), ("lr", "lr"),
                    ("adam_eps", "adam_eps")):
    if getattr(F, flag) is not None:
      over[key] = getattr(F, flag)
  from common import gmm
  try:
    gmm.resolve_backend(F.gmm)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return get_config(F.model, **over)


def train_one(cfg) -> None:
  from common import hlo, mesh as mesh_lib, train
  from common.sharding import describe
  import strategies

  import jax
  main = jax.process_index() == 0               # only process 0 prints and writes files
  say = print if main else (lambda *a, **k: None)
  strat = strategies.get(F.strategy)
  mesh = mesh_lib.for_strategy(strat, F.mesh)
  start, state = 0, None
  if F.restore is not None:                   # checked and read before anything compiles
    from common import checkpoint
    start = checkpoint.check(F.checkpoint_dir, F.restore, cfg)
    state = checkpoint.restore(F.checkpoint_dir, start, cfg, strat, mesh)
  job = train.build(strat, cfg, mesh, state=state)
  mesh_desc = ",".join(f"{k}:{v}" for k, v in mesh.shape.items()) if mesh is not None else "single"
  say(f"{F.strategy} on mesh {mesh_desc}, model {F.model}: compiled in {job.compile_s:.1f}s"
      + (f", restored step {start} from {F.checkpoint_dir}" if F.restore is not None else ""),
      flush=True)
  if F.dump_sharding:
    for path, t in describe(job.params):
      say(f"  param {path:<40s} {t}")
    for path, t in describe(job.batch(0)):
      say(f"  batch {path:<40s} {t}")
    if hasattr(strat, "activation_shardings"):
      for name, t in strat.activation_shardings(cfg, mesh):
        say(f"  act   {name:<40s} {t}")
  stats = hlo.compiled_stats(job.compiled, mesh, job.hlo)
  if F.hlo_stats:
    say(f"  flops/device {stats['flops']:.3e}  memory {stats['memory']}")
    for kind, v in stats["collectives"].items():
      if v["count"]:
        say(f"  {kind:<20s} count {v['count']:>4d}  bytes/device {v['bytes']:>12,d}")
  out = open(F.metrics_file, "w") if F.metrics_file and main else None
  steps = 20 if F.steps is None else F.steps
  tokens = cfg.batch * cfg.seq_len
  saver = None
  if F.checkpoint_dir:
    from common import checkpoint
    saver = checkpoint.Saver(F.checkpoint_dir, cfg, strategy=F.strategy, mesh=mesh_desc)
  params, opt_state = job.params, job.opt_state
  try:
    for i, params, opt_state, m, dt in train.steps(job, steps, start):
      m = {k: float(v) for k, v in m.items() if k != "counts"}
      rec = {"step": i, "loss": m["loss"], "ce_loss": m["ce_loss"], "aux_loss": m["aux_loss"],
             "grad_norm": m["grad_norm"], "dropped": m["dropped"], "step_time_s": dt,
             "tokens_per_s": tokens / dt}
      say(f"[{i + 1:>4d}/{start + steps}] loss {m['loss']:.4f} ce {m['ce_loss']:.4f} "
          f"aux {m['aux_loss']:.4f} gnorm {m['grad_norm']:.3f} dropped {m['dropped']:.0f} "
          f"{tokens / dt:,.0f} tok/s", flush=True)
      if out:
        out.write(json.dumps(rec) + "\n")
      if not train.finite(m):
        if out:
          out.close()                            # keeps every step up to this one
        raise NonFinite(f"non-finite loss at step {i}")
      if saver and F.save_every and (i + 1) % F.save_every == 0:
        saver.save(i + 1, params, opt_state)      # i + 1 steps done: resumes at batch i + 1
    if saver:
      saver.save(start + steps, params, opt_state)
  finally:
    if saver:
      saver.close()                            # waits until the last save is finalised
  if out:
    out.write(json.dumps({"summary": True, "strategy": F.strategy, "mesh": mesh_desc,
                          "model": F.model, "dtype": cfg.dtype, "compile_s": job.compile_s,
                          "flops": stats["flops"],
                          "memory": {k: stats["memory"][k] for k in
                                     ("argument_bytes", "output_bytes", "temp_bytes")},
                          "collectives": stats["collectives"]}) + "\n")
    out.close()


def main(argv):
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if F.strategy and F.compare:
    raise UsageError("give --strategy or --compare, not both")
  check_flags()
  _setup_devices(F.devices)
  cfg = make_config()
  if F.strategy:
    train_one(cfg)
  else:
    from common import compare
    compare.main(cfg, names=F.compare or "all", mesh_spec=F.mesh,
                 steps=3 if F.steps is None else F.steps,
                 report_dir=F.report_dir, compile_only=F.compile_only, model_name=F.model,
                 hbm_gb=F.hbm_gb)


def _run():
  from common.config import ConfigError
  try:
    app.run(main)
  except (ConfigError, UsageError, NonFinite) as e:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1 if isinstance(e, NonFinite) else 2)


if __name__ == "__main__":
  _run()
