"""Hugging Face checkpoints in and out (modeling/export_hf.py; run.py --init_from / --export_hf).

  to_hf          the exact inverse of convert.from_hf on every fixture (tests/fixtures/hf/), in
                 v5's fused expert layout and the per-expert one on disk (gpt-oss's and Llama 4's
                 one fused layout); on gpt-oss and Llama 4 models with every feature their
                 config.json can say, random in every tensor, both ways bit for bit
  config_to_hf   read back by convert.config_from_hf to the same model; what a family cannot say
                 refused, naming the field
  safetensors    save_safetensors -> convert.load_safetensors, float32 and bfloat16, one file and
                 sharded with an index
  padded stacks  pp's stored MoE stack (layer_layout, layer_stages) to and from depth order
  run.py         --init_from: ep's first loss is the reference's from the same directory, not the
                 random init's; --export_hf: the trained weights load back and give the
                 reference's next loss; bad input: one `error:` line, exit 2, nothing compiled
"""
import json
import os
import pathlib
import re

import jax
import ml_dtypes
import numpy as np
import pytest

from modeling import convert, export_hf, model
from modeling.config import Config, get_config
from runtime import data as data_lib
from tests.conftest import compare_table, one_error_line, run_py_in_one_process

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.npz"))


def fixture(name: str):
  """-> (config.json dict, HF state dict) of tests/fixtures/hf/NAME.npz."""
  with np.load(FIXTURES / f"{name}.npz") as f:
    state = {k: f[k] for k in f.files if k not in ("config_json", "tokens", "logits")}
    return json.loads(str(f["config_json"])), state


def bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(np.uint32 if a.dtype == np.float32 else np.uint16)


def same_tree(a, b) -> bool:
  """Equal trees of float32 arrays, bit for bit."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  return ta == tb and all(x.dtype == y.dtype and x.shape == y.shape
                          and np.array_equal(bits(x), bits(y)) for x, y in zip(la, lb))


def converted(name: str):
  hf, state = fixture(name)
  if hf["model_type"] not in convert.FAMILIES:
    pytest.skip(f"model_type {hf['model_type']} is not one convert supports")
  cfg = Config(**convert.config_from_hf(hf)).validate()
  return hf, state, cfg, convert.from_hf(state, cfg, ignore=convert.mtp_prefixes(hf))


@pytest.mark.parametrize("name", NAMES)
def test_to_hf_inverts_from_hf(name):
  """to_hf(from_hf(state)) == state, every name and bit, in the fixture's layout (transformers
  v5's fused experts); the per-expert layout of checkpoints on disk converts back to the same
  params (gpt-oss and Llama 4 have one layout, fused, on disk too)."""
  hf, state, cfg, params = converted(name)
  fused = any(n.endswith("experts.gate_up_proj") for n in state)
  back = export_hf.to_hf(params, cfg, hf, fused=fused)
  assert sorted(back) == sorted(state)
  for n, a in state.items():
    assert back[n].dtype == np.float32 and back[n].shape == a.shape, n
    assert np.array_equal(bits(back[n]), bits(a.astype(np.float32))), n
  on_disk = export_hf.to_hf(params, cfg, hf)
  if export_hf.family(hf).routed is not None:
    assert sorted(on_disk) == sorted(state)
  else:
    assert not any("gate_up_proj" in n for n in on_disk)
    assert any(".experts.0." in n for n in on_disk)
  assert same_tree(convert.from_hf(on_disk, cfg, ignore=convert.mtp_prefixes(hf)), params)


@pytest.mark.parametrize("name", NAMES)
def test_config_to_hf_round_trips(name):
  hf, _, cfg, _ = converted(name)
  written = export_hf.config_to_hf(cfg, hf["model_type"])
  assert Config(**convert.config_from_hf(written)).model_fields() == cfg.model_fields()
  assert written["model_type"] == hf["model_type"]


# gpt-oss and Llama 4 with every feature their config.json can say: gpt-oss's sinks, q/k/v/o,
# router and expert biases, the clamped SwiGLU, sliding and full layers, YaRN unrounded; Llama 4's
# local-chunk and NoPE layers (temperature tuning), dense layers between the MoE layers (0 and 2),
# the L2 QK-norm, q/k/v/o biases, llama3 RoPE, the shared expert
FEATURED = {
    "gpt_oss": ("gpt-oss-test", dict(n_layers=4, yarn_factor=4.0, yarn_original_max=8,
                                     yarn_truncate=False)),
    "llama4_text": ("llama4-maverick-test", dict(qk_l2_norm=True, qkv_bias=True, attn_o_bias=True,
                                                 llama3_factor=4.0, llama3_original_max=16)),
}


def featured(family: str):
  """-> (cfg, params) of FEATURED[family]: every tensor random (so none is zero: the sinks and
  biases too), but the router's correction bias, which neither family has a tensor for."""
  preset, over = FEATURED[family]
  cfg = get_config(preset, **over)
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32),
                        model.init_params(cfg))
  params["layers"]["moe"]["bias"][:] = 0
  return cfg, params


