"""Strategy registry: `--strategy=NAME` loads `strategies/NAME.py`.

Every strategy module exposes the same small functional interface:
  NAME: str, AXES: tuple of mesh axis names (mesh order), MAIN_AXIS: the axis that gets all
  devices when --mesh is omitted, and
  Options                     -> a frozen dataclass of the strategy's own knobs (--opt=k=v,...,
                                 parsed by layout/options.py), or layout.options.NoOptions
  check(cfg, mesh, opts)      -> None, raises modeling.config.ConfigError with a one-line message
  param_specs(cfg, mesh, opts=None) -> pytree of PartitionSpec shaped like modeling.model params (opts:
                                 the Options, which may store them: ep_x_tp zero1), written
                                 as a role -> spec table (modeling.model.param_specs: one layer's
                                 array per role; the stacked [L] dim is unsharded, or split over
                                 pipeline stages)
  batch_spec(cfg, mesh)       -> PartitionSpec of tokens/targets/positions [B, S]
  layout(cfg, mesh, opts)     -> modeling.model.Parallelism: how it runs the model on its mesh
                                 (shardings + the routed-MoE implementation)
  prepare_batch(b, cfg, mesh) -> optional: reorder the global numpy batch (CP load balancing)
  cost(cfg, mesh, opts)       -> list of measure.cost.Term, each over named mesh axes: the
                                 weight traffic from measure.cost.weight_terms (stored vs used
                                 specs by role) plus the strategy's own activation terms
  __doc__                     -> opens with the contract: mesh axes, sharding table, collectives
                                 per layer; its "HLO contract" block lists (kind over axes) lines
                                 that must equal both the compiled program and cost()'s terms
  contract_variant(opts)      -> optional: the name of another "HLO contract, <name>:" block
  contract_tags(opts, cfg)    -> optional: the tags ("[name]" after a contract line's axes) whose
                                 lines hold for these options and model (cfg None: the defaults;
                                 measure/contract.py)
  activation_shardings(cfg, mesh, opts) -> optional: [(name, sharding)] for --dump_sharding
  COMPARE_MESH                -> mesh spec for the comparison table when the main axis alone
                                 does not fit the presets (its first axis is scaled to the
                                 device count); None: every device on MAIN_AXIS
  GROW_AXIS                   -> optional: the axis COMPARE_MESH caps for the tiny presets only;
                                 at other device counts it grows while the model admits it
  COMPARE_VARIANTS            -> optional: option settings ("key=value:...") that the comparison
                                 of 'all' shows as rows of their own, "NAME:key=value"
  TEST_CASES, COST_CASES, BAD_INPUT -> the strategy's rows of the one table that drives
                                 tests/test_strategies.py (parity and contract per TEST_CASES
                                 row, the cost model per COST_CASES row, one-line errors)
  BF16_CASE                   -> its bf16 mixed-precision row (a Case): tests/test_precision.py
  TARGET_CASES                -> optional: rows only the hardware's compilers compile (ep's ragged
                                 exchange), held to the contract and cost model on XLA:TPU's
                                 program (bench/target_contracts.py, tests/test_target_contracts.py)
  PLAN_GRID, PLAN_EXTRA       -> optional: {option: values} whose every combination the planner
                                 enumerates, and option sets beyond that product
                                 (planning/plan.py option_sets); none: the defaults only
  PLAN_PLATFORM_EXTRA         -> optional: {platform: option sets} it adds on that platform's
                                 clusters ("tpu": ep's ragged exchange)
  INVARIANT_MESHES            -> optional: (preset, (mesh, mesh, ...)[, overrides]): meshes on
                                 which one model must give the same losses
                                 (tests/test_strategies.py::test_layout_invariance)
Optional hooks (read with getattr; absent = the plain behaviour):
  stored_config(cfg, mesh, opts)  -> the model as the options store it (pp: its layer layout,
                                 the interleaved stack); strategies.stored_config calls it
  layout_note(cfg, mesh, opts)    -> a line for the run's header about a layout it picked (pp)
  LAYER_LAYOUT = True             -> it runs --layer_layout's padded MoE stack (pp, reference)
  bubble(cfg, mesh)               -> a pipeline's idle fraction, shown in the mesh cell (pp)
  PIPELINE = True                 -> it runs its microbatches in its own pipeline over `stage`
                                 (pp): the planner prices its passes, not gradient accumulation
  routed_rows(cfg, shape)         -> the planner's rows of one MoE layer's expert computation on
                                 a device, where no all-to-all term gives them (ep_tp)
The reference has AXES = () and runs on one device with no mesh.

Adding a strategy: write strategies/NAME.py to this interface, add NAME to NAMES below, and put
only what is specific to it in tests/test_NAME.py.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

from layout import options
from modeling.config import ConfigError


class Case(NamedTuple):
  """A test row: a preset with config overrides, on a mesh, with the strategy's options."""
  model: str
  mesh: str | None
  overrides: dict = {}           # Config fields over the preset  # noqa: RUF012 (never mutated)
  opts: object = None            # the strategy's Options (None = the defaults)

  def config(self):
    from modeling.config import get_config
    return get_config(self.model, **self.overrides)

  def label(self, name: str) -> str:
    """`ep tiny expert:8 exchange=ragged`: strategy `name`, the preset, the mesh and the options
    that differ from the strategy's defaults."""
    default = get(name).Options()
    opts = vars(self.opts) if self.opts is not None else {}
    return " ".join([name, self.model, self.mesh or "-",
                     *(f"{k}={v}" for k, v in opts.items() if v != getattr(default, k))])


