"""Exact causal attention with memory linear in the sequence length (plain jax.numpy + lax).

Shapes (the legend of modeling/__init__.py): B batch, S queries, T keys, KV key/value heads,
G query heads per KV head, Dq query/key head dim, Dv value head dim (may differ from Dq: MLA's
192 vs 128, never padded), Dr the decoupled RoPE dim (MLA), C the key chunk, n = ceil(T / C).

  q [B, S, KV, G, Dq], k [B, T, KV, Dq], v [B, T, KV, Dv], q_pos [B, S], k_pos [B, T] int32,
  optional q_r [B, S, KV, G, Dr] and k_r [B, T, Dr] (ONE RoPE key shared by all heads):

    s[b,s,k,g,t] = scale * (q[b,s,k,g] . k[b,t,k] + q_r[b,s,k,g] . k_r[b,t])   float32
    s            = -1e30 where key t is not visible to query s, by TRUE positions (any order):
                   visible = k_pos <= q_pos                                      (causal)
                             and q_pos - k_pos < window          (window > 0: gpt-oss sliding)
                             and k_pos // L == q_pos // L   (local_chunk L > 0: Llama 4 chunked)
    o[b,s,k,g]   = sum_t exp(s_t) v[b,t,k] / (sum_t exp(s_t) + exp(sink[k,g]))  [B, S, KV, G, Dv]
  with optional sinks [KV, G] (gpt-oss: one learned logit per query head; without them the
  exp(sink) term is absent: softmax_t(s)).

impl="xla": the formula as written (the oracle): the [B, KV, G, S, T] scores and probabilities
  are materialised and autodiff keeps them for the backward: O(S T) memory. The sinks as
  transformers' gpt-oss applies them: a sink column concatenated to the scores, the softmax over
  T + 1, the column dropped.

impl="cudnn" / "dpa_xla": jax.nn.dot_product_attention, the window and local chunk in its
  boolean mask by true positions (its local_window_size counts indices, not positions); no
  sinks (a ValueError).

impl="chunked": an online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al.) over
  the key / value chunks k_c, v_c of C keys, a lax.scan with float32 carries per query row
    m   = running max of s                             [B, S, KV, G]
    l   = running sum of exp(s - m)                     [B, S, KV, G]
    acc = running sum of exp(s - m) v                   [B, S, KV, G, Dv]
  updated per chunk from its scores s_c [B, S, KV, G, C]:
    m' = max(m, max_c s_c);  a = exp(m - m');  p = exp(s_c - m')
    l' = a l + sum_c p;      acc' = a acc + p . v_c
  and at the end the sink is folded in as one more key of score sink and value 0:
    m' = max(m, sink);  l' = l exp(m - m') + exp(sink - m');  acc' = acc exp(m - m')
  then o = acc / l, lse = m + log(l) (the sink's term included).
  The backward (FlashAttention-2) is a second scan over the same chunks that recomputes s_c:
    D    = sum_v do * o                                  [B, S, KV, G], once
    p    = exp(s_c - lse);  dp = do . v_c;  ds = p (dp - D) visible (0 on masked keys)
    dv_c = p^T . do;  dk_c = scale ds^T . q;  dk_r_c = scale sum_{KV,G} ds^T . q_r   (scan outputs)
    dq  += scale ds . k_c;  dq_r += scale ds . k_r_c                                 (scan carries)
  The sink is a key whose value is 0: p_sink = exp(sink - lse), its ds = p_sink (0 - D), so
    dsink[k,g] = -sum_{b,s} exp(sink[k,g] - lse[b,s,k,g]) D[b,s,k,g]                [KV, G], once
  Memory: a jax.custom_vjp keeps for the backward only its inputs q, k, v, q_r, k_r, q_pos,
  k_pos, the output o and lse [B, S, KV, G] float32, all O(S + T). A step of either scan holds
  O(B S KV G C) float32 (s_c, p, dp, ds), never O(S T); the scans' outputs (dk, dv, dk_r per
  chunk) are O(T).

Precision: the einsums take their operands in the input dtype and accumulate in float32
  (preferred_element_type): bf16 inputs give float32 scores and statistics; p and ds are cast to
  the input dtype only as operands of the p.v, p.do, ds.k, ds.q products (as the oracle casts
  its probabilities to v.dtype, and as FlashAttention does). Nothing is cast to float32 outside
  the chunk bodies.

Padding: T is padded to n C with k_pos = int32 max (masked for every query, like a causally
  masked key) and zero keys and values. A row with no visible key (never met in self-attention,
  where each query sees its own key) then averages v over its T + padding masked keys, where the
  oracle averages over T; with sinks both give 0 (exp(sink) outweighs exp(-1e30)).

Masks in arithmetic: s + (visible - 1) * 1e30 rather than jnp.where(visible, s, -1e30), which
  gives the same float32 values (|s| << 1e30), and ds * visible in the backward. The mask depends
  only on positions, the same in every layer; a jnp.where broadcasts its constant branch to the
  scores' shape, and differentiating the layer scan hoists such layer-invariant values out of it,
  each chunk's stacked: [n, B, S, KV, G, C], the whole [S, T] scores' size (measured: a 1-layer
  Mixtral-8x7B step's temp 12.5 GiB at S = 8192 against 1.3 GiB at 2048). q_pos is tied to q
  (an optimization barrier, _tied) so that the mask itself is per layer too.

Ordered (attend(..., ordered=True), the model's call wherever positions are the batch's own
  0..S-1): the queries are split into blocks of C too, and block i folds only key chunks
  lo[i]..i, the ones its mask does not empty (_spans, static): causal, lo[i] = 0, n (n + 1) / 2
  of the n^2 (block, chunk) pairs, about half the score, p.v and backward FLOPs at large n; with
  a window or local chunk, lo[i] is the chunk of the earliest key block i's first query sees,
  max(0, i C - window + 1, i C // L * L) // C, so a windowed block visits at most
  ceil(window / C) + 1 chunks, whatever S. A scan over the query blocks with a fori_loop of
  those visits; the backward scans the key chunks, each visiting blocks j..hi[j] (the last
  block whose lo <= j), dq summed per block in the scan's carry, [n, B, C, ..] float32. A step
  now holds O(B C KV G C), independent of S. The mask by true positions still applies inside every
  visited pair; what ordered promises is only that the skipped pairs are empty. It applies
  where S = T and S is not sharded: cp (positions load-balanced, S split over context) keeps
  the key-chunk scan above, every query against every chunk.

Sharding: nothing is placed or resharded here. Only the T dim (never sharded), and S when ordered
  (only where it is not sharded), is padded and reshaped into chunks; B, S, KV, G keep their
  (explicit) shardings through the named-dim einsums, and the sinks [KV, G] broadcast against
  them (split over heads as q is, or whole). The backward's dk, dv, dk_r, dsinks contract S, KV,
  G or B, which may be sharded (heads: tp; S: cp; dk_r sums over the heads, dsinks over B and
  S), where jnp.einsum wants an out_sharding: each is typed as JAX's own transpose rule types a
  cotangent, its primal's sharding with reduced <-> unreduced (_ct_sharding), so the results
  carry the shardings impl="xla"'s autodiff gives them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import einops
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

MASKED = -1e30                           # the oracle's score for a masked (causal) key
PAD_POS = int(np.iinfo(np.int32).max)    # k_pos of a padding key: after every query
F32 = jnp.float32


class Mask(NamedTuple):
  """The static part of the mask beyond causal (0 = off): a sliding window (gpt-oss: query p
  sees keys p - window + 1 .. p) and chunked local attention (Llama 4: keys of p's own
  local_chunk-aligned chunk, up to p)."""
  window: int = 0
  local_chunk: int = 0

  def first_key(self, p):
    """The earliest key position that query position p (an int or an int numpy array) sees:
    p - window + 1, the start of p's local chunk, the later of the two; causal only: -2^62."""
    first = np.full(np.shape(p), -2 ** 62, np.int64)
    if self.window:
      first = np.maximum(first, np.asarray(p) - self.window + 1)
    if self.local_chunk:
      first = np.maximum(first, np.asarray(p) // self.local_chunk * self.local_chunk)
    return first

  def pair_visible(self, q_lo, q_hi, k_lo, k_hi) -> bool:
    """Whether any key at positions k_lo..k_hi is visible to some query at q_lo..q_hi (ints):
    query p sees keys first_key(p)..p, both ends nondecreasing in p, so the queries together
    see the one range first_key(q_lo)..q_hi."""
    return bool(k_lo <= q_hi and k_hi >= self.first_key(q_lo))


CAUSAL = Mask()


def attend(q, k, v, q_pos, k_pos, scale, impl="chunked", chunk=512, q_r=None, k_r=None,
           ordered=False, *, window=0, local_chunk=0, sinks=None):
  """q [B, S, KV, G, Dq], k [B, T, KV, Dq], v [B, T, KV, Dv] -> o [B, S, KV, G, Dv] (dtype of v).
  Causal by TRUE positions: key t is visible to query s iff k_pos[b, t] <= q_pos[b, s]
  (q_pos [B, S], k_pos [B, T] int32; positions may be any permutation, e.g. a load-balanced
  context-parallel order, so never assume contiguity for correctness), and, where given:
    window > 0:      q_pos - k_pos < window                      (gpt-oss's sliding window)
    local_chunk > 0: k_pos // local_chunk == q_pos // local_chunk  (Llama 4's chunked attention)
  sinks [KV, G] (float32, one learned logit per query head, q's heads as KV x G): gpt-oss's
  attention sink, an extra term exp(sink) in each row's softmax denominator whose value is
  dropped (the module docstring, "Sinks").
  Optional decoupled RoPE part (MLA): q_r [B, S, KV, G, Dr] and k_r [B, T, Dr] (ONE key shared by
  all heads): scores = q.k + q_r.k_r. Dv may differ from Dq (MLA: 192 vs 128): never pad.
  scores are computed in float32 whatever the input dtype (bf16 inputs -> float32 statistics).
  ordered=True promises q_pos = k_pos, increasing along the sequence (the suite's batches, which
  only cp reorders, and cp shards S): impl="chunked" then also splits the queries into blocks
  of `chunk` and visits only the key chunks each block can see (the module docstring,
  "Ordered"), where S = T and S is not sharded. Any other call ignores it.
  impl "cudnn" / "dpa_xla" take the window and local chunk in their mask but no sinks."""
  if (q_r is None) != (k_r is None):
    raise ValueError("q_r and k_r come together (MLA's decoupled RoPE part) or not at all")
  mask = Mask(int(window), int(local_chunk))
  if mask.window < 0 or mask.local_chunk < 0:
    raise ValueError(f"window and local_chunk are >= 0 (0: none), got {mask}")
  if sinks is not None and tuple(sinks.shape) != tuple(q.shape[2:4]):
    raise ValueError(f"sinks are [KV, G] = {tuple(q.shape[2:4])} (q's heads), got "
                     f"{tuple(sinks.shape)}")
  if impl == "xla":
    return _xla(q, k, v, q_pos, k_pos, scale, q_r, k_r, mask, sinks)
  if impl == "chunked":
    c = max(1, min(int(chunk), k.shape[1]))          # no chunk longer than T
    if ordered and q.shape[1] == k.shape[1] and not _seq_sharded(q):
      return _ordered(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks)
    return _chunked(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks)
  if impl in ("cudnn", "dpa_xla"):
    if q_r is not None:
      raise ValueError("attention impl cudnn takes no decoupled RoPE part (GQA only)")
    if sinks is not None:
      raise ValueError(f"attention impl {impl} takes no attention sinks "
                       "(jax.nn.dot_product_attention has none): use xla or chunked")
    return _dpa(q, k, v, q_pos, k_pos, scale, mask, "cudnn" if impl == "cudnn" else "xla")
  raise ValueError(f"unknown attention impl {impl!r} (xla | chunked | cudnn)")


def _visible(q_pos, k_pos, mask):
  """Whether key k_pos is visible to query q_pos (broadcast int32 arrays -> bool): causal, and
  the window / local chunk of `mask`. q_pos - k_pos cannot overflow: positions are >= 0 and
  PAD_POS (int32 max) only ever meets them, never a negative one."""
  visible = k_pos <= q_pos
  if mask.window:
    visible = visible & (q_pos - k_pos < mask.window)
  if mask.local_chunk:
    visible = visible & (k_pos // mask.local_chunk == q_pos // mask.local_chunk)
  return visible


def _seq_sharded(x) -> bool:
  """Whether x [B, S, ...]'s S is split over a mesh axis (cp): query blocks would reshape it."""
  sharding = jax.typeof(x).sharding
  if sharding is None or sharding.mesh.empty:
    return False                               # unplaced, or local inside a full-manual shard_map
  spec = tuple(sharding.spec)
  return len(spec) > 1 and spec[1] is not None


def _dpa(q, k, v, q_pos, k_pos, scale, mask, implementation):
  """jax.nn.dot_product_attention (impl "cudnn": its cuDNN kernel on a GPU; "dpa_xla": the same
  call with implementation="xla", which tests this wrapper on CPU). Its GQA takes the query heads
  flattened KV-major, as q's (KV, G) are; the mask by true positions [B, 1, S, T] (bool), window
  and local chunk included (its own local_window_size counts indices, not positions)."""
  kv = q.shape[2]
  qf = einops.rearrange(q, "b s k g h -> b s (k g) h")                          # [B, S, H, Dq]
  visible = _visible(q_pos[:, :, None], k_pos[:, None, :], mask)[:, None]      # [B, 1, S, T]
  o = jax.nn.dot_product_attention(qf, k, v, scale=scale, mask=visible,
                                   implementation=implementation)              # [B, S, H, Dv]
  return einops.rearrange(o, "b s (k g) v -> b s k g v", k=kv)


def _xla(q, k, v, q_pos, k_pos, scale, q_r, k_r, mask, sinks):
  """The oracle: the whole [B, KV, G, S, T] softmax, autodiff through it; sinks as transformers'
  gpt-oss applies them: a column of sink logits concatenated to the scores, dropped after the
  softmax."""
  scores = jnp.einsum("bskgh,btkh->bkgst", q, k)                              # [B, KV, G, S, T]
  if q_r is not None:
    scores = scores + jnp.einsum("bskgr,btr->bkgst", q_r, k_r)                # [B, KV, G, S, T]
  scores = scores.astype(F32) * scale
  visible = _visible(q_pos[:, None, None, :, None], k_pos[:, None, None, None, :],
                     mask)                                                    # [B, 1, 1, S, T]
  scores = jnp.where(visible, scores, MASKED)
  if sinks is not None:       # zeros_like: the column takes the scores' sharding
    column = jnp.zeros_like(scores[..., :1]) + sinks.astype(F32)[:, :, None, None]  # [.., S, 1]
    scores = jnp.concatenate([scores, column], axis=-1)                       # [.., S, T + 1]
  probs = jax.nn.softmax(scores, axis=-1)[..., :k.shape[1]].astype(v.dtype)   # [B, KV, G, S, T]
  return jnp.einsum("bkgst,btkv->bskgv", probs, v)                            # [B, S, KV, G, Dv]


# ---------------------------------------------------------------------------------------------
# chunked: online softmax over key chunks, FlashAttention-2 backward


def _reshape(x, shape, entries):
  """jnp.reshape(x, shape), its sharding stated: `entries(x's spec entries)` -> the result's,
  x's reduced / unreduced axes kept. JAX infers a reshape's sharding itself, but where B and the
  chunk count are both 1 it may put B's axis on the wrong size-1 dim."""
  s = jax.typeof(x).sharding
  spec = None if s is None or s.mesh.empty else s.spec
  if spec is None or not (any(spec.partitions) or spec.reduced or spec.unreduced):
    return jnp.reshape(x, shape)
  parts = tuple(spec.partitions) + (None,) * (x.ndim - len(spec.partitions))
  return jnp.reshape(x, shape, out_sharding=P(*entries(parts), reduced=spec.reduced,
                                                unreduced=spec.unreduced))


def _to_chunks(x, c, fill=0):
  """x [B, T, ...] -> [n, B, C, ...]: T padded with `fill` to n C, chunks leading for lax.scan
  (only T, never sharded, is padded and split; B keeps its place and sharding)."""
  if x is None:
    return None
  pad = -x.shape[1] % c
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
  b, t = x.shape[:2]
  x = _reshape(x, (b, t // c, c) + x.shape[2:], lambda e: (e[0], None, None) + e[2:])
  return jnp.moveaxis(x, 1, 0)                                                # [n, B, C, ...]


def _from_chunks(x, t):
  """[n, B, C, ...] -> [B, T, ...]: the scan's per-chunk outputs, padding dropped."""
  x = jnp.moveaxis(x, 0, 1)                                                   # [B, n, C, ...]
  b, n, c = x.shape[:3]
  return _reshape(x, (b, n * c) + x.shape[3:], lambda e: (e[0], None) + e[3:])[:, :t]


def _chunk_xs(k, v, k_pos, k_r, c):
  """The scans' inputs: k_c [n, B, C, KV, Dq], v_c [n, B, C, KV, Dv], k_pos_c [n, B, C] (PAD_POS
  on the padding), k_r_c [n, B, C, Dr] or None."""
  return (_to_chunks(k, c), _to_chunks(v, c), _to_chunks(k_pos, c, PAD_POS), _to_chunks(k_r, c))


def _tied(q_pos, q):
  """q_pos, tied to q by an optimization barrier (a no-op on values): the causal mask computed
  from it is per layer, never hoisted out of the layer scan (the module docstring, "Masks")."""
  return jax.lax.optimization_barrier((q_pos, q))[0]


def _chunk_scores(scale, q, q_r, q_pos, k_c, k_r_c, k_pos_c, mask=CAUSAL):
  """Scores of all queries against one key chunk, float32, masked: ([B, S, KV, G, C] scores,
  [B, S, 1, 1, C] visible, 1.0 or 0.0). Masked keys score MASKED, as in the oracle."""
  s = jnp.einsum("bskgh,bckh->bskgc", q, k_c, preferred_element_type=F32)     # [B, S, KV, G, C]
  if q_r is not None:
    s = s + jnp.einsum("bskgr,bcr->bskgc", q_r, k_r_c, preferred_element_type=F32)
  visible = _visible(q_pos[:, :, None, None, None], k_pos_c[:, None, None, None, :],
                     mask).astype(F32)                                        # [B, S, 1, 1, C]
  return s * scale + (visible - 1.0) * -MASKED, visible


def _init(q, dv):
  """The online softmax's empty state for q's rows: m = -inf, l = 0, acc = 0 (float32), built
  from q so that it carries q's sharding: ([B, S, KV, G] x2, [B, S, KV, G, Dv])."""
  rows = jnp.zeros_like(q[..., 0], dtype=F32)                                 # [B, S, KV, G]
  return rows - jnp.inf, rows, rows[..., None] + jnp.zeros((dv,), F32)


def _fold_chunk(carry, scale, mask, q, q_r, q_pos, k_c, v_c, k_pos_c, k_r_c):
  """One key chunk folded into the online-softmax state (m, l, acc) of q's rows."""
  m, l, acc = carry                            # [B, S, KV, G] x2, [B, S, KV, G, Dv] float32
  s, _ = _chunk_scores(scale, q, q_r, q_pos, k_c, k_r_c, k_pos_c, mask)       # [B, S, KV, G, C]
  m_new = jnp.maximum(m, s.max(axis=-1))                                      # [B, S, KV, G]
  alpha = jnp.exp(m - m_new)                   # rescales what was summed under the old max
  p = jnp.exp(s - m_new[..., None])                                           # [B, S, KV, G, C]
  l = alpha * l + p.sum(axis=-1)                                              # [B, S, KV, G]
  pv = jnp.einsum("bskgc,bckv->bskgv", p.astype(v_c.dtype), v_c,
                  preferred_element_type=F32)                                 # [B, S, KV, G, Dv]
  return m_new, l, alpha[..., None] * acc + pv


def _fold(carry, scale, c, q, k, v, q_pos, k_pos, q_r, k_r, mask=CAUSAL):
  """Fold keys k [B, T, ..] (any T, chunks of c) into the online-softmax state `carry`. A chunk
  with no key visible to a row sums its masked keys at the finite MASKED, which the first
  visible key's rescale (exp(MASKED - m) = 0) then wipes: chunks may come in any order."""
  q_pos = _tied(q_pos, q)
  step = lambda carry, xs: (_fold_chunk(carry, scale, mask, q, q_r, q_pos, *xs), None)
  return jax.lax.scan(step, carry, _chunk_xs(k, v, k_pos, k_r, c))[0]


def _finish(carry, dtype, sinks=None):
  """The state -> (o [B, S, KV, G, Dv] in dtype, lse [B, S, KV, G] float32), the sinks [KV, G]
  (if any) folded in first as one more key each, of score sink and value 0."""
  m, l, acc = carry
  if sinks is not None:
    sink = sinks.astype(F32)                                  # [KV, G], broadcast over B, S
    m_new = jnp.maximum(m, sink)                                              # [B, S, KV, G]
    alpha = jnp.exp(m - m_new)
    m, l, acc = m_new, alpha * l + jnp.exp(sink - m_new), alpha[..., None] * acc
  return (acc / l[..., None]).astype(dtype), m + jnp.log(l)


def _forward(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks):
  """The online-softmax scan: (o [B, S, KV, G, Dv] v.dtype, lse [B, S, KV, G] float32)."""
  carry = _fold(_init(q, v.shape[-1]), scale, c, q, k, v, q_pos, k_pos, q_r, k_r, mask)
  return _finish(carry, v.dtype, sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks):
  return _forward(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks)[0]


def _chunked_fwd(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks):
  o, lse = _forward(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks)
  return o, (q, k, v, q_pos, k_pos, q_r, k_r, sinks, o, lse)   # inputs, o and lse: O(S + T)


def _ct_sharding(x):
  """The sharding JAX's own autodiff gives x's cotangent: x's, reduced <-> unreduced. The
  backward's dk, dv, dk_r, dsinks contract S, KV, G, which may be sharded: typed like this, the
  sum over those shards is left to the cotangent's consumer (or XLA), exactly as for impl="xla"."""
  sharding = jax.typeof(x).sharding
  if sharding is None or sharding.mesh.empty or not sharding.mesh.explicit_axes:
    return None                                # inside a full-manual shard_map: local arrays
  return sharding.update(spec=sharding.spec.to_ct_spec())


def _pair_grads(scale, mask, q, q_r, q_pos, lse, d, do, k_c, v_c, k_pos_c, k_r_c):
  """FlashAttention-2's backward of q's rows against one key chunk, p recomputed from lse:
  (dq_c, dq_r_c, dk_c, dv_c, dk_r_c) float32, the q-side [B, S, KV, G, ..], the chunk's
  [B, C, ..] (None where there is no RoPE part)."""
  s, visible = _chunk_scores(scale, q, q_r, q_pos, k_c, k_r_c, k_pos_c, mask)
  p = jnp.exp(s - lse[..., None])                                             # [B, S, KV, G, C]
  dv_c = jnp.einsum("bskgc,bskgv->bckv", p.astype(do.dtype), do, preferred_element_type=F32,
                    out_sharding=_ct_sharding(v_c))                           # [B, C, KV, Dv]
  dp = jnp.einsum("bskgv,bckv->bskgc", do, v_c, preferred_element_type=F32)    # [B, S, KV, G, C]
  # d loss / d (q.k): softmax's backward, zero on masked keys, times the score scale
  ds = (p * (dp - d[..., None]) * visible * scale).astype(q.dtype)
  dq_c = jnp.einsum("bskgc,bckh->bskgh", ds, k_c, preferred_element_type=F32)  # [B, S, KV, G, Dq]
  dk_c = jnp.einsum("bskgc,bskgh->bckh", ds, q, preferred_element_type=F32,
                    out_sharding=_ct_sharding(k_c))                           # [B, C, KV, Dq]
  if q_r is None:
    return dq_c, None, dk_c, dv_c, None
  dq_r_c = jnp.einsum("bskgc,bcr->bskgr", ds, k_r_c, preferred_element_type=F32)  # [B, S, KV, G, Dr]
  dk_r_c = jnp.einsum("bskgc,bskgr->bcr", ds, q_r, preferred_element_type=F32,
                      out_sharding=_ct_sharding(k_r_c))                       # [B, C, Dr]
  return dq_c, dq_r_c, dk_c, dv_c, dk_r_c


def _add(a, b):
  return None if a is None else a + b


def _grads(scale, c, q, k, v, q_pos, k_pos, q_r, k_r, lse, d, do, dq, dq_r, mask=CAUSAL):
  """FlashAttention-2's backward against keys k [B, T, ..]: one scan over their chunks that
  recomputes p from lse (d = sum_v do * o); dq (and dq_r) added to the given float32 sums in the
  carry, and dk, dv (and dk_r) [B, T, ..] float32, emitted per chunk."""
  q_pos = _tied(q_pos, q)

  def step(carry, xs):
    dq, dq_r = carry                           # [B, S, KV, G, Dq], [B, S, KV, G, Dr] float32
    dq_c, dq_r_c, dk_c, dv_c, dk_r_c = _pair_grads(scale, mask, q, q_r, q_pos, lse, d, do, *xs)
    return (dq + dq_c, _add(dq_r, dq_r_c)), (dk_c, dv_c, dk_r_c)

  (dq, dq_r), (dk, dv, dk_r) = jax.lax.scan(step, (dq, dq_r), _chunk_xs(k, v, k_pos, k_r, c))
  t = k.shape[1]
  return dq, dq_r, _from_chunks(dk, t), _from_chunks(dv, t), (
      None if k_r is None else _from_chunks(dk_r, t))


def _row_dot(do, o):
  """d = sum_v do * o [B, S, KV, G] float32: the softmax backward's row term."""
  return jnp.einsum("bskgv,bskgv->bskg", do, o, preferred_element_type=F32)


def _sink_grad(sinks, lse, d):
  """d loss / d sinks [KV, G] in sinks' dtype: -sum_{B, S} exp(sink - lse) d (lse [B, S, KV, G]
  with the sink, d = _row_dot), typed as JAX's autodiff types the cotangent; None: no sinks."""
  if sinks is None:
    return None
  p = jnp.exp(sinks.astype(F32) - lse)                 # [B, S, KV, G] the sink's probability
  return jnp.einsum("bskg,bskg->kg", -p, d,
                    out_sharding=_ct_sharding(sinks)).astype(sinks.dtype)     # [KV, G]


def _zeros_f32(x):
  return None if x is None else jnp.zeros_like(x, dtype=F32)


def _cast(x, like):
  """A float32 gradient sum in its primal's dtype (None for an absent input)."""
  return None if like is None else x.astype(like.dtype)


def _chunked_bwd(scale, c, mask, res, do):
  q, k, v, q_pos, k_pos, q_r, k_r, sinks, o, lse = res
  d = _row_dot(do, o)
  dq, dq_r, dk, dv, dk_r = _grads(scale, c, q, k, v, q_pos, k_pos, q_r, k_r, lse, d, do,
                                  _zeros_f32(q), _zeros_f32(q_r), mask)
  return (_cast(dq, q), _cast(dk, k), _cast(dv, v), None, None, _cast(dq_r, q_r),
          _cast(dk_r, k_r), _sink_grad(sinks, lse, d))


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ---------------------------------------------------------------------------------------------
# chunked, ordered: query blocks too, and only the key chunks a block can see


def _index(tree, i):
  """Entry i of each [n, ...] array in `tree` (None leaves stay None)."""
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _add_at(a, i, x):
  """a[i] += x for a [n, ...] (None stays None)."""
  if a is None:
    return None
  return jax.lax.dynamic_update_index_in_dim(
      a, jax.lax.dynamic_index_in_dim(a, i, keepdims=False) + x, i, 0)


def _spans(n, c, mask):
  """Which (query block, key chunk) pairs are not empty, positions 0..n c - 1 in blocks and
  chunks of c: (lo, hi) [n] int32 (numpy, static): block i sees chunks lo[i]..i, chunk j is seen
  by blocks j..hi[j]. lo[i] is the chunk of the earliest key block i's first query sees (every
  chunk from there to i holds a key that query, or a later one, sees)."""
  lo = np.maximum(mask.first_key(np.arange(n) * c), 0) // c                  # nondecreasing
  hi = np.searchsorted(lo, np.arange(n), side="right") - 1                     # >= j: lo[j] <= j
  return lo.astype(np.int32), hi.astype(np.int32)


def _ordered_forward(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks):
  """Query block i [B, C, KV, G, ..] folds key chunks lo[i]..i (_spans: a fori_loop inside a
  scan over the blocks): (o [B, S, KV, G, Dv] v.dtype, lse [B, S, KV, G] float32)."""
  s = q.shape[1]
  ks = _chunk_xs(k, v, k_pos, k_r, c)                           # [n, B, C, ..] each
  qs = (_to_chunks(q, c), _to_chunks(q_r, c), _to_chunks(_tied(q_pos, q), c, PAD_POS))
  n = qs[0].shape[0]

  def block(_, xs):
    i, lo_i, q_i, q_r_i, q_pos_i = xs                           # [B, C, KV, G, Dq], .., [B, C]
    visit = lambda j, carry: _fold_chunk(carry, scale, mask, q_i, q_r_i, q_pos_i,
                                         *_index(ks, j))
    carry = jax.lax.fori_loop(lo_i, i + 1, visit, _init(q_i, v.shape[-1]))
    return None, _finish(carry, v.dtype, sinks)

  lo, _ = _spans(n, c, mask)
  _, (o, lse) = jax.lax.scan(block, None, (jnp.arange(n), jnp.asarray(lo), *qs))
  return _from_chunks(o, s), _from_chunks(lse, s)


def _ordered_grads(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, lse, d, do):
  """The backward over the same pairs, key chunk j outermost (a scan) and query blocks j..hi[j]
  inside (a fori_loop after the diagonal pair): dk_j, dv_j (dk_r_j) summed in the loop's carry
  and emitted per chunk; dq (dq_r) [n, B, C, ..] float32 in the scan's carry, block i added to.
  Padding rows get lse = +inf (p = 0): their zero do would otherwise meet exp(s - 0)."""
  s = q.shape[1]
  ks = _chunk_xs(k, v, k_pos, k_r, c)
  qs = (_to_chunks(q, c), _to_chunks(q_r, c), _to_chunks(_tied(q_pos, q), c, PAD_POS),
        _to_chunks(lse, c, jnp.inf), _to_chunks(d, c), _to_chunks(do, c))
  n = qs[0].shape[0]

  def chunk(dqs, xs):
    j, hi_j, k_j, v_j, k_pos_j, k_r_j = xs
    pair = lambda i: _pair_grads(scale, mask, *_index(qs, i), k_j, v_j, k_pos_j, k_r_j)
    add = lambda dqs, i, dq_c, dq_r_c: (_add_at(dqs[0], i, dq_c), _add_at(dqs[1], i, dq_r_c))
    dq_c, dq_r_c, dk_j, dv_j, dk_r_j = pair(j)        # the diagonal pair starts the sums

    def visit(i, carry):
      dqs, dk_j, dv_j, dk_r_j = carry
      dq_c, dq_r_c, dk_c, dv_c, dk_r_c = pair(i)
      return add(dqs, i, dq_c, dq_r_c), dk_j + dk_c, dv_j + dv_c, _add(dk_r_j, dk_r_c)

    carry = (add(dqs, j, dq_c, dq_r_c), dk_j, dv_j, dk_r_j)
    dqs, dk_j, dv_j, dk_r_j = jax.lax.fori_loop(j + 1, hi_j + 1, visit, carry)
    return dqs, (dk_j, dv_j, dk_r_j)

  _, hi = _spans(n, c, mask)
  dqs = (_zeros_f32(qs[0]), _zeros_f32(qs[1]))
  (dq, dq_r), (dk, dv, dk_r) = jax.lax.scan(chunk, dqs,
                                            (jnp.arange(n), jnp.asarray(hi), *ks))
  t = k.shape[1]
  return (_from_chunks(dq, s), None if q_r is None else _from_chunks(dq_r, s),
          _from_chunks(dk, t), _from_chunks(dv, t), None if k_r is None else _from_chunks(dk_r, t))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ordered(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks):
  return _ordered_forward(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks)[0]


def _ordered_fwd(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks):
  o, lse = _ordered_forward(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, sinks)
  return o, (q, k, v, q_pos, k_pos, q_r, k_r, sinks, o, lse)   # inputs, o and lse: O(S)


def _ordered_bwd(scale, c, mask, res, do):
  q, k, v, q_pos, k_pos, q_r, k_r, sinks, o, lse = res
  d = _row_dot(do, o)
  dq, dq_r, dk, dv, dk_r = _ordered_grads(scale, c, mask, q, k, v, q_pos, k_pos, q_r, k_r, lse,
                                          d, do)
  return (_cast(dq, q), _cast(dk, k), _cast(dv, v), None, None, _cast(dq_r, q_r),
          _cast(dk_r, k_r), _sink_grad(sinks, lse, d))


_ordered.defvjp(_ordered_fwd, _ordered_bwd)
