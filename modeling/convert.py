"""Hugging Face MoE checkpoints (FAMILIES) -> this suite's config and parameter pytree.

numpy only (no torch, no transformers). A user with a real checkpoint directory:

  import json
  from modeling import convert
  from modeling.config import Config
  hf = json.load(open("ckpt/config.json"))
  cfg = Config(**convert.config_from_hf(hf, seq_len=4096, batch=8)).validate()
  params = convert.from_hf(convert.load_safetensors("ckpt"), cfg)   # float32 numpy pytree

`config_from_hf` refuses (ValueError) what the suite does not model: tied embeddings, attention
biases where the family has none, scaled RoPE other than YaRN and llama3 (linear, ...), sliding
windows outside gpt-oss's layer types, activations other than SiLU, other model types; the
tensor reader refuses quantized (FP8, MXFP4) tensors. `from_hf` refuses missing or unexpected tensors
and every shape mismatch, so a wrong config never loads silently. DeepSeek-V3's multi-token
prediction layers (model.layers.61.* in the release) are no part of the suite's model: drop
them with `ignore=convert.mtp_prefixes(hf)`.

Conventions. HF's nn.Linear weights are [out, in]; the suite's are [in, out], so every
projection is transposed, and the head dims are split out of the flat ones:
  q_proj [H*Dh, D] -> wq [D, H, Dh]; o_proj [D, H*Dh] -> wo [H, Dh, D]
  kv_b_proj [H*(nope+v), kv_lora] -> wkv_b [kv_lora, H, nope+v] (per head: [nope | v])
  expert w1 / gate_proj [F, D] -> wi_0[e] [D, F]; w3 / up_proj -> wi_1[e]; w2 / down_proj
  [D, F] -> wo[e] [F, D]; the router gate [E, D] -> router [D, E]; lm_head [V, D] -> unembed [D, V].
MLA keeps HF's order inside a head: q = [nope | rope], kv_a_proj_with_mqa out = [kv_lora | rope].
No RoPE dims are permuted: with rope_interleave the suite de-interleaves the rope parts itself
(x0, x1, x2, x3, ..) -> (x0, x2, .., x1, x3, ..) before its rotate-half RoPE, as HF does.
Mixtral's routers have no bias: "bias" is zeros. The pytree's "layers" stacks the MoE layers
only; "dense_layers" stacks DeepSeek's first first_k_dense_replace dense-FFN layers (absent when
there are none).

Both transformers layouts of the routed experts load: the per-expert tensors of checkpoints on
disk (and of transformers v4 in memory: block_sparse_moe.experts.{e}.w1/w2/w3 for Mixtral,
mlp.experts.{e}.gate_proj/up_proj/down_proj for DeepSeek) and the fused ones of transformers v5's
state_dict (mlp.experts.gate_up_proj [E, 2F, D] = [gate rows | up rows], mlp.experts.down_proj
[E, D, F]; v5 renames Mixtral's block_sparse_moe to mlp).
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Mapping

import numpy as np

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v2", "deepseek_v3",
            "kimi_k2", "gpt_oss", "llama4_text", "llama4")
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "kimi_k2")   # kimi_k2: DeepSeek-V3's architecture


def _refuse(msg: str):
  raise ValueError(msg)


def _rope(hf: dict, default_theta: float) -> dict:
  """RoPE fields of Config from a v4 (rope_theta, rope_scaling, partial_rotary_factor) or v5
  (rope_parameters) config: rope_theta, YaRN's, and the rotary fraction (partial_rotary). Other
  scaled RoPE kinds are refused."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if params and all(isinstance(v, dict) for v in params.values()):
    _refuse(f"per-layer-type rope_parameters {sorted(params)} are not modelled")
  kind = params.get("rope_type", params.get("type", "default"))
  theta = params.get("rope_theta", hf.get("rope_theta"))
  out = {"rope_theta": float(default_theta if theta is None else theta),
         "partial_rotary": float(params.get("partial_rotary_factor",
                                            hf.get("partial_rotary_factor") or 1.0))}
  if kind == "yarn":
    if params.get("attention_factor") is not None:
      _refuse("rope_scaling.attention_factor is not modelled (YaRN's mscale fields are)")
    out.update(yarn_factor=float(params["factor"]),
               yarn_original_max=int(params.get("original_max_position_embeddings")
                                     or hf["max_position_embeddings"]),
               yarn_beta_fast=float(params.get("beta_fast") or 32),
               yarn_beta_slow=float(params.get("beta_slow") or 1),
               yarn_mscale=float(params.get("mscale") or 0),
               yarn_mscale_all_dim=float(params.get("mscale_all_dim") or 0),
               yarn_truncate=bool(params.get("truncate", True)))
  elif kind == "llama3":
    out.update(llama3_factor=float(params["factor"]),
               llama3_low_freq_factor=float(params.get("low_freq_factor", 1.0)),
               llama3_high_freq_factor=float(params.get("high_freq_factor", 4.0)),
               llama3_original_max=int(params["original_max_position_embeddings"]))
  elif kind != "default":
    _refuse(f"rope type {kind!r} is not modelled (default, yarn and llama3 are; linear, "
            "dynamic, longrope ... are not)")
  return out


