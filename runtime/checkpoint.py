"""Layout-free checkpoints (orbax-checkpoint) that restore into any strategy's mesh.

A step directory holds two items: `state` = {params, opt_state} (orbax StandardSave: every
process writes its own shards, nothing is gathered) and `meta` (JSON: step, optimizer, the
model config, each param's shape). The router-bias state lives in params (layers.moe.bias);
the data position is the step: batch i is a pure function of i (runtime/data.py), so training
resumes at batch `step`. Params have one pytree for every strategy, so a restore passes
ShapeDtypeStructs carrying the *new* strategy's NamedShardings and orbax reshards while reading.
The optimizer state differs between adamw and muon: a restore must use the saved optimizer.

Saves are atomic: orbax writes `<step>.orbax-checkpoint-tmp*` and renames it to `<step>` only
once every process has finished (a commit marker on object stores), and `steps()` lists only
finalised steps, so a save killed mid-write is never offered for restore.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

import jax

from modeling import model, optim
from modeling.config import Config, ConfigError


def _closed_loop(exc) -> bool:
  return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _quiet(prev, get_exc):
  # after a failed read, orbax's pending tensorstore callbacks hit its closed asyncio loop and
  # print tracebacks from background threads; drop exactly those so errors stay one line
  return lambda a: None if _closed_loop(get_exc(a)) else prev(a)


sys.unraisablehook = _quiet(sys.unraisablehook, lambda u: u.exc_value)
threading.excepthook = _quiet(threading.excepthook, lambda a: a.exc_value)


def _quiet_orphans() -> None:
  # the sibling reads of a failed restore, and the sibling writes of a failed save, end as
  # never-retrieved asyncio futures, which asyncio logs (with the same error) when they are
  # collected, at a time the garbage collector picks: the one-line error is the report
  logging.getLogger("asyncio").setLevel(logging.CRITICAL)


class CheckpointError(ConfigError):
  """A checkpoint that cannot be restored here; run.py prints it as a one-line error (exit 2)."""


def _manager(directory: str, create: bool = False, on_commit=None):
  """orbax's manager of `directory`'s steps; on_commit: called (no arguments, from orbax's
  background thread) after each save is committed."""
  import orbax.checkpoint as ocp
  return ocp.CheckpointManager(
      os.path.abspath(directory), item_names=("state", "meta"),
      options=ocp.CheckpointManagerOptions(
          create=create, max_to_keep=None,
          async_options=ocp.AsyncOptions(post_finalization_callback=on_commit)))


def steps(directory: str) -> list[int]:
  """Finalised steps in `directory`: `<step>/` directories holding orbax's finalize metadata.
  Tmp directories of unfinished saves (`<step>.orbax-checkpoint-tmp*`) and a step directory
  without `_CHECKPOINT_METADATA` are not steps."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit() and
                os.path.isfile(os.path.join(directory, n, "_CHECKPOINT_METADATA")))


def _meta(cfg: Config, step: int, **extra) -> dict:
  shapes = {jax.tree_util.keystr(p): list(l.shape) for p, l in jax.tree_util.tree_flatten_with_path(
      model.init_params_shapes(cfg), is_leaf=lambda l: isinstance(l, model.ShapeLeaf))[0]}
  return {"format": 1, "step": step, "data_step": step, "optimizer": cfg.optimizer,
          "model": cfg.model_fields(), "param_shapes": shapes, **extra}


class SaveError(Exception):
  """A save that failed while the run was going (disk full, permission): run.py prints it as one
  `error:` line and exits 1; the steps committed before it stay restorable."""


_ORBAX_ERRORS: list[str] = []       # what orbax logged at ERROR and the filter below held back


def _quiet_orbax_logs() -> None:
  # orbax logs a failed background write through absl at ERROR, with a traceback per thread
  # (hundreds of lines for one full disk), and may not raise it; Saver reports it once, as a
  # SaveError naming the cause kept here
  import absl.logging
  class _NotOrbax(logging.Filter):
    def filter(self, record):
      if f"{os.sep}orbax{os.sep}" not in record.pathname:
        return True
      if record.levelno >= logging.ERROR:
        _ORBAX_ERRORS.append(record.getMessage())
      return False
  logger = absl.logging.get_absl_logger()
  if not any(isinstance(f, _NotOrbax) for f in logger.filters):
    logger.addFilter(_NotOrbax())


def _save_failure(e: BaseException | None) -> str:
  """A failed write's cause in a few words: the OS error that orbax's exception (or, when it
  raised none, its last logged error) carries, or the first line of either."""
  import re
  logged = [m for m in _ORBAX_ERRORS if "os_error_code" in m] or _ORBAX_ERRORS[:1]
  text = str(e) if e is not None else (logged[-1] if logged else "")
  m = re.search(r"os_error_code='?(\d+)", text)
  if m:
    return os.strerror(int(m.group(1)))
  if e is not None:
    return _first_line(e)
  return text.strip().splitlines()[0][:300] if text.strip() else "orbax did not commit it"


