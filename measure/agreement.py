"""How close a strategy's run must be to the single-device reference's: the named tolerances
(their derivation is in tests/parity.py) and the check the tests and `--full_parity` share.

A run is a list of per-step records {loss, aux_loss, ce_loss, grad_norm, dropped, grads,
params (after the step)} as numpy. `disagreements` returns what is off, one line each; an empty
list is parity on losses, every gradient leaf and every post-step parameter.
"""
from __future__ import annotations

import jax
import numpy as np

RTOL, ATOL = 1e-5, 1e-6          # gradients (fp32)
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-5
PARAM_ATOL = 1e-5                # post-step parameters
# Adam's first update is ~g / (|g| + eps): parity runs use eps = 1e-5 on both sides, so that
# summation-order noise on near-zero gradient elements cannot move a parameter by ~lr
# (tests/parity.py derives it). Training keeps eps = 1e-8.
PARITY_ADAM_EPS = 1e-5


def _close(got, want, rtol, atol) -> tuple[bool, float]:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  err = np.abs(got - want)
  return bool(np.all(err <= atol + rtol * np.abs(want))), float(err.max(initial=0.0))


def disagreements(got: list[dict], want: list[dict], rtol=RTOL, atol=ATOL) -> list[str]:
  """['step 1 grads layers.moe.wi_0: max |diff| 3e-3', ...]; [] when the runs agree."""
  out = []
  if len(got) != len(want):
    return [f"{len(got)} steps against the reference's {len(want)}"]
  for i, (g, w) in enumerate(zip(got, want)):
    for k in ("loss", "aux_loss", "ce_loss"):
      ok, err = _close(g[k], w[k], LOSS_RTOL, LOSS_ATOL)
      if not ok:
        out.append(f"step {i} {k}: |diff| {err:.1e}")
    ok, err = _close(g["grad_norm"], w["grad_norm"], rtol * 10, atol)
    if not ok:
      out.append(f"step {i} grad_norm: |diff| {err:.1e}")
    if not np.array_equal(g["dropped"], w["dropped"]):
      out.append(f"step {i} dropped: {g['dropped']} vs {w['dropped']}")
    for tree, tol in (("grads", atol), ("params", max(atol, PARAM_ATOL))):
      leaves = jax.tree_util.tree_flatten_with_path(g[tree])[0]
      for (path, a), b in zip(leaves, jax.tree.leaves(w[tree])):
        ok, err = _close(a, b, rtol, tol)
        if not ok:
          out.append(f"step {i} {tree} {jax.tree_util.keystr(path)}: max |diff| {err:.1e}")
  return out