@pytest.mark.parametrize("family", sorted(FEATURED))
def test_featured_families_round_trip(family, tmp_path):
  """gpt-oss's and Llama 4's export: family_of names the family; config_to_hf reads back to the
  model; from_hf(to_hf(params)) == params and to_hf(from_hf(state)) == state, bit for bit; the
  fused gate / up columns in the family's order (gate even for gpt-oss, first for Llama 4); a
  directory written by export loads back to the params."""
  cfg, params = featured(family)
  kinds = set(cfg.layer_attentions)
  assert kinds == ({"sliding", "full"} if family == "gpt_oss" else {"local", "nope"})
  assert family == "gpt_oss" or (cfg.dense_inside and cfg.nope_attn_scale)
  assert export_hf.family_of(cfg) == family
  hf = export_hf.config_to_hf(cfg, family)
  assert Config(**convert.config_from_hf(hf)).model_fields() == cfg.model_fields()
  state = export_hf.to_hf(params, cfg, hf)
  assert same_tree(convert.from_hf(state, cfg), params)
  assert same_tree(export_hf.to_hf(convert.from_hf(state, cfg), cfg, hf), state)
  assert same_tree(export_hf.to_hf(params, cfg, hf, fused=True), state)
  moe, f = params["layers"]["moe"], cfg.d_ff
  if family == "gpt_oss":
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert np.array_equal(gate_up[..., 0::2], moe["wi_0"][1])
    assert np.array_equal(gate_up[..., 1::2], moe["wi_1"][1])
    bias = state["model.layers.1.mlp.experts.gate_up_proj_bias"]
    assert np.array_equal(bias[:, 0::2], moe["bi_0"][1])
    assert np.array_equal(state["model.layers.1.self_attn.sinks"],
                          params["layers"]["attn"]["sinks"][1])
  else:                                          # layers 0 and 2 dense, 1 and 3 MoE
    gate_up = state["model.layers.3.feed_forward.experts.gate_up_proj"]
    assert np.array_equal(gate_up[..., :f], moe["wi_0"][1])
    assert np.array_equal(gate_up[..., f:], moe["wi_1"][1])
    assert np.array_equal(state["model.layers.2.feed_forward.gate_proj.weight"],
                          params["dense_layers"]["mlp"]["wi_0"][1].T)
    assert "model.layers.3.feed_forward.shared_expert.up_proj.weight" in state
  export_hf.export(str(tmp_path), params, cfg)
  assert convert.read_config(str(tmp_path))["model_type"] == family
  assert same_tree(export_hf.load(str(tmp_path), cfg), params)


