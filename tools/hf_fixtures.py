"""Whole-model logit fixtures from Hugging Face transformers' own Mixtral and DeepSeek-V3 classes.

Not part of the suite: nothing imports this file, and it needs torch + transformers, which the
suite does not. Run it in a separate Python 3.11+ virtual environment from the repo root:

  python3.11 -m venv /path/to/hfenv
  /path/to/hfenv/bin/pip install torch transformers numpy safetensors
  /path/to/hfenv/bin/python tools/hf_fixtures.py [--out tests/fixtures/hf]

It writes one compressed npz per model to tests/fixtures/hf/<name>.npz:
  mixtral              MixtralForCausalLM, GQA, softmax top-2 of 8 experts
  deepseek_v3          DeepseekV3ForCausalLM, MLA with q low rank, 1 dense + 2 MoE layers,
                       sigmoid group-limited routing with correction bias, 1 shared expert
  deepseek_v3_noqlora  the same with q_lora_rank None (a direct q_proj, as DeepSeek-V2-Lite)
Each holds every state-dict tensor (buffers included) under its HF name as float32, `tokens`
[2, 16] int32, `logits` [2, 16, V] float32 of the HF forward (positions 0..15, causal, no
padding, no cache) and `config_json` (the HF config's to_json_string, a 0-d string array).

The models are float32, attn_implementation="eager", experts_implementation="eager", eval mode.
Every weight is redrawn from a seeded numpy generator (not torch's), normal / sqrt(fan_in) with
the embedding at std 1, RMSNorm scales 1 + 0.1 randn and the routers' e_score_correction_bias
0.05 randn, so activations and logits are O(1). The weights are rounded to bfloat16-representable
float32 values (all math stays float32): the zero low mantissa bytes halve the compressed files.

The committed files were made with transformers 5.23.0, torch 2.14.1 (CPU), numpy 2.4.6.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import transformers

B, S = 2, 16

MODELS = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None,
        max_position_embeddings=64)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True, rope_scaling=None, attention_bias=False, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=64)),
}
MODELS["deepseek_v3_noqlora"] = (MODELS["deepseek_v3"][0], MODELS["deepseek_v3"][1],
                                 {**MODELS["deepseek_v3"][2], "q_lora_rank": None})
SEED = 1      # numpy and torch; every top-k boundary of these fixtures is > 1e-4 from a tie


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
    elif t.ndim == 1:                                           # every RMSNorm scale
      v = 1.0 + 0.1 * rng.standard_normal(t.shape)
    elif name.endswith("embed_tokens.weight"):
      v = rng.standard_normal(t.shape)
    else:                                                       # [.., out, in]: fan_in = last dim
      v = rng.standard_normal(t.shape) / np.sqrt(t.shape[-1])
    with torch.no_grad():
      t.copy_(torch.from_numpy(bf16_round(v)))


def routers(model: torch.nn.Module) -> list:
  return [(n, m) for n, m in model.named_modules()
          if type(m).__name__ in ("MixtralTopKRouter", "DeepseekV3TopkRouter")]


def routing_report(name: str, cfg, inputs: dict, mods: dict) -> None:
  """Expert use per MoE layer, and the smallest score gap at each top-k boundary (a tie there
  would make the choice of experts depend on implementation details)."""
  for layer, x in inputs.items():
    x = x.reshape(-1, x.shape[-1]).double()
    w = mods[layer].weight.detach().double()
    logits = x @ w.T                                                         # [T, E]
    k = cfg.num_experts_per_tok
    if name == "mixtral":
      choice = torch.softmax(logits, -1)
      srt = choice.sort(-1, descending=True)[0]
      gaps = [(srt[:, k - 1] - srt[:, k]).min().item()]
    else:
      bias = mods[layer].e_score_correction_bias.detach().double()
      sb = torch.sigmoid(logits) + bias
      g = cfg.n_group
      gs = sb.view(-1, g, sb.shape[-1] // g).topk(2, -1)[0].sum(-1).sort(-1, descending=True)[0]
      group_gap = (gs[:, cfg.topk_group - 1] - gs[:, cfg.topk_group]).min().item()
      keep = gs[:, cfg.topk_group - 1:cfg.topk_group]
      gscore = sb.view(-1, g, sb.shape[-1] // g).topk(2, -1)[0].sum(-1)
      mask = (gscore >= keep).repeat_interleave(sb.shape[-1] // g, dim=-1)
      choice = torch.where(mask, sb, torch.tensor(float("-inf"), dtype=sb.dtype))
      srt = choice.sort(-1, descending=True)[0]
      gaps = [group_gap, (srt[:, k - 1] - srt[:, k]).min().item()]
    idx = choice.topk(k, -1)[1]
    counts = torch.bincount(idx.flatten(), minlength=logits.shape[-1]).tolist()
    print(f"  {layer}: expert counts {counts}, min top-k boundary gap(s) "
          + ", ".join(f"{v:.2e}" for v in gaps))
    assert all(c > 0 for c in counts), f"{name} {layer}: an expert is never used"
    assert min(gaps) > 1e-4, f"{name} {layer}: a near-tie at a top-k boundary"


def build(name: str, out_dir: str) -> str:
  model_cls, config_cls, kw = MODELS[name]
  seed = SEED
  torch.manual_seed(seed)
  config = getattr(transformers, config_cls)(**kw)
  config._attn_implementation = "eager"
  model = getattr(transformers, model_cls)(config).to(torch.float32)
  model.set_attn_implementation("eager")
  model.set_experts_implementation("eager")
  model.eval()
  rng = np.random.default_rng(seed)
  redraw(model, rng)
  tokens = rng.integers(0, config.vocab_size, size=(B, S)).astype(np.int32)

  mods = dict(routers(model))
  captured = {}
  hooks = [m.register_forward_hook(lambda m, a, o, n=n: captured.__setitem__(n, a[0].detach()))
           for n, m in mods.items()]
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens).long(),
                position_ids=torch.arange(S).expand(B, S), use_cache=False)
  for h in hooks:
    h.remove()
  logits = out.logits.float().numpy()
  print(f"{name}: transformers {transformers.__version__}, torch {torch.__version__}; logits std "
        f"{logits.std():.3f}, max |logit| {np.abs(logits).max():.3f}, per-position std over vocab "
        f"min {logits.std(-1).min():.3f}")
  assert logits.std(-1).min() > 0.3, "near-constant logits"
  routing_report(name, config, captured, mods)

  arrays = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  assert "tokens" not in arrays and "logits" not in arrays and "config_json" not in arrays
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
  ap.add_argument("--only", nargs="*", choices=sorted(MODELS), default=sorted(MODELS))
  args = ap.parse_args()
  torch.set_num_threads(1)                                     # bitwise-stable reductions
  for name in args.only:
    build(name, args.out)


if __name__ == "__main__":
  main()
