"""What `run.py --plan` is told to hold fixed. Each of these flags, given with --plan, restricts
the enumeration (planning.plan's grid) to the candidates that take its value; `build` checks them
against the strategies before anything is enumerated or compiled (one-line ConfigErrors: run.py
exits 2).

  --strategy=NAME, --compare=a,b   only those strategies; an entry's own options
                                   (cp:kv_exchange=ring) restrict that entry as --opt does
  --capacity_factor=CF             only CF: any finite CF >= 0, in the grid (0, 1.25) or not (the
                                   cost model sizes buffers by C = ceil(CF S K / E) for any CF)
  --remat=POLICY                   only POLICY, one of plan.REMATS (the policies the temp model
                                   is calibrated for; the others are refused)
  --microbatches=M                 only M: pp's pipeline M, elsewhere gradient accumulation's;
                                   where M does not divide a batch shard, check() refuses it
  --mesh=AXIS:N,..                 only that mesh (omitted axes 1, its sizes multiplying to
                                   --devices), for each strategy whose axes it names
  --opt=KEY=VALUE,..               only the strategies that have one of the keys, and of their
                                   option sets those taking the values: a field the planner varies
                                   (OPTION_GRID, OPTION_EXTRA) is filtered on, any other is set
                                   (the planner otherwise holds it at its default)
  --layer_layout=c0,c1,..          pp only (the one strategy whose stages hold layer groups),
                                   its stack in that layout: check() admits stage = the number of
                                   groups (interleaved: groups / 2)

A constraint that leaves nothing raises NoCandidate (run.py exits 1): here, where no option set
of any strategy takes an --opt value the planner varies; in planning.cli, where check() refuses
every enumerated candidate.
"""
from __future__ import annotations

import dataclasses
import math

from layout import mesh as mesh_lib
from layout import options as options_lib
from modeling.config import ConfigError
from planning import plan
import strategies


class NoCandidate(Exception):
  """The constraints leave no candidate: one line that names them (run.py: exit 1)."""


@dataclasses.dataclass(frozen=True)
class Constraints:
  """The grid enumerate_candidates walks: each field the planner's own unless a flag fixed it."""
  names: tuple[str, ...] = plan.NAMES
  remats: tuple[str, ...] = plan.REMATS
  capacity_factors: tuple[float, ...] = plan.CAPACITY_FACTORS
  microbatches: int | None = None          # None: the planner's divisors
  mesh: tuple = ()                         # ((axis, size), ...); (): every split of N
  options: tuple = ()                      # ((strategy, (Options, ...)), ...); (): option_sets
  given: tuple[str, ...] = ()              # the constraining flags as given, for the messages

  def kwargs(self) -> dict:
    """plan.enumerate_candidates' keyword arguments."""
    return dict(names=self.names, remats=self.remats, capacity_factors=self.capacity_factors,
                microbatches=self.microbatches, only_mesh=dict(self.mesh) or None,
                options=dict(self.options) if self.options else None)

  def label(self) -> str:
    """The constraining flags, space-separated ('' when none)."""
    return " ".join(self.given)


def build(n: int, names, entries=(), *, chosen: str = "", capacity_factor: float | None = None,
          remat: str | None = None, microbatches: int | None = None, mesh: str | None = None,
          opt: str | None = None, layer_layout: str | None = None) -> Constraints:
  """The constraints of the flags given (None: not given). n: --devices; names: the strategies to
  plan, in order (run.py's bases of --strategy / --compare, else every one); entries: the
  --strategy / --compare entries as given, with their own options ([]: every strategy);
  chosen: that flag as given ('--strategy=ep'), or ''."""
  given = [chosen] if chosen else []
  names = [s for s in names if s != "reference"]
  if not names:
    raise ConfigError(f"{chosen}: the reference runs on one device; --plan ranks the layouts of "
                      "the other strategies")
  out = {}
  if capacity_factor is not None:
    if not (math.isfinite(capacity_factor) and capacity_factor >= 0):
      raise ConfigError(f"--capacity_factor={capacity_factor} must be a finite number >= 0")
    out["capacity_factors"] = (capacity_factor,)
    given.append(f"--capacity_factor={capacity_factor:g}")
  if remat is not None:
    if remat not in plan.REMATS:
      raise ConfigError(f"--remat={remat}: the planner prices remat {' | '.join(plan.REMATS)} "
                        "only (its temp model is calibrated for those)")
    out["remats"] = (remat,)
    given.append(f"--remat={remat}")
  if microbatches is not None:
    if microbatches < 1:
      raise ConfigError(f"--microbatches={microbatches} must be >= 1")
    out["microbatches"] = microbatches
    given.append(f"--microbatches={microbatches}")
  if layer_layout is not None:
    given.append(f"--layer_layout={layer_layout}")
    staged = [s for s in names if getattr(strategies.get(s), "LAYER_LAYOUT", False)]
    if not staged:
      raise ConfigError(f"--layer_layout={layer_layout} is pp's (its stages hold the groups); "
                        f"{', '.join(names)} run the model without it: plan pp, or drop it")
    names = staged
  sets = {}
  if opt is not None:
    given.append(f"--opt={opt}")
    names, sets = _option_sets(names, options_lib.split(opt))
  if any(own for _, own in map(strategies.split_entry, entries)):
    sets = {**sets, **_entry_sets(names, entries, sets)}
  if mesh is not None:
    given.append(f"--mesh={mesh}")
    names, out["mesh"] = _mesh(n, names, mesh, given)
  if sets:
    dead = [s for s in names if s in sets and not sets[s]]
    if len(dead) == len(names):
      why = "; ".join(_varied_values(s) for s in dead)
      raise NoCandidate(f"no candidate left by {' '.join(given)}: no option set the planner "
                        f"enumerates takes those values ({why})")
    names = [s for s in names if s not in dead]
    out["options"] = tuple((s, tuple(sets[s])) for s in names if s in sets)
  return Constraints(names=tuple(names), given=tuple(given), **out)


