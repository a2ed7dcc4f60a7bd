"""Each strategy's contract on the target compilers' programs: its first test row (a tiny model,
f32) compiled on this host for 8 TPU v5p chips by XLA:TPU, and for 8 H100s by XLA:GPU, through
`bench/target_contracts.py`; every compiled (kind, mesh axes, bytes) equals the cost model's, whose
(kind, axes) set is the docstring's contract, in measure.compilers' normal form (a reduce-scatter
counted as the all-reduce XLA:TPU may issue in its place, all-reduces merged over A+B found and
named). The same rows on XLA:CPU are tests/test_strategies.py's. XLA:GPU compiles a step in about
30 s here, so its rows are the two that show what it does differently from XLA:TPU (fsdp's
reduce-scatters, which it keeps, and cp's merged all-reduces); `python bench/target_contracts.py
--target=h100` runs them all."""
import json
import os
import subprocess
import sys

import pytest

import strategies
from tests.conftest import subprocess_env
from tests.test_target import needs_cuda_plugin, needs_libtpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = [n for n in strategies.NAMES if n != "reference"]
GPU_NAMES = ["fsdp", "cp"]


def _rows(target: str, names: list[str], tmp) -> dict:
  out = tmp / f"{target}.jsonl"
  env = subprocess_env()
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run([sys.executable, "bench/target_contracts.py", f"--target={target}",
                      f"--strategy={','.join(names)}", f"--json={out}"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=1200)
  assert out.exists(), r.stdout + r.stderr[-3000:]
  return {json.loads(l)["row"].split()[0]: json.loads(l) for l in out.read_text().splitlines()}


@pytest.fixture(scope="module")
def tpu(tmp_path_factory):
  return _rows("tpu-v5p", NAMES, tmp_path_factory.mktemp("tpu"))


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
  return _rows("h100", GPU_NAMES, tmp_path_factory.mktemp("gpu"))


def _holds(row: dict) -> None:
  assert row["model_is_contract"], row
  assert not row["off"], row


@needs_libtpu
@pytest.mark.parametrize("name", NAMES)
def test_contract_on_xla_tpu(tpu, name):
  _holds(tpu[name])


@needs_libtpu
def test_xla_tpu_rewrites_are_seen(tpu):
  """The normal form is needed, and what it forgives is named: on the 2x2x2 v5p slice fsdp's
  reduce-scatters over all 8 chips become all-reduces, and cp's sums over context and then data
  (the norm scales' gradients and the CE sum: 1,284 bytes) become one all-reduce."""
  assert tpu["fsdp"]["rs_as_all_reduce"] == ["fsdp"] and not tpu["fsdp"]["rs_kept"]
  assert tpu["cp"]["merged"] == [["context", "data", 1284.0]], tpu["cp"]
  assert tpu["pp"]["rs_kept"] == ["stage"], tpu["pp"]


@needs_cuda_plugin
@pytest.mark.parametrize("name", GPU_NAMES)
def test_contract_on_xla_gpu(gpu, name):
  _holds(gpu[name])


@needs_cuda_plugin
def test_xla_gpu_keeps_reduce_scatters(gpu):
  """XLA:GPU has no reduce-scatter decomposer: fsdp's stay reduce-scatters."""
  assert gpu["fsdp"]["rs_kept"] == ["fsdp"] and not gpu["fsdp"]["rs_as_all_reduce"], gpu["fsdp"]
