"""run.py: bad flags give one-line errors (exit 2, no traceback); the metrics file contract."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import one_error_line, run_py_in_one_process, subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300):
  env = subprocess_env()
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


BAD_FLAGS = [
    (["--strategy=nope"], "unknown strategy 'nope'"),
    (["--strategy=dp", "--mesh=data:4"], "has 4 devices but 8 are available"),
    (["--strategy=dp", "--mesh=data:8", "--batch=12"], "batch=12 is not divisible by mesh axis data=8"),
    (["--strategy=dp", "--mesh=expert:8"], "mesh axis 'expert' is not used by strategy 'dp'"),
    (["--strategy=dp", "--mesh=data:x"], "bad mesh entry 'data:x'"),
    (["--strategy=dp", "--capacity_factor=-1"], "--capacity_factor=-1.0 must be a finite number >= 0"),
    (["--strategy=dp", "--capacity_factor=inf"], "--capacity_factor=inf must be a finite number >= 0"),
    (["--strategy=dp", "--devices=100000"], "--devices=100000 must be in [1, 4096]"),
    (["--strategy=dp", "--gmm=fast"], "fast"),
    (["--strategy=dp", "--model=gpt5"], "unknown model 'gpt5'"),
    (["--strategy=tp", "--mesh=data:2,tensor:4"], "n_kv_heads=2 is not divisible by mesh axis tensor=4"),
    (["--strategy=cp", "--mesh=context:4,data:2", "--seq=36"],
     "seq_len=36 is not divisible by 2*context=8"),
    (["--strategy=ep", "--mesh=expert:8", "--batch=4"],
     "batch=4 is not divisible by mesh axis dataxfsdpxexpert=8"),
    (["--strategy=ep", "--mesh=expert:8", "--opt=exchange=ragged"],
     "exchange=ragged needs ragged_all_to_all"),
    # the flags strategy options replaced: each names its --opt form
    (["--strategy=ep", "--dispatch=a2a"], "--dispatch is retired: give --opt=exchange=VALUE (ep)"),
    (["--strategy=ep", "--dispatch_batch_on_expert"],
     "--dispatch_batch_on_expert is retired: give --opt=exchange=none (ep)"),
    (["--strategy=shard_exp_on_fsdp", "--expert_fsdp_mode=ep"],
     "--expert_fsdp_mode is retired: give --opt=mode=VALUE (shard_exp_on_fsdp)"),
    (["--strategy=ep_tp", "--ep_tp_capacity=0.5"],
     "--ep_tp_capacity is retired: give --opt=capacity=VALUE (ep_tp)"),
    (["--strategy=cp", "--context_sharding=context"], "--context_sharding is retired: give nothing"),
    # a strategy option of another strategy (the rest: test_options_one_line_errors, in-process)
    (["--strategy=tp", "--opt=exchange=a2a"],
     "strategy 'tp' has no option 'exchange' (it is an option of ep, ep_tp); its options: none"),
    (["--strategy=ep_tp", "--mesh=data:2,expert:4"], "n_kv_heads=2 is not divisible by mesh axis expert=4"),
    (["--strategy=shard_exp_on_fsdp", "--mesh=fsdp:2,expert:4", "--batch=4"],
     "batch=4 is not divisible by mesh axis fsdpxexpert=8"),
    (["--strategy=reference", "--mesh=data:8"], "takes no --mesh"),
    (["--compare=ep", "--mesh=search"], "--mesh=search is a compare-mode study"),
    (["--strategy=ep", "--adam_eps=0"], "--adam_eps=0.0 must be a finite number > 0"),
    (["--strategy=ep", "--dtype=float16"], "unknown dtype 'float16'; choose from float32, bfloat16"),
    (["--strategy=ep", "--dtype=bfloat16", "--grad_reduce_dtype=fp8"],
     "unknown grad_reduce_dtype 'fp8'"),
    (["--strategy=dp", "--devices=0"], "--devices=0 must be in [1, 4096]"),
    (["--strategy=dp", "--steps=-1"], "--steps=-1 must be >= 0"),
    (["--steps=0"], "--steps=0 in compare mode: use --compile_only"),
    (["--strategy=dp", "--layers=0"], "--layers=0 must be >= 1"),
    (["--strategy=dp", "--remat=all"], "unknown remat 'all'"),
    (["--compile_only", "--hbm_gb=0"], "--hbm_gb=0.0 must be a finite number > 0"),
    (["--compare=dp", "--hbm_gb=80"], "--hbm_gb needs --compile_only"),
    (["--strategy=dp", "--microbatches=0"], "--microbatches=0 must be >= 1"),
    (["--strategy=dp", "--batch=8", "--microbatches=3"], "batch=8 is not divisible by microbatches=3"),
    (["--strategy=dp", "--mesh=data:8", "--microbatches=2"],
     "batch=8 is not divisible by microbatches=2 x mesh axis data=8"),
    (["--strategy=dp", "--batch=0"], "--batch=0 must be >= 1"),
    (["--strategy=pp", "--mesh=stage:2,expert:4", "--microbatches=4"],
     "batch=8 is not divisible by microbatches=4 x mesh axis dataxexpert=4"),
    (["--strategy=pp", "--mesh=stage:4,expert:2"],
     "n_layers=2 < mesh axis stage=4: fewer MoE layers than stages, no layer layout gives each "
     "stage one"),
    (["--strategy=dp", "--lr=-1"], "--lr=-1.0 must be a finite number > 0"),
    (["--strategy=dp", "--lr=nan"], "--lr=nan must be a finite number > 0"),
    (["--strategy=dp", "--metrics_file=/no/such/dir/m.jsonl"],
     "--metrics_file=/no/such/dir/m.jsonl: directory /no/such/dir does not exist"),
    (["--report_dir=/proc/no_such_dir"], "--report_dir=/proc/no_such_dir:"),
    (["--strategy=ep", "--num_processes=2", "--process_id=2", "--coordinator_address=127.0.0.1:1"],
     "--process_id=2 must be in [0, --num_processes=2)"),
    (["--strategy=ep", "--num_processes=2", "--process_id=0"],
     "multi-process needs --coordinator_address, --num_processes and --process_id"),
    (["--num_processes=2", "--process_id=0", "--coordinator_address=127.0.0.1:1"],
     "multi-process runs need --strategy"),
    (["--strategy=dp", "--restore=latest", "--checkpoint_dir=/no/such/dir"],
     "--checkpoint_dir=/no/such/dir does not exist"),
    (["--strategy=dp", "--restore=latest"], "--restore needs --checkpoint_dir"),
    (["--compare=dp", "--hlo_stats"], "--hlo_stats is for --strategy"),
    (["--strategy=fsdp", "--model=deepseek-v3"], "model deepseek-v3 would allocate"),
    (["--strategy=tp", "--model=deepseek-test", "--mesh=data:1,tensor:8"],
     "n_heads=4 is not divisible by mesh axis tensor=8"),
    (["--strategy=dp", "--attention=flash"],
     "unknown attention 'flash'; choose from xla, chunked, cudnn"),
    (["--strategy=dp", "--attention=cudnn"], "--attention=cudnn needs a GPU"),
    (["--strategy=dp", "--model=deepseek-test", "--attention=cudnn"],
     "--attention=cudnn takes GQA only"),
    (["--strategy=dp", "--attention_chunk=0"], "attention_chunk=0 must be >= 1"),
    (["--strategy=cp", "--opt=kv_exchange=ring", "--attention=xla"],
     "kv_exchange=ring folds each visiting K/V block into an online softmax: it takes "
     "--attention=chunked, not xla"),
    (["--strategy=ep", "--devices=1", "--mesh=expert:1"],
     "--devices=1: one device is the reference's layout (--strategy=reference)"),
    (["--devices=1", "--compile_only"], "--devices=1: one device is the reference's layout"),
    (["--strategy=dp", "--opt=kv_exchange=ring"],
     "strategy 'dp' has no option 'kv_exchange' (it is an option of cp, ep_as_cp, pp)"),
    (["--model=deepseek-v3", "--layers=3", "--describe"],
     "first_k_dense_replace=3 must be in [0, n_layers=3) (at least one MoE layer)"),
    # --layer_layout: pp's stages (and the reference); a layout that is not the model's
    (["--strategy=ep", "--mesh=expert:8", "--layers=3", "--layer_layout=2,1"],
     "--layer_layout=2,1 is pp's (its stages hold the groups); ep runs the model without it"),
    (["--strategy=pp", "--mesh=stage:2,expert:4", "--layers=3", "--layer_layout=2,2"],
     "layer_layout=2,2 holds 4 MoE layers, the model has 3"),
    (["--strategy=pp", "--mesh=stage:2,expert:4", "--layer_layout=2,x"],
     "expected MoE layers per group, each >= 1"),
    # --plan (planning/): refused before anything is enumerated or compiled
    (["--plan", "--cluster=tpu"], "unknown cluster 'tpu'; choose from h100, h800"),
    (["--plan", "--devices=12"], "--devices=12: whole nodes of 8 (h100), or part of one"),
    (["--plan", "--remat=dots_saveable"],
     "--remat=dots_saveable: the planner prices remat none | block only"),
    (["--plan", "--compare=dp,ep", "--layer_layout=1,1"], "--layer_layout=1,1 is pp's"),
    (["--plan", "--mesh=data:4"], "--mesh=data:4 has 4 devices, not --devices=8"),
    (["--plan", "--plan_compile=-1"], "--plan_compile=-1 must be >= 0"),
    (["--plan", "--plan_efficiency=2"], "--plan_efficiency=2.0 must be in (0, 1]"),
    (["--plan", "--plan_imbalance=-0.1"], "--plan_imbalance=-0.1 must be >= 0"),
    (["--plan", "--plan_overlap=all"], "--plan_overlap=all: choose from none | weights | schedule"),
    (["--plan", "--plan_a2a=deepep"], "--plan_a2a=deepep: choose from flat | hierarchical"),
    (["--plan", "--plan_gmm=tiles"], "--plan_gmm=tiles: choose from flat | rows"),
    (["--plan", "--plan_ici=mesh"], "--plan_ici=mesh: choose from dimension | torus"),
    (["--plan", "--plan_find=pp"], "--plan_find=pp: expected STRATEGY@MESH"),
    (["--plan", "--plan_find=pp@stage:4"], "--plan_find=pp@stage:4 has 4 devices, not --devices=8"),
    (["--plan", "--plan_find=pp@fsdp:8"], "mesh axis 'fsdp' is not used by strategy 'pp'"),
    (["--plan", "--compile_only"], "--plan compiles its best candidates itself"),
    (["--plan", "--opt=foo=1"], "--opt key 'foo' is an option of none of the planned strategies"),
    (["--strategy=dp", "--checkpoint_dir=run.py", "--restore=latest"],
     "--checkpoint_dir=run.py is a file, not a directory"),
    (["--strategy=dp", "--checkpoint_dir=run.py"], "--checkpoint_dir=run.py is a file"),
    (["--compile_only", "--hbm_gb=80XB"], "flag --hbm_gb=80XB: could not convert string to float"),
    (["--strategy=dp", "--steps=x"], "flag --steps=x: invalid literal for int()"),
]

@pytest.fixture(scope="module")
def bad_flag_results():
  """Every BAD_FLAGS row through run.py's own entry point, in one process."""
  return run_py_in_one_process({str(i): args for i, (args, _) in enumerate(BAD_FLAGS)})


