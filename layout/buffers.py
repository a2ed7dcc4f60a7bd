"""Padded exchange buffers: the rows of a dispatch / combine / compaction buffer that no token
fills. jax >= 0.11 leaves `jnp.empty` uninitialised on GPU/TPU, and a buffer whose padding is
read into a result is a bug that zero-filled CPU buffers hide (MaxText once read such rows as
tokens). Every such buffer is made here; `poisoned()` fills its padding with NaN at trace time,
and tests/test_robustness.py shows parity still holds: no padding row reaches a result.

  with buffers.poisoned():   # trace + compile inside: every padded buffer starts as NaN
    job = train.build(...)
"""
from __future__ import annotations

import contextlib

import jax.numpy as jnp

_FILL = [0.0]


def padded(shape, dtype):
  """A buffer whose rows are written by a scatter; the rows left over are padding."""
  return jnp.full(shape, _FILL[0], dtype)


def pad_value(dtype):
  """The value of a padding row (0, or NaN when poisoned)."""
  return jnp.asarray(_FILL[0], dtype)


@contextlib.contextmanager
def poisoned():
  """Trace with NaN in every padding row (tests only)."""
  _FILL[0] = float("nan")
  try:
    yield
  finally:
    _FILL[0] = 0.0
