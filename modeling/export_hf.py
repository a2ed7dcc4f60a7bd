"""This suite's parameter pytree -> a Hugging Face checkpoint directory, and back into a run.

The inverse of modeling/convert.py (numpy only, no torch, transformers or safetensors package):

  to_hf(params, cfg, hf_config)   the param pytree -> {HF name: float32 array}: from_hf's exact
                                  inverse (to_hf(from_hf(state, cfg), cfg, hf) == state, bit for
                                  bit, in the layout asked for: the per-expert tensors of
                                  checkpoints on disk by default, transformers v5's fused ones
                                  with fused=True)
  config_to_hf(cfg, family)       a config.json dict that convert.config_from_hf reads back to
                                  cfg's model fields (checked: a field the family cannot say is
                                  refused, naming it)
  save_safetensors(path, tensors) the safetensors format written directly (float32 or bfloat16),
                                  sharded with a model.safetensors.index.json past shard_bytes
  export(dir, params, cfg, hf)    the safetensors and config.json of a checkpoint directory
  load(dir, cfg, hf)              a checkpoint directory -> params in cfg's stored layout
                                  (run.py --init_from)

Every family's names are one `Family` block below (what from_hf reads for that model_type): the
routed experts' prefix and per-expert names on disk (or, for gpt-oss and Llama 4, the writer of
their one fused layout), the dense and shared experts' names, and its config.json writer.
Everything else (attention: GQA with its optional biases, sinks, output bias and QK-norm, or MLA;
the dense layers; the router's correction bias for sigmoid routers) follows cfg, as in from_hf.

pp's padded MoE stack (cfg.layer_layout: inert zero rows so stages may differ) has no HF form:
`unpadded` drops its padding rows back to depth order, `padded` puts a converted model into
them (zeros, as model.init_params draws them).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Mapping

import numpy as np

from modeling import convert
from modeling.config import Config

SHARD_BYTES = 4 * 2**30            # a safetensors file holds at most this much (but one tensor)
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


# ----------------------------------------------------------------------------- families
@dataclasses.dataclass(frozen=True)
class Family:
  """How one HF model_type names what cfg does not decide (convert.from_hf reads the same)."""
  architecture: str                       # config.json "architectures"
  config: Callable                        # cfg -> the family's own config.json fields
  moe: str = "mlp."                       # the MoE block inside a layer (per-expert layout)
  experts: tuple = ("gate_proj", "up_proj", "down_proj")   # per-expert names: wi_0, wi_1, wo
  shared: str = "shared_experts."         # the shared expert inside the MoE block
  shared_gate: str | None = None          # its gate's weight [1, D] (cfg.shared_gate)
  dense: str = "mlp."                     # a dense layer's SwiGLU inside a layer
  # the routed block in the family's own layout, (moe params, prefix, where) -> tensors: its
  # router and experts fused [E, D, 2F] on disk as in memory (gpt-oss, Llama 4), without a
  # correction-bias tensor; None: _moe's gate, correction bias and per-expert (or v5) experts
  routed: Callable | None = None


def _rope_fields(cfg: Config) -> dict:
  """RoPE in transformers v4's keys (v5 reads them too): rope_theta, and YaRN's rope_scaling."""
  out = {"rope_theta": cfg.rope_theta, "rope_scaling": None,
         "max_position_embeddings": cfg.seq_len}
  if cfg.yarn_factor:
    out["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.yarn_factor,
                           "original_max_position_embeddings": cfg.yarn_original_max,
                           "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow,
                           "mscale": cfg.yarn_mscale, "mscale_all_dim": cfg.yarn_mscale_all_dim}
    if not cfg.yarn_truncate:                 # the ramp's bounds unrounded (gpt-oss); absent: True
      out["rope_scaling"]["truncate"] = False
    out["max_position_embeddings"] = max(cfg.seq_len,
                                         int(cfg.yarn_original_max * cfg.yarn_factor))
  elif cfg.llama3_factor:
    out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.llama3_factor,
                           "low_freq_factor": cfg.llama3_low_freq_factor,
                           "high_freq_factor": cfg.llama3_high_freq_factor,
                           "original_max_position_embeddings": cfg.llama3_original_max}
    out["max_position_embeddings"] = max(cfg.seq_len,
                                         int(cfg.llama3_original_max * cfg.llama3_factor))
  return out


def _gqa_fields(cfg: Config) -> dict:
  return {"num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim}


def _mixtral(cfg: Config) -> dict:
  return {**_gqa_fields(cfg), "num_local_experts": cfg.n_experts, "intermediate_size": cfg.d_ff,
          "router_aux_loss_coef": cfg.aux_loss_coef, "sliding_window": None,
          "attention_bias": False}


def _qwen(cfg: Config) -> dict:
  """Qwen2-MoE / Qwen3-MoE: every dense layer (the prefix and those inside) is in
  mlp_only_layers."""
  out = {**_gqa_fields(cfg), "num_experts": cfg.n_experts, "moe_intermediate_size": cfg.d_ff,
         "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
         "mlp_only_layers": [i for i, moe in enumerate(cfg.layer_is_moe) if not moe],
         "intermediate_size": cfg.dense_d_ff or cfg.d_ff, "router_aux_loss_coef": cfg.aux_loss_coef,
         "use_sliding_window": False, "sliding_window": None}
  if cfg.n_shared_experts:
    out["shared_expert_intermediate_size"] = cfg.shared_d_ff
  if not cfg.qk_norm:                                     # qwen2_moe: its q/k/v biases
    out["qkv_bias"] = cfg.qkv_bias
  return out


def _deepseek_moe(cfg: Config) -> dict:
  if cfg.dense_inside:
    raise ValueError(f"mlp_only_layers={cfg.mlp_only_layers}: DeepSeek's, Kimi's and GLM's "
                     "config.json place dense layers only before the MoE layers "
                     "(first_k_dense_replace)")
  return {"n_routed_experts": cfg.n_experts, "moe_intermediate_size": cfg.d_ff,
          "n_shared_experts": cfg.n_shared_experts, "n_group": cfg.n_group,
          "topk_group": cfg.topk_group, "routed_scaling_factor": cfg.routed_scaling_factor,
          "norm_topk_prob": cfg.norm_topk_prob, "first_k_dense_replace": cfg.first_k_dense_replace,
          "intermediate_size": cfg.dense_d_ff or cfg.d_ff, "moe_layer_freq": 1}


def _glm4(cfg: Config) -> dict:
  return {**_gqa_fields(cfg), **_deepseek_moe(cfg), "attention_bias": cfg.qkv_bias,
          "use_qk_norm": cfg.qk_norm,
          "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim if cfg.rotary_dim else 1.0}


def _mla(cfg: Config) -> dict:
  """DeepSeek-V2 / V3, Kimi-K2: MLA, their MoE and balance loss."""
  out = {**_deepseek_moe(cfg), "num_key_value_heads": cfg.n_heads,
         "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
         "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
         "v_head_dim": cfg.v_head_dim, "head_dim": cfg.qk_rope_head_dim,
         "rope_interleave": cfg.rope_interleave, "attention_bias": False,
         "num_nextn_predict_layers": 0, "aux_loss_alpha": cfg.aux_loss_coef,
         "seq_aux": cfg.aux_loss_kind == "sequence"}
  if cfg.router == "softmax":                              # deepseek_v2
    out.update(scoring_func="softmax",
               topk_method="group_limited_greedy" if cfg.n_group > 1 else "greedy")
  else:
    out.update(scoring_func="sigmoid", topk_method="noaux_tc")
  return out


def _depth_attentions(cfg: Config, family_name: str, kinds: dict) -> list:
  """Each layer's attention kind (attention_pattern over the depth) -> the family's word for it
  (kinds); ValueError naming attention_pattern when a kind has none."""
  bad = sorted(set(cfg.layer_attentions) - set(kinds))
  if bad:
    raise ValueError(f"attention_pattern={cfg.attention_pattern!r}: {family_name} has no "
                     f"{', '.join(bad)} layers ({', '.join(kinds)} only)")
  period = cfg.layer_attentions
  return [kinds[period[i % len(period)]] for i in range(cfg.n_layers)]


def _gpt_oss(cfg: Config) -> dict:
  """gpt-oss: layer_types from attention_pattern (full, sliding), sinks, one attention_bias for
  q/k/v and o, the router's and experts' biases, the clamped SwiGLU; every layer MoE."""
  types = _depth_attentions(cfg, "gpt_oss", {"full": "full_attention",
                                             "sliding": "sliding_attention"})
  if not cfg.swiglu_limit:
    raise ValueError("swiglu_limit=0 (the plain SwiGLU): gpt-oss's experts always compute the "
                     "clamped (up + 1) * gate * sigmoid(alpha * gate), at limit 0 too")
  return {**_gqa_fields(cfg), "num_local_experts": cfg.n_experts, "intermediate_size": cfg.d_ff,
          "layer_types": types, "sliding_window": cfg.sliding_window or None,
          "attention_bias": cfg.qkv_bias, "swiglu_limit": cfg.swiglu_limit,
          "swiglu_alpha": cfg.swiglu_alpha, "router_aux_loss_coef": cfg.aux_loss_coef}


def _llama4(cfg: Config) -> dict:
  """Llama 4's text model: MoE layers by index (moe_layers; the rest dense, of width
  intermediate_size_mlp), NoPE layers (no_rope_layers 0) with temperature tuning, the RoPE
  layers' chunk (attention_chunk_size), the L2 QK-norm (use_qk_norm), llama3 RoPE scaling."""
  if cfg.yarn_factor:
    raise ValueError(f"yarn_factor={cfg.yarn_factor}: transformers' Llama 4 reads any "
                     "rope_scaling as llama3's")
  local = "local" in cfg.layer_attentions
  types = _depth_attentions(cfg, "llama4_text", {"full": "full_attention",
                                                 "local": "chunked_attention",
                                                 "nope": "full_attention"})
  nope = [cfg.layer_attentions[i % len(cfg.layer_attentions)] == "nope"
          for i in range(cfg.n_layers)]
  moe_layers = [i for i, moe in enumerate(cfg.layer_is_moe) if moe]
  out = {**_gqa_fields(cfg), "num_local_experts": cfg.n_experts, "intermediate_size": cfg.d_ff,
         "intermediate_size_mlp": cfg.dense_d_ff or cfg.d_ff, "moe_layers": moe_layers,
         "no_rope_layers": [int(not n) for n in nope], "layer_types": types,
         "attention_chunk_size": cfg.local_chunk if local else None,
         "use_qk_norm": cfg.qk_l2_norm, "attention_bias": cfg.qkv_bias,
         "attn_temperature_tuning": bool(cfg.nope_attn_scale),
         "attn_scale": cfg.nope_attn_scale or 0.1, "floor_scale": cfg.nope_floor_scale,
         "router_jitter_noise": 0.0, "router_aux_loss_coef": cfg.aux_loss_coef}
  step = next((s for s in range(1, cfg.n_layers + 1)
               if list(range(s - 1, cfg.n_layers, s)) == moe_layers), None)
  if step:                                     # the same layers as moe_layers (which it yields to)
    out["interleave_moe_layer_step"] = step
  return out


