"""The cost model against the compiled HLO on every row the tests hold it to: each strategy's
COST_CASES (tests/test_strategies.py), the bf16 rows (tests/test_precision.py) and the remat rows
(tests/test_remat.py), each compiled as the tests compile it (tests/parity.py, 8 CPU devices).
Per row: whether every (kind, axes) is exact, else its keys that are not, with the bytes the
HLO has over the model's and their ratio; last, the counts.

Run from the repo root:  python bench/cost_rows.py [SUBSTRING]   (rows whose label holds it)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tests.conftest  # noqa: E402,F401  (8 devices, the tests' codegen flag and compile cache)
from modeling.config import get_config  # noqa: E402
import strategies  # noqa: E402
from tests import parity, test_precision, test_remat  # noqa: E402


def rows():
  """(label, strategy, config, mesh, opts) of every cost row the tests hold."""
  for n in (n for n in strategies.NAMES if n != "reference"):
    for c in strategies.get(n).COST_CASES:
      over = "".join(f" {k}={v}" for k, v in c.overrides.items())
      yield f"table {n} {c.model} {c.mesh}{over} {c.opts or ''}", n, c.config(), c.mesh, c.opts
  for n, mesh in test_precision.MESHES:
    yield (f"bf16 {n} {mesh}", n, parity.bf16_config(test_precision.DEEPSEEK), mesh,
           test_precision.OPTS.get(n))
  for n, mesh, remat in test_remat.REMAT_MESHES:
    yield f"remat {n} {mesh} {remat}", n, get_config("tiny", remat=remat), mesh, None


if __name__ == "__main__":
  pick = sys.argv[1] if len(sys.argv) > 1 else ""
  n_rows = exact = within = 0
  for label, name, cfg, mesh, opts in rows():
    if pick not in label:
      continue
    table = parity.cost_table(name, cfg, mesh, opts)
    off = {k: v for k, v in table.items() if v["predicted"] != v["measured"]}
    n_rows += 1
    exact += not off
    within += all(0.99 <= v["ratio"] <= 1.01 for v in table.values())
    print(("exact " if not off else "      ") + label, flush=True)
    for (kind, axes), v in sorted(off.items(), key=lambda kv: kv[0][0]):
      more = v["measured"] - v["predicted"]
      print(f"        {kind} over {','.join(sorted(axes))}: {more:+,.0f} B ({v['ratio']:.4f})")
  print(f"{n_rows} rows: {exact} exact, {within} within 1%")
