"""Every name that a docstring, a comment, README.md or a docs page gives to the suite's own code
exists, read with ast (nothing is imported). The references, by pattern:

  path      a path that opens with a package of the suite or docs/ (`strategies/ep.py`,
            `tests/test_cp.py`, `docs/planner.md`, `planning/full_scale.json`), or a bare `*.py`
            name (`ep.py`): the file exists (a bare name: some file of that name). An
            all-capitals stem is a placeholder (`strategies/NAME.py`); WRITTEN_BY_A_RUN lists the
            files a command writes and the repo does not hold.
  member    a path followed by `::name`, `: name` or `'s name` (`measure/cost.py: step_terms`,
            `tests/test_cp.py::test_ring_balanced_skips_the_empty_half_blocks`,
            `strategies/ep.py's moe_body`): after `::` the module defines it at its top level
            (a test); after `:` or `'s` its code holds the name anywhere (a local such as
            tp.py's gather_in, or `jax.shard_map`), and the word counts only where it reads as
            code (_reads_as_code): backticked; with an underscore or an inner capital, but for
            a strategy's name; or defined somewhere in the suite and capitalised (`Saver`) or
            after `:`. English ("planning/plan.py: every term") is left alone.
  dotted    `pkg.module.name` where pkg is a package of the suite (PACKAGES) or a top-level
            module (TOP_MODULES): `modeling.model.param_specs`, `planning.check`,
            `compare.outcome`, `layout.options.NoOptions`; each step is a module, a name the
            module defines, or (after a class) a name its body defines.
  imported  in a .py file, `alias.name` where alias is a suite module the same file imports
            (`from layout import dispatch` makes `dispatch.send_rows` a reference); an alias
            the file never imports (a variable `plan.pos`) is not one.
  section   `README, "Set-up"` or `docs/planner.md, "Honesty"`: the page has a heading that
            holds the quoted words.

Read: the suite's .py files (the top level and PACKAGES) for their docstrings and comments,
README.md and docs/*.md whole. Not read: a bare identifier (`fsdp_use`), which prose cannot tell
from a term or a formula's name; write code as `path: name` or `pkg.module.name` to have it
checked. Each rule is a function over a repo root: test_a_wrong_name_is_caught writes a wrong
name of each kind into a new file of a copy and sees it reported, test_prose_is_not_a_reference
writes prose that must not be.
"""
import ast
import functools
import io
import os
import re
import shutil
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("parallel", "modeling", "layout", "measure", "strategies", "runtime", "kernels",
            "planning", "tests", "tools", "bench")
TOP_MODULES = ("run", "compare", "report", "command_line")
FILE_EXTS = ("py", "md", "json", "txt", "sh", "jsonl", "toml", "cfg")   # `run.py` is a path
# files a command writes that the repo does not hold (each with its writer)
WRITTEN_BY_A_RUN = {"kernels/mgpu_tiles.json": "python bench/gmm.py --autotune, on a Hopper GPU"}

IDENT = r"[A-Za-z_]\w*"
# a path: optional dirs, a name and an extension; not inside a longer path, a URL or a dotted name
PATH = re.compile(r"(?<![\w/.\-])((?:[A-Za-z_][\w\-]*/)*[A-Za-z_][\w\-]*\.(?:py|md|json|sh))\b")
MEMBER = re.compile(PATH.pattern + rf"(::|:[ \t]*|'s[ \t]+)(`?)({IDENT})")
DOTTED = re.compile(rf"(?<![\w.])((?:{'|'.join(PACKAGES + TOP_MODULES)})(?:\.{IDENT})+)")
SECTION = re.compile(r"(?<![\w/.\-])(README(?:\.md)?|docs/[\w\-]+\.md),?\s+\"([^\"]{1,80})\"")
HEADING = re.compile(r"^#+\s+(.*)$", re.M)


# ---------------------------------------------------------------------------- what the suite has
@functools.lru_cache(maxsize=None)
def python_files(root: str) -> tuple[str, ...]:
  """Every .py file of the suite, relative to root: the top level's and the packages'."""
  out = sorted(n for n in os.listdir(root) if n.endswith(".py"))
  for pkg in PACKAGES:
    for d, dirs, files in os.walk(os.path.join(root, pkg)):
      dirs[:] = sorted(n for n in dirs if not n.startswith(".") and n != "__pycache__")
      out += [os.path.relpath(os.path.join(d, f), root) for f in sorted(files)
              if f.endswith(".py")]
  return tuple(out)


