"""Build a runnable training job from (strategy module, Config, mesh): place params and data
(each process its addressable shards: multi-process safe), compile the train step once, run
steps. Shared by run.py and the tests."""
from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from typing import Any, Callable, NamedTuple

import einops
import jax
import jax.numpy as jnp
import numpy as np

from layout import mesh as mesh_lib
from measure import hlo
from modeling import model, optim, routing
from modeling.config import ConfigError
from parallel import sharding
from parallel.sharding import put
from runtime import data as data_lib


class Job(NamedTuple):
  name: str
  cfg: Any
  mesh: Any                 # None for the single-device reference
  opts: Any                 # the strategy's Options
  params: Any
  opt_state: Any
  step: Callable            # compiled: (params, opt_state, batch) -> (params, opt_state, metrics)
  compiled: Any             # jax Compiled object (HLO text, cost and memory analysis)
  compile_s: float
  batch: Callable           # step index -> placed batch dict
  hlo: str                  # the HLO whose collectives are counted: compiled.as_text(), or on
                            # XLA:CPU with bf16 the module before it upcasts them (measure/hlo.py)


def global_norm(tree) -> jax.Array:
  """sqrt of the sum of squares of every leaf. On a mesh: ONE scalar all-reduce over all mesh
  axes per step, whatever the leaves' layouts (per-leaf sums would each be all-reduced over that
  leaf's shard axes, grouped as XLA sees fit): each device sums its own shards, a shard held by
  r devices counted 1/r times (r: a power of two on these meshes, so the division is exact)."""
  leaves = [g.astype(jnp.float32) for g in jax.tree.leaves(tree)]
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in leaves))
  specs = [jax.typeof(g).sharding.spec for g in leaves]

  def local(*shards):
    axes = tuple(mesh.axis_names)
    total = sum(jnp.sum(jnp.square(s)) / (mesh.size // sharding.spec_shards(p, mesh))
                for s, p in zip(shards, specs))
    return jax.lax.psum(sharding.to_varying(total, axes), axes)

  return jnp.sqrt(jax.shard_map(local, in_specs=tuple(specs), out_specs=jax.P())(*leaves))


def microbatches(batch: dict, m: int) -> dict:
  """[B, S] -> [M, B/M, S]: microbatch i = rows i, i+M, i+2M, ... Each device keeps its own
  rows (B/M stays split over the batch axes when B % (M x their size) == 0): no data moves.
  Each microbatch keeps the batch's sharding: the reshape alone may move a batch axis of size
  1 onto M (ep on data:2,fsdp:4 leaves expert there), and rope's positions would then differ
  from the activations' layout."""
  def split(a):                                                          # [B, S] -> [M, B/M, S]
    spec = jax.typeof(a).sharding.spec
    out = einops.rearrange(a, "(b m) s -> m b s", m=m)
    return jax.reshard(out, jax.sharding.PartitionSpec(None, *spec)) if any(spec) else out
  return jax.tree.map(split, batch)


def accumulated_grads(params, batch, cfg, lay: model.Parallelism):
  """Gradient accumulation over cfg.microbatches = M: -> (metrics as model.loss_fn, grads), the
  same values as one pass over the whole batch (up to summation order).
  pass 1: forward of every microbatch (no grad) -> the step's router counts [L, E];
  pass 2: value_and_grad per microbatch with those counts as the aux loss's f, every loss term a
          microbatch sum over the step's tokens; losses and grads summed in the scan carry.
  The sequence-wise loss (aux_loss_kind "sequence") is complete within each microbatch: no pass
  1, and the step's counts (the bias update's load) are summed in pass 2's carry.
  A layout that gathers its weights once per step (lay.gathers_once, ZeRO-1) gathers them once
  for both passes, as Megatron's distributed optimizer does: pass 2 takes each microbatch's
  gradients at the gathered copy, sums them in float32 at its size (Megatron's main_grad
  buffer), and the gather's backward reduce-scatters the sum once, after the last microbatch."""
  mbs = microbatches(batch, cfg.microbatches)                               # [M, B/M, S]
  n_tokens = batch["tokens"].shape[0] * batch["tokens"].shape[1]
  per_sequence = cfg.aux_loss_kind == "sequence"
  used, pull = params, None
  if lay.gathers_once:
    used, pull = jax.vjp(lay.params, params)        # [.., D, ..] typed reduced over grad axes
    lay = lay.given()

  # pass 1 unrolled (forward only, nothing kept for a backward: it costs compile time, not
  # memory): as a second lax.scan beside pass 2's, the executable reloaded from the persistent
  # compilation cache crashes XLA:CPU (jax 0.12: rendezvous "id < num_threads" check failure)
  zero_counts = jnp.zeros((cfg.n_layer_slots, cfg.n_experts), jnp.float32)
  counts = None
  if not per_sequence:
    counts = zero_counts
    for i in range(cfg.microbatches):
      mb = jax.tree.map(lambda a: a[i], mbs)
      counts = counts + model.forward(used, mb, cfg, lay)[1]["counts"]
    counts = jax.lax.stop_gradient(counts)                                  # [L_moe, E], global

  def grad_one(carry, mb):
    (_, m), g = jax.value_and_grad(model.loss_fn, has_aux=True)(used, mb, cfg, lay,
                                                                counts, n_tokens)
    if not per_sequence:
      m = {k: v for k, v in m.items() if k != "counts"}
    g = jax.tree.map(lambda a: a.astype(jnp.float32), g)
    return jax.tree.map(jnp.add, carry, (m, g)), None
  zero_m = {k: jnp.zeros((), jnp.float32)
            for k in ("loss", "ce_loss", "aux_loss", "z_loss", "dropped")}
  if per_sequence:
    zero_m["counts"] = zero_counts
  (m, grads), _ = jax.lax.scan(grad_one, (zero_m, jax.tree.map(_zero_grad, used)), mbs)
  if pull is not None:      # the gathered copies' sums -> their reduce-scatter, once
    grads = pull(jax.tree.map(lambda g, u: g.astype(u.dtype), grads, used))[0]
  return {**m, "counts": m["counts"] if per_sequence else counts}, grads


def _zero_grad(u):
  """float32 zeros typed as the gradient at u: unreduced over the axes u is typed reduced over
  (a weight gathered for use: parallel.sharding.gather_weight), else as u."""
  spec = jax.typeof(u).sharding.spec
  if not spec.reduced:
    return jnp.zeros_like(u, jnp.float32)
  return jnp.zeros(u.shape, jnp.float32,
                   out_sharding=jax.sharding.PartitionSpec(*spec.partitions,
                                                            unreduced=spec.reduced))


def make_train_step(cfg, lay: model.Parallelism, opt: optim.Optimizer, with_grads: bool = False):
  """Pure step: loss+grads (accumulated over cfg.microbatches), AdamW/Muon update, aux-loss-free
  router-bias update."""
  def step(params, opt_state, batch):
    if lay.loss is not None:              # the strategy runs the whole model (pp: its microbatches)
      (_, m), grads = jax.value_and_grad(lambda p: lay.loss(p, batch), has_aux=True)(params)
    elif cfg.microbatches > 1:
      m, grads = accumulated_grads(params, batch, cfg, lay)
    else:
      (_, m), grads = jax.value_and_grad(model.loss_fn, has_aux=True)(params, batch, cfg, lay)
    new_params, new_opt_state = opt.update(grads, opt_state, params)
    if cfg.bias_update_rate:                                    # [L, E], the whole step's counts
      moe = new_params["layers"]["moe"]
      moe["bias"] = routing.update_bias(moe["bias"], m["counts"], cfg.bias_update_rate)
    metrics = {k: m[k] for k in ("loss", "ce_loss", "aux_loss", "z_loss", "dropped")}
    metrics["grad_norm"] = global_norm(grads)
    if with_grads:
      metrics["grads"] = grads
    return new_params, new_opt_state, metrics
  return step


def check_layer_layout(strategy, cfg) -> None:
  """--layer_layout pads the MoE stack into groups for pp's stages (modeling/config.py): only a
  strategy that says it runs the padded stack (LAYER_LAYOUT = True) takes it; every other one's
  cost model and contract count the MoE layers, not the stack's rows."""
  if cfg.layer_layout and not getattr(strategy, "LAYER_LAYOUT", False):
    raise ConfigError(f"--layer_layout={cfg.layer_layout} is pp's (its stages hold the groups); "
                      f"{strategy.NAME} runs the model without it")
  if cfg.layer_stages and not getattr(strategy, "LAYER_LAYOUT", False):
    raise ConfigError(f"layer_stages={cfg.layer_stages} (the MoE stack stored round-robin over "
                      f"pp's stages) is pp's; {strategy.NAME} runs the model without it")


def build(strategy, cfg, mesh, opts=None, *, with_grads: bool = False, compile_only: bool = False,
          init: Callable | None = None, state: tuple | None = None,
          dump_dir: str | None = None) -> Job:
  """strategy: a module from strategies/ (see strategies/__init__.py for the contract); opts:
  its Options (None = the defaults). init: cfg -> numpy params (default model.init_params);
  state: (params, opt_state) already placed in this strategy's shardings (a restored
  checkpoint, runtime/checkpoint.py); dump_dir: an empty folder where XLA also writes the step's
  optimized module and buffer assignment (measure/peak.py reads them)."""
  opts = strategy.Options() if opts is None else opts
  ctx = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
  with ctx:
    check_layer_layout(strategy, cfg)
    if mesh is not None:
      strategy.check(cfg, mesh, opts)
    specs = strategy.param_specs(cfg, mesh, opts) if mesh is not None else None
    mesh_lib.require_microbatches(cfg, mesh, strategy.batch_spec(cfg, mesh) if mesh is not None else None)
    opt = optim.make_optimizer(cfg.optimizer, model.param_roles(cfg), lr=cfg.lr,
                               weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
    lay = strategy.layout(cfg, mesh, opts)
    step_fn = make_train_step(cfg, lay, opt, with_grads)
    bspec = strategy.batch_spec(cfg, mesh) if mesh is not None else None
    prep = getattr(strategy, "prepare_batch", None)
    data_lib.check_run(cfg)                   # a token file: once, before any batch is read

    def batch(i: int):
      b = data_lib.batch_for(cfg, i)           # cfg.data's tokens, or the synthetic chain
      if prep is not None and mesh is not None:
        b = prep(b, cfg, mesh)
      return put(b, {k: bspec for k in b} if bspec is not None else None, mesh)

    if compile_only:
      params = model.abstract_params(cfg, specs, mesh)
      opt_state = jax.eval_shape(opt.init, params)
      b0 = {k: jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len), jnp.int32,
                                    sharding=_ns(mesh, bspec)) for k in ("tokens", "targets", "positions")}
    elif state is not None:
      params, opt_state = state
      b0 = batch(0)
    else:
      params = (init or model.init_params)(cfg)
      if init is not None:
        check_init(params, cfg)
      params = put(params, specs, mesh)
      opt_state = jax.jit(opt.init)(params)
      b0 = batch(0)
    t0 = time.perf_counter()
    # compile only: the program a training loop runs, its params and optimizer state donated
    # (their buffers become the new ones), so XLA's temp is the scratch beside one copy of the
    # state; without donation XLA borrows the outputs' buffers as scratch, which a donated step
    # cannot, and the state's two copies are live at its end. The executed runs here keep the
    # state: steps() starts again from job.params and yields each step's state to the caller.
    donate = (0, 1) if compile_only else ()
    compiled, hlo_text = _compile(
        jax.jit(step_fn, donate_argnums=donate).lower(params, opt_state, b0), cfg.mixed,
        dump_dir, mesh_lib.platform(mesh) if mesh is not None else None)
    compile_s = time.perf_counter() - t0

  def run_step(p, o, b):
    with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
      return compiled(p, o, b)

  return Job(getattr(strategy, "NAME", strategy.__name__.split(".")[-1]), cfg, mesh, opts, params,
             opt_state, run_step, compiled, compile_s, batch, hlo_text)


