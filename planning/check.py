"""Compile the best few candidates (compile only) and set the prediction beside the program:
per-device memory (params + optimizer + the temp model vs params + optimizer + XLA's temp
bytes) and bytes per (kind, axes) (the cost model vs the HLO, measure.hlo). On CPU the step is
compiled with --gmm=scan: XLA:CPU lowers ragged_dot through an [E, M, K] buffer no accelerator
holds (docs/planner.md, "Does it fit?"), and the temp model is calibrated on scan's programs.
With --target the target's compiler compiles them (runtime/target.py), ragged_dot as it is.
"""
from __future__ import annotations

import dataclasses
import time

from modeling.config import ConfigError
from planning import clusters, plan


@dataclasses.dataclass
class Checked:
  candidate: plan.Candidate
  compiled_memory: float            # params + optimizer + XLA temp, bytes per device
  compiled_temp: float
  bytes_by_axes: dict               # measure.cost.versus(..., by="axes")
  compile_s: float
  rewrites: str = ""                # a --target's compiler: its rewrites (measure/compilers.py)
  calls_by_axes: dict = dataclasses.field(default_factory=dict)   # (kind, axes) -> (the
  # collectives plan.term_calls counts, merged where a --target's compiler merges, compiled)
  refused_over: float = 0.0         # XLA:TPU refused it: the HBM it has (compiled_temp: needs)

  @property
  def memory_ratio(self) -> float:
    return self.candidate.memory / self.compiled_memory


def distinct(ranked: list[plan.Candidate], k: int) -> list[plan.Candidate]:
  """The first k candidates that compile to different programs (placements of one layout
  compile alike: only the device order differs)."""
  out, seen = [], set()
  for c in ranked:
    key = (c.strategy, c.sizes, c.opts, c.microbatches, c.remat, c.capacity_factor)
    if key not in seen:
      seen.add(key)
      out.append(c)
    if len(out) == k:
      break
  return out


def refusal(c: plan.Candidate, cfg, devices) -> str:
  """Why the compiler of `devices` (a runtime.target.Target) cannot compile c, or "": its
  strategy's check on their mesh (ep's ragged exchange, which a TPU cluster's grid holds, where
  XLA:CPU compiles for a TPU cluster without its slice or libtpu)."""
  from layout import mesh as mesh_lib
  import strategies
  strat = strategies.get(c.strategy)
  try:
    strat.check(plan.config_for(c, cfg), mesh_lib.make_mesh(dict(c.sizes), devices.devices),
                c.opts if c.opts is not None else strat.Options())
  except ConfigError as e:
    return str(e)
  return ""


def compilable(ranked, cfg, devices, passed: list):
  """The candidates of ranked `devices` can compile, in order; each one it cannot is appended
  to passed as (candidate, why)."""
  for c in ranked:
    why = refusal(c, cfg, devices)
    if why:
      passed.append((c, why))
    else:
      yield c


def parse(text: str):
  """A candidate named as STRATEGY@MESH/M=m/REMAT[/option=value...] (bench/plan_memory.py's
  form) -> (strategy, {axis: size}, m, remat, {option: value})."""
  try:
    head, m, remat, *opts = text.split("/")
    name, mesh = head.split("@")
    sizes = {a: int(n) for a, n in (kv.split(":") for kv in mesh.split(","))}
    return name, sizes, int(m.removeprefix("M=")), remat, dict(o.split("=") for o in opts)
  except ValueError:
    raise ConfigError(f"candidate {text!r}: want STRATEGY@AXIS:N,.../M=m/REMAT"
                      "[/option=value...]") from None


def find(cands: list[plan.Candidate], text: str) -> plan.Candidate | None:
  """The admitted candidate of cands, at capacity factor 1.25, that text names (parse), or
  None."""
  name, sizes, m, remat, opts = parse(text)
  return next((c for c in cands if not c.error and c.capacity_factor == 1.25
               and c.strategy == name and c.microbatches == m and c.remat == remat
               and {a: n for a, n in c.sizes if n > 1} == sizes
               and all(str(getattr(c.opts, k)) == v for k, v in opts.items())), None)


def compile_candidate(c: plan.Candidate, cfg, dump_dir: str | None = None,
                      devices=None) -> Checked:
  """Compile c (compile only) and compare it with its prediction. devices: the
  runtime.target.Target to compile for (None = this process's devices, XLA:CPU on this host; a
  --target's compiler keeps the default ragged_dot); dump_dir: where XLA also writes the step's
  module and buffer assignment (measure/peak.py)."""
  import jax

  from layout import mesh as mesh_lib
  from measure import compilers, cost, hlo
  from runtime import target, train
  import strategies
  devices = target.host(jax.devices()) if devices is None else devices
  strat = strategies.get(c.strategy)
  c_cfg = plan.config_for(c, cfg)
  on_cpu = devices.compiler == "XLA:CPU"
  if on_cpu:
    c_cfg = c_cfg.replace(gmm_backend="scan")
  mesh = mesh_lib.make_mesh(dict(c.sizes), devices.devices)
  opts = c.opts if c.opts is not None else strat.Options()
  t0 = time.perf_counter()
  try:
    job = train.build(strat, c_cfg, mesh, opts, compile_only=True, dump_dir=dump_dir)
  except jax.errors.JaxRuntimeError as e:
    oom = target.hbm_oom(e)             # over the chip's HBM: no program, its temp is known
    if oom is None:
      raise
    return Checked(c, c.param_opt + oom[0], oom[0], {}, time.perf_counter() - t0,
                   refused_over=oom[1])
  temp = job.compiled.memory_analysis().temp_size_in_bytes
  got = hlo.collective_stats_by_axes(job.hlo, mesh)
  terms = cost.step_terms(strat, c_cfg, mesh, opts)
  table = cost.versus(terms, got, by="axes")
  rewrites = "" if on_cpu else compilers.said(
      compilers.agreement(cost.by_axes(terms), hlo.bytes_by_axes(got), mesh))
  merges = clusters.MERGES[devices.compiler]
  calls = plan.term_calls(terms, c_cfg, c.strategy, dict(c.sizes), opts, merges)
  counted = {k: (calls.get(k, 0.0), got.get(k, {}).get("count", 0.0))
             for k in set(calls) | set(got)}
  return Checked(c, c.param_opt + temp, temp, table, job.compile_s, rewrites, calls_by_axes=counted)