class BadInput(NamedTuple):
  """A config / mesh / options the strategy's check() refuses with exactly this one line."""
  overrides: dict
  mesh: str
  opts: object
  message: str

# Order = the order of the comparison table.
NAMES = ["reference", "dp", "fsdp", "tp", "ep", "cp", "ep_as_cp", "shard_exp_on_fsdp", "ep_tp", "ep_x_tp", "pp"]


def available() -> list[str]:
  """Every registered strategy, in table order."""
  return list(NAMES)


def get(name: str):
  if name not in NAMES:
    raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(NAMES)}")
  return importlib.import_module(f"strategies.{name}")


def split_entry(entry: str) -> tuple[str, dict[str, str]]:
  """A comparison entry -> (strategy name, its own options): "cp" -> ("cp", {}),
  "cp:kv_exchange=ring" -> ("cp", {"kv_exchange": "ring"}) (several joined by ':')."""
  name, *rest = entry.split(":")
  get(name)                                    # unknown name -> one-line error
  own = {}
  for pair in rest:
    key, eq, value = pair.partition("=")
    if not eq or not key or not value:
      raise ConfigError(f"comparison entry {entry!r}: after the strategy come key=value pairs "
                        f"joined by ':' (e.g. cp:kv_exchange=ring)")
    own[key] = value
  return name, own


def of_entry(entry: str):
  """The strategy module a comparison entry runs: "cp:kv_exchange=ring" -> strategies.cp."""
  return get(split_entry(entry)[0])


def stored_config(strat, cfg, mesh, opts):
  """The model as the strategy's options store it (its `stored_config`: pp's interleaved
  schedule stores the MoE stack round-robin over the stages); cfg itself for every other
  strategy, or without a mesh."""
  hook = getattr(strat, "stored_config", None)
  return cfg if hook is None or mesh is None else hook(cfg, mesh, opts)


def compare_entries(name: str) -> list[str]:
  """A strategy's rows in a comparison of 'all': itself, then its COMPARE_VARIANTS (an option
  setting each, e.g. cp's ring K/V exchange beside its all-gather)."""
  return [name] + [f"{name}:{v}" for v in getattr(get(name), "COMPARE_VARIANTS", ())]


def parse_options(names: list[str], pairs: dict[str, str]) -> dict:
  """{entry: its Options} from {key: value} (--opt, split by layout.options.split); an entry is
  a strategy name, or one with its own options (split_entry), which override --opt's.
  Single strategy: every key must be one of its options. Several (compare mode): each key must
  belong to at least one of them and goes to those that have it."""
  classes = {n: get(n).Options for n in NAMES}
  entries = {n: split_entry(n) for n in names}
  if len(names) == 1:
    (base, own), = entries.values()
    others = {n: c for n, c in classes.items() if n != base}
    return {names[0]: options.parse(base, classes[base], {**pairs, **own}, others)}
  for key in pairs:
    if not any(key in options.keys(classes[b]) for b, _ in entries.values()):
      owners = [n for n, c in classes.items() if key in options.keys(c)]
      where = f" (an option of {', '.join(owners)})" if owners else ""
      raise ConfigError(f"--opt key {key!r} belongs to none of the compared strategies{where}")
  return {n: options.parse(b, classes[b], {**{k: v for k, v in pairs.items()
                                             if k in options.keys(classes[b])}, **own})
          for n, (b, own) in entries.items()}
