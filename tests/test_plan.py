"""The planner (planning/): enumeration counts, admissibility errors, ranking order, the speed
of ranking on real shapes, gradient accumulation's candidates, and the honesty check: three
compiled candidates (one accumulating) whose predicted bytes per (kind, axes) are within 1% of
the HLO's and whose predicted memory is within MEMORY_RTOL of XLA's."""
import dataclasses
import math
import re
import time

import numpy as np
import pytest

from layout import mesh as mesh_lib
from measure import cost
from modeling import model
from modeling.config import ConfigError, get_config
from planning import check, clusters, plan
import strategies

H100 = clusters.get("h100")
NODE4 = clusters.Cluster("node4", H100.peak_flops, H100.hbm_bytes, 4, H100.intra_bw,
                         H100.inter_bw, "a node of 4, for the tests")


def test_splits_and_placements():
  assert sorted(mesh_lib.splits(8, 1)) == [(8,)]
  triples = list(mesh_lib.splits(8, 3))
  assert len(triples) == 10 and len(set(triples)) == 10          # C(3 + 2, 2) ordered triples
  assert all(math.prod(t) == 8 for t in triples)
  assert sorted(mesh_lib.splits(12, 2, powers_of_two=True)) == [(1, 12), (2, 6), (4, 3)]
  assert plan.placements({"data": 2, "expert": 4}, 8) == [("data", "expert")]
  assert plan.placements({"data": 2, "expert": 4}, 4) == [("data",), ("expert",)]
  assert plan.placements({"data": 16, "expert": 1}, 8) == [()]    # data:16 spans two nodes


def test_enumeration_counts_on_tiny():
  """dp: one mesh x 2 capacity factors x 2 remats, one placement; ep: the 10 splits of 8
  devices over (data, fsdp, expert), all admitted by tiny (8 experts, batch 8), each inside one
  node of 8: 10 x 2 x 2."""
  cfg = get_config("tiny", dtype="bfloat16")
  dp = plan.enumerate_candidates(cfg, 8, H100, 80e9, names=("dp",))
  assert len(dp) == 4 and not any(c.error for c in dp)
  ep = plan.enumerate_candidates(cfg, 8, H100, 80e9, names=("ep",))
  assert len(ep) == 40 and not any(c.error for c in ep)
  assert len({(c.sizes, c.remat, c.capacity_factor) for c in ep}) == 40
  # nodes of 4: a mesh with two axes of size 2 and 4 has two placements, fsdp:8 none inside
  ep4 = plan.enumerate_candidates(cfg, 8, NODE4, 80e9, names=("ep",), remats=("block",),
                                  capacity_factors=(0.0,))
  by_mesh = {}
  for c in ep4:
    by_mesh.setdefault(c.mesh_str, []).append(c.inner)
  assert sorted(by_mesh["data:2,expert:4"]) == [("data",), ("expert",)]
  assert by_mesh["fsdp:8"] == [()]


def test_option_grid():
  """cp's K/V exchange is part of the candidate: each admitted cp layout comes with allgather
  and ring, says which in its layout, and the two predict different bytes."""
  cfg = get_config("tiny", dtype="bfloat16")
  cands = [c for c in plan.enumerate_candidates(cfg, 8, H100, 80e9, names=("cp",),
                                                remats=("block",), capacity_factors=(0.0,))
           if not c.error]
  by_mesh = {}
  for c in cands:
    by_mesh.setdefault(c.sizes, {})[c.opts.kv_exchange] = c
  assert by_mesh and all(set(v) == {"allgather", "ring"} for v in by_mesh.values())
  ctx = next(v for k, v in by_mesh.items() if dict(k)["context"] > 1)
  assert "kv_exchange=ring" in ctx["ring"].layout()
  assert ctx["ring"].comm_s != ctx["allgather"].comm_s


def test_admissibility_errors_are_check_lines():
  """tiny has 2 layers: pp on stage:4 or stage:8 is refused with check()'s one line, and a
  refused candidate carries no prediction and is not ranked."""
  cfg = get_config("tiny", dtype="bfloat16")
  cands = plan.enumerate_candidates(cfg, 8, H100, 80e9, names=("pp",))
  refused = [c for c in cands if c.error]
  assert ("n_layers=2 < mesh axis stage=4: fewer MoE layers than stages, no layer layout gives "
          "each stage one") in {c.error for c in refused}
  assert all(c.step_s == 0 and c.memory == 0 for c in refused)
  ranked = plan.rank(cands)
  assert ranked and all(not c.error for c in ranked)
  assert all(dict(c.sizes)["stage"] in (1, 2) for c in ranked)


def test_pp_on_stages_that_do_not_divide_the_layers_runs_the_balanced_layout():
  """3 MoE layers: pp on stage:2 runs 2 + 1 (a padded stack of 4 rows), and the candidate
  compiles with that layout; stage:4 holds more stages than layers and is refused with
  check()'s line."""
  cfg = get_config("tiny", dtype="bfloat16", n_layers=3)
  cands = plan.enumerate_candidates(cfg, 8, H100, 80e9, names=("pp",))
  plain = [c for c in cands if c.opts.virtual_stages == 1]
  two = [c for c in plain if dict(c.sizes)["stage"] == 2 and not c.error]
  assert two and all(c.layer_layout == "2,1" and "layers=2x1+1x1" in c.layout() for c in two)
  assert plan.config_for(two[0], cfg).layer_layout == "2,1"
  assert all(c.error == "n_layers=3 < mesh axis stage=4: fewer MoE layers than stages, no layer "
             "layout gives each stage one" for c in plain if dict(c.sizes)["stage"] == 4)
  # interleaved and interleaved 1F1B (2 chunks per stage) need 2P MoE layers: refused with
  # stored_config's line
  assert all(c.error == "--opt=virtual_stages=2 on stage=2 needs 4 MoE layers, the model has 3"
             for c in cands if c.opts.virtual_stages == 2 and dict(c.sizes)["stage"] == 2)


