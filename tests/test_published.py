"""planning/published.py: the published MoE runs as data, each posed as the suite's layout and
predicted by the planner, and the summary line's contract."""
import dataclasses
import math
import re
import statistics

import pytest

from modeling.config import PRESETS
from planning import clusters, plan, published


@pytest.fixture(scope="module")
def preds():
  return [published.predict(r) for r in published.ROWS]


def test_spearman():
  assert published.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert published.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  # ties take their mean rank: ranks (0.5, 0.5, 2) against (0, 1, 2)
  assert published.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)


def test_rows_are_posed_or_say_why(preds):
  """Every row names a preset and a cluster profile; it is posed (a candidate the planner
  admits, its prediction in the row's measure) or says in one line what it waits for."""
  assert len(preds) >= 14
  for p in preds:
    r = p.row
    assert r.model in PRESETS and r.cluster in clusters.PROFILES, r.row
    assert math.prod(r.mesh.values()) == r.devices, r.row
    if p.error:
      assert "\n" not in p.error and p.predicted == 0.0, r.row
      continue
    c = p.candidate
    assert not c.error and dict(c.sizes) == {a: r.mesh.get(a, 1) for a, _ in c.sizes}, r.row
    expect = {"step_s": c.step_s, "tokens_per_s": c.tokens_per_s,
              "tflops": c.tokens_per_s * p.flops_per_token / 1e12}[r.measure]
    assert p.predicted == pytest.approx(expect) and p.predicted > 0, r.row


def test_flops_per_token_match_the_publishers(preds):
  """The suite's model FLOPs per token within 5% of what each publisher's TFLOP/s over
  tokens/s implies (DeepSeek-V3 and Qwen3-235B-A22B at 4K), so a TFLOP/s row compares the same
  work."""
  seen = set()
  for p in preds:
    implied = published.IMPLIED_FLOPS_PER_TOKEN.get((p.row.model, p.row.seq))
    if implied and not p.error:
      assert abs(p.flops_per_token / implied - 1) < 0.05, (p.row.row, p.flops_per_token)
      seen.add(p.row.model)
  assert seen == {"deepseek-v3", "qwen3-235b-a22b"}


def test_summary_line(preds):
  line = published.summary(preds)
  assert re.fullmatch(r"published: \d+ rows, median error \d+\.\d{3}, worst error \d+\.\d{3}, "
                      r"Spearman (nan|-?\d\.\d\d)", line), line
  n = int(line.split()[1])
  assert n == sum(not p.error for p in preds)
  errors = sorted(abs(p.ratio - 1) for p in preds if not p.error)
  assert f"worst error {errors[-1]:.3f}" in line


def test_prediction_is_the_planners():
  """A row's prediction is the planner's own ranking of that layout: the same candidate
  `enumerate_candidates` gives under the row's constraints and overlap, at its fastest
  placement."""
  row = next(r for r in published.ROWS if r.row == "5")
  p = published.predict(row)
  from modeling.config import get_config
  cfg = get_config(row.model, dtype="bfloat16").replace(batch=row.batch, seq_len=row.seq)
  cluster = clusters.get(row.cluster)
  cands = [c for c in plan.enumerate_candidates(cfg, row.devices, cluster, cluster.hbm_bytes,
                                                 names=("fsdp",), remats=(row.remat,),
                                                 overlap=row.overlap, gmm=row.gmm, ici=row.ici)
           if not c.error and dict(c.sizes) == {"data": 1, "fsdp": 256}
           and c.capacity_factor == row.capacity_factor and c.microbatches == 1]
  assert p.candidate.step_s == pytest.approx(min(c.step_s for c in cands))


