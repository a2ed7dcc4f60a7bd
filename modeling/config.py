"""Model and run configuration: one frozen dataclass and named presets."""
from __future__ import annotations

import dataclasses
import functools
import math
import os


class ConfigError(ValueError):
  """A bad flag or config value; run.py prints it as a one-line error."""


# --remat: what the backward keeps of each layer's block (the rest is recomputed)
REMAT_POLICIES = ("none",                # everything the autodiff saves (no jax.checkpoint)
                  "block",               # nothing but the block's input: recompute the layer
                  "dots_saveable",       # matmul outputs kept, elementwise work recomputed
                  "dots_with_no_batch_dims_saveable")  # only weight matmuls (no batch dims)


# --dtype: compute dtype (activations, weights at use, exchanges); params and optimizer state
# stay float32 (the master copy). --grad_reduce_dtype: the dtype weight gradients are summed
# across devices in (float32 unless asked: see parallel/sharding.py gather_weight)
DTYPES = ("float32", "bfloat16")

# --aux_loss_kind: the load-balance loss's statistics (modeling/routing.py)
AUX_LOSS_KINDS = ("batch",        # f and P over the whole step's tokens (Switch, Mixtral)
                  "sequence")     # per sequence, averaged over sequences (DeepSeek-V3's
                                  # complementary sequence-wise balance loss)
# what picks each token's experts (modeling/routing.py, "expert choice")
EXPERT_CHOICES = ("router",       # the top-k of the router's scores
                  "position")     # the same top-k of a hash of the token's position: the choice
                                  # every layout makes alike (--full_parity in bfloat16)
ATTENTIONS = ("gqa", "mla")
LAYER_ATTENTIONS = ("full",      # causal attention over every earlier key
                    "sliding",   # the last sliding_window keys only (gpt-oss)
                    "local",     # the keys of the query's own local_chunk block only (Llama 4)
                    "nope")      # every earlier key, no RoPE (Llama 4's NoPE layers)
GROUP_SCORES = ("top2", "max")    # group-limited routing's group score (modeling/routing.py)
# --attention: how the softmax(q k^T) v core runs (modeling/attention.py)
ATTENTION_IMPLS = ("xla",         # the [B, H, S, T] scores materialised: the oracle
                   "chunked",     # online softmax over key chunks: memory linear in S
                   "cudnn")       # jax.nn.dot_product_attention's cuDNN kernel (GPU, GQA)


def _model(default):
  """A field of the model itself: a checkpoint restores only into the same values."""
  return dataclasses.field(default=default, metadata={"group": "model"})


def _run(default):
  """A field of the run (data, optimizer, precision): may change between runs of one model."""
  return dataclasses.field(default=default, metadata={"group": "run"})


def _plain(default):
  """How the step computes, not what: the same losses and gradients for any value (gradient
  accumulation, recompute, the grouped-matmul backend). The reference runs at the defaults."""
  return dataclasses.field(default=default, metadata={"group": "plain"})


