"""Decoder-only MoE transformer: init, forward, loss. Shared by the reference and every strategy.

  tokens [B, S] -> embed -> scan over L x block [RMSNorm -> causal GQA attention (RoPE) -> +res
                                              -> RMSNorm -> MoE FFN (+ shared expert) -> +res]
         -> RMSNorm -> unembed -> next-token cross-entropy (+ aux losses)

A strategy does not rewrite the model. It hands `forward` a `Layout`:
  x      out_sharding of the residual stream [B, S, D] (needed where a contraction dim is sharded,
         e.g. the row-parallel attention output under TP)
  kv     sharding K/V [B, T, KV, Dh] and kv_pos [B, T] are resharded to before attention (CP
         all-gathers them over the context axis here; dK/dV come back reduce-scattered)
  use    (role, w) -> w, applied to every non-routed weight right before its use (FSDP all-gather);
         role: its entry in ROLES (w is one layer's slice inside the layer scan)
  moe    (p_moe, x [B, S, D], positions [B, S]) -> (y, stats): the routed MoE, where the strategy
         places its shard_map and token exchange. stats are GLOBAL sums (see routing.router_stats).
  loss   optional (params, batch) -> (loss, metrics) replacing loss_fn for a strategy that runs
         the whole model its own way (pp: a pipeline schedule in one shard_map).
  gather_in / scatter_out / row_out: sequence parallelism (Megatron-SP, ep_tp).
         gather_in: normed h (residual layout x) -> what attention, moe and the shared expert
           read (ep_tp: the all-gather over the sequence axis);
         row_out: out_sharding of the row-parallel projections attn wo and shared wo (ep_tp:
           typed unreduced); moe's y must come in the same layout, as it is added to shared wo;
         scatter_out: attention out, and moe y + shared out -> the residual layout (ep_tp: the
           reduce-scatter).
         Defaults: identity, identity, row_out = x: the forward of every other strategy is the
         same program as without these hooks.
The reference passes Layout() with moe=the dense oracle and no shardings.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import einops
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from modeling import moe as moe_lib, routing
from modeling.config import Config
from parallel import sharding


def _identity_use(role: str, w):
  del role
  return w


def _identity(a):
  return a


@dataclasses.dataclass(frozen=True)
class Layout:
  x: Any = None
  kv: Any = None
  kv_pos: Any = None
  use: Callable = _identity_use
  moe: Callable | None = None
  gather_in: Callable = _identity
  scatter_out: Callable = _identity
  row_out: Any = None
  loss: Callable | None = None

  @property
  def row(self):
    """out_sharding of the row-parallel projections (attn wo, shared wo)."""
    return self.x if self.row_out is None else self.row_out


# ----------------------------------------------------------------------------- parameters
# Every parameter's role, declared once below next to its shape. Strategies lay parameters out by
# role (a role -> PartitionSpec table, `param_specs`); the optimizer, weight decay and the cost
# models read roles too. Per-layer roles are stacked: [L, ...], scanned by `forward`.
LAYER_ROLES = ("attn_norm", "attn_q", "attn_kv", "attn_o", "mlp_norm", "router", "bias",
               "expert_in", "expert_out", "shared_in", "shared_out")
ROLES = ("embed", "final_norm", "unembed") + LAYER_ROLES
NORMS = ("attn_norm", "mlp_norm", "final_norm")                     # [D] scales
EXPERTS = ("expert_in", "expert_out")                               # [E, D, F] / [E, F, D]
MOE_ROLES = {"router": "router", "bias": "bias", "wi_0": "expert_in", "wi_1": "expert_in",
             "wo": "expert_out"}                                     # a layer's "moe" leaves
D_DIM = {"embed": 1, "unembed": 0, "router": 0, "attn_q": 0, "attn_kv": 0, "attn_o": 2,
         "expert_in": 1, "expert_out": 2, "shared_in": 0, "shared_out": 1}   # the model dim D


@dataclasses.dataclass(frozen=True)
class ShapeLeaf:
  """A parameter's declaration: full shape ([L, ...] for a layer role) and role."""
  shape: tuple
  role: str


