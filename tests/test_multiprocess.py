"""run.py across 2 local processes x 4 CPU devices (jax.distributed, gloo collectives): the same
losses as one process x 8 devices and as the single-device reference; checkpoints saved by 2
processes equal one process's, and 2 processes restore one process's checkpoint."""
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from layout import mesh as mesh_lib
from modeling import config
from runtime import checkpoint, train
import strategies
from tests import parity
from tests.conftest import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240
# 2 processes sum over gloo in another order than 1 process: with Adam's eps 1e-8 such noise
# moves an update by ~1e-5 (tests/parity.py, PARITY_ADAM_EPS); every run here uses the parity eps
EPS = parity.PARITY_ADAM_EPS
CFG = config.get_config("tiny", adam_eps=EPS)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(n: int, *args, timeout: float = TIMEOUT_S) -> list[subprocess.CompletedProcess]:
  """run.py in n processes on 127.0.0.1; every child is killed on failure or timeout."""
  env = subprocess_env()
  env["JAX_PLATFORMS"] = "cpu"
  addr = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen([sys.executable, "run.py", *args, f"--devices={8 // n}",
                             f"--adam_eps={EPS}",
                             "--compilation_cache=", f"--coordinator_address={addr}",
                             f"--num_processes={n}", f"--process_id={i}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True) for i in range(n)]
  deadline = time.monotonic() + timeout
  out = []
  try:
    for p in procs:
      o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
      out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  for r in out:
    assert r.returncode == 0, r.stderr[-3000:]
  return out


def losses(path) -> list[float]:
  return [json.loads(l)["loss"] for l in open(path).read().splitlines() if "summary" not in l]


@functools.lru_cache(maxsize=None)
def in_process(name: str, mesh_spec: str | None, steps: int) -> list[float]:
  """The same run in this process (8 devices): what `run.py --strategy=name` computes."""
  strat = strategies.get(name)
  job = train.build(strat, CFG, mesh_lib.for_strategy(strat, mesh_spec))
  return [float(m["loss"]) for _, _, _, m, _ in train.steps(job, steps)]


def assert_losses(got, want):
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


def _restored(d, name, spec, step=3):
  cfg = CFG
  strat = strategies.get(name)
  mesh = mesh_lib.for_strategy(strat, spec)
  job = train.build(strat, cfg, mesh, state=checkpoint.restore(d, step, cfg, strat, mesh))
  return job, jax.tree.map(train.to_host, {"params": job.params, "opt_state": job.opt_state})


@pytest.fixture(scope="module")
def one_process_ckpt(tmp_path_factory):
  """ep (data:2,expert:4) in this process, 3 steps, saved: what run.py saves on one process."""
  d = str(tmp_path_factory.mktemp("ckpt1"))
  strat = strategies.get("ep")
  cfg = CFG
  job = train.build(strat, cfg, mesh_lib.for_strategy(strat, "data:2,expert:4"))
  saver = checkpoint.Saver(d, cfg)
  for _, params, opt_state, _, _ in train.steps(job, 3):
    pass
  saver.save(3, params, opt_state)
  saver.close()
  return d


def test_ep_two_processes_match_one_process_and_reference(tmp_path, one_process_ckpt):
  m, d = tmp_path / "m.jsonl", str(tmp_path / "ck")
  r = launch(2, "--strategy=ep", "--mesh=data:2,expert:4", "--steps=3", f"--metrics_file={m}",
             f"--checkpoint_dir={d}")
  got = losses(m)
  assert len(got) == 3
  assert_losses(got, in_process("ep", "data:2,expert:4", 3))
  assert_losses(got, in_process("reference", None, 3))
  assert "[   3/3] loss" in r[0].stdout and "loss" not in r[1].stdout   # process 0 reports
  # the 2-process checkpoint holds what one process saves, to the suite's post-step parameter
  # tolerance (at the parity eps, see EPS)
  assert checkpoint.steps(d) == [3]
  two = _restored(d, "ep", "data:2,expert:4")[1]
  one = _restored(one_process_ckpt, "ep", "data:2,expert:4")[1]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=parity.PARAM_ATOL),
               two, one)


def test_fsdp_two_processes_restore_and_match_one_process_and_reference(tmp_path, one_process_ckpt):
  # 2 processes restore the 1-process ep checkpoint into fsdp, train 2 more steps, save each
  d, m = str(tmp_path / "ck"), tmp_path / "m.jsonl"
  shutil.copytree(one_process_ckpt, d)
  launch(2, "--strategy=fsdp", "--mesh=data:2,fsdp:4", "--steps=2", f"--metrics_file={m}",
         f"--checkpoint_dir={d}", "--restore=latest", "--save_every=1")
  got = losses(m)
  assert [json.loads(l)["step"] for l in open(m).read().splitlines()[:2]] == [3, 4]
  job, _ = _restored(one_process_ckpt, "fsdp", "data:2,fsdp:4")
  assert_losses(got, [float(x[3]["loss"]) for x in train.steps(job, 2, start=3)])
  assert_losses(got, in_process("reference", None, 5)[3:])
  assert checkpoint.steps(d) == [3, 4, 5]


def test_settings_from_flags_and_environment(monkeypatch):
  from runtime import distributed
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setattr(distributed, "_cluster_detected", lambda: False)
  assert distributed.settings(None, None, None) is None
  want = {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}
  assert distributed.settings("10.0.0.1:1234", 2, 1) == want
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  assert distributed.settings(None, None, None) == want
  with pytest.raises(config.ConfigError, match="expected host:port"):
    distributed.settings("10.0.0.1", 2, 1)


def test_sigterm_to_one_process_stops_both_at_one_saved_step(tmp_path):
  """A preemption notice reaches one process: JAX's preemption sync point stops both after the
  same step, and the step they save together restores."""
  d, m = str(tmp_path / "ck"), tmp_path / "m.jsonl"
  env = subprocess_env()
  env["JAX_PLATFORMS"] = "cpu"
  addr = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen([sys.executable, "run.py", "--strategy=dp", "--mesh=data:8",
                             "--devices=4", "--steps=3000", "--save_every=1000",
                             f"--checkpoint_dir={d}", f"--metrics_file={m}", "--compilation_cache=",
                             f"--coordinator_address={addr}", "--num_processes=2",
                             f"--process_id={i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
           for i in range(2)]
  try:
    deadline = time.monotonic() + TIMEOUT_S
    while not (m.exists() and len(m.read_text().splitlines()) >= 5):
      assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
      time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    out = [p.communicate(timeout=TIMEOUT_S) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in out]
  (n,) = checkpoint.steps(d)
  assert 5 <= n < 1000
  assert f"stopped by SIGTERM after step {n}: saved step {n} to {d}" in out[0][0], out[0][0]
  assert json.loads(m.read_text().splitlines()[-1])["steps_done"] == n
  _restored(d, "dp", "data:8", step=n)
