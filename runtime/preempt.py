"""Stopping a run cleanly on SIGTERM / SIGINT (a cloud scheduler's preemption notice, Ctrl-C).

The first signal asks the run to stop after the step in flight: `Stop.requested(step)` turns
true at a step boundary, run.py saves that step when --checkpoint_dir is set, says where, and
exits 0. A second signal ends the process at once (exit status 128 + the signal's number).

Multi-process runs must all stop after the same step, or their saves would not make one
checkpoint. There SIGTERM goes to JAX's preemption service (jax.distributed starts it with
`jax_enable_preemption_service`): it tells every process, and
`multihost_utils.reached_preemption_sync_point(step)` turns true on every process at the same
step. Python installs no handler there (a stop one process alone took would leave the others
waiting in a collective): SIGINT keeps Python's default.
"""
from __future__ import annotations

import os
import signal
import sys


class Stop:
  """Installs the handlers for the duration of a run (`with Stop(...) as stop:`)."""

  def __init__(self, multi_process: bool = False):
    self.multi_process = multi_process
    self.signal: str | None = None        # the name of the first signal received
    self._old = {}

  def _handle(self, signum, frame):       # noqa: ARG002
    name = signal.Signals(signum).name
    if self.signal is not None:
      print(f"error: second {name}: stopping at once, without saving", file=sys.stderr,
            flush=True)
      os._exit(128 + signum)
    self.signal = name
    print(f"{name}: stopping after the step in flight", file=sys.stderr, flush=True)

  def __enter__(self) -> "Stop":
    for s in ([] if self.multi_process else [signal.SIGINT, signal.SIGTERM]):
      self._old[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, h in self._old.items():
      signal.signal(s, h)

  def requested(self, step: int) -> bool:
    """After step `step` (steps done): should the run stop here? Every process of a
    multi-process run must call this at every step with the same step number."""
    if self.multi_process:
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal = self.signal or "SIGTERM"
        return True
    return self.signal is not None
