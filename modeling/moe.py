"""Token permutation, the expert FFN on sorted tokens (swiglu_experts, experts_ffn), and the
dense MoE oracle.

permute:   token copies (t, k) sorted by expert id, stably; dropped copies get the sentinel id E
           so they sort last, past sum(group_sizes), where gmm returns exact zeros.
             experts [[1,0],[0,1]] -> flat [1,0,0,1] -> order [1,2,0,3] -> rows x[0],x[1],x[0],x[1]
             group_sizes [2, 2]
unpermute: inverse permutation (a gather by inv = argsort(order)) and the weighted combine
           y_t = sum_k w_tk * ys[(t, k)].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from modeling import gmm as gmm_lib, routing
from modeling.config import Config


def permute(x: jax.Array, experts: jax.Array, keep: jax.Array, n_experts: int):
  """x [T, D], experts/keep [T, K] -> (xs [T*K, D] sorted by expert, group_sizes [E], order [T*K])."""
  t, k = experts.shape
  flat = jnp.where(keep, experts, n_experts).reshape(t * k)          # [T*K], dropped -> E
  order = jnp.argsort(flat, stable=True)                              # [T*K]
  xs = jnp.take(x, order // k, axis=0)                                # [T*K, D]
  group_sizes = jnp.sum(jax.nn.one_hot(flat, n_experts, dtype=jnp.int32), axis=0)  # [E], E dropped
  return xs, group_sizes, order


def unpermute(ys: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
  """ys [T*K, D] in sorted order, weights [T, K] (0 where dropped) -> y [T, D]."""
  t, k = weights.shape
  inv = jnp.argsort(order)                                            # [T*K]
  y = jnp.take(ys, inv, axis=0).reshape(t, k, -1)                     # [T, K, D]
  return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def glu(h0: jax.Array, h1: jax.Array, cfg: Config | None) -> jax.Array:
  """The experts' gated activation of gate h0 and up h1: silu(h0) * h1, or with
  cfg.swiglu_limit > 0 gpt-oss's clamped form (g = min(h0, limit), u = clip(h1, -limit, limit),
  (u + 1) * g * sigmoid(alpha * g))."""
  if cfg is None or not cfg.swiglu_limit:
    return jax.nn.silu(h0) * h1
  g = jnp.minimum(h0, cfg.swiglu_limit)
  u = jnp.clip(h1, -cfg.swiglu_limit, cfg.swiglu_limit)
  return (u + 1) * g * jax.nn.sigmoid(cfg.swiglu_alpha * g)


def add_row_bias(y: jax.Array, b: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """y [M, N] on sorted rows plus an expert bias b [e, N] per row (row r its group's row of b,
  nothing on the tail rows past sum(group_sizes): dropped copies stay exact zeros). The sum is
  float32, rounded once to y's dtype, so the bias's gradient is summed (and reduced across
  devices) in float32, as every float32-kept role's (modeling/model.py KEEP_F32)."""
  gid = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(y.shape[0]), side="right")  # [M]
  rows = jnp.take(b.astype(jnp.float32), gid, axis=0, mode="fill", fill_value=0)        # [M, N]
  return (y.astype(jnp.float32) + rows).astype(y.dtype)


def add_bias(y: jax.Array, b: jax.Array) -> jax.Array:
  """y [..., N] + b [N] (broadcast), in float32, rounded once to y's dtype (add_row_bias)."""
  return (y.astype(jnp.float32) + b.astype(jnp.float32)).astype(y.dtype)


def swiglu_experts(xs: jax.Array, group_sizes: jax.Array, p: dict, backend: str,
                   cfg: Config | None = None, **gmm_kwargs) -> jax.Array:
  """xs [M, D] sorted by group -> [M, D]; p holds wi_0/wi_1 [e, D, F], wo [e, F, D], and with
  gpt-oss's expert biases bi_0 / bi_1 [e, F], bo [e, D]. cfg: the activation (glu). gmm_kwargs
  (capacity, kernel, wgrad) go to every modeling.gmm.gmm call (the benchmarks)."""
  mm = lambda a, w: gmm_lib.gmm(a, w.astype(a.dtype), group_sizes, backend=backend, **gmm_kwargs)
  h0, h1 = mm(xs, p["wi_0"]), mm(xs, p["wi_1"])                       # [M, F]
  if "bi_0" in p:
    h0, h1 = add_row_bias(h0, p["bi_0"], group_sizes), add_row_bias(h1, p["bi_1"], group_sizes)
  ys = mm(glu(h0, h1, cfg).astype(xs.dtype), p["wo"])                 # [M, D]
  return add_row_bias(ys, p["bo"], group_sizes) if "bo" in p else ys


def experts_ffn(p: dict, rows: jax.Array, ids: jax.Array, n: int, backend: str,
                cfg: Config | None = None) -> jax.Array:
  """rows [..., D] with expert ids [...] in 0..n (n = padding) -> each row through its expert:
  stable sort by id (padding last), SwiGLU gmm on p's n experts (zero tail), unsort. The EP
  exchanges' expert step (strategies/ep.py), whatever buffer layout brought the rows."""
  shape, d = rows.shape, rows.shape[-1]
  rows, gid = rows.reshape(-1, d), ids.reshape(-1)                       # [M, D], [M]
  order = jnp.argsort(gid, stable=True)
  gs = jnp.sum(jax.nn.one_hot(gid, n, dtype=jnp.int32), axis=0)          # [n], padding excluded
  ys = swiglu_experts(rows[order], gs, p, backend, cfg)                  # [M, D]
  return jnp.zeros_like(rows).at[order].set(ys.astype(rows.dtype)).reshape(shape)


