"""run.py's durability: metrics that survive a kill, SIGTERM that stops after the step in flight
and saves it, saves reported when committed, a restore that names an unfinished newer save, and
a full disk that is one error line with the committed steps still restorable."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from runtime import checkpoint
from tests.conftest import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--strategy=dp", "--mesh=data:8")


def _popen(*args):
  env = subprocess_env()
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.Popen([sys.executable, "run.py", *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(*args, timeout=300):
  p = _popen(*args)
  out, err = p.communicate(timeout=timeout)
  return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _lines(path) -> list[dict]:
  return [json.loads(l) for l in open(path).read().splitlines()] if os.path.exists(path) else []


def _signal_after(p, metrics, n_steps: int, sig, timeout=240):
  """Send `sig` to p once the metrics file holds n_steps lines."""
  deadline = time.monotonic() + timeout
  while len(_lines(metrics)) < n_steps:
    assert p.poll() is None, p.communicate()
    assert time.monotonic() < deadline, "the run did not reach its steps in time"
    time.sleep(0.05)
  p.send_signal(sig)


def test_kill_9_keeps_the_metrics_of_the_steps_done(tmp_path):
  m = tmp_path / "m.jsonl"
  p = _popen(*TINY, "--steps=3000", f"--metrics_file={m}")
  _signal_after(p, m, 7, signal.SIGKILL)
  p.communicate(timeout=60)
  recs = _lines(m)
  assert len(recs) >= 7 and [r["step"] for r in recs] == list(range(len(recs)))


def test_sigterm_saves_the_step_and_resumes_as_the_uninterrupted_run(tmp_path):
  """SIGTERM near step 20 of 3,000 with --save_every=1000: the run stops after the step in
  flight, saves it, says where and exits 0; --restore=latest resumes it with the losses of the
  run that was never stopped."""
  d, m = str(tmp_path / "ck"), tmp_path / "m.jsonl"
  p = _popen(*TINY, "--steps=3000", "--save_every=1000", f"--checkpoint_dir={d}",
             f"--metrics_file={m}")
  _signal_after(p, m, 20, signal.SIGTERM)
  out, err = p.communicate(timeout=120)
  assert p.returncode == 0, err
  (n,) = checkpoint.steps(d)
  assert 2 <= n <= 999
  assert f"saved step {n} to {d}" in out and \
      f"stopped by SIGTERM after step {n}: saved step {n} to {d}" in out, out
  summary = _lines(m)[-1]
  assert summary["summary"] and summary["stopped_by"] == "SIGTERM" and summary["steps_done"] == n

  resumed = tmp_path / "r.jsonl"
  r = _run(*TINY, "--steps=3", f"--checkpoint_dir={d}", "--restore=latest",
           f"--metrics_file={resumed}")
  assert r.returncode == 0, r.stderr
  assert f"restoring step {n}, the newest committed step of {d}" in r.stdout
  whole = tmp_path / "w.jsonl"
  r = _run(*TINY, f"--steps={n + 3}", f"--metrics_file={whole}")
  assert r.returncode == 0, r.stderr
  after = [x["loss"] for x in _lines(resumed)[:-1]]
  want = [x["loss"] for x in _lines(whole)[n:-1]]
  assert len(after) == 3 and after == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_a_restore_names_an_unfinished_newer_save(tmp_path):
  d = str(tmp_path / "ck")
  r = _run(*TINY, "--steps=1", f"--checkpoint_dir={d}")
  assert r.returncode == 0 and f"saved step 1 to {d}" in r.stdout, r.stderr
  os.makedirs(os.path.join(d, "5.orbax-checkpoint-tmp"))           # a save killed mid-write
  r = _run(*TINY, "--steps=1", f"--checkpoint_dir={d}", "--restore=latest")
  assert r.returncode == 0, r.stderr
  assert ("restoring step 1, the newest committed step of "
          f"{d} (a newer save was incomplete: 5.orbax-checkpoint-tmp)") in r.stdout, r.stdout


@pytest.fixture
def small_disk():
  """An 8 MiB tmpfs: one of tiny's checkpoints (5 MB) fits, two do not."""
  path = f"/tmp/moe-sharding-disk-{uuid.uuid4().hex[:8]}"
  os.makedirs(path)
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", path],
                     capture_output=True, text=True)
  if r.returncode:
    os.rmdir(path)
    pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
  yield path
  subprocess.run(["umount", path])
  shutil.rmtree(path, ignore_errors=True)


def test_a_full_disk_is_one_error_line_and_keeps_the_committed_step(small_disk):
  d = os.path.join(small_disk, "ck")
  r = _run(*TINY, "--steps=3", "--save_every=1", f"--checkpoint_dir={d}")
  assert r.returncode == 1, r.stderr
  assert r.stderr.strip() == (f"error: saving step 2 to {d} failed (No space left on device); "
                              "the newest committed step is 1"), r.stderr
  assert checkpoint.steps(d) == [1] and f"saved step 1 to {d}" in r.stdout
