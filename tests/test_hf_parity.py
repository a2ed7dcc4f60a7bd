"""Whole-model logit parity with Hugging Face transformers' own model classes of every family
modeling/convert.py accepts (no torch needed here).

The fixtures (tests/fixtures/hf/*.npz, written by tools/hf_fixtures.py in its own Python 3.11
environment) hold each model's HF state dict under HF's names, its config.json, a [2, 16] token
batch and transformers' float32 logits. modeling/convert.py (the user-facing converter) turns
them into the suite's config and parameters; the suite's forward, single-device and under
strategies, must give transformers' logits within 1e-5 of their largest magnitude.
  mixtral              GQA, softmax top-2 of 8 experts
  deepseek_v3          MLA with q_lora 32, one dense layer, sigmoid group-limited top-2 with a
                       non-zero correction bias, a shared expert, interleaved RoPE
  deepseek_v3_noqlora  the same with a direct query projection (as DeepSeek-V2-Lite)
  deepseek_v3_yarn     DeepSeek-V3 with YaRN RoPE scaling (factor 4 over 8 original positions,
                       positions to 11): the interpolated frequencies and MLA's mscale^2
  deepseek_v2_lite     DeepSeek-V2: softmax greedy top-2, unnormalised, two shared experts
  deepseek_v2          DeepSeek-V2 with q_lora and group_limited_greedy routing (a group's max)
  qwen3_moe            QK-norm on every GQA head, a dense first layer (mlp_only_layers)
  qwen3_moe_inside     the same with its dense layer inside the stack (MoE, dense, MoE, MoE)
  qwen2_moe            q/k/v biases, a shared expert of its own width behind a sigmoid gate
  glm4_moe             partial rotary (half of each head), q/k/v biases, QK-norm, sigmoid
                       group-limited routing with correction bias, a shared expert, a dense layer
  gpt_oss              attention sinks, sliding (window 5) and full layers in turn, biases on
                       q/k/v/o, the router and the experts, the clamped SwiGLU, YaRN untruncated
  llama4               three RoPE layers of chunked local attention (blocks of 5) with the L2
                       QK-norm, a NoPE layer with temperature tuning, llama3 RoPE scaling, dense
                       and MoE layers in turn (Maverick's interleave step 2), top-1 sigmoid
                       routing whose score scales the expert's input, a shared expert
The fixtures of the last nine have 12 positions (not a power of two).
"""
import json
import math
import pathlib

import jax
from jax.sharding import NamedSharding
import numpy as np
import pytest

from layout import mesh as mesh_lib
from modeling import convert, model
from modeling.config import Config
import strategies
from tests import pipeline

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
RTOL = 1e-5                                   # of the largest |logit| (docs/models.md's bound)
CASES = [("mixtral", "reference", None), ("mixtral", "ep", "expert:2"),
         ("mixtral", "tp", "tensor:2"), ("mixtral", "pp", "stage:2,expert:2"),
         ("deepseek_v3", "reference", None), ("deepseek_v3", "ep", "expert:2"),
         ("deepseek_v3", "fsdp", "fsdp:2"), ("deepseek_v3", "pp", "stage:2,expert:2"),
         ("deepseek_v3", "tp", "tensor:2"), ("deepseek_v3", "cp", "context:2"),
         ("deepseek_v3", "pp", "stage:2,tensor:2"),              # TP inside the stages
         ("deepseek_v3", "pp", "stage:2,context:2"),             # CP inside the stages
         ("deepseek_v3_noqlora", "reference", None), ("deepseek_v3_noqlora", "ep", "expert:2"),
         ("deepseek_v3_yarn", "reference", None), ("deepseek_v3_yarn", "ep", "expert:2"),
         ("deepseek_v3_yarn", "cp", "context:2"), ("deepseek_v3_yarn", "tp", "tensor:2"),
         ("deepseek_v2_lite", "reference", None), ("deepseek_v2_lite", "ep", "expert:2"),
         ("deepseek_v2", "reference", None), ("deepseek_v2", "ep", "expert:2"),
         ("deepseek_v2", "tp", "tensor:2"),
         ("qwen3_moe", "reference", None), ("qwen3_moe", "ep", "expert:2"),
         ("qwen3_moe", "tp", "tensor:2"), ("qwen3_moe", "fsdp", "fsdp:2"),
         ("qwen3_moe", "cp", "context:2"), ("qwen3_moe", "pp", "stage:2,expert:2"),
         ("qwen3_moe", "pp", "stage:2,context:2"),
         ("qwen3_moe_inside", "reference", None), ("qwen3_moe_inside", "ep", "expert:2"),
         ("qwen3_moe_inside", "tp", "tensor:2"), ("qwen3_moe_inside", "fsdp", "fsdp:2"),
         ("qwen3_moe_inside", "cp", "context:2"), ("qwen3_moe_inside", "ep_x_tp",
                                                   "expert:2,tensor:2"),
         ("qwen2_moe", "reference", None), ("qwen2_moe", "ep", "expert:2"),
         ("qwen2_moe", "tp", "tensor:2"), ("qwen2_moe", "fsdp", "fsdp:2"),
         ("qwen2_moe", "ep_tp", "expert:2"), ("qwen2_moe", "ep_x_tp", "expert:2,tensor:2"),
         ("qwen2_moe", "cp", "context:2"),
         ("glm4_moe", "reference", None), ("glm4_moe", "ep", "expert:2"),
         ("glm4_moe", "tp", "tensor:2"), ("glm4_moe", "fsdp", "fsdp:2"),
         ("glm4_moe", "cp", "context:2"), ("glm4_moe", "pp", "stage:2,expert:2"),
         ("glm4_moe", "pp", "stage:2,tensor:2"),                 # TP inside the stages
         ("glm4_moe", "ep_tp", "expert:2"), ("glm4_moe", "ep_x_tp", "expert:2,tensor:2"),
         ("gpt_oss", "reference", None), ("gpt_oss", "ep", "expert:2"),
         ("gpt_oss", "tp", "tensor:2"), ("gpt_oss", "fsdp", "fsdp:2"),
         ("gpt_oss", "cp", "context:2"), ("gpt_oss", "ep_tp", "expert:2"),
         ("gpt_oss", "ep_x_tp", "expert:2,tensor:2"),
         ("llama4", "reference", None), ("llama4", "ep", "expert:2"),
         ("llama4", "tp", "tensor:2"), ("llama4", "fsdp", "fsdp:2"),
         ("llama4", "cp", "context:2"), ("llama4", "ep_tp", "expert:2"),
         ("llama4", "ep_x_tp", "expert:2,tensor:2")]
