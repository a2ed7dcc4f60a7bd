"""Context parallelism (CP) pieces: the load-balanced sequence order, the K/V gather specs, and
the capacity rule's whole-sequence gather. Every helper takes the CP mesh axis as a parameter
(`cp_axis`), so a strategy that plays CP on another physical axis (ep_as_cp: `expert`) reuses
them unchanged.

Load balancing: the sequence is cut into 2cp chunks and CP rank i holds chunks i and 2cp-1-i,
so every rank has the same causal work (the model masks with the true positions):
  S=8, cp=2: chunks [01][23][45][67] -> rank0 [0 1 6 7], rank1 [2 3 4 5]
"""
from __future__ import annotations

import dataclasses
import einops
import jax
from jax.sharding import PartitionSpec as P
import numpy as np

from layout import mesh as mesh_lib, options
from modeling.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Options:
  """The options of a strategy that splits the sequence (cp; ep_as_cp on expert)."""
  kv_exchange: str = options.choice(
      "allgather", ("allgather", "ring"),
      "how each device's queries reach every key: all-gather K/V (MLA: the latent) over the CP "
      "axis, or pass the blocks around a ring of collective-permutes (modeling/ring_attention.py)")


def check_options(cfg, opts) -> None:
  """The ring folds each visiting block into the chunked online softmax."""
  if opts.kv_exchange == "ring" and cfg.attention_impl != "chunked":
    raise ConfigError(f"kv_exchange=ring folds each visiting K/V block into an online softmax: "
                      f"it takes --attention=chunked, not {cfg.attention_impl}")


def contract_variant(opts):
  """Which HLO contract block of the strategy's docstring this exchange compiles to."""
  return None if opts.kv_exchange == "allgather" else "kv_exchange=ring"


def check(cfg, mesh, cp_axis: str) -> None:
  """The load-balanced order cuts S into 2*cp chunks."""
  cp = mesh_lib.axis_size(mesh, cp_axis)
  if cfg.seq_len % (2 * cp):
    raise ConfigError(f"seq_len={cfg.seq_len} is not divisible by 2*{cp_axis}={2 * cp}")


def load_balance_order(seq_len: int, cp: int) -> np.ndarray:
  """The permutation of sequence indices in CP-rank order, e.g. S=8, cp=2 -> [0,1,6,7,2,3,4,5]."""
  if seq_len % (2 * cp):
    raise ValueError(f"seq_len={seq_len} not divisible by 2*context={2 * cp}")
  chunks = einops.rearrange(np.arange(seq_len), "(n c) -> n c", n=2 * cp)     # [2cp, S/2cp]
  # rank i: chunk i (first half, in order) and chunk 2cp-1-i (second half, reversed)
  pairs = np.stack([chunks[:cp], chunks[cp:][::-1]], axis=1)                # [cp, 2, S/2cp]
  return einops.rearrange(pairs, "rank two c -> (rank two c)")


def reorder_sequence(b: dict, order: np.ndarray) -> dict:
  """Apply a sequence permutation to tokens, targets and positions alike."""
  return {k: np.ascontiguousarray(v[:, order]) for k, v in b.items()}


def prepare_batch(b: dict, cfg, mesh, cp_axis: str) -> dict:
  """Reorder the global [B, S] batch so device i of cp_axis holds chunks i and 2cp-1-i
  (tokens, targets and positions alike; the model uses the true positions)."""
  return reorder_sequence(b, load_balance_order(cfg.seq_len, mesh_lib.axis_size(mesh, cp_axis)))


def kv_specs(batch_axes) -> tuple[P, P]:
  """(Parallelism.kv, Parallelism.kv_pos): K/V [B, T, KV, Dh] and kv_pos [B, T] whole along T, i.e. an
  all-gather over the CP axis (whichever axis splits S in Parallelism.x)."""
  return P(batch_axes, None, None, None), P(batch_axes, None)


def sequence_gatherer(cp_axis: str):
  """moe_local's gather_sequence inside a full-manual shard_map: the whole sequence's expert ids
  [b, S, K] and positions [b, S] (int32, all-gathered over cp_axis in device order)."""
  def gather(experts, positions):
    ag = lambda a: jax.lax.all_gather(a, cp_axis, axis=1, tiled=True)
    return ag(experts), ag(positions)
  return gather


def lb_positions(seq_len: int, cp: int) -> np.ndarray:
  """Positions held by each CP rank after load balancing, [cp, S/cp] (for docs and tests)."""
  return einops.rearrange(load_balance_order(seq_len, cp), "(rank s) -> rank s", rank=cp)