def test_one_f_ticks_closed_form_is_the_table():
  """The planner's 1f1b tick counts: v = 1's closed form (P forward-only ticks, 2M + P - 2 with
  a backward, a ring of min(M, P)) is what pp's table gives; v = 2 is read off the table, and
  its ring is ((v + 1) P - 1) / v stage-microbatches at most (docs/strategies-and-pipelines.md,
  "Interleaved 1F1B")."""
  pp = strategies.get("pp")
  plan.one_f_ticks.cache_clear()
  for p, m in ((2, 2), (2, 6), (4, 4), (4, 8), (8, 8)):
    table = pp.schedule("1f1b", p, m, 1)
    backward = (np.asarray(table["B"]) >= 0).any(axis=1)
    assert plan.one_f_ticks(p, m, 1) == (int((~backward).sum()), int(backward.sum()),
                                         pp.in_flight(table)), (p, m)
  fwd, bwd, ring = plan.one_f_ticks(4, 16, 2)
  assert fwd + bwd == len(pp.schedule("1f1b", 4, 16, 2)["F"]) == 70
  assert ring == 2 * (4 - 1) + (2 - 1) * 4 + 1


def test_interleaved_candidates_store_the_chunks_and_shorten_the_bubble():
  """pp's interleaved candidates (v = 2) carry the round-robin storage they compile with
  (layer_stages = P, P x v groups) and are predicted with the bubble (P-1)/(vM+P-1): less
  compute time than gpipe's same layout."""
  cfg = get_config("tiny", dtype="bfloat16", n_layers=4)
  cands = [c for c in plan.enumerate_candidates(cfg, 8, H100, 80e9, names=("pp",))
           if not c.error and dict(c.sizes)["stage"] == 2]
  key = lambda c: (c.sizes, c.microbatches, c.remat, c.capacity_factor, c.inner)
  gpipe = {key(c): c for c in cands if c.opts.schedule == "gpipe"}
  inter = [c for c in cands if c.opts.schedule == "interleaved"]
  assert inter and all("schedule=interleaved virtual_stages=2" in c.layout() for c in inter)
  for c in inter:
    run = plan.config_for(c, cfg)
    assert (run.layer_stages, run.layer_layout) == (2, "1,1,1,1")
    g = gpipe[key(c)]
    p, m = 2, c.microbatches
    np.testing.assert_allclose(c.compute_s / g.compute_s,
                               (2 * m + p - 1) / (2 * m) / ((m + p - 1) / m), rtol=1e-9)
  # interleaved 1F1B: the same storage, its table's ticks of one chunk each, fewer in time
  # than plain 1f1b's, and a ring of chunk slots in place of min(M, P) microbatches
  one_f = {key(c): c for c in cands if c.opts.schedule == "1f1b" and c.opts.virtual_stages == 1}
  inter_1f = [c for c in cands if c.opts.schedule == "1f1b" and c.opts.virtual_stages == 2]
  assert inter_1f and all("schedule=1f1b virtual_stages=2" in c.layout() for c in inter_1f)
  for c in inter_1f:
    assert plan.config_for(c, cfg).layer_stages == 2
    assert c.compute_s < one_f[key(c)].compute_s, (c.layout(), c.compute_s)


def test_ranking_order_and_exact_params():
  """Those that fit come first, each group by predicted step time; dp's params + optimizer
  state are 3 x the float32 params (param + 2 Adam moments), exactly; a candidate whose axes
  all lie inside a node moves its bytes no slower than the same layout with none inside (each
  collective's latency aside: test_published.py holds it)."""
  cfg = get_config("mixtral-8x7b", dtype="bfloat16", n_layers=4)
  cands = plan.enumerate_candidates(cfg, 64, H100, 60 * 2**30, names=("dp", "fsdp", "ep"),
                                    latency=False)
  ranked = plan.rank(cands)
  fits = [c.fits for c in ranked]
  assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
  for group in (True, False):
    times = [c.step_s for c in ranked if c.fits == group]
    assert times == sorted(times)
  full = sum(cost.nbytes(l.shape) for l in model.param_leaves(cfg))
  dp = next(c for c in ranked if c.strategy == "dp")
  assert dp.param_opt == 3 * full and not dp.fits
  same = {}
  for c in ranked:
    same.setdefault((c.strategy, c.sizes, c.microbatches, c.remat, c.capacity_factor),
                    []).append(c)
  groups = [g for g in same.values() if len(g) > 1]
  assert groups                                   # placements differ only in communication
  for g in groups:
    assert len({c.compute_s for c in g}) == 1 and len({c.memory for c in g}) == 1
  # one link class (inter = intra): every placement communicates alike, and no faster than
  # any placement on the real cluster, whose inter-node links are slower
  flat = clusters.Cluster("flat", H100.peak_flops, H100.hbm_bytes, 8, H100.intra_bw,
                          H100.intra_bw, "one link class")
  even = plan.enumerate_candidates(cfg, 64, flat, 60 * 2**30, names=("ep",), latency=False)
  by_layout = {}
  for c in even:
    if not c.error:
      by_layout.setdefault((c.sizes, c.remat, c.capacity_factor), set()).add(round(c.comm_s, 12))
  assert all(len(v) == 1 for v in by_layout.values())
  for c in ranked:
    if c.strategy == "ep":
      assert c.comm_s >= min(by_layout[(c.sizes, c.remat, c.capacity_factor)]) * (1 - 1e-9)

