"""How close a strategy's run must be to the single-device reference's: the named tolerances
(their derivation is in tests/parity.py and below) and the check the tests and `--full_parity`
share.

A run is a list of per-step records {loss, aux_loss, ce_loss, grad_norm, dropped, grads,
params (after the step)} as numpy. `disagreements` returns what is off, one line each; an empty
list is parity on losses, every gradient leaf and every post-step parameter. `worst` measures
the largest gradient and parameter errors and names their leaves (table.json).

float32: elementwise, |got - want| <= ATOL + RTOL |want| per gradient element (PARAM_ATOL for
the post-step parameters), the same routing (dropped assignments equal at every step).

bfloat16 (`disagreements_bf16`): two correct bf16 programs round differently wherever XLA fuses
or splits differently (a batch per device, a contraction split over tensor): activations differ
by an ulp (2^-8 relative) here and there. Two consequences, and the rule for each:
(1) Routing is discrete: such an ulp flips a top-k choice near a tie (measured: deepseek-test,
    capacity 1.25, ep dropped 215 assignments where the reference dropped 216), and a flipped
    token moves its whole contribution between experts: per-leaf gradient errors of 10-24% from
    ~1% of the tokens. So both sides choose experts by position (cfg.expert_choice = "position",
    modeling/routing.py: a hash of the token's position, exact): the same assignments, the same
    drops at the requested capacity, while the router's weights, probabilities, aux and z losses
    and every gradient stay computed as in training. The top-k of the router's scores is the same
    float32 code in either dtype and is proven by the float32 parity. Dropped counts must still
    be equal at every step (a layout that drops differently, e.g. an overflowing buffer, fails).
    gpt-oss's clamped SwiGLU is discrete the same way: an ulp moves an activation across the
    limit, where its derivative jumps between 0 and 1 (measured: gpt-oss-test, limit 1.5, tp and
    ep against the reference over seeds 0-3, worst leaves 3.4e-2 to 5.0e-2 in relative L2;
    unclamped, 1.6e-2 to 2.2e-2). So both sides run it unclamped
    (swiglu_limit = 0); the clamp is proven by the float32 parity.
(2) What is left is rounding. Losses are compared relatively (BF16_LOSS_RTOL); gradients and
    each step's parameter update (params after - params before, each side its own) in relative
    L2 norm per leaf (BF16_GRAD_RTOL): elementwise bounds do not hold for bf16 sums whose terms
    cancel. A gradient summed over a missing or an extra mesh axis is off by >= 50% of the leaf.
(3) Adam's first update is ~lr g / (|g| + eps): with eps << the bf16 noise of g a near-zero
    element's update flips sign at random. Parity runs in bf16 use eps = BF16_ADAM_EPS, which makes
    the update Lipschitz in g (the optimizer's own math is proven in float32).
"""
from __future__ import annotations

import jax
import numpy as np

RTOL, ATOL = 1e-5, 1e-6          # gradients (fp32)
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-5
PARAM_ATOL = 3e-5                # post-step parameters: 1% of lr (3e-3); a wrong update is off
                                 # by ~lr. Measured worst 1.3e-5 (ep_tp, deepseek-test, expert:8:
                                 # dense attention's wo), from gradient elements ~4e-8 apart
                                 # (within ATOL) through Adam's lr / eps = 300 (tests/parity.py)
# Adam's first update is ~g / (|g| + eps): parity runs use eps = 1e-5 on both sides, so that
# summation-order noise on near-zero gradient elements cannot move a parameter by ~lr
# (tests/parity.py derives it). Training keeps eps = 1e-8.
PARITY_ADAM_EPS = 1e-5

# bfloat16, see (1)-(3) above; the values tests/parity.py's bf16 tests use (there with
# top_k = E, measured 1.3e-4 / 2.0e-2). Measured with experts chosen by position, run.py
# --compare --full_parity --dtype=bfloat16 --model=deepseek-test: every strategy, capacity 0.5,
# 3 steps: losses within 2e-4 relative, gradient leaves 2.8e-2 and updates
# 2.6e-2 in relative L2 (the worst leaf everywhere MLA's wq_a / wkv_a, whose gradients cancel
# through the q / kv RMSNorm); ep, ep_tp, tp at capacity 1.25, seed 0 (3 steps) and seed 1 (4
# steps): losses 2.2e-4, gradients 3.0e-2, updates 3.0e-2. The bounds are 2.3x (losses) and
# 1.7x (leaves) the largest measured. Trajectories drift apart with steps (rounded parameters
# give gradients that differ by more than rounding): the rule is for short runs, as compared.
BF16_ADAM_EPS = 1e-2
BF16_LOSS_RTOL = 5e-4            # loss, aux_loss, ce_loss: relative
BF16_GRAD_RTOL = 5e-2            # relative L2 norm per gradient leaf and per update leaf; and
                                 # the grad norm, relative (implied by the leaves' bound: the
                                 # losses' 5e-4 failed ep_tp and ep_x_tp's correct norms)


def parity_config(cfg):
  """The config --full_parity runs every row at (the reference's too). float32: as given.
  bfloat16: experts chosen by position, the SwiGLU unclamped (rule (1)). The Adam eps is the
  caller's (run.py: parity_eps unless --adam_eps)."""
  return cfg if not cfg.mixed else cfg.replace(expert_choice="position", swiglu_limit=0.0)


