"""Layers point one way: cli -> mesh -> comms, and inside them room by room.

Inside mesh: algo <- model, data <- engine <- runtime <- testing (the local grids' harness) <-
bench <- cli, with the run's vocabulary (config, errors, methods) at mesh's top; inside comms:
the core (codecs, wire, transport, throttle, netns, addrs, errors) <- the transports (p2p,
torchdist) <- build, their factory.

Checked on the import statements themselves: every one counts, at module level, inside a
function or under TYPE_CHECKING alike (a lazy import is still an arrow: it runs when the function
does). Not counted: modules imported by a name computed at run time (mesh.algo.optim's plugin
table, comms.build's optional backends), since no import statement names them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import cli
import comms
import mesh

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cli", "mesh", "comms")

# A module belongs to the longest room its name starts with; "mesh" is config, errors and the
# package itself, "comms" the transport-independent core.
COMMS = {"comms", "comms.p2p", "comms.torchdist", "comms.build"}
VOCABULARY = {"mesh", "mesh.methods"}
# the pure math may read config and errors, nothing else of mesh, and comms' core (the codecs
# and the group mean's formula, comms.transport.mean_in_member_order: one place for both)
ALGO = {"mesh", "comms"}
MODEL = VOCABULARY | {"mesh.algo"}
ENGINE = MODEL | {"mesh.model", "mesh.data"} | COMMS
RUNTIME = ENGINE | {"mesh.engine"}
TESTING = RUNTIME | {"mesh.runtime"}
BENCH = TESTING | {"mesh.testing"}
# room -> the other rooms it may import (its own is always allowed)
MAY_IMPORT: dict[str, set[str]] = {
    "comms": set(),
    "comms.p2p": {"comms"},
    "comms.torchdist": {"comms"},
    "comms.build": {"comms", "comms.p2p", "comms.torchdist"},
    # config checks a pipeline window with mesh.algo.schedule; its choices name comms' codecs,
    # backends and link presets (comms.names)
    "mesh": {"mesh.algo", "comms"},
    "mesh.methods": {"mesh"},
    "mesh.algo": ALGO,
    "mesh.model": MODEL,
    "mesh.data": MODEL | {"comms"},  # comms.procs: a dead writer's leftovers are litter
    "mesh.engine": ENGINE,
    "mesh.runtime": RUNTIME,
    "mesh.testing": TESTING,  # the local grids' harness: benchmarks and tests only
    "mesh.bench": BENCH,  # and only cli imports the benchmarks
    "cli": TESTING | {"mesh.bench"},
}


def _modules() -> dict[str, Path]:
    """Every module of the three packages by dotted name (a package by its own name)."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module (or package) of ours that a dotted name refers to, if any."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, module of ours) for every import statement in the file, wherever it stands."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (target := _resolve(a.name)) is not None:
                    yield node.lineno, target
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from its package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                target = _resolve(f"{base}.{a.name}") or _resolve(base)
                if target is not None:
                    yield node.lineno, target


GRAPH = {m: {t for _, t in _imported(m, p) if t != m} for m, p in MODULES.items()}


def _room(module: str) -> str:
    return max((r for r in MAY_IMPORT if module == r or module.startswith(r + ".")), key=len)


def _circles() -> list[list[str]]:
    """One shortest circle per strongly connected group of modules, as a path back to its start."""
    reach = {m: _reachable(m) for m in GRAPH}
    out, seen = [], set()
    for m in sorted(GRAPH):
        if m in seen or m not in reach[m]:
            continue
        group = {n for n in reach[m] if m in reach[n]}
        seen |= group
        out.append(_shortest_path(m, m, group))
    return out


def _reachable(start: str) -> set[str]:
    """Modules reachable from start by one or more imports."""
    found: set[str] = set()
    todo = list(GRAPH[start])
    while todo:
        m = todo.pop()
        if m not in found:
            found.add(m)
            todo.extend(GRAPH[m])
    return found


def _shortest_path(start: str, end: str, within: set[str]) -> list[str]:
    """Breadth first from start to end through `within`: [start, ..., end]."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for t in sorted(GRAPH[m] & within):
                if t == end:
                    path = [m]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), end]
                if t not in prev:
                    prev[t] = m
                    nxt.append(t)
        frontier = nxt
    raise AssertionError(f"no path {start} -> {end}")


def test_layers_point_one_way():
    """Every import runs down the layers (by room), and no modules import each other in a
    circle, however long."""
    bad = []
    for module, path in sorted(MODULES.items()):
        room = _room(module)
        allowed = MAY_IMPORT[room] | {room}
        for line, target in _imported(module, path):
            if _room(target) not in allowed:
                where = f"{path.relative_to(ROOT)}:{line}"
                bad.append(f"{where} ({room}) imports {target} ({_room(target)})")
    bad += [f"import circle: {' -> '.join(c)}" for c in _circles()]
    assert not bad, "\n".join(bad)


# The benchmarks and the tests' harness are no part of the product: only the bench commands and
# the benchmarks themselves import mesh.bench (a product command's tables and plots come from
# mesh.report), and nothing of cli, mesh or comms imports a module of tests/.
BENCH_COMMANDS = ("cli.bench", "cli.bench_grids", "cli.bench_system")
TEST_MODULES = {"tests"} | {p.stem for p in (ROOT / "tests").rglob("*.py")}


def test_the_product_imports_no_benchmark_and_no_test_harness():
    bad = []
    for module, path in sorted(MODULES.items()):
        where = path.relative_to(ROOT)
        if _room(module) != "mesh.bench" and module not in BENCH_COMMANDS:
            for line, target in _imported(module, path):
                if _room(target) == "mesh.bench":
                    bad.append(f"{where}:{line} imports the benchmark {target}")
                if _room(target) == "mesh.testing" and _room(module) != "mesh.testing":
                    bad.append(f"{where}:{line} imports the test harness {target}")
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in TEST_MODULES:
                    bad.append(f"{where}:{node.lineno} imports {name} (tests/)")
    assert not bad, "\n".join(bad)


def test_our_packages_are_the_ones_imported():
    for pkg in (cli, mesh, comms):
        assert Path(pkg.__file__).resolve().is_relative_to(ROOT), pkg.__file__


def test_no_unsafe_deserialization():
    pattern_hits = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                    if name in {"loads", "load"} and "pickle" in ast.unparse(f):
                        pattern_hits.append(f"{path}: {ast.unparse(node)}")
                    if name in {"eval", "exec"} and isinstance(f, ast.Name):
                        pattern_hits.append(f"{path}: {ast.unparse(node)}")
                    if ast.unparse(f) == "torch.load" and not any(
                        k.arg == "weights_only" for k in node.keywords
                    ):
                        pattern_hits.append(f"{path}: {ast.unparse(node)}")
    assert not pattern_hits, pattern_hits