@pytest.mark.parametrize("row", range(len(BAD_FLAGS)), ids=[m for _, m in BAD_FLAGS])
def test_bad_flags_one_line_error(bad_flag_results, row):
  line = one_error_line(*bad_flag_results[str(row)][::2])
  assert BAD_FLAGS[row][1] in line, line


def test_a_bad_flag_in_its_own_process():
  """One row as a user runs it: its own `python run.py` process (the rows above share one)."""
  r = _run("--strategy=cp", "--mesh=context:4,data:2", "--seq=36")
  assert r.returncode == 2, r.stderr
  assert r.stderr.strip() == "error: seq_len=36 is not divisible by 2*context=8", r.stderr


def test_metrics_file(tmp_path):
  path = tmp_path / "m.jsonl"
  r = _run("--strategy=reference", "--model=deepseek-test", "--steps=3", f"--metrics_file={path}")
  assert r.returncode == 0, r.stderr
  recs = [json.loads(l) for l in path.read_text().splitlines()]
  assert len(recs) == 4
  for i, rec in enumerate(recs[:3]):
    assert set(rec) == {"step", "loss", "ce_loss", "aux_loss", "grad_norm", "dropped",
                        "step_time_s", "tokens_per_s", "steps_done"}
    assert rec["step"] == i and rec["steps_done"] == i + 1
  s = recs[-1]
  assert s["summary"] is True and s["strategy"] == "reference"
  assert {"mesh", "compile_s", "flops", "memory", "collectives"} <= set(s)
  assert s["attention"] == "chunked" and s["aux_loss_kind"] == "sequence"
  assert set(s["memory"]) == {"argument_bytes", "output_bytes", "temp_bytes"}
  assert all(set(v) == {"count", "bytes", "wire_bytes"} for v in s["collectives"].values())
  assert "[   3/3] loss" in r.stdout