def test_featured_families_refuse_what_they_cannot_say():
  """What gpt-oss's or Llama 4's checkpoint cannot hold is refused, naming the field, rather than
  written as another model."""
  gpt, _ = featured("gpt_oss")
  llama, params = featured("llama4_text")
  refused = [
      (gpt.replace(swiglu_limit=0.0), "gpt_oss", "swiglu_limit=0"),
      (gpt.replace(attention_pattern="local,full", local_chunk=4, sliding_window=0), "gpt_oss",
       "attention_pattern='local,full': gpt_oss has no local layers"),
      (gpt.replace(mlp_only_layers="1", dense_d_ff=32), "gpt_oss", "mlp_only_layers="),
      (gpt.replace(attn_sinks=False), "gpt_oss", "attn_sinks="),
      (llama.replace(attention_pattern="sliding,nope", sliding_window=4, local_chunk=0),
       "llama4_text", "llama4_text has no sliding layers"),
      (llama.replace(attention_pattern="full,local"), "llama4_text", "attention_pattern="),
      (llama.replace(llama3_factor=0.0, yarn_factor=4.0, yarn_original_max=8), "llama4_text",
       "yarn_factor=4.0"),
      (llama.replace(shared_width=32), "llama4_text", "shared_width="),
  ]
  for cfg, family, why in refused:
    with pytest.raises(ValueError, match=re.escape(why)):
      export_hf.config_to_hf(cfg, family)
  with pytest.raises(ValueError, match="a llama4_text checkpoint with a sigmoid router has no "
                     "tensor for"):
    export_hf.check_export(llama.replace(bias_update_rate=1e-3))
  with pytest.raises(ValueError, match="a mixtral checkpoint with a softmax router has no "):
    export_hf.check_export(get_config("mixtral-test").replace(bias_update_rate=1e-3))
  assert export_hf.check_export(get_config("deepseek-test").replace(
      bias_update_rate=1e-3)) == "deepseek_v3"
  hf = export_hf.config_to_hf(llama, "llama4_text")
  params["layers"]["moe"]["bias"][1, 0] = 0.5
  with pytest.raises(ValueError, match="layer 3: a non-zero router bias"):
    export_hf.to_hf(params, llama, hf)
  with pytest.raises(ValueError, match="model_type 'llama4' has no export"):   # its text model's is
    export_hf.to_hf(params, llama, {"model_type": "llama4", "text_config": hf})   # llama4_text


@pytest.mark.parametrize("preset,family", [
    ("tiny", "mixtral"), ("deepseek-test", "deepseek_v3"), ("deepseek-v2-test", "deepseek_v2"),
    ("gpt-oss-test", "gpt_oss"), ("llama4-test", "llama4_text"),
    ("llama4-maverick-test", "llama4_text")])
def test_config_to_hf_of_presets(preset, family):
  """A preset's model (trained without --init_from) gets the first family that expresses it;
  a family that cannot is refused, naming the fields."""
  cfg = get_config(preset)
  assert export_hf.family_of(cfg) == family
  back = Config(**convert.config_from_hf(export_hf.config_to_hf(cfg, family)))
  same = lambda c: export_hf._comparable(c).model_fields()   # noqa: E731 (MLA: head_dim unread)
  assert same(back) == same(cfg)
  other = "deepseek_v3" if family == "mixtral" else "mixtral"
  with pytest.raises(ValueError, match=f"no {other} form: "):
    export_hf.config_to_hf(cfg, other)