def _no_bias(m: dict, where: str, whose: str) -> None:
  """The router's correction bias must be zeros where the checkpoint has no tensor for it."""
  if np.any(np.asarray(m["bias"]) != 0):
    raise ValueError(f"{where}: a non-zero router bias, which {whose} checkpoint has no tensor "
                     "for (trained with bias_update_rate > 0?)")


def _interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """[..., F] twice -> [..., 2F]: a in the even columns, b in the odd ones."""
  return np.ascontiguousarray(np.stack([a, b], axis=-1).reshape(a.shape[:-1] + (2 * a.shape[-1],)))


def _gpt_oss_moe(m: dict, p: str, where: str) -> dict:
  """convert._gpt_oss_moe's inverse: router.weight [E, D] and router.bias [E];
  experts.gate_up_proj [E, D, 2F] (gate the even columns, up the odd ones) and its bias [E, 2F];
  experts.down_proj [E, F, D] and its bias [E, D] (the suite's [in, out] as they are)."""
  _no_bias(m, where, "a gpt-oss")
  f = {k: np.asarray(m[k], np.float32) for k in ("router_b", "wi_0", "wi_1", "wo", "bi_0", "bi_1",
                                                 "bo")}
  return {p + "router.weight": _t(m["router"]), p + "router.bias": f["router_b"],
          p + "experts.gate_up_proj": _interleave(f["wi_0"], f["wi_1"]),
          p + "experts.gate_up_proj_bias": _interleave(f["bi_0"], f["bi_1"]),
          p + "experts.down_proj": f["wo"], p + "experts.down_proj_bias": f["bo"]}


