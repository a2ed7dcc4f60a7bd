"""Whole-model logit fixtures from Hugging Face transformers' own MoE model classes.

Not part of the suite: nothing imports this file, and it needs torch + transformers, which the
suite does not. Run it in a separate Python 3.11+ virtual environment from the repo root:

  python3.11 -m venv /path/to/hfenv
  /path/to/hfenv/bin/pip install torch transformers numpy safetensors
  /path/to/hfenv/bin/python tools/hf_fixtures.py [--out tests/fixtures/hf] [--only NAME[,NAME..]]

It writes one compressed npz per model to tests/fixtures/hf/<name>.npz (MODELS below holds each
one's exact config, seed and sequence length):
  mixtral              MixtralForCausalLM, GQA, softmax top-2 of 8 experts
  deepseek_v3          DeepseekV3ForCausalLM, MLA with q low rank, 1 dense + 2 MoE layers,
                       sigmoid group-limited routing with correction bias, 1 shared expert
  deepseek_v3_noqlora  the same with q_lora_rank None (a direct q_proj, as DeepSeek-V2-Lite)
  deepseek_v3_yarn     deepseek_v3 with YaRN RoPE (factor 4 over an original 8 positions,
                       mscale = mscale_all_dim = 1: the softmax scale carries the YaRN mscale^2),
                       1 dense + 1 MoE layer (to stay small)
  qwen3_moe            Qwen3MoeForCausalLM, GQA 4/2 heads of 16, per-head QK RMSNorm, one dense
                       layer (mlp_only_layers [0]) + 2 MoE layers, softmax top-2 renormalised
  qwen3_moe_inside     the same with a dense layer inside the stack: MoE, dense
                       (mlp_only_layers [1]), MoE, MoE
  qwen2_moe            Qwen2MoeForCausalLM, GQA, q/k/v biases, 2 MoE layers, softmax top-2 not
                       renormalised, a shared expert behind its sigmoid gate
  glm4_moe             Glm4MoeForCausalLM, GQA, q/k/v biases, QK norm, partial RoPE (half of
                       each head, rotate-half), 1 dense + 2 MoE layers, sigmoid group-limited
                       routing with correction bias and scale 2.5, 1 shared expert
  deepseek_v2_lite     DeepseekV2ForCausalLM, MLA without q low rank, softmax greedy top-2 (not
                       renormalised), 2 shared experts, 1 dense + 1 MoE layer
  deepseek_v2          DeepseekV2ForCausalLM, MLA with q low rank, softmax group_limited_greedy
                       (group score = the group's max) top-2, routed scale 2.0, 2 shared experts,
                       1 dense + 1 MoE layer (DeepseekV2 never renormalises: norm_topk_prob is
                       unused by its router, and it has no scoring_func / correction bias)
  gpt_oss              GptOssForCausalLM, GQA 4/2 heads of 16 with attention sinks, 4 layers
                       alternating sliding (window 5 < seq 12) and full attention, biases on
                       q/k/v/o, the router and the experts, the clamped SwiGLU (limit 1.5: it
                       clamps), YaRN without truncation (factor 4 over 8 positions)
  llama4               Llama4ForCausalLM (text), GQA 4/2 heads of 16, 4 layers: three RoPE layers
                       with chunked local attention (blocks of 5 of 12 positions) and the L2
                       QK-norm, one NoPE layer with temperature tuning (floor 4, scale 0.5),
                       llama3 RoPE scaling (factor 4 over 8), dense layers (width 48) and MoE
                       layers in turn (interleave_moe_layer_step 2, as Maverick), top-1 sigmoid
                       routing scaling the expert's input over 4 experts, a shared expert
Each holds every state-dict tensor (buffers included) under its HF name as float32, `tokens`
[2, S] int32, `logits` [2, S, V] float32 of the HF forward (positions 0..S-1, causal, no
padding, no cache) and `config_json` (the HF config's to_json_string, a 0-d string array).
S is 16 for the first three and 12 for the others (not a power of two; past YaRN's original 8).

The models are float32, attn_implementation="eager", experts_implementation="eager", eval mode.
Every weight is redrawn from a seeded numpy generator (not torch's), normal / sqrt(fan_in) with
the embedding at std 1, RMSNorm scales 1 + 0.1 randn, linear biases 0.1 randn and the routers'
e_score_correction_bias 0.05 randn, so activations and logits are O(1). The weights are rounded
to bfloat16-representable float32 values (all math stays float32): the zero low mantissa bytes
halve the compressed files. Each fixture's routing is checked: every expert used, every top-k
(and group) boundary more than 1e-4 from a tie under that family's own rule, and the rule's
choice equal to the experts the HF router picked.

mixtral, deepseek_v3 and deepseek_v3_noqlora were made with transformers 5.23.0, torch 2.14.1
(CPU), numpy 2.4.6; the others with transformers 5.24.0, torch 2.13.0 (CPU), numpy 2.4.6.
"""
from __future__ import annotations