def _qwen_dense(hf: dict) -> list[int]:
  """Qwen-MoE's dense layers: mlp_only_layers, and every layer not on decoder_sparse_step."""
  n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step") or 1
  only = set(hf.get("mlp_only_layers") or ())
  bad = sorted(i for i in only if not 0 <= i < n)
  if bad:
    _refuse(f"mlp_only_layers {bad} outside [0, num_hidden_layers={n})")
  return [i for i in range(n) if i in only or (i + 1) % step != 0]


def _dense_fields(dense: list[int], width: int) -> dict:
  """Dense layers at these depth indices -> Config fields: a prefix (first_k_dense_replace)
  when they all lead the stack, else every one in mlp_only_layers (so that a periodic stack,
  Maverick's, is one period from its first layer); dense_d_ff their width."""
  if dense == list(range(len(dense))):
    return dict(first_k_dense_replace=len(dense), dense_d_ff=width if dense else 0)
  return dict(mlp_only_layers=",".join(map(str, dense)), dense_d_ff=width)


def config_from_hf(hf: Mapping[str, Any], **overrides) -> dict:
  """An HF config (config.json as a dict, or PretrainedConfig.to_dict()) -> keyword arguments of
  modeling.config.Config; `overrides` (run fields: seq_len, batch, dtype, ...) are merged last.
  Every field that changes the computation is read or refused in one line naming it."""
  hf = dict(hf)
  mt = hf.get("model_type")
  if mt == "llama4":                            # Llama4ForConditionalGeneration: its text model
    hf = dict(hf.get("text_config") or {}, model_type="llama4_text")
    mt = "llama4_text"
  if mt not in FAMILIES:
    _refuse(f"model_type {mt!r} is not supported; supported: {', '.join(FAMILIES)}")
  if hf.get("tie_word_embeddings", False):
    _refuse("tie_word_embeddings=True is not modelled (the suite has a separate unembed)")
  if hf.get("use_sliding_window") or (mt in ("mixtral", "glm4_moe")
                                      and hf.get("sliding_window") is not None):
    _refuse(f"sliding_window={hf.get('sliding_window')} is not modelled (full causal attention "
            "only)")
  if hf.get("hidden_act", "silu") != "silu":
    _refuse(f"hidden_act={hf['hidden_act']!r} is not modelled (SwiGLU experts: silu)")
  for name in ("attention_dropout", "hidden_dropout"):
    if hf.get(name):
      _refuse(f"{name}={hf[name]} is not modelled (no dropout)")
  rope = _rope(hf, {"mixtral": 1e6, "gpt_oss": 150000.0, "llama4_text": 500000.0}.get(mt, 10000.0))
  partial = rope.pop("partial_rotary")
  common = dict(vocab=hf["vocab_size"], d_model=hf["hidden_size"],
                n_heads=hf["num_attention_heads"], n_layers=hf["num_hidden_layers"],
                top_k=hf["num_experts_per_tok"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                **rope)
  if "router_aux_loss_coef" in hf:                  # Mixtral, Qwen: the load-balance loss weight
    common["aux_loss_coef"] = float(hf["router_aux_loss_coef"])
  if mt in MLA_FAMILIES:
    kw = _mla(hf, mt, common)
  else:
    heads = hf["num_attention_heads"]
    dh = hf.get("head_dim") or hf["hidden_size"] // heads
    kw = dict(common, attention="gqa", n_kv_heads=hf.get("num_key_value_heads") or heads,
              head_dim=dh)
    if partial != 1.0:
      if mt != "glm4_moe":
        _refuse(f"partial_rotary_factor={partial} is not modelled for {mt}")
      kw["rotary_dim"] = int(dh * partial)
    if mt == "mixtral":
      if hf.get("attention_bias"):
        _refuse("attention_bias=True is not modelled for mixtral")
      kw.update(n_experts=hf["num_local_experts"], d_ff=hf["intermediate_size"],
                router="softmax", norm_topk_prob=True)
    elif mt in ("qwen2_moe", "qwen3_moe"):
      if mt == "qwen3_moe" and hf.get("attention_bias"):
        _refuse("attention_bias=True is not modelled for qwen3_moe (its o_proj would carry a "
                "bias too)")
      kw.update(_dense_fields(_qwen_dense(hf), hf["intermediate_size"]),
                n_experts=hf.get("num_experts") or hf["num_local_experts"],
                d_ff=hf["moe_intermediate_size"], router="softmax",
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                qkv_bias=mt == "qwen2_moe" and bool(hf.get("qkv_bias", True)),
                qk_norm=mt == "qwen3_moe")
      shared = (hf.get("shared_expert_intermediate_size") or 0) if mt == "qwen2_moe" else 0
      if shared:                              # one shared expert of its own width, gated
        kw.update(n_shared_experts=1, shared_width=shared, shared_gate=True)
    elif mt == "gpt_oss":
      kw.update(_gpt_oss(hf))
    elif mt == "llama4_text":
      kw.update(_llama4(hf))
    else:                                                        # glm4_moe
      kw.update(_deepseek_moe(hf), qkv_bias=bool(hf.get("attention_bias", False)),
                qk_norm=bool(hf.get("use_qk_norm", False)), router="sigmoid")
  kw.update(overrides)
  return kw


_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def _pattern(kinds: list) -> str:
  """Each layer's attention kind (Config.LAYER_ATTENTIONS) -> Config.attention_pattern: the
  shortest period that repeats over the depth ("" when every layer is full)."""
  n = len(kinds)
  period = next(p for p in range(1, n + 1)
                if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))
  return "" if kinds[:period] == ["full"] else ",".join(kinds[:period])


