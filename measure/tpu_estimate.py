"""XLA:TPU's own estimate of a compiled step's time, counted over its loops.

XLA:TPU annotates each op of the compiled program with the cycles it expects the op to take
(`"estimated_cycles"` in the op's backend_config). `compiled.cost_analysis()["optimal_seconds"]`
reads a loop's body once, so a step that scans its layers is estimated as one layer. Here each
op's cycles are multiplied by how often its computation runs per step (while loops' trip counts,
measure.hlo's execution counts) and summed; a cycle is turned into seconds by the compiler's
own estimate of one matmul on one chip (`seconds_per_cycle`: `optimal_seconds` over the cycles
of a [2048, 8192] @ [8192, 8192] bf16 matmul, a program with no loop). An op the compiler could
not estimate carries the int64 maximum and is counted apart (`unknown`).

  python bench/tpu_estimate.py --target=tpu-v5p      # each strategy beside the planner's time
"""
from __future__ import annotations

import functools
import re

from measure import hlo

_CYCLES = re.compile(r'"estimated_cycles":"?(\d+)')
_UNKNOWN = 2**62                        # the compiler's "no estimate" (int64 max) and above


def step_cycles(hlo_text: str) -> tuple[float, int]:
  """(the cycles XLA:TPU estimates for one run of the program, each op's cycles x the runs of
  its computation; the ops it gave no estimate) of a compiled module's text."""
  comps, entry = hlo._computations(hlo_text)
  counts = hlo._execution_counts(comps, entry)
  total, unknown = 0.0, 0
  for name, lines in comps.items():
    for line in lines:
      m = _CYCLES.search(line)
      if not m:
        continue
      cycles = int(m.group(1))
      if cycles >= _UNKNOWN:
        unknown += 1
      else:
        total += counts[name] * cycles
  return total, unknown


def optimal_seconds(compiled) -> float:
  """`compiled.cost_analysis()["optimal_seconds"]` (a dict, or a list of one per jax version)."""
  analysis = compiled.cost_analysis()
  return (analysis if isinstance(analysis, dict) else analysis[0])["optimal_seconds"]


@functools.lru_cache(maxsize=8)
def seconds_per_cycle(device) -> float:
  """Seconds a cycle of `device`'s estimates stands for: the compiler's optimal_seconds of one
  [2048, 8192] @ [8192, 8192] bf16 matmul on that device over its estimated cycles."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding
  on = SingleDeviceSharding(device)
  a = jax.ShapeDtypeStruct((2048, 8192), jnp.bfloat16, sharding=on)
  b = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16, sharding=on)
  compiled = jax.jit(lambda x, y: x @ y).lower(a, b).compile()
  cycles, _ = step_cycles(compiled.as_text())
  return optimal_seconds(compiled) / cycles