@pytest.mark.parametrize("overlap,one_f,exposed", [
    ("none", True, 1 + 2 + 4 + 8),      # every collective serial
    ("weights", True, 2 + 8),           # the gather and the permute under compute
    ("schedule", False, 2 + 8),         # gpipe pairs no microbatches: its all-to-all stays
    ("schedule", True, 8),              # 1f1b: the all-to-all too
])
def test_overlap_hides_each_class_up_to_the_compute(overlap, one_f, exposed):
  """planning.plan.timing: the loads --plan_overlap hides run under compute, up to its length
  (past it they are exposed again); the rest is added to it. Loads on NVLink (1 s of bytes
  each at 450 GB/s, x the factor in the parametrization)."""
  from strategies import pp
  opts = pp.Options(schedule="1f1b" if one_f else "gpipe")
  from modeling.config import get_config
  cfg = get_config("tiny")
  bw = clusters.get("h100").intra_bw
  loads = (("all-gather over expert", ("expert",), 1 * bw, "weights"),
           ("all-to-all over expert", ("expert",), 2 * bw, "paired"),
           ("collective-permute over expert", ("expert",), 4 * bw, "weights"),
           ("all-reduce over expert", ("expert",), 8 * bw, ""))
  c = plan.Candidate("pp", (("stage", 1), ("expert", 8)), 1, "none", 1.0, opts,
                     inner=("expert",))
  plan.timing(c, cfg, loads, clusters.get("h100"), plan.EFFICIENCY, overlap)
  assert c.serial_comm_s == pytest.approx(15.0)
  hid = 15.0 - exposed
  assert c.comm_s == pytest.approx(exposed + max(0.0, hid - c.compute_s))
  assert c.step_s == pytest.approx(c.compute_s + c.comm_s)


def test_latency_is_the_least_protocols_fixed_time():
  """planning.plan.latency_s, NCCL's model (clusters.NCCL): a small all-reduce over two nodes
  of 8 takes the tree with LL, 6.8 + 2 (7 x 0.6 + log2(2) x 5.0) = 25.2 us; a call of 1 ms of
  bytes the ring with Simple (LL's quarter bandwidth would add 3 ms), 8.4 + 2 (14 x 3.4 +
  1 x 14) = 131.6 us. Inside a node, an all-gather's 7 LL steps; an all-to-all across nodes
  one network step (LL). On a v5p slice, 64 chips span 3 torus dimensions of 4: an all-gather
  runs 3 x 3 hops, a send the torus' diameter, 6 hops, 1 us each."""
  h100, v5p, us = clusters.get("h100"), clusters.get("tpu-v5p"), 1e-6
  assert plan.latency_s("all-reduce over data", 16, 8, h100) == pytest.approx(25.2 * us)
  assert plan.latency_s("all-reduce over data", 16, 8, h100, per_call=1e-3) == pytest.approx(
      131.6 * us)
  assert plan.latency_s("all-gather over fsdp", 8, 8, h100) == pytest.approx(10.8 * us)
  assert plan.latency_s("all-to-all over expert", 64, 8, h100) == pytest.approx(9.3 * us)
  assert plan.latency_s("all-gather over fsdp", 64, 64, v5p) == pytest.approx(9 * us)
  assert plan.latency_s("collective-permute over stage", 64, 64, v5p) == pytest.approx(6 * us)


def test_each_collective_adds_its_latency_to_the_step():
  """timing: a load issued n times adds n x latency_s to its time, hidden or exposed as its
  bytes are (an exposed all-reduce of no bytes, 1,000 calls inside a node of 8: 1,000 x the
  ring LL's 6.6 + 2 x 7 x 0.6 us)."""
  from modeling.config import get_config
  cfg = get_config("tiny")
  c = plan.Candidate("tp", (("data", 1), ("tensor", 8)), 1, "none", 1.0, None,
                     inner=("tensor",))
  plan.timing(c, cfg, (("all-reduce over tensor", ("tensor",), 0.0, "", 1000.0),),
              clusters.get("h100"), plan.EFFICIENCY)
  assert c.latency_s == c.comm_s == pytest.approx(1000 * (6.6 + 14 * 0.6) * 1e-6)