def _llama4_moe(m: dict, p: str, where: str) -> dict:
  """convert._llama4_moe's inverse: router.weight [E, D]; experts.gate_up_proj [E, D, 2F] (gate
  the first F columns, up the last), experts.down_proj [E, F, D] (the suite's [in, out])."""
  _no_bias(m, where, "a Llama 4")
  wi_0, wi_1, wo = (np.asarray(m[k], np.float32) for k in ("wi_0", "wi_1", "wo"))
  return {p + "router.weight": _t(m["router"]),
          p + "experts.gate_up_proj": np.ascontiguousarray(np.concatenate([wi_0, wi_1], axis=-1)),
          p + "experts.down_proj": wo}


FAMILIES: dict[str, Family] = {
    "mixtral": Family("MixtralForCausalLM", _mixtral, moe="block_sparse_moe.",
                      experts=("w1", "w3", "w2")),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", _qwen, shared="shared_expert.",
                        shared_gate="shared_expert_gate.weight"),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", _qwen),
    "glm4_moe": Family("Glm4MoeForCausalLM", _glm4),
    "deepseek_v2": Family("DeepseekV2ForCausalLM", _mla),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", _mla),
    "kimi_k2": Family("DeepseekV3ForCausalLM", _mla),
    "gpt_oss": Family("GptOssForCausalLM", _gpt_oss, routed=_gpt_oss_moe),
    "llama4_text": Family("Llama4ForCausalLM", _llama4, moe="feed_forward.",
                          shared="shared_expert.", dense="feed_forward.", routed=_llama4_moe),
}