def _attention_pattern(hf: dict) -> str:
  """gpt-oss's layer_types (one per layer) -> Config.attention_pattern (_pattern); refused when a
  type is not modelled."""
  n = hf["num_hidden_layers"]
  types = list(hf.get("layer_types") or
               ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)])
  unknown = sorted(set(types) - set(_LAYER_TYPES))
  if unknown or len(types) != n:
    _refuse(f"layer_types {unknown or len(types)} not modelled (full_attention, "
            f"sliding_attention; one per layer of {n})")
  return _pattern([_LAYER_TYPES[t] for t in types])


def _gpt_oss(hf: dict) -> dict:
  """gpt-oss: sinks, alternating sliding / full attention, biases on q/k/v/o, the router and the
  experts, the clamped SwiGLU, softmax over the selected top-k logits."""
  pattern = _attention_pattern(hf)
  bias = bool(hf.get("attention_bias", True))
  return dict(n_experts=hf["num_local_experts"], d_ff=hf["intermediate_size"], router="softmax",
              norm_topk_prob=True, attn_sinks=True, qkv_bias=bias, attn_o_bias=bias,
              attention_pattern=pattern,
              sliding_window=int(hf["sliding_window"]) if "sliding" in pattern else 0,
              router_bias=True, expert_bias=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
              swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


def _llama4(hf: dict) -> dict:
  """Llama 4's text model: NoPE layers (no_rope_layers 0) with temperature tuning, chunked local
  attention on the RoPE layers (attention_chunk_size), the L2 QK-norm (use_qk_norm), top-1
  sigmoid routing whose score scales the expert's input, a shared expert of the experts' width.
  Dense layers (of width intermediate_size_mlp) between the MoE layers: every layer not in
  moe_layers (by default every interleave_moe_layer_step-th layer is MoE)."""
  n = hf["num_hidden_layers"]
  moe_layers = hf.get("moe_layers")
  step = hf.get("interleave_moe_layer_step") or 1
  moe_layers = set(range(step - 1, n, step) if moe_layers is None else moe_layers)
  dense = [i for i in range(n) if i not in moe_layers]
  if hf.get("router_jitter_noise"):
    _refuse(f"router_jitter_noise={hf['router_jitter_noise']} is not modelled")
  interval = hf.get("no_rope_layer_interval") or 4
  rope_on = list(hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)])
  chunk = hf.get("attention_chunk_size")
  kinds = [("local" if chunk else "full") if on else "nope" for on in rope_on]
  pattern = _pattern(kinds)
  bias = bool(hf.get("attention_bias", False))
  tuning = bool(hf.get("attn_temperature_tuning", True)) and "nope" in kinds
  return dict(_dense_fields(dense, hf.get("intermediate_size_mlp") or 0),
              n_experts=hf["num_local_experts"], d_ff=hf["intermediate_size"], router="sigmoid",
              norm_topk_prob=False, route_scale_input=True, n_shared_experts=1,
              attention_pattern=pattern, local_chunk=int(chunk) if "local" in kinds else 0,
              qk_l2_norm=bool(hf.get("use_qk_norm", True)), rope_interleave=True,
              qkv_bias=bias, attn_o_bias=bias,
              nope_attn_scale=float(hf.get("attn_scale", 0.1)) if tuning else 0.0,
              nope_floor_scale=float(hf.get("floor_scale", 8192)))