def test_overlap_classes_of_real_terms():
  """Weight gathers and gradient reductions (a term with a parameter group), the optimizer's,
  and point-to-point sends are "weights"; all-to-alls "paired"; tensor parallelism's
  reductions of activations are on the critical path."""
  from measure import cost
  term = lambda kind, phase="fwd", params="": cost.Term(kind, phase, "x", 1.0, ("a",), 2,
                                                       params=params)
  assert plan.overlap_class(term("all-gather", params="layers")) == "weights"
  assert plan.overlap_class(term("all-reduce", "bwd", params="layers")) == "weights"
  assert plan.overlap_class(term("all-gather", "opt")) == "weights"
  assert plan.overlap_class(term("collective-permute")) == "weights"
  assert plan.overlap_class(term("all-to-all")) == "paired"
  assert plan.overlap_class(term("ragged-all-to-all")) == "paired"
  assert plan.overlap_class(term("all-reduce")) == ""


def test_fp8_rows_price_the_matmuls_at_the_fp8_peak(preds):
  """An FP8 row's compute is bf16's with the matmuls' share at the cluster's FP8 peak: H800's
  1,978.9 TFLOP/s against 989.4, the attention core at bf16's."""
  row = dataclasses.replace(next(r for r in published.ROWS if r.row == "8"), gmm="flat")
  p, bf16 = published.predict(row), published.predict(dataclasses.replace(row, dtype="bf16"))
  from modeling.config import get_config
  cfg = get_config("deepseek-v3").replace(seq_len=p.row.seq)
  a = plan.attention_share(cfg)
  assert 0 < a < 0.2
  assert p.candidate.compute_s == pytest.approx(
      bf16.candidate.compute_s * (a + (1 - a) * 989.4 / 1978.9), rel=1e-9)


def test_the_publishers_orders_and_errors(preds):
  """What the time model gets right, held: the all-to-all overlap makes Qwen3-235B's 2a
  faster than the same layout without it (2c), as measured (17.6 s, 19.7 s); DeepSeek-V3's
  layout on 2,048 H800 within 25% of its ~1,540 tokens/s/GPU (the issue's target); and the
  summary no worse than docs/planner.md prints (median error 0.084, worst 0.413, Spearman
  0.97), and so the issue's targets: median at most 0.25, no row off by 2x, Spearman at least
  0.9 over the five Qwen3-235B layouts."""
  by = {p.row.row: p for p in preds}
  assert by["2a"].predicted < by["2c"].predicted
  assert abs(by["8"].ratio - 1) <= 0.25, by["8"].ratio
  errors = sorted(abs(p.ratio - 1) for p in preds if not p.error)
  assert statistics.median(errors) <= 0.085 and errors[-1] <= 0.414, errors
  assert float(published.summary(preds).split("Spearman ")[1]) >= 0.97


def test_hierarchical_all_to_all():
  """planning.plan.a2a_seconds: flat sends every copy to another node over InfiniBand;
  hierarchical (the group filling whole nodes) one copy per distinct destination node, NVLink
  carrying the node's own copies and the fan-out, the slower link setting the time. A group
  inside one node is not an inter-node exchange: the same either way."""
  h100 = clusters.get("h100")
  wire, group, k = 31e9, 32, 8                       # 1 GB to each of 31 others, 4 nodes
  flat = plan.a2a_seconds(wire, group, k, h100, "flat")
  assert flat == pytest.approx(wire / h100.inter_bw)
  # 24 GB to other nodes; a token's 6 remote copies (8 x 3/4) reach 3 x (1 - (3/4)^8) distinct
  # nodes: IB carries 24 GB x 2.7 / 6, NVLink 7 GB + the 24 GB it fans out
  distinct = 3 * (1 - 0.75 ** 8)
  ib = 24e9 * distinct / 6 / h100.inter_bw
  assert ib > 31e9 / h100.intra_bw
  assert plan.a2a_seconds(wire, group, k, h100, "hierarchical") == pytest.approx(ib)
  assert plan.a2a_seconds(7e9, 8, k, h100, "hierarchical") == pytest.approx(7e9 / h100.inter_bw)
  # top-1 routing: one copy, one node: nothing to merge
  assert plan.a2a_seconds(wire, group, 1, h100, "hierarchical") == pytest.approx(
      max(24e9 / h100.inter_bw, 31e9 / h100.intra_bw))


