"""--full_parity in bfloat16 (measure/agreement.py, the bfloat16 rule): both sides choose experts
by token position (modeling/routing.py, "expert choice"), so the same assignments are dropped at
the requested capacity and every gradient and update is held to the reference's; the check
fails a run that is off."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from measure import agreement
from modeling import routing
from modeling.config import get_config
from tests.conftest import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BF16 = get_config("deepseek-test", dtype="bfloat16")
RULE_CFG = agreement.parity_config(_BF16.replace(adam_eps=agreement.parity_eps(_BF16)))


def _lowbias32(x: np.ndarray) -> np.ndarray:
  """The hash, written again in numpy (uint32 wraps the same way)."""
  x = x.astype(np.uint32)
  x ^= x >> np.uint32(16)
  x *= np.uint32(0x7FEB352D)
  x ^= x >> np.uint32(15)
  x *= np.uint32(0x846CA68B)
  x ^= x >> np.uint32(16)
  return x


def test_position_scores_are_a_hash_of_position_and_expert():
  """position_scores(p)[e] = lowbias32(p * E + e) >> 8, / 2^24: exact, in [0, 1), and a token
  keeps its scores wherever it sits (cp's reordered positions, ep_tp's sequence shards)."""
  e = 16
  pos = np.array([[0, 1, 2, 31], [31, 2, 1, 0]], np.int32)                # [B=2, S=4]
  got = np.asarray(routing.position_scores(jnp.asarray(pos), e))          # [2, 4, E]
  want = (_lowbias32(pos[..., None].astype(np.uint32) * e + np.arange(e, dtype=np.uint32))
          >> np.uint32(8)).astype(np.float64) / 2**24
  np.testing.assert_array_equal(got, want)
  assert got.min() >= 0 and got.max() < 1
  np.testing.assert_array_equal(got[0], got[1, ::-1])                     # the same per position
  # hand-worked: lowbias32(0) = 0, so position 0 scores expert 0 at exactly 0
  assert got[0, 0, 0] == 0.0


def test_position_choice_takes_the_experts_and_keeps_the_router_weights():
  """expert_choice="position": the experts are the top-k (sigmoid: within the kept groups) of
  position_scores; the weights are the router's unbiased scores at them, renormalised."""
  cfg = get_config("deepseek-test", expert_choice="position")   # E 16, K 4, 2 of 4 groups of 4
  t = 32
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((t, cfg.d_model)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((cfg.d_model, cfg.n_experts)) / 8, jnp.float32)
  choice = routing.position_scores(jnp.arange(t), cfg.n_experts)          # [T, E]
  r = routing.route(x, w, jnp.full(cfg.n_experts, 5.0), cfg, choice)      # a bias that would decide
  ids = np.asarray(r.experts)
  c = np.asarray(choice)
  for i in range(t):
    groups = c[i].reshape(4, 4)
    kept = np.argsort(-np.sort(groups, axis=1)[:, -2:].sum(1), kind="stable")[:2]
    allowed = np.concatenate([g * 4 + np.arange(4) for g in kept])
    want = allowed[np.argsort(-c[i, allowed], kind="stable")[:4]]
    assert sorted(ids[i]) == sorted(want), (i, ids[i], want)
  s = 1 / (1 + np.exp(-np.asarray(x @ w, np.float64)))
  picked = np.take_along_axis(s, ids, axis=1)
  np.testing.assert_allclose(np.asarray(r.weights),
                             picked / picked.sum(1, keepdims=True) * cfg.routed_scaling_factor,
                             rtol=1e-5)


# --------------------------------------------------------------------------- the check can fail
def _run_records(rng, noise=0.0, steps=2):
  """A synthetic two-step run: expert-like and norm-like gradient leaves, each the sum of 8
  token-shard partials of the model's gradient size (~1e-3 per element), Adam's first update
  -lr g / (|g| + eps) at BF16_ADAM_EPS, and bf16-sized noise (`noise` x the leaf's RMS)."""
  parts = [{"wi": 1e-3 * rng.standard_normal((steps, 16, 4)),
            "norm": 1e-3 * rng.standard_normal(16)} for _ in range(8)]
  params0 = {"wi": rng.standard_normal((16, 4)) * 0.1, "norm": np.ones(16)}
  recs, params = [], params0
  for i in range(steps):
    g = {"wi": sum(p["wi"][i] for p in parts), "norm": sum(p["norm"] for p in parts) * (i + 1)}
    g = {k: v + noise * np.linalg.norm(v) / np.sqrt(v.size) * rng.standard_normal(v.shape)
         for k, v in g.items()}
    params = {k: params[k] - 3e-3 * g[k] / (np.abs(g[k]) + agreement.BF16_ADAM_EPS) for k in g}
    recs.append({"loss": 6.0 - 0.1 * i, "aux_loss": 0.3, "ce_loss": 5.7 - 0.1 * i,
                 "grad_norm": float(np.sqrt(sum(np.sum(v * v) for v in g.values()))),
                 "dropped": 512.0, "grads": g, "params": params})
  return recs, params0, parts