def family(hf_config: Mapping) -> Family:
  mt = hf_config.get("model_type")
  if mt not in FAMILIES:
    raise ValueError(f"model_type {mt!r} has no export (modeling/export_hf.py FAMILIES: "
                     f"{', '.join(FAMILIES)})")
  return FAMILIES[mt]


def _comparable(cfg: Config) -> Config:
  """cfg's model with the fields that do not change it at their defaults: the stored layout
  (layer_layout, layer_stages), what MLA does not read (head_dim, n_kv_heads), the dense width
  without dense layers, YaRN's and llama3's knobs without their scaling, the group score without
  groups, NoPE's temperature tuning without a NoPE layer (or its floor with the tuning off); and
  attention_pattern as its shortest period over the depth."""
  d = {f.name: f.default for f in dataclasses.fields(Config)}
  off = {"layer_layout": d["layer_layout"], "layer_stages": d["layer_stages"]}
  if cfg.mla:
    off.update(head_dim=d["head_dim"], n_kv_heads=d["n_kv_heads"])
  if not cfg.n_dense_layers:
    off["dense_d_ff"] = d["dense_d_ff"]
  if not cfg.yarn_factor:
    off.update({k: d[k] for k in d if k.startswith("yarn_")})
  if not cfg.llama3_factor:
    off.update({k: d[k] for k in d if k.startswith("llama3_")})
  kinds = cfg.layer_attentions
  # "local,nope,local,nope" and "local,nope" (or "full" and "") are one model: a config.json
  # lists each layer's kind, and convert reads back the shortest period
  off["attention_pattern"] = convert._pattern(  # noqa: SLF001 (convert's own reading)
      [kinds[i % len(kinds)] for i in range(cfg.n_layers)])
  if "nope" not in kinds or not cfg.nope_attn_scale:
    # the tuning scales the NoPE layers' queries only; convert reads attn_scale only when the
    # tuning is on and a NoPE layer exists, floor_scale always (Llama 4) or never (the others)
    off["nope_floor_scale"] = d["nope_floor_scale"]
    if "nope" not in kinds:
      off["nope_attn_scale"] = d["nope_attn_scale"]
  if cfg.n_group == 1:
    off["group_score"] = d["group_score"]
  return cfg.replace(**off)


