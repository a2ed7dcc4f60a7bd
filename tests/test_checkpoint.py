"""Checkpoints restore into any strategy: train 3 steps under ep, save, restore under
shard_exp_on_fsdp and fsdp, train 2 more: the losses are the uninterrupted 5-step reference's.
Bad checkpoints fail with one-line errors; an unfinished save is never offered."""
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from layout import mesh as mesh_lib
from modeling import config
from runtime import checkpoint, train
import strategies
from tests import parity
from tests.conftest import one_error_line, subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg_for(optimizer: str):
  return parity.parity_config(config.get_config("tiny", optimizer=optimizer))


def _job(name, spec, cfg, directory=None, step=None):
  strat = strategies.get(name)
  mesh = mesh_lib.for_strategy(strat, spec)
  state = checkpoint.restore(directory, step, cfg, strat, mesh) if directory else None
  return train.build(strat, cfg, mesh, state=state)


def _host(tree):
  return jax.tree.map(train.to_host, tree)


@pytest.fixture(scope="module", params=["adamw", "muon"])
def saved(request, tmp_path_factory):
  """ep (data:2,expert:4), 3 steps, saved -> (cfg, dir, losses, the saved state as numpy)."""
  cfg = cfg_for(request.param)
  d = str(tmp_path_factory.mktemp(f"ckpt_{request.param}"))
  job = _job("ep", "data:2,expert:4", cfg)
  run = list(train.steps(job, 3))
  _, params, opt_state, _, _ = run[-1]
  saver = checkpoint.Saver(d, cfg, strategy="ep")
  saver.save(3, params, opt_state)
  saver.close()
  return cfg, d, [float(r[3]["loss"]) for r in run], _host({"params": params, "opt_state": opt_state})


@pytest.mark.parametrize("name,spec", [("shard_exp_on_fsdp", "fsdp:2,expert:4"), ("fsdp", "fsdp:8")])
def test_restore_into_another_strategy_continues_the_reference(saved, name, spec):
  cfg, d, first, state = saved
  if cfg.optimizer == "muon" and name == "fsdp":
    pytest.skip("muon: one target (shard_exp_on_fsdp) keeps the suite fast")
  assert checkpoint.check(d, "latest", cfg) == 3
  job = _job(name, spec, cfg, d, 3)
  restored = _host({"params": job.params, "opt_state": job.opt_state})
  jax.tree.map(np.testing.assert_array_equal, restored, state)          # bit-exact round trip
  assert job.params["layers"]["moe"]["bias"].sharding.mesh.shape == job.mesh.shape
  rest = [float(m["loss"]) for _, _, _, m, _ in train.steps(job, 2, start=3)]
  want = [float(r["loss"]) for r in parity.reference(cfg, 5)]
  np.testing.assert_allclose(first + rest, want, rtol=1e-5, atol=0)


def test_bad_checkpoints_one_line_errors(saved, tmp_path):
  cfg, d, _, _ = saved
  other = "muon" if cfg.optimizer == "adamw" else "adamw"
  with pytest.raises(checkpoint.CheckpointError, match=f"holds {cfg.optimizer} state: restore it "
                     f"with --optimizer={cfg.optimizer}, not {other}"):
    checkpoint.check(d, "latest", cfg.replace(optimizer=other))
  with pytest.raises(checkpoint.CheckpointError, match="from another model config: n_layers=2 there, 1 here"):
    checkpoint.check(d, "latest", cfg.replace(n_layers=1))
  with pytest.raises(checkpoint.CheckpointError, match=r"step 7 is not in .* \(complete steps: 3\)"):
    checkpoint.check(d, 7, cfg)
  with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint in"):
    checkpoint.check(str(tmp_path), "latest", cfg)
  bad = str(tmp_path / "bad_meta")
  shutil.copytree(d, bad)
  with open(os.path.join(bad, "3", "meta", "metadata"), "w") as f:
    f.write('{"format": 1, "st')                                    # a truncated JSON file
  with pytest.raises(checkpoint.CheckpointError, match="step 3 is unreadable"):
    checkpoint.check(bad, "latest", cfg)
  with open(os.path.join(bad, "3", "meta", "metadata"), "w") as f:
    f.write('{"format": 1, "step": 3}')                             # valid JSON, not ours
  with pytest.raises(checkpoint.CheckpointError, match="step 3 is unreadable: bad meta"):
    checkpoint.check(bad, "latest", cfg)


