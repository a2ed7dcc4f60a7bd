"""run.py across 2 local processes x 4 CPU devices (jax.distributed, gloo collectives): the same
losses as one process x 8 devices and as the single-device reference."""
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from common import config, train
from common import mesh as mesh_lib
import strategies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(n: int, *args, timeout: float = TIMEOUT_S) -> list[subprocess.CompletedProcess]:
  """run.py in n processes on 127.0.0.1; every child is killed on failure or timeout."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  addr = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen([sys.executable, "run.py", *args, f"--devices={8 // n}",
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
  job = train.build(strat, config.get_config("tiny"), mesh_lib.for_strategy(strat, mesh_spec))
  return [float(m["loss"]) for _, _, _, m, _ in train.steps(job, steps)]


def assert_losses(got, want):
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


def test_ep_two_processes_match_one_process_and_reference(tmp_path):
  m = tmp_path / "m.jsonl"
  r = launch(2, "--strategy=ep", "--mesh=data:2,expert:4", "--steps=3", f"--metrics_file={m}")
  got = losses(m)
  assert len(got) == 3
  assert_losses(got, in_process("ep", "data:2,expert:4", 3))
  assert_losses(got, in_process("reference", None, 3))
  assert "[   3/3] loss" in r[0].stdout and "loss" not in r[1].stdout   # process 0 reports


def test_fsdp_two_processes_match_one_process_and_reference(tmp_path):
  m = tmp_path / "m.jsonl"
  launch(2, "--strategy=fsdp", "--mesh=data:2,fsdp:4", "--steps=2", f"--metrics_file={m}")
  got = losses(m)
  assert len(got) == 2
  assert_losses(got, in_process("fsdp", "data:2,fsdp:4", 2))
  assert_losses(got, in_process("reference", None, 2))