def test_a_tpu_slice_is_one_node_of_ici_and_slices_meet_over_dcn():
  """tpu-v5p: up to 6,144 chips are one slice, so every layout has one placement, all its axes
  on ICI; on two slices (12,288 chips) no placement holds every axis: one crosses the DCN."""
  tpu = clusters.get("tpu-v5p")
  assert (tpu.node_size, tpu.intra_bw, tpu.inter_bw) == (6144, 200e9, 6.25e9)
  cfg = get_config("mixtral-8x7b", dtype="bfloat16")
  ranked = [c for c in plan.enumerate_candidates(cfg, 64, tpu, tpu.hbm_bytes, names=("ep",))
            if not c.error]
  assert ranked and all(set(c.inner) == {a for a, n in c.sizes if n > 1} for c in ranked)
  sizes = {"data": 2, "fsdp": 8, "expert": 768}                      # 12,288 chips: 2 slices
  assert ("expert", "fsdp") in plan.placements(sizes, tpu.node_size)
  assert all(len(p) < 3 for p in plan.placements(sizes, tpu.node_size))


def test_cluster_profiles_are_per_device():
  """A profile's figures are one JAX device's: tpu-v7's device is half a chip (2,307 TFLOP/s and
  192 GiB per chip); a TPU's temp model is XLA:TPU's fit, a GPU's XLA:CPU's."""
  v7 = clusters.get("tpu-v7")
  assert (2 * v7.peak_flops, 2 * v7.hbm_bytes) == (2307e12, 192 * 2**30)
  for c in clusters.PROFILES.values():
    assert c.temp_model == ("XLA:TPU" if c.name.startswith("tpu-") else "XLA:CPU"), c.name
    assert c.temp_model in plan.TEMP_COEFS and c.intra_bw > c.inter_bw and c.doc, c.name


def test_ranks_a_thousand_real_candidates_quickly(monkeypatch):
  """The speed docs/planner.md claims ("Speed"), loosely (a shared 2-core host): Mixtral-8x7B
  on 64 devices enumerates over a thousand candidates in well under a minute, without a device
  mesh. What keeps it fast: the parameter tree is built once per model config, not per
  candidate (its candidates hold a few dozen configs)."""
  built, tree = [], model._param_tree

  def counted(cfg, leaf):
    built.append(cfg)
    return tree(cfg, leaf)
  monkeypatch.setattr(model, "_param_tree", counted)
  for cached in (model.init_params_shapes, model.param_counts, model._param_specs):
    getattr(cached, "cache_clear", lambda: None)()       # start cold, whatever ran before
  cfg = get_config("mixtral-8x7b", dtype="bfloat16")
  t = time.perf_counter()
  cands = plan.enumerate_candidates(cfg, 64, H100, 80e9)
  ranked = plan.rank(cands)
  # under a minute: beside CI's two test workers on 2 cores it takes 33 to 35 s
  assert len(ranked) >= 1000 and time.perf_counter() - t < 60
  trees, n = len(built), len(cands)
  assert 0 < trees <= n / 50, f"{trees} parameter trees built for {n} candidates"


# Predicted memory against XLA's, params + optimizer + temp of the donated step, on the four
# compiled candidates below: held out (D, heads, F and vocab differ from planning/calibrate.py's
# models), at the calibration's depth and length (4 layers, S = 1024), where they come out at
# 0.996, 1.003 and 0.988 (the third accumulating, M = 2) on jax 0.12.0.1, and ep_x_tp's zero1
# with accumulation at 0.992 (its temp term is set from buffer assignments, not fitted). zero1
# without accumulation is over-predicted on this small shape (docs/planner.md, "Honesty").
# XLA's temp has a part the model does not scale down, so 10% holds at this scale,
# not on shallower and shorter models.
MEMORY_RTOL = 0.10
SMALL = dict(d_model=512, n_heads=8, n_kv_heads=8, head_dim=64, d_ff=1024, n_layers=4,
             seq_len=1024, batch=16, dtype="bfloat16", vocab=8000)


@pytest.fixture(scope="module")
def compiled():
  """The planner's two best distinct layouts of ep and fsdp for a small Mixtral-shaped model on
  the 8 test devices, its best with gradient accumulation, and its best of ep_x_tp's zero1 with
  gradient accumulation (one gather and one reduce-scatter per step for both passes), compiled
  (compile only)."""
  cfg = get_config("mixtral-8x7b", **SMALL)
  enum = lambda names: plan.rank(plan.enumerate_candidates(cfg, 8, H100, 80e9, names=names,
                                                           remats=("block",),
                                                           capacity_factors=(0.0,)))
  ranked = enum(("ep", "fsdp"))
  accum = next(c for c in ranked if c.microbatches > 1)
  zero1 = next(c for c in enum(("ep_x_tp",)) if c.opts.zero1 and c.microbatches > 1)
  return [check.compile_candidate(c, cfg) for c in check.distinct(ranked, 2) + [accum, zero1]]


def test_accumulation_is_enumerated_and_priced_as_the_cost_model():
  """Outside pp, gradient accumulation's M is every divisor of the sequences a batch shard
  holds: each M is a candidate of its own, says M in its layout, and is priced as
  measure.cost.step_terms prices the step (M microbatches' exchanges, the counts pass, the
  once-per-step terms once); it holds one microbatch's activations plus a gradient carry."""
  cfg = get_config("mixtral-8x7b", **SMALL)
  # gmm flat: under rows, M = 2 also halves each grouped matmul's rows (test_published.py)
  cands = [c for c in plan.enumerate_candidates(cfg, 8, H100, 80e9, names=("ep",),
                                                remats=("block",), capacity_factors=(0.0,),
                                                gmm="flat")
           if not c.error and dict(c.sizes) == {"data": 1, "fsdp": 1, "expert": 8}]
  by_m = {c.microbatches: c for c in cands}
  assert sorted(by_m) == [1, 2], sorted(by_m)            # 16 sequences over 8 batch shards
  one, two = by_m[1], by_m[2]
  assert " M=2 " in two.layout() and " M=" not in one.layout()
  c_cfg = plan.config_for(two, cfg)
  ref = dataclasses.replace(two)
  plan.timing(ref, c_cfg, plan.step_loads(cost.step_terms(
      strategies.get("ep"), c_cfg, mesh_lib.abstract_mesh(dict(two.sizes)), two.opts), c_cfg,
      "ep", dict(two.sizes), two.opts), H100, plan.EFFICIENCY, gmm="flat")
  assert ref.comm_s == pytest.approx(two.comm_s, rel=1e-12) and two.comm_s > one.comm_s
  assert two.compute_s == pytest.approx(one.compute_s * 5 / 4)   # + pass 1's forwards
  assert two.temp < one.temp, (two.temp, one.temp)