def model_mismatch(cfg: Config, hf_config: Mapping) -> list[str]:
  """The model fields on which convert.config_from_hf(hf_config) and cfg differ ('name=got
  (config.json) != want')."""
  back = _comparable(Config(**convert.config_from_hf(hf_config)))
  want = _comparable(cfg).model_fields()
  return [f"{k}={v!r} (config.json) != {want[k]!r}" for k, v in back.model_fields().items()
          if want[k] != v]


def config_to_hf(cfg: Config, family_name: str, dtype: str = "float32") -> dict:
  """A config.json for cfg as `family_name` (a model_type of FAMILIES); ValueError naming the
  fields that family's config cannot express (checked by reading it back with
  convert.config_from_hf)."""
  fam = family({"model_type": family_name})
  hf = {"model_type": family_name, "architectures": [fam.architecture],
        "vocab_size": cfg.vocab, "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.n_heads, "num_hidden_layers": cfg.n_layers,
        "num_experts_per_tok": cfg.top_k, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_dropout": 0.0, "torch_dtype": dtype,
        **_rope_fields(cfg), **fam.config(cfg)}
  try:
    off = model_mismatch(cfg, hf)
  except (ValueError, TypeError, KeyError) as e:
    raise ValueError(f"this model has no {family_name} form: {e}") from None
  if off:
    raise ValueError(f"this model has no {family_name} form: " + "; ".join(off))
  return hf


def family_of(cfg: Config) -> str:
  """The first model_type of FAMILIES whose config.json expresses cfg; ValueError if none."""
  why = []
  for name in FAMILIES:
    try:
      config_to_hf(cfg, name)
      return name
    except ValueError as e:
      why.append(str(e).split(": ", 1)[-1][:80])
  raise ValueError("no Hugging Face model_type expresses this model (" +
                   "; ".join(f"{n}: {w}" for n, w in zip(FAMILIES, why)) + ")")


def check_export(cfg: Config, hf_config: Mapping | None = None) -> str:
  """Whether cfg's params, trained, can be exported (run.py --export_hf asks before compiling)
  -> the model_type they will be written as: hf_config's (which must describe cfg's model), or
  family_of(cfg)'s. ValueError saying why not. A trained router bias (bias_update_rate) has a
  tensor only in a DeepSeek-style checkpoint: a sigmoid router outside the routed families."""
  if hf_config is None:
    model_type = family_of(cfg)
  else:
    family(hf_config)
    off = model_mismatch(cfg, hf_config)
    if off:
      raise ValueError("the model is not its config.json's: " + "; ".join(off))
    model_type = hf_config["model_type"]
  if cfg.bias_update_rate and (cfg.router != "sigmoid"
                               or FAMILIES[model_type].routed is not None):
    raise ValueError(f"bias_update_rate={cfg.bias_update_rate} trains a router bias, which a "
                     f"{model_type} checkpoint with a {cfg.router} router has no tensor for")
  return model_type


# ----------------------------------------------------------------------------- tensors
def _t(w) -> np.ndarray:
  """[d_in, *out] (the suite's) -> nn.Linear's [prod(out), d_in]."""
  w = np.asarray(w, np.float32)
  return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)