def doc_files(root: str) -> list[str]:
  docs = os.path.join(root, "docs")
  return ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(docs)
                                if n.endswith(".md"))


def _targets(t) -> set[str]:
  if isinstance(t, ast.Name):
    return {t.id}
  if isinstance(t, (ast.Tuple, ast.List)):
    return set().union(*(_targets(e) for e in t.elts))
  if isinstance(t, ast.Starred):
    return _targets(t.value)
  return set()


def defined(body, imports: bool = True) -> dict[str, ast.AST]:
  """Names a module or class body binds at its own level (through if / try / with blocks)."""
  out = {}
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      out[node.name] = node
    elif isinstance(node, ast.Assign):
      out.update(dict.fromkeys(set().union(*(_targets(t) for t in node.targets)), node))
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
      out.update(dict.fromkeys(_targets(node.target), node))
    elif isinstance(node, (ast.Import, ast.ImportFrom)) and imports:
      out.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    for block in ("body", "orelse", "finalbody"):
      if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
        out.update({k: v for k, v in defined(getattr(node, block, []), imports).items()
                    if k not in out})
    if isinstance(node, ast.Try):
      for h in node.handlers:
        out.update({k: v for k, v in defined(h.body, imports).items() if k not in out})
  return out


@functools.lru_cache(maxsize=None)
def module_tree(root: str, rel: str) -> ast.Module:
  with open(os.path.join(root, rel)) as f:
    return ast.parse(f.read(), rel)


@functools.lru_cache(maxsize=None)
def module_names(root: str, rel: str) -> dict:
  return defined(module_tree(root, rel).body)


@functools.lru_cache(maxsize=None)
def module_idents(root: str, rel: str) -> frozenset:
  """Every identifier a module's code holds: its definitions at any depth (locals, arguments,
  keywords) and the names and attributes it reads (`jax.shard_map` -> shard_map)."""
  out = set()
  for node in ast.walk(module_tree(root, rel)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      out.add(node.name)
    elif isinstance(node, ast.Name):
      out.add(node.id)
    elif isinstance(node, ast.Attribute):
      out.add(node.attr)
    elif isinstance(node, (ast.arg, ast.keyword)) and node.arg:
      out.add(node.arg)
    elif isinstance(node, ast.alias):
      out.add((node.asname or node.name).split(".")[0])
  return frozenset(out)


@functools.lru_cache(maxsize=None)
def suite_names(root: str) -> frozenset:
  """Every name some module of the suite defines (def, class, assignment; not imports), at its
  top level or in a class body."""
  out = set()
  for rel in python_files(root):
    names = defined(module_tree(root, rel).body, imports=False)
    out |= set(names)
    for node in names.values():
      if isinstance(node, ast.ClassDef):
        out |= set(defined(node.body, imports=False))
  return frozenset(out)


@functools.lru_cache(maxsize=None)
def strategy_names(root: str) -> frozenset:
  """strategies.NAMES, read from strategies/__init__.py."""
  node = module_names(root, os.path.join("strategies", "__init__.py"))["NAMES"]
  return frozenset(ast.literal_eval(node.value))


@functools.lru_cache(maxsize=None)
def by_basename(root: str) -> dict[str, list[str]]:
  out = {}
  for rel in python_files(root):
    out.setdefault(os.path.basename(rel), []).append(rel)
  return out


def module_file(root: str, dotted: str) -> str | None:
  """'layout.fsdp' -> 'layout/fsdp.py' (or the package's __init__.py), if it exists."""
  rel = dotted.replace(".", "/")
  for cand in (rel + ".py", os.path.join(rel, "__init__.py")):
    if os.path.isfile(os.path.join(root, cand)):
      return cand
  return None


# ---------------------------------------------------------------------------- where names are
def comment_blocks(source: str) -> list[tuple[int, str]]:
  """(first line, text) of each run of comments on consecutive lines, '#' stripped."""
  blocks, last = [], None
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type != tokenize.COMMENT:
      continue
    line, text = tok.start[0], tok.string.lstrip("#").strip()
    if last is not None and line == last + 1:
      blocks[-1] = (blocks[-1][0], blocks[-1][1] + "\n" + text)
    else:
      blocks.append((line, text))
    last = line
  return blocks


def docstrings(tree: ast.Module) -> list[tuple[int, str]]:
  out = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
          and isinstance(body[0].value.value, str)):
        out.append((body[0].lineno, body[0].value.value))
  return out