def test_cli_losses_match_reference(tmp_path):
  # the end-to-end contract (losses equal the reference's), for one strategy (the rest:
  # docs/testing.md, "Checking a strategy from the command line")
  def losses(*args):
    path = tmp_path / "m.jsonl"
    r = _run(*args, "--steps=2", f"--metrics_file={path}")
    assert r.returncode == 0, r.stderr
    return [json.loads(l)["loss"] for l in path.read_text().splitlines()[:-1]]
  ref = losses("--strategy=reference")
  ep = losses("--strategy=ep", "--mesh=data:2,expert:4", "--devices=8")
  assert len(ep) == 2
  for a, b in zip(ep, ref):
    assert abs(a - b) <= 1e-5 * abs(b), (ep, ref)


def test_steps_zero_compiles_and_reports(tmp_path):
  path = tmp_path / "m.jsonl"
  r = _run("--strategy=reference", "--steps=0", f"--metrics_file={path}")
  assert r.returncode == 0, r.stderr
  recs = [json.loads(l) for l in path.read_text().splitlines()]
  assert len(recs) == 1 and recs[0]["summary"] is True        # 0 steps run, the summary stays
  assert "loss" not in r.stdout


def test_non_finite_loss_stops_with_one_line_error(tmp_path):
  path = tmp_path / "m.jsonl"
  r = _run("--strategy=reference", "--lr=1e30", "--steps=6", f"--metrics_file={path}")
  assert r.returncode == 1, r.stderr
  lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: non-finite loss at step "), r.stderr
  n = int(lines[0].rsplit(" ", 1)[1])
  recs = [json.loads(l) for l in path.read_text().splitlines()]
  assert [rec["step"] for rec in recs] == list(range(n + 1))    # every step up to N, no summary
  assert all(np.isfinite(rec["loss"]) for rec in recs[:-1])
  assert not (np.isfinite(recs[-1]["loss"]) and np.isfinite(recs[-1]["grad_norm"]))