def tensors(rng) -> dict:
  t = {"a.weight": rng.standard_normal((3, 5)).astype(np.float32),
       "b": np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, 1e-40, 3.4e38], np.float32),
       "scalar": np.array(7.25, np.float32),
       "c.big": rng.standard_normal((64, 33)).astype(np.float32),
       "d": rng.standard_normal((2, 3, 4)).astype(np.float32)}
  return t


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sharded", [False, True])
def test_safetensors_round_trip(tmp_path, dtype, sharded):
  src = tensors(np.random.default_rng(0))
  files = export_hf.save_safetensors(str(tmp_path / "model.safetensors"), src, dtype,
                                     shard_bytes=4096 if sharded else export_hf.SHARD_BYTES)
  index = tmp_path / "model.safetensors.index.json"
  if sharded:                        # 64 x 33 x 4 B > 4096: c.big on its own, the rest packed
    shards = sorted(n for n in os.listdir(tmp_path) if n.endswith(".safetensors"))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    weight_map = json.loads(index.read_text())["weight_map"]
    assert sorted(weight_map) == sorted(src) and set(weight_map.values()) == set(shards)
  else:
    assert files == [str(tmp_path / "model.safetensors")] and not index.exists()
  for f in files:
    if f.endswith(".safetensors"):
      raw = open(f, "rb").read()
      n = int(np.frombuffer(raw[:8], "<u8")[0])
      header = json.loads(raw[8:8 + n])
      assert n % 8 == 0 and len(raw) == 8 + n + max(v["data_offsets"][1] for k, v in
                                                    header.items() if k != "__metadata__")
      assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {
          "F32" if dtype == "float32" else "BF16"}
  back = convert.load_safetensors(str(tmp_path))
  assert sorted(back) == sorted(src)
  for n, a in src.items():
    want = a if dtype == "float32" else a.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert back[n].shape == a.shape and np.array_equal(bits(back[n]), bits(want)), n


def test_bfloat16_rounding_keeps_nan():
  got = export_hf._bf16_bits(np.array([np.nan, -np.nan, 1.0 + 2**-8, 1.0 + 3 * 2**-8], np.float32))
  want = np.array([np.nan, -np.nan, 1.0 + 2**-8, 1.0 + 3 * 2**-8],
                  np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
  assert np.all(np.isnan((got.astype(np.uint32) << 16).view(np.float32)[:2]))
  assert np.array_equal(got[2:], want[2:])                   # ties to even: down, then up


@pytest.mark.parametrize("layout,stages,n", [("2,1", 0, 3), ("1,1,1,1", 2, 4)])
def test_padded_stack_round_trip(layout, stages, n):
  """padded(depth-order params) is init_params of the padded config (real layers drawn the same
  whatever the layout, padding rows zeros); unpadded inverts it; to_hf takes either."""
  cfg = Config(n_layers=n, layer_layout=layout, layer_stages=stages).validate()
  flat = cfg.replace(layer_layout="", layer_stages=0)
  assert same_tree(export_hf.padded(model.init_params(flat), cfg), model.init_params(cfg))
  assert same_tree(export_hf.unpadded(model.init_params(cfg), cfg), model.init_params(flat))
  hf = export_hf.config_to_hf(flat, "mixtral")
  assert export_hf.to_hf(model.init_params(cfg), cfg, hf).keys() == export_hf.to_hf(
      model.init_params(flat), flat, hf).keys()


def test_build_checks_an_inits_shapes():
  """train.build's init is held to the model's tree and shapes before anything is placed."""
  from modeling.config import ConfigError
  from runtime import train
  cfg = get_config("tiny")
  params = model.init_params(cfg)
  train.check_init(params, cfg)
  params["layers"]["moe"]["wo"] = params["layers"]["moe"]["wo"][:, :, :-1]
  with pytest.raises(ConfigError, match=r"\['layers'\]\['moe'\]\['wo'\] has shape"):
    train.check_init(params, cfg)
  del params["final_norm"]
  with pytest.raises(ConfigError, match="final_norm.*missing"):
    train.check_init(params, cfg)


def test_export_and_load(tmp_path):
  """export -> load gives the params back: float32 bit for bit (one file, or sharded), bfloat16
  rounded; config.json is the one given, its fields kept, or config_to_hf's."""
  hf, _, cfg, params = converted("deepseek_v3")
  written = export_hf.export(str(tmp_path / "a"), params, cfg, hf)
  assert written == {**hf, "torch_dtype": "float32"}
  assert json.loads((tmp_path / "a" / "config.json").read_text()) == written
  assert same_tree(export_hf.load(str(tmp_path / "a"), cfg), params)
  export_hf.export(str(tmp_path / "b"), params, cfg, shard_bytes=64 * 1024)
  assert (tmp_path / "b" / "model.safetensors.index.json").exists()
  assert same_tree(export_hf.load(str(tmp_path / "b"), cfg), params)
  assert Config(**convert.config_from_hf(convert.read_config(str(tmp_path / "b")))
                ).model_fields() == cfg.model_fields()
  export_hf.export(str(tmp_path / "c"), params, cfg, hf, dtype="bfloat16")
  as_bf16 = jax.tree.map(lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32), params)
  assert same_tree(export_hf.load(str(tmp_path / "c"), cfg), as_bf16)
  with pytest.raises(ValueError, match="n_layers"):
    export_hf.export(str(tmp_path / "d"), params, cfg.replace(n_layers=4), hf)