def prose(root: str, rel: str) -> list[tuple[int, str]]:
  """(line, text) pieces of a file that state things about the code: a .py file's docstrings
  and comments, a page's whole text."""
  with open(os.path.join(root, rel)) as f:
    text = f.read()
  if not rel.endswith(".py"):
    return [(1, text)]
  return docstrings(module_tree(root, rel)) + comment_blocks(text)


def imported_modules(root: str, rel: str) -> dict[str, str]:
  """alias -> module file, for every import of a suite module anywhere in a .py file."""
  out = {}
  for node in ast.walk(module_tree(root, rel)):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.asname and (f := module_file(root, a.name)):
          out[a.asname] = f
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        if f := module_file(root, f"{node.module}.{a.name}"):
          out[a.asname or a.name] = f
  return out


# ---------------------------------------------------------------------------- the rules
def _placeholder(path: str) -> bool:
  """`strategies/NAME.py`, `tests/test_NAME.py`: a stem with an all-capitals word."""
  return any(re.fullmatch(r"[A-Z]{2,}", w) for p in path.split("/")
             for w in p.rsplit(".", 1)[0].split("_"))


def path_files(root: str, path: str) -> list[str] | None:
  """The files a written path names: [] when none exists, None when it is not the suite's."""
  if _placeholder(path):
    return None
  if "/" in path:
    if path.split("/", 1)[0] not in PACKAGES + ("docs",) or path in WRITTEN_BY_A_RUN:
      return None                               # another project's path, or a run's output
    return [path] if os.path.isfile(os.path.join(root, path)) else []
  if path.endswith(".py"):
    return by_basename(root).get(path, [])
  return [path] if os.path.isfile(os.path.join(root, path)) else None


def resolve_dotted(root: str, dotted: str) -> str | None:
  """None when `pkg.module.name...` names what exists, else what is missing."""
  parts = dotted.split(".")
  if any(p in FILE_EXTS for p in parts[1:]) or "NAME" in parts:
    return None                           # a file name (`run.py`) or a placeholder, not a module
  mod, i = parts[0], 1
  while i < len(parts) and module_file(root, f"{mod}.{parts[i]}"):
    mod, i = f"{mod}.{parts[i]}", i + 1
  if not module_file(root, mod):
    return f"no module {mod}"
  if i == len(parts):
    return None
  names = module_names(root, module_file(root, mod))
  node = names.get(parts[i])
  if node is None:
    return f"{module_file(root, mod)} defines no {parts[i]}"
  if i + 1 < len(parts) and isinstance(node, ast.ClassDef):
    if parts[i + 1] not in defined(node.body):
      return f"class {parts[i]} ({module_file(root, mod)}) has no {parts[i + 1]}"
  return None


def _reads_as_code(root: str, sep: str, tick: str, name: str) -> bool:
  """Whether the word after `path: ` / `path's ` names code: `::` or backticked; shaped like code
  (an underscore or an inner capital), but for a strategy's name ("test_precision.py's ep_tp
  row"); capitalised or, after ':', plain, and defined somewhere in the suite ("Saver")."""
  if sep == "::" or tick:
    return True
  if name in strategy_names(root):
    return False
  if "_" in name or any(c.isupper() for c in name[1:]):
    return True
  return (name[0].isupper() or sep.startswith(":")) and name in suite_names(root)


def _headings(root: str, page: str) -> list[str]:
  with open(os.path.join(root, page)) as f:
    return [h.replace("`", "").lower() for h in HEADING.findall(f.read())]