def _deepseek_moe(hf: dict) -> dict:
  """The MoE fields DeepSeek-V2/V3, Kimi-K2 and GLM-4.5 share: routed and shared experts, the
  dense prefix, group-limited routing."""
  if hf.get("moe_layer_freq", 1) != 1:
    _refuse(f"moe_layer_freq={hf['moe_layer_freq']} is not modelled (every layer past "
            "first_k_dense_replace is MoE)")
  n_dense = hf.get("first_k_dense_replace") or 0
  return dict(n_experts=hf.get("n_routed_experts") or hf.get("num_local_experts"),
              d_ff=hf["moe_intermediate_size"], n_shared_experts=hf.get("n_shared_experts") or 0,
              n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
              routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
              norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
              first_k_dense_replace=n_dense, dense_d_ff=hf["intermediate_size"] if n_dense else 0)


def _mla(hf: dict, mt: str, common: dict) -> dict:
  """DeepSeek-V2 (softmax: greedy / group_limited_greedy), DeepSeek-V3 and Kimi-K2 (sigmoid,
  noaux_tc): MLA attention and their MoE."""
  if hf.get("attention_bias", False):
    _refuse("attention_bias=True is not modelled for MLA")
  kw = dict(common, **_deepseek_moe(hf), n_kv_heads=hf["num_attention_heads"],
            attention="mla", q_lora_rank=hf.get("q_lora_rank") or 0,
            kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
            rope_interleave=bool(hf.get("rope_interleave", True)), head_dim=hf["v_head_dim"])
  if "aux_loss_alpha" in hf:                     # DeepSeek's own config.json: its balance loss
    kw["aux_loss_coef"] = float(hf["aux_loss_alpha"])
    kw["aux_loss_kind"] = "sequence" if hf.get("seq_aux", True) else "batch"
  if mt == "deepseek_v2":
    method = hf.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
      _refuse(f"topk_method={method!r} is not modelled for deepseek_v2 (greedy, "
              "group_limited_greedy)")
    if hf.get("scoring_func", "softmax") != "softmax":
      _refuse(f"scoring_func={hf['scoring_func']!r} is not modelled for deepseek_v2 (softmax)")
    # transformers' DeepseekV2 never renormalises the top-k weights (norm_topk_prob unread)
    kw.update(router="softmax", norm_topk_prob=False, group_score="max",
              n_group=kw["n_group"] if method == "group_limited_greedy" else 1,
              topk_group=kw["topk_group"] if method == "group_limited_greedy" else 1)
  else:
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
      _refuse(f"scoring_func={hf['scoring_func']!r} is not modelled for {mt} (sigmoid)")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
      _refuse(f"topk_method={hf['topk_method']!r} is not modelled for {mt} (noaux_tc)")
    kw["router"] = "sigmoid"
  return kw