def _param_tree(cfg: Config, leaf) -> dict:
  """The param pytree of one layer's / the model's leaves: leaf(shape, fan_in, role) makes a
  normal(0, 1/fan_in) leaf, fan_in=0 -> ones, fan_in=-1 -> zeros."""
  d, h, kv, dh, e, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.n_experts, cfg.d_ff, cfg.vocab)

  def layer():
    out = {
        "attn_norm": leaf((d,), 0, "attn_norm"),
        "attn": {"wq": leaf((d, h, dh), d, "attn_q"), "wk": leaf((d, kv, dh), d, "attn_kv"),
                 "wv": leaf((d, kv, dh), d, "attn_kv"), "wo": leaf((h, dh, d), h * dh, "attn_o")},
        "mlp_norm": leaf((d,), 0, "mlp_norm"),
        "moe": {"router": leaf((d, e), d, "router"), "bias": leaf((e,), -1, "bias"),
                "wi_0": leaf((e, d, f), d, "expert_in"), "wi_1": leaf((e, d, f), d, "expert_in"),
                "wo": leaf((e, f, d), f, "expert_out")}}
    if cfg.n_shared_experts:
      fs = cfg.shared_d_ff
      out["shared"] = {"wi_0": leaf((d, fs), d, "shared_in"), "wi_1": leaf((d, fs), d, "shared_in"),
                       "wo": leaf((fs, d), fs, "shared_out")}
    return out

  layers = [layer() for _ in range(cfg.n_layers)]                   # drawn layer by layer, first
  return {"embed": leaf((v, d), 1, "embed"), "layers": layers,
          "final_norm": leaf((d,), 0, "final_norm"), "unembed": leaf((d, v), d, "unembed")}


def _stack(tree: dict, stack) -> dict:
  return {**tree, "layers": jax.tree.map(lambda *ls: stack(ls), *tree["layers"],
                                         is_leaf=lambda l: isinstance(l, ShapeLeaf))}


def init_params(cfg: Config, seed: int | None = None) -> dict:
  """Deterministic numpy float32 init: the same values whatever strategy asks."""
  rng = np.random.default_rng(cfg.seed if seed is None else seed)

  def leaf(shape, fan_in, role):
    del role
    if fan_in == 0:
      return np.ones(shape, np.float32)
    if fan_in == -1:
      return np.zeros(shape, np.float32)
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
  return _stack(_param_tree(cfg, leaf), np.stack)


def init_params_shapes(cfg: Config) -> dict:
  """The param pytree with ShapeLeaf(shape, role) leaves (for spec trees and cost models)."""
  return _stack(_param_tree(cfg, lambda shape, fan_in, role: ShapeLeaf(shape, role)),
                lambda ls: ShapeLeaf((len(ls),) + ls[0].shape, ls[0].role))


def layer_params(params: dict, i: int) -> dict:
  """Layer i's params: one slice of the stacked [L, ...] leaves."""
  return jax.tree.map(lambda a: a[i], params["layers"])


def param_leaves(cfg: Config) -> list:
  """The ShapeLeaf(shape, role) of every parameter, in pytree order."""
  return jax.tree.leaves(init_params_shapes(cfg), is_leaf=lambda l: isinstance(l, ShapeLeaf))


def param_roles(cfg: Config) -> dict:
  """The param pytree with role strings as leaves."""
  return jax.tree.map(lambda l: l.role, init_params_shapes(cfg),
                      is_leaf=lambda l: isinstance(l, ShapeLeaf))


def param_specs(cfg: Config, table: dict, layer_axis=None) -> dict:
  """A strategy's role -> PartitionSpec table (one layer's array; roles it omits are replicated)
  -> the spec pytree of the params; layer roles get the leading [L] dim, sharded over
  `layer_axis` (pipeline stages) or not at all."""
  def spec(leaf):
    p = table.get(leaf.role, P())
    return P(layer_axis, *p) if leaf.role in LAYER_ROLES else p
  return jax.tree.map(spec, init_params_shapes(cfg), is_leaf=lambda l: isinstance(l, ShapeLeaf))


def abstract_params(cfg: Config, specs, mesh) -> dict:
  """ShapeDtypeStructs with shardings, for compile-only studies of large configs."""
  shapes = init_params_shapes(cfg)
  is_leaf = lambda l: isinstance(l, ShapeLeaf)
  if mesh is None:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), shapes, is_leaf=is_leaf)
  return jax.tree.map(
      lambda s, p: jax.ShapeDtypeStruct(s.shape, jnp.float32,
                                        sharding=jax.sharding.NamedSharding(mesh, p)),
      shapes, specs, is_leaf=is_leaf)


