"""Decoder-only MoE transformer: init, forward, loss. Shared by the reference and every strategy.

  tokens [B, S] -> embed
         -> scan over the first_k_dense_replace dense layers [RMSNorm -> attention -> +res
                                                             -> RMSNorm -> SwiGLU FFN -> +res]
         -> scan over the L_moe MoE layers [RMSNorm -> attention -> +res
                                            -> RMSNorm -> MoE FFN (+ shared expert) -> +res]
         -> RMSNorm -> unembed -> next-token cross-entropy (+ aux losses)
  attention: causal GQA with RoPE (Mixtral), or MLA (DeepSeek: `mla`), cfg.attention; its
  softmax(q k^T) v core is modeling/attention.py's `attend`, cfg.attention_impl (--attention):
  xla's materialised scores, the chunked online softmax (memory linear in S), or cuDNN.

A strategy does not rewrite the model. Its `layout(cfg, mesh, opts)` hands `forward` a
`Parallelism`, how the strategy runs the model on its mesh:
  x      out_sharding of the residual stream [B, S, D] (needed where a contraction dim is sharded,
         e.g. the row-parallel attention output under TP)
  kv     sharding K/V [B, T, KV, Dh] and kv_pos [B, T] are resharded to before attention (CP
         all-gathers them over the context axis here; dK/dV come back reduce-scattered); MLA
         gathers its latent [B, T, Rkv + rope] to the same (batch, T) instead. Without kv the
         positions are the batch's own order, 0..S-1 (only cp reorders them): attention is
         called `ordered` and skips the key chunks after each query block
  kv_axes  CP inside a full-manual shard_map (pp's stages): the mesh axes that split the local
         sequence; K/V (MLA: the latent) all-gathered over them by hand (the transpose,
         dK/dV, reduce-scattered), or with kv_ring passed around their ring, the keys'
         positions given whole (Positions.k)
  use    (role, w) -> w, applied to every non-routed weight right before its use (FSDP all-gather);
         role: its entry in ROLES (w is one layer's slice inside the layer scan)
  moe    (p_moe, x [B, S, D], positions [B, S]) -> (y, stats): a MoE layer's routed FFN, where the strategy
         places its shard_map and token exchange. stats are GLOBAL sums (see routing.router_stats).
  loss   optional (params, batch) -> (loss, metrics) replacing loss_fn for a strategy that runs
         the whole model its own way (pp: a pipeline schedule in one shard_map).
  gather_in / scatter_out / row_out: sequence parallelism (Megatron-SP, ep_tp).
         gather_in: normed h (residual layout x) -> what moe and the dense SwiGLUs (shared
           expert, dense layer FFN) read, and what attention reads (GQA: h; MLA: its latents,
           after the token-local down-projections) (ep_tp: the all-gather over the sequence axis;
           tp: typed reduced over tensor);
         row_out: out_sharding of the row-parallel projections attn wo and the SwiGLUs' wo
           (ep_tp: typed unreduced); moe's y must come in the same layout, as it is added to
           shared wo;
         scatter_out: attention out, a dense layer's FFN out, and moe y + shared out -> the
           residual layout (ep_tp: the reduce-scatter).
         Defaults: identity, identity, row_out = x: the forward of every other strategy is the
         same program as without these hooks.
  moe_in_residual: moe reads the normed h (and its positions) in the residual layout x, not
         gather_in's, and returns y in that layout; only the shared expert goes through
         gather_in / row_out / scatter_out (ep_tp's exchange=folded: the MoE exchanges the
         sequence-parallel tokens itself).
The reference passes Parallelism() with moe=the dense oracle and no shardings.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import einops
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from modeling import attention as attention_lib, moe as moe_lib, ring_attention, routing
from modeling.config import Config, segments
from parallel import sharding


def _identity_use(role: str, w):
  del role
  return w


def _identity(a):
  return a


@dataclasses.dataclass(frozen=True)
class Parallelism:
  x: Any = None
  kv: Any = None
  kv_pos: Any = None
  kv_ring: bool = False          # with kv: CP's K/V exchange, all-gather (False) or ring
  kv_axes: tuple = ()            # manual CP (pp): K/V all-gathered over these axes by hand
  use: Callable = _identity_use
  moe: Callable | None = None
  gather_in: Callable = _identity
  scatter_out: Callable = _identity
  row_out: Any = None
  moe_in_residual: bool = False
  loss: Callable | None = None
  # the parameters as the step uses them, once per step before the forward (ZeRO-1's all-gather
  # over data, layout/fsdp.gather_once), or as stored
  params: Callable = _identity

  @property
  def splits_sequence(self) -> bool:
    """Whether the queries hold part of the sequence (CP) and K/V are gathered whole."""
    return self.kv is not None or bool(self.kv_axes)

  @property
  def gathers_once(self) -> bool:
    """Whether `params` gathers the weights once per step (ZeRO-1), rather than per use."""
    return self.params is not _identity

  def given(self) -> "Parallelism":
    """This Parallelism with its forward taking the parameters as given: already `params`' output
    (gradient accumulation gathers once for every microbatch: runtime.train)."""
    return dataclasses.replace(self, params=_identity)

  @property
  def row(self):
    """out_sharding of the row-parallel projections (attn wo, shared wo)."""
    return self.x if self.row_out is None else self.row_out


# ----------------------------------------------------------------------------- parameters
# Every parameter's role, declared once below next to its shape. Strategies lay parameters out by
# role (a role -> PartitionSpec table, `param_specs`); the optimizer, weight decay and the cost
# models read roles too. Per-layer roles are stacked, one stack per kind of layer, each scanned
# by `forward`: "dense_layers" [n_dense_layers, ...] (the dense-FFN layers in depth order:
# DeepSeek's leading ones, Qwen's mlp_only_layers, Llama 4's between MoE layers; absent when
# none), and "layers" [n_moe_layers, ...] (the MoE layers in depth order).
ATTN_ROLES = ("attn_q", "attn_kv", "attn_o",                        # GQA, and MLA's wq / wo
              "attn_q_bias", "attn_kv_bias", "head_norm",           # GQA's biases, QK-norm
              "attn_sinks", "attn_o_bias",                          # gpt-oss: sinks [H], bo [D]
              "attn_q_a", "q_norm", "attn_q_b",                     # MLA query low rank
              "attn_kv_a", "kv_norm", "attn_kv_b")                  # MLA latent c_KV
LAYER_ROLES = ("attn_norm", "mlp_norm", "router", "bias", "expert_in", "expert_out",
               "router_bias", "expert_in_bias", "expert_out_bias",  # gpt-oss's MoE biases
               "shared_in", "shared_out", "shared_gate", "dense_in", "dense_out") + ATTN_ROLES
ROLES = ("embed", "final_norm", "unembed") + LAYER_ROLES
NORMS = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "kv_norm",  # RMSNorm scales
         "head_norm")
BIASES = ("attn_q_bias", "attn_kv_bias", "attn_o_bias",             # added, never multiplied
          "router_bias", "expert_in_bias", "expert_out_bias")
EXPERTS = ("expert_in", "expert_out")                               # [E, D, F] / [E, F, D]
EXPERT_BIASES = ("expert_in_bias", "expert_out_bias")               # [E, F] / [E, D]
MOE_ROLES = {"router": "router", "bias": "bias", "wi_0": "expert_in", "wi_1": "expert_in",
             "wo": "expert_out", "router_b": "router_bias", "bi_0": "expert_in_bias",
             "bi_1": "expert_in_bias", "bo": "expert_out_bias"}     # a layer's "moe" leaves
# The dim FSDP shards (layout/fsdp.py): the model dim D, or for MLA's up-projections (which have
# none) the low rank they read
D_DIM = {"embed": 1, "unembed": 0, "router": 0, "attn_q": 0, "attn_kv": 0, "attn_o": 2,
         "attn_q_a": 0, "attn_q_b": 0, "attn_kv_a": 0, "attn_kv_b": 0,
         "expert_in": 1, "expert_out": 2, "shared_in": 0, "shared_out": 1, "shared_gate": 0,
         "dense_in": 0, "dense_out": 1}


@dataclasses.dataclass(frozen=True)
class ShapeLeaf:
  """A parameter's declaration: full shape ([L, ...] for a layer role) and role."""
  shape: tuple
  role: str


