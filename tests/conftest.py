"""8 simulated CPU devices for every test (asserted: a test never skips for lack of devices),
LLVM -O0, the persistent compilation cache, and the xdist groups (group_of)."""
import os
import sys

# -O0 LLVM codegen: the tests run tiny models for a few steps, so compiling dominates; XLA's HLO
# passes (SPMD partitioning, collectives) are the same, and -O0 cut test_precision + test_pp from
# 2:49 to 2:16 (jax 0.11.2, cold cache). run.py keeps XLA's default; the tests' run.py
# subprocesses get the same flag (subprocess_env), as their results are compared with in-process ones.
CODEGEN_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8 " + CODEGEN_FLAGS).strip()


def subprocess_env() -> dict:
  """The environment for run.py subprocesses: this one's, with the tests' codegen flag but not
  their device count (run.py sets it from --devices), so in-process and subprocess results come
  from the same code."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = CODEGEN_FLAGS
  return env


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# run.py's own entry point (`_run`: absl flags, the checks, the `error:` line and the exit
# status) for many command lines in one Python process, so that jax and the suite are imported
# once rather than once per command; an exception escaping `_run` is written out as the traceback
# it would print, with exit status 1.
_RUN_PY_DRIVER = """
import contextlib, io, json, sys, traceback
import run
out = {}
for key, args in json.loads(sys.argv[1]).items():
  o, e = io.StringIO(), io.StringIO()
  sys.argv = ["run.py", *args]
  run.F.unparse_flags()
  code = 0
  try:
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
      run._run()
  except SystemExit as x:
    code = 0 if x.code is None else x.code if isinstance(x.code, int) else 1
  except BaseException:
    e.write(traceback.format_exc())
    code = 1
  out[key] = [code, o.getvalue(), e.getvalue()]
print("RESULTS " + json.dumps(out))
"""


def one_error_line(code: int, stderr: str, prefix: str = "error: ") -> str:
  """A refused run: exit status 2 and one non-blank stderr line, starting with `prefix` -> that
  line (the command line's bad-input rule, docs/command-line.md)."""
  lines = [l for l in stderr.strip().splitlines() if l.strip()]
  assert code == 2 and len(lines) == 1 and lines[0].startswith(prefix), stderr[-2000:]
  return lines[0]


def run_py_in_one_process(rows: dict, timeout: float = 600) -> dict:
  """{key: run.py's arguments} -> {key: [exit status, stdout, stderr]}, every row through
  run._run in one subprocess (JAX_PLATFORMS=cpu, the tests' codegen flags)."""
  import json
  import subprocess
  env = subprocess_env()
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-c", _RUN_PY_DRIVER, json.dumps(rows)], cwd=root, env=env,
                     capture_output=True, text=True, timeout=timeout)
  line = [l for l in r.stdout.splitlines() if l.startswith("RESULTS ")]
  assert line, r.stdout + r.stderr
  return json.loads(line[-1].removeprefix("RESULTS "))

def compare_table(stdout: str) -> dict:
  """run.py's comparison table in `stdout` -> {strategy entry: {column: cell}}."""
  lines = [l for l in stdout.splitlines() if l.startswith("|")]
  cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
  head = cells(lines[0])
  return {row[0]: dict(zip(head, row)) for row in map(cells, lines[2:])}

import jax  # noqa: E402

from runtime import target as _target  # noqa: E402

# With libtpu or the CUDA plugin installed (requirements-tpu.txt, requirements-gpu.txt), jax
# would start them on a host with neither chip, warn and fall back to the CPU: on such a host
# the tests and their subprocesses ask for the CPU alone, as run.py does
# (command_line.setup_devices).
if not jax.config.jax_platforms and _target.without_accelerator():
  os.environ["JAX_PLATFORMS"] = "cpu"
  jax.config.update("jax_platforms", "cpu")

# The persistent compilation cache, shared by both xdist workers. jax writes an entry in place; a
# size limit turns on its file lock (filelock), which reads and writes take, so a worker never
# reads an entry the other is still writing.
CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
jax.config.update("jax_compilation_cache_dir", CACHE)
jax.config.update("jax_compilation_cache_max_size", 64 * 2**30)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
  config.addinivalue_line("markers", "fast: the fast tier (tests/conftest.py, FAST_FILES)")
  if jax.default_backend() == "cpu":
    assert jax.device_count() == 8, f"expected 8 simulated CPU devices, got {jax.device_count()}"


