"""What XLA's temp holds at its peak, read from a step's dump (runtime.train.build(dump_dir=D)):
the scheduled optimized module and its buffer assignment, on XLA:CPU, whose temporaries share
one preallocated allocation.

A value lives from its defining instruction to its last use, on one timeline: the entry
computation's schedule, each while, call and conditional's computations inlined at the
instruction that runs them (a loop body's values are counted once, over the body's span, not
per iteration). At each point the live values' address ranges in the temp allocation are merged
(aliases share their addresses); the point where they span the most bytes is the peak. That
span is at most XLA's temp size: the rest is fragmentation and this liveness's approximation.

  peak(D) -> Peak(bytes, temp_bytes, at, buffers): buffers are the distinct address ranges
  live at the peak, largest first, each (bytes, shape, the instruction that defines it).
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re

_VALUE = re.compile(r"value: <\d+ (\S+) @[^>]*> \(size=(\d+),offset=(\d+)\): (\S+)")
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%(\S+) = (.*)$")
_CALLS = re.compile(r"(?:condition|body|to_apply|true_computation|false_computation)=%([\w.\-]+)")


@dataclasses.dataclass
class Peak:
  bytes: int                 # the live values' merged address span at the peak
  temp_bytes: int            # XLA's preallocated temp allocation
  at: str                    # the instruction at the peak
  buffers: list              # [(bytes, shape, defining instruction)], largest first


def _files(dump_dir: str) -> tuple[str, str]:
  """The largest module's optimized HLO and buffer assignment in dump_dir."""
  assignments = glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt"))
  if not assignments:
    raise ValueError(f"no buffer assignment in {dump_dir}: build with dump_dir on XLA:CPU")
  assignment = max(assignments, key=os.path.getsize)
  module = assignment.replace("-buffer-assignment.txt", ".txt")
  with open(module) as f, open(assignment) as g:
    return f.read(), g.read()


def _temp_values(assignment: str) -> tuple[dict, int]:
  """{instruction: [(offset, size, shape)]} of the values in the preallocated temp, its size."""
  m = re.search(r"allocation \d+: size (\d+), [^\n]*preallocated-temp:\n(.*?)(?:\nallocation |\Z)",
                assignment, re.S)
  if m is None:
    raise ValueError("the buffer assignment has no preallocated temp (XLA:CPU's)")
  values = collections.defaultdict(list)
  for v in _VALUE.finditer(m.group(2)):
    values[v.group(1)].append((int(v.group(3)), int(v.group(2)), v.group(4)))
  return values, int(m.group(1))


def _computations(module: str) -> tuple[dict, str]:
  """{computation: [(instruction, its op, operands, computations it runs, is root)]}, and the
  entry's name."""
  comps, cur, entry = {}, None, None
  for line in module.split("\n"):
    head = _COMPUTATION.match(line)
    if head:
      cur = head.group(2)
      comps[cur] = []
      entry = cur if head.group(1) else entry
    elif line.startswith("}"):
      cur = None
    elif cur is not None and (ins := _INSTRUCTION.match(line)):
      body = ins.group(3).split(", metadata=")[0]
      op = re.match(r"^(?:\(.*?\)|\S+) ([\w\-]+)\(", body)
      op = op.group(1) if op else ""
      runs = []
      if op in ("while", "call", "conditional"):
        runs = _CALLS.findall(body)
        branches = re.search(r"branch_computations=\{([^}]*)\}", body)
        if branches:
          runs += re.findall(r"%([\w.\-]+)", branches.group(1))
      comps[cur].append((ins.group(2), op, re.findall(r"%([\w.\-]+)", body), runs,
                         bool(ins.group(1))))
  return comps, entry


def _live_ranges(comps: dict, entry: str) -> tuple[dict, dict, list]:
  """Each instruction's first and last point on the inlined timeline, and the timeline."""
  timeline, start, end = [], {}, {}

  def walk(comp: str) -> None:
    first = len(timeline)
    names = {n for n, *_ in comps[comp]}
    for name, op, operands, runs, _ in comps[comp]:
      for c in dict.fromkeys(runs):
        if c in comps:
          walk(c)
      timeline.append(name)
      at = len(timeline) - 1
      start[name] = first if op == "parameter" else at
      for o in operands:
        if o in names and o in start and o != name:
          end[o] = max(end.get(o, start[o]), at)
    last = len(timeline) - 1
    for name, _, _, _, root in comps[comp]:
      end[name] = last if root else end.get(name, start[name])

  walk(entry)
  return start, end, timeline


def peak(dump_dir: str) -> Peak:
  module, assignment = _files(dump_dir)
  values, temp_bytes = _temp_values(assignment)
  start, end, timeline = _live_ranges(*_computations(module))
  events = collections.defaultdict(list)
  for name, spans in values.items():
    if name in start:
      for off, size, shape in spans:
        events[start[name]].append((True, (name, off, size, shape)))
        events[end[name] + 1].append((False, (name, off, size, shape)))
  live, best = set(), (0, 0, set())
  for point in sorted(events):
    for born, value in events[point]:
      (live.add if born else live.discard)(value)
    span, hi = 0, -1
    for lo, top in sorted((off, off + size) for _, off, size, _ in live):
      if top > hi:
        span += top - max(lo, hi)
        hi = top
    if span > best[0]:
      best = (span, point, set(live))
  span, point, snapshot = best
  distinct = {}
  for name, off, size, shape in sorted(snapshot):
    distinct.setdefault((off, size), (size, shape, name))
  return Peak(span, temp_bytes, timeline[min(point, len(timeline) - 1)] if timeline else "",
              sorted(distinct.values(), reverse=True))