import argparse
import copy
import os

import numpy as np
import torch
import transformers

B = 2

# name -> (model class, config class, config kwargs, seed, sequence length). The seed feeds numpy
# (weights, tokens) and torch; each fixture's top-k boundaries are > 1e-4 from a tie with it.
_DSV3 = dict(
    vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96,
    moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    rope_interleave=True, rope_scaling=None, attention_bias=False, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=64)
_DSV2 = dict(
    vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=96,
    moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
    attention_bias=False, mlp_bias=False, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False, max_position_embeddings=64)
_QWEN3 = dict(
    vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=3, mlp_only_layers=[0], decoder_sparse_step=1, intermediate_size=48,
    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    attention_bias=False, use_sliding_window=False, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False, max_position_embeddings=64)
MODELS = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None,
        max_position_embeddings=64), 1, 16),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", _DSV3, 1, 16),
    "deepseek_v3_noqlora": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                            {**_DSV3, "q_lora_rank": None}, 1, 16),
    "deepseek_v3_yarn": ("DeepseekV3ForCausalLM", "DeepseekV3Config", {
        **{k: v for k, v in _DSV3.items() if k != "rope_scaling"},
        "num_hidden_layers": 2, "max_position_embeddings": 32,
        "rope_parameters": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                original_max_position_embeddings=8, beta_fast=32, beta_slow=1,
                                mscale=1.0, mscale_all_dim=1.0)}, 2, 12),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", _QWEN3, 1, 12),
    "qwen3_moe_inside": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                         {**_QWEN3, "num_hidden_layers": 4, "mlp_only_layers": [1]}, 4, 12),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, mlp_only_layers=[], decoder_sparse_step=1, intermediate_size=96,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, qkv_bias=True, use_sliding_window=False,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        max_position_embeddings=64), 2, 12),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=48,
        moe_intermediate_size=20, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=64), 1, 12),
    "deepseek_v2_lite": ("DeepseekV2ForCausalLM", "DeepseekV2Config", {
        **_DSV2, "q_lora_rank": None, "topk_method": "greedy", "n_group": None,
        "topk_group": None, "norm_topk_prob": False, "routed_scaling_factor": 1.0}, 1, 12),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", {
        **_DSV2, "q_lora_rank": 32, "topk_method": "group_limited_greedy", "n_group": 4,
        "topk_group": 2, "norm_topk_prob": False, "routed_scaling_factor": 2.0}, 1, 12),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
        sliding_window=5, attention_bias=True, swiglu_limit=1.5, swiglu_alpha=1.702,
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=64,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0,
                             truncate=False)), 1, 12),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", dict(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=1, intermediate_size=32,
        intermediate_size_mlp=48, interleave_moe_layer_step=2, attention_chunk_size=5,
        use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
        attention_bias=False, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=64,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=4.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8)), 1, 12),
}
ROUTERS = ("MixtralTopKRouter", "DeepseekV3TopkRouter", "DeepseekV2TopkRouter",
           "Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "Glm4MoeTopkRouter", "GptOssTopKRouter",
           "Llama4Router")


def bf16_round(a: np.ndarray) -> np.ndarray:
  """float32 -> the nearest bfloat16-representable float32 (round to nearest even)."""
  u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
  u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
  return u.astype(np.uint32).view(np.float32)


