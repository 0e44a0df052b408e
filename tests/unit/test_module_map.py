"""docs/architecture.md's module map lists every Python module of the packages, and only those;
the tests its failure tables name exist; every pointer to one of its sections names a heading it has.

The map is the table under the heading ``## Module map``: one row per module, its path in
backticks in the first column (``| `ps_server/store.py` | role |``). Generated code
(``services/pb/``) and tests are not listed.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("shardline", "services", "ps_server", "dispatcher", "rack_cache", "worker", "jobs")
NOT_LISTED = ("services/pb/",)
HEADING = "## Module map"
ROW = re.compile(r"^\|\s*`([^`]+\.py)`\s*\|")


def modules_in_tree() -> set[str]:
    found = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if "__pycache__" in rel or rel.startswith(NOT_LISTED):
                continue
            found.add(rel)
    return found


def modules_in_map() -> list[str]:
    """The first-column paths of the module map's rows, in order (duplicates kept)."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    try:
        start = lines.index(HEADING)
    except ValueError:
        raise AssertionError(f"{DOC.relative_to(REPO)} has no '{HEADING}' heading") from None
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        match = ROW.match(line)
        if match:
            rows.append(match.group(1))
    return rows


def test_module_map_matches_the_tree():
    listed = modules_in_map()
    tree = modules_in_tree()
    missing = sorted(tree - set(listed))
    stale = sorted(set(listed) - tree)
    repeated = sorted({m for m in listed if listed.count(m) > 1})
    problems = []
    if missing:
        problems.append("add a row for each module in the tree but not in the map:\n" + "\n".join(
            f"  | `{m}` | <one-line role> |" for m in missing))
    if stale:
        problems.append("remove the row of each module in the map but not in the tree:\n" + "\n".join(
            f"  | `{m}` | ..." for m in stale))
    if repeated:
        problems.append("keep one row of each module listed twice:\n" + "\n".join(
            f"  | `{m}` | ..." for m in repeated))
    assert not problems, (f"{DOC.relative_to(REPO)}, '{HEADING}' is out of date with the tree:\n"
                          + "\n".join(problems))


def test_every_row_names_a_role():
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADING)
    empty = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        match = ROW.match(line)
        if match:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 2 or not cells[1]:
                empty.append(match.group(1))
    assert not empty, "rows of the module map without a role: " + ", ".join(empty)


def test_every_test_the_doc_names_exists():
    """The failure tables name the tests that cover each case: a test renamed or removed must take
    its mention in docs/architecture.md along."""
    doc = DOC.read_text(encoding="utf-8")
    tests = REPO / "tests"
    files = {path.name for path in tests.rglob("test_*.py")}
    missing_paths = sorted(p for p in set(re.findall(r"tests/[\w/]+\.py", doc)) if not (REPO / p).exists())
    missing_files = sorted(set(re.findall(r"(?<![/\w])(test_\w+\.py)", doc)) - files)
    source = "\n".join(path.read_text(encoding="utf-8") for path in tests.rglob("*.py"))
    defined = set(re.findall(r"def (test_\w+)", source))
    missing_tests = sorted(set(re.findall(r"`(test_\w+)`", doc)) - defined)
    assert not (missing_paths or missing_files or missing_tests), (
        f"{DOC.relative_to(REPO)} names tests that do not exist: files {missing_paths + missing_files}, "
        f"test functions {missing_tests}")


# A pointer to a section (architecture.md, then the heading in double quotes) in code, docs or bench
# must name a heading of the doc.
SECTION_REF = re.compile(r'architecture\.md, "([^"]+)"')
REF_FOLDERS = PACKAGES + ("docs", "bench", "deploy", "tests", "examples")


def test_every_section_pointer_names_a_heading():
    headings = {re.sub(r"^#+\s+", "", line).strip()
                for line in DOC.read_text(encoding="utf-8").splitlines() if re.match(r"^#{2,4} ", line)}
    dangling = []
    for folder in REF_FOLDERS:
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in (".py", ".md", ".yaml") or "__pycache__" in path.parts:
                continue
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for section in SECTION_REF.findall(line):
                    if section not in headings:
                        dangling.append(f"{path.relative_to(REPO)}:{lineno}: \"{section}\"")
    assert not dangling, ("these point at a section docs/architecture.md does not have (rename the pointer "
                          "to an existing '## ' or '### ' heading, or add the section):\n  " + "\n  ".join(dangling))