FAMILIES = sorted({f for f, _, _ in CASES})


def load(name: str):
  """-> (Config, params (numpy, the suite's layout), batch, transformers' logits)."""
  with np.load(FIXTURES / f"{name}.npz") as f:
    arrays = {k: f[k] for k in f.files}
  hf = json.loads(str(arrays.pop("config_json")))
  tokens, want = arrays.pop("tokens"), arrays.pop("logits")
  b, s = tokens.shape
  cfg = Config(**convert.config_from_hf(hf, batch=b, seq_len=s)).validate()
  params = convert.from_hf(arrays, cfg)
  batch = {"tokens": tokens.astype(np.int32), "targets": tokens.astype(np.int32),
           "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()}
  return cfg, params, batch, want


def logits(name: str, cfg, params, batch, mesh_spec):
  """The suite's logits [B, S, V] for `params` under strategy `name` (its Parallelism; pp: its
  pipeline, tests/pipeline.py's logits; cp: its load-balanced token order, undone after)."""
  strat = strategies.get(name)
  n = math.prod(mesh_lib.parse_mesh_spec(mesh_spec).values()) if mesh_spec else None
  mesh = mesh_lib.for_strategy(strat, mesh_spec, n)
  if mesh is None:
    lay = model.reference_layout(cfg)
    return np.asarray(jax.jit(lambda p, b: model.forward(p, b, cfg, lay)[0])(params, batch))
  with jax.set_mesh(mesh):
    put = lambda tree, specs: jax.tree.map(lambda a, p: jax.device_put(a, NamedSharding(mesh, p)),
                                           tree, specs)
    p = put(params, strat.param_specs(cfg, mesh))
    bspec = strat.batch_spec(cfg, mesh)
    order = np.arange(cfg.seq_len)
    if hasattr(strat, "prepare_batch"):                     # cp: positions travel with tokens
      order = strat.prepare_batch({"i": order[None]}, cfg, mesh)["i"][0]
    b = {k: jax.device_put(v[:, order], NamedSharding(mesh, bspec)) for k, v in batch.items()}
    if name == "pp":
      fn = lambda p, b: pipeline.logits(strat, p, b, cfg=cfg, mesh=mesh)
    else:
      lay = strat.layout(cfg, mesh, strat.Options())
      fn = lambda p, b: model.forward(p, b, cfg, lay)[0]
    return np.asarray(jax.jit(fn)(p, b))[:, np.argsort(order)]


@pytest.mark.parametrize("fixture,strategy,mesh", CASES,
                         ids=[f"{f}-{s}-{m}" for f, s, m in CASES])
def test_logits_match_transformers(fixture, strategy, mesh):
  cfg, params, batch, want = load(fixture)
  got = logits(strategy, cfg, params, batch, mesh)
  assert got.shape == want.shape
  err = np.max(np.abs(got - want)) / np.max(np.abs(want))
  assert err <= RTOL, f"max |logit error| = {err:.2e} of max |logit|"
  assert np.std(want) > 0.5                                  # the fixture's logits are not flat


def test_converter_round_trips_the_declared_tree():
  """from_hf gives init_params' exact tree and shapes (so a converted checkpoint loads into any
  strategy's param_specs), and refuses a state dict with a tensor missing."""
  for fixture in FAMILIES:
    cfg, params, *_ = load(fixture)
    shapes = jax.tree.map(np.shape, model.init_params(cfg))
    assert jax.tree.map(np.shape, params) == shapes, fixture
  with np.load(FIXTURES / "mixtral.npz") as f:
    arrays = {k: f[k] for k in f.files if k not in ("config_json", "tokens", "logits")}
    cfg = Config(**convert.config_from_hf(json.loads(str(f["config_json"])))).validate()
  arrays.pop("model.norm.weight")
  with pytest.raises(ValueError, match="model.norm.weight"):
    convert.from_hf(arrays, cfg)
