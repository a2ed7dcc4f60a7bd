"""Deterministic synthetic data: sequences from a fixed random Markov chain.

Each token v has 4 successors (fixed from the seed) with probabilities 0.6/0.2/0.1/0.1, so the
best achievable next-token CE is ~1.09 nats and a model visibly learns. Batch `step` is a pure
function of (seed, step, batch, seq_len, vocab): every strategy and process count sees the same
global batch. Strategies that reorder the sequence (CP load balancing, layout/context.py) do it
on top of this.

Real tokens (--data=PATH, Config.data; batch_for dispatches): a token file read through a
memory map, never whole. Its format is its name: NAME.npy (1-D, any integer dtype, from its
header), NAME.u32.bin (raw uint32), any other NAME.bin (raw uint16, as nanoGPT's data preparation
writes train.bin). Window w is tokens[w*S : w*S + S + 1] (consecutive windows share one token,
so every next-token pair is trained once per epoch); W = (N - 1) // S windows, the tail left
over. Global sequence g = step * B + b is window perm_e(g mod W) of epoch e = g // W, perm_e a
bijection of [0, W) keyed by (seed, e): batch `step` is a pure function of (file, seed, step,
batch, seq_len), and an epoch visits every window once, in its own order.
"""
from __future__ import annotations

import functools
import os

import numpy as np

from modeling.config import ConfigError

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


# --- real token files (--data=PATH) ---------------------------------------------------------

FORMATS = "NAME.bin (uint16 tokens, nanoGPT's), NAME.u32.bin (uint32) or NAME.npy (1-D integer)"
SCAN_CHUNK = 1 << 24          # tokens per chunk of the one-time min / max scan of a file


def batch_for(cfg, step: int) -> dict:
  """Batch `step` of the run cfg: its token file's (cfg.data; check_run holds the file to the
  model once, before the first batch) or, without one, the synthetic chain's."""
  if not cfg.data:
    return batch(step, cfg.batch, cfg.seq_len, cfg.vocab, cfg.seed)
  return file_batch(cfg.data, step, cfg.batch, cfg.seq_len, cfg.seed)


def check_run(cfg) -> None:
  """The run's token file, if any (cfg.data), held to the model (check: its format, length and
  token range; one-line ConfigError): run.py asks before anything starts, runtime/train.py's
  build before its first batch. Nothing for the synthetic chain."""
  if cfg.data:
    check(cfg.data, cfg.seq_len, cfg.vocab)


def _key(path: str) -> tuple:
  """The memory map's cache key: the file as it is now (a rewritten file is opened afresh)."""
  try:
    st = os.stat(path)
  except OSError as e:
    raise ConfigError(f"--data={path}: {e.strerror or 'cannot be read'}") from None
  if not os.path.isfile(path):
    raise ConfigError(f"--data={path} is not a file")
  return os.path.abspath(path), st.st_mtime_ns, st.st_size


def tokens(path: str) -> np.ndarray:
  """The file's tokens, a read-only memory map (cached per file): ConfigError for a missing or
  empty file, an unknown format, a .npy that is not 1-D integer."""
  return _open(path, *_key(path))


@functools.lru_cache(maxsize=8)
def _open(path: str, abspath: str, mtime_ns: int, size: int) -> np.ndarray:
  if path.endswith(".npy"):
    try:
      a = np.load(abspath, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
      raise ConfigError(f"--data={path}: not a readable .npy file "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
      raise ConfigError(f"--data={path}: a .npy token file must be 1-D integer, this one is "
                        f"{a.ndim}-D {a.dtype}")
  elif path.endswith(".bin"):
    dtype = np.dtype(np.uint32 if path.endswith(".u32.bin") else np.uint16)
    if size % dtype.itemsize:
      raise ConfigError(f"--data={path}: {size} bytes is not a whole number of {dtype} tokens")
    a = np.memmap(abspath, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
  else:
    raise ConfigError(f"--data={path}: unknown token file format: expected {FORMATS}")
  if len(a) == 0:
    raise ConfigError(f"--data={path} holds no token")
  return a


def token_range(path: str) -> tuple[int, int]:
  """(smallest, largest) token of the file: one chunked scan per file, cached."""
  return _range(path, *_key(path))


@functools.lru_cache(maxsize=8)
def _range(path: str, abspath: str, mtime_ns: int, size: int) -> tuple[int, int]:
  a = _open(path, abspath, mtime_ns, size)
  lo, hi = None, None
  for i in range(0, len(a), SCAN_CHUNK):
    c = np.asarray(a[i:i + SCAN_CHUNK])
    lo = int(c.min()) if lo is None else min(lo, int(c.min()))
    hi = int(c.max()) if hi is None else max(hi, int(c.max()))
  return lo, hi


def check(path: str, seq_len: int, vocab: int) -> None:
  """ConfigError (one line) unless the file is a token file of at least seq_len + 1 tokens,
  each in [0, vocab)."""
  n = len(tokens(path))
  if n < seq_len + 1:
    raise ConfigError(f"--data={path} holds {n} tokens, fewer than seq_len + 1 = {seq_len + 1} "
                      "(one sequence and its targets)")
  lo, hi = token_range(path)
  if lo < 0:
    raise ConfigError(f"--data={path} holds token id {lo} < 0")
  if hi >= vocab:
    raise ConfigError(f"--data={path} holds token id {hi} >= the model's vocab {vocab}")


def windows(path: str, seq_len: int) -> int:
  """W: the file's windows of seq_len + 1 tokens, window w starting at token w * seq_len."""
  return (len(tokens(path)) - 1) // seq_len


def file_batch(path: str, step: int, batch_size: int, seq_len: int, seed: int = 0) -> dict:
  """Batch `step` of the token file -> {tokens, targets, positions} [B, S] int32 numpy, as
  batch() returns: the windows of global sequences step * B .. step * B + B - 1 (module
  docstring)."""
  a, n_win = tokens(path), windows(path, seq_len)
  g = step * batch_size + np.arange(batch_size, dtype=np.int64)
  epoch, j = np.divmod(g, n_win)
  w = np.empty(batch_size, np.int64)
  for e in np.unique(epoch):
    w[epoch == e] = permute(j[epoch == e], n_win, seed, int(e))
  seq = np.stack([np.asarray(a[s * seq_len:s * seq_len + seq_len + 1]) for s in w.tolist()])
  seq = seq.astype(np.int64)
  pos = np.broadcast_to(np.arange(seq_len), (batch_size, seq_len))
  return {"tokens": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32),
          "positions": pos.astype(np.int32).copy()}


def _mix(z: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer, on uint64 arrays (wrapping)."""
  z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


def permute(i: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
  """perm(i) for a bijection perm of [0, n) keyed by (seed, epoch): a 4-round Feistel network
  on 2h bits (the fewest with 4^h >= n), cycle-walked back into [0, n). O(len(i)) time and
  memory whatever n: no permutation of the whole file is held."""
  keys = np.random.SeedSequence([seed, epoch, 2718]).generate_state(4, np.uint64)
  h = max(1, ((n - 1).bit_length() + 1) // 2)
  shift, mask = np.uint64(h), np.uint64((1 << h) - 1)

  def rounds(x):
    left, right = x >> shift, x & mask
    for k in keys:
      left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << shift) | right

  x = rounds(np.atleast_1d(np.asarray(i, np.int64)).astype(np.uint64))
  while (out := x >= np.uint64(n)).any():
    x[out] = rounds(x[out])
  return x.astype(np.int64)