def test_grouped_matmul_rows_per_expert(preds):
  """--plan_gmm=rows: the routed experts' share of the compute runs at r / (r + GMM_HALF_ROWS)
  of the dense matmuls' efficiency, r the rows per local expert of one layer's call; the rest
  as under flat. Qwen3-235B's 128 experts, folded over (expert, tensor), each tensor rank
  routing S / t of a sequence's positions: 2a and 2c hold 4 a device (EP 32), each rank routes
  2,048 x 8 copies per microbatch, 4,096 rows per expert; 2d holds 16 (EP 8), 1,024; 2e 16 and
  TP 4, 512; 2b 16 and MBS 4, 4,096. The fold rows' capacity factor 1 / (t c) sizes the padded
  exchange at those routed rows."""
  by = {p.row.row: p for p in preds}
  rows = {k: by[k].candidate.expert_rows for k in published.RANKED}
  # (the dispatch's bytes carry its [EP, e] int32 counts beside the rows)
  assert rows == pytest.approx({"2a": 4096, "2b": 4096, "2c": 4096, "2d": 1024, "2e": 512},
                               rel=1e-5)
  assert plan.gmm_efficiency(plan.GMM_HALF_ROWS, "rows") == pytest.approx(0.5)
  assert plan.gmm_efficiency(1e9, "rows") == pytest.approx(1.0, abs=1e-5)
  assert plan.gmm_efficiency(100.0, "flat") == 1.0
  from modeling.config import get_config
  for k in ("2a", "2d"):
    row = next(r for r in published.ROWS if r.row == k)
    flat = published.predict(dataclasses.replace(row, gmm="flat")).candidate
    cfg = get_config(row.model).replace(seq_len=row.seq, **dict(row.config))
    r = plan.routed_share(cfg)
    assert 0.4 < r < 0.8, r
    g = rows[k] / (rows[k] + plan.GMM_HALF_ROWS)
    assert by[k].candidate.compute_s == pytest.approx(flat.compute_s * (1 - r + r / g), rel=1e-9)


