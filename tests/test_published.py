"""planning/published.py: the published MoE runs as data, each posed as the suite's layout and
predicted by the planner, and the summary line's contract."""
import math
import re

import pytest

from modeling.config import PRESETS
from planning import clusters, plan, published


@pytest.fixture(scope="module")
def preds():
  return [published.predict(r) for r in published.ROWS]


def test_spearman():
  assert published.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert published.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
  # ties take their mean rank: ranks (0.5, 0.5, 2) against (0, 1, 2)
  assert published.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)


def test_rows_are_posed_or_say_why(preds):
  """Every row names a preset and a cluster profile; it is posed (a candidate the planner
  admits, its prediction in the row's measure) or says in one line what it waits for."""
  assert len(preds) >= 14
  for p in preds:
    r = p.row
    assert r.model in PRESETS and r.cluster in clusters.PROFILES, r.row
    assert math.prod(r.mesh.values()) == r.devices, r.row
    if p.error:
      assert "\n" not in p.error and p.predicted == 0.0, r.row
      continue
    c = p.candidate
    assert not c.error and dict(c.sizes) == {a: r.mesh.get(a, 1) for a, _ in c.sizes}, r.row
    expect = {"step_s": c.step_s, "tokens_per_s": c.tokens_per_s,
              "tflops": c.tokens_per_s * p.flops_per_token / 1e12}[r.measure]
    assert p.predicted == pytest.approx(expect) and p.predicted > 0, r.row


def test_flops_per_token_match_the_publishers(preds):
  """The suite's model FLOPs per token within 5% of what each publisher's TFLOP/s over
  tokens/s implies (DeepSeek-V3 and Qwen3-235B-A22B at 4K), so a TFLOP/s row compares the same
  work."""
  seen = set()
  for p in preds:
    implied = published.IMPLIED_FLOPS_PER_TOKEN.get((p.row.model, p.row.seq))
    if implied and not p.error:
      assert abs(p.flops_per_token / implied - 1) < 0.05, (p.row.row, p.flops_per_token)
      seen.add(p.row.model)
  assert seen == {"deepseek-v3", "qwen3-235b-a22b"}


def test_summary_line(preds):
  line = published.summary(preds)
  assert re.fullmatch(r"published: \d+ rows, median error \d+\.\d{3}, worst error \d+\.\d{3}, "
                      r"Spearman (nan|-?\d\.\d\d)", line), line
  n = int(line.split()[1])
  assert n == sum(not p.error for p in preds)
  errors = sorted(abs(p.ratio - 1) for p in preds if not p.error)
  assert f"worst error {errors[-1]:.3f}" in line


def test_prediction_is_the_planners():
  """A row's prediction is the planner's own ranking of that layout: the same candidate
  `enumerate_candidates` gives under the row's constraints, at its fastest placement."""
  row = next(r for r in published.ROWS if r.row == "5")
  p = published.predict(row)
  from modeling.config import get_config
  cfg = get_config(row.model, dtype="bfloat16").replace(batch=row.batch, seq_len=row.seq)
  cluster = clusters.get(row.cluster)
  cands = [c for c in plan.enumerate_candidates(cfg, row.devices, cluster, cluster.hbm_bytes,
                                                 names=("fsdp",), remats=(row.remat,))
           if not c.error and dict(c.sizes) == {"data": 1, "fsdp": 256}
           and c.capacity_factor == row.capacity_factor and c.microbatches == 1]
  assert p.candidate.step_s == pytest.approx(min(c.step_s for c in cands))
