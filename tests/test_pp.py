"""pp beyond the shared table (tests/test_strategies.py, which holds parity for stage:2 and
stage:4, M = 2, 4 and 8, with data and expert axes, tiny and deepseek-test, a capacity factor):
the collective-permute bytes are exact, the aux loss is the step's (not a mean of microbatch
losses), Muon runs on the stage-sharded layers, and the schedule tables (layout/schedule.py):
valid (tests/pipeline.py replays them), drawn by its docstring, equal to the compiled permutes,
1f1b within min(M, P)/M of gpipe's activations, and interleaved's round-robin storage: every
layer once, in depth order; and the balanced layout pp picks by itself where the stages do not
divide the MoE layers (a run of it, and the one-line error where no layout exists)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layout import mesh as mesh_lib, schedule as sched
from measure import hlo
from modeling import model
from modeling.config import get_config
from runtime import data, train
import strategies
from tests import parity, pipeline

PP = strategies.get("pp")
CASES = [("tiny", dict(batch=16, microbatches=4), "stage:2,expert:4"),
         ("tiny", dict(n_layers=4, batch=16, microbatches=8), "stage:4,data:2"),
         ("deepseek-test", dict(microbatches=2), "stage:2,data:2,expert:2"),
         ("deepseek-test", dict(n_layers=5, microbatches=4, capacity_factor=1.0), "stage:4,expert:2")]
IDS = ["tiny-s2e4-m4", "tiny-s4d2-m8", "deepseek-s2d2e2-m2", "deepseek-s4e2-m4-cap"]


@pytest.mark.parametrize("model_name,over,mesh", CASES[:3], ids=IDS[:3])
def test_permute_and_weight_bytes_exact(model_name, over, mesh):
  """The permutes are 2 x (M+P-1) x [b/M, S, D]; with a data axis, the stage's non-expert
  matrices are all-gathered over data once per step (not per tick: that would be M+P-1 x) and
  their gradients reduce-scattered once, and the embedding, head and dense prefix over
  (stage, data), to the byte."""
  cfg = get_config(model_name, **over)
  table = parity.assert_cost_model("pp", cfg, mesh)
  keys = [("collective-permute", frozenset({"stage"}))]
  if "data" in mesh:
    keys += [(kind, frozenset(axes)) for kind in ("all-gather", "reduce-scatter")
             for axes in (("data",), ("stage", "data"))]
  for key in keys:
    assert table[key]["predicted"] == table[key]["measured"], (key, table[key])


def test_every_stage_stores_a_share_of_embedding_head_and_dense_prefix():
  """The weights one stage alone uses (embedding, dense prefix; head) are stored split over
  every stage, D over (stage, data), like their optimizer state: 1/(P x data) per device, not a
  whole copy per stage; the prefix's norms replicated; the MoE stack's matrices over data within
  their stage. An MLA rank the (stage, data) split does not divide is refused."""
  from jax.sharding import PartitionSpec as P
  cfg = get_config("deepseek-test", n_layers=5)
  mesh = mesh_lib.abstract_mesh({"stage": 4, "data": 2, "expert": 2})
  specs = PP.param_specs(cfg, mesh)
  shapes = model.init_params_shapes(cfg)
  is_leaf = lambda l: isinstance(l, model.ShapeLeaf)
  spread = ("stage", "data")
  for leaf, spec in zip(jax.tree.leaves(shapes["dense_layers"], is_leaf=is_leaf),
                        jax.tree.leaves(specs["dense_layers"], is_leaf=lambda x: isinstance(x, P))):
    if leaf.role in model.D_DIM:
      assert spec[1 + model.D_DIM[leaf.role]] == spread and spec[0] is None, (leaf.role, spec)
    else:
      assert all(e is None for e in spec), (leaf.role, spec)
  assert specs["embed"] == P(None, spread) and specs["unembed"] == P(spread)
  assert tuple(specs["layers"]["attn"]["wq_a"]) == ("stage", "data"), specs["layers"]["attn"]
  PP.check(cfg, mesh, PP.Options())
  with pytest.raises(strategies.ConfigError, match="kv_lora_rank=36 is not divisible by mesh "
                                                   "axis stagexdata=8"):
    PP.check(cfg.replace(kv_lora_rank=36), mesh, PP.Options())


def test_microbatch_aux_loss_is_not_a_mean_of_microbatch_losses():
  """The bug class pp avoids: the mean of per-microbatch load-balance losses is not the step's
  (f and P are products of sums over the whole batch). On deepseek-test with 4 microbatches
  the two differ by far more than the parity tolerance, so test_parity tells them apart. (The
  sequence-wise loss, deepseek-test's own, is a mean over sequences: the two agree.)"""
  cfg = get_config("deepseek-test", aux_loss_kind="batch")
  params = jax.tree.map(jnp.asarray, model.init_params(cfg))
  b = {k: jnp.asarray(v) for k, v in data.batch(0, cfg.batch, cfg.seq_len, cfg.vocab,
                                                  cfg.seed).items()}
  lay = model.reference_layout(cfg)
  whole = model.loss_fn(params, b, cfg, lay)[1]["aux_loss"]
  quarter = lambda i: {k: v[2 * i:2 * i + 2] for k, v in b.items()}
  mean = np.mean([model.loss_fn(params, quarter(i), cfg, lay)[1]["aux_loss"] for i in range(4)])
  assert abs(mean - whole) > 100 * parity.LOSS_RTOL * abs(whole), (mean, whole)
  cfg = cfg.replace(aux_loss_kind="sequence")
  lay = model.reference_layout(cfg)
  whole = model.loss_fn(params, b, cfg, lay)[1]["aux_loss"]
  mean = np.mean([model.loss_fn(params, quarter(i), cfg, lay)[1]["aux_loss"] for i in range(4)])
  np.testing.assert_allclose(mean, whole, rtol=1e-6)


# ----------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedule_tables_run_every_microbatch_once_in_order(name):
  """Every table the engine may run, P = 1..5 and M = 1..9: each stage runs each microbatch's
  forward and backward once; gpipe's hops take one tick; 1f1b's reads find their sends and its
  backwards their ring slots (check_schedule); 1f1b keeps min(M, P) in flight (Megatron's), gpipe's table M (its autodiff
  keeps M+P-1 ticks); 1f1b runs at most one phase per stage and tick, in 2(M+P-1) ticks, and
  sends both ways at each."""
  for p in range(1, 6):
    for m in range(1, 10):
      table = sched.schedule(name, p, m)
      pipeline.check_schedule(table, m)
      assert sched.in_flight(table) == (min(m, p) if name == "1f1b" else m), (p, m)
      assert len(table["F"]) == 2 * (m + p - 1)
      assert sum(sched.permutes(name, table)) == 2 * (m + p - 1) * (2 if name == "1f1b" else 1)
      if name == "1f1b":
        assert not ((table["F"] >= 0) & (table["B"] >= 0)).any()


def test_interleaved_tables_run_every_chunk_once_in_order():
  """interleaved, P = 1..4, v = 2..3, M = P..3P (multiples of P): every stage runs every
  (microbatch, chunk) once, a hop (stage s-1 to s, or the ring's P-1 to 0 into the next chunk)
  takes one tick (check_schedule); v*M+P-1 ticks each way, so the bubble is (P-1)/(v*M+P-1),
  and a permute each tick."""
  for p in range(1, 5):
    for v in (2, 3):
      for m in range(p, 3 * p + 1, p):
        table = sched.schedule("interleaved", p, m, v)
        pipeline.check_schedule(table, m)
        fwd = table["F"][:len(table["F"]) // 2]
        assert len(fwd) == v * m + p - 1
        idle = 1 - (fwd >= 0).sum() / fwd.size
        np.testing.assert_allclose(idle, (p - 1) / (v * m + p - 1))
        assert sched.permutes("interleaved", table) == (v * m + p - 1,) * 2


def test_interleaved_1f1b_tables_run_every_chunk_once_in_order():
  """1f1b with v = 2, 3 chunks per stage (Megatron's interleaved 1F1B), P = 2..5, M = P..4P:
  every (microbatch, chunk) once per stage each way, one phase per stage and tick, each read
  finds its send in its inbox slot and its residuals in its ring slot (check_schedule); fewer
  than v times plain 1f1b's ticks, each 1/v of its (P = 4, M = 16, v = 2: 70 ticks of 1/2
  against 38)."""
  for p in range(2, 6):
    for v in (2, 3):
      for m in range(p, 4 * p + 1, p):
        table = sched.schedule("1f1b", p, m, v)
        pipeline.check_schedule(table, m)
        assert len(table["F"]) < v * len(sched.schedule("1f1b", p, m)["F"]), (p, v, m)
  assert len(sched.schedule("1f1b", 4, 16, 2)["F"]) == 70


def test_check_schedule_refuses_broken_interleaved_tables():
  """The checker fails an interleaved table whose stage runs a chunk out of turn or drops one."""
  good = sched.schedule("interleaved", 2, 2, 2)
  pipeline.check_schedule(good, 2)
  swapped = {k: v.copy() for k, v in good.items()}
  swapped["C"][[2, 3], 1] = swapped["C"][[3, 2], 1]      # stage 1: F1b, then F0a: out of turn
  dropped = {k: v.copy() for k, v in good.items()}
  dropped["F"][1, 0] = -1                                 # stage 0 never runs F1a
  dropped["B"][-2, 0] = -1
  for bad in (swapped, dropped):
    with pytest.raises(AssertionError):
      pipeline.check_schedule(bad, 2)


def test_check_schedule_refuses_broken_tables():
  """The checker fails a table that drops a forward, repeats a backward, or delays a stage's
  forwards by a tick (the activation it reads was overwritten: a broken hop)."""
  good = sched.schedule("1f1b", 3, 4)                 # 12 ticks, stage 1's F0 at tick 1
  pipeline.check_schedule(good, 4)
  dropped = {k: v.copy() for k, v in good.items()}
  dropped["F"][1, 1] = -1
  repeated = {k: v.copy() for k, v in good.items()}
  repeated["B"][5, 2] = 0
  late = {k: v.copy() for k, v in good.items()}
  late["F"][:, 1] = np.roll(late["F"][:, 1], 1)
  for bad in (dropped, repeated, late):
    with pytest.raises(AssertionError):
      pipeline.check_schedule(bad, 4)


def test_docstring_draws_the_tables_it_runs():
  """layout/schedule.py's docstring draws the tables pp runs."""
  assert pipeline.diagram(sched.schedule("gpipe", 4, 4)) in sched.__doc__
  assert pipeline.diagram(sched.schedule("1f1b", 4, 8)) in sched.__doc__
  assert pipeline.diagram(sched.schedule("interleaved", 3, 3, 2)) in sched.__doc__
  assert pipeline.diagram(sched.schedule("1f1b", 2, 4, 2)) in sched.__doc__


@pytest.mark.parametrize("case", [c for c in PP.COST_CASES
                                  if c.opts in (PP.ONE_F, PP.INTERLEAVED, PP.ONE_F_INTERLEAVED)
                                  and not c.mesh.startswith("stage:1,")],
                         ids=lambda c: f"{c.model}-{c.mesh}-{c.opts.schedule}")
def test_scheduled_permutes_are_the_tables(case):
  """The compiled 1f1b or interleaved step's collective-permutes over stage: the table's sends
  (plus the counts pre-pass's when 1f1b's batch-wise loss needs it: vM+P-1, less the last
  tick's unread send where v = 1 unrolls it), each one microbatch's [b/M, S/c, D]. (One stage
  sends nothing over stage: its contract and cost rows hold that.)"""
  cfg = case.config()
  j = parity.job("pp", cfg, case.mesh, case.opts)
  got = hlo.collective_stats_by_axes(j.hlo, j.mesh)[("collective-permute", frozenset({"stage"}))]
  p, m, name = j.mesh.shape["stage"], cfg.microbatches, case.opts.schedule
  v = sched.chunks(cfg)
  want = sum(sched.permutes(name, sched.schedule(name, p, m, v)))
  want += (v * m + p - 1 - (v == 1)) * sched.counts_pre_pass(cfg, case.opts)
  b = cfg.batch // (j.mesh.shape["data"] * j.mesh.shape["expert"]) // m
  assert got["count"] == want
  s = cfg.seq_len // j.mesh.shape["context"]                    # a device's positions
  assert got["bytes"] == want * b * s * cfg.d_model * 4


def test_1f1b_holds_at_most_p_microbatches():
  """Megatron's bound, compile-only XLA temp, one sequence per microbatch per device (S = 512,
  stage:2,expert:4, M = 4P = 8): gpipe grows by a = (g(8) - g(2)) / 6 per microbatch, its
  activation share (M+P-1) a; 1f1b's share is its temp less its constant (its M = 1 temp, one
  microbatch held, less a). 1f1b's share <= min(M, P)/M x gpipe's + 10% (measured 31.4 MiB
  against a bound of 38.0; a ring of 2P-1 would hold about 47)."""
  def temp(schedule, m):
    cfg = get_config("tiny", seq_len=512, batch=4 * m, microbatches=m, aux_loss_kind="sequence")
    j = train.build(PP, cfg, mesh_lib.for_strategy(PP, "stage:2,expert:4"),
                    PP.Options(schedule=schedule), compile_only=True)
    return j.compiled.memory_analysis().temp_size_in_bytes
  p, m = 2, 8
  a = (temp("gpipe", m) - temp("gpipe", p)) / (m - p)
  one = temp("1f1b", m) - (temp("1f1b", 1) - a)
  assert one <= 1.1 * min(m, p) / m * (m + p - 1) * a, (one / 2**20, a / 2**20)


# ----------------------------------------------------------------------------- layer layouts
@pytest.mark.parametrize("n_layers,dense,groups,stages",
                         [(61, 3, 16, 0), (5, 0, 2, 0), (61, 3, 32, 16), (5, 0, 4, 2)],
                         ids=["61-layers-16-stages", "5-layers-2-stages",
                              "61-layers-16-stages-interleaved", "5-layers-2-stages-interleaved"])
def test_layer_layout_runs_every_layer_once_in_order(n_layers, dense, groups, stages):
  """An uneven --layer_layout (the balanced one: 58 MoE layers as ten groups of 4 and six of 3;
  5 as 3 + 2) pads the MoE stack with inert rows; interleaved's storage (layer_stages) puts the
  groups round-robin on the stages (V3's 58 as 32 chunks on 16 stages: stage 0 holds layers
  0-1 and 31-32). The stored model is the plain one: every real row holds the layer of its
  depth (each once), the stack runs in depth order, its loss and its real rows' gradients are
  the plain model's (a skipped, repeated or reordered layer would change them: the layers'
  weights differ), and its padding rows get zero gradients."""
  from modeling.config import balanced_layout
  cfg = get_config("deepseek-test", n_layers=n_layers, first_k_dense_replace=dense, batch=2,
                   seq_len=8, aux_loss_kind="batch", z_loss_coef=1e-3, vocab=32, d_model=16,
                   n_heads=2, n_kv_heads=2, d_ff=8, dense_d_ff=8, kv_lora_rank=8,
                   qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
  padded = cfg.replace(layer_layout=balanced_layout(cfg.n_moe_layers, groups),
                       layer_stages=stages).validate()
  slots = np.asarray(padded.layer_slots)
  assert sorted(slots[slots >= 0]) == list(range(cfg.n_moe_layers))
  assert (list(slots[slots >= 0]) == list(range(cfg.n_moe_layers))) == (not stages)
  assert len(slots) == groups * max(padded.layer_groups) > cfg.n_moe_layers
  if stages:                                  # stage s's rows: its groups s, s+P, .. in turn
    rows = slots.reshape(stages, -1, max(padded.layer_groups))
    first = np.cumsum((0,) + padded.layer_groups)[:-1]
    for s in range(stages):
      np.testing.assert_array_equal(rows[s, :, 0], first[s::stages])
  b = {k: jnp.asarray(v) for k, v in data.batch(0, cfg.batch, cfg.seq_len, cfg.vocab,
                                                  cfg.seed).items()}

  def run(c):
    params = jax.tree.map(jnp.asarray, model.init_params(c))
    fn = lambda p: model.loss_fn(p, b, c, model.reference_layout(c))
    return params, jax.jit(jax.value_and_grad(fn, has_aux=True))(params)
  p0, ((l0, m0), g0) = run(cfg)
  p1, ((l1, m1), g1) = run(padded)
  real = slots >= 0
  depth = slots[real]                         # the layer each real row holds
  for a, r in zip(jax.tree.leaves(p1["layers"]), jax.tree.leaves(p0["layers"])):
    np.testing.assert_array_equal(np.asarray(a)[real], np.asarray(r)[depth])   # the same layers
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  for k in ("aux_loss", "z_loss"):
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(m1["counts"])[real], np.asarray(m0["counts"])[depth])
  for a, r in zip(jax.tree.leaves(g1["layers"]), jax.tree.leaves(g0["layers"])):
    np.testing.assert_allclose(np.asarray(a)[real], np.asarray(r)[depth], rtol=1e-5, atol=1e-7)
    assert not np.asarray(a)[~real].any()                        # padding: zero gradients
  rest = lambda g: jax.tree.leaves({k: v for k, v in g.items() if k != "layers"})
  for a, r in zip(rest(g1), rest(g0)):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-7)


def test_interleaved_bf16_with_remat():
  """interleaved in bf16 mixed precision with remat block inside each chunk (the chunk's custom
  vjp around jax.checkpoint'd layers): the bf16 reference's losses, gradients and updates."""
  cfg = get_config("tiny", n_layers=4, batch=16, microbatches=4, layer_layout="1,1,1,1",
                   layer_stages=2, remat="block")
  parity.check_bf16("pp", cfg, "stage:2,expert:4", opts=PP.INTERLEAVED)


def test_bf16_with_tensor_and_context_inside_the_stages():
  """Megatron's within-stage layouts in bf16 mixed precision: deepseek-test (MLA, the dense
  prefix, the sequence-wise loss) on stage:2,context:2,tensor:2 under 1f1b: the bf16
  reference's losses, gradients and updates; the contract and the cost model in bf16 bytes
  (the all-reduces over tensor and the latent's gather over context move bf16)."""
  cfg = get_config("deepseek-test", n_layers=5, microbatches=2)
  parity.check_bf16("pp", cfg, "stage:2,context:2,tensor:2", opts=PP.ONE_F)
  b16 = parity.bf16_config(cfg)
  parity.assert_contract("pp", b16, "stage:2,context:2,tensor:2", PP.ONE_F)
  parity.assert_cost_model("pp", b16, "stage:2,context:2,tensor:2", PP.ONE_F)


# ----------------------------------------------------------------------------- the default layout
def test_stored_config_balances_stages_that_do_not_divide_the_layers():
  """3 MoE layers (deepseek-test's 4, one dense) on 2 stages, no --layer_layout: gpipe and 1f1b
  store the planner's balanced layout, 2,1 (a padded stack of 4 rows), which check() admits,
  and layout_note names it; a given layout, or stages that divide the layers, stay as given."""
  mesh = mesh_lib.abstract_mesh({"stage": 2, "data": 1, "expert": 4})
  cfg = get_config("deepseek-test", n_layers=4)
  for opts in (PP.Options(), PP.ONE_F):
    stored = PP.stored_config(cfg, mesh, opts)
    assert (stored.layer_layout, stored.layer_slots) == ("2,1", (0, 1, 2, -1))
    PP.check(stored, mesh, opts)
    assert PP.layout_note(cfg, mesh, opts) == \
        "pp: 3 MoE layers on 2 stages: --layer_layout=2,1 (balanced)"
  for given in (cfg.replace(layer_layout="1,2").validate(),
                get_config("deepseek-test", n_layers=5)):          # 4 MoE layers: 2 + 2
    assert PP.stored_config(given, mesh, PP.Options()) is given
    assert PP.layout_note(given, mesh, PP.Options()) is None


@pytest.mark.parametrize("model_name,n_layers,stages,message", [
    ("tiny", 1, 2, "n_layers=1 < mesh axis stage=2: fewer MoE layers than stages, no layer "
                   "layout gives each stage one"),
    ("deepseek-test", 4, 4, "n_layers - first_k_dense_replace=3 < mesh axis stage=4: fewer MoE "
                            "layers than stages, no layer layout gives each stage one")],
    ids=["1-layer-2-stages", "3-moe-layers-4-stages"])
def test_fewer_moe_layers_than_stages_is_a_one_line_error(model_name, n_layers, stages, message):
  """No layout gives every stage a MoE layer: stored_config leaves the model as given (no note)
  and check() refuses it in one line that says so (before: 'not divisible')."""
  from modeling.config import ConfigError
  mesh = mesh_lib.abstract_mesh({"stage": stages, "data": 1, "expert": 8 // stages})
  cfg = get_config(model_name, n_layers=n_layers)
  stored = PP.stored_config(cfg, mesh, PP.Options())
  assert stored is cfg and PP.layout_note(cfg, mesh, PP.Options()) is None
  with pytest.raises(ConfigError) as e:
    PP.check(stored, mesh, PP.Options())
  assert str(e.value) == message


def test_run_picks_the_balanced_layout_by_itself(tmp_path):
  """The command line: 3 MoE layers on stage:2 without --layer_layout
  trains on the balanced 2,1, printed once as a note, with finite losses (before: exit 2,
  'n_layers - first_k_dense_replace=3 is not divisible by mesh axis stage=2')."""
  import json
  import os
  import subprocess
  import sys

  from tests.conftest import subprocess_env
  env = subprocess_env()                       # as tests/test_cli.py's _run
  env["JAX_PLATFORMS"] = "cpu"
  path = tmp_path / "m.jsonl"
  r = subprocess.run([sys.executable, "run.py", "--strategy=pp", "--model=deepseek-test",
                      "--layers=4", "--mesh=stage:2,expert:4", "--steps=2",
                      f"--metrics_file={path}"],
                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  out = (r.stdout + r.stderr).splitlines()
  assert [l for l in out if "layer_layout" in l] == \
      ["note: pp: 3 MoE layers on 2 stages: --layer_layout=2,1 (balanced)"], r.stdout + r.stderr
  losses = [rec["loss"] for rec in map(json.loads, path.read_text().splitlines())
            if not rec.get("summary")]
  assert len(losses) == 2 and np.isfinite(losses).all(), losses


# Megatron's published TP x PP x EP (x CP) layouts at the publishers' shapes (docs/strategies-
# and-pipelines.md, "Tensor parallelism inside the stages"), with parallel folding
# (experts=fold): (model, mesh, batch, sequence, v, the stored chunk layout pp picks, or the
# one-line refusal). Qwen3-235B's long-context rows: TP4 PP8 VPP4 EP8 with CP2 at 32K and CP4 at
# 64K, global batch 256 (EP8 = expert:2 x tensor:4, attention TP4 x CP x DP)
MEGATRON = [
    ("deepseek-v3", "stage:8,data:2,expert:32,tensor:2", 8192, 4096, 4,
     "2," * 26 + "1,1,1,1,1,1", None),
    ("qwen3-235b-a22b", "stage:8,expert:16,tensor:2", 2048, 4096, 4, "3," * 30 + "2,2", None),
    ("qwen3-235b-a22b", "stage:32,expert:4,tensor:2", 2048, 4096, 3, None,
     "--opt=virtual_stages=3 on stage=32 needs 96 MoE layers, the model has 94"),
    ("qwen3-235b-a22b", "stage:8,data:4,expert:2,tensor:4", 2048, 4096, 4, "3," * 30 + "2,2",
     None),
    ("qwen3-235b-a22b", "stage:8,data:2,expert:2,context:2,tensor:4", 256, 32768, 4,
     "3," * 30 + "2,2", None),
    ("qwen3-235b-a22b", "stage:8,expert:2,context:4,tensor:4", 256, 65536, 4, "3," * 30 + "2,2",
     None)]


@pytest.mark.parametrize("model_name,mesh,batch,seq,v,layout,refusal", MEGATRON,
                         ids=["dsv3-tp2-pp8-vp4-ep64", "qwen3-a", "qwen3-d", "qwen3-e",
                              "qwen3-cp2-32k", "qwen3-cp4-64k"])
def test_megatron_layouts_at_the_publishers_shapes(model_name, mesh, batch, seq, v, layout,
                                                   refusal):
  """pp with a tensor axis and the experts folded over (expert, tensor) poses Megatron's
  TP x PP x VP x EP (x CP) layouts at full shape: the stored chunks it balances by itself, or
  its one line where the layers do not fill them."""
  from modeling.config import ConfigError
  shape = mesh_lib.parse_mesh_spec(mesh)
  rows = batch // (shape.get("data", 1) * shape.get("expert", 1))     # a device's sequences
  cfg = get_config(model_name, batch=batch, seq_len=seq, microbatches=min(128, rows))
  am = mesh_lib.abstract_mesh({a: shape.get(a, 1) for a in PP.AXES})
  opts = PP.Options(schedule="1f1b", virtual_stages=v, experts="fold")
  try:
    stored = strategies.stored_config(PP, cfg, am, opts)
    PP.check(stored.validate(), am, opts)
  except ConfigError as e:
    assert refusal is not None and str(e) == refusal, e
    return
  assert refusal is None and stored.layer_layout == layout.rstrip(",")
  assert stored.layer_stages == 8 and len(stored.layer_groups) == 8 * v