def _attention_params(cfg: Config, leaf) -> dict:
  """One layer's attention. GQA: wq [D, H, Dh], wk / wv [D, KV, Dh], wo [H, Dh, D].
  MLA (Hugging Face DeepseekV3's q_proj | q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa,
  kv_a_layernorm, kv_b_proj; o_proj, transposed to [in, out]):
    wq [D, H, nope+rope]  or  wq_a [D, Rq], q_norm [Rq], wq_b [Rq, H, nope+rope]
    wkv_a [D, Rkv + rope]  (the latent c_KV, then the RoPE key shared by all heads)
    kv_norm [Rkv], wkv_b [Rkv, H, nope + v]  (per head: the no-RoPE key, then the value)
    wo [H, v, D]"""
  d, h = cfg.d_model, cfg.n_heads
  if not cfg.mla:
    kv, dh = cfg.n_kv_heads, cfg.head_dim
    out = {"wq": leaf((d, h, dh), d, "attn_q"), "wk": leaf((d, kv, dh), d, "attn_kv"),
           "wv": leaf((d, kv, dh), d, "attn_kv"), "wo": leaf((h, dh, d), h * dh, "attn_o")}
    if cfg.qkv_bias:                      # bq [H, Dh], bk / bv [KV, Dh]: zeros at init
      out.update(bq=leaf((h, dh), -1, "attn_q_bias"), bk=leaf((kv, dh), -1, "attn_kv_bias"),
                 bv=leaf((kv, dh), -1, "attn_kv_bias"))
    if cfg.qk_norm:                       # q_norm / k_norm [Dh]: one scale for every head
      out.update(q_norm=leaf((dh,), 0, "head_norm"), k_norm=leaf((dh,), 0, "head_norm"))
    if cfg.attn_sinks:                    # sinks [H]: one logit per query head, zeros at init
      out["sinks"] = leaf((h,), -1, "attn_sinks")
    if cfg.attn_o_bias:                   # bo [D]: added to the attention's output
      out["bo"] = leaf((d,), -1, "attn_o_bias")
    return out
  qk, rq, rkv = cfg.qk_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
  nope, rope_d, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  q = ({"wq_a": leaf((d, rq), d, "attn_q_a"), "q_norm": leaf((rq,), 0, "q_norm"),
        "wq_b": leaf((rq, h, qk), rq, "attn_q_b")} if rq else {"wq": leaf((d, h, qk), d, "attn_q")})
  return {**q, "wkv_a": leaf((d, rkv + rope_d), d, "attn_kv_a"),
          "kv_norm": leaf((rkv,), 0, "kv_norm"),
          "wkv_b": leaf((rkv, h, nope + v), rkv, "attn_kv_b"), "wo": leaf((h, v, d), h * v, "attn_o")}


def _param_tree(cfg: Config, leaf) -> dict:
  """The param pytree of one layer's / the model's leaves: leaf(shape, fan_in, role) makes a
  normal(0, 1/fan_in) leaf, fan_in=0 -> ones, fan_in=-1 -> zeros."""
  d, e, f, v = cfg.d_model, cfg.n_experts, cfg.d_ff, cfg.vocab

  def swiglu(width, roles, leaf):                                   # a dense SwiGLU FFN
    r_in, r_out = roles
    return {"wi_0": leaf((d, width), d, r_in), "wi_1": leaf((d, width), d, r_in),
            "wo": leaf((width, d), width, r_out)}

  def layer(dense, leaf=leaf):
    out = {"attn_norm": leaf((d,), 0, "attn_norm"), "attn": _attention_params(cfg, leaf),
           "mlp_norm": leaf((d,), 0, "mlp_norm")}
    if dense:
      return {**out, "mlp": swiglu(cfg.dense_d_ff, ("dense_in", "dense_out"), leaf)}
    out["moe"] = {"router": leaf((d, e), d, "router"), "bias": leaf((e,), -1, "bias"),
                  "wi_0": leaf((e, d, f), d, "expert_in"), "wi_1": leaf((e, d, f), d, "expert_in"),
                  "wo": leaf((e, f, d), f, "expert_out")}
    if cfg.router_bias:                   # router_b [E]: added to the router logits
      out["moe"]["router_b"] = leaf((e,), -1, "router_bias")
    if cfg.expert_bias:                   # bi_0 / bi_1 [E, F], bo [E, D]: zeros at init
      out["moe"].update(bi_0=leaf((e, f), -1, "expert_in_bias"),
                        bi_1=leaf((e, f), -1, "expert_in_bias"),
                        bo=leaf((e, d), -1, "expert_out_bias"))
    if cfg.n_shared_experts:
      out["shared"] = swiglu(cfg.shared_d_ff, ("shared_in", "shared_out"), leaf)
      if cfg.shared_gate:                 # wg [D]: the shared expert's scalar gate
        out["shared"]["wg"] = leaf((d,), d, "shared_gate")
    return out

  # drawn layer by layer in depth order (the dense prefix first), then stacked per kind; the
  # MoE stack's padding rows (cfg.layer_slots -1, layer_layout) are zeros, drawn from nothing,
  # so the real layers hold the same values whatever the layout
  layers = [layer(not is_moe) for is_moe in cfg.layer_is_moe]
  moe = [lp for lp, is_moe in zip(layers, cfg.layer_is_moe) if is_moe]
  pad = lambda: layer(False, lambda shape, fan_in, role: leaf(shape, -1, role))
  tree = {"embed": leaf((v, d), 1, "embed")}
  if cfg.n_dense_layers:                 # inside the stack: stored as layer_layout groups them
    dense = [lp for lp, is_moe in zip(layers, cfg.layer_is_moe) if not is_moe]
    tree["dense_layers"] = [dense[j] for j in cfg.dense_slots] if cfg.dense_slots else dense
  return {**tree, "layers": [moe[j] if j >= 0 else pad() for j in cfg.layer_slots],
          "final_norm": leaf((d,), 0, "final_norm"), "unembed": leaf((d, v), d, "unembed")}


STACKS = ("dense_layers", "layers")      # the stacked layer kinds, in depth order


def _stack(tree: dict, stack) -> dict:
  return {**tree, **{k: jax.tree.map(lambda *ls: stack(ls), *tree[k],
                                     is_leaf=lambda l: isinstance(l, ShapeLeaf))
                     for k in STACKS if k in tree}}


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


@functools.lru_cache(maxsize=1024)
def init_params_shapes(cfg: Config) -> dict:
  """The param pytree with ShapeLeaf(shape, role) leaves (for spec trees and cost models). One
  tree per Config, shared by every caller (the planner asks for it per candidate): read it, never
  assign into it."""
  return _stack(_param_tree(cfg, lambda shape, fan_in, role: ShapeLeaf(shape, role)),
                lambda ls: ShapeLeaf((len(ls),) + ls[0].shape, ls[0].role))


def layer_params(params: dict, i: int) -> dict:
  """MoE layer i's params: one slice of the stacked [L_moe, ...] leaves."""
  return jax.tree.map(lambda a: a[i], params["layers"])


