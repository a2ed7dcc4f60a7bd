"""Collective and cost statistics read from a compiled (post-SPMD) XLA program.

Feed it ``jax.jit(f).lower(*args).compile()`` (or its ``.as_text()``): the
per-device HLO after partitioning, where the collectives the partitioner and
``shard_map`` inserted are visible. (``lowered.as_text()`` is StableHLO with
sharding annotations only and contains no partitioner collectives.)

Facts this parser relies on (XLA:CPU, 8 devices; held by tests/test_hlo.py on every jax the CI
runs):

* An op line reads ``[ROOT] %name = <shape> <opcode>(operands), attrs...``.
  Names are arbitrary (``%psum_invariant.7 = ... all-reduce(``), so we match
  the opcode, never the name.
* ``all-to-all`` is a tuple op, one buffer per peer: its bytes are the sum.
  The all-reduce combiner also merges independent all-reduces into one tuple
  op; that counts as one op whose bytes are the sum.
* ``replica_groups`` come in three spellings:
    - explicit ``{{0,1},{2,3}}`` (shard_map collectives; ``{}`` = all devices);
    - iota ``[G,S]<=[d0,d1,..]T(p0,p1,..)``: ``arange(N).reshape(d).transpose(p)
      .reshape(G, S)``;
    - mesh ``mesh['axis_0'=2,'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1'}``
      (partitioner collectives). The axes are XLA's own (renamed ``axis_i``)
      and need not match the user's mesh: ``P(('a','b'))`` on a (2,4) mesh
      shows up as ``mesh['axis_0'=8,'axis_1'=1]``. ``device_ids`` (optional)
      is an iota list reshaped to the mesh shape; a group is the set of
      devices varying along the listed axes, in listed order (major first).
      Sub-axes print as ``'axis_0':(pre)size``.
* ``collective-permute`` has ``source_target_pairs={{0,1},...}`` instead;
  we keep the pairs as its ``groups``.
* Ops inside a ``while`` body appear once but run ``known_trip_count`` times
  (``backend_config={..."known_trip_count":{"n":"3"}}``); nested loops
  multiply. A loop whose trip count is unknown is counted once.
* XLA keeps trivial collectives: a ``psum`` over a size-1 mesh axis compiles
  to an all-reduce with ``replica_groups={{0},{1},...}``. ``collective_ops``
  reports them; the ``*_stats`` functions skip them (no data moves).
* A ``conditional``'s branches run at most as often as the conditional; a branch's ops are
  counted at every run of it (an upper bound), unless the op's ``metadata={op_name="..."}``
  holds a named scope ``<name>.taken_<k>_of_<n>`` (``TAKEN``): the program says there that each
  device takes that branch k times in every n runs of its conditional, and the op counts k/n
  of its runs (a float; sums over a scope's ops are whole); nested scopes multiply. The
  persistent compilation cache keys a program without its metadata: two programs that differ
  only in scopes read as one.
* CPU emits no async ``-start``/``-done`` pairs; on other backends a pair is
  reported once, with the groups of the start and the result bytes of the
  done.
"""

from __future__ import annotations

from collections import defaultdict
import glob
import math
import os
import re
from typing import NamedTuple

import numpy as np

COLLECTIVE_KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce",
          "collective-permute", "ragged-all-to-all")

Groups = tuple[tuple[int, ...], ...]


class CollectiveOp(NamedTuple):
  """One collective instruction of the compiled program."""
  kind: str     # one of COLLECTIVE_KINDS
  bytes: int    # per-device result bytes of one execution
  groups: Groups  # device-id groups (source/target pairs for a permute)
  count: float  # executions per program run (loop trip counts multiplied; TAKEN's share)


# ----------------------------------------------------------------------------
# Line-level parsing.

_OPCODES = "|".join(sorted(COLLECTIVE_KINDS, key=len, reverse=True))
_OP_LINE = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*"
  r"(?P<shape>\(.*?\)|[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?)\s+"
  r"(?P<kind>" + _OPCODES + r")(?P<suffix>-start|-done)?\((?P<args>[^)]*)\)")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMP_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(
  r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)"
  r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
