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


def test_cp_ring_row_beside_its_allgather():
  """A comparison entry with its own options is a row of its own: cp's two K/V exchanges side
  by side (compile only), the all-gather's K/V in all-gathers, the ring's in
  collective-permutes, each equal to its own cost model."""
  rows = compare.main(get_config("tiny"), names=["cp", "cp:kv_exchange=ring"], mesh_spec=None,
                      steps=0, report_dir=None, compile_only=True, model_name="tiny")
  by = {r["strategy"]: r for r in rows}
  assert list(by) == ["cp", "cp:kv_exchange=ring"]
  permutes = {n: r["collectives"]["collective-permute"]["count"] for n, r in by.items()}
  gathers = {n: r["collectives"]["all-gather"]["count"] for n, r in by.items()}
  assert permutes["cp"] == 0 and gathers["cp"] > 0
  # the ring gathers only the keys' positions, once (int32 [b, S]): its K/V travel in permutes
  assert permutes["cp:kv_exchange=ring"] > 0 and gathers["cp:kv_exchange=ring"] == 1
  for r in rows:
    pred = sum(r["predicted"].values())
    meas = sum(v["bytes"] for v in r["collectives"].values())
    assert abs(meas / pred - 1) < 0.01, r["strategy"]
    # compiled as a training loop runs it: the params and optimizer state are donated, their
    # updated values written into the same buffers (runtime/train.py), so XLA's temp is the
    # scratch beside one copy of the state
    state = r["param_bytes"] + r["opt_bytes"]
    assert abs(r["memory"]["alias_bytes"] / state - 1) < 0.01, (r["memory"], state)


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


def test_full_parity_checks_grads_and_params_and_writes_table_md(tmp_path):
  rows = compare.main(get_config("tiny", adam_eps=1e-5), names=["ep"], mesh_spec=None, steps=2,
                      report_dir=str(tmp_path), compile_only=False, model_name="tiny",
                      full_parity=True)
  ep = rows[1]
  assert (ep["parity"], ep["parity_checked"], ep["disagreements"]) == (
      "PASS", "losses, grads, params", [])
  assert ep["settings"]["parity"] == "losses, grads, params"
  assert ep["wire_bytes"] > 0 and ep["predicted_wire_bytes"] > 0
  md = (tmp_path / "table.md").read_text()
  assert "| strategy" in md and "PASS (losses, grads, params)" in md and "\nverdict: " in md
  assert "jax " in md and "seed 0" in md and "capacity factor dropless" in md
  stored = json.loads((tmp_path / "table.json").read_text())[1]
  assert stored["settings"]["capacity_factor"] == 0.0 and "trace" not in stored
  assert "params0" not in stored
  # the float32 rule, stated in the header; the worst errors and their leaves, as measured
  from measure import agreement
  rule = agreement.rule(get_config("tiny"))
  assert stored["settings"]["parity_rule"] == rule and rule in md
  assert stored["settings"]["expert_choice"] == "router"
  assert 0 < stored["grad_max_abs"] <= 1e-4 and stored["grad_rel_l2"] <= 1e-4
  assert stored["param_max_abs"] <= agreement.PARAM_ATOL and stored["update_rel_l2"] <= 1e-2
  assert stored["grad_max_abs_leaf"].startswith("step ") and "[" in stored["grad_max_abs_leaf"]
  header = (tmp_path / "table.csv").read_text().splitlines()[0].split(",")
  assert {"wire_bytes", "all-to-all_wire_bytes", "seed", "jax", "grad_rel_l2", "grad_rel_l2_leaf",
          "param_max_abs", "update_rel_l2"} <= set(header)


def test_interleaved_row_reads_its_round_robin_stack_back_for_full_parity():
  """pp's interleaved entry stores its MoE rows round-robin over the stages (pp.stored_config):
  its row shows the interleaved bubble, and --full_parity holds its gradients and parameters,
  read back in depth order, to the reference's (compared in stored order they would differ)."""
  cfg = get_config("tiny", n_layers=4, batch=16, microbatches=4, adam_eps=1e-5)
  rows = compare.main(cfg, names=["pp:schedule=interleaved:virtual_stages=2"],
                      mesh_spec="stage:2,expert:4", steps=2, report_dir=None, compile_only=False,
                      model_name="tiny", full_parity=True)
  row = rows[1]
  assert (row["parity"], row["disagreements"]) == ("PASS", []), row.get("disagreements")
  assert "bubble 0.11" in row["mesh"] and row["layer_rows"] == [0, 2, 1, 3]