def parity_eps(cfg) -> float:
  """The Adam eps --full_parity runs at when --adam_eps is not given: PARITY_ADAM_EPS in
  float32, BF16_ADAM_EPS (rule (3)) in bfloat16."""
  return BF16_ADAM_EPS if cfg.mixed else PARITY_ADAM_EPS


def rule(cfg) -> str:
  """The comparison's rule for cfg (after parity_config) in one line: the header, table.json's
  settings."""
  if not cfg.mixed:
    return (f"float32 rule: losses within {LOSS_RTOL:g} relative + {LOSS_ATOL:g}, every gradient "
            f"element within {RTOL:g} relative + {ATOL:g}, every post-step parameter within "
            f"{RTOL:g} relative + {PARAM_ATOL:g}, dropped assignments equal at every step")
  return (f"bfloat16 rule: experts chosen by token position on both sides (the same "
          f"assignments and drops; the router's weights and gradients as in training), the "
          f"SwiGLU unclamped on both sides, "
          f"dropped assignments equal at every step, losses within {BF16_LOSS_RTOL:g} relative, "
          f"grad norm and every gradient leaf and every leaf's update within "
          f"{BF16_GRAD_RTOL:g} in relative L2 norm, Adam eps {cfg.adam_eps:g} on both sides")


def _close(got, want, rtol, atol) -> tuple[bool, float]:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  err = np.abs(got - want)
  return bool(np.all(err <= atol + rtol * np.abs(want))), float(err.max(initial=0.0))


def _rel_l2(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _leaves(tree) -> list[tuple[str, np.ndarray]]:
  return [(jax.tree_util.keystr(p), np.asarray(a))
          for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _updates(run: list[dict], params0) -> list[dict]:
  """Each step's parameter update, params after - params before (the run's own)."""
  before, out = params0, []
  for rec in run:
    out.append(jax.tree.map(lambda a, b: np.float64(a) - np.float64(b), rec["params"], before))
    before = rec["params"]
  return out


def disagreements(got: list[dict], want: list[dict], rtol=RTOL, atol=ATOL) -> list[str]:
  """float32: ['step 1 grads layers.moe.wi_0: max |diff| 3e-3', ...]; [] when the runs agree."""
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


def disagreements_bf16(got: list[dict], want: list[dict], params0) -> list[str]:
  """bfloat16 (rules (1)-(3) above), against the reference run at the same parity_config;
  params0: the parameters both started from. [] when the runs agree."""
  out = []
  if len(got) != len(want):
    return [f"{len(got)} steps against the reference's {len(want)}"]
  for i, (g, w, ug, uw) in enumerate(zip(got, want, _updates(got, params0),
                                          _updates(want, params0))):
    if not np.array_equal(g["dropped"], w["dropped"]):
      out.append(f"step {i} dropped: {g['dropped']} vs {w['dropped']}")
    for k, tol in (("loss", BF16_LOSS_RTOL), ("aux_loss", BF16_LOSS_RTOL),
                   ("ce_loss", BF16_LOSS_RTOL), ("grad_norm", BF16_GRAD_RTOL)):
      ok, err = _close(g[k], w[k], tol, 0.0)
      if not ok:
        out.append(f"step {i} {k}: |diff| {err:.1e} (> {tol:g} relative)")
    for tree, a_tree, b_tree in (("grads", g["grads"], w["grads"]), ("update", ug, uw)):
      for (path, a), (_, b) in zip(_leaves(a_tree), _leaves(b_tree)):
        err = _rel_l2(a, b)
        if not err <= BF16_GRAD_RTOL:                    # NaN fails too
          out.append(f"step {i} {tree} {path}: relative L2 {err:.1e} (> {BF16_GRAD_RTOL:g})")
  return out


def worst(got: list[dict], want: list[dict], params0=None) -> dict:
  """The largest errors against the reference over every step and leaf, each with the leaf it
  came from ("step 1 ['layers']['moe']['wi_0']"): grads and post-step params, max |diff| and
  relative L2 norm; with params0, the step's update (params after - before) in relative L2."""
  out = {}
  trees = {"grad": [(g["grads"], w["grads"]) for g, w in zip(got, want)],
           "param": [(g["params"], w["params"]) for g, w in zip(got, want)]}
  if params0 is not None:
    trees["update"] = list(zip(_updates(got, params0), _updates(want, params0)))
  for name, pairs in trees.items():
    best = {}
    for i, (a_tree, b_tree) in enumerate(pairs):
      for (path, a), (_, b) in zip(_leaves(a_tree), _leaves(b_tree)):
        errs = {"rel_l2": _rel_l2(a, b)}
        if name != "update":
          errs["max_abs"] = float(np.max(np.abs(np.float64(a) - b), initial=0.0))
        for k, v in errs.items():
          if k not in best or not v <= best[k][0]:       # NaN is the worst
            best[k] = (v, f"step {i} {path}")
    for k, (v, leaf) in best.items():
      out[f"{name}_{k}"], out[f"{name}_{k}_leaf"] = v, leaf
  return out