TAKEN = re.compile(r"([\w-]+)\.taken_(\d+)_of_(\d+)/")   # a named scope: a branch's share
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COND = re.compile(r"\bcondition=%?([\w.\-]+)")
_S32_CONST = re.compile(r"= s32\[\](?:\{[^}]*\})? constant\((\d+)\)")   # XLA:TPU adds a layout
_NUM_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_REPLICA_COUNT = re.compile(r"\breplica_count=(\d+)")


def _dtype_bits(dtype: str) -> int | None:
  """Bit width of an HLO element type (None for token/opaque)."""
  if dtype == "pred":
    return 8
  if dtype in ("c64", "c128"):
    return int(dtype[1:])
  m = re.match(r"^(?:bf|f|s|u|tf)(\d+)", dtype)
  return int(m.group(1)) if m else None


def shape_bytes(shape: str) -> int:
  """Total bytes of every array in an HLO shape string (tuples summed)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    bits = _dtype_bits(dtype)
    if bits is None:
      continue
    n = math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
    total += (n * bits + 7) // 8
  return total


def _ints(s: str) -> list[int]:
  return [int(v) for v in re.findall(r"-?\d+", s)]


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
  """Flat device ids of an iota list ``[reshape]T(perm)``."""
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  return (ids.transpose(perm) if perm else ids).reshape(-1)


def _parse_device_ids(text: str) -> np.ndarray:
  """``[dims]T(perm)`` iota, ``[dims]i0,i1,..`` or ``i0,i1,..`` device ids."""
  m = re.fullmatch(r"\s*\[([\d,\s]*)\](?:T\(([\d,\s]*)\))?(.*)", text)
  if m is None:
    return np.asarray(_ints(text))
  if m.group(3).strip():
    return np.asarray(_ints(m.group(3)))
  return _iota(_ints(m.group(1)), _ints(m.group(2)) if m.group(2) else None)


def _explicit_groups(body: str, num_devices: int | None) -> Groups:
  groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", body))
  if not groups and num_devices:  # `{}` means one group of every device
    groups = (tuple(range(num_devices)),)
  return groups


def _iota_groups(n_groups: int, size: int, reshape: str, perm: str | None) -> Groups:
  ids = _iota(_ints(reshape), _ints(perm) if perm else None).reshape(n_groups, size)
  return tuple(tuple(int(v) for v in row) for row in ids)


def _mesh_groups(mesh_axes: str, device_ids: str | None, group_axes: str) -> Groups:
  """Decode ``mesh[...] , device_ids=(...) {axes}`` replica groups."""
  axes = re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", mesh_axes)
  names = [a for a, _ in axes]
  sizes = [int(s) for _, s in axes]
  n = math.prod(sizes)
  ids = np.arange(n) if device_ids is None else _parse_device_ids(device_ids)
  # Referenced (sub-)axes: (axis index, pre_size, size); full axis = (i, 1, N).
  refs = []
  for item in filter(None, (t.strip() for t in group_axes.split(","))):
    m = re.fullmatch(r"'?([\w.\-]+?)'?(?::\((\d+)\)(\d+))?", item)
    i = names.index(m.group(1))
    refs.append((i, int(m.group(2)), int(m.group(3))) if m.group(2) else (i, 1, sizes[i]))
  # Split every mesh axis at the sub-axis boundaries (major to minor).
  cuts = [sorted({1, sizes[i]} | {c for j, p, s in refs if j == i for c in (p, p * s)})
      for i in range(len(sizes))]
  split_dims, offsets = [], []
  for cs in cuts:
    offsets.append(len(split_dims))
    split_dims += [b // a for a, b in zip(cs, cs[1:])]
  grouped = [offsets[i] + k
       for i, p, s in refs
       for k in range(cuts[i].index(p), cuts[i].index(p * s))]
  rest = [d for d in range(len(split_dims)) if d not in grouped]
  size = math.prod(split_dims[d] for d in grouped)
  table = ids.reshape(split_dims).transpose(rest + grouped).reshape(-1, size)
  return tuple(tuple(int(v) for v in row) for row in table)


def parse_replica_groups(line: str, num_devices: int | None = None) -> Groups:
  """Device groups of one HLO collective line, in any of the three formats.

  ``collective-permute`` lines give their ``source_target_pairs``.
  Returns ``()`` when the line has neither attribute.
  """
  m = re.search(r"source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}", line)
  if m:
    return _explicit_groups(m.group(1), None)
  m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", line)
  if m:
    return _explicit_groups(m.group(1), num_devices)
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,\s]*)\](?:T\(([\d,\s]*)\))?", line)
  if m:
    return _iota_groups(int(m.group(1)), int(m.group(2)), m.group(3), m.group(4))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]"
         r"(?:\s*,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", line)
  if m:
    return _mesh_groups(m.group(1), m.group(2), m.group(3))
  return ()


# ----------------------------------------------------------------------------
# Program-level parsing.

def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  """Split HLO text into {computation name: instruction lines}, entry name."""
  comps, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    if line and not line[0].isspace():
      m = _COMP_HEADER.match(line)
      if m:
        current = m.group(1)
        comps[current] = []
        if line.startswith("ENTRY"):
          entry = current
      elif line.startswith("}"):
        current = None
      continue
    if current is not None:
      comps[current].append(line)
  return comps, entry


def _trip_count(line: str, comps: dict[str, list[str]]) -> int:
  """A while's trips: XLA's known_trip_count annotation, or (a module dumped before the pass
  that annotates it) a scan's condition `i < N`: one s32 constant N and a compare LT."""
  trip = _TRIP.search(line)
  if trip:
    return int(trip.group(1))
  cond = _COND.search(line)
  body = comps.get(cond.group(1), []) if cond else []
  consts = [int(c) for l in body for c in _S32_CONST.findall(l)]
  if len(consts) == 1 and any("compare(" in l and "direction=LT" in l for l in body):
    return consts[0]
  return 1