# ----------------------------------------------------------------------------- precision
# Mixed precision (--dtype=bfloat16): params and optimizer state are float32 masters; every
# weight but these is used in the compute dtype, and the activations follow (the embedding
# lookup sets it). Router logits, softmax / sigmoid, top-k (modeling/routing.py), RMSNorm's
# statistics, attention scores and the losses are computed in float32 whatever the dtype.
KEEP_F32 = NORMS + ("router", "bias")


def use(lay: Layout, role: str, w, dtype):
  """A weight as the model reads it: the strategy's lay.use (its gather), then cast to `dtype`
  unless it is in KEEP_F32. A strategy that casts before gathering (sharding.gather_weight's
  dtype: the all-gather then moves bf16) makes this cast a no-op; the reference relies on it."""
  w = lay.use(role, w)
  return w if role in KEEP_F32 else w.astype(dtype)


# ----------------------------------------------------------------------------- blocks
def rms_norm(x, w, eps):
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * w).astype(x.dtype)


def rope(x, positions, theta):
  """x [B, S, ..heads.., Dh], positions [B, S] (true positions: CP-reordered tokens rotate right)."""
  half = x.shape[-1] // 2
  inv_freq = 1.0 / (theta ** (np.arange(half, dtype=np.float32) / half))       # [Dh/2]
  ang = positions.astype(jnp.float32)[..., None] * inv_freq                     # [B, S, Dh/2]
  heads = (slice(None), slice(None)) + (None,) * (x.ndim - 3)                   # any head dims
  cos, sin = jnp.cos(ang)[heads], jnp.sin(ang)[heads]                          # [B, S, 1.., Dh/2]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _gather_kv(a, spec):
  """K or V [B, S@cp, KV, Dh] -> spec (whole along the sequence): an all-gather over the axes
  that split S. Every such rank's queries read all of K/V, so the cotangent is a partial sum over
  those axes: gather_weight's backward reduce-scatters it (XLA:CPU alone would all-reduce)."""
  seq_axes = sharding.dim_axes(jax.typeof(a).sharding.spec, 1)
  return sharding.gather_weight(a, spec, tuple(x for x in seq_axes
                                               if x not in sharding.dim_axes(spec, 1)))


def attention(p, x, positions, cfg: Config, lay: Layout):
  """Causal GQA attention. x [B, S, D] -> [B, S, D]."""
  wq, wk, wv, wo = (use(lay, r, p[n], x.dtype) for n, r in (("wq", "attn_q"), ("wk", "attn_kv"),
                                                           ("wv", "attn_kv"), ("wo", "attn_o")))
  kv, dh = cfg.n_kv_heads, cfg.head_dim
  # H = KV x G viewed on the weights, never on activations: a reshape of [B, S, H, Dh] would
  # drop the batch dim's sharding when B is 1 per shard (jax >= 0.11)
  wq = einops.rearrange(wq, "d (k g) h -> d k g h", k=kv)                     # [D, KV, G, Dh]
  wo = einops.rearrange(wo, "(k g) h d -> k g h d", k=kv)                     # [KV, G, Dh, D]
  q = rope(jnp.einsum("bsd,dkgh->bskgh", x, wq), positions, cfg.rope_theta)    # [B, S, KV, G, Dh]
  k = rope(jnp.einsum("bsd,dkh->bskh", x, wk), positions, cfg.rope_theta)      # [B, S, KV, Dh]
  v = jnp.einsum("bsd,dkh->bskh", x, wv)                                       # [B, S, KV, Dh]
  k_pos = positions
  if lay.kv is not None:                                                       # CP: gather K/V
    k, v = _gather_kv(k, lay.kv), _gather_kv(v, lay.kv)                     # [B, T, KV, Dh]
    k_pos = jax.reshard(positions, lay.kv_pos)                                 # [B, T]
  scores = jnp.einsum("bskgh,btkh->bkgst", q, k).astype(jnp.float32) / np.sqrt(dh)
  causal = k_pos[:, None, None, None, :] <= positions[:, None, None, :, None]  # [B, 1, 1, S, T]
  probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(v.dtype)
  o = jnp.einsum("bkgst,btkh->bskgh", probs, v)                                # [B, S, KV, G, Dh]
  return jnp.einsum("bskgh,kghd->bsd", o, wo, out_sharding=lay.row)            # [B, S, D]