# ----------------------------------------------------------------------------- run.py
@pytest.fixture(scope="module")
def cli(tmp_path_factory):
  """Every run.py row in one process: the mixtral fixture written as a checkpoint directory
  (export), then runs from it, and bad inputs."""
  d = tmp_path_factory.mktemp("hf_io")
  hf, state, cfg, params = converted("mixtral")
  ck = str(d / "ck")
  export_hf.export(ck, params, cfg, hf)
  disk = convert.load_safetensors(ck)                            # the per-expert names

  def variant(name, edit):
    path = d / name
    path.mkdir()
    export_hf.save_safetensors(str(path / "model.safetensors"), edit(dict(disk)))
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)
  victim = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
  missing = variant("missing", lambda s: {k: v for k, v in s.items() if k != victim})
  misshaped = variant("misshaped", lambda s: {**s, victim: s[victim].T.copy()})
  no_config = d / "no_config"
  no_config.mkdir()
  export_hf.save_safetensors(str(no_config / "model.safetensors"), disk)
  out, m = str(d / "out"), lambda k: str(d / f"{k}.jsonl")
  ep = ["--strategy=ep", "--mesh=expert:2", "--devices=2"]
  ref = ["--strategy=reference", "--devices=2"]
  rows = {
      "ep": ep + [f"--init_from={ck}", "--steps=1", f"--metrics_file={m('ep')}",
                  f"--export_hf={out}"],
      "ref": ref + [f"--init_from={ck}", "--steps=2", f"--metrics_file={m('ref')}"],
      "random": ref + [f"--model={ck}", "--steps=1", f"--metrics_file={m('random')}"],
      "no_config": ep + [f"--init_from={no_config}"],
      "missing": ep + [f"--init_from={missing}"],
      "misshaped": ep + [f"--init_from={misshaped}"],
      "restore": ep + [f"--init_from={ck}", f"--checkpoint_dir={d}", "--restore=latest"],
      "compile_only": ep + [f"--export_hf={d / 'x'}", "--compile_only"],
      "other_model": ep + [f"--init_from={ck}", "--model=tiny"],
      "compare": ["--compare=ep", "--devices=2", f"--init_from={ck}", "--steps=1",
                  "--full_parity"],
      "compare_export": ["--compare=ep", "--devices=2", f"--init_from={ck}",
                         f"--export_hf={d / 'z'}"],
      "layer_layout": ["--strategy=pp", "--mesh=stage:2", "--devices=2", "--layer_layout=1,1",
                       f"--export_hf={d / 'y'}"],
      "taken": ep + [f"--export_hf={ck}"],
  }
  return {"dir": d, "ck": ck, "out": out, "hf": hf, "cfg": cfg, "params": params,
          "results": run_py_in_one_process(rows), "metrics": lambda k: [
              json.loads(l) for l in open(m(k)).read().splitlines()]}


def test_init_from_gives_the_checkpoints_loss(cli):
  """ep from the checkpoint starts at the reference's loss from it (one weight placed wrong
  would move it), which is not the random init's of the same model."""
  for k in ("ep", "ref", "random"):
    code, _, err = cli["results"][k]
    assert code == 0, err
  ep, ref, rnd = (cli["metrics"](k)[0]["loss"] for k in ("ep", "ref", "random"))
  assert abs(ep - ref) <= 1e-5 * (1 + abs(ref)), (ep, ref)
  assert abs(ref - rnd) > 1e-2, (ref, rnd)
  assert "initialised from" in cli["results"]["ep"][1]