def test_disagreements_name_a_wrong_gradient():
  """The check --full_parity runs fails on one gradient leaf off by a factor (an axis summed
  twice), and names it."""
  import numpy as np

  from measure import agreement
  rec = {"loss": 1.0, "aux_loss": 0.1, "ce_loss": 0.9, "grad_norm": 2.0, "dropped": 0.0,
         "grads": {"a": np.ones(3), "b": np.ones(2)}, "params": {"a": np.zeros(3), "b": np.ones(2)}}
  assert agreement.disagreements([rec], [rec]) == []
  bad = {**rec, "grads": {"a": np.ones(3), "b": 2 * np.ones(2)}}
  assert agreement.disagreements([bad], [rec]) == ["step 0 grads ['b']: max |diff| 1.0e+00"]


def _row(name, params, temp, wire, fits=None):
  r = {"strategy": name, "mesh": "m", "param_bytes": params, "opt_bytes": 0,
       "memory": {"temp_bytes": temp}, "wire_bytes": wire, "collectives": {}}
  if fits is not None:
    r["total_bytes"], r["fits"] = params + temp, fits
  return r


def test_verdict():
  cfg = get_config("tiny")
  rows = [_row("a", 2**30, 2**30, 5 * 2**30, True), _row("b", 2**29, 2**29, 2**30, True),
          _row("c", 9 * 2**30, 0, 2**20, False)]
  assert report.verdict(rows, 3, cfg) == (
      "verdict: fit in 3 GiB: a, b; of those b on m sends the fewest wire bytes (1.0G/step/device);"
      " least memory: b on m (1.0G/device, params + optimizer + XLA temp)")
  none = [_row("a", 2**30, 8 * 2**30, 1, False), _row("c", 8 * 2**30, 0, 2**20, False)]
  line = report.verdict(none, 3, cfg)
  assert line.startswith("verdict: nothing fits in 3 GiB; closest: c on m at 8.0G, dominated by "
                         "params + optimizer state (8.0G); try --mesh=search"), line
  temp = report.verdict([_row("a", 2**30, 8 * 2**30, 1, False)], 3, cfg)
  assert "dominated by XLA temp (8.0G" in temp and "--remat=block, --dtype=bfloat16" in temp
  searched = report.verdict([_row("a", 2**30, 8 * 2**30, 1, False)], 3, cfg, searched=True)
  assert "--mesh=search" not in searched and "--remat=block" in searched


def test_mesh_at_scale_grows_the_axis_the_preset_capped():
  """tp's COMPARE_MESH data:4,tensor:2 is capped by tiny's 2 KV heads; at 64 devices Mixtral
  (8 KV heads) takes tensor:8, not data:32,tensor:2. On 8 devices the table keeps tensor:2."""
  from layout import mesh as mesh_lib
  import strategies
  tp, ep_tp = strategies.get("tp"), strategies.get("ep_tp")
  mix = get_config("mixtral-8x7b", n_layers=2)
  assert compare.default_spec(tp, 64, mix, tp.Options()) == "data:8,tensor:8"
  assert compare.default_spec(ep_tp, 64, mix, ep_tp.Options()) == "data:8,expert:8"
  assert compare.default_spec(tp, 8, get_config("tiny"), tp.Options()) == "data:4,tensor:2"
  assert compare.default_spec(tp, 64, get_config("tiny"), tp.Options()) == "data:32,tensor:2"
  assert mesh_lib.order_note(tp, "tensor:2,data:4").startswith(
      "mesh axes are laid out in tp's order (data, tensor), not as given (tensor, data)")
  assert mesh_lib.order_note(tp, "data:4,tensor:2") is None