def _attention(a: dict, p: str, mla: bool) -> dict:
  if not mla:
    h, dh, d = a["wo"].shape
    out = {p + "q_proj.weight": _t(a["wq"]), p + "k_proj.weight": _t(a["wk"]),
           p + "v_proj.weight": _t(a["wv"]), p + "o_proj.weight": _t(a["wo"].reshape(h * dh, d))}
    for b, n in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj"), ("bo", "o_proj")):
      if b in a:
        out[f"{p}{n}.bias"] = np.asarray(a[b], np.float32).reshape(-1)
    for n in ("q_norm", "k_norm"):
      if n in a:
        out[f"{p}{n}.weight"] = np.asarray(a[n], np.float32)
    if "sinks" in a:                                        # gpt-oss: one logit per query head
      out[p + "sinks"] = np.asarray(a["sinks"], np.float32)
    return out
  out = {}
  if "wq_a" in a:
    out[p + "q_a_proj.weight"] = _t(a["wq_a"])
    out[p + "q_a_layernorm.weight"] = np.asarray(a["q_norm"], np.float32)
    out[p + "q_b_proj.weight"] = _t(a["wq_b"])
  else:
    out[p + "q_proj.weight"] = _t(a["wq"])
  h, v, d = a["wo"].shape
  out.update({p + "kv_a_proj_with_mqa.weight": _t(a["wkv_a"]),
              p + "kv_a_layernorm.weight": np.asarray(a["kv_norm"], np.float32),
              p + "kv_b_proj.weight": _t(a["wkv_b"]),
              p + "o_proj.weight": _t(a["wo"].reshape(h * v, d))})
  return out


def _swiglu(m: dict, p: str, names=("gate_proj", "up_proj", "down_proj")) -> dict:
  g, u, o = names
  return {f"{p}{g}.weight": _t(m["wi_0"]), f"{p}{u}.weight": _t(m["wi_1"]),
          f"{p}{o}.weight": _t(m["wo"])}


def _moe(m: dict, p: str, fam: Family, sigmoid: bool, fused: bool, where: str) -> dict:
  out = {p + "gate.weight": _t(m["router"])}
  if sigmoid:
    out[p + "gate.e_score_correction_bias"] = np.asarray(m["bias"], np.float32)
  else:
    _no_bias(m, where, "a softmax router's")
  wi_0, wi_1, wo = (np.asarray(m[k], np.float32) for k in ("wi_0", "wi_1", "wo"))
  if fused:                                    # [E, 2F, D] = [gate rows | up rows], [E, D, F]
    out[p + "experts.gate_up_proj"] = np.ascontiguousarray(
        np.concatenate([wi_0, wi_1], axis=2).transpose(0, 2, 1))
    out[p + "experts.down_proj"] = np.ascontiguousarray(wo.transpose(0, 2, 1))
    return out
  for e in range(wi_0.shape[0]):
    out.update(_swiglu({"wi_0": wi_0[e], "wi_1": wi_1[e], "wo": wo[e]}, f"{p}experts.{e}.",
                       fam.experts))
  return out


def _layer(tree: dict, i: int) -> dict:
  return {k: _layer(v, i) if isinstance(v, dict) else v[i] for k, v in tree.items()}


def to_hf(params: dict, cfg: Config, hf_config: Mapping, *, fused: bool = False) -> dict:
  """The suite's param pytree (numpy or fully addressable jax arrays; cfg's stored layout, pp's
  padding rows dropped) -> {HF name: float32 array} for hf_config's model_type. fused: the
  routed experts as transformers v5's state_dict holds them (mlp.experts.gate_up_proj /
  down_proj) instead of the per-expert tensors of checkpoints on disk; gpt-oss and Llama 4 have
  one layout, fused [E, D, 2F], either way."""
  fam = family(hf_config)
  params = unpadded(params, cfg)
  out = {"model.embed_tokens.weight": np.asarray(params["embed"], np.float32)}
  row = {False: 0, True: 0}                       # the next row of each stack, in depth order
  for i, is_moe in enumerate(cfg.layer_is_moe):
    p = f"model.layers.{i}."
    lp = _layer(params["layers" if is_moe else "dense_layers"], row[is_moe])
    row[is_moe] += 1
    out.update(_attention(lp["attn"], p + "self_attn.", cfg.mla))
    if not is_moe:
      out.update(_swiglu(lp["mlp"], p + fam.dense))
    elif fam.routed is not None:
      m = p + fam.moe
      out.update(fam.routed(lp["moe"], m, f"layer {i}"))
    else:
      m = p + ("mlp." if fused else fam.moe)
      out.update(_moe(lp["moe"], m, fam, cfg.router == "sigmoid", fused, f"layer {i}"))
    if is_moe and cfg.n_shared_experts:
      out.update(_swiglu(lp["shared"], m + fam.shared))
      if cfg.shared_gate:
        if fam.shared_gate is None:
          raise ValueError(f"{hf_config['model_type']} has no shared-expert gate")
        out[m + fam.shared_gate] = np.asarray(lp["shared"]["wg"], np.float32)[None]
    out[p + "input_layernorm.weight"] = np.asarray(lp["attn_norm"], np.float32)
    out[p + "post_attention_layernorm.weight"] = np.asarray(lp["mlp_norm"], np.float32)
  out["model.norm.weight"] = np.asarray(params["final_norm"], np.float32)
  out["lm_head.weight"] = _t(params["unembed"])
  return out


