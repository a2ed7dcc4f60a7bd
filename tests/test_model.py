"""The model's declarations against published figures: total and activated-per-token parameter
counts of the presets at published shapes (modeling.model.param_counts; `run.py --describe`)."""
import pytest

from modeling import model
from modeling.config import get_config

# (total, activated per token, how the publisher counts the embedding) as published: Mixtral of
# Experts (arXiv 2401.04088) and Mistral's 8x22B announcement; DeepSeek-V2-Lite's model card;
# DeepSeek-V3 technical report (arXiv 2412.19437), MTP excluded; the Qwen3, GLM-4.5 and Kimi-K2
# model cards; OpenAI's gpt-oss model card (116.8B / 5.1B, 20.9B / 3.6B, embedding not active);
# Meta's Llama 4 Scout model card (109B / 17B, the vision encoder in its total, not modelled). "row": a token's one embedding row (param_counts' activated); "table": the whole
# embedding table counted as activated (Qwen's and Moonshot's convention). Publishers round to
# 2-3 digits and some count their multi-token-prediction layers in: totals within 1.5%.
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9, "row"), "deepseek-v2-lite": (15.7e9, 2.4e9, "row"),
             "deepseek-v3": (671e9, 37e9, "row"), "mixtral-8x22b": (141e9, 39e9, "row"),
             "qwen3-30b-a3b": (30.5e9, 3.3e9, "table"), "qwen3-235b-a22b": (235e9, 22e9, "table"),
             "glm-4.5": (355e9, 32e9, "row"), "kimi-k2": (1.04e12, 32.6e9, "table"),
             "gpt-oss-120b": (116.8e9, 5.1e9, "row"), "gpt-oss-20b": (20.9e9, 3.6e9, "row"),
             "llama4-scout": (109e9, 17e9, "table"), "llama4-maverick": (400e9, 17e9, "table")}


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_publications(name):
  cfg = get_config(name)
  total, active = model.param_counts(cfg)
  want_total, want_active, embedding = PUBLISHED[name]
  if embedding == "table":
    active += cfg.vocab * cfg.d_model - cfg.d_model
  assert abs(total / want_total - 1) <= 0.015, (name, total)
  assert abs(active / want_active - 1) <= 0.03, (name, active)


def test_maverick_interleaves_dense_and_moe_layers():
  """Llama 4 Maverick: 24 dense layers (width 16384) and 24 MoE layers (128 experts of 8192) in
  turn, NoPE every fourth layer: one scanned run of a four-layer period."""
  cfg = get_config("llama4-maverick")
  shapes = model.init_params_shapes(cfg)
  assert shapes["dense_layers"]["mlp"]["wi_0"].shape == (24, 5120, 16384)
  assert shapes["layers"]["moe"]["wi_0"].shape == (24, 128, 5120, 8192)
  assert cfg.layer_is_moe == (False, True) * 24
  assert cfg.layer_segments == (((("local", False), ("local", True), ("local", False),
                                  ("nope", True)), 12),)


def test_deepseek_presets_are_the_real_architecture():
  v3 = get_config("deepseek-v3")
  leaves = model.param_leaves(v3)
  roles = {l.role for l in leaves}
  assert {"attn_q_a", "attn_kv_a", "attn_kv_b", "dense_in"} <= roles and "attn_kv" not in roles
  dense = model.init_params_shapes(v3)["dense_layers"]["mlp"]["wi_0"].shape
  assert dense == (3, 7168, 18432)
  assert model.init_params_shapes(v3)["layers"]["moe"]["wi_0"].shape == (58, 256, 7168, 2048)
  v2 = model.init_params_shapes(get_config("deepseek-v2-lite"))["layers"]["attn"]
  assert "wq" in v2 and "wq_a" not in v2 and v2["wkv_b"].shape == (26, 512, 16, 256)


def test_layers_keep_the_dense_layers_inside_where_they_fall():
  """--layers=N (get_config's n_layers) on a model with dense layers inside the stack: its first
  N layers' dense layers; past its depth, a repeated dense/MoE period goes on (Maverick's every
  other layer), a pattern that does not repeat gains no dense layer; an explicit
  mlp_only_layers wins."""
  from modeling.config import dense_at_depth
  assert get_config("llama4-maverick", n_layers=4).mlp_only_layers == "0,2"
  assert get_config("llama4-maverick-test", n_layers=8).mlp_only_layers == "0,2,4,6"
  assert get_config("llama4-maverick-test", n_layers=5).mlp_only_layers == "0,2,4"
  qwen_like = get_config("tiny", n_layers=4, mlp_only_layers="1", dense_d_ff=64)  # M, D, M, M
  assert [dense_at_depth(qwen_like, n) for n in (1, 2, 6)] == ["", "1", "1"]
  assert get_config("llama4-maverick-test", n_layers=8, mlp_only_layers="1").mlp_only_layers == "1"