def param_leaves(cfg: Config, with_paths: bool = False) -> list:
  """The ShapeLeaf(shape, role) of every parameter, in pytree order; with_paths: (key path,
  leaf) pairs, the path's first key naming the leaf's group ("embed", "layers", ...)."""
  flat = jax.tree_util.tree_flatten_with_path(init_params_shapes(cfg),
                                              is_leaf=lambda l: isinstance(l, ShapeLeaf))[0]
  return flat if with_paths else [leaf for _, leaf in flat]


@functools.lru_cache(maxsize=1024)
def param_counts(cfg: Config) -> tuple[int, int]:
  """(total, activated per token) parameters, from the declarations. Activated: what one token's
  forward multiplies by: every weight but the routed experts, top_k of the n_experts routed
  experts, and of the embedding table the one row it reads (a lookup, not a matmul; the
  unembedding is a matmul and counts whole). Mixtral-8x7B 46.70B / 12.75B, DeepSeek-V2-Lite
  15.71B / 2.45B, DeepSeek-V3 671.03B / 36.63B (tests/test_model.py holds the published
  46.7B / 12.9B, 15.7B / 2.4B, 671B / 37B)."""
  total = active = 0
  for leaf in param_leaves(cfg.replace(layer_layout="")):     # layer_layout's padding: no params
    n = math.prod(leaf.shape)
    total += n
    if leaf.role in EXPERTS + EXPERT_BIASES:
      active += n * cfg.top_k // cfg.n_experts
    else:
      active += cfg.d_model if leaf.role == "embed" else n
  return total, active


def param_roles(cfg: Config) -> dict:
  """The param pytree with role strings as leaves."""
  return jax.tree.map(lambda l: l.role, init_params_shapes(cfg),
                      is_leaf=lambda l: isinstance(l, ShapeLeaf))


def param_specs(cfg: Config, table: dict, layer_axis=None, dense_table=None,
                dense_layer_axis=None) -> dict:
  """A strategy's role -> PartitionSpec table (one layer's array; roles it omits are replicated)
  -> the spec pytree of the params; layer roles get the leading [L] dim: the MoE stack's sharded
  over `layer_axis` (pipeline stages) or not at all, the dense prefix's never. dense_table: the
  dense prefix's own role table (pp splits its matrices over every stage, as the embedding's),
  else `table`; dense_layer_axis: the dense stack's [L] over it, as the MoE stack's over
  layer_axis (pp's stages holding dense layers inside the stack). One tree per (cfg, tables,
  axes), shared as init_params_shapes' is."""
  frozen = lambda tbl: None if tbl is None else tuple(sorted(tbl.items()))
  return _param_specs(cfg, frozen(table), layer_axis, frozen(dense_table), dense_layer_axis)


def _derived(table: dict) -> dict:
  """A role table with the gpt-oss roles a strategy's table leaves out split as the weights they
  belong to: expert biases as their matrices' E dim (and bi's F dim, as wi's), the sinks [H] as
  wq's heads."""
  entries = lambda role, n: tuple(table.get(role, P())) + (None,) * n
  e_in, e_out, q = entries("expert_in", 3), entries("expert_out", 3), entries("attn_q", 3)
  return {"expert_in_bias": P(e_in[0], e_in[2]), "expert_out_bias": P(e_out[0], None),
          "attn_sinks": P(q[1]), **table}


@functools.lru_cache(maxsize=4096)
def _param_specs(cfg: Config, table: tuple, layer_axis, dense_table: tuple | None,
                 dense_layer_axis=None) -> dict:
  table = _derived(dict(table))
  dense_table = None if dense_table is None else _derived(dict(dense_table))

  def spec(axis, tbl):
    return lambda leaf: (P(axis, *tbl.get(leaf.role, P())) if leaf.role in LAYER_ROLES
                         else tbl.get(leaf.role, P()))
  is_leaf = lambda l: isinstance(l, ShapeLeaf)
  shapes = init_params_shapes(cfg)
  out = jax.tree.map(spec(None, table), shapes, is_leaf=is_leaf)
  if dense_table is not None and "dense_layers" in shapes:
    out["dense_layers"] = jax.tree.map(spec(None, dense_table), shapes["dense_layers"],
                                       is_leaf=is_leaf)
  elif dense_layer_axis is not None and "dense_layers" in shapes:
    out["dense_layers"] = jax.tree.map(spec(dense_layer_axis, table), shapes["dense_layers"],
                                       is_leaf=is_leaf)
  return {**out, "layers": jax.tree.map(spec(layer_axis, table), shapes["layers"],
                                        is_leaf=is_leaf)}


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
# statistics, attention scores and the losses are computed in float32 whatever the dtype. The
# q/k/v biases are used as stored (float32, never typed reduced: an add has no contraction to
# sum their gradient in) and cast to the activations' dtype where they are added.
KEEP_F32 = NORMS + BIASES + ("router", "bias", "attn_sinks")


def use(lay: Parallelism, role: str, w, dtype):
  """A weight as the model reads it: the strategy's lay.use (its gather), then cast to `dtype`
  unless it is in KEEP_F32. A strategy that casts before gathering (sharding.gather_weight's
  dtype: the all-gather then moves bf16) makes this cast a no-op; the reference relies on it."""
  w = lay.use(role, w)
  return w if role in KEEP_F32 else w.astype(dtype)


# ----------------------------------------------------------------------------- blocks
def rms_norm(x, w, eps):
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * w).astype(x.dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@functools.lru_cache(maxsize=64)
def rope_frequencies(cfg: Config, dim: int) -> tuple[np.ndarray, float]:
  """-> (inv_freq [dim/2] float32, the cos / sin scale) of a dim-wide rotation under cfg's RoPE:
  theta^(-2i/dim), or with yarn_factor YaRN's blend of it and its factor-interpolated copy, the
  ramp between the dims that turn yarn_beta_fast and yarn_beta_slow times over
  yarn_original_max positions (bounds floored / ceiled unless not yarn_truncate), as transformers computes it."""
  base = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))   # [dim/2]
  if cfg.llama3_factor:
    return _llama3_frequencies(cfg, base), 1.0
  if not cfg.yarn_factor:
    return base.astype(np.float32), 1.0
  f, n = cfg.yarn_factor, cfg.yarn_original_max

  def turns_dim(turns):              # the dim whose wavelength fits `turns` times in n positions
    return dim * math.log(n / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
  lo, hi = turns_dim(cfg.yarn_beta_fast), turns_dim(cfg.yarn_beta_slow)
  if cfg.yarn_truncate:
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, dim - 1)
  hi = hi + 0.001 if lo == hi else hi
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
  keep = 1 - ramp                    # 1: the fast dims keep theta's frequency (extrapolation)
  inv_freq = (base / f) * (1 - keep) + base * keep
  scale = (yarn_mscale(f, cfg.yarn_mscale) / yarn_mscale(f, cfg.yarn_mscale_all_dim)
           if cfg.yarn_mscale and cfg.yarn_mscale_all_dim else yarn_mscale(f))
  return inv_freq.astype(np.float32), float(scale)


def _llama3_frequencies(cfg: Config, inv_freq: np.ndarray) -> np.ndarray:
  """Llama 3's scaled RoPE frequencies (transformers' llama3 rope type): wavelengths past
  original / low_freq_factor slowed by the factor, those under original / high_freq_factor kept,
  the ones between blended by how many turns they make in the original positions."""
  f, lo, hi = cfg.llama3_factor, cfg.llama3_low_freq_factor, cfg.llama3_high_freq_factor
  n = cfg.llama3_original_max
  wavelen = 2 * math.pi / inv_freq
  out = np.where(wavelen > n / lo, inv_freq / f, inv_freq)
  medium = (wavelen >= n / hi) & (wavelen <= n / lo)
  if hi > lo and medium.any():
    smooth = (n / wavelen - lo) / (hi - lo)
    out = np.where(medium, (1 - smooth) * out / f + smooth * out, out)
  return out.astype(np.float32)


