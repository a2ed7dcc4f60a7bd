"""Strategy registry: `--strategy=NAME` loads `strategies/NAME.py`.

Every strategy module exposes the same small functional interface:
  NAME: str, AXES: tuple of mesh axis names (mesh order), MAIN_AXIS: the axis that gets all
  devices when --mesh is omitted, and
  check(cfg, mesh)            -> None, raises common.config.ConfigError with a one-line message
  param_specs(cfg, mesh)      -> pytree of PartitionSpec shaped like common.model params, written
                                 as a role -> spec table (common.model.param_specs: one layer's
                                 array per role; the stacked [L] dim is never sharded)
  batch_spec(cfg, mesh)       -> PartitionSpec of tokens/targets/positions [B, S]
  layout(cfg, mesh)           -> common.model.Layout (shardings + the routed-MoE implementation)
  prepare_batch(b, cfg, mesh) -> optional: reorder the global numpy batch (CP load balancing)
  cost(cfg, mesh)             -> list of common.cost.Term, each over named mesh axes: the
                                 weight traffic from common.cost.weight_terms (stored vs used
                                 specs by role) plus the strategy's own activation terms
  __doc__                     -> opens with the contract: mesh axes, sharding table, collectives
                                 per layer; its "HLO contract" block lists (kind over axes) lines
                                 that must equal both the compiled program and cost()'s terms
  contract_variant(cfg)       -> optional: the name of another "HLO contract, <name>:" block
  COMPARE_MESH                -> optional mesh spec for the comparison table when the main axis
                                 alone does not fit the presets (its first axis is scaled to the
                                 device count)
The reference has AXES = () and runs on one device with no mesh.
"""
from __future__ import annotations

import importlib

from common.config import ConfigError

# Order = the order of the comparison table.
NAMES = ["reference", "dp", "fsdp", "tp", "ep", "cp", "ep_as_cp", "shard_exp_on_fsdp", "ep_tp", "pp"]


def available() -> list[str]:
  """Registered names whose module exists in this checkout."""
  out = []
  for n in NAMES:
    try:
      importlib.import_module(f"strategies.{n}")
      out.append(n)
    except ModuleNotFoundError as e:
      if e.name != f"strategies.{n}":
        raise
  return out


def get(name: str):
  if name not in NAMES:
    raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(available())}")
  try:
    return importlib.import_module(f"strategies.{name}")
  except ModuleNotFoundError as e:
    if e.name == f"strategies.{name}":
      raise ConfigError(f"strategy {name!r} is not implemented in this checkout") from None
    raise
