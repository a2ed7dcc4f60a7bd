"""The README is a front door and docs/ a manual in the present tense, held so:

  readme_length   README.md is at most MAX_README_LINES lines
  docs_pages      docs/ holds at least MIN_DOC_PAGES pages
  no_history      no date (2026-11-26) or commit hash (7-40 hex digits with a digit and a letter)
                  in README.md or docs/*.md, but for docs/results.md, the one results log
  links           every relative link in README.md and docs/*.md names a file that exists
  strategy table  README.md's generated strategy table is what `tools/readme_tables.py` writes
                  (`python tools/readme_tables.py --check`); the comparison block is checked
                  against a fresh `python run.py --report_dir` elsewhere (slow)

Each rule is a function over a repo root, so the `*_catches_*` tests run it on a copy with the
rule broken and see it fail.
"""
import os
import re
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import readme_tables  # noqa: E402

MAX_README_LINES = 300
MIN_DOC_PAGES = 6
RESULTS_LOG = "results.md"

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HEX_WORD = re.compile(r"\b[0-9a-f]{7,40}\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def doc_pages(root: str) -> list[str]:
  docs = os.path.join(root, "docs")
  return sorted(os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md"))


def manual(root: str) -> list[str]:
  """README.md and every docs page: the files that state what is."""
  return [os.path.join(root, "README.md")] + doc_pages(root)


def commit_hashes(text: str) -> list[str]:
  """Words of 7-40 hex digits holding both a digit and a letter: 'd919d46', not 'deadbee' (no
  digit), '1234567' (no letter), 'e5m2' or 'a2a10' (too short, or not hex)."""
  return [w for w in HEX_WORD.findall(text)
          if re.search(r"[0-9]", w) and re.search(r"[a-f]", w)]


def history(root: str) -> list[str]:
  """'file:line: what' for every date or commit hash outside the results log."""
  out = []
  for path in manual(root):
    if os.path.basename(path) == RESULTS_LOG and os.path.dirname(path).endswith("docs"):
      continue
    with open(path) as f:
      for i, line in enumerate(f, 1):
        found = DATE.findall(line) + commit_hashes(line)
        if found:
          out.append(f"{os.path.relpath(path, root)}:{i}: {', '.join(found)}")
  return out


def broken_links(root: str) -> list[str]:
  """'file: target' for every relative link whose file does not exist (anchors not checked)."""
  out = []
  for path in manual(root):
    with open(path) as f:
      text = FENCE.sub("", f.read())
    for target in LINK.findall(text):
      if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        continue                                    # a URL, mailto:, or an anchor on the page
      name = target.split("#", 1)[0]
      if not os.path.exists(os.path.join(os.path.dirname(path), name)):
        out.append(f"{os.path.relpath(path, root)}: {target}")
  return out


def readme_lines(root: str) -> int:
  with open(os.path.join(root, "README.md")) as f:
    return len(f.read().splitlines())


def test_readme_is_at_most_300_lines():
  n = readme_lines(ROOT)
  assert n <= MAX_README_LINES, f"README.md has {n} lines; move reference material to docs/"


def test_docs_has_at_least_6_pages():
  pages = doc_pages(ROOT)
  assert len(pages) >= MIN_DOC_PAGES, pages


def test_no_dates_or_commit_hashes_outside_the_results_log():
  found = history(ROOT)
  assert not found, "dates and hashes belong in docs/results.md:\n" + "\n".join(found)


def test_every_relative_link_names_a_file_that_exists():
  bad = broken_links(ROOT)
  assert not bad, "\n".join(bad)


def test_readme_strategy_table_is_what_the_script_writes():
  assert readme_tables.main(["--check"]) == 0, (
      "README.md's strategy table is stale: run python tools/readme_tables.py")


# Each rule, broken on a copy: it must fail there.

@pytest.fixture
def repo(tmp_path):
  """README.md and docs/ copied to tmp_path: a root each rule can be run on and broken in."""
  shutil.copy(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
  shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs")
  for rel in _linked_outside(ROOT):
    dst = tmp_path / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.touch()
  return tmp_path


def _linked_outside(root):
  """Relative paths (from the root) of linked files outside README.md and docs/."""
  out = set()
  for path in manual(root):
    with open(path) as f:
      text = FENCE.sub("", f.read())
    for target in LINK.findall(text):
      if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        continue
      full = os.path.normpath(os.path.join(os.path.dirname(path), target.split("#", 1)[0]))
      rel = os.path.relpath(full, root)
      if rel != "README.md" and not rel.startswith("docs" + os.sep) and not rel.startswith(".."):
        out.add(rel)
  return sorted(out)


def _append(path, text):
  with open(path, "a") as f:
    f.write(text)


def test_readme_length_catches_a_long_readme(repo):
  assert readme_lines(repo) <= MAX_README_LINES
  _append(repo / "README.md", "line\n" * (MAX_README_LINES + 1))
  assert readme_lines(repo) > MAX_README_LINES


def test_docs_pages_catches_too_few_pages(repo):
  for path in doc_pages(str(repo))[MIN_DOC_PAGES - 1:]:
    os.remove(path)
  assert len(doc_pages(str(repo))) < MIN_DOC_PAGES


@pytest.mark.parametrize("where", ["README.md", "docs/planner.md"])
@pytest.mark.parametrize("text", ["measured 2026-11-26 on this host", "at d919d46, cold",
                                  "commit 0123456789abcdef0123456789abcdef01234567"])
def test_history_catches_a_date_or_hash(repo, where, text):
  assert not history(str(repo))
  _append(repo / where, f"\n{text}\n")
  assert history(str(repo))


def test_history_allows_the_results_log_and_look_alikes(repo):
  _append(repo / "docs" / RESULTS_LOG, "\n2026-11-26 at d919d46\n")
  _append(repo / "README.md", "\ne5m2 a2a10 1f1b deadbee 1234567 ragged_dot abc123 ffffff\n")
  assert not history(str(repo))


@pytest.mark.parametrize("link", ["[x](docs/missing.md)", "[x](docs/missing.md#anchor)",
                                  "[x](strategies/missing.py)"])
def test_links_catch_a_missing_file(repo, link):
  assert not broken_links(str(repo))
  _append(repo / "README.md", f"\n{link}\n")
  assert broken_links(str(repo))


def test_links_skip_urls_anchors_and_code(repo):
  _append(repo / "README.md", "\n[a](https://example.com/x) [b](#the-folders) [c](mailto:a@b)\n"
                              "```\n[d](not/a/file.md)\n```\n")
  assert not broken_links(str(repo))


def test_strategy_table_check_catches_a_hand_edit(repo):
  readme = repo / "README.md"
  assert readme_tables.main(["--check", "--readme", str(readme)]) == 0
  text = readme.read_text()
  table = readme_tables.read_block(text, "strategies")
  readme.write_text(readme_tables.replace_block(text, "strategies",
                                                table.replace("| `ep` |", "| `ep` (edited) |")))
  assert readme_tables.main(["--check", "--readme", str(readme)]) == 1


def test_comparison_check_catches_a_hand_edit(repo, tmp_path_factory):
  """The comparison block against a report's table.md: equal passes, an edited cell fails."""
  report = tmp_path_factory.mktemp("report")
  readme = repo / "README.md"
  block = readme_tables.read_block(readme.read_text(), "comparison")
  (report / "table.md").write_text(block + "\n")
  assert readme_tables.main(["--check", "--readme", str(readme), "--report_dir", str(report)]) == 0
  (report / "table.md").write_text(block.replace("PASS", "FAIL", 1) + "\n")
  assert readme_tables.main(["--check", "--readme", str(readme), "--report_dir", str(report)]) == 1