def test_compiled_bytes_per_kind_and_axes_within_one_percent(compiled):
  for r in compiled:
    assert r.bytes_by_axes, r.candidate.layout()
    bad = {k: v for k, v in r.bytes_by_axes.items() if not 0.99 <= v["ratio"] <= 1.01}
    assert not bad, (r.candidate.layout(), bad)


def test_compiled_collective_counts_are_the_cost_model_calls(compiled):
  """Every (kind, axes) issues as many collectives per step in XLA:CPU's program as the cost
  terms count (plan.calls_of; XLA:CPU merges none): the latency term's calls."""
  for r in compiled:
    assert r.calls_by_axes, r.candidate.layout()
    bad = {k: v for k, v in r.calls_by_axes.items() if v[0] != pytest.approx(v[1])}
    assert not bad, (r.candidate.layout(), bad)


def test_compiled_memory_within_tolerance(compiled):
  for r in compiled:
    assert abs(r.memory_ratio - 1) <= MEMORY_RTOL, (r.candidate.layout(), r.memory_ratio,
                                                    r.candidate.temp, r.compiled_temp)


def test_pp_on_one_stage_is_predicted_without_a_time_loop():
  """pp's gpipe on one stage with one microbatch runs its time loop once: XLA folds the loop, so
  no weight copy or sum lives through it (plan._one_tick), and the planner's memory is within
  MEMORY_RTOL of XLA's on the calibration's Mixtral shape (0.982); priced with the loop's
  copies and sums it was 1.253. 1f1b on one stage keeps its explicit float32 sums, and is
  priced with them (1.064)."""
  from planning import calibrate
  cfg = get_config("mixtral-8x7b", **calibrate.MIXTRAL[1], dtype="bfloat16")
  mesh = {"stage": 1, "data": 2, "expert": 4}
  cands = plan.enumerate_candidates(cfg, 8, H100, 80e9, names=("pp",), remats=("block",),
                                    capacity_factors=(0.0,), only_mesh=mesh)
  pick = lambda schedule, m: next(c for c in cands if c.microbatches == m and not c.error
                                  and c.opts.schedule == schedule and c.opts.virtual_stages == 1)
  gpipe, one_f = pick("gpipe", 1), pick("1f1b", 1)
  assert gpipe.temp < one_f.temp
  for c in (gpipe, one_f):
    r = check.compile_candidate(c, cfg)
    assert abs(r.memory_ratio - 1) <= MEMORY_RTOL, (c.layout(), r.memory_ratio)


# run.py --plan's first line: the ranking, then the global batch and where it came from
FIRST_LINE = re.compile(r"ranked (\d+) candidates \((\d+) fit\) in [\d.]+ s; global batch "
                        r"(?P<batch>\d+) x (?P<seq>\d+) tokens \((?P<source>.+)\)")


def test_plan_command_line(tmp_path):
  """`run.py --plan`: the first line, the table, the refusals, --plan_find's rank, the PNG, and
  one compiled candidate's predicted vs compiled bytes, every (kind, axes) within 1%."""
  from tests.test_cli import _run
  r = _run("--plan", "--model=tiny", "--devices=8", "--plan_compile=1", "--plan_top=3",
           "--plan_find=ep@data:2,expert:4", f"--report_dir={tmp_path}")
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  m = FIRST_LINE.fullmatch(lines[0])
  assert m and int(m[1]) >= int(m[2]) > 0, lines[0]
  assert m["batch"] == "8" and m["source"] == "max of the preset's 8 and --devices=8", lines[0]
  assert lines[2].startswith("| # | layout") and len([l for l in lines if l.startswith("| ")]) == 4
  assert any(l.startswith("refused by check():") for l in lines)
  assert any(l.startswith("ep data:2,expert:4: ") for l in lines)
  assert any(l.startswith("wrote ") and l.endswith("plan.png") for l in lines)
  ratios = [float(l.rsplit("ratio ", 1)[1]) for l in lines if l.startswith("  ") and "ratio" in l]
  assert ratios and all(0.99 <= x <= 1.01 for x in ratios), ratios
  assert any(l.startswith("compiled ") for l in lines)
  assert lines[-1].startswith("verdict after compiling 1: "), lines[-1]


def test_plan_on_a_tpu_cluster_says_when_xla_cpu_compiles():
  """--plan --cluster=tpu-v5p predicts XLA:TPU's temp; on 2 devices (no v5p slice) XLA:CPU
  compiles the checked candidate, and the output says the ratios set two compilers side by
  side."""
  from tests.test_cli import _run
  r = _run("--plan", "--model=tiny", "--devices=2", "--cluster=tpu-v5p", "--plan_compile=1",
           "--plan_top=1")
  assert r.returncode == 0, r.stderr
  assert "temp as XLA:TPU holds it" in r.stdout, r.stdout
  assert "compiled by XLA:CPU; the temp model is fitted to XLA:TPU's" in r.stdout, r.stdout
  assert "note: the ratios below set XLA:CPU's temp against XLA:TPU's model" in r.stdout
  # ranking alone starts only the CPU backend: an installed CUDA plugin or libtpu is not probed
  r0 = _run("--plan", "--model=tiny", "--devices=8", "--plan_compile=0", "--plan_top=1")
  assert r0.returncode == 0 and "plugin configuration error" not in r0.stderr, r0.stderr


