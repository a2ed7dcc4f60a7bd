"""The comparison (`python run.py`): rows, parity verdicts, cost-model ratio, report files."""
import json
import os

import compare
from modeling.config import get_config
import report


def test_compare_dp_and_tp_writes_report(tmp_path):
  rows = compare.main(get_config("tiny"), names=["dp", "tp"], mesh_spec=None, steps=2,
                      report_dir=str(tmp_path), compile_only=False, model_name="tiny")
  by = {r["strategy"]: r for r in rows}
  assert list(by) == ["reference", "dp", "tp"]                  # the reference is always run
  assert by["tp"]["mesh"] == "data:4,tensor:2"                  # tp's COMPARE_MESH
  for name in ("dp", "tp"):
    assert by[name]["parity"] == "PASS", by[name]
    pred = sum(by[name]["predicted"].values())
    meas = sum(v["bytes"] for v in by[name]["collectives"].values())
    assert abs(meas / pred - 1) < 0.1
  assert by["dp"]["collectives"]["all-reduce"]["count"] >= 1
  for f in ("table.json", "table.csv", "loss.png", "bytes.png"):
    assert os.path.getsize(tmp_path / f) > 0
  assert json.loads((tmp_path / "table.json").read_text())[1]["strategy"] == "dp"


def test_fit_column():
  """--hbm_gb: total/dev = params + optimizer + XLA temp; fits iff <= hbm_gb GiB."""
  row = {"strategy": "dp", "mesh": "data:8", "param_bytes": 2**30, "opt_bytes": 2 * 2**30,
         "memory": {"temp_bytes": 2**30}, "collectives": {}}
  compare.fit(row, 4)
  assert row["total_bytes"] == 4 * 2**30 and row["fits"]
  compare.fit(row, 3.99)
  assert not row["fits"]
  table = report.render([row], compile_only=True, simulated=True, hbm_gb=3.99)
  assert "| total/dev | fits 3.99G |" in table and "| 4.0G      | NO         |" in table
