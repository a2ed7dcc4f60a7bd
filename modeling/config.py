"""Model and run configuration: one frozen dataclass and named presets."""
from __future__ import annotations

import dataclasses
import math


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
  n_layers: int = _model(2)
  n_experts: int = _model(8)
  top_k: int = _model(2)
  d_ff: int = _model(128)                # F, per routed expert
  n_shared_experts: int = _model(0)      # shared experts are fused into one SwiGLU of width n_shared * d_ff
  router: str = _model("softmax")        # "softmax" (Mixtral) | "sigmoid" (DeepSeek-V3)
  norm_topk_prob: bool = _model(True)    # renormalise the top-k weights to sum 1
  n_group: int = _model(1)               # group-limited routing (sigmoid router)
  topk_group: int = _model(1)
  routed_scaling_factor: float = _model(1.0)
  rope_theta: float = _model(10000.0)
  norm_eps: float = _model(1e-6)
  # losses / balancing
  aux_loss_coef: float = _run(0.01)
  z_loss_coef: float = _run(0.0)
  bias_update_rate: float = _run(0.0)    # gamma of the aux-loss-free bias update (0 = off)
  capacity_factor: float = _run(0.0)     # 0 = dropless
  # run
  seq_len: int = _run(32)
  batch: int = _run(8)
  lr: float = _run(3e-3)
  weight_decay: float = _run(0.0)
  adam_eps: float = _run(1e-8)
  optimizer: str = _run("adamw")
  seed: int = _run(0)
  dtype: str = _run("float32")           # compute dtype: DTYPES (mixed precision: modeling/model.py)
  grad_reduce_dtype: str = _run("float32")   # weight-gradient reductions under dtype=bfloat16
  # how the step computes (the same math for every value)
  gmm_backend: str = _plain("ragged_dot")
  microbatches: int = _plain(1)          # M microbatches per step, one optimizer update: gradient
                                         # accumulation (runtime/train.py); pp: the pipeline's microbatches
  remat: str = _plain("none")            # jax.checkpoint of each layer's block: see REMAT_POLICIES

  @property
  def shared_d_ff(self) -> int:
    return self.n_shared_experts * self.d_ff

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
    need(self.n_experts % self.n_group == 0,
         f"n_experts={self.n_experts} not divisible by n_group={self.n_group}")
    need(1 <= self.topk_group <= self.n_group, f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
    need(self.top_k <= self.topk_group * (self.n_experts // self.n_group),
         "top_k larger than the experts in the kept groups")
    need(self.capacity_factor >= 0, f"capacity_factor={self.capacity_factor} must be >= 0")
    need(self.microbatches >= 1, f"microbatches={self.microbatches} must be >= 1")
    need(self.batch % self.microbatches == 0,
         f"batch={self.batch} is not divisible by microbatches={self.microbatches}")
    need(self.remat in REMAT_POLICIES,
         f"unknown remat {self.remat!r}; choose from {', '.join(REMAT_POLICIES)}")
    need(self.dtype in DTYPES, f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
    need(self.grad_reduce_dtype in DTYPES,
         f"unknown grad_reduce_dtype {self.grad_reduce_dtype!r}; choose from {', '.join(DTYPES)}")
    need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even (RoPE)")
    return self


PRESETS: dict[str, Config] = {
    # tests: tiny everything
    "tiny": Config(),
    # Mixtral-style: softmax top-2 over 8 experts, no shared expert
    "mixtral-test": Config(n_experts=8, top_k=2, router="softmax", norm_topk_prob=True),
    # DeepSeek-V3-style: sigmoid router with correction bias, group-limited top-k
    "deepseek-test": Config(n_experts=16, top_k=4, router="sigmoid", n_group=4, topk_group=2,
                            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                            bias_update_rate=1e-3, d_ff=64),
    # Mixtral-8x7B-shaped, for compile-only scaling studies (never run on CPU)
    "mixtral-8x7b": Config(vocab=32000, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                           n_layers=32, n_experts=8, top_k=2, d_ff=14336, seq_len=4096,
                           batch=64),
    # DeepSeek-V2-Lite-shaped (compile-only). Attention approximated by GQA: MLA's low-rank
    # latent KV (kv_lora_rank 512) and its 64 decoupled RoPE dims are not modelled; in training
    # MLA up-projects the latent into per-head K and V, so KV heads = H = 16 query heads of
    # Dh = 128 (= its v_head_dim / qk_nope_head_dim): attention activations match, attention
    # params are over-counted (K/V projections full rank). Its first (dense) layer is MoE here.
    # 16.3B params here (sum over model.param_leaves) vs 15.7B published.
    "deepseek-v2-lite": Config(vocab=102400, d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128,
                               n_layers=27, n_experts=64, top_k=6, d_ff=1408, n_shared_experts=2,
                               router="softmax", norm_topk_prob=False, seq_len=4096, batch=64),
    # DeepSeek-V3-shaped (compile-only), the same attention approximation: KV heads = H = 128 of
    # Dh = 128, no q/kv low rank, no RoPE dims; its first 3 (dense) layers are MoE here.
    # 721.0B params here (sum over model.param_leaves) vs 671B published (no MTP module).
    "deepseek-v3": Config(vocab=129280, d_model=7168, n_heads=128, n_kv_heads=128, head_dim=128,
                          n_layers=61, n_experts=256, top_k=8, d_ff=2048, n_shared_experts=1,
                          router="sigmoid", n_group=8, topk_group=4, norm_topk_prob=True,
                          routed_scaling_factor=2.5, bias_update_rate=1e-3, aux_loss_coef=1e-4,
                          seq_len=4096, batch=256),
}


def get_config(name: str, **overrides) -> Config:
  if name not in PRESETS:
    raise ConfigError(f"unknown model {name!r}; choose from {', '.join(PRESETS)}")
  return PRESETS[name].replace(**overrides).validate()