def _execution_counts(comps: dict[str, list[str]], entry: str | None) -> dict[str, int]:
  """How often each computation runs per program run (while bodies x trips)."""
  callers = defaultdict(list)  # callee -> [(caller, multiplier)]
  for name, lines in comps.items():
    for line in lines:
      if re.search(r"-done\(", line):  # an async pair is called once
        continue
      mult = _trip_count(line, comps) if " while(" in line else 1
      callees = _CALLEE.findall(line)
      for b in _BRANCHES.findall(line):
        callees += [c.strip().lstrip("%") for c in b.split(",") if c.strip()]
      for callee in callees:
        callers[callee].append((name, mult))

  memo: dict[str, int] = {}

  def count(name: str, stack: frozenset = frozenset()) -> int:
    if name in memo:
      return memo[name]
    if name == entry or not callers.get(name) or name in stack:
      n = 1  # entry, or a computation we cannot place: assume once
    else:
      n = sum(count(c, stack | {name}) * k for c, k in callers[name])
    memo[name] = n
    return n

  return {name: count(name) for name in comps}


def _num_devices(hlo_text: str) -> int | None:
  parts = _NUM_PARTITIONS.search(hlo_text)
  reps = _REPLICA_COUNT.search(hlo_text)
  n = (int(parts.group(1)) if parts else 1) * (int(reps.group(1)) if reps else 1)
  return n if (parts or reps) else None


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
  """Every collective of a compiled HLO module, in text order.

  Trivial collectives (all groups of size 1) are included; see module doc.
  """
  comps, entry = _computations(hlo_text)
  if not comps:  # a bare snippet: treat all lines as one computation
    comps, entry = {"snippet": hlo_text.splitlines()}, "snippet"
  counts = _execution_counts(comps, entry)
  n_dev = _num_devices(hlo_text)
  ops, started = [], {}
  for name, lines in comps.items():
    for line in lines:
      m = _OP_LINE.match(line)
      if not m:
        continue
      kind, suffix = m.group("kind"), m.group("suffix")
      if suffix == "-start":  # wait for the done to know the result bytes
        started[m.group("name")] = parse_replica_groups(line, n_dev)
        continue
      if suffix == "-done":
        operand = m.group("args").split(",")[0].strip().split()[-1].lstrip("%")
        groups = started.pop(operand, ())
      else:
        groups = parse_replica_groups(line, n_dev)
      # nested scopes multiply; one scope named twice in an op's path (remat's recompute
      # repeats its forward's scopes inside the backward's) counts once
      share = math.prod(int(k) / int(n) for _, k, n in set(TAKEN.findall(line)))
      ops.append(CollectiveOp(kind, shape_bytes(m.group("shape")), groups,
                  counts[name] * share))
  return ops