import pytest  # noqa: E402

import strategies  # noqa: E402


def group_of(nodeid: str) -> str:
  """A test's xdist group: its file, so that a file's tests share their compiled steps in one
  worker, except tests/test_strategies.py, which groups per strategy (the first word of the
  test id): the table's rows spread over the workers while each strategy's parity, contract and
  cost tests share one compile. A strategy's own file (tests/test_ep_tp.py, ...) joins its
  table's group: its tests read the same compiled rows."""
  path, _, rest = nodeid.partition("::")
  group = path.rsplit("/", 1)[-1].removesuffix(".py")
  if group == "test_strategies" and "[" in rest:
    group += "-" + rest.split("[", 1)[1].split("-", 1)[0].rstrip("]")
  elif group.removeprefix("test_") in strategies.NAMES[1:]:            # not the reference
    group = "test_strategies-" + group.removeprefix("test_")
  return group


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadgroup` groups by group_of. xdist's own loadgroup reads an "@group" suffix that
  its worker hook writes into item._nodeid from an xdist_group mark, which pytest >= 9.2 no longer
  reads (its node ids come from item._id): every test became its own group, spread round-robin
  over the workers, each compiling what the other had."""
  if config.getvalue("dist") != "loadgroup":
    return None
  from xdist.scheduler import LoadScopeScheduling

  class ByGroup(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      return group_of(nodeid)

  return ByGroup(config, log)


def pytest_addoption(parser):
  parser.addoption(
      "--rows", choices=("all", "first"), default="all",
      help="first: every test collected, but a parametrized one on its first row only, and the "
           "strategy table (tests/test_strategies.py) on each strategy's first row: .ci/run's "
           "run of its version-sensitive files on the oldest supported jax")
  parser.addoption(
      "--strategy", default=None,
      help="NAME: only that strategy's tests (its rows of the strategy table and "
           "tests/test_NAME.py)")


def first_rows(items) -> tuple[list, list]:
  """--rows=first: (kept, deselected). A test function's rows are keyed by its function, and in
  the strategy table by (function, strategy) too; the first item of each key is kept."""
  seen, keep, drop = set(), [], []
  for item in items:
    spec = getattr(item, "callspec", None)
    if spec is None:
      keep.append(item)
      continue
    key = (item.nodeid.split("[", 1)[0],
           spec.params.get("name") if item.path.name == "test_strategies.py" else None)
    (drop if key in seen else keep).append(item)
    seen.add(key)
  return keep, drop




# The fast tier (`pytest -m fast`): every strategy's first parity, contract and cost row (the
# strategy table on --rows=first), the units that compile nothing or little, and the command
# line's contract, each parametrized test on its first row. The full matrix is the default.
FAST_FILES = {"test_strategies.py", "test_cli.py", "test_imports.py", "test_docs.py",
              "test_names.py", "test_routing.py", "test_dispatch.py", "test_durability.py",
              "test_data.py"}


def strategy_of(item) -> str | None:
  """The strategy a test holds: the strategy table's row, or a strategy's own test file
  (tests/test_NAME.py); None for the tests of no one strategy."""
  spec = getattr(item, "callspec", None)
  if item.path.name == "test_strategies.py" and spec is not None and "name" in spec.params:
    return spec.params["name"]
  stem = item.path.stem.removeprefix("test_")
  return stem if stem in strategies.NAMES else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """--rows=first keeps first rows; --strategy=NAME keeps that strategy's tests (exactly: `-k ep`
  would match ep_tp's and every deepseek row); the fast tier's items get the `fast` mark before
  `-m` selects (tryfirst)."""
  if config.getoption("rows") == "first":
    items[:], drop = first_rows(items)
    config.hook.pytest_deselected(items=drop)
  only = config.getoption("strategy")
  if only:
    if only not in strategies.NAMES:
      raise pytest.UsageError(f"--strategy={only}: choose from {', '.join(strategies.NAMES)}")
    drop = [i for i in items if strategy_of(i) != only]
    items[:] = [i for i in items if strategy_of(i) == only]
    config.hook.pytest_deselected(items=drop)
  fast, _ = first_rows([i for i in items if i.path.name in FAST_FILES])
  for item in fast:
    item.add_marker(pytest.mark.fast)
