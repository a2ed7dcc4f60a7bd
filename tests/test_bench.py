"""Smoke tests of the benchmark scripts: each runs as `python bench/<name>.py` from the repo root
with the smallest flags, exits 0 and prints its table. Timings are not checked."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _process(script, *flags) -> subprocess.CompletedProcess:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # conftest's 8 simulated devices: the benches use one device
  return subprocess.run([sys.executable, os.path.join("bench", script), *flags], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=120, check=False)


def _run(script, *flags):
  out = _process(script, *flags)
  assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
  return out.stdout


def test_gmm_bench():
  out = _run("gmm.py", "--shapes=mixtral", "--backends=ragged_dot", "--iters=1", "--scale=512")
  lines = out.splitlines()
  assert any(re.match(r"shape\s+backend\s+mode\s+ms\s+TFLOP/s", l) for l in lines), out
  for mode in ("fwd", "fwd+bwd"):
    assert any(re.match(rf"mixtral .* ragged_dot\s+{re.escape(mode)}\s+\d", l) for l in lines), out


def test_gmm_bench_torch_row():
  """torch._grouped_mm (CPU here) on the bench's own data: its forward is checked against
  lax.ragged_dot inside the bench (a mismatch prints 'failed' and drops the rows)."""
  pytest.importorskip("torch")
  out = _run("gmm.py", "--shapes=mixtral_skew", "--backends=torch", "--iters=1", "--scale=64")
  assert "failed" not in out, out
  for mode in ("fwd", "fwd+bwd"):
    assert any(re.match(rf"mixtral_skew .* torch\s+{re.escape(mode)}\s+\d", l)
               for l in out.splitlines()), out


def test_moe_layer_bench():
  # --isolate=yes: the row runs in a child process (the GPU default path), which runs the
  # in-process path (the CPU default) itself. "padded" exercises the gmm-options wrapper.
  backend = "padded"
  out = _run("moe_layer.py", "--proxies=mixtral", f"--backends={backend}", "--iters=1",
             "--scale=512", "--isolate=yes")
  header = [l for l in out.splitlines() if l.startswith("| proxy | backend |")]
  rows = [l for l in out.splitlines() if l.startswith("| mixtral |")]
  assert len(header) == 1 and len(rows) == 1, out
  cells = [c.strip() for c in rows[0].strip("|").split("|")]
  assert cells[1] == backend and "error" not in rows[0], out
  for c in cells[2:6]:             # fwd ms, fwd TFLOP/s, fwd+bwd ms, fwd+bwd TFLOP/s
    assert float(c) > 0, out
  assert "isolated=True" in out, out
  assert "not measured by this run" in out.lower(), out


def test_moe_layer_bench_torch_row():
  """The PyTorch eager layer (torch._grouped_mm) on the bench's weights: the bench checks its
  forward against the JAX layer before timing and fails the row on a mismatch."""
  pytest.importorskip("torch")
  out = _run("moe_layer.py", "--backends=torch", "--iters=1", "--scale=256", "--isolate=no")
  rows = [l for l in out.splitlines() if l.startswith(("| mixtral |", "| deepseek |"))]
  assert len(rows) == 2 and all("error" not in r for r in rows), out
  for r in rows:
    cells = [c.strip() for c in r.strip("|").split("|")]
    assert cells[1] == "torch" and float(cells[2]) > 0 and float(cells[4]) > 0, out
    assert "rel err vs the JAX layer" in cells[-1], out


def test_moe_layer_bench_kernel_names():
  """Kernels named in --backends are checked through modeling.gmm's registry, which the kernels
  package fills: custom:mgpu:mgpu runs anywhere (as ragged_dot off Hopper, said in the note),
  an unknown kernel is a usage error."""
  out = _run("moe_layer.py", "--proxies=mixtral", "--backends=custom:mgpu:mgpu", "--iters=1",
             "--scale=512", "--isolate=no")
  rows = [l for l in out.splitlines() if l.startswith("| mixtral |")]
  assert len(rows) == 1 and "error" not in rows[0], out
  if "mgpu" not in out.split("kernels=")[1].split("]")[0]:
    assert "mgpu unavailable here: runs as ragged_dot" in rows[0], out
  bad = subprocess.run([sys.executable, os.path.join("bench", "moe_layer.py"),
                        "--backends=custom:nope"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
  assert bad.returncode != 0 and "unknown gmm kernel 'nope'" in bad.stderr + bad.stdout, bad


def test_step_mfu_bench():
  """One train step on one device, timed, with the planner's compute term beside it: the MFU it
  prints is flops_per_step over the measured time (CPU here: a tiny model, a tiny MFU)."""
  out = _run("step_mfu.py", "--model=tiny", "--steps=2", "--warmup=1")
  step = float(re.search(r"step_s (\S+)", out).group(1))
  flops = float(re.search(r"model flops/step (\S+)", out).group(1))
  mfu = float(re.search(r"mfu (\S+) of h100", out).group(1))
  assert step > 0 and flops > 0, out
  np.testing.assert_allclose(mfu, flops / (step * 989.4e12), rtol=0.01)


@pytest.mark.parametrize("flags,message", [
    (("--set=foo=1", "ep@expert:8/M=1/block"), "error: --set=foo=1: want FIELD=INTEGER"),
    (("ep@expert:8/M=1/block", "ep/expert"), "error: candidate 'ep/expert': want STRATEGY@"),
    (("ep@expert:16/M=1/block",), "error: ep@expert:16/M=1/block is not among the planner's")])
def test_plan_memory_bad_input_is_one_line_before_any_compile(flags, message):
  """bench/plan_memory.py checks every flag and candidate before it compiles the first one."""
  out = _process("plan_memory.py", "--devices=8", *flags)
  assert out.returncode == 2 and out.stderr.startswith(message), (out.returncode, out.stderr)
  assert len(out.stderr.strip().splitlines()) == 1 and "| candidate" not in out.stdout, out


def test_buffers_bench_sets_cpu_beside_tpu():
  """bench/buffers.py on mixtral-test for 8 v5p chips: both compilers' temp and peak lines, and
  the grouped table: --top=5 groups, then the rest."""
  pytest.importorskip("libtpu", reason="libtpu absent: pip install -r requirements-tpu.txt")
  out = _run("buffers.py", "--target=tpu-v5p", "--strategy=ep", "--model=mixtral-test",
             "--layers=2", "--devices=8", "--mesh=fsdp:2,expert:4", "--top=5")
  assert re.search(r"XLA:CPU: temp \d+\.\d\d GiB, peak span", out), out
  assert re.search(r"XLA:TPU: temp \d+\.\d\d GiB, peak span", out), out
  rows = [l for l in out.splitlines() if l.startswith("| ") and "GiB |" not in l]
  assert len(rows) == 6 and rows[-1].startswith("| the rest |"), out


def test_period_scan_bench():
  """The toy stack's three rows on XLA:CPU, each with its temp over the params."""
  out = _run("period_scan.py", "--layers=8", "--period=2")
  for row in ("one kind", "outside", "inside"):
    assert re.search(rf"^\| {row} \| [\d.]+ MiB \| [\d.]+ \|$", out, re.M), out