def read_config(path: str) -> dict:
  """A Hugging Face config.json (its path, or the folder holding it) -> dict; ValueError naming
  what is wrong."""
  file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.isfile(file):
    _refuse(f"no such file {file}" + (" (the folder has no config.json)"
                                      if os.path.isdir(path) else ""))
  try:
    with open(file) as fh:
      hf = json.load(fh)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    _refuse(f"{file} is not a readable JSON file: {e}")
  if not isinstance(hf, dict):
    _refuse(f"{file} holds no JSON object")
  return hf


def mtp_prefixes(hf: Mapping[str, Any]) -> tuple:
  """The name prefixes of DeepSeek-V3's multi-token-prediction layers (after the decoder's
  num_hidden_layers), for from_hf's `ignore`."""
  n = hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0
  return tuple(f"model.layers.{hf['num_hidden_layers'] + i}." for i in range(n))


def _get(cfg, name, default=None):
  if isinstance(cfg, Mapping):
    return cfg.get(name, default)
  return getattr(cfg, name, default)


class _State:
  """The HF tensors, taken once each by name with a shape check; leftovers are an error."""

  def __init__(self, state: Mapping[str, np.ndarray], ignore: Iterable[str]):
    ignore = tuple(ignore)
    self.state = state
    self.left = {n for n in state
                 if not n.endswith("rotary_emb.inv_freq") and not n.startswith(ignore)}
    self.missing = []

  def has(self, name: str) -> bool:
    return name in self.state

  def take(self, name: str, shape: tuple) -> np.ndarray:
    if name not in self.state:
      self.missing.append(name)
      return np.zeros(shape, np.float32)
    a = np.asarray(self.state[name])
    if tuple(a.shape) != tuple(shape):
      _refuse(f"{name}: shape {tuple(a.shape)} but the config needs {tuple(shape)}")
    self.left.discard(name)
    return a.astype(np.float32)

  def finish(self):
    if self.missing:
      _refuse(f"{len(self.missing)} tensor(s) the config needs are missing: "
              + ", ".join(self.missing[:4]) + (", ..." if len(self.missing) > 4 else ""))
    if self.left:
      left = sorted(self.left, key=_natural)
      _refuse(f"{len(left)} unexpected tensor(s) for this config: " + ", ".join(left[:4])
              + (", ..." if len(left) > 4 else ""))


def _natural(name: str):
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _linear(st: _State, name: str, d_in: int, out: tuple) -> np.ndarray:
  """nn.Linear weight [prod(out), d_in] -> [d_in, *out]."""
  return st.take(name, (int(np.prod(out)), d_in)).T.reshape((d_in,) + tuple(out))


