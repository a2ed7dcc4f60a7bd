"""One `python run.py --strategy=NAME` run: the checkpoint plan checked before anything compiles,
the restore, the compile, the step loop with its metrics lines, the saves, and the stop on
SIGTERM / SIGINT (runtime/preempt.py). The flags are absl's FLAGS as run.py defines them (`F`);
what is printed about the compiled step is the caller's (`on_compiled`)."""
from __future__ import annotations

import json
import os
from typing import Callable

import jax

from measure import hlo
from modeling.config import ConfigError
from runtime import checkpoint, preempt, target, train


class NonFinite(Exception):
  """A step's loss or gradient norm is NaN or inf: one `error:` line, exit status 1."""


def prepare_checkpoints(F, cfg, strat, mesh, opts, steps: int, say, main: bool):
  """Before compiling: the restored step (0 without --restore), its state (None) and the steps
  this run saves; a plan whose saves would collide with the directory's steps is refused, or
  with --overwrite_checkpoint those steps are deleted (and said)."""
  start, state = 0, None
  if F.restore is not None:
    start = checkpoint.check(F.checkpoint_dir, F.restore, cfg)
  planned = checkpoint.planned_saves(start, steps, F.save_every)
  doomed = checkpoint.check_plan(F.checkpoint_dir, start, planned, F.restore is not None,
                                 F.overwrite_checkpoint)
  if F.restore is not None:
    state = checkpoint.restore(F.checkpoint_dir, start, cfg, strat, mesh, opts)
    unfinished = checkpoint.incomplete_after(F.checkpoint_dir, start)
    say((f"restoring step {start}, the newest committed step of {F.checkpoint_dir}"
         if F.restore == "latest" else f"restoring step {start} of {F.checkpoint_dir}")
        + (f" (a newer save was incomplete: {', '.join(unfinished)})" if unfinished else ""))
  if doomed and main:
    checkpoint.delete_steps(F.checkpoint_dir, doomed)
    say(f"deleted step(s) {', '.join(map(str, doomed))} of {F.checkpoint_dir} "
        "(--overwrite_checkpoint)")
  return start, state, planned


def train_one(F, strat, cfg, mesh, opts, on_compiled: Callable, say, devices=None) -> None:
  """Build, compile and train `strat` (F.strategy's module) on `mesh`, with cfg as its options
  store the model (strategies.stored_config). on_compiled(job, strat, stats, mesh_desc, say)
  prints what the flags ask about the compiled step, before any step runs. say: print on
  process 0, nothing on the others. devices: the runtime.target.Target the mesh is built from
  (its compiler and --target name go into the header and the metrics summary)."""
  main = jax.process_index() == 0               # only process 0 writes files
  steps = 20 if F.steps is None else F.steps
  start, state, planned = 0, None, []
  if not F.compile_only:
    check_allocation(cfg, strat, mesh, opts, F.model)
  if F.checkpoint_dir:                        # checked (and read) before anything compiles
    start, state, planned = prepare_checkpoints(F, cfg, strat, mesh, opts, steps, say, main)
  init, hf_config = hf_start(F, cfg, say)      # --init_from / --export_hf: before compiling
  try:
    job = train.build(strat, cfg, mesh, opts, state=state, compile_only=F.compile_only,
                      init=init)
  except jax.errors.JaxRuntimeError as e:
    oom = target.hbm_oom(e) if devices is not None and devices.name else None
    if oom is None:
      raise
    raise target.OverHBM(
        f"{devices.memory_label()} refuses the step: its temporaries need {oom[0] / 2**30:.2f} "
        f"GiB, over the {oom[1] / 2**30:.2f} GiB of HBM a device has (XLA error E1000, "
        "CompileTimeHbmOom)") from None
  mesh_desc = ",".join(f"{k}:{v}" for k, v in mesh.shape.items()) if mesh is not None else "single"
  for_target = f" for {devices.name} ({devices.topology})" if devices and devices.name else ""
  say(f"{F.strategy} on mesh {mesh_desc}, model {F.model}, gmm {cfg.gmm_backend}: compiled"
      f"{for_target} in {job.compile_s:.1f}s"
      + (f", restored step {start} from {F.checkpoint_dir}" if F.restore is not None else ""),
      flush=True)
  stats = hlo.compiled_stats(job.compiled, mesh, job.hlo)
  on_compiled(job, strat, stats, mesh_desc, say)
  # line-buffered: each line reaches the file when written, so a kill loses at most the step in
  # flight
  out = open(F.metrics_file, "w", buffering=1) if F.metrics_file and main else None
  saver = None
  if F.checkpoint_dir and not F.compile_only:
    saver = checkpoint.Saver(F.checkpoint_dir, cfg, say=say, strategy=F.strategy, mesh=mesh_desc)
  done, stopped_by, params = run_steps(job, 0 if F.compile_only else steps, start, planned, saver,
                                       out, say)
  if stopped_by:
    say(f"stopped by {stopped_by} after step {done}"
        + (f": saved step {done} to {F.checkpoint_dir}; resume with --restore=latest"
           if saver else " (no --checkpoint_dir: nothing saved)"), flush=True)
  if F.export_hf:
    if stopped_by:
      say(f"not exported to {F.export_hf}: stopped before the last step", flush=True)
    else:
      export_trained(F.export_hf, params, cfg, hf_config, main, say)
  if out:
    out.write(json.dumps({"summary": True, "strategy": F.strategy, "mesh": mesh_desc,
                          "model": F.model, "dtype": cfg.dtype, "compile_s": job.compile_s,
                          "flops": stats["flops"],
                          "memory": {k: stats["memory"][k] for k in
                                     ("argument_bytes", "output_bytes", "temp_bytes")},
                          "collectives": stats["collectives"],
                          "steps": 0 if F.compile_only else steps, "first_step": start,
                          "steps_done": done, "stopped_by": stopped_by,
                          "batch": cfg.batch, "seq_len": cfg.seq_len, "layers": cfg.n_layers,
                          "remat": cfg.remat, "microbatches": cfg.microbatches,
                          "capacity_factor": cfg.capacity_factor, "seed": cfg.seed,
                          "data": cfg.data or "synthetic",
                          "aux_loss_kind": cfg.aux_loss_kind,
                          "attention": cfg.attention_impl, "gmm": cfg.gmm_backend,
                          "optimizer": cfg.optimizer, "options": vars(opts),
                          "compile_only": F.compile_only, "jax": jax.__version__,
                          "compiler": devices.compiler if devices else None,
                          "target": devices.name or None if devices else None}) + "\n")
    out.close()