def _corrupt_copy(src, dst):
  shutil.copytree(src, dst)
  n = 0
  for root, _, files in os.walk(os.path.join(dst, "3", "state")):
    for f in files:
      if "ocdbt" in root or root.endswith(os.sep + "d"):            # the array data files
        p = os.path.join(root, f)
        with open(p, "r+b") as fh:
          fh.truncate(os.path.getsize(p) // 2)
        n += 1
  assert n, "no array data file found to corrupt"


def test_corrupt_checkpoint_fails_on_restore(saved, tmp_path):
  cfg, d, _, _ = saved
  bad = str(tmp_path / "bad")
  _corrupt_copy(d, bad)
  with pytest.raises(checkpoint.CheckpointError, match="cannot be restored|is unreadable"):
    checkpoint.restore(bad, checkpoint.check(bad, "latest", cfg), cfg,
                       strategies.get("fsdp"), mesh_lib.for_strategy(strategies.get("fsdp"), None))


def test_unfinished_save_is_not_offered(saved, tmp_path):
  # orbax writes <step>.orbax-checkpoint-tmp-<t> and renames it when every process is done: a
  # save killed before that leaves only the tmp directory, which is not a step
  cfg, d, _, _ = saved
  dd = str(tmp_path / "ck")
  shutil.copytree(d, dd)
  shutil.copytree(os.path.join(dd, "3"), os.path.join(dd, "5.orbax-checkpoint-tmp-1234567"))
  # a step directory without orbax's finalize metadata (possible only outside orbax's rename)
  shutil.copytree(os.path.join(dd, "3"), os.path.join(dd, "6"))
  os.remove(os.path.join(dd, "6", "_CHECKPOINT_METADATA"))
  assert checkpoint.steps(dd) == [3]
  assert checkpoint.check(dd, "latest", cfg) == 3
  with pytest.raises(checkpoint.CheckpointError, match=r"step 5 is not in .*complete steps: 3"):
    checkpoint.check(dd, 5, cfg)


def _run(*args):
  env = subprocess_env()
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env,
                        capture_output=True,
                        text=True, timeout=120)


def test_run_py_bad_restore_exits_2_with_one_line(saved, tmp_path):
  cfg, d, _, _ = saved
  if cfg.optimizer != "adamw":
    pytest.skip("once is enough")
  bad = str(tmp_path / "bad")
  _corrupt_copy(d, bad)
  for args, message in [
      ([f"--checkpoint_dir={d}", "--layers=1"], "is from another model config: n_layers=2 there, 1 here"),
      ([f"--checkpoint_dir={bad}"], "cannot be restored"),
      ([f"--checkpoint_dir={d}", "--restore=4"], "step 4 is not in")]:
    restore = [] if any(a.startswith("--restore=") for a in args) else ["--restore=latest"]
    r = _run("--strategy=fsdp", "--mesh=fsdp:8", "--steps=1", *restore, *args)
    line = one_error_line(r.returncode, r.stderr)
    assert message in line, line
    assert "compiled" not in r.stdout                                 # failed before compiling


_KILLED_SAVE = """
import os, pathlib, sys
import jax.numpy as jnp
from runtime import checkpoint
from modeling import config
cfg, d = config.get_config("tiny"), sys.argv[1]
s = checkpoint.Saver(d, cfg)
s.save(1, {"w": jnp.ones((4, 4))}, {"m": jnp.zeros(4)})
s.close()
rename = os.rename
def killed(a, b, *args, **kw):               # SIGKILL-like exit between writing and finalising
  if "tmp" in str(a):
    os._exit(9)
  return rename(a, b, *args, **kw)
os.rename = killed
pathlib.Path.rename = lambda self, t: killed(str(self), str(t))
s = checkpoint.Saver(d, cfg)
s.save(2, {"w": 2 * jnp.ones((4, 4))}, {"m": jnp.ones(4)})
s.close()
"""


def test_save_killed_before_finalize_is_not_offered(tmp_path):
  d = str(tmp_path / "ck")
  env = subprocess_env()
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  r = subprocess.run([sys.executable, "-c", _KILLED_SAVE, d], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 9, r.stderr[-2000:]                 # died inside save 2
  assert any(n.startswith("2.") for n in os.listdir(d)), os.listdir(d)   # its data was written
  assert checkpoint.steps(d) == [1]
  assert checkpoint.check(d, "latest", config.get_config("tiny")) == 1


def test_a_save_orbax_would_skip_is_an_error(tmp_path):
  """orbax skips a step at or below the newest in the directory, and says nothing: the Saver
  refuses it instead, and reports each step it did save."""
  import jax.numpy as jnp
  d, said = str(tmp_path / "ck"), []
  cfg = config.get_config("tiny")
  s = checkpoint.Saver(d, cfg, say=lambda line, **_: said.append(line))
  s.save(3, {"w": jnp.ones(2)}, {"m": jnp.zeros(2)})
  with pytest.raises(checkpoint.CheckpointError, match=r"^save of step 2 to .* would be skipped: "
                     r"the directory already holds step 3$"):
    s.save(2, {"w": jnp.ones(2)}, {"m": jnp.zeros(2)})
  with pytest.raises(checkpoint.CheckpointError, match="would be skipped"):
    s.save(3, {"w": jnp.ones(2)}, {"m": jnp.zeros(2)})
  s.close()
  assert said == [f"saved step 3 to {d}"] and checkpoint.steps(d) == [3]
  assert checkpoint.planned_saves(0, 5, 2) == [2, 4, 5]
  assert checkpoint.planned_saves(3, 2, 0) == [5]