def test_rows_per_expert_are_the_routed_rows_whatever_the_capacity_factor():
  """The planner prices a grouped matmul by the rows balanced routing gives each local expert,
  not by the candidate's padded buffer: ep on Mixtral-8x7B's 8 experts, one a device (EP 8),
  a 4,096-token sequence a device: the group's 8 sequences route 2 copies a token over the 8
  experts, 8,192 rows each, at capacity factor 0 (padded to the worst case), 1 and 1.25
  alike."""
  from modeling.config import get_config
  cfg = get_config("mixtral-8x7b", dtype="bfloat16").replace(batch=8)
  h100 = clusters.get("h100")
  cands = [c for c in plan.enumerate_candidates(cfg, 8, h100, h100.hbm_bytes, names=("ep",),
                                                 remats=("block",),
                                                 capacity_factors=(0.0, 1.0, 1.25))
           if not c.error and dict(c.sizes)["expert"] == 8]
  assert {c.capacity_factor for c in cands} == {0.0, 1.0, 1.25}
  assert [c.expert_rows for c in cands] == pytest.approx([8192.0] * len(cands), rel=1e-5)
  # pp's microbatches split the batch: a call's rows are 1/M of the step's, at every factor
  pp = [c for c in plan.enumerate_candidates(cfg.replace(batch=16), 8, h100, h100.hbm_bytes,
                                               names=("pp",), remats=("block",),
                                               capacity_factors=(0.0, 1.25),
                                               only_mesh={"stage": 2, "expert": 4})
        if not c.error]
  assert {c.microbatches for c in pp} >= {1, 2, 4} and {c.capacity_factor for c in pp} == {
      0.0, 1.25}
  # 16 sequences over data 1: each of the 8 experts gets 16 x 4,096 x 2 / 8 rows a step
  assert [c.expert_rows * c.microbatches for c in pp] == pytest.approx([16384.0] * len(pp),
                                                                       rel=1e-5)
  # a sequence split over the exchange's axis pads each device's buffer to the whole
  # sequence's slots, not its rows: ep_as_cp (S over expert) and ep_x_tp's sequence
  # parallelism (S over tensor, its rows gathered back) run 8,192 rows an expert, as ep does
  split = {"ep_as_cp": {"fsdp": 8, "expert": 8},
           "ep_x_tp": {"data": 8, "expert": 4, "tensor": 2}}
  for name, mesh in split.items():
    got = [c for c in plan.enumerate_candidates(cfg.replace(batch=64), 64, h100, h100.hbm_bytes,
                                                names=(name,), remats=("block",),
                                                only_mesh=mesh)
           if not c.error and c.microbatches == 1]
    assert got and [c.expert_rows for c in got] == pytest.approx([8192.0] * len(got)), name


def test_gmm_half_rows_is_the_fit(preds):
  """planning.plan.GMM_HALF_ROWS is the fit's minimum (`python -m planning.published
  --fit_gmm`: least mean |log(predicted / measured)| over the posed rows) against its grid
  neighbours, so a change to another term that moves the fit fails here until it is refitted."""
  i = published.GMM_GRID.index(plan.GMM_HALF_ROWS)
  grid = published.GMM_GRID[i - 1:i + 2]
  value, loo, lines = published.fit_gmm(published.ROWS, grid)
  assert value == plan.GMM_HALF_ROWS and len(lines) == 3
  assert set(loo) == {p.row.row for p in preds if not p.error}


def test_routed_cf_sizes_the_exchange_at_the_routed_rows():
  """A pp experts=fold row's padded exchange carries the rows it routes: each device of 2a
  (one sequence per microbatch, S / t = 2,048 positions, top-8) sends 16,384 rows of D per
  layer call, where the capacity rule at factor 1 bounds a shard's copies by the whole
  sequence's slots (32,768). (The dispatch's bytes carry its [EP, e] int32 counts too.)"""
  from measure import cost
  from modeling.config import get_config
  from layout import mesh as mesh_lib
  from strategies import pp
  row = next(r for r in published.ROWS if r.row == "2a")
  assert row.capacity_factor == published.routed_cf(row.mesh, row.options) == 0.5
  assert published.routed_cf({"tensor": 4, "context": 2}, {"experts": "fold"}) == 0.125
  assert published.routed_cf({"tensor": 4}, {}) == 1.0
  cfg = get_config(row.model, dtype="bfloat16").replace(
      seq_len=row.seq, batch=row.batch, microbatches=row.microbatches, **dict(row.config))
  shape = {a: row.mesh.get(a, 1) for a in pp.AXES}
  mesh, opts = mesh_lib.abstract_mesh(shape), pp.Options(**row.options)
  # as the planner stores it: 94 layers on 8 stages as 3 x 30 + 2 x 2, stored for 4 chunks
  import strategies
  cfg = strategies.stored_config(pp, cfg.replace(layer_layout=plan._layer_layout("pp", cfg, shape)),
                                 mesh, opts)
  for cf, rows in ((row.capacity_factor, 16384), (1.0, 32768)):
    c = cfg.replace(capacity_factor=cf)
    lay = pp.layout(c, mesh, opts)
    terms = pp.cost(cost.microbatch(c, lay), mesh, opts)
    dispatch = sum(x.bytes for x in terms if x.kind == "all-to-all" and x.phase == "fwd"
                   and x.what.startswith("dispatch"))
    calls = c.n_layer_slots * plan._runs("pp", c, dict(mesh.shape), opts)
    assert dispatch / calls / (c.d_model * 2) == pytest.approx(rows, rel=1e-5), cf