def read_init(F, cfg, hf=None) -> dict:
  """--init_from's params in cfg's stored layout (export_hf.load), every tensor read and
  checked: one ConfigError line otherwise."""
  from modeling import convert, export_hf
  try:
    return export_hf.load(F.init_from, cfg, convert.read_config(F.init_from) if hf is None else hf)
  except ValueError as e:
    raise ConfigError(f"--init_from={F.init_from}: {e}") from None


def init_every_row(F, cfg):
  """Compare mode's --init_from: the checkpoint read and checked once, before anything compiles,
  -> train.build's init for every row: the params in that row's stored layout (pp pads its MoE
  stack with inert zero rows)."""
  from modeling import export_hf
  flat = read_init(F, cfg.replace(layer_layout="", layer_stages=0))       # depth order
  return lambda c: export_hf.padded(flat, c)


def hf_start(F, cfg, say):
  """--init_from / --export_hf, before anything compiles -> (train.build's init: the
  checkpoint's params once, or None; the config.json the model came from, or None). Every
  tensor of --init_from is read and checked against cfg (missing, unexpected, misshaped: one
  ConfigError line), and --export_hf's model must have a Hugging Face form."""
  from modeling import convert, export_hf
  hf, init = None, None
  if F.init_from:
    try:
      hf = convert.read_config(F.init_from)
    except ValueError as e:
      raise ConfigError(f"--init_from={F.init_from}: {e}") from None
    if not F.compile_only:
      tree = {"params": read_init(F, cfg, hf)}
      init = lambda c: tree.pop("params")          # noqa: E731 (handed over once)
      say(f"initialised from {F.init_from} ({hf['model_type']})")
  try:
    if F.export_hf:                            # its config.json: --init_from's, or one for the
      export_hf.check_export(cfg, hf)          # model's family
  except ValueError as e:
    raise ConfigError(f"--export_hf={F.export_hf}: {e}") from None
  return init, hf


def export_trained(path: str, params, cfg, hf_config, main: bool, say) -> None:
  """--export_hf: the trained params gathered to the host (every process takes part) and
  written by process 0 as a Hugging Face checkpoint (modeling/export_hf.py)."""
  from modeling import export_hf
  host = jax.tree.map(train.to_host, params)
  if main:
    hf = export_hf.export(path, host, cfg, hf_config)
    say(f"exported to {path} ({hf['model_type']}, float32)", flush=True)


def run_steps(job, steps: int, start: int, planned: list[int], saver, out, say):
  """The step loop: a console line and a metrics line per step, the planned saves, the last
  step saved, a stop after the step in flight on SIGTERM / SIGINT (that step saved) -> (steps
  done, the signal's name or None, the params after the last step done). A non-finite step
  raises NonFinite after its line."""
  cfg = job.cfg
  tokens = cfg.batch * cfg.seq_len
  params, opt_state, done = job.params, job.opt_state, start
  with preempt.Stop(multi_process=jax.process_count() > 1) as stop:
    try:
      for i, params, opt_state, m, dt in train.steps(job, steps, start):
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
        if not train.finite(m):
          raise NonFinite(f"non-finite loss at step {i}")
        if stop.requested(done) and done != start + steps:
          break
        if saver and done in planned and done != start + steps:
          saver.save(done, params, opt_state)       # done steps: resumes at batch done
      if saver:
        saver.save(done, params, opt_state)
    finally:
      if saver:
        saver.close()                              # waits until the last save is committed
  return done, stop.signal, params


def _host_bytes() -> int:
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_allocation(cfg, strat, mesh, opts, model_name: str) -> None:
  """Refuse, before anything is allocated, a run whose float32 parameters (built whole on the
  host by modeling.model.init_params) plus, on simulated CPU devices, every device's parameter
  and optimizer shards would not fit this host's memory: such a study is --compile_only."""
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
    raise ConfigError(f"model {model_name} would allocate {need / 2**30:,.1f} GiB of float32 "
                      f"parameters and optimizer state on this host ({have / 2**30:.0f} GiB): "
                      "use --compile_only to study it without allocating")