def rope(x, positions, cfg: Config, interleave=False, dim: int = 0):
  """x [B, S, ..heads.., Dh], positions [B, S] (true positions: CP-reordered tokens rotate right).
  Rotates the pairs (x_i, x_i+d/2) of the first d = dim (0: all Dh) dims, the rest passing
  through (partial rotary); interleave: the pairs (x_2i, x_2i+1), as Hugging Face's
  DeepseekV3 (rope_interleave), which de-interleaves first: the result is in the rotated-half
  order, the same for q and k, so their dot products are the same as its. Frequencies and the
  cos / sin scale: rope_frequencies (YaRN when cfg.yarn_factor)."""
  dim = dim or x.shape[-1]
  x, rest = x[..., :dim], x[..., dim:]
  if interleave:
    x = einops.rearrange(x, "... (d two) -> ... (two d)", two=2)
  half = dim // 2
  inv_freq, scale = rope_frequencies(cfg, dim)                                  # [d/2]
  ang = positions.astype(jnp.float32)[..., None] * inv_freq                     # [B, S, d/2]
  heads = (slice(None), slice(None)) + (None,) * (x.ndim - 3)                   # any head dims
  cos, sin = (scale * jnp.cos(ang))[heads], (scale * jnp.sin(ang))[heads]     # [B, S, 1.., d/2]
  x1, x2 = x[..., :half], x[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  return out if rest.shape[-1] == 0 else jnp.concatenate([out, rest], axis=-1)


def _kv_gather_axes(a, spec) -> tuple:
  """The axes that split a's sequence dim [B, S@cp, ...] and not spec's: what _gather_kv gathers."""
  return tuple(x for x in sharding.dim_axes(jax.typeof(a).sharding.spec, 1)
               if x not in sharding.dim_axes(spec, 1))


def _ring_axes(a, lay: Parallelism, spec) -> tuple:
  """The ring's axes: lay.kv_axes inside a manual shard_map, else those splitting a's sequence
  and not spec's."""
  return lay.kv_axes or _kv_gather_axes(a, spec)


def _gather_kv(a, lay: Parallelism, spec=None):
  """K or V [B, S@cp, ...] -> whole along the sequence: an all-gather over the axes that split
  S (lay.kv_axes inside a manual shard_map; else those of a's type not in spec, lay.kv by
  default). Every such rank's queries read all of K/V, so the cotangent is a partial sum over
  those axes, reduce-scattered: the manual all-gather's transpose, or gather_weight's backward
  (XLA:CPU alone would all-reduce)."""
  if lay.kv_axes:
    return jax.lax.all_gather(a, lay.kv_axes, axis=1, tiled=True)             # [B, T, ...]
  spec = lay.kv if spec is None else spec
  return sharding.gather_weight(a, spec, _kv_gather_axes(a, spec))


def _kv_as_is(kv, w):
  """ring_attend's expand for GQA: the travelling block is K and V themselves."""
  del w
  return kv[0], kv[1], None


def _mla_expand(lat, w, r: int, nope: int):
  """ring_attend's expand for MLA: a latent block [b, s, Rkv + rope] up-projected by w = (wkv_b,)
  to k_n [b, s, H, nope], v [b, s, H, v], and its RoPE key k_r [b, s, rope]."""
  kv = jnp.einsum("btr,rhk->bthk", lat[..., :r], w[0])                     # [b, s, H, nope + v]
  return kv[..., :nope], kv[..., nope:], lat[..., r:]


class Positions(NamedTuple):
  """A batch's positions [B, S] (int32) in each layout a layer reads them: q as the batch (the
  queries, the MoE's tokens), x as the residual (Parallelism.x: MLA's token-local RoPE key, the
  folded MoE), k as the keys (Parallelism.kv_pos: cp's whole sequence, all-gathered). Made once per
  step before the layer scans, outside their remat (layer_positions), so that no layer reshards
  them: inside a scanned, rematted block XLA hoists such a reshard out of the loop in some
  programs and repeats it per layer in others (bf16), which would put its bytes at its whim."""
  q: Any
  x: Any
  k: Any


def layer_positions(positions, lay: Parallelism) -> Positions:
  """positions [B, S] in the batch's layout -> Positions (a Positions passes through)."""
  if isinstance(positions, Positions):
    return positions
  x = positions if lay.x is None else jax.reshard(positions, P(*tuple(lay.x)[:2]))  # [B, S]
  k = positions if lay.kv_pos is None else jax.reshard(positions, lay.kv_pos)       # [B, T]
  return Positions(positions, x, k)


def attention(p, x, pos: Positions, cfg: Config, lay: Parallelism, kind: str = "full"):
  """Causal self-attention of cfg.attention. x [B, S, D], the normed residual in its own layout
  (Parallelism.x) -> [B, S, D]; the attention gathers what it reads (lay.gather_in). kind: the
  layer's attention kind (config.LAYER_ATTENTIONS: full, sliding, local or nope)."""
  if cfg.mla:
    return mla(p, x, pos, cfg, lay)
  return gqa(p, x, pos, cfg, lay, kind)


def _split_heads(w, pattern: str, g_axis: int, kv: int):
  """A weight's heads H viewed as [KV, G] (einops `pattern`); G = 1 (multi-head attention) as
  a new axis at g_axis: jax 0.11.2's reshape sharding rule rejects a split that leaves a
  singleton on a weight typed reduced and split over tensor (ep_x_tp's zero1 copy)."""
  if w.shape[g_axis - 1] == kv:
    return jnp.expand_dims(w, g_axis)
  return einops.rearrange(w, pattern, k=kv)


def gqa(p, x, pos: Positions, cfg: Config, lay: Parallelism, kind: str = "full"):
  """Causal GQA attention. x [B, S, D] -> [B, S, D]; q, k and v all read the gathered x. A
  "sliding" layer sees its last cfg.sliding_window keys, a "local" one the keys of its own
  cfg.local_chunk block, a "nope" one every earlier key without RoPE; with cfg.attn_sinks each
  query head's sink logit joins every softmax denominator (modeling/attention.py)."""
  positions = pos.q
  x = lay.gather_in(x)
  wq, wk, wv, wo = (use(lay, r, p[n], x.dtype) for n, r in (("wq", "attn_q"), ("wk", "attn_kv"),
                                                           ("wv", "attn_kv"), ("wo", "attn_o")))
  kv = wk.shape[1]                # KV; inside a manual shard_map (pp) the local KV heads
  # H = KV x G viewed on the weights, never on activations: a reshape of [B, S, H, Dh] would
  # drop the batch dim's sharding when B is 1 per shard (jax >= 0.11)
  wq = _split_heads(wq, "d (k g) h -> d k g h", 2, kv)                        # [D, KV, G, Dh]
  wo = _split_heads(wo, "(k g) h d -> k g h d", 1, kv)                        # [KV, G, Dh, D]
  q = jnp.einsum("bsd,dkgh->bskgh", x, wq)                                     # [B, S, KV, G, Dh]
  k = jnp.einsum("bsd,dkh->bskh", x, wk)                                       # [B, S, KV, Dh]
  v = jnp.einsum("bsd,dkh->bskh", x, wv)                                       # [B, S, KV, Dh]
  if cfg.qkv_bias:           # biases split like their weights, added in float32 (moe.add_bias)
    bias = lambda n, role: use(lay, role, p[n], x.dtype)
    q = moe_lib.add_bias(q, _split_heads(bias("bq", "attn_q_bias"), "(k g) h -> k g h", 1,
                                         kv))                                  # + [KV, G, Dh]
    k = moe_lib.add_bias(k, bias("bk", "attn_kv_bias"))                        # + [KV, Dh]
    v = moe_lib.add_bias(v, bias("bv", "attn_kv_bias"))
  if cfg.qk_norm:                                           # RMSNorm of each head, before RoPE
    q = rms_norm(q, lay.use("head_norm", p["q_norm"]), cfg.norm_eps)
    k = rms_norm(k, lay.use("head_norm", p["k_norm"]), cfg.norm_eps)
  if kind != "nope":                                        # NoPE layers: no rotation
    q = rope(q, positions, cfg, cfg.rope_interleave, cfg.rotary_dim)           # [B, S, KV, G, Dh]
    k = rope(k, positions, cfg, cfg.rope_interleave, cfg.rotary_dim)           # [B, S, KV, Dh]
    if cfg.qk_l2_norm:                                      # Llama 4: L2 norm after RoPE
      q, k = rms_norm(q, 1.0, cfg.norm_eps), rms_norm(k, 1.0, cfg.norm_eps)
  elif cfg.nope_attn_scale:                                 # Llama 4's temperature tuning
    t = 1 + cfg.nope_attn_scale * jnp.log1p(jnp.floor(
        (positions.astype(jnp.float32) + 1) / cfg.nope_floor_scale))          # [B, S]
    q = (q * t[:, :, None, None, None]).astype(q.dtype)                       # [B, S, KV, G, Dh]
  scale = softmax_scale(cfg)
  extra = {"window": cfg.window_of(kind), "local_chunk": cfg.local_chunk_of(kind)}
  if cfg.attn_sinks:                                        # [H] -> [KV, G], float32
    extra["sinks"] = _split_heads(use(lay, "attn_sinks", p["sinks"], jnp.float32),
                                  "(k g) -> k g", 1, kv)
  if lay.kv_ring:                                             # CP: K/V blocks around the ring
    o = ring_attention.ring_attend(q, (k, v), (), _kv_as_is, positions, pos.k, scale,
                                   cfg.attention_chunk, _ring_axes(k, lay, lay.kv),
                                   balanced=True, manual=bool(lay.kv_axes),
                                   **extra)                     # cp's load-balanced order
  else:
    if lay.splits_sequence:                                                    # CP: gather K/V
      k, v = _gather_kv(k, lay), _gather_kv(v, lay)                         # [B, T, KV, Dh]
    o = attention_lib.attend(q, k, v, positions, pos.k, scale, cfg.attention_impl,
                             cfg.attention_chunk, ordered=not lay.splits_sequence,
                             **extra)                                          # [B, S, KV, G, Dh]
  return jnp.einsum("bskgh,kghd->bsd", o, wo, out_sharding=lay.row)            # [B, S, D]


def softmax_scale(cfg: Config) -> float:
  """Attention's 1 / sqrt(q . k width), times mscale(factor, yarn_mscale_all_dim)^2 under YaRN
  for MLA (Hugging Face's DeepseekV3Attention; its GQA families leave the scale alone)."""
  scale = 1 / math.sqrt(cfg.qk_head_dim)
  if cfg.mla and cfg.yarn_factor and cfg.yarn_mscale_all_dim:
    scale *= yarn_mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim) ** 2
  return scale