@dataclasses.dataclass(frozen=True)
class Config:
  """The model and the run. A strategy's own knobs are its Options (strategies/NAME.py)."""
  vocab: int = _model(256)
  d_model: int = _model(64)
  n_heads: int = _model(4)
  n_kv_heads: int = _model(2)
  head_dim: int = _model(16)
  n_layers: int = _model(2)              # all decoder layers: first_k_dense_replace dense, then MoE
  n_experts: int = _model(8)
  top_k: int = _model(2)
  d_ff: int = _model(128)                # F, per routed expert
  n_shared_experts: int = _model(0)      # shared experts are fused into one SwiGLU of width n_shared * d_ff
  router: str = _model("softmax")        # "softmax" (Mixtral) | "sigmoid" (DeepSeek-V3)
  norm_topk_prob: bool = _model(True)    # renormalise the top-k weights to sum 1
  n_group: int = _model(1)               # group-limited routing (sigmoid router)
  topk_group: int = _model(1)
  routed_scaling_factor: float = _model(1.0)
  # group-limited routing's group score: "top2" the sum of the group's two best biased scores
  # (DeepSeek-V3, GLM-4.5: noaux_tc), "max" its best score (DeepSeek-V2: group_limited_greedy)
  group_score: str = _model("top2")
  rope_theta: float = _model(10000.0)
  # RoPE on the first rotary_dim dims of each GQA head only, the rest passing through (GLM-4.5's
  # partial_rotary_factor); 0 = the whole head
  rotary_dim: int = _model(0)
  # YaRN RoPE scaling (DeepSeek-V3's and Kimi-K2's released configs), as transformers applies it:
  # yarn_factor 0 = unscaled; else the frequencies interpolated between yarn_beta_fast and
  # yarn_beta_slow rotations over yarn_original_max positions, cos / sin scaled by
  # mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim), and MLA's softmax scale by
  # mscale(factor, yarn_mscale_all_dim)^2 (modeling/model.py rope_frequencies, softmax_scale)
  yarn_factor: float = _model(0.0)
  yarn_original_max: int = _model(0)
  yarn_beta_fast: float = _model(32.0)
  yarn_beta_slow: float = _model(1.0)
  yarn_mscale: float = _model(1.0)
  yarn_mscale_all_dim: float = _model(0.0)
  yarn_truncate: bool = _model(True)     # the ramp's bounds floored / ceiled (False: gpt-oss)
  norm_eps: float = _model(1e-6)
  # GQA extras: biases on the q, k and v projections (Qwen2-MoE, GLM-4.5), and an RMSNorm of
  # each q and k head (weight [Dh], eps norm_eps) before RoPE (Qwen3-MoE, GLM-4.5)
  qkv_bias: bool = _model(False)
  qk_norm: bool = _model(False)
  # the shared expert's width when it is not n_shared_experts x d_ff (Qwen2-MoE's
  # shared_expert_intermediate_size); 0: n_shared_experts x d_ff
  shared_width: int = _model(0)
  # the shared expert's output scaled by sigmoid(h @ w_gate), one scalar per token (Qwen2-MoE)
  shared_gate: bool = _model(False)
  # gpt-oss: each layer's attention kind (LAYER_ATTENTIONS), a period repeated over depth
  # ("sliding,full": even layers slide, odd ones see everything; "" = every layer full), the
  # sliding layers' window in keys, a learned sink logit per query head in every softmax
  # denominator, and a bias on the attention's output projection
  attention_pattern: str = _model("")
  sliding_window: int = _model(0)
  attn_sinks: bool = _model(False)
  attn_o_bias: bool = _model(False)
  # Llama 4: the "local" layers' block of keys (attention_chunk_size), an L2 norm (an RMSNorm
  # without weight, eps norm_eps) of each q and k head after RoPE on the RoPE layers
  # (use_qk_norm), and on the "nope" layers queries scaled by
  # 1 + nope_attn_scale * log1p(floor((position + 1) / nope_floor_scale)) (attn_temperature_tuning;
  # nope_attn_scale 0 = off)
  local_chunk: int = _model(0)
  qk_l2_norm: bool = _model(False)
  nope_attn_scale: float = _model(0.0)
  nope_floor_scale: float = _model(8192.0)
  # Llama 3's RoPE scaling (rope_type "llama3"): frequencies with wavelength past
  # original / low_freq_factor divided by the factor, those under original / high_freq_factor
  # kept, a smooth blend between; 0 = off
  llama3_factor: float = _model(0.0)
  llama3_low_freq_factor: float = _model(1.0)
  llama3_high_freq_factor: float = _model(4.0)
  llama3_original_max: int = _model(0)
  # gpt-oss's MoE: a trained bias on the router logits (router_bias), biases on every expert's
  # gate / up ([E, F] each) and down ([E, D]) projections (expert_bias), and the clamped SwiGLU
  # when swiglu_limit > 0: g = min(gate, limit), u = clip(up, -limit, limit),
  # h = (u + 1) * g * sigmoid(swiglu_alpha * g)  (0: h = silu(gate) * up)
  router_bias: bool = _model(False)
  expert_bias: bool = _model(False)
  swiglu_limit: float = _model(0.0)
  swiglu_alpha: float = _model(1.702)
  # Llama 4: the routing score scales the expert's input, y = sum_k FFN_k(w_k x), rather than
  # its output (top_k 1 only: every layout then scales the token before it leaves)
  route_scale_input: bool = _model(False)
  # attention: "gqa" (Mixtral: n_kv_heads K/V heads of head_dim) or "mla" (DeepSeek's Multi-head
  # Latent Attention, Hugging Face DeepseekV3's conventions; head_dim and n_kv_heads unused)
  attention: str = _model("gqa")
  q_lora_rank: int = _model(0)           # MLA query down-projection rank (0 = direct, as V2-Lite)
  kv_lora_rank: int = _model(0)          # MLA latent c_KV width
  qk_nope_head_dim: int = _model(0)      # per-head q/k dims without RoPE
  qk_rope_head_dim: int = _model(0)      # q/k RoPE dims (the key's part is shared by all heads)
  v_head_dim: int = _model(0)            # per-head value dim (!= the q/k dim: never padded)
  rope_interleave: bool = _model(False)  # RoPE on (x0, x1), (x2, x3).. pairs (HF DeepseekV3)
  # leading dense layers (DeepSeek): the first first_k_dense_replace layers have a dense SwiGLU
  # FFN of width dense_d_ff instead of the MoE (Hugging Face's first_k_dense_replace and
  # intermediate_size)
  first_k_dense_replace: int = _model(0)
  dense_d_ff: int = _model(0)
  # dense layers inside the stack (Qwen-MoE's mlp_only_layers and decoder_sparse_step, Llama 4's
  # interleave_moe_layer_step): their depth indices, comma-separated, each >= first_k_dense_replace;
  # they have the dense SwiGLU of width dense_d_ff, as the prefix's
  mlp_only_layers: str = _model("")
  # the MoE layer stack in groups ("4,4,3": MoE layers per group, in depth order; "" = one group
  # of all of them): each group padded to the largest with inert slots, so that pp's stages can
  # hold different numbers of layers (strategies/pp.py; layer_slots below)
  layer_layout: str = _model("")
  # the layout's groups stored round-robin over this many stages: stage s holds groups s, s+P,
  # s+2P, .. (pp's interleaved schedule, Megatron's virtual-pipeline placement; the rows leave
  # depth order and `layer_order` puts them back for a model run whole); 0: in depth order
  layer_stages: int = _model(0)
  # losses / balancing
  aux_loss_coef: float = _run(0.01)
  attention_impl: str = _run("chunked")  # ATTENTION_IMPLS
  attention_chunk: int = _run(512)       # keys per chunk of attention_impl="chunked"
  aux_loss_kind: str = _run("batch")     # AUX_LOSS_KINDS: statistics over the batch or per sequence
  z_loss_coef: float = _run(0.0)
  bias_update_rate: float = _run(0.0)    # gamma of the aux-loss-free bias update (0 = off)
  capacity_factor: float = _run(0.0)     # 0 = dropless
  expert_choice: str = _run("router")    # EXPERT_CHOICES
  # run
  seq_len: int = _run(32)
  batch: int = _run(8)
  lr: float = _run(3e-3)
  weight_decay: float = _run(0.0)
  adam_eps: float = _run(1e-8)
  optimizer: str = _run("adamw")
  seed: int = _run(0)
  data: str = _run("")                   # a token file (runtime/data.py); "" = the synthetic chain
  dtype: str = _run("float32")           # compute dtype: DTYPES (mixed precision: modeling/model.py)
  grad_reduce_dtype: str = _run("float32")   # weight-gradient reductions under dtype=bfloat16
  # how the step computes (the same math for every value)
  gmm_backend: str = _plain("ragged_dot")
  microbatches: int = _plain(1)          # M microbatches per step, one optimizer update: gradient
                                         # accumulation (runtime/train.py); pp: the pipeline's microbatches
  remat: str = _plain("none")            # jax.checkpoint of each layer's block: see REMAT_POLICIES

  @property
  def shared_d_ff(self) -> int:
    """The fused shared experts' SwiGLU width: shared_width, else n_shared_experts x d_ff."""
    return self.shared_width or self.n_shared_experts * self.d_ff

  @property
  def dense_inside(self) -> tuple[int, ...]:
    """The depth indices of the dense layers after the prefix (mlp_only_layers)."""
    return tuple(int(i) for i in self.mlp_only_layers.split(",")) if self.mlp_only_layers else ()

  @property
  def layer_is_moe(self) -> tuple[bool, ...]:
    """Per layer in depth order: an MoE layer (True) or a dense one (the prefix, mlp_only_layers)."""
    inside = set(self.dense_inside)
    return tuple(i >= self.first_k_dense_replace and i not in inside for i in range(self.n_layers))

  @property
  def n_dense_layers(self) -> int:
    return self.n_layers - self.n_moe_layers

  @property
  def n_moe_layers(self) -> int:
    return sum(self.layer_is_moe)

  @property
  def mlp_period(self) -> int:
    """The shortest period of the dense/MoE pattern of the layers after the prefix (layer_is_moe):
    2 for Llama 4 Maverick's dense and MoE layers in turn, 1 for a stack of one kind; their
    number where the pattern does not repeat."""
    moe = self.layer_is_moe[self.first_k_dense_replace:]
    return next(q for q in range(1, len(moe) + 1)
                if len(moe) % q == 0 and moe == moe[:q] * (len(moe) // q))

  @property
  def layer_kinds(self) -> tuple[tuple[str, bool], ...]:
    """Per layer in depth order: (its attention kind, whether it is an MoE layer)."""
    kinds = self.layer_attentions
    return tuple((kinds[i % len(kinds)], moe) for i, moe in enumerate(self.layer_is_moe))

  @property
  def layer_segments(self) -> tuple[tuple[tuple[tuple[str, bool], ...], int], ...]:
    """The layers in depth order as runs of a repeated period: ((period's layer_kinds, repeats),
    ..); each run is one scan over its repeats (model.run_layers), so compile time follows the
    number of runs, not the depth. DeepSeek-V3: ((dense,) x 3), ((moe,) x 58); gpt-oss: one run
    of its (sliding, full) period; Llama 4 Maverick: one run of (dense, MoE, dense, MoE NoPE)."""
    return segments(self.layer_kinds)

  @property
  def layer_groups(self) -> tuple[int, ...]:
    """MoE layers per group of the stack (layer_layout), (n_moe_layers,) when unset."""
    if not self.layer_layout:
      return (self.n_moe_layers,)
    return tuple(int(c) for c in self.layer_layout.split(","))

  @property
  def n_layer_slots(self) -> int:
    """Rows of the stored MoE stack: groups x the largest group (= n_moe_layers when unset)."""
    return len(self.layer_groups) * max(self.layer_groups)

  @property
  def group_order(self) -> tuple[int, ...]:
    """The layout's groups in the order the stacks store them: depth order, or round-robin over
    layer_stages stages (stage-major: stage s's groups s, s+P, ..)."""
    groups = len(self.layer_groups)
    p = self.layer_stages or groups
    return tuple(g for s in range(p) for g in range(s, groups, p))

  @property
  def layer_slots(self) -> tuple[int, ...]:
    """For each row of the stored MoE stack, the MoE layer it holds, or -1 for an inert padding
    row: group g's layers fill its first rows, padding its last ones; the groups in
    group_order."""
    groups, most, depth, rows = self.layer_groups, max(self.layer_groups), 0, []
    for count in groups:
      rows.append(list(range(depth, depth + count)) + [-1] * (most - count))
      depth += count
    return tuple(r for g in self.group_order for r in rows[g])

  @property
  def dense_slots(self) -> tuple[int, ...]:
    """For each row of the stored stack of dense layers inside the MoE stack (mlp_only_layers),
    the dense layer it holds: their layers split into layer_layout's groups (equal, of whole
    periods: validate), the groups in group_order; () without any."""
    n = self.n_dense_layers if self.dense_inside else 0
    per = n // len(self.layer_groups)
    return tuple(r for g in self.group_order for r in range(g * per, (g + 1) * per))

  @property
  def dense_order(self) -> tuple[int, ...] | None:
    """The stored dense rows (dense_slots) to read, in that order, for depth order, or None
    when they already are in depth order."""
    slots = self.dense_slots
    return None if list(slots) == sorted(slots) else tuple(sorted(range(len(slots)),
                                                                  key=slots.__getitem__))

  @property
  def layer_order(self) -> tuple[int, ...] | None:
    """The stored rows to read, in that order, for the MoE stack in depth order (padding rows
    last), or None when the rows already are in depth order (layer_stages unset)."""
    slots = self.layer_slots
    real = [j for j in slots if j >= 0]
    if real == sorted(real):
      return None
    return tuple(sorted(range(len(slots)), key=lambda i: (slots[i] < 0, slots[i])))

  @property
  def layer_attentions(self) -> tuple[str, ...]:
    """The attention kinds of one period of layers (attention_pattern), ("full",) when unset:
    layer i (in depth order, the dense prefix included) has kind [i % period]."""
    return tuple(k.strip() for k in self.attention_pattern.split(",")) if \
        self.attention_pattern else ("full",)

  def window_of(self, kind: str) -> int:
    """The sliding window of a layer of attention kind `kind`, 0 for none."""
    return self.sliding_window if kind == "sliding" else 0

  def local_chunk_of(self, kind: str) -> int:
    """The local block of keys of a layer of attention kind `kind`, 0 for none."""
    return self.local_chunk if kind == "local" else 0

  @property
  def qk_head_dim(self) -> int:
    """Per-head q/k width: head_dim (GQA), qk_nope + qk_rope (MLA)."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

  @property
  def mla(self) -> bool:
    return self.attention == "mla"

  @property
  def mixed(self) -> bool:
    """bf16 mixed precision: weights are cast to `dtype` on their stored shard, before any gather."""
    return self.dtype != "float32"

  def replace(self, **kw) -> "Config":
    return dataclasses.replace(self, **kw)

  def model_fields(self) -> dict:
    """The fields that define the model (a checkpoint compares them)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.metadata["group"] == "model"}

  def plain(self) -> "Config":
    """The same model and run computed the plainest way (every "plain" field at its default):
    the single-device reference's config; M = 1, no recompute, the ragged_dot gmm."""
    return dataclasses.replace(self, **{f.name: f.default for f in dataclasses.fields(self)
                                        if f.metadata["group"] == "plain"})

  def validate(self) -> "Config":
    """Model-level checks (strategy-independent)."""
    def need(cond, msg):
      if not cond:
        raise ConfigError(msg)
    for name in ("vocab", "d_model", "n_heads", "n_kv_heads", "head_dim", "n_layers", "n_experts",
                 "d_ff", "seq_len", "batch"):
      need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
    need(math.isfinite(self.lr) and self.lr > 0, f"lr={self.lr} must be a finite number > 0")
    need(self.n_heads % self.n_kv_heads == 0,
         f"n_heads={self.n_heads} not divisible by n_kv_heads={self.n_kv_heads}")
    need(1 <= self.top_k <= self.n_experts, f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
    need(self.router in ("softmax", "sigmoid"), f"unknown router {self.router!r}")
    need(self.group_score in GROUP_SCORES, f"unknown group_score {self.group_score!r}; choose "
         f"from {', '.join(GROUP_SCORES)}")
    need(self.yarn_factor == 0 or (self.yarn_factor >= 1 and self.yarn_original_max >= 1),
         f"yarn_factor={self.yarn_factor} must be 0 (off) or >= 1 with yarn_original_max >= 1")
    need(self.shared_width >= 0 and (not self.shared_width or self.n_shared_experts >= 1),
         f"shared_width={self.shared_width} needs n_shared_experts >= 1")
    need(not self.shared_gate or self.n_shared_experts >= 1,
         "shared_gate needs a shared expert (n_shared_experts >= 1)")
    need(not (self.mla and (self.qkv_bias or self.qk_norm or self.rotary_dim)),
         "qkv_bias, qk_norm and rotary_dim are GQA's (MLA has its own latent norms and RoPE dims)")
    need(0 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0,
         f"rotary_dim={self.rotary_dim} must be even and in [0, head_dim={self.head_dim}]")
    kinds = self.layer_attentions
    need(all(k in LAYER_ATTENTIONS for k in kinds), f"attention_pattern={self.attention_pattern!r}:"
         f" each entry one of {', '.join(LAYER_ATTENTIONS)}")
    need(("sliding" in kinds) == (self.sliding_window >= 1),
         f"sliding_window={self.sliding_window} needs a sliding layer in attention_pattern, and "
         "a sliding layer a sliding_window >= 1")
    need(("local" in kinds) == (self.local_chunk >= 1),
         f"local_chunk={self.local_chunk} needs a local layer in attention_pattern, and a local "
         "layer a local_chunk >= 1")
    need(self.llama3_factor == 0 or (self.llama3_factor >= 1 and self.llama3_original_max >= 1
                                     and self.llama3_high_freq_factor >= self.llama3_low_freq_factor > 0),
         f"llama3_factor={self.llama3_factor} must be 0 (off) or >= 1 with llama3_original_max >= "
         "1 and llama3_high_freq_factor >= llama3_low_freq_factor > 0")
    need(not (self.llama3_factor and self.yarn_factor), "llama3_factor and yarn_factor exclude "
         "each other (one RoPE scaling)")
    need(not (self.mla and (self.attn_sinks or self.attn_o_bias or len(kinds) > 1
                            or self.qk_l2_norm or self.nope_attn_scale)),
         "attention sinks, the output bias, layers of different attention kinds, the L2 QK-norm "
         "and NoPE temperature tuning are GQA's here")
    need(self.attention_impl != "cudnn" or not self.attn_sinks,
         "--attention=cudnn takes no attention sinks; use chunked")
    need(not self.route_scale_input or self.top_k == 1,
         f"route_scale_input (the score scaling the expert's input) needs top_k=1, not "
         f"{self.top_k}")
    need(self.swiglu_limit >= 0, f"swiglu_limit={self.swiglu_limit} must be >= 0 (0 = SwiGLU)")
    need(self.n_experts % self.n_group == 0,
         f"n_experts={self.n_experts} not divisible by n_group={self.n_group}")
    need(1 <= self.topk_group <= self.n_group, f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
    need(self.top_k <= self.topk_group * (self.n_experts // self.n_group),
         "top_k larger than the experts in the kept groups")
    need(self.capacity_factor >= 0, f"capacity_factor={self.capacity_factor} must be >= 0")
    need(self.expert_choice in EXPERT_CHOICES, f"unknown expert_choice {self.expert_choice!r}; "
         f"choose from {', '.join(EXPERT_CHOICES)}")
    need(self.microbatches >= 1, f"microbatches={self.microbatches} must be >= 1")
    need(self.batch % self.microbatches == 0,
         f"batch={self.batch} is not divisible by microbatches={self.microbatches}")
    need(self.remat in REMAT_POLICIES,
         f"unknown remat {self.remat!r}; choose from {', '.join(REMAT_POLICIES)}")
    need(self.dtype in DTYPES, f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
    need(self.grad_reduce_dtype in DTYPES,
         f"unknown grad_reduce_dtype {self.grad_reduce_dtype!r}; choose from {', '.join(DTYPES)}")
    need(self.aux_loss_kind in AUX_LOSS_KINDS, f"unknown aux_loss_kind {self.aux_loss_kind!r}; "
         f"choose from {', '.join(AUX_LOSS_KINDS)}")
    need(self.attention_impl in ATTENTION_IMPLS, f"unknown attention {self.attention_impl!r}; "
         f"choose from {', '.join(ATTENTION_IMPLS)}")
    need(self.attention_chunk >= 1, f"attention_chunk={self.attention_chunk} must be >= 1")
    need(self.attention_impl != "cudnn" or not self.mla,
         "--attention=cudnn takes GQA only (MLA's value and key head dims differ); use chunked")
    need(self.attention in ATTENTIONS,
         f"unknown attention {self.attention!r}; choose from {', '.join(ATTENTIONS)}")
    need(0 <= self.first_k_dense_replace < self.n_layers,
         f"first_k_dense_replace={self.first_k_dense_replace} must be in [0, n_layers="
         f"{self.n_layers}) (at least one MoE layer)")
    inside = self.mlp_only_layers.split(",") if self.mlp_only_layers else []
    need(all(i.strip().isdigit() for i in inside) and
         list(self.dense_inside) == sorted(set(self.dense_inside)) and
         all(self.first_k_dense_replace <= i < self.n_layers for i in self.dense_inside),
         f"mlp_only_layers={self.mlp_only_layers!r}: expected increasing depth indices in "
         f"[first_k_dense_replace={self.first_k_dense_replace}, n_layers={self.n_layers})")
    need(self.n_moe_layers >= 1, f"mlp_only_layers={self.mlp_only_layers} leaves no MoE layer")
    if self.layer_layout:
      groups = self.layer_layout.split(",")
      need(all(g.strip().isdigit() and int(g) >= 1 for g in groups),
           f"layer_layout={self.layer_layout!r}: expected MoE layers per group, each >= 1, "
           "e.g. 4,4,3")
      need(sum(self.layer_groups) == self.n_moe_layers,
           f"layer_layout={self.layer_layout} holds {sum(self.layer_groups)} MoE layers, the "
           f"model has {self.n_moe_layers}")
    need(not self.dense_inside or not self.layer_layout or (
        not self.first_k_dense_replace and len(set(self.layer_groups)) == 1
        and self.n_layers % (len(self.layer_groups) * self.mlp_period) == 0),
         f"mlp_only_layers (dense layers inside the stack) takes a layer_layout of equal groups "
         f"of whole periods of {self.mlp_period} dense and MoE layers, no padding; not "
         f"layer_layout={self.layer_layout}")
    need(self.layer_stages >= 0, f"layer_stages={self.layer_stages} must be >= 0")
    need(not self.layer_stages or len(self.layer_groups) % self.layer_stages == 0,
         f"layer_layout={self.layer_layout or self.n_moe_layers}: {len(self.layer_groups)} "
         f"groups are not a multiple of layer_stages={self.layer_stages}")
    need(not self.n_dense_layers or self.dense_d_ff >= 1,
         "dense_d_ff must be >= 1 with dense layers (first_k_dense_replace, mlp_only_layers)")
    if self.mla:
      for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1 (mla)")
      need(self.q_lora_rank >= 0, f"q_lora_rank={self.q_lora_rank} must be >= 0")
      need(self.qk_rope_head_dim % 2 == 0,
           f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE)")
    else:
      need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even (RoPE)")
    return self


@functools.lru_cache(maxsize=256)
def segments(kinds: tuple) -> tuple:
  """A sequence of layer kinds -> runs ((period, repeats), ..) covering it in order: from each
  position, the period repeated at least twice that covers the most layers (the shortest such
  period on a tie), else one layer on its own. [a a a b a b a b] -> ((a,), 3), ((b, a), 2), ((b,), 1)."""
  out, i, n = [], 0, len(kinds)
  while i < n:
    best = (kinds[i:i + 1], 1)
    for p in range(1, (n - i) // 2 + 1):
      period, r = kinds[i:i + p], 1
      while kinds[i + r * p:i + (r + 1) * p] == period:
        r += 1
      if r >= 2 and p * r > len(best[0]) * best[1]:
        best = (period, r)
    out.append(best)
    i += len(best[0]) * best[1]
  return tuple(out)


def balanced_layout(n: int, groups: int) -> str:
  """n layers in `groups` groups as even as they go, the larger groups first (layer_layout):
  balanced_layout(58, 16) = "4,4,...,4,3,...,3" (ten 4s, six 3s)."""
  q, r = divmod(n, groups)
  return ",".join(str(q + (g < r)) for g in range(groups))


PRESETS: dict[str, Config] = {
    # tests: tiny everything
    "tiny": Config(attention_chunk=16),   # 2 key chunks at seq_len 32
    # Mixtral-style: softmax top-2 over 8 experts, no shared expert
    "mixtral-test": Config(attention_chunk=16, n_experts=8, top_k=2, router="softmax",
                           norm_topk_prob=True),
    # DeepSeek-V3's architecture at test size: MLA with a query down-projection, one leading
    # dense layer, sigmoid router with correction bias, group-limited top-k, a shared expert, the
    # sequence-wise balance loss
    "deepseek-test": Config(attention="mla", attention_chunk=16, n_heads=4, n_kv_heads=4,
                            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, n_layers=3,
                            first_k_dense_replace=1, dense_d_ff=96, n_experts=16, top_k=4,
                            router="sigmoid", n_group=4, topk_group=2, n_shared_experts=1,
                            routed_scaling_factor=2.5, norm_topk_prob=True,
                            bias_update_rate=1e-3, aux_loss_kind="sequence", d_ff=64),
    # DeepSeek-V2-Lite's architecture at test size: MLA with a direct query projection, softmax
    # router without groups or top-k renormalisation, two shared experts
    "deepseek-v2-test": Config(attention="mla", attention_chunk=16, n_heads=4, n_kv_heads=4,
                               q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, n_layers=3,
                               first_k_dense_replace=1, dense_d_ff=96, n_experts=8, top_k=2,
                               router="softmax", norm_topk_prob=False, n_shared_experts=2,
                               d_ff=32),
    # Qwen2-MoE's extras at test size: q/k/v biases, a shared expert of its own width behind a
    # sigmoid gate, unnormalised top-k weights
    "qwen2-test": Config(attention_chunk=16, n_experts=8, top_k=2, router="softmax",
                         norm_topk_prob=False, qkv_bias=True, n_shared_experts=1, shared_width=96,
                         shared_gate=True, d_ff=64),
    # GLM-4.5's architecture at test size: partial rotary (half of each head), q/k/v biases,
    # QK-norm, a dense first layer, sigmoid group-limited routing with correction bias, a shared
    # expert (Qwen3-MoE's QK-norm is the same code)
    "glm-test": Config(attention_chunk=16, n_layers=3, first_k_dense_replace=1, dense_d_ff=96,
                       n_experts=16, top_k=4, router="sigmoid", n_group=4, topk_group=2,
                       n_shared_experts=1, routed_scaling_factor=2.5, qkv_bias=True, qk_norm=True,
                       rotary_dim=8, d_ff=64, bias_update_rate=1e-3),
    # gpt-oss's architecture at test size: sliding (12 keys of 32) and full layers in turn,
    # attention sinks, biases on q/k/v/o, the router and the experts, the clamped SwiGLU
    "gpt-oss-test": Config(attention_chunk=8, n_layers=2, attention_pattern="sliding,full",
                           sliding_window=12, attn_sinks=True, qkv_bias=True, attn_o_bias=True,
                           router_bias=True, expert_bias=True, swiglu_limit=1.5, n_experts=8,
                           top_k=2, router="softmax", norm_topk_prob=True, d_ff=64),
    # Llama 4's text architecture at test size: three RoPE layers of chunked local attention
    # (blocks of 12 of 32 keys) with the L2 QK-norm, then a NoPE layer with temperature tuning;
    # llama3 RoPE scaling; top-1 sigmoid routing whose score scales the expert's input; a shared
    # expert
    "llama4-test": Config(attention_chunk=8, n_layers=4,
                          attention_pattern="local,local,local,nope", local_chunk=12,
                          qk_l2_norm=True, nope_attn_scale=0.5, nope_floor_scale=8.0,
                          rope_interleave=True, llama3_factor=4.0, llama3_original_max=16,
                          n_experts=8, top_k=1, router="sigmoid", norm_topk_prob=False,
                          route_scale_input=True, n_shared_experts=1, d_ff=64),
    # Llama 4 Maverick's stack at test size: dense layers (their own width) between the MoE
    # layers, chunked local attention and NoPE layers in turn; no QK-norm
    "llama4-maverick-test": Config(attention_chunk=8, n_layers=4, attention_pattern="local,nope",
                                   local_chunk=12, mlp_only_layers="0,2", dense_d_ff=96,
                                   nope_attn_scale=0.5, nope_floor_scale=8.0,
                                   rope_interleave=True, n_experts=8, top_k=1, router="sigmoid",
                                   norm_topk_prob=False, route_scale_input=True,
                                   n_shared_experts=1, d_ff=64),
    # Mixtral-8x7B-shaped, for compile-only scaling studies (never run on CPU)
    "mixtral-8x7b": Config(vocab=32000, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                           n_layers=32, n_experts=8, top_k=2, d_ff=14336, seq_len=4096,
                           batch=64),
    # DeepSeek-V2-Lite at its published shapes (compile-only; Hugging Face config.json):
    # 15.7B total / 2.4B activated parameters (python run.py --model=deepseek-v2-lite --describe)
    "deepseek-v2-lite": Config(vocab=102400, d_model=2048, n_heads=16, n_kv_heads=16,
                               attention="mla", q_lora_rank=0, kv_lora_rank=512,
                               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                               rope_interleave=True, n_layers=27, first_k_dense_replace=1,
                               dense_d_ff=10944, n_experts=64, top_k=6, d_ff=1408,
                               n_shared_experts=2, router="softmax", norm_topk_prob=False,
                               seq_len=4096, batch=64),
    # DeepSeek-V3 at its published shapes (compile-only): 671B / 37B. Not modelled: the
    # multi-token-prediction module (its 14B are not in the 671B either) and YaRN's RoPE
    # scaling (numbers only: no shape, byte or memory changes)
    "deepseek-v3": Config(vocab=129280, d_model=7168, n_heads=128, n_kv_heads=128,
                          attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                          rope_interleave=True, n_layers=61, first_k_dense_replace=3,
                          dense_d_ff=18432, n_experts=256, top_k=8, d_ff=2048,
                          n_shared_experts=1, router="sigmoid", n_group=8, topk_group=4,
                          norm_topk_prob=True, routed_scaling_factor=2.5, bias_update_rate=1e-3,
                          aux_loss_coef=1e-4, aux_loss_kind="sequence", seq_len=4096, batch=256),
}


def is_path(name: str) -> bool:
  """Whether --model names a file or folder (a Hugging Face config.json) rather than a preset."""
  return name not in PRESETS and (os.sep in name or name.endswith(".json") or os.path.exists(name))


# the run shapes of a model read from a config.json: the real-scale presets' (seq 4096, batch 64)
# from d_model 1024 up, the Config defaults (seq 32, batch 8) below it
REAL_SCALE_D_MODEL = 1024
REAL_SCALE_RUN = dict(seq_len=4096, batch=64)


def _from_hf(path: str) -> Config:
  """A Hugging Face config.json (or its folder) -> Config (convert.config_from_hf), with the run
  shapes above; ConfigError naming the path and what is wrong."""
  from modeling import convert
  try:
    cfg = Config(**convert.config_from_hf(convert.read_config(path)))
  except (ValueError, TypeError, KeyError) as e:
    msg = f"missing field {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
    raise ConfigError(f"--model={path}: {msg}") from None
  return cfg.replace(**REAL_SCALE_RUN) if cfg.d_model >= REAL_SCALE_D_MODEL else cfg


def base_config(name: str) -> Config:
  """--model's Config before the flags: a preset, or a Hugging Face config.json (a path to it, or
  to the folder holding it) read by modeling/convert.py, with the run shapes above."""
  if name in PRESETS:
    return PRESETS[name]
  if not is_path(name):
    raise ConfigError(f"unknown model {name!r}; choose a preset ({', '.join(PRESETS)}) or give "
                      "the path of a Hugging Face config.json or of its folder")
  return _from_hf(name)


# presets read from the released config.json files in configs/ (their published shapes; counts
# held by tests/test_model.py, python run.py --model=NAME --describe)
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
for _name in ("mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b", "glm-4.5", "kimi-k2",
              "gpt-oss-120b", "gpt-oss-20b", "llama4-scout", "llama4-maverick"):
  PRESETS[_name] = _from_hf(os.path.join(CONFIGS, f"{_name}.json"))


def get_config(name: str, **overrides) -> Config:
  """A preset or a config.json path (base_config) with `overrides`, validated. n_layers without
  mlp_only_layers keeps the model's dense layers inside the stack where they fall
  (`dense_at_depth`)."""
  base = base_config(name)
  if "n_layers" in overrides and "mlp_only_layers" not in overrides and base.dense_inside:
    overrides = {**overrides, "mlp_only_layers": dense_at_depth(base, overrides["n_layers"])}
  return base.replace(**overrides).validate()


def dense_at_depth(cfg: Config, n: int) -> str:
  """cfg's mlp_only_layers for the model cut or grown to n layers: the dense layers among its
  first n; past its depth, its dense/MoE pattern repeated where the layers after the prefix are
  one repeated period (mlp_period: Llama 4 Maverick's every other layer), none otherwise."""
  prefix, period, moe = cfg.first_k_dense_replace, cfg.mlp_period, cfg.layer_is_moe
  repeats = period < cfg.n_layers - prefix
  dense = [i for i in range(prefix, n)
           if (not moe[i] if i < cfg.n_layers else
               repeats and not moe[prefix + (i - prefix) % period])]
  return ",".join(str(i) for i in dense)