def redraw(model: torch.nn.Module, rng: np.random.Generator) -> None:
  """Every state-dict tensor redrawn in place (sorted name order), see the module docstring."""
  state = model.state_dict()
  for name in sorted(state):
    t = state[name]
    if name.endswith("e_score_correction_bias"):
      v = 0.05 * rng.standard_normal(t.shape)
    elif name.endswith(".bias") or name.endswith("_proj_bias"):   # linear and expert biases
      v = 0.1 * rng.standard_normal(t.shape)
    elif name.endswith(".sinks"):                               # gpt-oss: one logit per head
      v = rng.standard_normal(t.shape)
    elif model.config.model_type in ("gpt_oss", "llama4_text") and name.endswith("_proj") and \
        t.ndim == 3:
      v = rng.standard_normal(t.shape) / np.sqrt(t.shape[-2])   # experts stored [E, in, out]
    elif t.ndim == 1:                                           # every RMSNorm scale
      assert name.endswith("norm.weight"), f"unexpected 1-D tensor {name}"
      v = 1.0 + 0.1 * rng.standard_normal(t.shape)
    elif name.endswith("embed_tokens.weight"):
      v = rng.standard_normal(t.shape)
    else:                                                       # [.., out, in]: fan_in = last dim
      v = rng.standard_normal(t.shape) / np.sqrt(t.shape[-1])
    with torch.no_grad():
      t.copy_(torch.from_numpy(bf16_round(v)))


def routers(model: torch.nn.Module) -> list:
  return [(n, m) for n, m in model.named_modules() if type(m).__name__ in ROUTERS]


def _boundary_gap(choice: torch.Tensor, k: int) -> float:
  srt = choice.sort(-1, descending=True)[0]
  return (srt[:, k - 1] - srt[:, k]).min().item()


def _group_mask(group_scores: torch.Tensor, topk_group: int, n_per_group: int):
  """-> (expert mask [T, E] of the kept groups, the gap at the group top-k boundary)."""
  gap = _boundary_gap(group_scores, topk_group)
  keep = group_scores.sort(-1, descending=True)[0][:, topk_group - 1:topk_group]
  return (group_scores >= keep).repeat_interleave(n_per_group, dim=-1), gap