def _table_rows(stdout):
  return [l for l in stdout.splitlines() if l.startswith("|")]


def test_compare_all_skipped_rows_are_aligned():
  r = _run("--compare=ep,fsdp", "--model=mixtral-test", "--devices=64", "--compile_only")
  assert r.returncode == 1, r.stderr                     # nothing compiled: nothing compared
  assert [l.split(":")[0:2] for l in r.stderr.splitlines() if l.startswith("skipped: ")] == \
      [["skipped", " ep"], ["skipped", " fsdp"]], r.stderr
  assert r.stderr.strip().splitlines()[-1].startswith("error: compare did not pass: "), r.stderr
  rows = _table_rows(r.stdout)
  assert len(rows) == 4 and all("skipped: " in l for l in rows[2:]), r.stdout
  # a markdown table: every row has the header's cells, and the borders line up
  assert {l.count("|") for l in rows} == {rows[0].count("|")}, r.stdout
  assert {tuple(i for i, c in enumerate(l) if c == "|") for l in rows} == \
      {tuple(i for i, c in enumerate(rows[0]) if c == "|")}, r.stdout


def test_compare_marks_a_non_finite_row():
  import report
  ok = {"strategy": "dp", "mesh": "data:8", "losses": [1.0, 0.9], "max_dloss": 0.0,
        "parity": "PASS", "collectives": {k: {"count": 0, "bytes": 0} for k in report.KINDS},
        "param_bytes": 1, "opt_bytes": 1, "memory": {"temp_bytes": 1}, "step_s": 0.1,
        "dropped_frac": 0.0}
  bad = dict(ok, strategy="ep", losses=[1.0, float("nan")], nonfinite_step=1, parity="NON-FINITE")
  bad.pop("max_dloss")
  skipped = {"strategy": "shard_exp_on_fsdp", "mesh": "fsdp:16,expert:4",
             "error": "n_experts=8 is not divisible by mesh axis expertxfsdp=64"}
  table = report.render([ok, bad, skipped], compile_only=False, simulated=True)
  rows = table.splitlines()
  assert "nan" not in table and "NON-FINITE at step 1" in rows[3], table
  assert {tuple(i for i, c in enumerate(l) if c == "|") for l in rows if l.startswith("| ")} == \
      {tuple(i for i, c in enumerate(rows[0]) if c == "|")}, table