def test_ici_dims():
  """planning.plan.ici_dims: a group inside a TPU slice laid out as compactly as slices are,
  rings of 4 chips a dimension (4 chips one dimension, 16 two, 64 three), capped at the torus'
  dimensions; tpu-v7's two devices a chip; one dimension under --plan_ici=dimension and off a
  torus."""
  v5p, v6e, v7, h100 = (clusters.get(n) for n in ("tpu-v5p", "tpu-v6e", "tpu-v7", "h100"))
  dims = {g: plan.ici_dims(g, v5p, "torus") for g in (1, 2, 4, 8, 16, 32, 64, 2048)}
  assert dims == {1: 1, 2: 1, 4: 1, 8: 2, 16: 2, 32: 3, 64: 3, 2048: 3}
  assert plan.ici_dims(256, v6e, "torus") == 2
  assert plan.ici_dims(256, v7, "torus") == 3 and plan.ici_dims(8, v7, "torus") == 1
  assert plan.ici_dims(256, v7, "dimension") == 1 and plan.ici_dims(256, h100, "torus") == 1


def test_torus_prices_a_slice_group_on_its_dimensions():
  """timing: a load inside a TPU slice runs at the profile's one-dimension bandwidth times the
  dimensions its group spans (--plan_ici=torus); row 6's FSDP over 256 v7 devices (128 chips,
  three dimensions) moves its bytes in a third of the time (its latency aside)."""
  from modeling.config import get_config
  cfg, v7 = get_config("tiny"), clusters.get("tpu-v7")
  loads = (("all-reduce over fsdp", ("fsdp",), 3 * v7.intra_bw, ""),)
  t = {}
  for ici in plan.ICIS:
    c = plan.Candidate("fsdp", (("data", 1), ("fsdp", 256)), 1, "none", 1.0, inner=("fsdp",))
    plan.timing(c, cfg, loads, v7, plan.EFFICIENCY, ici=ici)
    t[ici] = c.serial_comm_s
  assert t == pytest.approx({"dimension": 3.0, "torus": 1.0})
  row = next(r for r in published.ROWS if r.row == "6")
  flat = published.predict(dataclasses.replace(row, ici="dimension")).candidate
  torus = published.predict(row).candidate
  assert torus.serial_comm_s - torus.latency_s == pytest.approx(
      (flat.serial_comm_s - flat.latency_s) / 3)


def test_the_planners_header_states_its_error():
  """The error `run.py --plan`'s header states at its default terms is what
  `python -m planning.published --overlap=weights` prints: every row at the planner's default
  overlap, gmm and ici, each at its own all-to-all and dtype."""
  from planning import cli
  assert (plan.OVERLAP, plan.GMM, plan.ICI) == ("weights", "rows", "torus")
  rows = [dataclasses.replace(r, overlap=plan.OVERLAP) for r in published.ROWS]
  line = published.summary([published.predict(r) for r in rows])
  n, median, worst = re.search(r"published: (\d+) rows, median error ([\d.]+), worst error "
                               r"([\d.]+)", line).groups()
  assert f"held to {n} published runs" in cli.HELD, (cli.HELD, line)
  assert f"median error {median}, worst {worst}" in cli.HELD, (cli.HELD, line)


def test_run_py_flag_defaults_are_the_planners():
  """run.py's --plan_* defaults are planning.plan's constants (written twice, as run.py keeps
  planning out of its start-up): the header states the held error only at cli.DEFAULTS, so a
  default flipped in one place alone would print a plan the error does not describe."""
  import run
  from planning import cli
  cli_defaults = tuple(run.F[name].default for name in
                       ("plan_overlap", "plan_a2a", "plan_gmm", "plan_ici", "plan_efficiency",
                        "plan_imbalance"))
  assert cli_defaults == cli.DEFAULTS