def test_plan_compile_passes_over_what_its_compiler_cannot_compile():
  """A TPU cluster's grid holds ep's ragged exchange, which XLA:CPU (compiling for 2 devices, no
  v5p slice) cannot compile: --plan_compile passes over such candidates with one line and
  compiles the next, or says it compiled none; never an error after the ranking."""
  from tests.test_cli import _run
  r = _run("--plan", "--model=tiny", "--devices=2", "--cluster=tpu-v5p", "--plan_compile=1",
           "--plan_top=1", "--strategy=ep", "--opt=exchange=ragged")
  assert r.returncode == 0, r.stderr
  assert re.search(r"^passed over (\d+) candidates XLA:CPU does not compile \(the first: ep "
                   r".*exchange=ragged needs ragged_all_to_all", r.stdout, re.M), r.stdout
  assert r.stdout.rstrip().endswith("compiled none: XLA:CPU compiles none of the 36 candidates")


def test_compiled_verdict_passes_over_what_compiles_over_hbm():
  """After the compiles, the verdict is the best-ranked candidate that fits by XLA's memory:
  one predicted to fit that compiles over HBM is named and passed over, and where none fits
  the verdict says so."""
  from planning import check, render
  a, b = (plan.Candidate(s, (("expert", 8),), 1, "block", 1.25) for s in ("ep", "fsdp"))
  a.param_opt, b.param_opt = 70 * 2**30, 50 * 2**30
  results = [check.Checked(a, 78 * 2**30, 8 * 2**30, {}, 1.0),
             check.Checked(b, 60 * 2**30, 10 * 2**30, {}, 1.0)]
  line = render.compiled_verdict(results, 74.5 * 2**30)
  assert line.startswith("verdict after compiling 2: fsdp expert:8"), line
  assert "ranked above it: ep expert:8" in line and "78.0G" in line, line
  none = render.compiled_verdict(results[:1], 74.5 * 2**30)
  assert none.startswith("verdict after compiling 1: none fits in 74.5G"), none


def test_full_scale_rows_name_admitted_candidates():
  """planning/full_scale.json, the full-scale rows of the temp model's fit: every row names a
  candidate the planner admits (its Mixtral rows enumerated again, as calibrate.py does), with
  the temp terms of the head's tables and the expert rows at the hidden width."""
  import json
  import os
  from planning import calibrate
  path = os.path.join(os.path.dirname(plan.__file__), "full_scale.json")
  with open(path) as f:
    saved = json.load(f)
  assert len(saved) >= 20 and all(check.parse(r["candidate"]) for r in saved)
  is_mixtral = lambda r: r["model"] == "mixtral-8x7b" and r["batch"] == 64
  mixtral = [r for r in saved if is_mixtral(r)]
  rows = calibrate.full_scale_rows(path, keep=is_mixtral)
  assert len(rows) == len(mixtral) >= 10
  for (features, temp, param_opt, label), r in zip(rows, mixtral):
    assert label.endswith(r["candidate"]) and temp == r["temp"] and param_opt > 0
    routed = "work_rows_f" in features and features["work_rows_f"] > 0
    assert routed and (features["gathered_head"] > 0) == ("fsdp:" in r["candidate"]), label


def test_temp_model_holds_the_batch_sweep():
  """planning/full_scale.json's batch sweep (a 2-layer Mixtral-8x7B on 8 devices at batch 16 to
  128: 8,192 to 131,072 tokens per device, XLA's temp bytes saved): the planner's memory is
  within 10% of every row's, and doubling the batch adds about twice what the previous doubling
  added, as XLA's temp does. A term in R x T (expert rows by tokens) grows as T^2: it
  over-predicted batch 128 by 2x."""
  import os
  from planning import calibrate
  path = os.path.join(os.path.dirname(plan.__file__), "full_scale.json")
  rows = calibrate.full_scale_rows(path, keep=lambda r: r["devices"] == 8)
  by_name = {}
  for features, temp, param_opt, label in rows:          # "MODEL N=8 B=16 n_layers=2 CANDIDATE"
    pred = plan.predict_temp(features)
    assert abs((pred + param_opt) / (temp + param_opt) - 1) <= MEMORY_RTOL, label
    by_name.setdefault(label.split()[-1], []).append((int(label.split()[2][2:]), pred))
  assert len(by_name) == 4 and len(rows) == 16, sorted(by_name)
  for name, points in by_name.items():
    assert [b for b, _ in points] == [16, 32, 64, 128], (name, points)
    steps = [b - a for (_, a), (_, b) in zip(points, points[1:])]
    assert all(1.5 < b / a < 2.5 for a, b in zip(steps, steps[1:])), (name, steps)