LATENT_NORM_EPS = 1e-6   # MLA's q / kv latent RMSNorms: a constant in DeepSeek's and HF's code


def mla(p, x, pos: Positions, cfg: Config, lay: Parallelism):
  """Causal Multi-head Latent Attention (DeepSeek-V2/V3). x [B, S, D] -> [B, S, D].

    q      = x @ wq  or  rms_norm(x @ wq_a) @ wq_b            [B, S, H, nope | rope]
    c, k_r = x @ wkv_a                                        [B, S, Rkv | rope]
    k_n, v = rms_norm(c) @ wkv_b                              [B, T, H, nope | v]
    scores = (q_n . k_n + rope(q_r) . rope(k_r)) / sqrt(nope + rope): k_r is one key for all
             heads (the decoupled RoPE key), its rotation shared.
  The down-projections are token-local: they run in the residual layout (Parallelism.x), and
  what the heads read is gathered after them. lay.gather_in takes the latents: normed c_Q (or x when
  q_lora_rank = 0), normed c_KV and rotated k_r, Rq + Rkv + rope = 2,112 values per token at
  DeepSeek-V3's shape against D = 7,168 (tp, ep_tp). Parallelism.kv's gather over the sequence (CP)
  takes normed c_KV and k_r only: Rkv + rope = 576 per token, against H x (nope + v) + rope =
  32,832 for the up-projected K and V. K and V are up-projected from the gathered latent, typed
  reduced over the sequence axes (sharding.partial_einsum): their cotangents stay partial sums
  until the latent's own reduce-scatter."""
  nope, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
  w = lambda n, role: use(lay, role, p[n], x.dtype)
  positions = pos.q
  if cfg.q_lora_rank:
    cq = jnp.einsum("bsd,dr->bsr", x, w("wq_a", "attn_q_a"))                   # [B, S, Rq]
    q_in = rms_norm(cq, lay.use("q_norm", p["q_norm"]), LATENT_NORM_EPS)
  else:
    q_in = x                                                                   # [B, S, D]
  ckv = jnp.einsum("bsd,dc->bsc", x, w("wkv_a", "attn_kv_a"))                  # [B, S, Rkv + rope]
  c = rms_norm(ckv[..., :r], lay.use("kv_norm", p["kv_norm"]), LATENT_NORM_EPS)  # [B, S, Rkv]
  k_r = rope(ckv[..., r:], pos.x, cfg, cfg.rope_interleave)         # [B, S, rope]
  # one gather of all the heads read: [B, S, Rq|D + Rkv + rope] (tp: typed reduced; ep_tp: + AG)
  lat = lay.gather_in(jnp.concatenate([q_in, c, k_r], axis=-1))
  q_in, lat = lat[..., :q_in.shape[-1]], lat[..., q_in.shape[-1]:]            # lat [B, S, Rkv + rope]
  wq = w("wq_b", "attn_q_b") if cfg.q_lora_rank else w("wq", "attn_q")         # [Rq|D, H, qk]
  q = jnp.einsum("bsr,rhk->bshk", q_in, wq)                                    # [B, S, H, qk]
  q_n = q[..., :nope]                                                          # [B, S, H, nope]
  q_r = rope(q[..., nope:], positions, cfg, cfg.rope_interleave)    # [B, S, H, rope]
  wkv_b = w("wkv_b", "attn_kv_b")                                              # [Rkv, H, nope + v]
  scale = softmax_scale(cfg)
  # every head its own KV head (KV = H, G = 1), and the one shared RoPE key
  q_n, q_r = q_n[:, :, :, None], q_r[:, :, :, None]                            # [B, S, H, 1, .]
  spec = None if lay.kv is None else P(*tuple(lay.kv)[:2], None)   # the gathered latent's
  if lay.kv_ring:                                      # CP: latent blocks around the ring
    expand = functools.partial(_mla_expand, r=r, nope=nope)
    o = ring_attention.ring_attend(q_n, lat, (wkv_b,), expand, positions, pos.k, scale,
                                   cfg.attention_chunk, _ring_axes(lat, lay, spec), q_r=q_r,
                                   balanced=True, manual=bool(lay.kv_axes))    # [B, S, H, 1, v]
  else:
    if lay.kv_axes:                                    # manual CP: gather the latent
      lat = _gather_kv(lat, lay)                                               # [B, T, Rkv + rope]
    if lay.kv is None:                                 # (manual: each rank's own partial dK/dV)
      kv = jnp.einsum("btr,rhk->bthk", lat[..., :r], wkv_b)                    # [B, T, H, nope + v]
    else:                                              # CP: gather the latent, not K and V
      gathered = _kv_gather_axes(lat, spec)          # K/V stay partial sums over these
      lat = _gather_kv(lat, lay, spec)                                         # [B, T, Rkv + rope]
      kv = sharding.partial_einsum("btr,rhk->bthk", lat[..., :r], wkv_b, gathered)
    o = attention_lib.attend(q_n, kv[..., :nope], kv[..., nope:], positions, pos.k, scale,
                             cfg.attention_impl, cfg.attention_chunk, q_r=q_r,
                             k_r=lat[..., r:], ordered=not lay.splits_sequence)  # [B, S, H, 1, v]
  return jnp.einsum("bshv,hvd->bsd", o[:, :, :, 0], w("wo", "attn_o"),
                    out_sharding=lay.row)                                      # [B, S, D]