def is_trivial(op: CollectiveOp) -> bool:
  """True when no data moves: every group has one device (or self-sends only)."""
  if op.kind == "collective-permute":
    return all(p[0] == p[-1] for p in op.groups)
  return bool(op.groups) and all(len(g) <= 1 for g in op.groups)


# ----------------------------------------------------------------------------
# Mapping groups to mesh axes.

def _device_coords(mesh) -> dict[int, tuple[int, ...]]:
  """{id in the HLO's groups: mesh coordinates}. A compiled program's groups name its devices by
  their place in its device assignment (use_global_device_ids: replica x partitions +
  partition), which for a step over one mesh is the mesh's devices in row-major order, not their
  device ids: on a TPU slice jax.make_mesh orders a 2x2x2 torus's ids as 0,1,3,2,6,7,5,4."""
  shape = np.asarray(mesh.devices).shape
  return {i: tuple(int(c) for c in np.unravel_index(i, shape)) for i in range(math.prod(shape))}


def op_axes(op: CollectiveOp, mesh) -> frozenset[str]:
  """Mesh axis names a collective's groups span.

  The axes are those along which group members differ; each group must be
  exactly the devices varying along them (for a permute: each pair must
  differ only along them). Trivial ops give ``frozenset()``; groups that do
  not match any axis subset give ``frozenset({"?"})``.
  """
  if is_trivial(op):
    return frozenset()
  coords = _device_coords(mesh)
  names = tuple(mesh.axis_names)
  try:
    members = [[coords[d] for d in g] for g in op.groups]
  except KeyError:
    return frozenset({"?"})
  if not members:
    return frozenset({"?"})
  varying = {a for g in members for a in range(len(names))
       if len({c[a] for c in g}) > 1}
  if op.kind != "collective-permute":
    want = math.prod(mesh.devices.shape[a] for a in varying)
    for g in members:
      fixed = {a: g[0][a] for a in range(len(names)) if a not in varying}
      ok = (len(g) == want and len(set(g)) == want
         and all(c[a] == v for c in g for a, v in fixed.items()))
      if not ok:
        return frozenset({"?"})
  return frozenset(names[a] for a in varying)


# ----------------------------------------------------------------------------
# Summaries.

def _zero() -> dict[str, int]:
  return {"count": 0, "bytes": 0, "wire_bytes": 0}


def wire_factor(kind: str, n: int) -> float:
  """Bytes one device sends per byte of a collective's per-device result, over a group of n
  devices (ring algorithms; a permute sends its buffer once): all-gather (n-1)/n of the gathered
  result, reduce-scatter (n-1) x the scattered result, all-reduce 2(n-1)/n, all-to-all (n-1)/n
  (the block for itself stays)."""
  if n <= 1:
    return 0.0
  return {"all-gather": (n - 1) / n, "reduce-scatter": n - 1, "all-reduce": 2 * (n - 1) / n,
          "all-to-all": (n - 1) / n, "ragged-all-to-all": (n - 1) / n,
          "collective-permute": 1.0}[kind]


def group_size(op: CollectiveOp) -> int:
  """Devices in one of the op's groups (2 for a permute's source-target pair)."""
  return 2 if op.kind == "collective-permute" else max((len(g) for g in op.groups), default=1)


def collective_stats(hlo_text: str, mesh=None) -> dict[str, dict[str, int]]:
  """{kind: {"count", "bytes", "wire_bytes"}} summed over executions; trivial ops skipped.

  ``bytes`` is per device: sum of count * result bytes; ``wire_bytes`` what the device sends for
  them (`wire_factor`). Every kind of COLLECTIVE_KINDS is present. ``mesh`` is accepted for
  symmetry and unused.
  """
  del mesh
  return _by_kind(collective_ops(hlo_text))


def _stats(ops, key, stats) -> dict:
  """Sum count, count * bytes and the wire bytes of the non-trivial ops into stats[key(op)]."""
  for op in ops:
    if not is_trivial(op):
      entry = stats[key(op)]
      entry["count"] += op.count
      entry["bytes"] += op.count * op.bytes
      entry["wire_bytes"] += op.count * op.bytes * wire_factor(op.kind, group_size(op))
  for entry in stats.values():              # TAKEN's shares sum to whole counts
    for k in ("count", "bytes"):
      if abs(entry[k] - round(entry[k])) < 1e-6 * max(1, abs(entry[k])):
        entry[k] = int(round(entry[k]))
  return stats


