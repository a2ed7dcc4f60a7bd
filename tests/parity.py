"""Parity harness: run a strategy and the single-device reference for N steps from the same
init and data, and chex-assert per-step loss, aux loss, grad norm, every gradient and the
post-step params. Reference runs are cached per model config, so many strategies share one."""
from __future__ import annotations

import contextlib
import functools

import chex
import jax
import numpy as np

from layout import buffers, mesh as mesh_lib
from measure import agreement, contract, cost, hlo
from runtime import train
import strategies

# The tolerances live in measure/agreement.py (run.py --full_parity uses them too); why they are
# what they are is written here.
RTOL, ATOL = agreement.RTOL, agreement.ATOL       # fp32 gradients
LOSS_RTOL, LOSS_ATOL = agreement.LOSS_RTOL, agreement.LOSS_ATOL
# Adam's first update is ~g / (|g| + eps). With the training default eps = 1e-8, a gradient
# element that is a near-cancelling sum (|g| ~ 1e-9, its sign set by summation order) moves the
# updated param by up to ~9% of lr between two correct layouts (measured on dp and tp). Parity
# runs therefore use eps = 1e-5 for the strategy and the reference alike: the update is then
# Lipschitz in g with constant lr/eps = 300: the few-1e-9 summation-order differences of large
# gradient sums move a param by at most ~1e-5 (measured 1.7e-6 on dp, 1.3e-5 on ep_tp's
# tensor-split attention), instead of ~3e-4; PARAM_ATOL is 3e-5.
# (1e-5 is still far below the typical |g| of 1e-3..1e-1 here: the optimizer behaves as Adam.)
PARITY_ADAM_EPS = agreement.PARITY_ADAM_EPS
PARAM_ATOL = agreement.PARAM_ATOL


def _np(tree):
  return jax.tree.map(lambda a: np.asarray(jax.device_get(a)), tree)


def make_mesh(name: str, mesh_spec: str | None):
  return mesh_lib.for_strategy(strategies.get(name), mesh_spec)


def job(name: str, cfg, mesh_spec: str | None, opts=None, *, init=None,
        poison: bool = False) -> train.Job:
  """Compiled train step (with grads in the metrics), cached: HLO tests reuse parity's compile.
  Every entry point here applies parity_config, so all share one compile per (name, cfg, mesh,
  opts). opts: the strategy's Options (None = defaults); init: cfg -> numpy params (a
  module-level function); poison: trace with NaN in every padded exchange buffer
  (layout/buffers.py)."""
  return _job(name, parity_config(cfg), mesh_spec, _opts(name, opts), init, poison)


def _opts(name, opts):
  return strategies.get(name).Options() if opts is None else opts


def _build(name: str, cfg, mesh_spec: str | None, opts, init=None, poison: bool = False):
  with (buffers.poisoned() if poison else contextlib.nullcontext()):
    return train.build(strategies.get(name), cfg, make_mesh(name, mesh_spec), opts,
                       with_grads=True, init=init)


# A compiled train step holds about a thousand memory maps of XLA:CPU code (measured: 1.1k per
# tiny step); a worker that kept every step it compiled passed the kernel's 65,530
# (vm.max_map_count) and segfaulted inside a compile. So at most 24 steps stay compiled (a
# file's or a strategy's rows fit), the reference's are not kept (its runs are), and runs (numpy
# results) are kept in full.
_job = functools.lru_cache(maxsize=24)(_build)


def run(name: str, cfg, mesh_spec: str | None, steps: int, opts=None, *, init=None,
        poison: bool = False) -> list[dict]:
  """-> per step {loss, aux_loss, grad_norm, dropped, grads, params (after the step)} as numpy."""
  return _run(name, parity_config(cfg), mesh_spec, steps, _opts(name, opts), init, poison)


@functools.lru_cache(maxsize=None)
def _run(name: str, cfg, mesh_spec: str | None, steps: int, opts, init=None,
         poison: bool = False) -> list[dict]:
  out = []
  build = _build if name == "reference" else _job      # the reference runs once per config
  for _, params, _, m, _ in train.steps(build(name, cfg, mesh_spec, opts, init, poison), steps):
    rec = {k: m[k] for k in ("loss", "aux_loss", "ce_loss", "grad_norm", "dropped", "grads")}
    rec["params"] = _np(params)
    out.append(rec)
  return out


def reference(cfg, steps: int, *, init=None) -> list[dict]:
  """The single-device reference on the same model and run, computed the plainest way."""
  return run("reference", cfg.plain(), None, steps, init=init)