def swiglu(p, x, lay: Parallelism, roles=("shared_in", "shared_out"), gate=None):
  """Dense SwiGLU FFN (the shared expert, a dense layer's FFN). x [B, S, D] -> [B, S, D]. gate
  [B, S, 1] (shared_gate) scales the hidden activation, before the row-parallel wo: the same
  product as scaling the output, which under tensor parallelism is still a partial sum."""
  r_in, r_out = roles
  w0, w1, wo = (use(lay, r, p[n], x.dtype) for n, r in (("wi_0", r_in), ("wi_1", r_in),
                                                       ("wo", r_out)))
  h = jax.nn.silu(jnp.einsum("bsd,df->bsf", x, w0)) * jnp.einsum("bsd,df->bsf", x, w1)  # [B, S, F]
  if gate is not None:                         # [B, S, 1] to the hidden's batch and sequence
    h = h * (lay.gather_in(gate) if lay.x is None else      # manual (pp): gathered as h was
             jax.reshard(gate, P(*jax.typeof(h).sharding.spec.partitions[:2], None)))
  return jnp.einsum("bsf,fd->bsd", h, wo, out_sharding=lay.row)


def shared_gate(p, h, lay: Parallelism):
  """The shared expert's gate sigmoid(h @ wg) [B, S, 1] (Qwen2-MoE), of h the normed residual in
  its own layout (token-local: no exchange; the caller reshards the [B, S] gate to where the
  shared expert's hidden activation is); None without a gate."""
  if "wg" not in p:
    return None
  g = jnp.einsum("bsd,d->bs", h, use(lay, "shared_gate", p["wg"], h.dtype),
                 out_sharding=None if lay.x is None else P(*tuple(lay.x)[:2]))  # [B, S]
  return jax.nn.sigmoid(g.astype(jnp.float32)).astype(h.dtype)[..., None]      # [B, S, 1]


def block(x, lp, pos: Positions, cfg: Config, lay: Parallelism, kind: str = "full"):
  """One decoder layer. x [B, S, D], lp: one layer's params -> (x [B, S, D], its router stats);
  a dense layer (lp has "mlp", no "moe") returns no stats. kind: its attention kind."""
  h = rms_norm(x, lay.use("attn_norm", lp["attn_norm"]), cfg.norm_eps)      # residual layout
  x = x + lay.scatter_out(attention(lp["attn"], h, pos, cfg, lay, kind))
  if "bo" in lp["attn"]:                      # the output bias, once, on the reduced output
    x = moe_lib.add_bias(x, use(lay, "attn_o_bias", lp["attn"]["bo"], x.dtype))      # [D]
  h = rms_norm(x, lay.use("mlp_norm", lp["mlp_norm"]), cfg.norm_eps)      # residual layout
  if "mlp" in lp:                                                   # a leading dense layer
    return x + lay.scatter_out(swiglu(lp["mlp"], lay.gather_in(h), lay,
                                      ("dense_in", "dense_out"))), None
  if lay.moe_in_residual:                      # the MoE in the residual layout, the shared alone
    y, stats = lay.moe(lp["moe"], h, pos.x)
    if "shared" in lp:
      y = y + lay.scatter_out(swiglu(lp["shared"], lay.gather_in(h), lay,
                                     gate=shared_gate(lp["shared"], h, lay)))
    return x + y, stats
  gate = shared_gate(lp["shared"], h, lay) if "shared" in lp else None
  h = lay.gather_in(h)
  y, stats = lay.moe(lp["moe"], h, pos.q)
  if "shared" in lp:
    y = y + swiglu(lp["shared"], h, lay, gate=gate)
  return x + lay.scatter_out(y), stats


def remat(body, cfg: Config):
  """--remat: the scanned layer body under jax.checkpoint (recomputed inside the backward of each
  scan step, keeping what the policy saves), or as it is for "none"."""
  if cfg.remat == "none":
    return body
  policy = None if cfg.remat == "block" else getattr(jax.checkpoint_policies, cfg.remat)
  return jax.checkpoint(body, policy=policy, prevent_cse=False)


def dense_prefix(x, params, positions, cfg: Config, lay: Parallelism):
  """The leading dense layers (none unless cfg.first_k_dense_replace; a model with dense layers
  inside the stack runs whole through `run_layers`): x [B, S, D] -> [B, S, D]. positions: [B, S]
  or their Positions."""
  if not cfg.first_k_dense_replace:
    return x
  pos = layer_positions(positions, lay)                  # once, outside the scan and its remat
  return run_layers(x, params["dense_layers"], None, pos, cfg, lay,
                    cfg.layer_kinds[:cfg.first_k_dense_replace])[0]


def slot_mask(cfg: Config):
  """[n_layer_slots] bool: the MoE stack's rows that hold a layer (layer_layout's padding rows
  are inert), or None when the stack has no padding."""
  slots = np.asarray(cfg.layer_slots)
  return None if (slots >= 0).all() else slots >= 0