def test_the_dominant_collective_is_the_one_the_step_waits_for():
  """The dominant collective is the one that adds the most to the step, not the largest by its
  own time: row 2b's gradient all-reduce over data (4.40 s) runs under the compute, its
  all-to-all (2.36 s) does not. Where overlap hides every collective (row 5's FSDP), the largest
  is named and marked hidden (its weights' all-gathers, forward and remat's, carry the bytes of
  their gradients' reduce-scatter, and XLA:TPU issues twice as many of them: 0.48 s against
  0.47); at --plan_overlap=none the largest is the one the step waits for."""
  def cand(row, **change):
    return published.predict(dataclasses.replace(
        next(r for r in published.ROWS if r.row == row), **change)).candidate
  c = cand("2b")
  assert (c.dominant, c.dominant_hidden) == ("all-to-all over expert,tensor", False)
  serial = cand("2b", overlap="none")
  assert (serial.dominant, serial.dominant_hidden) == ("all-reduce over data", False)
  assert serial.dominant_s > c.dominant_s
  fsdp = cand("5")
  assert (fsdp.dominant, fsdp.dominant_hidden) == ("all-gather over fsdp", True)
  assert fsdp.comm_s < plan.DOMINANT_EXPOSED * fsdp.step_s


def test_routing_imbalance_prices_the_busiest_devices_routed_work():
  """--imbalance / --plan_imbalance: the routed experts' matmuls at 1 + X of balanced routing's
  on rows whose routing is real, capped at a real capacity factor; forced-balanced rows (NVIDIA's
  tables) unchanged. Only the routed share moves: the step's other compute stays."""
  assert plan.routed_load(0.1, 0.0) == pytest.approx(1.1)          # dropless: no cap
  assert plan.routed_load(0.5, 1.25) == 1.25                        # a capacity drops the rest
  assert plan.routed_load(0.1, 1.25) == pytest.approx(1.1)
  assert plan.routed_load(0.5, 1.0, capped=False) == 1.5            # a dropless run's sizing

  def compute(row, x):
    r = next(r for r in published.ROWS if r.row == row)
    return published.predict(dataclasses.replace(r, imbalance=x)).candidate.compute_s
  assert compute("2a", 0.2) == compute("2a", 0.0)                   # forced-balanced
  base, more, most = compute("3a", 0.0), compute("3a", 0.1), compute("3a", 0.2)
  assert base < more < most and most - more == pytest.approx(more - base)   # linear in X
  assert compute("5", 0.5) == pytest.approx(compute("5", 0.25))     # capped at capacity 1.25
  assert compute("5", 0.1) > compute("5", 0.0)
  assert compute("4", 0.1) > compute("4", 0.0)                      # cf 1 sizes, not caps


def test_plan_imbalance_moves_the_planners_step_and_leaves_its_bytes():
  """The planner at --plan_imbalance: a dropless candidate's compute grows by the routed share x
  X, its collectives do not."""
  from modeling.config import get_config
  from planning import clusters
  cfg = get_config("mixtral-8x7b", dtype="bfloat16").replace(batch=64).validate()
  h100 = clusters.get("h100")
  pick = lambda x: next(c for c in plan.enumerate_candidates(
      cfg, 64, h100, h100.hbm_bytes, names=("ep",), remats=("block",), capacity_factors=(0.0,),
      only_mesh={"data": 1, "fsdp": 8, "expert": 8}, imbalance=x) if not c.error)
  flat, skewed = pick(0.0), pick(0.2)
  assert skewed.serial_comm_s == flat.serial_comm_s
  assert skewed.compute_s > flat.compute_s