def route_tokens(p: dict, x: jax.Array, positions: jax.Array, cfg: Config,
                 experts_all=None, positions_all=None, seq_axes=()):
  """Route local tokens x [B, S, D] -> (Routing over T=B*S, keep [T, K], stats (local sums)).

  experts_all / positions_all: see routing.capacity_keep; pass a callable instead to gather the
  whole sequences lazily (only needed when capacity_factor > 0).
  seq_axes: the mesh axes splitting S (inside a shard_map), over which the sequence-wise loss's
  per-sequence statistics are summed (routing.sequence_aux_sum; aux_loss_kind "sequence").
  """
  b, s, d = x.shape
  choice = None
  if cfg.expert_choice == "position":                  # routing.py, "expert choice"
    choice = routing.position_scores(positions, cfg.n_experts).reshape(b * s, cfg.n_experts)
  r = routing.route(x.reshape(b * s, d), p["router"], p["bias"], cfg, choice, p.get("router_b"))
  if cfg.capacity_factor > 0:
    e_local = r.experts.reshape(b, s, cfg.top_k)                      # [B, S, K]
    e_all, pos_all = (experts_all(e_local, positions) if callable(experts_all)
                      else (experts_all, positions_all))
    s_all = s if e_all is None else e_all.shape[1]
    keep = routing.capacity_keep(e_local, positions, routing.expert_slots(cfg, s_all), cfg.n_experts,
                                 e_all, pos_all).reshape(b * s, cfg.top_k)
  else:
    keep = jnp.ones(r.experts.shape, jnp.bool_)
  r = r._replace(weights=jnp.where(keep, r.weights, 0.0))
  stats = routing.router_stats(r, keep, cfg.n_experts)
  if cfg.aux_loss_kind == "sequence":                  # replaces the batch-wise P
    del stats["prob_sum"]
    stats["seq_aux_sum"] = routing.sequence_aux_sum(r, b, cfg, seq_axes)
  return r, keep, stats


def scaled_input(x: jax.Array, r: routing.Routing, keep: jax.Array, cfg: Config):
  """Llama 4's routing (cfg.route_scale_input, top_k 1): the token x [b, s, D] scaled by its
  score before it reaches its expert, and the combine weights [T, 1] the kept mask (1, or 0 where
  dropped) -> (x, r). (x, r) as they are otherwise."""
  if not cfg.route_scale_input:
    return x, r
  b, s, _ = x.shape
  x = (x * r.weights.reshape(b, s, 1).astype(x.dtype)).astype(x.dtype)      # [b, s, D]
  return x, r._replace(weights=keep.astype(jnp.float32))                     # [T, 1]


def moe_local(p: dict, x: jax.Array, positions: jax.Array, cfg: Config, *,
              token_axes=(), gather_sequence=None, seq_axes=()):
  """The whole MoE on local tokens with ALL experts local (dp / fsdp / cp bodies, inside shard_map).

  x [b, s, D] local tokens; p = {router [D, E], bias [E], wi_0, wi_1 [E, D, F], wo [E, F, D]}.
  token_axes: mesh axes the tokens are sharded over; router stats are psum'd over them.
  gather_sequence: callable (experts_local, positions_local) -> whole-sequence versions, needed by
  the capacity rule when the sequence itself is sharded (cp).
  seq_axes: the token axes splitting the sequence (cp), for the sequence-wise loss.
  Returns (y [b, s, D], stats with global sums).
  """
  b, s, d = x.shape
  r, keep, stats = route_tokens(p, x, positions, cfg, experts_all=gather_sequence,
                                seq_axes=seq_axes)
  xin, r = scaled_input(x, r, keep, cfg)
  xs, gs, order = permute(xin.reshape(b * s, d), r.experts, keep, cfg.n_experts)  # [T*K, D]
  ys = swiglu_experts(xs, gs, p, cfg.gmm_backend, cfg)                           # [T*K, D]
  y = unpermute(ys, order, r.weights).reshape(b, s, d)
  if token_axes:
    stats = jax.tree.map(lambda v: jax.lax.psum(v, tuple(token_axes)), stats)
  return y.astype(x.dtype), stats


def moe_dense(p: dict, x: jax.Array, positions: jax.Array, cfg: Config):
  """Oracle: every expert on every token, combined with the routing weights. No sort, no gmm.

  x [B, S, D] -> (y [B, S, D], stats). Cost E x a dense FFN: tiny models only.
  """
  b, s, d = x.shape
  r, keep, stats = route_tokens(p, x, positions, cfg)
  xt, r = scaled_input(x, r, keep, cfg)
  xt = xt.reshape(b * s, d)
  w0, w1, wo = (p[n].astype(x.dtype) for n in ("wi_0", "wi_1", "wo"))  # the compute dtype
  h0 = jnp.einsum("td,edf->tef", xt, w0)                              # [T, E, F]
  h1 = jnp.einsum("td,edf->tef", xt, w1)
  if "bi_0" in p:                                                     # gpt-oss's expert biases
    h0, h1 = add_bias(h0, p["bi_0"]), add_bias(h1, p["bi_1"])          # [E, F] over T
  ye = jnp.einsum("tef,efd->ted", glu(h0, h1, cfg).astype(x.dtype), wo)   # [T, E, D]
  if "bo" in p:
    ye = add_bias(ye, p["bo"])
  combine = jnp.sum(jax.nn.one_hot(r.experts, cfg.n_experts) * r.weights[..., None], axis=1)  # [T, E]
  combine = combine.astype(x.dtype)
  y = jnp.einsum("ted,te->td", ye, combine)
  return y.reshape(b, s, d).astype(x.dtype), stats