def moe_stack(x, layers, positions, cfg: Config, lay: Parallelism, mask=None, dense=None,
              kinds=None):
  """x [B, S, D] through a stack of MoE layers (stacked params `layers`, one `block` scanned)
  -> (x, router stats {name: [rows, ...]}). mask [rows] bool (default: slot_mask(cfg), for the
  whole stack): a False row is a padding slot, its block computed and discarded (x passes
  through unchanged, its stats are zeros, its parameters get zero gradients). positions: [B, S]
  or their Positions. Row i has attention kind cfg.layer_attentions[(first_k_dense_replace + i)
  % period], the stack's rows in depth order from its first MoE layer; kinds [rows] int32 (a
  traced value: a pp stage's chunk that starts inside a period) gives each row's kind as an
  index into cfg.layer_attentions instead. Either runs as `switched_rows` (one scan, each row's
  kind data) where kinds is given or padding rows lie among rows of different kinds (the runs
  of one period that run_layers scans carry no mask). dense: the dense rows [n, ...] of
  a stack with dense layers inside, interleaved with the MoE rows as the model's one repeated
  period orders them (a pp stage of whole periods, pp.check), or, with kinds [layers] (each of
  the stage's layers' attention kind, in depth order), as `switched_periods` runs them."""
  mask = slot_mask(cfg) if mask is None else mask
  pos = layer_positions(positions, lay)                  # once, outside the scan and its remat
  rows = jax.tree.leaves(layers)[0].shape[0]
  if dense is not None and kinds is not None:
    return switched_periods(x, dense, layers, pos, cfg, lay, kinds)
  if dense is not None:
    period = cfg.layer_segments[0][0]
    n = rows + jax.tree.leaves(dense)[0].shape[0]
    return run_layers(x, dense, layers, pos, cfg, lay, period * (n // len(period)), mask)
  names, first = cfg.layer_attentions, cfg.first_k_dense_replace
  static = [(first + i) % len(names) for i in range(rows)]
  if kinds is None and mask is not None and len(set(static)) > 1:
    kinds = np.asarray(static, np.int32)     # padding rows among layers of different kinds
  if kinds is not None:
    return switched_rows(x, layers, pos, cfg, lay, kinds, mask)
  return run_layers(x, None, layers, pos, cfg, lay,
                    tuple((names[k], True) for k in static), mask)


def switched_rows(x, layers, pos: Positions, cfg: Config, lay: Parallelism, kinds, mask=None):
  """x [B, S, D] through MoE rows whose attention kinds are data: kinds [rows] int32, an index
  into cfg.layer_attentions per row (a pp stage's chunk that starts inside a period, so that
  stages running one program hold rows of different kinds) -> (x, stats {name: [rows, ...]}).
  One scan over the rows; its step is a lax.switch over the period's kinds, one `block` under
  remat in each branch, of which a device runs the one its row names. Each branch is scoped
  `attention_<kind>.taken_<c>_of_<n>` (measure/hlo.py: TAKEN), c of the model's n MoE layers
  being at that branch's index in the period: the branches' collectives are alike (a kind
  changes the mask, not what is exchanged: pp.check refuses the ring, whose exchange a window
  shortens), so the program's collectives count once per row. mask [rows] bool as in
  moe_stack, or None."""
  names = cfg.layer_attentions
  moe_at = _period_indices(cfg)[True]
  branches = [_taken(_layer_body(k, pos, cfg, lay), "attention", k, j, moe_at)
              for j, k in enumerate(names)]

  def step(x, xs):
    lp, kind, real = xs
    y, st = jax.lax.switch(kind, branches, x, lp)
    if real is None:
      return y, st
    return jnp.where(real, y, x), jax.tree.map(lambda v: jnp.where(real, v, 0).astype(v.dtype), st)
  real = None if mask is None else jnp.asarray(mask)
  return jax.lax.scan(step, x, (layers, jnp.asarray(kinds, jnp.int32), real))


def _period_indices(cfg: Config) -> dict:
  """{is_moe: each dense (False) or MoE (True) layer's index into cfg.layer_attentions}: the
  branch a switched layer takes (a pattern may name a kind more than once: Llama 4's local,
  local, local, nope)."""
  period = len(cfg.layer_attentions)
  return {m: [d % period for d, moe in enumerate(cfg.layer_is_moe) if moe == m]
          for m in (False, True)}


def _stack_kinds(cfg: Config) -> dict:
  """{is_moe: the attention kinds the dense (False) or MoE (True) layers take}."""
  names = cfg.layer_attentions
  return {m: {names[j] for j in at} for m, at in _period_indices(cfg).items()}


def switches(cfg: Config, is_moe: bool | None = None) -> bool:
  """Whether switched_periods runs a lax.switch: a stack whose layers take more than one
  attention kind (Maverick's MoE layers, local and NoPE); is_moe: that stack's (True: the MoE
  layers', False: the dense layers'), None: either."""
  kinds = _stack_kinds(cfg)
  return any(len(kinds[m]) > 1 for m in ((False, True) if is_moe is None else (is_moe,)))


def _taken(body, prefix: str, name: str, j: int, at: list):
  """A switch branch: body scoped `<prefix>_<name>.taken_<c>_of_<n>` (measure/hlo.py: TAKEN),
  c of the n layers whose period indices are `at` being at index j."""
  share = f"{prefix}_{name}.taken_{at.count(j)}_of_{len(at)}"

  def branch(x, lp):
    with jax.named_scope(share):
      return body(x, lp)
  return branch


def switched_periods(x, dense, moe, pos: Positions, cfg: Config, lay: Parallelism, kinds):
  """x [B, S, D] through a pp stage's dense layers [n_dense, ...] and MoE layers [n_moe, ...] in
  turn, whole periods of their dense/MoE pattern (config.mlp_period: Maverick's dense, MoE),
  whose attention kinds are data: kinds [layers] int32, each layer's index into
  cfg.layer_attentions in depth order (a stage that starts inside the attention period) -> (x,
  the MoE layers' stats {name: [n_moe, ...]}). One scan over the periods; a layer of a stack
  whose layers take more than one kind in the model is a lax.switch over the kinds, one
  `block` under remat in each branch, scoped as switched_rows scopes them (the dense stack's
  `dense_attention_<kind>.taken_<c>_of_<n>`); a stack of one kind runs its block."""
  names = cfg.layer_attentions
  unit = cfg.layer_is_moe[:cfg.mlp_period]                        # one scan step's MLP kinds
  reps = len(kinds) // len(unit)
  counts = {m: unit.count(m) for m in (False, True)}
  at, used = _period_indices(cfg), _stack_kinds(cfg)      # per stack: each layer's branch, kinds
  # a stack with one layer a period is scanned as stored, [reps, ...] (pp's 1f1b keeps the
  # weights its vjp saves once, by identity: a reshaped view would be saved per microbatch)
  xs = {m: stack if counts[m] == 1 else
        jax.tree.map(lambda a: a.reshape(reps, counts[m], *a.shape[1:]), stack)
        for m, stack in ((False, dense), (True, moe)) if counts[m]}   # [reps, per period, ...]

  def layer(i, is_moe):                   # position i of the period: (x, rows, kind) -> (x, st)
    row = None if counts[is_moe] == 1 else unit[:i].count(is_moe)
    if len(used[is_moe]) == 1:
      body = _layer_body(next(iter(used[is_moe])), pos, cfg, lay, row)
      return lambda x, lp, kind: body(x, lp)
    prefix = "attention" if is_moe else "dense_attention"
    # a branch at an index no layer of the stack has is never run (taken_0_of_n)
    branches = [_taken(_layer_body(k, pos, cfg, lay, row), prefix, k, j, at[is_moe])
                for j, k in enumerate(names)]
    return lambda x, lp, kind: jax.lax.switch(kind, branches, x, lp)
  layers = [layer(i, m) for i, m in enumerate(unit)]

  def step(x, xs_kinds):
    rows, k = xs_kinds
    stats = []
    for i, (run, is_moe) in enumerate(zip(layers, unit)):
      x, st = run(x, rows[is_moe], k[i])
      if is_moe:
        stats.append(st)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *stats)
  k = jnp.asarray(kinds, jnp.int32).reshape(reps, len(unit))
  x, st = jax.lax.scan(step, x, (xs, k))
  return x, jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), st)