def problems_in(root: str, text: str, aliases: dict[str, str]) -> list[tuple[int, str]]:
  """(line offset in text, what is wrong) for every reference in text that names nothing."""
  out = []
  line = lambda pos: text.count("\n", 0, pos)
  for m in PATH.finditer(text):
    if path_files(root, m.group(1)) == []:
      out.append((line(m.start()), f"{m.group(1)}: no such file"))
  for m in MEMBER.finditer(text):
    path, sep, tick, name = m.groups()
    files = path_files(root, path)
    if not files or not path.endswith(".py") or not _reads_as_code(root, sep, tick, name):
      continue
    has = module_names if sep == "::" else module_idents   # `::`: a test, at the top level
    if not any(name in has(root, f) for f in files):
      out.append((line(m.start()), f"{path}{sep}{name}: {' / '.join(files)} defines no {name}"))
  for m in DOTTED.finditer(text):
    if why := resolve_dotted(root, m.group(1)):
      out.append((line(m.start()), f"{m.group(1)}: {why}"))
  if aliases:
    short = re.compile(rf"(?<![\w.])({'|'.join(map(re.escape, aliases))})\.({IDENT})")
    for m in short.finditer(text):
      alias, name = m.groups()
      if name in FILE_EXTS:
        continue
      if name not in module_names(root, aliases[alias]):
        out.append((line(m.start()), f"{alias}.{name}: {aliases[alias]} defines no {name}"))
  for m in SECTION.finditer(text):
    page = "README.md" if m.group(1).startswith("README") else m.group(1)
    if not os.path.isfile(os.path.join(root, page)):
      continue                                             # the path rule reports it
    want = " ".join(m.group(2).replace("`", "").lower().split())   # a quote may wrap a line
    if not any(want in h for h in _headings(root, page)):
      out.append((line(m.start()), f'{m.group(1)}, "{want}": no such heading in {page}'))
  return out


def problems(root: str, rel: str) -> list[str]:
  """'file:line: what' for every reference in one file that names nothing."""
  aliases = imported_modules(root, rel) if rel.endswith(".py") else {}
  return [f"{rel}:{start + off}: {why}"
          for start, text in prose(root, rel)
          for off, why in problems_in(root, text, aliases)]


# ---------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("rel", list(python_files(ROOT)) + doc_files(ROOT))
def test_every_name_exists(rel):
  found = problems(ROOT, rel)
  assert not found, "names that do not exist:\n" + "\n".join(found)


PROBE_HEAD = "from layout import dispatch\n\n"              # makes `dispatch.x` a reference


@pytest.fixture(scope="module")
def suite_copy(tmp_path_factory):
  """A copy of the suite's .py files and two pages, for probe files to be written into."""
  root = tmp_path_factory.mktemp("suite")
  for rel in list(python_files(ROOT)) + ["README.md", "docs/planner.md"]:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(ROOT, rel), root / rel)
  return root


def _probe(root, text) -> list[str]:
  """The problems of a new test file in root holding text (a name of its own per call)."""
  rel = os.path.join("tests", f"test_probe_{len(os.listdir(root / 'tests'))}.py")
  (root / rel).write_text(PROBE_HEAD + text)
  return problems(str(root), rel)


@pytest.mark.parametrize("text,want", [
    ("# see tests/test_nowhere.py\n", "tests/test_nowhere.py: no such file"),
    ("# see no_such_module.py\n", "no_such_module.py: no such file"),
    ("# measure/cost.py: no_such_term\n", "defines no no_such_term"),
    ("# tests/test_cp.py::test_nothing_at_all\n", "defines no test_nothing_at_all"),
    ("# strategies/ep.py's moe_bodyy\n", "defines no moe_bodyy"),
    ("# modeling.model.no_such_fn\n", "modeling/model.py defines no no_such_fn"),
    ("# planning.no_such_module\n", "planning/__init__.py defines no no_such_module"),
    ("# layout.options.NoOptions.no_field\n", "class NoOptions"),
    ("# dispatch.no_such_helper\n", "layout/dispatch.py defines no no_such_helper"),
    ('# (docs/planner.md, "No such section")\n', "no such heading"),
    ('# (README, "Planner")\n', "no such heading in README.md"),
])
def test_a_wrong_name_is_caught(suite_copy, text, want):
  found = _probe(suite_copy, text)
  assert len(found) == 1 and want in found[0], found


@pytest.mark.parametrize("text", [
    "# strategies/NAME.py and tests/test_NAME.py: placeholders\n",
    "# planning/plan.py: every term; run.py: exit status 2; ep.py's padded a2a\n",
    "# grug/ep_ring.py, jax/_src/lax.py: another project's files\n",
    "# plan.pos, mesh.shape, cfg.batch: variables, not modules this file imports\n",
    "# python run.py --plan; compare.py and report.py are files; e.g. tests.parity works\n",
    '# docs/planner.md, "Does it fit?" and (docs/planner.md, "Published setups")\n',
])
def test_prose_is_not_a_reference(suite_copy, text):
  assert _probe(suite_copy, text) == []
