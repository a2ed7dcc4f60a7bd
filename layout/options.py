"""A strategy's own options: a frozen dataclass in the strategy's file, set on the command line
as `--opt=key=value,key=value` and parsed against that dataclass here.

  @dataclasses.dataclass(frozen=True)
  class Options:
    exchange: str = options.choice("a2a", ("a2a", "ragged", "none"), "the token exchange")
    capacity: float = options.number(0.0, "buffer fraction", lo=0.0, hi=1.0)

A field's metadata says which values it takes (`choices`, or `lo`/`hi` for a number; bools take
true/false). Every error is one line, raised before anything compiles: an unknown key, a key of
another strategy, a bad value. A strategy with no knobs has `Options = NoOptions`.
"""
from __future__ import annotations

import dataclasses
import math

from modeling.config import ConfigError


@dataclasses.dataclass(frozen=True)
class NoOptions:
  """The options of a strategy that has none."""


def choice(default: str, choices: tuple[str, ...], doc: str):
  """A string field taking one of `choices`."""
  return dataclasses.field(default=default, metadata={"choices": tuple(choices), "doc": doc})


def number(default: float, doc: str, lo: float | None = None, hi: float | None = None):
  """A float field in [lo, hi] (either bound optional)."""
  return dataclasses.field(default=default, metadata={"lo": lo, "hi": hi, "doc": doc})


def integer(default: int, doc: str, lo: int | None = None, hi: int | None = None):
  """An int field in [lo, hi] (either bound optional)."""
  return dataclasses.field(default=default, metadata={"lo": lo, "hi": hi, "doc": doc,
                                                      "integer": True})


def split(text: str | None) -> dict[str, str]:
  """'a=1,b=x' -> {'a': '1', 'b': 'x'} (order kept); one-line errors for malformed pairs."""
  out: dict[str, str] = {}
  for part in filter(None, (p.strip() for p in (text or "").split(","))):
    key, sep, value = part.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not key or not value:
      raise ConfigError(f"bad --opt entry {part!r}: expected key=value")
    if key in out:
      raise ConfigError(f"--opt key {key!r} given twice")
    out[key] = value
  return out


def _value(name: str, key: str, field: dataclasses.Field, text: str):
  meta = field.metadata
  if "choices" in meta:
    if text not in meta["choices"]:
      raise ConfigError(f"{name} option {key}={text!r}: choose from {', '.join(meta['choices'])}")
    return text
  if field.type in (bool, "bool"):
    if text.lower() not in ("true", "false", "1", "0"):
      raise ConfigError(f"{name} option {key}={text!r}: expected true or false")
    return text.lower() in ("true", "1")
  if meta.get("integer"):
    if not text.lstrip("-").isdigit():
      raise ConfigError(f"{name} option {key}={text!r}: expected an integer")
    v = int(text)
    lo, hi = meta.get("lo"), meta.get("hi")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
      raise ConfigError(f"{name} option {key}={text}: must be an integer in "
                        f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]")
    return v
  try:
    v = float(text)
  except ValueError:
    raise ConfigError(f"{name} option {key}={text!r}: expected a number") from None
  lo, hi = meta.get("lo"), meta.get("hi")
  if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
    rng = f"[{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}]"
    raise ConfigError(f"{name} option {key}={text}: must be a finite number in {rng}")
  return v


def keys(cls) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(cls))


def parse(name: str, cls, pairs: dict[str, str], others: dict[str, type] | None = None):
  """Options of strategy `name` (its dataclass `cls`) from {key: text}. others: the other
  strategies' Options classes, so a key that belongs elsewhere says where."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  kw = {}
  for key, text in pairs.items():
    if key not in fields:
      owners = [n for n, c in (others or {}).items() if key in keys(c)]
      where = f" (it is an option of {', '.join(owners)})" if owners else ""
      mine = ", ".join(fields) or "none"
      raise ConfigError(f"strategy {name!r} has no option {key!r}{where}; its options: {mine}")
    kw[key] = _value(name, key, fields[key], text)
  return cls(**kw)