class Saver:
  """Saves (params, opt_state) after `step` completed steps; every process calls save(). Saves
  are asynchronous: the step's state is copied off the devices, training goes on, and orbax
  writes and commits it in the background. `saved step N to DIR` is printed (through `say`)
  when step N is committed, from orbax's post-finalization callback, not when the next save
  starts; close() waits for the last one. A failed save raises SaveError (one line) at the next
  save() or at close(). A save orbax would skip (a step at or below the newest in the
  directory, or one this run already saved) is a CheckpointError, never silence (run.py
  refuses such a plan before compiling)."""

  def __init__(self, directory: str, cfg: Config, say=print, **extra):
    _quiet_orbax_logs()
    _quiet_orphans()
    self.cfg, self.extra, self.directory, self.say = cfg, extra, directory, say
    self.lock = threading.Lock()
    self.pending: list[int] = []         # saved, not yet reported as committed
    self.mgr = _manager(directory, create=True, on_commit=self._report)
    self.saved = set(self.mgr.all_steps())

  def _report(self) -> None:
    """Say each pending step that is committed (a finalised step directory)."""
    with self.lock:
      done = set(steps(self.directory))
      for step in [s for s in self.pending if s in done]:
        self.say(f"saved step {step} to {self.directory}", flush=True)
        self.pending.remove(step)

  def _check_committed(self) -> None:
    """After orbax finished: a pending step that is not committed failed (orbax may only log
    it): stop the run now rather than train on while saves fail."""
    self._report()
    if self.pending:
      raise self._failed(self.pending[0], None)

  def _failed(self, step: int, e: BaseException | None) -> SaveError:
    newest = max(steps(self.directory), default=None)
    return SaveError(f"saving step {step} to {self.directory} failed ({_save_failure(e)}); "
                     + ("no step is committed there" if newest is None
                        else f"the newest committed step is {newest}"))

  def save(self, step: int, params, opt_state) -> None:
    import orbax.checkpoint as ocp
    newest = max(self.saved, default=-1)
    if step <= newest:
      raise CheckpointError(f"save of step {step} to {self.directory} would be skipped: the "
                            f"directory already holds step {newest}")
    try:
      self.mgr.wait_until_finished()     # a failure of the previous save surfaces here
    except Exception as e:               # noqa: BLE001 -- any write failure
      raise self._failed(self.pending[0] if self.pending else step, e) from None
    self._check_committed()
    with self.lock:
      self.pending.append(step)
    try:
      ok = self.mgr.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
          meta=ocp.args.JsonSave(_meta(self.cfg, step, **self.extra))))
    except Exception as e:               # noqa: BLE001 -- a write that fails at once
      raise self._failed(step, e) from None
    if not ok:
      raise CheckpointError(f"orbax did not save step {step} to {self.directory}")
    self.saved.add(step)

  def close(self) -> None:
    """Waits for the last (asynchronous) save to be committed and reported."""
    try:
      self.mgr.wait_until_finished()
    except Exception as e:               # noqa: BLE001 -- any write failure
      step = self.pending[0] if self.pending else max(self.saved, default=0)
      raise self._failed(step, e) from None
    finally:
      try:
        self.mgr.close()
      except Exception:                  # noqa: BLE001 -- the failure is already reported
        pass
    self._check_committed()


def incomplete_after(directory: str, step: int) -> list[str]:
  """The unfinished saves (`<N>.orbax-checkpoint-tmp*`, N > step) left in `directory` by a run
  killed or failed while saving: a restore of `step` names them."""
  if not os.path.isdir(directory):
    return []
  out = []
  for n in sorted(os.listdir(directory)):
    head = n.split(".orbax-checkpoint-tmp")[0]
    if n != head and head.isdigit() and int(head) > step:
      out.append(n)
  return out


def planned_saves(start: int, n_steps: int, save_every: int) -> list[int]:
  """The steps a run of n_steps after `start` saves: every save_every, and the last."""
  every = [s for s in range(start + 1, start + n_steps + 1) if save_every and s % save_every == 0]
  return sorted(set(every) | {start + n_steps})