def assert_parity(got: list[dict], want: list[dict], rtol=RTOL, atol=ATOL) -> None:
  """Every step finite, and measure.agreement.disagreements' rule (the one --full_parity
  applies): losses, grad norm, dropped counts, every gradient and post-step parameter."""
  for g in got:
    chex.assert_tree_all_finite(g)
  off = agreement.disagreements(got, want, rtol, atol)
  assert not off, "\n".join(off[:20])


def parity_config(cfg):
  """The config parity runs use (see PARITY_ADAM_EPS, and BF16_ADAM_EPS for bf16)."""
  return cfg.replace(adam_eps=BF16_ADAM_EPS if cfg.mixed else PARITY_ADAM_EPS)


# ----------------------------------------------------------------------------- bf16 parity
# A bf16 strategy is compared with the bf16 reference (tests/test_precision.py). Two correct bf16
# programs round differently wherever XLA fuses or splits differently (a batch per device, a
# contraction split over tensor): activations differ by an ulp (2^-8 relative) here and there.
# (1) Routing is discrete: such an ulp flips a top-k choice near a tie, and a flipped token moves
#     its whole contribution between experts. Measured with top_k=2 on tiny: per-leaf gradient
#     errors of 10-24% against the bf16 reference, from ~1% of tokens -- and the bf16 reference
#     is as far from the float32 one. So bf16 parity routes every token to every expert
#     (`bf16_config`: top_k = E): no choice left to flip, the same routing, permutation,
#     exchange and combine code runs, with its weights. (top_k < E is proven in float32.)
# (2) What is left is rounding: measured over the 9 strategies x 3 steps, losses within 1.3e-4
#     relative and every gradient leaf within 2.0e-2 in relative L2 norm. The tolerances below
#     are 4x / 2.5x that; a gradient summed over a missing or an extra mesh axis is off by >= 50%.
# (3) Adam's first step is ~lr * g / (|g| + eps): with eps << the bf16 noise of g (~1e-4 here) a
#     near-zero element flips sign at random. eps = 1e-2 makes the update Lipschitz in g (the
#     parity runs only: the optimizer's own math is proven in float32), and the updates are
#     compared like the gradients, in relative L2 norm per leaf.
BF16_ADAM_EPS = agreement.BF16_ADAM_EPS
BF16_LOSS_RTOL = agreement.BF16_LOSS_RTOL
BF16_GRAD_RTOL = agreement.BF16_GRAD_RTOL     # relative L2 norm, per gradient / update leaf


def bf16_config(cfg):
  """cfg in bf16 mixed precision with every token routed to every expert (see above)."""
  return cfg.replace(dtype="bfloat16", top_k=cfg.n_experts, topk_group=cfg.n_group)


def rel_l2(got, want) -> dict:
  """{leaf path: ||got - want|| / ||want||} over two pytrees of arrays."""
  err = jax.tree.map(lambda g, w: float(np.linalg.norm(np.float64(g) - w)
                                        / max(np.linalg.norm(np.float64(w)), 1e-30)), got, want)
  return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(err)[0]}


def assert_parity_bf16(got: list[dict], want: list[dict], params0) -> None:
  """bf16 run against the bf16 reference: losses (BF16_LOSS_RTOL), every gradient leaf and every
  leaf's param update (BF16_GRAD_RTOL, relative L2); params and grads stay float32 (masters)."""
  before_g, before_w = params0, params0
  for i, (g, w) in enumerate(zip(got, want)):
    chex.assert_tree_all_finite(g)
    for k in ("loss", "aux_loss", "ce_loss"):
      np.testing.assert_allclose(g[k], w[k], rtol=BF16_LOSS_RTOL, atol=1e-6, err_msg=f"step {i} {k}")
    assert {a.dtype.name for a in jax.tree.leaves((g["grads"], g["params"]))} == {"float32"}
    bad = {k: v for k, v in rel_l2(g["grads"], w["grads"]).items() if v > BF16_GRAD_RTOL}
    assert not bad, (f"step {i} grads", bad)
    moved_g = jax.tree.map(np.subtract, g["params"], before_g)
    moved_w = jax.tree.map(np.subtract, w["params"], before_w)
    bad = {k: v for k, v in rel_l2(moved_g, moved_w).items() if v > BF16_GRAD_RTOL}
    assert not bad, (f"step {i} param updates", bad)
    before_g, before_w = g["params"], w["params"]


def check_bf16(name: str, cfg, mesh_spec: str | None, steps: int = 2, opts=None) -> list[dict]:
  """`name` in bf16 (bf16_config(cfg)) against the bf16 reference."""
  from modeling import model
  cfg = bf16_config(cfg)
  got = run(name, cfg, mesh_spec, steps, opts)
  assert_parity_bf16(got, reference(cfg, steps), model.init_params(cfg))
  return got