def shared_expert(p, x, lay: Layout):
  """Dense SwiGLU shared expert. x [B, S, D] -> [B, S, D]."""
  w0, w1, wo = (use(lay, r, p[n], x.dtype) for n, r in (("wi_0", "shared_in"),
                                                       ("wi_1", "shared_in"), ("wo", "shared_out")))
  h = jax.nn.silu(jnp.einsum("bsd,df->bsf", x, w0)) * jnp.einsum("bsd,df->bsf", x, w1)  # [B, S, Fs]
  return jnp.einsum("bsf,fd->bsd", h, wo, out_sharding=lay.row)


def block(x, lp, positions, cfg: Config, lay: Layout):
  """One decoder layer. x [B, S, D], lp: one layer's params -> (x [B, S, D], its router stats)."""
  h = lay.gather_in(rms_norm(x, lay.use("attn_norm", lp["attn_norm"]), cfg.norm_eps))
  x = x + lay.scatter_out(attention(lp["attn"], h, positions, cfg, lay))
  h = lay.gather_in(rms_norm(x, lay.use("mlp_norm", lp["mlp_norm"]), cfg.norm_eps))
  y, stats = lay.moe(lp["moe"], h, positions)
  if "shared" in lp:
    y = y + shared_expert(lp["shared"], h, lay)
  return x + lay.scatter_out(y), stats


def remat(body, cfg: Config):
  """--remat: the scanned layer body under jax.checkpoint (recomputed inside the backward of each
  scan step, keeping what the policy saves), or as it is for "none"."""
  if cfg.remat == "none":
    return body
  policy = None if cfg.remat == "block" else getattr(jax.checkpoint_policies, cfg.remat)
  return jax.checkpoint(body, policy=policy, prevent_cse=False)


def forward(params, batch, cfg: Config, lay: Layout):
  """-> (logits [B, S, V], router stats {name: [L, ...]}). The layers are one `block` scanned
  over the stacked [L, ...] layer params: compile time does not grow with depth."""
  tokens, positions = batch["tokens"], batch["positions"]
  embed = use(lay, "embed", params["embed"], cfg.dtype)
  x = embed.at[tokens].get(out_sharding=lay.x)                                 # [B, S, D] cfg.dtype
  body = remat(lambda x, lp: block(x, lp, positions, cfg, lay), cfg)
  x, stats = jax.lax.scan(body, x, params["layers"])
  x = rms_norm(x, lay.use("final_norm", params["final_norm"]), cfg.norm_eps)
  logits = jnp.einsum("bsd,dv->bsv", x, use(lay, "unembed", params["unembed"], x.dtype))  # [B, S, V]
  return logits, stats


def loss_fn(params, batch, cfg: Config, lay: Layout, counts=None, n_tokens=None):
  """-> (loss, metrics). Mean next-token CE over all tokens + aux_coef*aux + z_coef*z.

  One microbatch of a step (runtime.train, gradient accumulation): counts [L, E] are the WHOLE
  step's router counts (f of the aux loss, pass 1) and n_tokens the step's tokens; CE, P and z
  are this microbatch's sums over n_tokens, so the microbatch losses sum to the step's loss."""
  logits, stats = forward(params, batch, cfg, lay)
  logits = logits.astype(jnp.float32)
  tgt = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
  nll = jax.nn.logsumexp(logits, axis=-1) - tgt                                # [B, S]
  if counts is None:
    ce = jnp.mean(nll)
    n_tokens = batch["tokens"].shape[0] * batch["tokens"].shape[1]
    aux, z = routing.aux_losses(stats, n_tokens, cfg.n_experts)                # [L] each
  else:
    ce = jnp.sum(nll) / n_tokens
    aux, z = routing.aux_losses({**stats, "counts": counts}, n_tokens, cfg.n_experts)
  aux, z = jnp.sum(aux), jnp.sum(z)
  loss = ce + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
  metrics = {"loss": loss, "ce_loss": ce, "aux_loss": aux, "z_loss": z,
             "dropped": jnp.sum(stats["dropped"]), "counts": stats["counts"]}  # counts [L, E]
  return loss, metrics


def reference_layout(cfg: Config) -> Layout:
  """Single device, no shardings, dense MoE oracle."""
  return Layout(moe=lambda p, x, pos: moe_lib.moe_dense(p, x, pos, cfg))