def check_init(params, cfg) -> None:
  """An init's params have the model's tree and shapes (model.init_params_shapes), or one-line
  ConfigError naming the first that differs, before anything is placed or compiled."""
  want = model.init_params_shapes(cfg)
  is_leaf = lambda l: isinstance(l, model.ShapeLeaf)
  got_paths = jax.tree_util.tree_flatten_with_path(params)[0]
  want_paths = jax.tree_util.tree_flatten_with_path(want, is_leaf=is_leaf)[0]
  got = {jax.tree_util.keystr(k): tuple(np.shape(a)) for k, a in got_paths}
  need = {jax.tree_util.keystr(k): tuple(l.shape) for k, l in want_paths}
  for name in sorted(set(got) | set(need)):
    if got.get(name) != need.get(name):
      raise ConfigError(f"init: params{name} has shape {got.get(name, 'missing')}, the model "
                        f"needs {need.get(name, 'none')}")


_DUMP_LOCK = threading.Lock()     # compare compiles strategies in threads; the cache switch is global


def _compile(lowered, mixed: bool, dump_dir: str | None = None, platform: str | None = None):
  """-> (compiled, the HLO text to count collectives in: see measure/hlo.py WIRE_PASS). A dump
  (the wire pass's, or dump_dir's) needs a real compile: the persistent compilation cache is
  off for it (its key ignores the dump flags, and jax memoises "cache on", hence reset_cache
  both ways). platform: the mesh's (layout/mesh.platform), None for the default backend's."""
  wire = hlo.wire_dump_needed(mixed, platform)
  if not wire and dump_dir is None:
    compiled = lowered.compile()
    return compiled, compiled.as_text()
  from jax.experimental.compilation_cache import compilation_cache
  with tempfile.TemporaryDirectory() as d, _DUMP_LOCK:
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    options = hlo.wire_dump_options(dump_dir or d) if wire else {"xla_dump_to": dump_dir}
    if dump_dir is not None:
      options["xla_dump_hlo_as_text"] = True
    try:
      compiled = lowered.compile(compiler_options=options)
    finally:
      jax.config.update("jax_enable_compilation_cache", cache)
      compilation_cache.reset_cache()
    return compiled, (wire and hlo.read_wire_dump(dump_dir or d)) or compiled.as_text()


def steps(job: Job, n: int, start: int = 0):
  """The training loop (run.py, compare and the tests): n steps from the job's state, which has
  already taken `start` steps (batches are a pure function of the step index). Yields
  (i, params, opt_state, metrics as numpy, seconds) after each step i = start .. start+n-1."""
  params, opt_state = job.params, job.opt_state
  for i in range(start, start + n):
    b = job.batch(i)
    t0 = time.perf_counter()
    params, opt_state, m = job.step(params, opt_state, b)
    m = jax.tree.map(to_host, m)
    yield i, params, opt_state, m, time.perf_counter() - t0


def to_host(a) -> np.ndarray:
  """The global value as numpy on every process (all-gathered when this process does not hold
  it all; every process must call this in the same order then)."""
  if a.is_fully_addressable or a.is_fully_replicated:
    return np.asarray(jax.device_get(a))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def finite(m) -> bool:
  """Loss and grad norm of a step's metrics are finite."""
  return bool(np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]))


def _ns(mesh, spec):
  return None if mesh is None else jax.sharding.NamedSharding(mesh, spec)
