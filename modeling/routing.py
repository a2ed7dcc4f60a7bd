"""Routers, load-balancing losses, the aux-loss-free bias update and the capacity rule.

Formulas (T = tokens, E = experts, K = top-k; everything in float32):

softmax router (Mixtral, Qwen-MoE, DeepSeek-V2, gpt-oss)
  logits = x @ W_r (+ b_r, gpt-oss's router bias)   [T, E]
  p      = softmax(logits)
  idx    = top-k of p (ties -> lower expert id); with n_group > 1 inside the topk_group groups
           of the best max p (group_score "max": DeepSeek-V2's group_limited_greedy)
  w      = p[idx] / sum(p[idx])     if norm_topk_prob, else p[idx];  * routed_scaling_factor
           (renormalised, the softmax over the k selected logits: gpt-oss's router)

sigmoid router (DeepSeek-V3)
  s      = sigmoid(logits);  s_b = s + b            b = correction bias [E], not trained by gradient
  groups : experts split into n_group contiguous groups; group score = sum of its top-2 s_b
           (group_score "top2"; "max": its best s_b)
  keep the topk_group best groups, take the top-k experts of s_b inside them
  w      = s[idx] / sum(s[idx]) (if norm_topk_prob) * routed_scaling_factor    (unbiased s)
  p      = s / sum_e s        (normalised affinities, used by the aux loss)

load-balance aux loss, aux_loss_kind "batch" (over the GLOBAL batch: layout-independent)
  f_e = (assignments to e) / T_global, P_e = sum_t p[t, e] / T_global,  aux = E * sum_e f_e P_e
  (Switch / Mixtral; f sums to K)
sequence-wise balance loss, aux_loss_kind "sequence" (DeepSeek-V3, eqs. 17-20), per sequence s
of S tokens, then averaged over the step's sequences:
  f_se = E / (K * S) * (assignments of s's tokens to e),  P_se = sum_{t in s} p[t, e] / S
  aux = mean_s sum_e f_se P_se      (f sums to E per sequence; alpha = aux_loss_coef, 1e-4 in V3)
  Each sequence's statistics are complete within it: a strategy that splits the sequence (cp,
  ep_as_cp, ep_tp) sums its [b, E] partials over the sequence axes before the product; a
  microbatch needs nothing from the others (no pass-1 counts under gradient accumulation).
router z-loss: z = mean_t logsumexp(logits_t)^2
aux-loss-free bias update after each step: b_e += gamma * sign(mean_e(load) - load_e)

expert choice (cfg.expert_choice): what picks each token's K experts
  "router"    the top-k above, of the router's scores (training, and every float32 comparison)
  "position"  the same selection (top-k; the sigmoid router's group rule) run on
              position_scores(position) [E] in [0, 1): an integer hash of (position in the
              sequence, expert id), exact, so every strategy and the reference choose the same
              experts for a token whatever their rounding. The weights, p, logits, the losses and
              their gradients stay the router's. --full_parity in bfloat16 runs both sides this
              way (measure/agreement.py): one bf16 ulp between two correct programs flips the
              router's top-k near a tie, and a flipped token moves its whole contribution.
              Every sequence of a batch, and every layer, then takes the same choice per position.

capacity (capacity_factor cf > 0; 0 = dropless)
  Per sequence and per expert there are C = ceil(cf * S * K / E) slots. The assignments of a
  sequence are ranked in (position, k-slot) order; an assignment is kept iff fewer than C earlier
  assignments of the same sequence went to the same expert. The rule only depends on the global
  sequence, never on how tokens are laid out over devices.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import einops
import jax
import jax.numpy as jnp

from modeling.config import Config


class Routing(NamedTuple):
  experts: jax.Array   # [T, K] int32 chosen expert ids
  weights: jax.Array   # [T, K] f32 combine weights (0 for dropped assignments once masked)
  probs: jax.Array     # [T, E] f32 router probabilities used by the aux loss
  logits: jax.Array    # [T, E] f32


def _topk_ids(scores: jax.Array, k: int) -> jax.Array:
  return jax.lax.top_k(scores, k)[1]


def position_scores(positions: jax.Array, n_experts: int) -> jax.Array:
  """positions [...] (int, the token's position in its sequence) -> [..., E] float32 in [0, 1):
  lowbias32 (a 32-bit integer hash) of position * E + e, its top 24 bits / 2^24: exact in
  float32, the same bits on any device. The scores expert_choice="position" selects by."""
  key = positions.astype(jnp.uint32)[..., None] * jnp.uint32(n_experts) + jnp.arange(
      n_experts, dtype=jnp.uint32)                                      # [..., E]
  for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
    key = (key ^ (key >> shift)) * jnp.uint32(mul)                      # wraps mod 2^32
  key = key ^ (key >> 16)
  return (key >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def route(x: jax.Array, router_w: jax.Array, bias: jax.Array, cfg: Config,
          choice: jax.Array | None = None, router_b: jax.Array | None = None) -> Routing:
  """x [T, D], router_w [D, E], bias [E] -> Routing. Call on local (unsharded) tokens.
  choice [T, E]: scores that select the experts in place of the router's (position_scores);
  the weights, probs and logits are the router's either way. router_b [E]: a trained bias on
  the logits (gpt-oss), or None."""
  logits = jnp.einsum("td,de->te", x.astype(jnp.float32), router_w.astype(jnp.float32))  # [T, E]
  if router_b is not None:
    logits = logits + router_b.astype(jnp.float32)
  if cfg.router == "softmax":
    s = probs = jax.nn.softmax(logits, axis=-1)                          # [T, E]
    sel = probs
  else:
    s = jax.nn.sigmoid(logits)                                            # [T, E]
    sel = s + jax.lax.stop_gradient(bias)[None, :]                        # biased: selects only
    probs = s / jnp.sum(s, axis=-1, keepdims=True)
  sel = sel if choice is None else choice
  if cfg.n_group > 1:                   # group-limited: the top-k inside the topk_group best groups
    sel = jnp.where(_group_mask(sel, cfg), sel, -jnp.inf)
  idx = _topk_ids(sel, cfg.top_k)                                         # [T, K]
  w = jnp.take_along_axis(s, idx, axis=-1)                                # unbiased scores
  if cfg.norm_topk_prob:
    w = w / jnp.sum(w, axis=-1, keepdims=True)
  return Routing(idx.astype(jnp.int32), w * cfg.routed_scaling_factor, probs, logits)


def _group_mask(sel: jax.Array, cfg: Config) -> jax.Array:
  """[T, E] bool: the experts of each token's topk_group best groups (n_group contiguous groups;
  a group's score the sum of its two best `sel` (group_score "top2") or its best ("max"))."""
  e, g = sel.shape[-1], cfg.n_group
  grouped = einops.rearrange(sel, "t (g n) -> t g n", g=g)               # [T, G, E/G]
  if cfg.group_score == "max":
    group_score = jnp.max(grouped, axis=-1)                               # [T, G]
  else:
    group_score = jnp.sum(jax.lax.top_k(grouped, min(2, e // g))[0], axis=-1)
  keep_groups = _topk_ids(group_score, cfg.topk_group)                   # [T, topk_group]
  gmask = jnp.sum(jax.nn.one_hot(keep_groups, g, dtype=jnp.bool_), axis=1) > 0   # [T, G]
  return einops.repeat(gmask, "t g -> t (g n)", n=e // g)                # expert = g*E/G + n


def expert_slots(cfg: Config, seq_len: int) -> int:
  """Slots per expert per sequence (0 = dropless)."""
  if cfg.capacity_factor <= 0:
    return 0
  return max(1, math.ceil(cfg.capacity_factor * seq_len * cfg.top_k / cfg.n_experts))


def capacity_keep(experts: jax.Array, positions: jax.Array, cap: int, n_experts: int,
                  experts_all: jax.Array | None = None,
                  positions_all: jax.Array | None = None) -> jax.Array:
  """Keep mask [B, S, K] of the capacity rule above.

  experts [B, S, K] / positions [B, S] are this device's tokens; experts_all / positions_all are
  the whole sequences these tokens belong to (default: the same arrays, i.e. sequence not
  sharded). Positions of a whole sequence are a permutation of 0..S_all-1.
  """
  if experts_all is None:
    experts_all, positions_all = experts, positions
  b, s_all, k = experts_all.shape
  order = jnp.argsort(positions_all, axis=1)                                  # [B, S_all]
  e_sorted = jnp.take_along_axis(experts_all, order[..., None], axis=1)      # [B, S_all, K] by position
  oh = jax.nn.one_hot(e_sorted.reshape(b, s_all * k), n_experts, dtype=jnp.int32)  # [B, S_all*K, E]
  rank = jnp.cumsum(oh, axis=1) - oh                                          # earlier same-expert count
  rank = jnp.sum(rank * oh, axis=-1).reshape(b, s_all, k)                     # [B, S_all(pos), K]
  keep_by_pos = rank < cap
  return jnp.take_along_axis(keep_by_pos, positions[..., None], axis=1)       # [B, S, K]


def router_stats(r: Routing, keep: jax.Array, n_experts: int) -> dict:
  """Per-device sums; a strategy psums them over its token axes to get global sums."""
  counts = jnp.sum(jax.nn.one_hot(r.experts, n_experts, dtype=jnp.float32), axis=(0, 1))  # [E]
  return {
      "counts": counts,                                         # assignments per expert (pre-drop)
      "prob_sum": jnp.sum(r.probs, axis=0),                     # [E]
      "z_sum": jnp.sum(jax.nn.logsumexp(r.logits, axis=-1) ** 2),
      "dropped": jnp.sum(1.0 - keep.astype(jnp.float32)),
  }


def sequence_aux_sum(r: Routing, n_seq: int, cfg: Config, seq_axes=()) -> jax.Array:
  """sum over this device's n_seq sequences of sum_e f_se P_se (the sequence-wise loss above).
  r routes this device's [n_seq, s] tokens, s = S / |seq_axes| of each sequence: the [b, E]
  partials are summed over seq_axes (inside a shard_map) first. Every rank of seq_axes then holds
  the same sum, so each counts 1/|seq_axes| of it: summed over all token axes with the other
  statistics, each sequence counts once."""
  e, k, s = cfg.n_experts, cfg.top_k, cfg.seq_len
  counts = jnp.sum(jax.nn.one_hot(r.experts, e, dtype=jnp.float32), axis=1)   # [T, E]
  counts = jnp.sum(counts.reshape(n_seq, -1, e), axis=1)                      # [b, E]
  probs = jnp.sum(r.probs.reshape(n_seq, -1, e), axis=1)                      # [b, E]
  n = 1
  if seq_axes:
    counts, probs = jax.lax.psum((counts, probs), tuple(seq_axes))
    n = jax.lax.axis_size(tuple(seq_axes))
  f = e / (k * s) * jax.lax.stop_gradient(counts)
  out = jnp.sum(f * probs / s) / n
  # varying again over seq_axes, as the other statistics, for their psum over all token axes
  return jax.lax.pcast(out, tuple(seq_axes), to="varying") if seq_axes else out


def aux_losses(stats: dict, n_tokens: int, cfg: Config) -> tuple[jax.Array, jax.Array]:
  """stats hold GLOBAL sums, [..., E] per layer -> (load-balance aux loss, z-loss) per layer:
  batch-wise from counts / prob_sum, or sequence-wise from seq_aux_sum (present when
  cfg.aux_loss_kind == "sequence") over the n_tokens / seq_len sequences."""
  if "seq_aux_sum" in stats:
    aux = stats["seq_aux_sum"] * (cfg.seq_len / n_tokens)
  else:
    f = jax.lax.stop_gradient(stats["counts"]) / n_tokens
    aux = cfg.n_experts * jnp.sum(f * stats["prob_sum"] / n_tokens, axis=-1)
  return aux, stats["z_sum"] / n_tokens


def update_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free balancing, per layer: b_e += rate * sign(mean(load) - load_e). [.., E]."""
  return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