def test_cpu_temp_model_is_fitted_to_xla_cpu():
  """TEMP_COEFS["XLA:CPU"] is the fit of its saved compiles, refitted as `python -m
  planning.calibrate --cases=planning/cpu_cases.json --with=planning/full_scale.json` does
  (nothing compiled): the 33 calibration cases' XLA:CPU temps (`--save`) and the 39 larger
  candidates. A change to the temp features that is not refitted fails here. The held-out rows
  (not fitted: the first picks of gpt-oss-120b and Llama 4, whose stacks scan a period of layer
  kinds) are within MEMORY_RTOL of XLA:CPU's total."""
  import os
  from planning import calibrate
  here = os.path.dirname(plan.__file__)
  scale = os.path.join(here, "full_scale.json")
  rows = calibrate.case_rows(os.path.join(here, "cpu_cases.json"), "XLA:CPU")
  assert len(rows) == len(calibrate.CASES)
  rows += calibrate.full_scale_rows(scale, keep=lambda r: not r.get("held_out"))
  coef = calibrate.fit([(f, t) for f, t, _, _ in rows], calibrate.fixed("XLA:CPU"))
  assert coef == pytest.approx(plan.TEMP_COEFS["XLA:CPU"], abs=2e-3)
  held = calibrate.full_scale_rows(scale, keep=lambda r: r.get("held_out"))
  assert {label.split()[0] for *_, label in held} >= {"gpt-oss-120b", "llama4-scout"}
  for features, temp, param_opt, label in held:
    pred = plan.predict_temp(features)
    assert abs((pred + param_opt) / (temp + param_opt) - 1) <= MEMORY_RTOL, label


def test_tpu_temp_model_is_fitted_to_xla_tpu():
  """TEMP_COEFS["XLA:TPU"] is the fit of its saved compiles, refitted as `python -m
  planning.calibrate --target=tpu-v5p --cases=planning/tpu_v5p_cases.json
  --with=planning/tpu_v5p_scale.json` does: the calibration cases compiled by XLA:TPU for 8 v5p
  chips and Mixtral-8x7B candidates on 64. The held-out rows (not fitted: two of the planner's
  first picks on 64 v5p chips, ep_x_tp's zero1 and pp on one stage, and Llama 4 Scout's ep,
  whose stack scans a period of four layers) are within MEMORY_RTOL of XLA:TPU's total, and a
  TPU cluster's candidates carry the TPU's temp where a GPU's carry XLA:CPU's."""
  import os
  from planning import calibrate
  here = os.path.dirname(plan.__file__)
  scale = os.path.join(here, "tpu_v5p_scale.json")
  rows = calibrate.case_rows(os.path.join(here, "tpu_v5p_cases.json"), "XLA:TPU")
  rows += calibrate.full_scale_rows(scale, keep=lambda r: not r.get("held_out"),
                                    compiler="XLA:TPU")
  coef = calibrate.fit([(f, t) for f, t, _, _ in rows], calibrate.fixed("XLA:TPU"))
  assert coef == pytest.approx(plan.TEMP_COEFS["XLA:TPU"], abs=1e-3)
  held = calibrate.full_scale_rows(scale, keep=lambda r: r.get("held_out"), compiler="XLA:TPU")
  assert held
  for features, temp, param_opt, label in held:
    pred = plan.predict_temp(features, "XLA:TPU")
    assert abs((pred + param_opt) / (temp + param_opt) - 1) <= MEMORY_RTOL, label
  with pytest.raises(ValueError, match="compiled by XLA:TPU, not XLA:CPU"):
    calibrate.full_scale_rows(scale)
  cfg = get_config("tiny", dtype="bfloat16")
  temps = {}
  for name in ("tpu-v5p", "h100"):
    cluster = clusters.get(name)
    c = next(c for c in plan.enumerate_candidates(cfg, 8, cluster, cluster.hbm_bytes,
                                                  names=("ep",)) if not c.error)
    features = plan.candidate_features(c, cfg)
    assert c.temp == pytest.approx(plan.predict_temp(features, cluster.temp_model))
    temps[name] = c.temp
  assert temps["tpu-v5p"] != pytest.approx(temps["h100"])


def test_abstract_mesh_is_what_enumeration_uses():
  """check, param_specs and cost read axis sizes only: the same terms on an abstract mesh as on
  the devices' mesh."""
  import strategies
  cfg = get_config("tiny")
  strat = strategies.get("ep")
  shape = {"data": 2, "fsdp": 1, "expert": 4}
  a = cost.by_axes(strat.cost(cfg, mesh_lib.abstract_mesh(shape), strat.Options()))
  b = cost.by_axes(strat.cost(cfg, mesh_lib.make_mesh(shape), strat.Options()))
  assert a == b and a


def test_plan_find_shows_the_best_of_every_placement():
  """--plan_find's lines: the six best-ranked, the least memory, then the best of each
  placement (the axes inside a node) and remat policy not among them, so two layouts compare at
  one placement."""
  from planning import render
  cands = []
  for i in range(9):                            # ranked by index; the last two inside a node
    c = plan.Candidate("ep", (("data", 2), ("expert", 4)), 1, "block", 1.25,
                       inner=("expert",) if i >= 7 else ("data",), param_opt=2**30 * (9 - i % 3))
    c.compute_s = 1.0 + i
    cands.append(c)
  text = render.found(cands, cands, "ep", {"data": 2, "expert": 4})
  lines = text.splitlines()
  assert lines[0] == "ep data:2,expert:4: 9 candidates, 9 admitted"
  ranks = [l.removeprefix("  least memory: ").split(":")[0].strip() for l in lines[1:7]]
  assert ranks == [f"rank {i} of 9" for i in range(1, 7)], text
  assert lines[3].startswith("  least memory: rank 3 of 9"), text
  best = [l for l in lines if "best with" in l]
  assert len(best) == 1 and best[0].startswith("  best with node[expert], remat=block: rank 8"), text


# run.py --plan's constraint flags (planning/constraints.py) on Mixtral-8x7B on 64 devices, nothing
# compiled, every ranked candidate printed: all rows in one Python process through run.py's own
# entry point (`_run`: absl flags, the checks, the `error:` line, the exit status), as
# tests/test_cli.py's BAD_FLAGS, so jax and the suite are imported once.
PLAN = ["--plan", "--model=mixtral-8x7b", "--devices=64", "--cluster=h100", "--plan_compile=0",
        "--plan_top=100000"]