@pytest.mark.parametrize("over,kind", [({}, "full"), ({"sliding_window": 128}, "sliding"),
                                       ({"local_chunk": 1024}, "local"),
                                       ({"sliding_window": 8192}, "sliding")])
def test_attention_flops_count_the_keys_each_layer_sees(over, kind):
  """The planner's attention core counts a query's keys under its layer's mask (the diagonal
  half, as causal's S/2): modeling.attention's first_key over every position of 4,096, for
  gpt-oss's window, Llama 4's local chunk, and a window no shorter than S (causal)."""
  import numpy as np
  from modeling import attention
  from modeling.config import get_config
  cfg = get_config("tiny").replace(seq_len=4096, **over)
  p = np.arange(cfg.seq_len)
  mask = attention.Mask(window=cfg.window_of(kind), local_chunk=cfg.local_chunk_of(kind))
  seen = np.maximum(mask.first_key(p), 0)
  assert plan.keys_per_query(cfg, kind) == pytest.approx(np.mean(p - seen + 1) - 0.5)


def test_gpt_oss_windowed_layers_cost_their_window():
  """gpt-oss-120b at 8,192 positions: its 18 sliding layers (window 128) cost the attention core
  128 keys a query, not 4,096: the step's FLOPs are those of the full layers alone, plus 128."""
  from modeling.config import get_config
  cfg = get_config("gpt-oss-120b").replace(seq_len=8192)
  full = cfg.replace(attention_pattern="full")
  mm, attn = plan._forward_flops_per_token(cfg)
  mm_full, attn_full = plan._forward_flops_per_token(full)
  assert mm == mm_full
  per_key = attn_full / (cfg.n_layers * 4096)
  assert attn == pytest.approx(per_key * 18 * (4096 + plan.keys_per_query(cfg, "sliding")))
  assert plan.keys_per_query(cfg, "sliding") == pytest.approx(128 - 128 * 127 / 16384 - 0.5)


def test_pp_ticks_last_as_long_as_the_slowest_chunk():
  """gpt-oss-120b (sliding, full) on pp: 4 stages of 9 layers hold 5 full layers on stages 1
  and 3 (a chunk starting on a full layer), 4.5 on average, so a tick lasts the 5; 2 and 3
  stages start every chunk on a period (1.0); an uneven layout's padded rows count as layers
  (5,5,5,5,4,4,4,4: 8 chunks of 5 rows for 36 layers), as for a model of one kind, where the
  ratio is the rows over the layers (DeepSeek-V3's 58 on 16 stages: 64 / 58)."""
  from modeling.config import get_config
  cfg = get_config("gpt-oss-120b").replace(seq_len=4096)
  mm, _ = plan._forward_flops_per_token(cfg)
  core = lambda kind: 2 * cfg.n_heads * 2 * cfg.head_dim * plan.keys_per_query(cfg, kind)
  layer, full, sliding = mm / cfg.n_layers, core("full"), core("sliding")
  mean = 36 * layer + 18 * (full + sliding)
  assert plan.slowest_chunk(cfg, 4) == pytest.approx(4 * (9 * layer + 5 * full + 4 * sliding)
                                                     / mean)
  assert plan.slowest_chunk(cfg, 2) == plan.slowest_chunk(cfg, 3) == 1.0
  uneven = cfg.replace(layer_layout="5,5,5,5,4,4,4,4")
  # chunk 1 holds layers 5..9 (full, sliding, full, sliding, full); a 4-layer chunk's padding
  # row runs kind 0, sliding
  assert plan.slowest_chunk(uneven, 8) == pytest.approx(8 * (5 * layer + 3 * full + 2 * sliding)
                                                        / mean)
  v3 = get_config("deepseek-v3").replace(layer_layout="4,4,4,4,4,4,4,4,4,4,3,3,3,3,3,3")
  assert plan.slowest_chunk(v3, 16) == pytest.approx(64 / 58)
