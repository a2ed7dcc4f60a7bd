"""Decoder-only MoE transformer: init, forward, loss. Shared by the reference and every strategy.

  tokens [B, S] -> embed -> L x [RMSNorm -> causal GQA attention (RoPE) -> +res
                                 -> RMSNorm -> MoE FFN (+ shared expert) -> +res]
         -> RMSNorm -> unembed -> next-token cross-entropy (+ aux losses)

A strategy does not rewrite the model. It hands `forward` a `Layout`:
  x      out_sharding of the residual stream [B, S, D] (needed where a contraction dim is sharded,
         e.g. the row-parallel attention output under TP)
  kv     sharding K/V [B, T, KV, Dh] and kv_pos [B, T] are resharded to before attention (CP
         all-gathers them over the context axis here; dK/dV come back reduce-scattered)
  use    (path, w) -> w, applied to every non-routed weight right before its use (FSDP all-gather)
  moe    (p_moe, x [B, S, D], positions [B, S]) -> (y, stats): the routed MoE, where the strategy
         places its shard_map and token exchange. stats are GLOBAL sums (see routing.router_stats).
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

import jax
import jax.numpy as jnp
import numpy as np

from common import moe as moe_lib
from common import routing
from common import sharding
from common.config import Config


def _identity_use(path: str, w):
  del path
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

  @property
  def row(self):
    """out_sharding of the row-parallel projections (attn wo, shared wo)."""
    return self.x if self.row_out is None else self.row_out


# ----------------------------------------------------------------------------- init
def _param_tree(cfg: Config, leaf) -> dict:
  """The param pytree; leaf(shape, fan_in) makes a normal(0, 1/fan_in) leaf, fan_in=0 -> ones,
  fan_in=-1 -> zeros."""
  d, h, kv, dh, e, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.n_experts, cfg.d_ff, cfg.vocab)
  layers = []
  for _ in range(cfg.n_layers):
    layer = {
        "attn_norm": leaf((d,), 0),
        "attn": {"wq": leaf((d, h, dh), d), "wk": leaf((d, kv, dh), d),
                 "wv": leaf((d, kv, dh), d), "wo": leaf((h, dh, d), h * dh)},
        "mlp_norm": leaf((d,), 0),
        "moe": {"router": leaf((d, e), d), "bias": leaf((e,), -1),
                "wi_0": leaf((e, d, f), d), "wi_1": leaf((e, d, f), d), "wo": leaf((e, f, d), f)},
    }
    if cfg.n_shared_experts:
      fs = cfg.shared_d_ff
      layer["shared"] = {"wi_0": leaf((d, fs), d), "wi_1": leaf((d, fs), d), "wo": leaf((fs, d), fs)}
    layers.append(layer)
  return {"embed": leaf((v, d), 1), "layers": layers, "final_norm": leaf((d,), 0),
          "unembed": leaf((d, v), d)}


def init_params(cfg: Config, seed: int | None = None) -> dict:
  """Deterministic numpy float32 init: the same values whatever strategy asks."""
  rng = np.random.default_rng(cfg.seed if seed is None else seed)

  def leaf(shape, fan_in):
    if fan_in == 0:
      return np.ones(shape, np.float32)
    if fan_in == -1:
      return np.zeros(shape, np.float32)
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
  return _param_tree(cfg, leaf)


def init_params_shapes(cfg: Config) -> dict:
  """The param pytree with shape tuples as leaves (for building spec trees)."""
  return _param_tree(cfg, lambda shape, fan_in: ShapeLeaf(shape))


@dataclasses.dataclass(frozen=True)
class ShapeLeaf:
  """A pytree leaf holding a parameter's shape."""
  shape: tuple


def abstract_params(cfg: Config, specs, mesh) -> dict:
  """ShapeDtypeStructs with shardings, for compile-only studies of large configs."""
  if mesh is None:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), init_params_shapes(cfg))
  return jax.tree.map(
      lambda s, p: jax.ShapeDtypeStruct(s.shape, jnp.float32,
                                        sharding=jax.sharding.NamedSharding(mesh, p)),
      init_params_shapes(cfg), specs)


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
  seq_axes = sharding.spec_axes(jax.typeof(a).sharding.spec, 1)
  return sharding.gather_weight(a, spec, tuple(x for x in seq_axes
                                               if x not in sharding.spec_axes(spec, 1)))