def _attention(st: _State, p: str, cfg) -> dict:
  d, h = _get(cfg, "d_model"), _get(cfg, "n_heads")
  if _get(cfg, "attention", "gqa") == "gqa":
    kv, dh = _get(cfg, "n_kv_heads"), _get(cfg, "head_dim")
    out = {"wq": _linear(st, p + "q_proj.weight", d, (h, dh)),
           "wk": _linear(st, p + "k_proj.weight", d, (kv, dh)),
           "wv": _linear(st, p + "v_proj.weight", d, (kv, dh)),
           "wo": _linear(st, p + "o_proj.weight", h * dh, (d,)).reshape(h, dh, d)}
    if _get(cfg, "qkv_bias", False):
      out.update(bq=st.take(p + "q_proj.bias", (h * dh,)).reshape(h, dh),
                 bk=st.take(p + "k_proj.bias", (kv * dh,)).reshape(kv, dh),
                 bv=st.take(p + "v_proj.bias", (kv * dh,)).reshape(kv, dh))
    if _get(cfg, "qk_norm", False):
      out.update(q_norm=st.take(p + "q_norm.weight", (dh,)), k_norm=st.take(p + "k_norm.weight", (dh,)))
    if _get(cfg, "attn_sinks", False):
      out["sinks"] = st.take(p + "sinks", (h,))
    if _get(cfg, "attn_o_bias", False):
      out["bo"] = st.take(p + "o_proj.bias", (d,))
    return out
  qr, kvr = _get(cfg, "q_lora_rank") or 0, _get(cfg, "kv_lora_rank")
  nope, rope, v = (_get(cfg, n) for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
  out = {}
  if qr:
    out["wq_a"] = _linear(st, p + "q_a_proj.weight", d, (qr,))
    out["q_norm"] = st.take(p + "q_a_layernorm.weight", (qr,))
    out["wq_b"] = _linear(st, p + "q_b_proj.weight", qr, (h, nope + rope))
  else:
    out["wq"] = _linear(st, p + "q_proj.weight", d, (h, nope + rope))
  out["wkv_a"] = _linear(st, p + "kv_a_proj_with_mqa.weight", d, (kvr + rope,))
  out["kv_norm"] = st.take(p + "kv_a_layernorm.weight", (kvr,))
  out["wkv_b"] = _linear(st, p + "kv_b_proj.weight", kvr, (h, nope + v))
  out["wo"] = _linear(st, p + "o_proj.weight", h * v, (d,)).reshape(h, v, d)
  return out


def _swiglu(st: _State, p: str, d: int, f: int, names=("gate_proj", "up_proj", "down_proj")):
  g, u, o = names
  return {"wi_0": _linear(st, f"{p}{g}.weight", d, (f,)),
          "wi_1": _linear(st, f"{p}{u}.weight", d, (f,)),
          "wo": _linear(st, f"{p}{o}.weight", f, (d,))}


def _moe(st: _State, p: str, cfg, mixtral: bool) -> dict:
  """A MoE layer's router, correction bias (sigmoid routers; zeros otherwise) and experts;
  mixtral: Mixtral's on-disk per-expert names (w1 / w3 / w2)."""
  d, e, f = _get(cfg, "d_model"), _get(cfg, "n_experts"), _get(cfg, "d_ff")
  if _get(cfg, "expert_bias", False):
    return _gpt_oss_moe(st, p, d, e, f)
  out = {"router": _linear(st, p + "gate.weight", d, (e,))}
  out["bias"] = (st.take(p + "gate.e_score_correction_bias", (e,))
                 if _get(cfg, "router") == "sigmoid" else np.zeros((e,), np.float32))
  if st.has(p + "experts.gate_up_proj"):                      # transformers v5 fused layout
    gate_up = st.take(p + "experts.gate_up_proj", (e, 2 * f, d))
    out["wi_0"] = np.ascontiguousarray(gate_up[:, :f].transpose(0, 2, 1))
    out["wi_1"] = np.ascontiguousarray(gate_up[:, f:].transpose(0, 2, 1))
    out["wo"] = np.ascontiguousarray(st.take(p + "experts.down_proj", (e, d, f)).transpose(0, 2, 1))
  else:                                                       # per expert (checkpoints, v4)
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    per = [_swiglu(st, f"{p}experts.{i}.", d, f, names) for i in range(e)]
    out.update({k: np.stack([x[k] for x in per]) for k in ("wi_0", "wi_1", "wo")})
  return out


def _llama4_moe(st: _State, p: str, cfg) -> dict:
  """Llama 4's MoE: router [E, D]; experts.gate_up_proj [E, D, 2F] (gate the first F columns, up
  the last), experts.down_proj [E, F, D] (already [in, out])."""
  d, e, f = _get(cfg, "d_model"), _get(cfg, "n_experts"), _get(cfg, "d_ff")
  gate_up = st.take(p + "experts.gate_up_proj", (e, d, 2 * f))
  return {"router": _linear(st, p + "router.weight", d, (e,)), "bias": np.zeros((e,), np.float32),
          "wi_0": np.ascontiguousarray(gate_up[..., :f]),
          "wi_1": np.ascontiguousarray(gate_up[..., f:]),
          "wo": st.take(p + "experts.down_proj", (e, f, d))}


def _gpt_oss_moe(st: _State, p: str, d: int, e: int, f: int) -> dict:
  """gpt-oss's MoE: router [E, D] + bias [E]; experts.gate_up_proj [E, D, 2F] with gate and up
  interleaved along 2F (gate the even columns) and its bias [E, 2F]; down_proj [E, F, D] and its
  bias [E, D] (already [in, out])."""
  gate_up = st.take(p + "experts.gate_up_proj", (e, d, 2 * f))
  gate_up_b = st.take(p + "experts.gate_up_proj_bias", (e, 2 * f))
  return {"router": _linear(st, p + "router.weight", d, (e,)), "bias": np.zeros((e,), np.float32),
          "router_b": st.take(p + "router.bias", (e,)),
          "wi_0": np.ascontiguousarray(gate_up[..., 0::2]),
          "wi_1": np.ascontiguousarray(gate_up[..., 1::2]),
          "wo": st.take(p + "experts.down_proj", (e, f, d)),
          "bi_0": np.ascontiguousarray(gate_up_b[:, 0::2]),
          "bi_1": np.ascontiguousarray(gate_up_b[:, 1::2]),
          "bo": st.take(p + "experts.down_proj_bias", (e, d))}


def from_hf(state: Mapping[str, np.ndarray], cfg, *, ignore: Iterable[str] = ()) -> dict:
  """An HF state dict (name -> array) -> the suite's float32 numpy param pytree for `cfg` (a
  modeling.config.Config, or the dict config_from_hf returns). `ignore`: name prefixes to skip
  (e.g. mtp_prefixes(hf)). Raises ValueError on a missing, unexpected or misshaped tensor."""
  st = _State(state, ignore)
  d, v, n_layers = _get(cfg, "d_model"), _get(cfg, "vocab"), _get(cfg, "n_layers")
  n_dense = _get(cfg, "first_k_dense_replace", 0) or 0
  if not 0 <= n_dense <= n_layers:
    _refuse(f"first_k_dense_replace={n_dense} outside [0, n_layers={n_layers}]")
  inside = _get(cfg, "mlp_only_layers", "") or ""
  dense_at = set(range(n_dense)) | {int(i) for i in inside.split(",") if inside}
  if _get(cfg, "layer_layout", ""):
    _refuse(f"layer_layout={_get(cfg, 'layer_layout')}: convert to the unpadded model, then "
            "train with the layout from a fresh init (the padded stack has no HF form)")
  dense, moe = [], []
  for i in range(n_layers):
    p = f"model.layers.{i}."
    layer = {"attn_norm": st.take(p + "input_layernorm.weight", (d,)),
             "mlp_norm": st.take(p + "post_attention_layernorm.weight", (d,)),
             "attn": _attention(st, p + "self_attn.", cfg)}
    m = p + next((k for k in ("block_sparse_moe.", "feed_forward.")
                  if any(n.startswith(p + k) for n in state)), "mlp.")
    if i in dense_at:                                             # mlp. / Llama 4's feed_forward.
      layer["mlp"] = _swiglu(st, m, d, _get(cfg, "dense_d_ff"))
      dense.append(layer)
      continue
    if m.endswith("feed_forward."):                               # Llama 4
      layer["moe"] = _llama4_moe(st, m, cfg)
      layer["shared"] = _swiglu(st, m + "shared_expert.", d, _get(cfg, "shared_width", 0)
                                or _get(cfg, "d_ff"))
      moe.append(layer)
      continue
    layer["moe"] = _moe(st, m, cfg, mixtral=m.endswith("block_sparse_moe."))
    n_shared = _get(cfg, "n_shared_experts", 0) or 0
    width = _get(cfg, "shared_width", 0) or n_shared * _get(cfg, "d_ff")
    if n_shared and _get(cfg, "shared_gate", False):              # Qwen2-MoE: one gated expert
      layer["shared"] = _swiglu(st, m + "shared_expert.", d, width)
      layer["shared"]["wg"] = st.take(m + "shared_expert_gate.weight", (1, d))[0]
    elif n_shared:
      layer["shared"] = _swiglu(st, m + "shared_experts.", d, width)
    moe.append(layer)
  params = {"embed": st.take("model.embed_tokens.weight", (v, d)),
            "final_norm": st.take("model.norm.weight", (d,)),
            "unembed": np.ascontiguousarray(st.take("lm_head.weight", (v, d)).T)}
  st.finish()
  if dense:
    params["dense_layers"] = _tree_stack(dense)
  if moe:
    params["layers"] = _tree_stack(moe)
  return params


def _tree_stack(trees: list):
  if isinstance(trees[0], dict):
    return {k: _tree_stack([t[k] for t in trees]) for k in trees[0]}
  return np.stack(trees).astype(np.float32)


# ----------------------------------------------------------------------------- safetensors
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bf16",
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
           "BOOL": np.bool_}