def check(name: str, cfg, mesh_spec: str, steps: int = 3, opts=None, *, init=None,
          poison: bool = False, **tol) -> list[dict]:
  """Run `name` on `mesh_spec` and assert parity with the reference. Returns the strategy's run."""
  got = run(name, cfg, mesh_spec, steps, opts, init=init, poison=poison)
  assert_parity(got, reference(cfg, steps, init=init), **tol)
  return got


def cost_table(name: str, cfg, mesh_spec: str, opts=None) -> dict:
  """The strategy's analytic cost (measure/cost.py) beside its compiled HLO (job's compile), per
  (collective kind, mesh axes): {(kind, axes): {predicted, measured, ratio}}."""
  j = job(name, cfg, mesh_spec, opts)
  got = hlo.collective_stats_by_axes(j.hlo, j.mesh)
  return cost.versus(cost.step_terms(strategies.get(name), j.cfg, j.mesh, j.opts), got, by="axes")


def assert_cost_model(name: str, cfg, mesh_spec: str, opts=None, tol: float = 0.01) -> dict:
  """The strategy's cost model matches the compiled HLO per (collective kind, mesh axes), both
  ways: every key either side has, within `tol` of the compiled bytes (1%, the planner's promise;
  of the 65 rows of the table, bf16 and remat tests, `python bench/cost_rows.py` measured 63
  exact and two, pp's tiny 1f1b and interleaved, within 0.01%).
  Returns cost_table's {(kind, axes): {predicted, measured, ratio}}."""
  table = cost_table(name, cfg, mesh_spec, opts)
  bad = {k: v for k, v in table.items() if not 1 - tol <= v["ratio"] <= 1 + tol}
  assert not bad, (name, mesh_spec, bad)
  return table


# Two layouts of one strategy differ only in how the global router statistics are grouped into
# per-shard partial sums before the psum. Reassociating n float32 additions moves a sum by at most
# (n-1)·u relative (u = 2^-24); the step-0 aux loss combines per-layer products of such sums, so
# two correct layouts may differ by a few ulps (measured: 1 ulp on cp, 4.1e-7 on tp on an AMD
# EPYC host), while a missing or double-counted shard moves it by percents. Bit-equality across
# layouts is not a property of the code, only of one CPU's rounding; it is asserted where it
# holds by construction: rerunning one compiled layout on the same inputs.
LAYOUT_AUX_RTOL = 2e-6


def assert_layout_invariance(name: str, cfg, mesh_specs, steps: int = 3) -> None:
  """Two layouts of one strategy: the same aux loss at step 0 (LAYOUT_AUX_RTOL, same params and
  data, only the reduction grouping differs) and the same losses at every step; a rerun of the
  first layout's compiled step on the same inputs is bit-identical."""
  a, b = (run(name, cfg, m, steps) for m in mesh_specs)
  np.testing.assert_allclose(a[0]["aux_loss"], b[0]["aux_loss"], rtol=LAYOUT_AUX_RTOL, atol=0)
  for x, y in zip(a, b):
    np.testing.assert_allclose(x["aux_loss"], y["aux_loss"], rtol=1e-6)
    np.testing.assert_allclose(x["loss"], y["loss"], rtol=1e-6)
  j = job(name, cfg, mesh_specs[0])
  once, twice = (_np(j.step(j.params, j.opt_state, j.batch(0))) for _ in range(2))
  chex.assert_trees_all_equal(once, twice)


def declared(name: str, opts, mesh, optimizer: str = "adamw", cfg=None) -> set:
  """The (kind, axes) set of the strategy's docstring contract for these options and optimizer
  (and the model, where a tagged line depends on it)."""
  strat = strategies.get(name)
  variant = strat.contract_variant(opts) if hasattr(strat, "contract_variant") else None
  tags = strat.contract_tags(opts, cfg) if hasattr(strat, "contract_tags") else ()
  return contract.declared_collectives(strat.__doc__, mesh, variant, optimizer, tags)


def assert_contract(name: str, cfg, mesh_spec: str, opts=None) -> train.Job:
  """Prose, model and program agree: the compiled step's collectives as (kind, mesh axes), the
  strategy's docstring "HLO contract" block and its cost model's terms are one set — each way.
  Returns the job."""
  j = job(name, cfg, mesh_spec, opts)
  want = declared(name, j.opts, j.mesh, j.cfg.optimizer, j.cfg)
  got = set(hlo.collective_stats_by_axes(j.hlo, j.mesh))
  assert got == want, {"undeclared": got - want, "declared, not compiled": want - got}
  model = set(cost.by_axes(cost.step_terms(strategies.get(name), j.cfg, j.mesh, j.opts)))
  assert model == want, {"not in the cost model": want - model, "not declared": model - want}
  return j