def attention(p, x, positions, cfg: Config, lay: Layout, path: str):
  """Causal GQA attention. x [B, S, D] -> [B, S, D]."""
  wq, wk, wv, wo = (lay.use(f"{path}/{n}", p[n]) for n in ("wq", "wk", "wv", "wo"))
  kv, g, dh = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
  # H = KV x G viewed on the weights, never on activations: a reshape of [B, S, H, Dh] would
  # drop the batch dim's sharding when B is 1 per shard (jax >= 0.11)
  wq = wq.reshape(wq.shape[0], kv, g, dh)                                      # [D, KV, G, Dh]
  wo = wo.reshape(kv, g, dh, wo.shape[-1])                                     # [KV, G, Dh, D]
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


def shared_expert(p, x, lay: Layout, path: str):
  """Dense SwiGLU shared expert. x [B, S, D] -> [B, S, D]."""
  w0, w1, wo = (lay.use(f"{path}/{n}", p[n]) for n in ("wi_0", "wi_1", "wo"))
  h = jax.nn.silu(jnp.einsum("bsd,df->bsf", x, w0)) * jnp.einsum("bsd,df->bsf", x, w1)  # [B, S, Fs]
  return jnp.einsum("bsf,fd->bsd", h, wo, out_sharding=lay.row)


def forward(params, batch, cfg: Config, lay: Layout):
  """-> (logits [B, S, V], per-layer stats list)."""
  tokens, positions = batch["tokens"], batch["positions"]
  embed = lay.use("embed", params["embed"])
  x = embed.at[tokens].get(out_sharding=lay.x)                                 # [B, S, D]
  stats = []
  for i, lp in enumerate(params["layers"]):
    path = f"layers/{i}"
    h = lay.gather_in(rms_norm(x, lay.use(f"{path}/attn_norm", lp["attn_norm"]), cfg.norm_eps))
    x = x + lay.scatter_out(attention(lp["attn"], h, positions, cfg, lay, f"{path}/attn"))
    h = lay.gather_in(rms_norm(x, lay.use(f"{path}/mlp_norm", lp["mlp_norm"]), cfg.norm_eps))
    y, st = lay.moe(lp["moe"], h, positions)
    if "shared" in lp:
      y = y + shared_expert(lp["shared"], h, lay, f"{path}/shared")
    x = x + lay.scatter_out(y)
    stats.append(st)
  x = rms_norm(x, lay.use("final_norm", params["final_norm"]), cfg.norm_eps)
  logits = jnp.einsum("bsd,dv->bsv", x, lay.use("unembed", params["unembed"]))  # [B, S, V]
  return logits, stats


def loss_fn(params, batch, cfg: Config, lay: Layout):
  """-> (loss, metrics). Mean next-token CE over all tokens + aux_coef*aux + z_coef*z."""
  logits, stats = forward(params, batch, cfg, lay)
  logits = logits.astype(jnp.float32)
  tgt = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
  ce = jnp.mean(jax.nn.logsumexp(logits, axis=-1) - tgt)
  n_tokens = batch["tokens"].shape[0] * batch["tokens"].shape[1]
  aux = z = jnp.zeros((), jnp.float32)
  for st in stats:
    a, zz = routing.aux_losses(st, n_tokens, cfg.n_experts)
    aux, z = aux + a, z + zz
  loss = ce + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
  metrics = {"loss": loss, "ce_loss": ce, "aux_loss": aux, "z_loss": z,
             "dropped": sum(st["dropped"] for st in stats),
             "counts": jnp.stack([st["counts"] for st in stats])}              # [L, E]
  return loss, metrics


def reference_layout(cfg: Config) -> Layout:
  """Single device, no shardings, dense MoE oracle."""
  return Layout(moe=lambda p, x, pos: moe_lib.moe_dense(p, x, pos, cfg))
