"""The docstring contract: a strategy's "HLO contract" block, parsed into (kind, mesh axes).

  HLO contract (...):
    all-gather over (data, fsdp): why
    reduce-scatter over fsdp: why
    all-gather over tensor [muon]: why (only when the step's optimizer is the one named)
    reduce-scatter over context [allgather]: why (only when the strategy's contract_tags(opts)
      name the tag: an option's value)
  HLO contract, <variant>:
    ...

tests/ hold the parsed set equal to the compiled program's collectives (measure/hlo.py) and to
the cost model's terms (measure/cost.py): prose, model and program are one set.
"""
from __future__ import annotations

import re

_CONTRACT = re.compile(r"^\s*(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute"
                       r"|ragged-all-to-all)\s+over\s+\(?([\w, ]+?)\)?\s*(?:\[(\w+)\])?\s*:",
                       re.M)


def _name(header: str) -> str | None:
  """A variant block's name: ', <name>:' or ', <name> (note):' -> <name>."""
  m = re.match(r",\s*([^:(]*?)\s*[:(]", header)
  return m.group(1) if m else None


def declared_collectives(doc: str, mesh, variant: str | None = None,
                         optimizer: str | None = None, tags=()) -> set:
  """{(kind, frozenset(axes))} from a docstring's 'HLO contract' block
  ('  all-gather over (data, fsdp): why'), size-1 axes dropped (no data moves over them).
  A docstring may hold several blocks, one per variant: 'HLO contract' alone is the default,
  'HLO contract, <variant>:' another (the strategy's contract_variant(opts) names it). A line
  whose axes are followed by '[<optimizer>]' holds only for steps of that optimizer (Muon's
  gathers of split matrices: 'all-gather over tensor [muon]:'), or where `tags` (the strategy's
  contract_tags(opts): option values) holds it ('reduce-scatter over context [allgather]:')."""
  blocks = re.split(r"^HLO contract", doc, flags=re.M)[1:]
  header = lambda b: b.split("\n", 1)[0]
  pick = [b for b in blocks if (variant is None and not header(b).startswith(","))
          or (variant is not None and _name(header(b)) == variant)]
  assert len(pick) == 1, (variant, [header(b) for b in blocks])
  out = set()
  for kind, axes, only in _CONTRACT.findall(pick[0]):
    if only and only != optimizer and only not in tags:
      continue
    live = frozenset(a.strip() for a in axes.split(",") if mesh.shape.get(a.strip(), 1) > 1)
    if live:
      out.add((kind, live))
  return out