def test_compare_row_that_fails_to_build_is_its_error(monkeypatch):
  """A strategy whose step fails to trace becomes its row's one-line error; the others run."""
  import compare
  from modeling.config import get_config
  import strategies
  dp = strategies.get("dp")

  def broken(cfg, mesh, opts):
    raise ValueError("0th dimension of all xs should be replicated\nmore detail")
  monkeypatch.setattr(dp, "layout", broken)
  rows = compare.main(get_config("tiny"), names=["dp", "fsdp"], mesh_spec=None, steps=1,
                      report_dir=None, compile_only=True, model_name="tiny")
  by = {r["strategy"]: r for r in rows}
  assert by["dp"]["error"] == ("failed: ValueError: 0th dimension of all xs should be replicated")
  assert "error" not in by["fsdp"] and by["fsdp"]["collectives"]["all-gather"]["count"] > 0


def test_checkpoint_saves_are_reported_and_never_vanish(tmp_path):
  """Every save prints `saved step N to DIR`; a run without --restore into a directory holding
  steps is refused before compiling (naming them); --overwrite_checkpoint replaces them; a
  restore whose saves orbax would skip (a later step in the directory) is refused too."""
  d = str(tmp_path / "ck")
  run = lambda *a: _run("--strategy=dp", "--mesh=data:8", f"--checkpoint_dir={d}", *a)
  r = run("--steps=2", "--save_every=1")
  assert r.returncode == 0, r.stderr
  assert [l for l in r.stdout.splitlines() if l.startswith("saved")] == [
      f"saved step 1 to {d}", f"saved step 2 to {d}"], r.stdout
  r = run("--steps=1")
  assert r.returncode == 2 and r.stderr.strip() == (
      f"error: --checkpoint_dir={d} already holds step(s) 1, 2: resume with --restore=latest, "
      "save to a new directory, or pass --overwrite_checkpoint to delete them"), r.stderr
  assert "compiled" not in r.stdout
  r = run("--restore=1", "--steps=1")
  assert r.returncode == 2 and "holds step(s) 2 after the restored step 1" in r.stderr, r.stderr
  r = run("--steps=1", "--overwrite_checkpoint")
  assert r.returncode == 0, r.stderr
  assert f"deleted step(s) 1, 2 of {d} (--overwrite_checkpoint)" in r.stdout
  assert f"saved step 1 to {d}" in r.stdout
  assert sorted(os.listdir(d)) == ["1"]


def test_compile_only_with_strategy_allocates_nothing(tmp_path):
  """--compile_only --strategy: compiled from abstract shapes, collectives and memory reported
  (with --hbm_gb a fit line), no step run; the metrics summary says so."""
  m = tmp_path / "m.jsonl"
  r = _run("--strategy=ep", "--mesh=data:2,expert:4", "--compile_only", "--hbm_gb=1",
           "--breakdown", f"--metrics_file={m}")
  assert r.returncode == 0, r.stderr
  assert "[   1/" not in r.stdout
  assert "all-to-all" in r.stdout and "wire bytes/device" in r.stdout
  assert "per device: params+opt " in r.stdout and ": fits in 1 GiB (G = GiB" in r.stdout
  assert "| all-to-all over (expert) | bwd |" in r.stdout          # the breakdown
  (summary,) = [json.loads(l) for l in m.read_text().splitlines()]
  assert summary["summary"] and summary["compile_only"] and summary["steps"] == 0


def _check_in_process(*args):
  """run.py's checks before JAX starts (flags, strategy options), in this process."""
  import run
  import command_line as command
  run.F.unparse_flags()
  run.F(["run.py", *args])
  try:
    command.check_flags(run.F)
    command.strategy_options(run.F, command.strategy_names(run.F))
  finally:
    run.F.unparse_flags()


