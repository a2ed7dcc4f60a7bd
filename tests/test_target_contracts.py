"""Each strategy's contract on the target compilers' programs: its first test row (a tiny model,
f32) compiled on this host for 8 TPU v5p chips by XLA:TPU, and for 8 H100s by XLA:GPU, through
`bench/target_contracts.py`; every compiled (kind, mesh axes, bytes) equals the cost model's, whose
(kind, axes) set is the docstring's contract, in measure.compilers' normal form (a reduce-scatter
counted as the all-reduce XLA:TPU may issue in its place, all-reduces merged over A+B found and
named). The same rows on XLA:CPU are tests/test_strategies.py's. XLA:GPU compiles a step in about
30 s here, so its rows are the two that show what it does differently from XLA:TPU (fsdp's
reduce-scatters, which it keeps, and cp's merged all-reduces); `python bench/target_contracts.py
--target=h100` runs them all. XLA:TPU also compiles each strategy's TARGET_CASES, rows XLA:CPU
cannot compile (ep's ragged exchange)."""
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
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  return {r["row"].split()[0] if r["kind"] == "first" else r["row"]: r for r in rows}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
  """target -> {strategy: its row}, each target's rows compiled once, in one subprocess."""
  rows = {}

  def get(target: str) -> dict:
    if target not in rows:
      names = NAMES if target == "tpu-v5p" else GPU_NAMES
      rows[target] = _rows(target, names, tmp_path_factory.mktemp(target))
    return rows[target]
  return get


def _on(target: str, *rows):
  """Rows for `target`, skipped without its package; ids target-strategy[-field]."""
  mark = needs_libtpu if target == "tpu-v5p" else needs_cuda_plugin
  return [pytest.param(target, *r, marks=mark, id="-".join([target, *map(str, r[:2])]))
          for r in rows]


TARGET_ROWS = [c.label(n) for n in NAMES for c in getattr(strategies.get(n), "TARGET_CASES", ())]


@pytest.mark.parametrize("target,name", _on("tpu-v5p", *[(n,) for n in NAMES + TARGET_ROWS])
                         + _on("h100", *[(n,) for n in GPU_NAMES]))
def test_contract_on_target(compiled, target, name):
  row = compiled(target)[name]
  assert row["model_is_contract"] and not row["off"], row


@pytest.mark.parametrize("target,name", _on("tpu-v5p", *[(n,) for n in NAMES + TARGET_ROWS])
                         + _on("h100", *[(n,) for n in GPU_NAMES]))
def test_collectives_issued_as_the_planner_counts(compiled, target, name):
  """The collectives a step issues, as the planner counts them for its latency term
  (planning.plan.term_calls, merged as planning.clusters.MERGES says this compiler merges),
  within 2x of the target program's: XLA:TPU keeps the weights' all-gathers apart and issues
  fsdp's reduce-scatters as all-reduces (1.7x on fsdp's row), XLA:GPU merges them."""
  model, compiled_calls = compiled(target)[name]["calls"]
  assert 0.5 <= model / compiled_calls <= 2, (model, compiled_calls)


# The normal form is needed, and what it forgives is named: on the 2x2x2 v5p slice fsdp's
# reduce-scatters over all 8 chips become all-reduces (XLA:GPU keeps them), and cp's sums over
# context and then data (the norm scales' gradients and the CE sum: 1,284 bytes) become one
# all-reduce on both targets.
@pytest.mark.parametrize("target,name,field,want", _on(
    "tpu-v5p", ("fsdp", "rs_as_all_reduce", ["fsdp"]), ("fsdp", "rs_kept", []),
    ("cp", "merged", [["context", "data", 1284.0]]), ("pp", "rs_kept", ["stage"]))
    + _on("h100", ("fsdp", "rs_kept", ["fsdp"]), ("fsdp", "rs_as_all_reduce", []),
          ("cp", "merged", [["context", "data", 1284.0]])))
def test_rewrites_are_seen(compiled, target, name, field, want):
  assert compiled(target)[name][field] == want, compiled(target)[name]