PRESET = "max of the preset's 64 and --devices=64"
CONSTRAINED = {
    "dropless": ["--capacity_factor=0"],                       # docs/planner.md's example
    "cf_off_grid": ["--capacity_factor=2", "--strategy=ep", "--batch=128"],
    "remat": ["--remat=none", "--strategy=ep_x_tp"],
    "microbatches": ["--microbatches=4", "--compare=tp,pp"],
    "mesh": ["--mesh=data:8,expert:8"],
    "opt_varied": ["--opt=kv_exchange=ring"],
    "opt_set": ["--opt=capacity=0.5", "--mesh=data:8,expert:8"],
    "strategy": ["--strategy=ep"],
    "compare_entry": ["--compare=cp:kv_exchange=ring,dp"],
    "layer_layout": ["--layer_layout=8,8,8,8", "--remat=block", "--capacity_factor=0"],
    # bad input: one line, exit 2, before anything is enumerated
    "bad_remat": ["--remat=dots_saveable"],
    "bad_mesh_axis": ["--strategy=ep", "--mesh=tensor:64"],
    "bad_mesh_size": ["--mesh=data:8,expert:4"],
    "bad_opt_key": ["--opt=foo=1"],
    "bad_opt_value": ["--opt=kv_exchange=ring2"],
    "bad_layer_layout": ["--strategy=ep", "--layer_layout=8,8,8,8"],
    # constraints that leave nothing: one line, exit 1
    "none_microbatches": ["--strategy=ep", "--microbatches=3"],
    "none_opt": ["--opt=virtual_stages=3"],
}
@pytest.fixture(scope="module")
def constrained():
  from tests.conftest import run_py_in_one_process
  return run_py_in_one_process({k: PLAN + v for k, v in CONSTRAINED.items()})


def _layouts(results, key: str, batch: int = 64, source: str = PRESET) -> list[str]:
  """The row's ranked layouts, every one printed, after checking its exit status and its first
  line (the ranking, the global batch and where it came from)."""
  code, out, err = results[key]
  assert code == 0, err
  lines = out.splitlines()
  m = FIRST_LINE.fullmatch(lines[0])
  assert m and m["batch"] == str(batch) and m["seq"] == "4096" and m["source"] == source, lines[0]
  rows = [m[1] for m in map(re.compile(r"\| *\d+ +\| (.+?) +\|").match, lines) if m]
  assert rows and len(rows) == int(m[1]), (len(rows), lines[0])
  fixed = [f for f in CONSTRAINED[key] if not f.startswith("--batch=")]   # not a constraint
  assert all(f in lines[1].split("held fixed: ")[1] for f in fixed), lines[1]
  return rows


def _error(results, key: str, status: int) -> str:
  """The row's one `error:` line, after checking its status and that it printed no table."""
  code, out, err = results[key]
  errors = [l for l in err.splitlines() if l.startswith("error: ")]
  assert code == status and not out and len(errors) == 1, (code, out, err)
  assert err.strip().splitlines()[-1] == errors[0], err
  return errors[0]


def test_plan_capacity_factor_constraint(constrained):
  """--capacity_factor: only that value, the grid's (0, dropless) or not
  (2.0); --batch is named as the batch's source."""
  rows = _layouts(constrained, "dropless")
  assert len(rows) > 1000 and all(re.search(r" cf=0 node\[", r) for r in rows), rows[:3]
  assert len({r.split()[0] for r in rows}) >= 8
  rows = _layouts(constrained, "cf_off_grid", batch=128, source="--batch")
  assert all(r.startswith("ep ") and re.search(r" cf=2 node\[", r) for r in rows), rows[:3]


def test_plan_remat_constraint(constrained):
  """--remat: only that policy; one the planner cannot price is a one-line error (exit 2)."""
  rows = _layouts(constrained, "remat")
  assert all(r.startswith("ep_x_tp ") and " remat=none " in r for r in rows), rows[:3]
  assert "--remat=dots_saveable: the planner prices remat none | block only" in _error(
      constrained, "bad_remat", 2)


def test_plan_microbatches_constraint(constrained):
  """--microbatches: only that M (pp's pipeline M, elsewhere gradient accumulation's); one that
  no batch shard takes leaves nothing: one line naming the constraints, exit 1."""
  rows = _layouts(constrained, "microbatches")
  assert {r.split()[0] for r in rows} == {"tp", "pp"}, rows[:3]
  assert all(re.search(r" M=4 ", r) for r in rows), rows[:3]
  line = _error(constrained, "none_microbatches", 1)
  assert line.startswith("error: no candidate left by --strategy=ep --microbatches=3: "), line
  assert "batch=64 is not divisible by microbatches=3" in line, line


def test_plan_mesh_constraint(constrained):
  """--mesh: only that mesh, for each strategy whose axes it names; an axis the strategy lacks,
  or sizes that do not multiply to --devices, are one-line errors (exit 2)."""
  rows = _layouts(constrained, "mesh")
  assert all(r.split()[1] == "data:8,expert:8" for r in rows), rows[:3]
  names = {r.split()[0] for r in rows}
  assert len(names) > 1 and all({"data", "expert"} <= set(strategies.get(n).AXES)
                                for n in names), names
  assert "mesh axis 'tensor' is not used by strategy 'ep'" in _error(constrained,
                                                                     "bad_mesh_axis", 2)
  assert "--mesh=data:8,expert:4 has 32 devices, not --devices=64" in _error(
      constrained, "bad_mesh_size", 2)