def run_layers(x, dense, moe, pos: Positions, cfg: Config, lay: Parallelism, kinds, mask=None):
  """x [B, S, D] through layers of `kinds` ((attention kind, MoE?) per layer, in depth order),
  reading the dense ones' params from the stack `dense` [n_dense, ...] and the MoE ones' from
  `moe` [n_moe, ...] in turn -> (x, the MoE layers' router stats {name: [n_moe, ...]}).

  The layers are cut into runs of a repeated period (config.segments): each run is one lax.scan
  whose step is one period, each layer of it under its own remat, so compile time follows the
  runs, not the depth. A run's rows of each stack are viewed as [repeats, per period, ...] (the
  layer dim is never sharded where a model has more than one run or a period longer than 1).
  mask [n_moe] bool: moe_stack's padding rows (a single MoE run), or None."""
  xs_of = {False: dense, True: moe}
  at = {False: 0, True: 0}                               # rows of each stack taken so far
  stats = []
  for period, reps in segments(tuple(kinds)):
    counts = {m: sum(1 for _, k in period if k == m) for m in (False, True)}
    xs = {}
    for m, n in counts.items():
      if n:
        stack, lo = xs_of[m], at[m]
        whole = lo == 0 and jax.tree.leaves(stack)[0].shape[0] == n * reps
        xs[m] = stack if whole else jax.tree.map(lambda a: a[lo:lo + n * reps], stack)
        at[m] += n * reps                                               # xs: [reps * n, ...]
    if len(period) == 1:                                  # a run of one kind: [reps, ...] rows
      kind, is_moe = period[0]
      body, xs = _layer_body(kind, pos, cfg, lay), xs[is_moe]
    else:                                                 # [reps, n, ...]: one period per step
      body = _period_body(period, pos, cfg, lay)
      xs = {m: jax.tree.map(lambda a: a.reshape(reps, counts[m], *a.shape[1:]), v)
            for m, v in xs.items()}
    if mask is not None:
      assert len(period) == 1 and period[0][1], "padding rows come with a pure MoE stack"

      def masked(x, xs_real, body=body):
        lp, real = xs_real
        y, st = body(x, lp)
        return jnp.where(real, y, x), jax.tree.map(
            lambda v: jnp.where(real, v, 0).astype(v.dtype), st)
      x, st = jax.lax.scan(masked, x, (xs, jnp.asarray(mask)))
    else:
      x, st = jax.lax.scan(body, x, xs)
    if counts[True] and len(period) > 1:                  # [reps, n_moe, ...] -> [rows, ...]
      st = jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), st)
    if counts[True]:
      stats.append(st)
  return x, (None if not stats else stats[0] if len(stats) == 1 else
             jax.tree.map(lambda *a: jnp.concatenate(a), *stats))          # [n_moe, ...]


def _layer_body(kind: str, pos: Positions, cfg: Config, lay: Parallelism, row=None):
  """One layer of attention kind `kind` under remat: (x, its params) -> (x, its stats). row: the
  params come as a period's rows [n, ...] and the layer's is row `row`, taken inside the remat:
  taken outside it, XLA:CPU and XLA:GPU hold the step's float32 gradient of the stack twice
  (`tests/test_layer_kinds.py: test_period_scan_holds_its_gradient_once`)."""
  def one(x, lp):
    if row is not None:
      lp = jax.tree.map(lambda a: a[row], lp)
    return block(x, lp, pos, cfg, lay, kind)
  return remat(one, cfg)


def _period_body(period, pos: Positions, cfg: Config, lay: Parallelism):
  """One scan step over a period's layers: (x, {False: dense rows [n, ...], True: MoE rows [n,
  ...]}) -> (x, the MoE layers' stats {name: [n_moe in the period, ...]}), each layer under its
  own remat."""
  rows = [sum(1 for _, m in period[:i] if m == is_moe) for i, (_, is_moe) in enumerate(period)]
  bodies = [_layer_body(kind, pos, cfg, lay, row) for (kind, _), row in zip(period, rows)]

  def step(x, xs):
    stats = []
    for body, (_, is_moe) in zip(bodies, period):
      x, st = body(x, xs[is_moe])
      if is_moe:
        stats.append(st)
    return x, (None if not stats else jax.tree.map(lambda *a: jnp.stack(a), *stats))
  return step


def forward(params, batch, cfg: Config, lay: Parallelism):
  """-> (logits [B, S, V], router stats {name: [L_moe, ...]}). The layers run as runs of a
  repeated period (`run_layers`), one `block` per layer of the period, scanned over the run's
  stacked params: compile time does not grow with depth."""
  tokens = batch["tokens"]
  positions = layer_positions(batch["positions"], lay)     # each layout's, once per step
  params = lay.params(params)
  embed = use(lay, "embed", params["embed"], cfg.dtype)
  x = embed.at[tokens].get(out_sharding=lay.x)                                 # [B, S, D] cfg.dtype
  order, real = cfg.layer_order, slot_mask(cfg)
  if order is None and real is None:
    x, stats = run_layers(x, params.get("dense_layers"), params["layers"], positions, cfg, lay,
                          cfg.layer_kinds)
    return head(x, params, cfg, lay), stats                                      # [B, S, V]
  # pp's stored stack (padding rows, stages' round-robin rows) run whole: the prefix, then the
  # MoE rows in depth order
  x = dense_prefix(x, params, positions, cfg, lay)
  if order is None:
    x, stats = moe_stack(x, params["layers"], positions, cfg, lay)             # padding rows
  else:
    order = np.asarray(order)
    layers = jax.tree.map(lambda a: a[order], params["layers"])
    dense = None if not cfg.dense_inside else params["dense_layers"]
    if cfg.dense_order is not None:                                # its dense rows in depth order
      dense = jax.tree.map(lambda a: a[np.asarray(cfg.dense_order)], dense)
    x, stats = moe_stack(x, layers, positions, cfg, lay, None if real is None else real[order],
                         dense)
    stats = jax.tree.map(lambda a: a[np.argsort(order)], stats)                # stored row order
  return head(x, params, cfg, lay), stats                                        # [B, S, V]


def head(x, params, cfg: Config, lay: Parallelism):
  """The final RMSNorm and the unembedding: x [.., D] -> logits [.., V] in x's dtype."""
  x = rms_norm(x, lay.use("final_norm", params["final_norm"]), cfg.norm_eps)
  return jnp.einsum("...d,dv->...v", x, use(lay, "unembed", params["unembed"], x.dtype))


def cross_entropy(logits, targets):
  """Next-token cross-entropy per token, in float32: logits [.., V], targets [..] -> [..]."""
  logits = logits.astype(jnp.float32)
  tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - tgt


def loss_total(ce, aux, z, cfg: Config) -> tuple:
  """The step's loss from its summed terms, ce + aux_loss_coef * aux + z_loss_coef * z, and its
  metrics {loss, ce_loss, aux_loss, z_loss} (the caller adds "dropped" and "counts")."""
  loss = ce + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
  return loss, {"loss": loss, "ce_loss": ce, "aux_loss": aux, "z_loss": z}


def loss_fn(params, batch, cfg: Config, lay: Parallelism, counts=None, n_tokens=None):
  """-> (loss, metrics). Mean next-token CE over all tokens + aux_coef*aux + z_coef*z.

  One microbatch of a step (runtime.train, gradient accumulation): n_tokens is the step's tokens
  and counts [L, E] the WHOLE step's router counts (f of the batch-wise aux loss, pass 1; None
  for the sequence-wise loss, complete within each microbatch); CE, P, the sequence-wise sums
  and z are this microbatch's over n_tokens, so the microbatch losses sum to the step's loss."""
  logits, stats = forward(params, batch, cfg, lay)
  nll = cross_entropy(logits, batch["targets"])                                # [B, S]
  if n_tokens is None:
    ce = jnp.mean(nll)
    n_tokens = batch["tokens"].shape[0] * batch["tokens"].shape[1]
    aux, z = routing.aux_losses(stats, n_tokens, cfg)                          # [L] each
  else:
    ce = jnp.sum(nll) / n_tokens
    aux, z = routing.aux_losses(stats if counts is None else {**stats, "counts": counts},
                                n_tokens, cfg)
  loss, metrics = loss_total(ce, jnp.sum(aux), jnp.sum(z), cfg)
  return loss, {**metrics, "dropped": jnp.sum(stats["dropped"]),
                "counts": stats["counts"]}                                     # counts [L, E]


def reference_layout(cfg: Config) -> Parallelism:
  """Single device, no shardings, dense MoE oracle."""
  return Parallelism(moe=lambda p, x, pos: moe_lib.moe_dense(p, x, pos, cfg))