@pytest.mark.parametrize("args,message", [
    (["--strategy=dp", "--capacity_factor=nan"], "--capacity_factor=nan must be a finite number >= 0"),
    (["--strategy=pp", "--opt=exchange=ragged"], "strategy 'pp' has no option 'exchange'"),
    (["--strategy=ep", "--opt=speed=fast"], "strategy 'ep' has no option 'speed'; its options: exchange"),
    (["--strategy=ep", "--opt=exchange=fast"], "ep option exchange='fast': choose from a2a, ragged, none"),
    (["--strategy=ep_tp", "--opt=capacity=1.5"], "ep_tp option capacity=1.5: must be a finite number in [0, 1]"),
    (["--strategy=ep_tp", "--opt=capacity=x"], "ep_tp option capacity='x': expected a number"),
    (["--strategy=shard_exp_on_fsdp", "--opt=mode=both"],
     "shard_exp_on_fsdp option mode='both': choose from gather, ep"),
    (["--strategy=ep", "--opt=exchange"], "bad --opt entry 'exchange': expected key=value"),
    (["--compare=dp,tp", "--opt=mode=ep"],
     "--opt key 'mode' belongs to none of the compared strategies (an option of shard_exp_on_fsdp)"),
    (["--compare=cp,cp:kv_exchange"], "comparison entry 'cp:kv_exchange': after the strategy"),
    (["--compare=cp,cp:ring=yes"], "strategy 'cp' has no option 'ring'"),
    (["--compare=dp,ccp:kv_exchange=ring"], "unknown strategy 'ccp'"),
    (["--strategy=dp", "--full_parity"], "--full_parity is a compare-mode check"),
    (["--compile_only", "--full_parity"], "--full_parity is a compare-mode check"),
    (["--strategy=dp", "--overwrite_checkpoint"], "--overwrite_checkpoint needs --checkpoint_dir"),
    (["--strategy=dp", "--compile_only", "--checkpoint_dir=/tmp"], "--compile_only runs no step"),
])
def test_options_one_line_errors(args, message):
  """The same checks run.py makes before JAX starts (its one-line `error:` is the message)."""
  import run
  from modeling.config import ConfigError
  with pytest.raises((ConfigError, run.UsageError)) as e:
    _check_in_process(*args)
  assert str(e.value).startswith(message), str(e.value)


def test_options_reach_the_strategies_that_have_them():
  import run
  import command_line as command
  import strategies
  run.F.unparse_flags()
  run.F(["run.py", "--compare=ep:exchange=none,ep_tp,dp", "--opt=capacity=0.5"])
  try:
    opts = command.strategy_options(run.F, command.strategy_names(run.F))
  finally:
    run.F.unparse_flags()
  assert opts == {"ep:exchange=none": strategies.get("ep").Options(exchange="none"),
                  "ep_tp": strategies.get("ep_tp").Options(capacity=0.5),
                  "dp": strategies.get("dp").Options()}


def test_compare_entries_carry_their_own_options():
  """NAME:key=value rows: their options over --opt's; 'all' adds each COMPARE_VARIANTS row."""
  import run
  import command_line as command
  import strategies
  run.F.unparse_flags()
  run.F(["run.py", "--compare=cp,cp:kv_exchange=ring,ep", "--opt=exchange=none"])
  try:
    opts = command.strategy_options(run.F, command.strategy_names(run.F))
    run.F.unparse_flags()
    run.F(["run.py"])
    every = command.strategy_names(run.F)
  finally:
    run.F.unparse_flags()
  cp = strategies.get("cp").Options
  assert opts == {"cp": cp(), "cp:kv_exchange=ring": cp(kv_exchange="ring"),
                  "ep": strategies.get("ep").Options(exchange="none")}
  assert every == [e for n in strategies.available() for e in strategies.compare_entries(n)]
  assert "cp:kv_exchange=ring" in every and "ep_as_cp:kv_exchange=ring" in every


def test_describe_prints_parameter_counts_without_compiling():
  r = _run("--model=deepseek-v3", "--describe", timeout=120)
  assert r.returncode == 0, r.stderr
  from modeling import model
  from modeling.config import get_config
  total, active = model.param_counts(get_config("deepseek-v3"))
  cfg = get_config("deepseek-v3")
  lines = r.stdout.splitlines()
  assert lines[:3] == [f"total_params {total}", f"activated_params {active}",
                       f"activated_params_with_embeddings {active - cfg.d_model + cfg.vocab * cfg.d_model}"]
  assert lines[3].startswith("model deepseek-v3: 671.03B total, 36.63B activated"), lines[3]


def _row(name, **kw):
  return {"strategy": name, "parity": "PASS", "losses": [1.0], **kw}


