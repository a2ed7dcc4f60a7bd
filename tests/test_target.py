"""--target=NAME (runtime/target.py): a compile-only step compiled on this CPU-only host by the
target's own compiler (XLA:TPU from libtpu, XLA:GPU from the CUDA plugin), its memory named as
that compiler's; and the one-line refusals, before anything compiles. The compiles skip, saying
why, without their optional package (requirements-tpu.txt, requirements-gpu.txt); the refusals
run everywhere."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import one_error_line, run_py_in_one_process, subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):
    return False


needs_libtpu = pytest.mark.skipif(not _installed("libtpu"),
                                  reason="libtpu absent: pip install -r requirements-tpu.txt")
needs_cuda_plugin = pytest.mark.skipif(not (_installed("jax_plugins.xla_cuda12")
                                            or _installed("jax_plugins.xla_cuda13")),
                                       reason="the CUDA plugin absent: pip install -r "
                                              "requirements-gpu.txt")

# ep on mixtral-test (E 8), one layer: the smallest step that holds an expert exchange
EP = ["--strategy=ep", "--model=mixtral-test", "--layers=1", "--compile_only"]


def _summary(path) -> dict:
  (line,) = [json.loads(l) for l in open(path).read().splitlines()]
  return line


@pytest.fixture(scope="module")
def tpu_runs(tmp_path_factory):
  """ep for 8 v5p chips (v5:2x2x2), with its padded and its ragged exchange, in one process."""
  d = tmp_path_factory.mktemp("tpu")
  out = run_py_in_one_process({
      "a2a": EP + ["--target=tpu-v5p", "--devices=8", f"--metrics_file={d}/a2a.jsonl"],
      "ragged": EP + ["--target=tpu-v5p", "--devices=8", "--opt=exchange=ragged",
                      f"--metrics_file={d}/ragged.jsonl"],
      "plan": ["--plan", "--model=tiny", "--devices=8", "--plan_compile=1", "--plan_top=3",
               "--target=tpu-v5p"],
      "cluster": ["--plan", "--model=tiny", "--devices=8", "--plan_compile=1", "--plan_top=1",
                  "--cluster=tpu-v5p"]})
  return {k: (*v, d / f"{k}.jsonl") for k, v in out.items()}


@needs_libtpu
def test_tpu_v5p_compiles_ep_with_xla_tpu(tpu_runs):
  code, stdout, stderr, metrics = tpu_runs["a2a"]
  assert code == 0, stderr
  assert "compiled for tpu-v5p (v5:2x2x2) in" in stdout, stdout
  assert "  memory: XLA:TPU (tpu-v5p, 8 devices)" in stdout, stdout
  assert "gmm ragged_dot" in stdout and "no --gmm=scan stand-in" in stderr, stderr
  s = _summary(metrics)
  assert s["compiler"] == "XLA:TPU" and s["target"] == "tpu-v5p" and s["compile_only"]
  assert s["memory"]["temp_bytes"] > 0 and s["collectives"]["all-to-all"]["count"] > 0


@needs_libtpu
def test_tpu_v5p_compiles_the_ragged_exchange(tpu_runs):
  """exchange=ragged, refused on XLA:CPU (tests/test_cli.py), compiles for a TPU: its HLO holds
  ragged-all-to-all ops."""
  code, stdout, stderr, metrics = tpu_runs["ragged"]
  assert code == 0, stderr
  assert "ragged-all-to-all" in stdout, stdout
  assert _summary(metrics)["collectives"]["ragged-all-to-all"]["count"] > 0


@needs_libtpu
def test_plan_compiles_its_best_with_xla_tpu(tpu_runs):
  """--plan --target: the planner's cluster is the target's chip, and its best candidate is
  compiled by XLA:TPU, its collectives held to the cost model in measure.compilers' normal
  form."""
  code, stdout, stderr, _ = tpu_runs["plan"]
  assert code == 0, stderr
  assert "8 devices of tpu-v5p" in stdout, stdout
  assert "compiled by XLA:TPU (tpu-v5p, 8 devices)" in stdout, stdout
  assert "in measure.compilers' normal form every (kind, axes) agrees" in stdout, stdout


@needs_libtpu
def test_plan_on_a_tpu_cluster_compiles_with_xla_tpu(tpu_runs):
  """--plan --cluster=tpu-v5p without --target: the temp model is XLA:TPU's, so XLA:TPU compiles
  the candidates it checks (libtpu installed, 8 devices a slice v5p makes)."""
  code, stdout, stderr, _ = tpu_runs["cluster"]
  assert code == 0, stderr
  assert "temp as XLA:TPU holds it" in stdout, stdout
  assert ("compiled by XLA:TPU (tpu-v5p, 8 devices); the temp model is fitted to XLA:TPU's"
          in stdout), stdout
  assert "note: the ratios below" not in stdout, stdout


@needs_cuda_plugin
def test_h100_compiles_ep_with_xla_gpu(tmp_path):
  m = tmp_path / "m.jsonl"
  out = run_py_in_one_process({"ep": EP + ["--target=h100", "--devices=8",
                                           f"--metrics_file={m}"]})
  code, stdout, stderr = out["ep"]
  assert code == 0, stderr
  assert "compiled for h100 (1x1x8) in" in stdout, stdout
  assert "  memory: XLA:GPU (h100, 8 devices)" in stdout, stdout
  s = _summary(m)
  assert s["compiler"] == "XLA:GPU" and s["target"] == "h100"
  assert s["memory"]["temp_bytes"] > 0 and s["collectives"]["all-to-all"]["count"] > 0


BAD = [
    (["--compile_only", "--target=tpu-v9"], "--target=tpu-v9: unknown target; choose from "
     "tpu-v5p, tpu-v5e, tpu-v6e, tpu-v7, h100, h200, b200"),
    (["--compile_only", "--target=tpu-v5p", "--devices=12"],
     "--target=tpu-v5p --devices=12: tpu-v5p makes 4, 8, 16, ..., 4096"),
    (["--strategy=ep", "--compile_only", "--target=tpu-v5e", "--devices=512"],
     "tpu-v5e makes 4, 8, 16, ..., 256"),
    (["--strategy=ep", "--compile_only", "--target=h100", "--devices=12"],
     "h100 makes 2 to 8 (one host), or a multiple of 8"),
    (["--strategy=ep", "--target=tpu-v5p"], "--target=tpu-v5p compiles for hardware this host "
     "lacks: it needs --compile_only"),
    (["--target=h100"], "it needs --compile_only"),
    (["--plan", "--target=tpu-v5p", "--cluster=h100"],
     "--target=tpu-v5p compiles for another chip than --cluster=h100"),
    (["--plan", "--target=tpu-v5p", "--plan_compile=0"],
     "--target=tpu-v5p with --plan compiles its best candidates: it needs --plan_compile >= 1"),
    (["--plan", "--target=tpu-v5e"], "--target=tpu-v5e with --plan: the planner has no cluster "
     "profile of tpu-v5e (it has h100, h800, tpu-v5p, h200, b200, tpu-v6e, tpu-v7)"),
    (["--strategy=reference", "--devices=1", "--compile_only", "--target=h100"],
     "the reference runs on one device of this host"),
    (["--strategy=ep", "--compile_only", "--target=h100", "--attention=cudnn"],
     "--attention=cudnn is not compiled for --target=h100"),
    (["--plan", "--target=h100", "--attention=cudnn"],
     "--attention=cudnn is not compiled for --target=h100"),
]


@pytest.fixture(scope="module")
def bad_results():
  return run_py_in_one_process({str(i): args for i, (args, _) in enumerate(BAD)})


@pytest.mark.parametrize("row", range(len(BAD)), ids=[m for _, m in BAD])
def test_bad_target_one_line_error(bad_results, row):
  line = one_error_line(*bad_results[str(row)][::2])
  assert BAD[row][1] in line, line


# run.py with the target packages hidden from importlib.util.find_spec: as if never installed
_HIDDEN = """
import importlib.util, sys
find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: (
    None if name in ("libtpu", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
    else find(name, *a))
import run
sys.argv = ["run.py", *sys.argv[1:]]
run._run()
"""


@pytest.mark.parametrize("flag,line", [
    ("--target=tpu-v5p", "error: --target=tpu-v5p needs libtpu: pip install -r "
                         "requirements-tpu.txt"),
    ("--target=h100", "error: --target=h100 needs jax-cuda12-plugin: pip install -r "
                      "requirements-gpu.txt")])
def test_missing_package_is_one_line(flag, line):
  env = subprocess_env()
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run([sys.executable, "-c", _HIDDEN, "--strategy=ep", "--compile_only", flag],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and r.stderr.strip() == line, r.stderr


def test_a_step_over_the_chips_hbm_is_read_from_the_refusal():
  """XLA:TPU refuses to compile a step whose temporaries exceed a device's HBM (E1000); the
  refusal names both sizes in binary units, which runtime.target.hbm_oom reads: the planner's
  check and the fit keep the step's temp, `run.py --compile_only` says it in one line."""
  from planning import check, plan, render
  from runtime import target
  text = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
          "memory required for HLO temporaries (113.60G) exceeds available HBM (95.73G). HLO "
          "module: jit_step.")
  assert target.hbm_oom(RuntimeError(text)) == (113.60 * 2**30, 95.73 * 2**30)
  assert target.hbm_oom(RuntimeError("RESOURCE_EXHAUSTED: something else")) is None
  c = plan.Candidate("fsdp", (("data", 1), ("fsdp", 64)), 1, "block", 1.25,
                     param_opt=10 * 2**30, temp=80 * 2**30)
  r = check.Checked(c, c.param_opt + 113.6 * 2**30, 113.6 * 2**30, {}, 180.0,
                    refused_over=95.73 * 2**30)
  line = render.checked([r])
  assert "refused by the compiler" in line and "over the 95.7G" in line, line
  assert "asked for 113.6G of temporaries" in line and "no program to read" in line, line
  assert "ratio" not in line, line
  verdict = render.compiled_verdict([r], 95 * 2**30)
  assert verdict.startswith("verdict after compiling 1: none"), verdict
  assert "is refused by the compiler at 123.6G (predicted 90.0G): over" in verdict, verdict