def _option_sets(names: list[str], pairs: dict[str, str]):
  """--opt's pairs -> (the strategies that have one of its keys, {strategy: its option sets
  taking the values})."""
  has = {s: options_lib.keys(strategies.get(s).Options) for s in names}
  for key in pairs:
    if not any(key in k for k in has.values()):
      owners = [s for s in strategies.NAMES if key in options_lib.keys(strategies.get(s).Options)]
      where = f" (it is an option of {', '.join(owners)})" if owners else ""
      raise ConfigError(f"--opt key {key!r} is an option of none of the planned strategies "
                        f"({', '.join(names)}){where}")
  kept = [s for s in names if any(k in has[s] for k in pairs)]
  return kept, {s: _restrict(s, plan.option_sets(s), {k: v for k, v in pairs.items()
                                                     if k in has[s]})
                for s in kept}


def _entry_sets(names: list[str], entries, sets: dict) -> dict:
  """--compare entries with their own options (cp:kv_exchange=ring) -> {strategy: its option
  sets}: each entry restricts its strategy's sets (after --opt's) as --opt does, and the sets of
  a strategy's entries are united (cp,cp:kv_exchange=ring: every cp set)."""
  out: dict = {}
  for entry in entries:
    base, own = strategies.split_entry(entry)
    if base in names:
      mine = out.setdefault(base, [])
      mine += [o for o in _restrict(base, sets.get(base, plan.option_sets(base)), own)
               if o not in mine]
  return out


def _restrict(name: str, sets: list, pairs: dict[str, str]) -> list:
  """Of a strategy's option sets, those taking `pairs`' values (typed by its Options: one-line
  errors for a bad value): a field the planner varies is filtered on, any other set."""
  cls = strategies.get(name).Options
  wanted = {k: getattr(options_lib.parse(name, cls, {k: v}), k) for k, v in pairs.items()}
  varied = set(plan.varied_fields(name))
  out = []
  for o in sets:
    if any(k in varied and getattr(o, k) != v for k, v in wanted.items()):
      continue
    o = dataclasses.replace(o, **{k: v for k, v in wanted.items() if k not in varied})
    if o not in out:
      out.append(o)
  return out


def _varied_values(name: str) -> str:
  """'pp varies schedule over gpipe, 1f1b, interleaved; virtual_stages over 1, 2'."""
  sets = plan.option_sets(name)
  vals = {k: list(dict.fromkeys(getattr(o, k) for o in sets)) for k in plan.varied_fields(name)}
  return (f"{name} varies " + "; ".join(f"{k} over {', '.join(map(str, v))}"
                                        for k, v in vals.items())) if vals else f"{name}: none"


def _mesh(n: int, names: list[str], spec: str, given: list[str]):
  """--mesh -> (the strategies whose axes it names, ((axis, size), ...) as given)."""
  if spec == "search":
    raise ConfigError("--mesh=search is a compare-mode study; with --plan give one mesh, or none "
                      "to enumerate them all")
  sizes = mesh_lib.parse_mesh_spec(spec)
  total = math.prod(sizes.values())
  if total != n:
    raise ConfigError(f"--mesh={spec} has {total} devices, not --devices={n}")
  if len(names) == 1:
    strat = strategies.get(names[0])
    mesh_lib.mesh_shape(strat.AXES, strat.MAIN_AXIS, spec, n, names[0])   # its one-line error
  fit = [s for s in names if set(sizes) <= set(strategies.get(s).AXES)]
  if not fit:
    others = " ".join(g for g in given if not g.startswith("--mesh="))
    raise ConfigError(f"--mesh={spec}: no planned strategy has the axes {', '.join(sizes)} "
                      f"({', '.join(names)}{' under ' + others if others else ''})")
  return fit, tuple(sizes.items())