def _safetensor_files(paths) -> list:
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  files = []
  for p in map(os.fspath, paths):
    if os.path.isdir(p):
      index = os.path.join(p, "model.safetensors.index.json")
      if os.path.exists(index):
        with open(index) as fh:
          shards = sorted(set(json.load(fh)["weight_map"].values()))
      else:
        shards = sorted(n for n in os.listdir(p) if n.endswith(".safetensors"))
      if not shards:
        _refuse(f"no .safetensors files in {p}")
      files += [os.path.join(p, n) for n in shards]
    else:
      files.append(p)
  return files


class Tensors(Mapping):
  """{name: float32 numpy array} over memory-mapped .safetensors files, each tensor decoded when
  it is read (from_hf reads each once): the host holds the float32 params it builds and one
  tensor in flight, never a float32 copy of the whole checkpoint; tensors it skips (DeepSeek's
  multi-token-prediction layers) are never decoded."""

  def __init__(self, index: dict):
    self._index = index            # name -> (memmap of the file, offset, end, dtype, shape)

  def __getitem__(self, name):
    raw, lo, hi, kind, shape = self._index[name]
    buf = raw[lo:hi]
    if kind == "bf16":
      a = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
      a = np.frombuffer(buf, np.dtype(kind).newbyteorder("<"))
    return a.reshape(shape).astype(np.float32)

  def __iter__(self):
    return iter(self._index)

  def __len__(self):
    return len(self._index)


def load_safetensors(paths) -> Tensors:
  """A .safetensors file, a list of them, or a checkpoint directory (its index or every shard)
  -> {name: float32 numpy array} (Tensors: decoded on read). Reads the format directly (8-byte
  header length, JSON header, raw little-endian data), so bfloat16 checkpoints load without
  torch; FP8 ones are refused, at their header, before any tensor is read."""
  index = {}
  for path in _safetensor_files(paths):
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    n = int(np.frombuffer(raw[:8].tobytes(), "<u8")[0])
    header = json.loads(raw[8:8 + n].tobytes())
    base = 8 + n
    for name, info in header.items():
      if name == "__metadata__":
        continue
      kind = _DTYPES.get(info["dtype"])
      if kind is None:
        _refuse(f"{path}: {name} has dtype {info['dtype']}, not loaded (dequantize first)")
      if name in index:
        _refuse(f"{name} is in more than one shard")
      lo, hi = info["data_offsets"]
      index[name] = (raw, base + lo, base + hi, kind, tuple(info["shape"]))
  return Tensors(index)