def collective_stats_by_axes(hlo_text: str, mesh) -> dict[tuple[str, frozenset], dict[str, int]]:
  """{(kind, mesh axes): {"count", "bytes", "wire_bytes"}}; only keys that occur."""
  return _by_axes(collective_ops(hlo_text), mesh)


def bytes_by_axes(stats: dict) -> dict[tuple[str, frozenset], int]:
  """collective_stats_by_axes' stats -> {(kind, mesh axes): result bytes}, the form
  measure.cost.by_axes gives the model's in and measure.compilers.agreement reads."""
  return {k: v["bytes"] for k, v in stats.items()}


def _by_kind(ops) -> dict:
  return _stats(ops, lambda op: op.kind, {k: _zero() for k in COLLECTIVE_KINDS})


def _by_axes(ops, mesh) -> dict:
  return dict(_stats(ops, lambda op: (op.kind, op_axes(op, mesh)), defaultdict(_zero)))


def compiled_stats(compiled, mesh=None, text: str | None = None) -> dict:
  """FLOPs (per device), memory and collective stats of a compiled program.

  Returns ``{"flops": float, "memory": {argument_bytes, output_bytes,
  temp_bytes, alias_bytes}, "collectives": collective_stats(...)}`` and, with
  a mesh, ``"collectives_by_axes"``. Get the text itself from
  ``compiled.as_text()``; `text` overrides it for the collectives (a train Job's ``hlo``:
  bf16 collectives on XLA:CPU, see WIRE_PASS).
  """
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
    cost = cost[0] if cost else {}
  mem = compiled.memory_analysis()
  field = lambda name: int(getattr(mem, name, 0) or 0)
  ops = collective_ops(text or compiled.as_text())   # parsed once for both views
  out = {
    "flops": float((cost or {}).get("flops", 0.0)),
    "memory": {
      "argument_bytes": field("argument_size_in_bytes"),
      "output_bytes": field("output_size_in_bytes"),
      "temp_bytes": field("temp_size_in_bytes"),
      "alias_bytes": field("alias_size_in_bytes"),
    },
    "collectives": _by_kind(ops),
  }
  if mesh is not None:
    out["collectives_by_axes"] = _by_axes(ops, mesh)
  return out


# ----------------------------------------------------------------------------- dtypes on the wire
# XLA:CPU runs every collective in float32: its runtime has no bf16 collectives, so the passes
# all-reduce-promotion and float-normalization-bf16 upcast them (convert, f32 op, convert back).
# GPU and TPU move bf16 as the program says. The cost model counts what the program moves, so on
# CPU the collectives are read from the module as it stands right before those passes: already
# SPMD-partitioned and optimised (the same ops, groups and shapes as the final HLO, measured in
# tests/test_precision.py), only not yet upcast. Bytes per (kind, axes) are the final HLO's;
# op counts are not: XLA combines all-reduces after this point.
WIRE_PASS = "all-reduce-promotion"


def wire_dump_needed(mixed: bool, platform: str | None = None) -> bool:
  """A bf16 program on XLA:CPU: its collectives are read from the WIRE_PASS dump. platform: the
  one it compiles for (default: the default backend's; a --target's compile-only devices are
  the target's, whose final HLO keeps bf16 collectives and is read as it is)."""
  import jax
  return mixed and (platform or jax.default_backend()) == "cpu"


def wire_dump_options(dump_dir: str) -> dict:
  """compiler_options that dump the module before WIRE_PASS into dump_dir."""
  return {"xla_dump_to": dump_dir, "xla_dump_hlo_pass_re": WIRE_PASS}


def read_wire_dump(dump_dir: str) -> str | None:
  """The dumped module before WIRE_PASS (the last one, if several jits were compiled)."""
  files = sorted(glob.glob(os.path.join(dump_dir, f"*.before_{WIRE_PASS}.txt")))
  if not files:
    return None
  with open(files[-1]) as f:
    return f.read()
