"""The one table that drives the strategy tests: every strategy's TEST_CASES, COST_CASES,
INVARIANT_MESHES and BAD_INPUT rows (declared in strategies/NAME.py, see strategies/__init__.py)
run here.

  parity    loss, aux loss, grad norm, dropped, every gradient and post-step parameter against
            the single-device reference, 3 steps (tests/parity.py)
  contract  the compiled step's (kind, mesh axes) set = the docstring's "HLO contract" block =
            the cost model's terms
  cost      the cost model's bytes per (kind, mesh axes) within 1% of the compiled HLO, both ways
  layouts   two meshes of one strategy: the same losses; a rerun is bit-identical
  bad input one-line ConfigError from check(), exactly the declared message
What is specific to one strategy stays in tests/test_NAME.py.
"""
import pytest

from layout import mesh as mesh_lib
from modeling.config import ConfigError, get_config
import strategies
from tests import parity

NAMES = [n for n in strategies.NAMES if n != "reference"]


def _rows(attr):
  out = []
  for n in NAMES:
    for c in getattr(strategies.get(n), attr, ()):
      opts = "" if c.opts is None else "-" + ",".join(f"{k}={v}" for k, v in vars(c.opts).items())
      over = "".join(f"-{k}={v}" for k, v in c.overrides.items())
      out.append(pytest.param(n, c, id=f"{n}-{c.model}-{c.mesh}{over}{opts}"))
  return out


def test_every_strategy_declares_its_table():
  for n in NAMES:
    s = strategies.get(n)
    assert len(s.TEST_CASES) >= 2 and s.COST_CASES and s.BAD_INPUT, n
    assert len({c.mesh for c in s.TEST_CASES}) >= min(2, len(s.AXES)), (n, "two meshes")
    assert {c.model for c in s.TEST_CASES} >= {"tiny", "deepseek-test"}, n
    assert hasattr(s, "COMPARE_MESH") and hasattr(s, "Options"), n


@pytest.mark.parametrize("name,case", _rows("TEST_CASES"))
def test_parity(name, case):
  got = parity.check(name, case.config(), case.mesh, opts=case.opts)
  if case.overrides.get("capacity_factor"):
    assert all(r["dropped"] > 0 for r in got)              # the capacity rule really drops


@pytest.mark.parametrize("name,case", _rows("TEST_CASES"))
def test_contract(name, case):
  parity.assert_contract(name, case.config(), case.mesh, case.opts)


@pytest.mark.parametrize("name,case", _rows("COST_CASES"))
def test_cost_model(name, case):
  parity.assert_cost_model(name, case.config(), case.mesh, case.opts)


@pytest.mark.parametrize("name", [n for n in NAMES
                                  if hasattr(strategies.get(n), "INVARIANT_MESHES")])
def test_layout_invariance(name):
  model, meshes, *over = strategies.get(name).INVARIANT_MESHES
  parity.assert_layout_invariance(name, get_config(model, **(over[0] if over else {})), meshes)


def _bad_rows():
  return [pytest.param(n, b, id=f"{n}-{i}") for n in NAMES
          for i, b in enumerate(strategies.get(n).BAD_INPUT)]


@pytest.mark.parametrize("name,bad", _bad_rows())
def test_bad_input(name, bad):
  strat = strategies.get(name)
  mesh = mesh_lib.make_mesh(mesh_lib.mesh_shape(strat.AXES, strat.MAIN_AXIS, bad.mesh, 8, name))
  with pytest.raises(ConfigError) as e:
    strat.check(get_config("tiny", **bad.overrides), mesh, bad.opts)
  assert str(e.value) == bad.message


def test_first_rows_keep_every_strategys_first_table_row():
  """.ci/run's run on the oldest jax (--rows=first, tests/conftest.py: first_rows): a
  parametrized test keeps its first row, the table keeps each strategy's first row, a test
  without rows is kept."""
  from pathlib import Path
  from types import SimpleNamespace

  from tests import conftest

  def item(nodeid, **params):
    return SimpleNamespace(nodeid=nodeid, path=Path(nodeid.split("::")[0]),
                           callspec=SimpleNamespace(params=params) if params else None)

  table, other = "tests/test_strategies.py::test_parity", "tests/test_remat.py::test_parity"
  items = [item(f"{table}[ep-a]", name="ep"), item(f"{table}[ep-b]", name="ep"),
           item(f"{table}[fsdp-a]", name="fsdp"), item(f"{other}[ep]", name="ep"),
           item(f"{other}[fsdp]", name="fsdp"), item("tests/test_cli.py::test_metrics_file")]
  keep, drop = conftest.first_rows(items)
  assert [i.nodeid for i in keep] == [items[k].nodeid for k in (0, 2, 3, 5)]
  assert [i.nodeid for i in drop] == [items[k].nodeid for k in (1, 4)]