# ----------------------------------------------------------------------------- padded stacks
def _depth_rows(cfg: Config) -> list[int]:
  """For each MoE layer in depth order, the row of the stored stack holding it."""
  slots = cfg.layer_slots
  return [slots.index(j) for j in range(cfg.n_moe_layers)]


def _take(tree: dict, rows) -> dict:
  """Every leaf of a nested dict of stacked params, its rows `rows` in that order."""
  return {k: _take(v, rows) if isinstance(v, dict) else np.asarray(v)[rows]
          for k, v in tree.items()}


def _dense_rows(params: dict, cfg: Config, to_depth: bool) -> dict:
  """The dense rows inside the stack (config.dense_slots) stored -> depth order (to_depth),
  or back."""
  if cfg.dense_order is None:
    return params
  rows = list(cfg.dense_order if to_depth else cfg.dense_slots)
  return {**params, "dense_layers": _take(params["dense_layers"], rows)}


def unpadded(params: dict, cfg: Config) -> dict:
  """params in cfg's stored layout -> the MoE stack (and the dense rows inside it) in depth
  order, padding rows dropped (the params themselves when the stacks have no layout)."""
  params, rows = _dense_rows(params, cfg, True), _depth_rows(cfg)
  if rows == list(range(len(cfg.layer_slots))):
    return params
  return {**params, "layers": _take(params["layers"], rows)}


def padded(params: dict, cfg: Config) -> dict:
  """The MoE stack (and the dense rows inside it) in depth order -> cfg's stored layout
  (padding rows zeros, as model.init_params draws them)."""
  params, rows, n = _dense_rows(params, cfg, False), _depth_rows(cfg), len(cfg.layer_slots)
  if rows == list(range(n)):
    return params

  def put(a):
    out = np.zeros((n,) + a.shape[1:], a.dtype)
    out[rows] = a
    return out
  spread = lambda t: {k: spread(v) if isinstance(v, dict) else put(np.asarray(v))
                      for k, v in t.items()}
  return {**params, "layers": spread(params["layers"])}


def checkpoint_files(path: str) -> list[str]:
  """The safetensors files convert.load_safetensors reads for a checkpoint directory (its
  index's shards, or every *.safetensors); ValueError when there are none."""
  return convert._safetensor_files(path)       # noqa: SLF001 (convert's own choice of files)


def load(path: str, cfg: Config, hf_config: Mapping | None = None) -> dict:
  """A checkpoint directory (config.json and safetensors) -> the suite's float32 params for cfg,
  in its stored layout. Each file is memory-mapped (convert.load_safetensors); DeepSeek's
  multi-token-prediction layers are skipped. ValueError on a missing, unexpected or misshaped
  tensor."""
  hf = convert.read_config(path) if hf_config is None else hf_config
  flat = cfg.replace(layer_layout="", layer_stages=0)
  params = convert.from_hf(convert.load_safetensors(path), flat,
                           ignore=convert.mtp_prefixes(hf))
  return padded(params, cfg)


