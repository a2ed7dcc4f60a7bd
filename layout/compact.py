"""Compaction of routed token copies to one device's local experts (ep_tp's AG-RS MoE).

After the token (and routing) all-gather of the AG-RS ("ring of experts") MoE every expert
device sees all T tokens of its group, but only the copies routed to its e local experts
matter. MaxText #3600 sorts all T*K copies (worst case) and runs the permute/gmm on all of
them. Here a prefix sum (linear, elementwise) picks the routed copies into a buffer of M rows
first; only that buffer is sorted by local expert, gathered and multiplied:

  experts [[0,2],[3,1],[2,0]], this device owns experts {2,3} (first=2, n_local=2), M=4
  copy id (t*K+k)     0  1  2  3  4  5
  mine                0  1  1  0  1  0
  slot = cumsum-1     .  0  1  .  2  .       -> buffer copy ids [1, 2, 4, pad]
  local expert        .  0  1  .  0  .       -> sort by (local expert): [1, 4, 2, pad]
  group_sizes [2, 1]; token = copy // K = [0, 2, 1, -]

Buffer bound M (static): a token's K copies go to K distinct experts, so at most
min(K, n_local) of them land here -> worst case T*min(K, n_local) (dropless). With the capacity
rule (cf > 0) at most C_e = ceil(cf*S*K/E) copies per sequence reach one expert, so b sequences
keep at most b*n_local*C_e copies here: M is the smaller bound. A fraction
f in (0, 1] of it trades memory/work for drops: copies past slot M are dropped ("overflow",
earliest tokens win) and counted. Balanced routing needs about T*K/EP rows.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from layout import dispatch


def buffer_rows(tokens: int, top_k: int, n_local: int, fraction: float = 0.0, seqs: int = 0,
                slots: int = 0) -> int:
  """Static buffer size M: the bound layout.dispatch.rows_bound gives for the T tokens (their K
  copies to e local experts, under the capacity rule's slots when set), or ceil(fraction x
  that) if fraction > 0."""
  worst = dispatch.rows_bound(tokens, top_k, n_local, seqs=seqs, slots=slots)
  if fraction <= 0:
    return worst
  return max(1, min(worst, math.ceil(fraction * worst)))


class Compacted(NamedTuple):
  copy: jax.Array         # [M] int32 copy id t*K+k, sorted by local expert; pad rows: T*K
  valid: jax.Array        # [M] bool, False for pad rows (sorted last)
  group_sizes: jax.Array  # [e] int32 rows per local expert
  overflow: jax.Array     # [] f32 routed copies that did not fit in M (dropped)


def compact(experts: jax.Array, keep: jax.Array, first, n_local: int, rows: int) -> Compacted:
  """experts / keep [T, K] -> the copies routed to experts [first, first+n_local), M=rows."""
  t, k = experts.shape
  local = (experts - first).reshape(t * k)                              # [T*K]
  mine = keep.reshape(t * k) & (local >= 0) & (local < n_local)         # [T*K]
  slot = jnp.cumsum(mine.astype(jnp.int32)) - 1                         # [T*K] buffer slot
  fits = mine & (slot < rows)
  copy = jnp.full((rows,), t * k, jnp.int32).at[jnp.where(fits, slot, rows)].set(
      jnp.arange(t * k, dtype=jnp.int32), mode="drop")                  # [M] copy ids, pad T*K
  valid = copy < t * k
  key = jnp.where(valid, local[jnp.minimum(copy, t * k - 1)], n_local)  # [M], pad -> n_local
  order = jnp.argsort(key, stable=True)                                 # the only sort: M rows
  key, copy, valid = key[order], copy[order], valid[order]
  group_sizes = jnp.sum(jax.nn.one_hot(key, n_local, dtype=jnp.int32), axis=0)   # [e]
  overflow = (jnp.sum(mine) - jnp.sum(fits)).astype(jnp.float32)
  return Compacted(copy, valid, group_sizes, overflow)
