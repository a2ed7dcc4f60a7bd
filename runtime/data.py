"""Deterministic synthetic data: sequences from a fixed random Markov chain.

Each token v has 4 successors (fixed from the seed) with probabilities 0.6/0.2/0.1/0.1, so the
best achievable next-token CE is ~1.09 nats and a model visibly learns. Batch `step` is a pure
function of (seed, step, batch, seq_len, vocab): every strategy and process count sees the same
global batch. Strategies that reorder the sequence (CP load balancing, layout/context.py) do it
on top of this.
"""
from __future__ import annotations

import numpy as np

_PROBS = np.array([0.6, 0.2, 0.1, 0.1])


def transition_table(vocab: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng([seed, 12345])
  return np.stack([rng.choice(vocab, size=4, replace=False) for _ in range(vocab)])  # [V, 4]


def batch(step: int, batch_size: int, seq_len: int, vocab: int, seed: int = 0) -> dict:
  """-> {tokens [B, S], targets [B, S], positions [B, S]} int32 numpy."""
  table = transition_table(vocab, seed)
  rng = np.random.default_rng([seed, step, 777])
  seq = np.empty((batch_size, seq_len + 1), np.int64)
  seq[:, 0] = rng.integers(0, vocab, size=batch_size)
  choice = rng.choice(4, size=(batch_size, seq_len), p=_PROBS)
  for t in range(seq_len):
    seq[:, t + 1] = table[seq[:, t], choice[:, t]]
  pos = np.broadcast_to(np.arange(seq_len), (batch_size, seq_len))
  return {"tokens": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32),
          "positions": pos.astype(np.int32).copy()}
