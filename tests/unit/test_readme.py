"""The README against the tree: its layout section names paths that exist and every package,
its tables keep one column count, its results rows stay short, its links point at files.

The layout section is a code block of entries: a line at column 0 names a top-level directory,
a line at column 2 an entry inside it, deeper lines describe the entry above. A path named
anywhere in an entry (`stage.py`, `dashboard/`, `scale_model*.py`) is resolved against that
entry's directory, then the top-level directory, then the repository root; one of them must
hold it. Placeholders (`results/<name>/`) and the lines marked "(not in git)" are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# the results table's cells: one claim a row, the depth in docs/results.md (issue #60, item 5)
MAX_RESULTS_CELL = 300
PACKAGE_ROOTS = ("cli", "comms", "mesh")
# file kinds the layout's descriptions name, not paths of the tree
NOT_PATHS = {"config.json", "tokenizer.json"}
# a path-like token: ends in a file extension or a slash
PATH_TOKEN = re.compile(r"[\w*<>.-][\w*<>./-]*(?:\.(?:py|toml|sh|md|json|html)|/)(?![\w/])")


def section(text: str, heading: str) -> str:
    """The body of `## heading` up to the next `## `."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def layout_block() -> list[str]:
    body = section(README.read_text(), "Layout")
    match = re.search(r"```\n(.*?)```", body, re.S)
    assert match, "the Layout section has no code block"
    return match.group(1).splitlines()


def resolve(token: str, bases: list[Path]) -> Path | None:
    """The first base that holds token (a glob where it has a star), else None."""
    name = token.rstrip("/")
    for base in bases:
        if "*" in name:
            hits = sorted(base.glob(name))
            if hits:
                return hits[0]
        elif (base / name).exists():
            return base / name
    return None


def layout_paths() -> tuple[set[Path], list[str]]:
    """Every path the layout names, resolved; and the tokens that resolve nowhere."""
    found: set[Path] = set()
    missing: list[str] = []
    top: Path | None = None
    entry: Path | None = None
    skip = False  # inside a placeholder's entry (results/<name>/) or one not in git
    for line in layout_block():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        first = line.split()[0]
        if indent == 0:
            top = ROOT / first.rstrip("/") if first.endswith("/") else None
            entry = None
            skip = "<" in first or "(not in git)" in line
        elif indent == 2 and top is not None:
            entry = top / first.rstrip("/") if first.endswith("/") else None
        if skip:
            continue
        bases = [b for b in (entry, top, ROOT) if b is not None]
        for token in PATH_TOKEN.findall(line):
            if "<" in token or token.startswith(".") or token in NOT_PATHS:
                continue
            hit = resolve(token, bases)
            if hit is None:
                missing.append(f"{token} (in: {line.strip()[:60]})")
            else:
                found.add(hit.resolve())
    return found, missing


def test_every_path_the_layout_names_exists() -> None:
    found, missing = layout_paths()
    assert found
    assert not missing, "the README's Layout names paths that are not in the tree: " + "; ".join(
        missing
    )


def test_the_layout_names_every_package() -> None:
    found, _ = layout_paths()
    packages = [
        init.parent
        for root in PACKAGE_ROOTS
        for init in sorted((ROOT / root).rglob("__init__.py"))
        if "__pycache__" not in init.parts
    ]
    assert {ROOT / r for r in PACKAGE_ROOTS} <= set(packages)
    unnamed = [str(p.relative_to(ROOT)) for p in packages if p.resolve() not in found]
    assert not unnamed, f"packages the README's Layout does not name: {unnamed}"


def test_the_layout_names_the_depth_study() -> None:
    found, _ = layout_paths()
    for rel in ("mesh/depth_rule.py", "mesh/bench/depth.py", "mesh/bench/depth_arms.py"):
        assert (ROOT / rel).resolve() in found, rel


def test_every_docs_page_is_linked_from_the_readme() -> None:
    # the layout says of docs/: "the pages linked above"
    text = README.read_text()
    unlinked = [
        p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{p.name}" not in text
    ]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def table_rows(text: str) -> list[list[list[str]]]:
    """Each markdown table in text (outside code blocks) as its rows of stripped cells."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        row = line.strip()
        if not fenced and row.startswith("|") and row.endswith("|"):
            current.append([c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]])
            continue
        if current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def test_tables_keep_one_column_count() -> None:
    for path in (README, ROOT / "docs" / "results.md"):
        tables = table_rows(path.read_text())
        assert tables, path
        for rows in tables:
            counts = {len(r) for r in rows}
            assert len(counts) == 1, f"{path.name}: a table with rows of {counts} cells: {rows[0]}"


def test_results_rows_are_short() -> None:
    tables = table_rows(section(README.read_text(), "Results"))
    assert len(tables) == 1, "one results table"
    rows = tables[0]
    assert rows[0][:3] == ["what (model, tokens, reference)", "measured", "target"]
    for row in rows[2:]:
        for cell in row:
            assert len(cell) <= MAX_RESULTS_CELL, f"a results cell of {len(cell)} chars: {cell}"
    assert any("results/depth" in " ".join(row) for row in rows)  # the depth study's row


def test_the_readmes_relative_links_point_at_files() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    broken = []
    for target in targets:
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z]+:", path):
            continue
        if not (ROOT / path).exists():
            broken.append(target)
    assert not broken, f"README links to files that are not in the tree: {broken}"
