"""The README's comparison block is what `python run.py` prints today: every cell equal to a fresh
`python run.py --report_dir=DIR`'s table.md but the step times, which vary run to run, and max
dloss, float32 rounding noise (1-3 ulps of the loss) whose last ulp differs between CPUs."""
import os
import subprocess
import sys

from tests.conftest import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import readme_tables  # noqa: E402

VARYING = ("step ms*", "max dloss")     # the columns whose cells differ from run to run or host


def deterministic(block: str) -> list[str]:
  """The block's lines with the VARYING columns' cells blanked."""
  lines = block.strip().splitlines()
  head = next((l for l in lines if l.startswith("| strategy")), None)
  assert head is not None, block
  cells = [c.strip() for c in head.strip("|").split("|")]
  cols = [cells.index(c) for c in VARYING]
  out = []
  for line in lines:
    if line.startswith("|") and set(line.strip()) <= set("|-"):
      out.append("---")                       # a separator: its widths follow the cells
    elif line.startswith("|"):
      row = [c.strip() for c in line.strip().strip("|").split("|")]
      if len(row) == len(cells) and row != cells:
        for col in cols:
          row[col] = "~"
      out.append(" | ".join(row))
    else:
      out.append(line.strip())
  return out


def test_readme_comparison_is_what_run_py_prints(tmp_path):
  env = subprocess_env()
  env.pop("XLA_FLAGS", None)                  # the README's table is run.py's own, default codegen
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run([sys.executable, "run.py", f"--report_dir={tmp_path}"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=1200)
  assert r.returncode == 0, r.stderr[-3000:]
  fresh = readme_tables.comparison_block(str(tmp_path))
  readme = readme_tables.read_block(open(os.path.join(ROOT, "README.md")).read(), "comparison")
  assert deterministic(readme) == deterministic(fresh)


def test_deterministic_blanks_only_the_varying_columns():
  block = ("header\n\n| strategy | final loss | max dloss | step ms* |\n|---|---|---|---|\n"
           "| dp | 5.63248 | 4.8e-07 | 33.2 |\n\nverdict: x")
  assert deterministic(block) == ["header", "", "strategy | final loss | max dloss | step ms*",
                                  "---", "dp | 5.63248 | ~ | ~", "", "verdict: x"]
  assert deterministic(block.replace("5.63248", "5.63249")) != deterministic(block)
