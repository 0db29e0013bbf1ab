"""Layers point one way: cli -> mesh -> comms. Checked on the import statements themselves."""

import ast
from pathlib import Path

import cli
import comms
import mesh

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"comms": {"mesh", "cli"}, "mesh": {"cli"}, "cli": set()}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_layers_point_one_way():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in (ROOT / package).rglob("*.py"):
            hit = _imports(path) & forbidden
            if hit:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(hit)}")
    assert not bad, bad


def test_our_packages_are_the_ones_imported():
    for pkg in (cli, mesh, comms):
        assert Path(pkg.__file__).resolve().is_relative_to(ROOT), pkg.__file__


def test_no_unsafe_deserialization():
    pattern_hits = []
    for package in FORBIDDEN:
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