def test_plan_opt_constraint(constrained):
  """--opt=key=value: only the strategies with that option, at that value: a field the planner
  varies is filtered on (kv_exchange), any other is set (ep_tp's capacity, shown in the row); a
  key no strategy has, or a bad value, is a one-line error (exit 2); a value the planner never
  enumerates leaves nothing (exit 1)."""
  rows = _layouts(constrained, "opt_varied")
  assert {r.split()[0] for r in rows} == {"cp", "ep_as_cp"}, rows[:3]
  assert all(" kv_exchange=ring " in r for r in rows), rows[:3]
  rows = _layouts(constrained, "opt_set")
  assert all(r.startswith("ep_tp data:8,expert:8 capacity=0.5 ") for r in rows), rows[:3]
  assert "--opt key 'foo' is an option of none of the planned strategies" in _error(
      constrained, "bad_opt_key", 2)
  assert "kv_exchange='ring2': choose from allgather, ring" in _error(constrained,
                                                                      "bad_opt_value", 2)
  line = _error(constrained, "none_opt", 1)
  assert line.startswith("error: no candidate left by --opt=virtual_stages=3: "), line


def test_plan_strategy_constraint(constrained):
  """--strategy (once an error with --plan) and --compare: only those strategies; a --compare
  entry's own options restrict that strategy's candidates."""
  rows = _layouts(constrained, "strategy")
  assert all(r.startswith("ep ") for r in rows), rows[:3]
  rows = _layouts(constrained, "compare_entry")
  assert {r.split()[0] for r in rows} == {"cp", "dp"}, rows[:3]
  assert all(" kv_exchange=ring " in r for r in rows if r.startswith("cp ")), rows[:3]


def test_plan_layer_layout_constraint(constrained):
  """--layer_layout: pp only, its stack in that layout: 4 groups on 4 stages, or 2 stages of 2
  chunks (interleaved); with strategies that do not take it, a one-line error (exit 2)."""
  rows = _layouts(constrained, "layer_layout")
  assert all(r.startswith("pp ") and " layers=8x4 " in r for r in rows), rows[:3]
  assert {r.split()[1].split(",")[0] for r in rows} == {"stage:4", "stage:2"}, rows[:3]
  assert all(" virtual_stages=2 " in r for r in rows if r.startswith("pp stage:2,")), rows[:3]
  assert "--layer_layout=8,8,8,8 is pp's" in _error(constrained, "bad_layer_layout", 2)


def test_plan_nothing_left_in_its_own_process():
  """One row as a user runs it, its own `python run.py` process: constraints that leave no
  candidate print one `error:` line that names them, and exit 1."""
  from tests.test_cli import _run
  r = _run(*PLAN, "--strategy=ep", "--microbatches=3")
  assert r.returncode == 1 and not r.stdout, (r.returncode, r.stdout, r.stderr)
  assert r.stderr.strip().splitlines()[-1].startswith(
      "error: no candidate left by --strategy=ep --microbatches=3: "), r.stderr


def test_ragged_exchange_is_planned_where_the_cluster_compiles_it():
  """ep's exchange=ragged: in a TPU cluster's grid (ep's PLAN_PLATFORM_EXTRA), on a GPU cluster
  where asked (--opt=exchange=ragged); admitted on a GPU or TPU cluster (the
  planner's abstract meshes stand for its devices), refused on a CPU; its memory is
  the padded exchange's (the receive buffer [EP*C, D] is the worst case either way) and its
  time prices the routed rows it moves, not that buffer: dropless on EP 8, the padded exchange
  sends up to EP x min(K, e) / K more than ragged's."""
  from strategies import ep
  cfg = get_config("tiny", dtype="bfloat16")
  on_cpu = mesh_lib.abstract_mesh({"data": 1, "fsdp": 1, "expert": 8}, "cpu")
  assert mesh_lib.platform(mesh_lib.abstract_mesh({"expert": 8}, "tpu")) == "tpu"
  with pytest.raises(ConfigError, match="exchange=ragged needs ragged_all_to_all"):
    ep.check(cfg, on_cpu, ep.Options(exchange="ragged"))
  grid = lambda cluster: {c.opts.exchange for c in plan.enumerate_candidates(
      cfg, 8, cluster, 80e9, names=("ep",), remats=("block",), only_mesh={"expert": 8},
      latency=False) if not c.error}
  assert grid(clusters.get("tpu-v5p")) == {"a2a", "ragged"} and grid(H100) == {"a2a"}
  by = {}
  for ex in ("a2a", "ragged"):
    for c in plan.enumerate_candidates(cfg, 8, H100, 80e9, names=("ep",), remats=("block",),
                                       options={"ep": [ep.Options(exchange=ex)]},
                                       only_mesh={"expert": 8}, latency=False):
      assert not c.error, c.error
      by[ex, c.capacity_factor] = c
  for cf in (0.0, 1.25):                # a2a's rows read from bytes that carry its counts too
    assert by["ragged", cf].memory == pytest.approx(by["a2a", cf].memory, rel=1e-3)
    assert by["ragged", cf].step_s < by["a2a", cf].step_s
  mesh = mesh_lib.abstract_mesh({"data": 1, "fsdp": 1, "expert": 8}, "gpu")
  terms = {ex: [t for t in cost.step_terms(ep, cfg.replace(remat="block"), mesh,
                                           ep.Options(exchange=ex))
                if t.kind.endswith("all-to-all")] for ex in ("a2a", "ragged")}
  sent = {ex: sum(t.sent_bytes for t in ts) for ex, ts in terms.items()}
  buffers = {ex: sum(t.wire_bytes for t in ts) for ex, ts in terms.items()}
  assert buffers["ragged"] > sent["ragged"] > 0                # the worst case, the routed rows
  # a2a's buffers [EP, C] at C = T min(K, e): EP min(K, e) / K = 4x the routed rows (beside
  # both exchanges' int32 counts and sizes)
  assert sent["a2a"] == pytest.approx(4 * sent["ragged"], rel=1e-2)