def routing_report(name: str, cfg, inputs: dict, picked: dict, mods: dict) -> None:
  """Expert use per MoE layer, and the smallest score gap at each top-k boundary (a tie there
  would make the choice of experts depend on implementation details), each family's router rule
  recomputed in float64 from the router's captured input (and checked against HF's choice)."""
  for layer, x in inputs.items():
    mod = mods[layer]
    kind = type(mod).__name__
    x = x.reshape(-1, x.shape[-1]).double()
    w = mod.weight.detach().double()
    logits = x @ w.T                                                         # [T, E]
    if kind == "GptOssTopKRouter":
      logits = logits + mod.bias.detach().double()
    k = cfg.num_experts_per_tok
    n_exp = logits.shape[-1]
    if kind in ("GptOssTopKRouter", "Llama4Router"):          # top-k of the (biased) logits
      choice = logits
      gaps = [_boundary_gap(choice, k)]
    elif kind in ("MixtralTopKRouter", "Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter") or (
        kind == "DeepseekV2TopkRouter" and cfg.topk_method == "greedy"):
      choice = torch.softmax(logits, -1)                      # softmax over all, then top-k
      gaps = [_boundary_gap(choice, k)]
    elif kind == "DeepseekV2TopkRouter":                      # group_limited_greedy
      assert cfg.topk_method == "group_limited_greedy", cfg.topk_method
      sm = torch.softmax(logits, -1)
      g = cfg.n_group
      gscore = sm.view(-1, g, n_exp // g).max(-1).values      # group score: the group's max
      mask, group_gap = _group_mask(gscore, cfg.topk_group, n_exp // g)
      choice = torch.where(mask, sm, torch.tensor(float("-inf"), dtype=sm.dtype))
      gaps = [group_gap, _boundary_gap(choice, k)]
    else:                                                     # DeepseekV3 / Glm4Moe: noaux_tc
      bias = mod.e_score_correction_bias.detach().double()
      sb = torch.sigmoid(logits) + bias
      g = cfg.n_group
      gscore = sb.view(-1, g, n_exp // g).topk(2, -1)[0].sum(-1)   # sum of the group's top 2
      mask, group_gap = _group_mask(gscore, cfg.topk_group, n_exp // g)
      choice = torch.where(mask, sb, torch.tensor(float("-inf"), dtype=sb.dtype))
      gaps = [group_gap, _boundary_gap(choice, k)]
    idx = choice.topk(k, -1)[1]
    hf_idx = picked[layer].reshape(-1, k)
    assert torch.equal(idx.sort(-1)[0], hf_idx.sort(-1)[0].to(idx.device)), (
        f"{name} {layer}: the recomputed {kind} rule disagrees with HF's choice")
    counts = torch.bincount(idx.flatten(), minlength=n_exp).tolist()
    print(f"  {layer}: expert counts {counts}, min top-k boundary gap(s) "
          + ", ".join(f"{v:.2e}" for v in gaps))
    assert all(c > 0 for c in counts), f"{name} {layer}: an expert is never used"
    assert min(gaps) > 1e-4, f"{name} {layer}: a near-tie at a top-k boundary"


def build(name: str, out_dir: str) -> str:
  model_cls, config_cls, kw, seed, seq = MODELS[name]
  torch.manual_seed(seed)
  config = getattr(transformers, config_cls)(**copy.deepcopy(kw))
  config._attn_implementation = "eager"
  model = getattr(transformers, model_cls)(config).to(torch.float32)
  model.set_attn_implementation("eager")
  model.set_experts_implementation("eager")
  model.eval()
  rng = np.random.default_rng(seed)
  redraw(model, rng)
  tokens = rng.integers(0, config.vocab_size, size=(B, seq)).astype(np.int32)

  mods = dict(routers(model))
  captured, picked = {}, {}

  def hook(m, a, o, n):
    captured[n] = a[0].detach()
    if type(m).__name__ == "Llama4Router":      # (scores: sigmoid of the top-k logits, 0 elsewhere, logits)
      picked[n] = o[0].detach().topk(config.num_experts_per_tok, -1)[1]
    else:
      picked[n] = o[2].detach()                 # (router_logits, top-k weights, top-k indices)
  hooks = [m.register_forward_hook(lambda m, a, o, n=n: hook(m, a, o, n)) for n, m in mods.items()]
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens).long(),
                position_ids=torch.arange(seq).expand(B, seq), use_cache=False)
  for h in hooks:
    h.remove()
  logits = out.logits.float().numpy()
  print(f"{name}: transformers {transformers.__version__}, torch {torch.__version__}; logits std "
        f"{logits.std():.3f}, max |logit| {np.abs(logits).max():.3f}, per-position std over vocab "
        f"min {logits.std(-1).min():.3f}")
  assert logits.std(-1).min() > 0.3, "near-constant logits"
  assert mods, f"{name}: no router found"
  routing_report(name, config, captured, picked, mods)

  arrays = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  assert "tokens" not in arrays and "logits" not in arrays and "config_json" not in arrays
  for k, v in arrays.items():
    if k.endswith("bias") or k.endswith("shared_expert_gate.weight"):
      assert np.all(v != 0), f"{name}: {k} has zeros"
  arrays.update(tokens=tokens, logits=logits.astype(np.float32),
                config_json=np.array(config.to_json_string()))
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{name}.npz")
  np.savez_compressed(path, **arrays)
  print(f"  wrote {path}: {len(arrays) - 3} tensors, {os.path.getsize(path) / 1024:.0f} KiB")
  return path


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.path.join("tests", "fixtures", "hf"))
  ap.add_argument("--only", nargs="*", default=list(MODELS),
                  help="fixture names, comma- or space-separated (default: all): "
                  + ",".join(MODELS))
  args = ap.parse_args()
  names = [n for arg in args.only for n in arg.split(",") if n]
  unknown = sorted(set(names) - set(MODELS))
  if unknown:
    ap.error(f"unknown fixture(s) {unknown}; known: {sorted(MODELS)}")
  torch.set_num_threads(1)                                     # bitwise-stable reductions
  for name in names:
    build(name, args.out)


if __name__ == "__main__":
  main()