def test_bf16_rule_fails_a_run_that_is_off():
  """The bfloat16 rule passes bf16-sized noise (1% per element) and fails, naming what is off:
  a gradient leaf missing one of its 8 token shards (an axis not summed), a gradient counted
  twice, a step's update off by 10% on one leaf, a different drop count, a loss off by 1e-3."""
  rng = np.random.default_rng(0)
  want, params0, parts = _run_records(rng)
  noisy, _, _ = _run_records(np.random.default_rng(0), noise=1e-2)
  assert agreement.disagreements_bf16(noisy, want, params0) == []

  def off(**change):
    got = [dict(r, grads=dict(r["grads"]), params=dict(r["params"])) for r in want]
    for step, (what, fn) in change.items():
      fn(got[int(step[1:])], what)
    return agreement.disagreements_bf16(got, want, params0)

  def missing_shard(rec, leaf):                    # step 1 sums 7 of the 8 token shards
    rec["grads"][leaf] = rec["grads"][leaf] - parts[3][leaf][1]
  assert off(s1=("wi", missing_shard)) == [
      "step 1 grads ['wi']: relative L2 3.8e-01 (> 0.05)"]
  twice = lambda rec, leaf: rec["grads"].update({leaf: 2 * rec["grads"][leaf]})
  assert off(s0=("norm", twice)) == ["step 0 grads ['norm']: relative L2 1.0e+00 (> 0.05)"]

  def bad_update(rec, leaf):                       # step 0's update of `leaf` 10% too large
    rec["params"][leaf] = params0[leaf] + 1.1 * (want[0]["params"][leaf] - params0[leaf])
  lines = off(s0=("norm", bad_update))
  assert lines[0] == "step 0 update ['norm']: relative L2 1.0e-01 (> 0.05)", lines
  dropped = lambda rec, _: rec.update(dropped=511.0)
  assert off(s1=(None, dropped)) == ["step 1 dropped: 511.0 vs 512.0"]
  loss = lambda rec, _: rec.update(loss=rec["loss"] * (1 + 1e-3))
  assert off(s0=(None, loss)) == ["step 0 loss: |diff| 6.0e-03 (> 0.0005 relative)"]


def test_worst_names_the_leaf():
  """table.json's worst errors: the largest max |diff| and relative L2 over steps and leaves,
  each with the step and leaf it came from."""
  rng = np.random.default_rng(1)
  want, params0, _ = _run_records(rng)
  got = [dict(r, grads=dict(r["grads"])) for r in want]
  got[1]["grads"]["norm"] = got[1]["grads"]["norm"] * 1.02
  w = agreement.worst(got, want, params0)
  assert w["grad_rel_l2_leaf"] == "step 1 ['norm']" and abs(w["grad_rel_l2"] - 0.02) < 1e-12
  assert w["grad_max_abs_leaf"] == "step 1 ['norm']"
  assert w["param_max_abs"] == 0.0 and w["update_rel_l2"] == 0.0
  assert set(w) == {f"{t}_{m}{leaf}" for t, ms in (("grad", ("max_abs", "rel_l2")),
                                                    ("param", ("max_abs", "rel_l2")),
                                                    ("update", ("rel_l2",)))
                    for m in ms for leaf in ("", "_leaf")}


# --------------------------------------------------------------------------- the command line
def test_cli_bf16_full_parity_passes_with_drops(tmp_path):
  """--compare --full_parity in bf16: ep and ep_tp at capacity factor 0.5 PASS the bfloat16
  rule, with the header stating it; both drop assignments, as many as the reference at every
  step, and table.json holds each row's worst gradient, parameter and update errors with their
  leaves, within the rule's bounds."""
  env = subprocess_env()
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run([sys.executable, "run.py", "--compare=ep,ep_tp", "--full_parity",
                      "--dtype=bfloat16", "--model=deepseek-test", "--capacity_factor=0.5",
                      "--steps=2", f"--report_dir={tmp_path}"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert agreement.rule(RULE_CFG) in r.stdout.replace("\n", " ")
  assert "bfloat16 rule: experts chosen by token position on both sides" in r.stdout
  rows = {row["strategy"]: row for row in json.loads((tmp_path / "table.json").read_text())}
  ref = rows["reference"]
  assert ref["settings"]["parity_rule"] == agreement.rule(RULE_CFG)
  assert ref["settings"]["expert_choice"] == "position"
  assert len(ref["dropped_steps"]) == 2 and min(ref["dropped_steps"]) > 0
  for name in ("ep", "ep_tp"):
    row = rows[name]
    assert (row["parity"], row["parity_checked"], row["disagreements"]) == (
        "PASS", "losses, grads, params", []), row
    assert f"| {name}" in r.stdout and row["dropped_frac"] > 0
    assert row["dropped_steps"] == ref["dropped_steps"]
    assert 0 < row["grad_rel_l2"] <= agreement.BF16_GRAD_RTOL
    assert 0 < row["update_rel_l2"] <= agreement.BF16_GRAD_RTOL
    assert row["grad_max_abs"] > 0 and row["param_max_abs"] > 0 and row["param_rel_l2"] > 0
    for k in ("grad_max_abs", "grad_rel_l2", "param_max_abs", "param_rel_l2", "update_rel_l2"):
      assert row[k + "_leaf"].startswith("step "), (k, row[k + "_leaf"])
    assert f"{name} worst: grads: rel L2" in r.stdout