@pytest.mark.parametrize("rows, compile_only, failed", [
    ([_row("reference"), _row("dp")], False, []),
    ([_row("reference"), _row("dp", parity="FAIL", parity_checked="losses")], False,
     ["dp: FAIL (losses)"]),
    ([_row("reference"), _row("ep", parity="NON-FINITE", nonfinite_step=2)], False,
     ["ep: NON-FINITE at step 2"]),
    ([_row("reference"), _row("dp"), {"strategy": "ep", "error": "n_experts=8 is not divisible"}],
     False, ["ep: n_experts=8 is not divisible"]),
    ([{"strategy": "dp", "error": "failed: ValueError: x"}, _row("ep")], True,
     ["dp: failed: ValueError: x"]),
    ([{"strategy": "dp", "error": "batch=8 is not divisible"}, _row("ep")], True, []),
    ([{"strategy": "dp", "error": "batch=8 is not divisible"}], True,
     ["nothing was compared: no strategy built"]),
    ([_row("reference"), {"strategy": "dp", "losses": [1.0]}], False,
     ["dp: parity not checked (the reference did not run)"]),
], ids=["pass", "fail", "non-finite", "skipped-run", "trace-failure", "skipped-compile-only",
        "nothing-compiled", "no-reference"])
def test_compare_exit_status_rule(rows, compile_only, failed):
  import compare
  failures, _ = compare.outcome(rows, compile_only)
  assert failures == failed


@pytest.mark.parametrize("args, code, says", [
    (["--compare=dp", "--steps=2"], 0, None),
    (["--compare=dp", "--steps=6", "--lr=1e30"], 1, "error: compare did not pass: dp: NON-FINITE"),
    (["--compare=dp,ep", "--devices=16", "--steps=1"], 1,
     "error: compare did not pass: dp: batch=8 is not divisible by mesh axis data=16; ep: "),
], ids=["all-pass", "non-finite", "all-skipped"])
def test_compare_exit_status(args, code, says):
  r = _run(*args)
  assert r.returncode == code, r.stdout + r.stderr
  if says:
    assert r.stderr.strip().splitlines()[-1].startswith(says), r.stderr


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_0(flag):
  r = _run(flag)
  assert r.returncode == 0 and "--hbm_gb" in r.stdout + r.stderr, r.stderr


def test_hbm_gb_takes_units():
  import command_line as command
  parse = command.MemoryParser().parse
  assert parse("80") == 80 and parse("74.5GiB") == 74.5 and parse("512MiB") == 0.5
  assert parse("80GB") == pytest.approx(80e9 / 2**30) and parse("80 gb") == parse("80GB")


def test_compile_only_memory_is_a_kernels_on_cpu():
  """--compile_only on XLA:CPU lowers the grouped matmul through scan unless --gmm is given,
  and says so; --gmm=ragged_dot keeps XLA:CPU's densified one, whose temp is larger."""
  temp = {}
  for extra in ((), ("--gmm=ragged_dot",)):
    r = _run("--strategy=ep", "--mesh=fsdp:2,expert:4", "--model=deepseek-test", "--compile_only",
             *extra)
    assert r.returncode == 0, r.stderr
    assert (", gmm scan:" if not extra else ", gmm ragged_dot:") in r.stdout, r.stdout
    assert ("note: --compile_only on XLA:CPU: gmm scan" in r.stderr) == (not extra), r.stderr
    temp[extra] = r.stdout.split("XLA temp ")[1].split(",")[0]
  assert temp[()] != temp[("--gmm=ragged_dot",)], temp


def test_breakdown_shows_once_per_step_terms_per_step():
  r = _run("--strategy=fsdp", "--model=deepseek-test", "--mesh=fsdp:8", "--compile_only",
           "--breakdown")
  assert r.returncode == 0, r.stderr
  ar_opt = [l for l in r.stdout.splitlines() if l.startswith("|  | opt |")]
  assert ar_opt and "4/step" in ar_opt[0], r.stdout                  # the grad norm, once
  assert "(+11 more: --breakdown_all)" in r.stdout, r.stdout
  for mode in ("--strategy=fsdp", "--compare=fsdp"):                 # both print the breakdown
    r = _run(mode, "--model=deepseek-test", "--mesh=fsdp:8", "--compile_only", "--breakdown_all")
    assert r.returncode == 0, r.stderr
    assert "more: --breakdown_all" not in r.stdout and "unembed gathered" in r.stdout, r.stdout