# ----------------------------------------------------------------------------- safetensors
def _bf16_bits(a: np.ndarray) -> np.ndarray:
  """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays NaN."""
  u = np.ascontiguousarray(a, np.float32).view(np.uint32)
  r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
  nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
  r = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), r)
  return r.astype("<u2")


def _encode(a, dtype: str) -> np.ndarray:
  if dtype == "bfloat16":
    return _bf16_bits(np.asarray(a, np.float32))
  return np.ascontiguousarray(np.asarray(a), "<f4")


def _write_file(path: str, tensors: list, dtype: str) -> None:
  """One safetensors file: 8-byte little-endian header length, the JSON header (padded with
  spaces to a multiple of 8), the tensors' little-endian bytes back to back."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  size = 2 if dtype == "bfloat16" else 4
  for name, a in tensors:
    n = int(np.prod(a.shape)) * size
    header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + n]}
    offset += n
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(np.uint64(len(text)).astype("<u8").tobytes())
    f.write(text)
    for _, a in tensors:
      f.write(memoryview(_encode(a, dtype)).cast("B"))
  os.replace(tmp, path)


def save_safetensors(path: str, tensors: Mapping[str, np.ndarray], dtype: str = "float32",
                     shard_bytes: int = SHARD_BYTES) -> list[str]:
  """tensors -> path (NAME.safetensors) as float32 or bfloat16 (rounded to nearest even), or,
  when they hold more than shard_bytes, NAME-00001-of-0000N.safetensors .. beside it (each at
  most shard_bytes, but a larger tensor on its own) and NAME.safetensors.index.json (its
  weight_map). convert.load_safetensors reads them back. -> the files written."""
  if dtype not in SAFETENSORS_DTYPES:
    raise ValueError(f"dtype {dtype!r}: choose from {', '.join(SAFETENSORS_DTYPES)}")
  size = 2 if dtype == "bfloat16" else 4
  items = [(n, np.asarray(a)) for n, a in tensors.items()]
  total = sum(int(np.prod(a.shape)) * size for _, a in items)
  if total <= shard_bytes:
    _write_file(path, items, dtype)
    return [path]
  shards, cur, cur_bytes = [], [], 0
  for name, a in items:
    n = int(np.prod(a.shape)) * size
    if cur and cur_bytes + n > shard_bytes:
      shards.append(cur)
      cur, cur_bytes = [], 0
    cur.append((name, a))
    cur_bytes += n
  shards.append(cur)
  base = path.removesuffix(".safetensors")
  folder, stem = os.path.split(base)
  names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for shard, name in zip(shards, names):
    _write_file(os.path.join(folder, name), shard, dtype)
    weight_map.update({t: name for t, _ in shard})
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  with open(base + ".safetensors.index.json", "w") as f:
    json.dump(index, f, indent=2)
  return [os.path.join(folder, n) for n in names] + [base + ".safetensors.index.json"]


def export(path: str, params: dict, cfg: Config, hf_config: Mapping | None = None,
           dtype: str = "float32", shard_bytes: int = SHARD_BYTES) -> dict:
  """A checkpoint directory transformers (and run.py --init_from) loads: model.safetensors (or
  its shards and index) and config.json, written last. hf_config: the config.json the model came
  from, its fields kept (it must describe cfg's model: ValueError otherwise); None: one written
  by config_to_hf for the first family that expresses cfg. -> the config.json written."""
  model_type = check_export(cfg, hf_config)
  if hf_config is None:
    hf = config_to_hf(cfg, model_type, dtype)
  else:
    hf = dict(hf_config)
    for key in [k for k in ("torch_dtype", "dtype") if k in hf] or ["torch_dtype"]:
      hf[key] = dtype                          # v4's key, v5's, or v4's where it had neither
  os.makedirs(path, exist_ok=True)
  save_safetensors(os.path.join(path, "model.safetensors"), to_hf(params, cfg, hf), dtype,
                   shard_bytes)
  tmp = os.path.join(path, "config.json.tmp")
  with open(tmp, "w") as f:
    json.dump(hf, f, indent=2)
  os.replace(tmp, os.path.join(path, "config.json"))
  return hf