def check_plan(directory: str, start: int, planned: list[int], restoring: bool,
               overwrite: bool) -> list[int]:
  """Before compiling: the steps already in `directory` that this run's saves would collide with
  -> the steps --overwrite_checkpoint deletes ([] when none). A run without --restore into a
  directory that holds steps, or a save at or below a step the directory holds, is an error
  unless overwrite is set."""
  have = steps(directory)
  if not restoring:
    if have and not overwrite:
      raise CheckpointError(
          f"--checkpoint_dir={directory} already holds step(s) {', '.join(map(str, have))}: "
          "resume with --restore=latest, save to a new directory, or pass "
          "--overwrite_checkpoint to delete them")
    return have
  later = [s for s in have if s > start]
  if later and max(later) >= min(planned) and not overwrite:
    raise CheckpointError(
        f"--checkpoint_dir={directory} holds step(s) {', '.join(map(str, later))} after the "
        f"restored step {start}: this run's saves ({', '.join(map(str, planned))}) would be "
        "skipped; pass --overwrite_checkpoint to delete them, or save to a new directory")
  return later


def delete_steps(directory: str, doomed: list[int]) -> None:
  """--overwrite_checkpoint: remove the step directories this run replaces (process 0)."""
  import shutil
  for s in doomed:
    shutil.rmtree(os.path.join(directory, str(s)))


def check(directory: str, step: str | int, cfg: Config) -> int:
  """Validate a restore before anything compiles -> the step. `step`: 'latest' or a number.
  One-line CheckpointError for no checkpoint, a missing step, an unreadable or foreign one."""
  import orbax.checkpoint as ocp
  have = steps(directory)
  if not have:
    raise CheckpointError(f"no complete checkpoint in {directory}")
  n = have[-1] if step == "latest" else int(step)
  if n not in have:
    raise CheckpointError(f"step {n} is not in {directory} (complete steps: "
                          f"{', '.join(map(str, have))})")
  where = f"checkpoint {directory} step {n}"
  mgr = _manager(directory)
  try:
    meta = mgr.restore(n, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  except Exception as e:                                 # noqa: BLE001 -- any read failure
    _quiet_orphans()
    raise CheckpointError(f"{where} is unreadable: {_first_line(e)}") from None
  finally:
    mgr.close()
  if (not isinstance(meta, dict) or meta.get("format") != 1 or meta.get("step") != n
      or not {"optimizer", "model", "param_shapes"} <= set(meta)
      or not isinstance(meta["model"], dict)):
    raise CheckpointError(f"{where} is unreadable: bad meta")
  if meta["optimizer"] != cfg.optimizer:
    raise CheckpointError(f"{where} holds {meta['optimizer']} state: restore it with "
                          f"--optimizer={meta['optimizer']}, not {cfg.optimizer}")
  want = _meta(cfg, n)
  for k in want["model"]:                  # the model's fields (modeling/config.py); run settings
    if meta["model"].get(k) != want["model"][k]:   # and strategy options may change
      raise CheckpointError(f"{where} is from another model config: {k}={meta['model'].get(k)} "
                            f"there, {want['model'][k]} here")
  if meta["param_shapes"] != want["param_shapes"]:
    raise CheckpointError(f"{where} is from another model config: parameter shapes differ")
  return n


def abstract_state(cfg: Config, strategy, mesh, opts=None) -> dict:
  """{params, opt_state} as ShapeDtypeStructs with `strategy`'s shardings (under its `opts`) on
  `mesh`."""
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one),
                          model.abstract_params(cfg, None, None))
  else:
    with jax.set_mesh(mesh):
      params = model.abstract_params(cfg, strategy.param_specs(cfg, mesh, opts), mesh)
  opt = optim.make_optimizer(cfg.optimizer, model.param_roles(cfg), lr=cfg.lr,
                             weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
  ctx = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
  with ctx:
    shardings = jax.jit(opt.init).lower(params).compile().output_shardings
    shapes = jax.eval_shape(opt.init, params)
  opt_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                           shapes, shardings)
  return {"params": params, "opt_state": opt_state}


def restore(directory: str, step: int, cfg: Config, strategy, mesh, opts=None) -> tuple:
  """(params, opt_state) of a checked step, placed in `strategy`'s shardings (under its `opts`)
  on `mesh`."""
  import orbax.checkpoint as ocp
  target = abstract_state(cfg, strategy, mesh, opts)
  mgr = _manager(directory)
  try:
    state = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state
  except Exception as e:                                 # noqa: BLE001 -- any read failure
    _quiet_orphans()
    raise CheckpointError(f"checkpoint {directory} step {step} cannot be restored: "
                          f"{_first_line(e)}") from None
  finally:
    mgr.close()
  bad = [a for a, t in zip(jax.tree.leaves(state), jax.tree.leaves(target))
         if a.shape != t.shape or a.dtype != t.dtype]
  if bad or jax.tree.structure(state) != jax.tree.structure(target):
    raise CheckpointError(f"checkpoint {directory} step {step} does not match this model's state")
  return state["params"], state["opt_state"]


def _first_line(e: Exception) -> str:
  s = str(e).strip()
  return s.splitlines()[0][:300] if s else type(e).__name__

