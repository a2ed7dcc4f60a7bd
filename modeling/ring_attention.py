"""Ring attention: context parallelism's second K/V exchange (Liu et al. 2023, "Ring Attention
with Blockwise Transformers"), beside model._gather_kv's all-gather.

The sequence is split over the ring axes (cp's `context`, ep_as_cp's `expert`): n = their size,
device r holds queries and keys of its own s = S/n tokens (any order: causal by true positions).
What travels is `kv`, whatever the keys and values are made from (GQA: K and V; MLA: the normed
latent c_KV and the rotated RoPE key, up-projected by each device that receives it, as the
all-gather path does once for the whole sequence):

  forward (n visits, n - 1 sends): device r folds the block of rank r - i into its online softmax
  (modeling/attention.py's _fold, in key chunks of `chunk`), then sends it to r + 1:
      visit 0     1       ...  n-1
      r      r-1          ...  r+1        (block owners; collective-permute r -> r+1 between)
  backward: the same ring again, the blocks travelling with their float32 gradient sums
  d(kv): at each visit the device adds its queries' share of d(kv) (FlashAttention-2's backward,
  _grads, through expand's vjp) and passes both on; after the n-th visit one more send takes
  each d(kv) home. dq stays where its queries are; expand's weight gradient is each device's
  partial sum over its own queries, handed back unreduced (the weight gather's backward sums it).

Positions do not travel: each device holds the keys' positions [B, S] (int32) of the whole
sequence, and each visit slices its block's owner's out of them. The model passes them whole
(modeling.model.layer_positions: all-gathered over the ring axes once per step, before the layer
scans); ring_attend gathers split ones itself.

Bytes per layer and device (kv = one block of `kv`):
  forward (n - 1) kv; backward (n - 1) kv + n d(kv) (float32)
against the all-gather's (n - 1) kv forward and (n - 1)/n reduce-scatter of d(kv) backward: the
ring sends n - 1 equal messages where the gather sends one n times larger, and each device holds
two blocks (the visiting one and its own) instead of the whole sequence: K/V memory O(S/n), and
on hardware each send overlaps the previous block's compute. The all-gather moves fewer, larger
messages (about 1/2 of the ring's backward bytes with float32 d(kv)) and runs every block's
scores in one pass.

Balanced (balanced=True, the model's call: cp's and ep_as_cp's batches come in the load-balanced
order of layout/context.py, rank r holding chunks r and 2n-1-r of 2n contiguous chunks): at
visit i > 0 the owner o = r - i (mod n) differs from r, and the causal mask empties half of the
(query chunk, key chunk) pairs. When o < r, key chunk o precedes both query chunks and key chunk
2n-1-o follows both: only the first half of the block is folded, for all local queries. When
o > r, query chunk r precedes both key chunks, 2n-1-r follows both: the whole block is folded
into the second half of the queries only. Either way a visit costs half of visit 0; the
backward takes the same halves (the unused half of d(kv) is zero). The choice is a lax.cond on
the device's own rank: inside the shard_map each device takes its branch, and no collective
decides it. The bytes do not change: the whole block still travels, since the next device may
need the other half.

Window, local chunk, sinks (attention.attend's): every fold masks by the true positions of its
block, so any order is exact; the sinks are folded once, at the end (attention._finish), and
their gradient -sum exp(sink - lse) D, each device's over its own queries, is summed like a
weight's. Balanced, what a visit folds is static per (rank, visit): positions are the load-
balanced order of 0..S-1, so _balanced_cases tabulates, for each half of the device's queries,
which halves of the visiting block hold a key it sees (none, first, second, both); a lax.switch
on that entry, indexed by the device's rank, folds only those, forward and backward. A window
shorter than S / 2n leaves most visits folding nothing (the ring still sends every block). Not
balanced, positions are not known statically: every block is folded whole, masked.

Memory: a jax.custom_vjp keeps only its inputs, the output and the log-sum-exp (O(s)); the
backward re-sends the blocks rather than keeping the n visitors. Every device runs the whole
ring in a full-manual shard_map (check_vma=False: the weights come typed reduced, their
gradients leave unreduced).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from modeling import attention as attention_lib
from parallel import sharding

F32 = jnp.float32


def ring_attend(q, kv, w, expand, q_pos, k_pos, scale, chunk, axes, q_r=None, balanced=False, *,
                window=0, local_chunk=0, sinks=None, manual=False):
  """Causal attention of q [B, S@axes, KV, G, Dq] (q_pos [B, S@axes]) to the whole sequence,
  whose blocks kv (a pytree of [B, S@axes, ..] arrays) travel around the ring `axes`; k_pos
  [B, S] their positions, whole or split over axes as q_pos (gathered here). expand(kv, w) ->
  (k [B, s, KV, Dq], v [B, s, KV, Dv], k_r [B, s, Dr] or None) makes a block's keys and values
  from what travels and the weights w (a pytree; () when kv already is (k, v)).
  q_r [B, S@axes, KV, G, Dr]: MLA's decoupled RoPE query. balanced=True promises the keys'
  positions are the queries' in the load-balanced order (layout/context.py: ring rank r holds
  chunks r and 2n-1-r of 2n contiguous chunks): each visit then computes only the half-blocks
  the mask leaves (the module docstring, "Balanced"). window, local_chunk, sinks [KV, G]: as
  attention.attend's (the sinks split over heads as q is; resharded so if not). manual=True:
  called inside a full-manual shard_map over `axes` (pp's stages): every array is already one
  device's block, k_pos the whole sequence's [b, S], and each device's weight gradient is its
  own partial sum (the caller's reduction sums it).
  -> o [B, S@axes, KV, G, Dv] in v's dtype."""
  mask = attention_lib.Mask(int(window), int(local_chunk))
  if manual:
    return _ring(scale, chunk, tuple(axes), expand, bool(balanced), mask, True, q, q_r, kv, w,
                 sinks, q_pos, k_pos)
  batch = (tuple(_spec(k_pos)) + (None,))[0]
  k_all = jax.reshard(k_pos, P(batch, None))          # [B, S] @ (batch, None): whole sequences
  if sinks is not None:
    heads = tuple(_spec(q))[2:4]                      # each device's sinks: its own heads'
    if tuple(_spec(sinks)) != heads:
      sinks = jax.reshard(sinks, P(*heads, reduced=sharding.full_spec(sinks).reduced))
  return _ring(scale, chunk, tuple(axes), expand, bool(balanced), mask, False, q, q_r, kv, w,
               sinks, q_pos, k_all)


def _spec(x) -> P:
  """x's partitions, without reduced / unreduced: the shard_map's view of its values."""
  return P(*sharding.full_spec(x).partitions)


def _plain(tree):
  """Each array resharded to its partitions alone (a type change, no data moves)."""
  return jax.tree.map(lambda x: jax.reshard(x, _spec(x)), tree)


def _specs(tree):
  return jax.tree.map(_spec, tree)


def _ring_size(q, axes, manual=False) -> int:
  if manual:
    return jax.lax.axis_size(axes)
  mesh = jax.typeof(q).sharding.mesh
  return sharding.axis_size(mesh, *axes)


def _send(tree, axes, n):
  """Every device's `tree` to the next device of the ring (r -> r + 1 mod n)."""
  return jax.lax.ppermute(tree, axes, [(j, (j + 1) % n) for j in range(n)])


def _owned(k_all, rank, i, n, s):
  """The positions [b, s] of the block a device holds at visit i: its owner's (rank - i mod n)
  slice of the whole sequence's k_all [b, S]."""
  return jax.lax.dynamic_slice_in_dim(k_all, ((rank - i) % n) * s, s, axis=1)


def _halves(tree):
  """Each [b, s, ..] array of tree -> (its first s/2 tokens, its last s/2) (None stays None)."""
  first = jax.tree.map(lambda x: x[:, :x.shape[1] // 2], tree)
  last = jax.tree.map(lambda x: x[:, x.shape[1] // 2:], tree)
  return first, last


def _join(first, last):
  """_halves' inverse: the two halves of each array of a tree, concatenated on the tokens."""
  return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), first, last)


NONE, FIRST, SECOND, WHOLE = range(4)       # which halves of a visiting block a query half sees


def _balanced_cases(n, s, mask):
  """The load-balanced order's visits under a window / local chunk: [n ranks, n visits, 2 query
  halves] int32 (numpy, static), NONE, FIRST, SECOND or WHOLE: the halves of the block visiting
  rank r at visit i (owner o = r - i mod n) that hold a key visible to some query of r's half a.
  Rank r's halves are chunks r and 2n-1-r of the 2n chunks of s/2 positions (Mask.pair_visible
  decides each (query chunk, key chunk) pair from their position ranges)."""
  h = s // 2
  chunks = lambda r: (r, 2 * n - 1 - r)
  span = lambda c: (c * h, c * h + h - 1)
  cases = np.zeros((n, n, 2), np.int32)
  for r in range(n):
    for i in range(n):
      for a, qc in enumerate(chunks(r)):
        for b, kc in enumerate(chunks((r - i) % n)):
          if mask.pair_visible(*span(qc), *span(kc)):
            cases[r, i, a] |= (FIRST, SECOND)[b]
  return cases


def _forward(scale, chunk, axes, expand, balanced, mask, manual, q, q_r, kv, w, sinks, q_pos,
             k_all):
  n = _ring_size(q, axes, manual)

  def body(q, q_r, kv, w, sinks, q_pos, k_all):   # per device: [b, s, ..] blocks; k_all [b, S]
    def fold(carry, q, q_r, q_pos, kv, k_pos):
      k, v, k_r = expand(kv, w)                                               # [b, t, KV, D.]
      return attention_lib._fold(carry, scale, min(chunk, k.shape[1]), q, k, v, q_pos, k_pos,
                                 q_r, k_r, mask)

    rank = jax.lax.axis_index(axes)
    v_type = jax.eval_shape(expand, kv, w)[1]                                 # [b, s, KV, Dv]
    carry = attention_lib._init(q, v_type.shape[-1])
    if balanced and mask != attention_lib.CAUSAL:
      cases = jnp.asarray(_balanced_cases(n, q.shape[1], mask))
      rows, carries = _halves((q, q_r, q_pos)), list(_halves(carry))
      for i in range(n):
        k_pos = _owned(k_all, rank, i, n, q.shape[1])                         # [b, s]
        first, second = _halves((kv, k_pos))
        for a in (0, 1):          # each query half folds the halves of the block it sees
          branches = [lambda c: c] + [lambda c, blk=blk, a=a: fold(c, *rows[a], *blk)
                                      for blk in (first, second, (kv, k_pos))]
          carries[a] = jax.lax.switch(cases[rank, i, a], branches, carries[a])   # NONE..WHOLE
        if i < n - 1:
          kv = _send(kv, axes, n)                     # collective-permute over axes
      carry = _join(*carries)
    else:
      for i in range(n):
        k_pos = _owned(k_all, rank, i, n, q.shape[1])                         # [b, s]
        if i == 0 or not balanced:                   # own block (or every block): all of it
          carry = fold(carry, q, q_r, q_pos, kv, k_pos)
        else:
          # the owner's first chunk precedes both of ours, its second follows both (owner <
          # rank): fold that first half-block; else (owner > rank) only our second chunk sees
          # the owner's: fold the whole block into those rows
          early = lambda carry: fold(carry, q, q_r, q_pos, *_halves((kv, k_pos))[0])
          def late(carry):
            (c0, c1), (q1, q_r1, q_pos1) = _halves(carry), _halves((q, q_r, q_pos))[1]
            return _join(c0, fold(c1, q1, q_r1, q_pos1, kv, k_pos))
          carry = jax.lax.cond((rank - i) % n < rank, early, late, carry)
        if i < n - 1:
          kv = _send(kv, axes, n)                     # collective-permute over axes
    # o [b, s, KV, G, Dv], lse [b, s, KV, G], the sinks folded in once
    return attention_lib._finish(carry, v_type.dtype, sinks)

  if manual:                                          # already one device's blocks
    return body(q, q_r, kv, w, sinks, q_pos, k_all)
  q_spec = _spec(q)
  args = _plain((q, q_r, kv, w, sinks, q_pos, k_all))
  o_spec, lse_spec = P(*q_spec), P(*tuple(q_spec)[:4])
  return jax.shard_map(body, in_specs=_specs(args), out_specs=(o_spec, lse_spec),
                       check_vma=False)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6))
def _ring(scale, chunk, axes, expand, balanced, mask, manual, q, q_r, kv, w, sinks, q_pos, k_all):
  return _forward(scale, chunk, axes, expand, balanced, mask, manual, q, q_r, kv, w, sinks,
                  q_pos, k_all)[0]


def _ring_fwd(scale, chunk, axes, expand, balanced, mask, manual, q, q_r, kv, w, sinks, q_pos,
              k_all):
  o, lse = _forward(scale, chunk, axes, expand, balanced, mask, manual, q, q_r, kv, w, sinks,
                    q_pos, k_all)
  return o, (q, q_r, kv, w, sinks, q_pos, k_all, o, lse)


def _query_axes(q) -> frozenset:
  """The axes splitting q's tokens (B and S): each device's weight gradient is a partial sum over
  them."""
  s = _spec(q)
  return frozenset(sharding.dim_axes(s, 0)) | frozenset(sharding.dim_axes(s, 1))


def _ring_bwd(scale, chunk, axes, expand, balanced, mask, manual, res, do):
  q, q_r, kv, w, sinks, q_pos, k_all, o, lse = res
  n = _ring_size(q, axes, manual)
  # w's leaves, then the sinks: partial sums over the query axes, like the weight gradients
  # (manual: each device's own, which the caller's reduction sums)
  params = jax.tree.leaves(w) + ([] if sinks is None else [sinks])
  partial = frozenset() if manual else _query_axes(q)
  reduced = [frozenset() if manual else frozenset(jax.typeof(x).sharding.spec.reduced)
             for x in params]
  for red in reduced:
    if not red <= partial:
      raise ValueError(f"ring_attend: a weight is reduced over {sorted(red - partial)}, which its "
                       "gradient is not a partial sum over")

  def body(q, q_r, kv, w, sinks, q_pos, k_all, o, lse, do):
    # the blocks are sent again rather than kept from the forward: the barrier stops XLA from
    # merging these sends with the forward's (CSE, where both land in one computation), which
    # would keep all n visitors alive from the forward to the backward
    kv = jax.lax.optimization_barrier(kv)
    d = attention_lib._row_dot(do, o)                                         # [b, s, KV, G]
    dq, dq_r = attention_lib._zeros_f32(q), attention_lib._zeros_f32(q_r)
    f32_zeros = lambda t: jax.tree.map(lambda x: jnp.zeros_like(x, dtype=F32), t)
    dkv, dw = f32_zeros(kv), f32_zeros(w)
    rank = jax.lax.axis_index(axes)

    def grads(rows, kv, k_pos):
      """One visit's gradients: rows = (q, q_r, q_pos, lse, d, do, dq, dq_r) of the queries
      that see the block kv -> (dq, dq_r) of those rows, d(kv) and d(w) float32."""
      q, q_r, q_pos, lse, d, do, dq, dq_r = rows
      (k, v, k_r), pull = jax.vjp(expand, kv, w)
      dq, dq_r, dk, dv, dk_r = attention_lib._grads(
          scale, min(chunk, k.shape[1]), q, k, v, q_pos, k_pos, q_r, k_r, lse, d, do, dq, dq_r,
          mask)
      cts = jax.tree.map(lambda g, x: g.astype(x.dtype), (dk, dv, dk_r), (k, v, k_r))
      dkv_i, dw_i = pull(cts)
      f32 = lambda t: jax.tree.map(lambda x: x.astype(F32), t)
      return (dq, dq_r), f32(dkv_i), f32(dw_i)

    add = lambda a, b: jax.tree.map(lambda x, y: x + y, a, b)
    if balanced and mask != attention_lib.CAUSAL:    # the forward's table, each query half
      cases = jnp.asarray(_balanced_cases(n, q.shape[1], mask))
      rows = [r + dqs for r, dqs in zip(_halves((q, q_r, q_pos, lse, d, do)),
                                        _halves((dq, dq_r)))]
      for i in range(n):
        k_pos = _owned(k_all, rank, i, n, q.shape[1])                         # [b, s]
        first, second = _halves((kv, k_pos))

        def half(blk, which):             # one half of the block; the other's d(kv) is zero
          def branch(rows):
            dqs, dkv_h, dw_i = grads(rows, *blk)
            zero = jax.tree.map(jnp.zeros_like, dkv_h)
            return dqs, _join(dkv_h, zero) if which == FIRST else _join(zero, dkv_h), dw_i
          return branch

        branches = [lambda rows: (rows[6:], f32_zeros(kv), f32_zeros(w)),       # NONE
                    half(first, FIRST), half(second, SECOND),
                    lambda rows: grads(rows, kv, k_pos)]                         # WHOLE
        for a in (0, 1):
          dqs, dkv_i, dw_i = jax.lax.switch(cases[rank, i, a], branches, rows[a])
          rows[a] = rows[a][:6] + tuple(dqs)
          dkv, dw = add(dkv, dkv_i), add(dw, dw_i)
        if i < n - 1:
          kv, dkv = _send((kv, dkv), axes, n)              # the block and its gradient sum
      dq, dq_r = _join(rows[0][6:], rows[1][6:])
    else:
      for i in range(n):
        k_pos = _owned(k_all, rank, i, n, q.shape[1])                         # [b, s]
        rows = (q, q_r, q_pos, lse, d, do, dq, dq_r)
        if i == 0 or not balanced:
          (dq, dq_r), dkv_i, dw_i = grads(rows, kv, k_pos)
        else:                                 # the forward's two cases (_forward), in reverse
          def early(rows):
            (kv0, k_pos0), _ = _halves((kv, k_pos))
            dqs, dkv0, dw_i = grads(rows, kv0, k_pos0)
            return dqs, _join(dkv0, jax.tree.map(jnp.zeros_like, dkv0)), dw_i
          def late(rows):
            rows0, rows1 = _halves(rows[:6]), _halves(rows[6:])
            dqs1, dkv_i, dw_i = grads(rows0[1] + rows1[1], kv, k_pos)
            return _join(rows1[0], dqs1), dkv_i, dw_i
          (dq, dq_r), dkv_i, dw_i = jax.lax.cond((rank - i) % n < rank, early, late, rows)
        dkv, dw = add(dkv, dkv_i), add(dw, dw_i)
        if i < n - 1:
          kv, dkv = _send((kv, dkv), axes, n)                # the block and its gradient sum
    dkv = _send(dkv, axes, n)                                # each d(kv) home
    # the weight (and sink) gradients: partial over the query axes; summed here over those the
    # weight is not typed reduced over (its gather's backward sums the rest). The sinks':
    # -sum_{b,s} exp(sink - lse) d (lse with the sink), over this device's queries
    dp = jax.tree.leaves(dw) + ([] if sinks is None else [
        jnp.einsum("bskg,bskg->kg", -jnp.exp(sinks.astype(F32) - lse), d)])   # [KV, G]
    dp = [jax.lax.psum(g, tuple(sorted(partial - red))) if partial - red else g
          for g, red in zip(dp, reduced)]
    cast = lambda g, x: None if x is None else g.astype(x.dtype)
    return (cast(dq, q), cast(dq_r, q_r), jax.tree.map(cast, dkv, kv),
            [g.astype(x.dtype) for g, x in zip(dp, jax.tree.leaves(w) + [sinks])])

  if manual:                                          # already one device's blocks
    dq, dq_r, dkv, dp = body(q, q_r, kv, w, sinks, q_pos, k_all, o, lse, do)
  else:
    args = _plain((q, q_r, kv, w, sinks, q_pos, k_all, o, lse, do))
    p_specs = [P(*_spec(x), unreduced=red) for x, red in zip(params, reduced)]
    out_specs = (_spec(q), None if q_r is None else _spec(q_r), _specs(kv), p_specs)
    dq, dq_r, dkv, dp = jax.shard_map(body, in_specs=_specs(args), out_specs=out_specs,
                                      check_vma=False)(*args)
  n_w = len(jax.tree.leaves(w))
  dw = jax.tree.unflatten(jax.tree.structure(w), dp[:n_w])
  return dq, dq_r, dkv, dw, (dp[n_w] if sinks is not None else None), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