def test_compare_mode_starts_every_row_from_the_checkpoint(cli):
  """--compare with --init_from: ep passes full parity from the checkpoint, and the reference's
  row's loss is the --strategy=reference run's first loss from it (not a random init's)."""
  code, out, err = cli["results"]["compare"]
  assert code == 0, out + err
  rows = compare_table(out)
  assert rows["ep"]["parity"].startswith("PASS (losses, grads, params)"), rows["ep"]
  want, got = cli["metrics"]("ref")[0]["loss"], rows["reference"]["final loss"]
  assert abs(float(got) - want) <= 1e-5, (got, want)


def test_export_hf_writes_the_trained_weights(cli):
  """--export_hf after one ep step: the directory loads back (convert.load_safetensors +
  from_hf) to weights that moved from the checkpoint's and give the reference's second loss
  (its params after the same first step) on the second batch; config.json is the checkpoint's,
  its fields kept."""
  assert "exported to" in cli["results"]["ep"][1]
  cfg = get_config(cli["ck"])
  written = convert.read_config(cli["out"])
  assert written == {**cli["hf"], "torch_dtype": "float32"}
  assert Config(**convert.config_from_hf(written)).model_fields() == cfg.model_fields()
  trained = convert.from_hf(convert.load_safetensors(cli["out"]), cfg)
  assert not same_tree(trained, cli["params"])
  loss = jax.jit(lambda p, b: model.loss_fn(p, b, cfg, model.reference_layout(cfg))[0])(
      trained, data_lib.batch_for(cfg, 1))
  want = cli["metrics"]("ref")[1]["loss"]
  assert abs(float(loss) - want) <= 1e-5 * (1 + abs(want)), (float(loss), want)


BAD = {"no_config": "has no config.json", "missing": "1 tensor(s) the config needs are missing: "
       "model.layers.1.block_sparse_moe.experts.3.w2.weight",
       "misshaped": "experts.3.w2.weight: shape (32, 64) but the config needs (64, 32)",
       "restore": "--init_from and --restore both give the starting weights",
       "compile_only": "--export_hf writes the trained weights: --compile_only trains none",
       "other_model": "--model=tiny and --init_from=",
       "compare_export": "--export_hf needs --strategy",
       "layer_layout": "--layer_layout=1,1 pads the MoE stack",
       "taken": "already holds a checkpoint"}


@pytest.mark.parametrize("row", sorted(BAD))
def test_bad_input_one_line(cli, row):
  code, out, err = cli["results"][row]
  line = one_error_line(code, err)
  assert BAD[row] in line, line
  assert "compiled" not in out


def test_dense_rows_inside_the_stack_round_trip():
  """Maverick's (dense, MoE) pairs stored round-robin for the interleaved schedules (4 chunks of
  one pair on 2 stages): both stacks hold stage 0's pairs 0 and 2 first (config.dense_slots);
  unpadded reads both back in depth order, padded stores them again, and the model run whole
  (model.forward, reading the stacks in depth order) gives the depth-order model's loss."""
  from runtime import data
  from strategies.pp import MAVERICK_CHUNKS
  cfg = get_config("llama4-maverick-test", **MAVERICK_CHUNKS)
  flat = cfg.replace(layer_layout="", layer_stages=0)
  assert cfg.dense_slots == (0, 2, 1, 3) and cfg.layer_slots == (0, 2, 1, 3)
  assert same_tree(export_hf.padded(model.init_params(flat), cfg), model.init_params(cfg))
  assert same_tree(export_hf.unpadded(model.init_params(cfg), cfg), model.init_params(flat))
  assert not same_tree(model.init_params(cfg), model.init_params(flat))
  batch = {k: jax.numpy.asarray(v) for k, v in data.batch_for(flat, 0).items()}
  loss = lambda c: float(model.loss_fn(jax.tree.map(jax.numpy.asarray, model.init_params(c)),
                                       batch, c, model.reference_layout(c))[0])
  assert loss(cfg) == pytest.approx(loss(flat), rel=1e-6)
