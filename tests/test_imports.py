"""The module import graph: no cycle anywhere, and imports point one way, down the layers
(parallel -> modeling -> layout -> measure -> strategies -> runtime -> the top: compare, report,
command_line, run.py and the planner, planning/; kernels beside runtime, bench on top). Every import statement counts, a function-level
one too, read from the source text (nothing is imported to find them)."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ["parallel", "modeling", "layout", "measure", "strategies", "runtime", "kernels", "top"]
PACKAGES = {"parallel", "modeling", "layout", "measure", "strategies", "runtime", "kernels",
            "planning"}
TOP = {"compare", "report", "run", "command_line", "planning"}


def modules() -> dict[str, str]:
  """{dotted module name: path} of the suite's source (tests and bench excluded)."""
  out = {}
  for top in sorted(PACKAGES):
    for name in sorted(os.listdir(os.path.join(ROOT, top))):
      if name.endswith(".py"):
        mod = top if name == "__init__.py" else f"{top}.{name[:-3]}"
        out[mod] = os.path.join(ROOT, top, name)
  for name in TOP - PACKAGES:
    out[name] = os.path.join(ROOT, f"{name}.py")
  return out


def imports(path: str, known) -> set[str]:
  """The suite modules a file imports (`import a.b`, `from a import b`, `from a.b import c`)."""
  out = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
      continue
    out |= {n for n in names if n in known}
  return out


def graph() -> dict[str, set[str]]:
  mods = modules()
  return {m: imports(p, mods) - {m} for m, p in mods.items()}


def layer(mod: str) -> int:
  top = mod.split(".")[0]
  return LAYERS.index("top" if top in TOP else top)


def test_no_import_cycle():
  g, state, cycles = graph(), {}, []

  def visit(m, path):
    state[m] = "open"
    for n in sorted(g[m]):
      if state.get(n) == "open":
        cycles.append(path[path.index(n):] + [n])
      elif n not in state:
        visit(n, path + [n])
    state[m] = "done"
  for m in sorted(g):
    if m not in state:
      visit(m, [m])
  assert not cycles, cycles


def test_imports_point_down():
  """A module imports only its own layer or lower ones; within strategies/, the registry
  (strategies/__init__.py, which loads strategy modules by name only) and ep.py's exchange are
  what other strategy files import."""
  up = [(m, n) for m, ns in graph().items() for n in ns if layer(n) > layer(m)]
  assert not up, up
  g = graph()
  within = {(m, n) for m, ns in g.items() for n in ns
            if m.startswith("strategies.") and n.startswith("strategies.")}
  assert {n for _, n in within} <= {"strategies.ep"}, within


def test_only_the_top_imports_strategy_modules_by_name():
  """runtime and the layers below take a strategy module as an argument; they never import one."""
  g = graph()
  importers = {m for m, ns in g.items() if any(n.startswith("strategies") for n in ns)}
  assert {m.split(".")[0] for m in importers} <= {"strategies"} | TOP, importers
