"""Optional packages are extras (pyproject.toml): core is what a peer needs to train and talk;
a feature whose extra is missing says so in one line, before any cell starts, and a plot is
skipped with a note, not a crash. 'Missing' here is the import failing, as on a core install."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from cli.preflight import check_extras
from mesh import report
from mesh.config import load_config
from mesh.errors import EXTRAS, MissingExtra

ROOT = Path(__file__).resolve().parents[2]


def test_core_holds_no_extra_and_all_holds_every_one():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].split("<")[0] for d in project["dependencies"]}
    packages = {package for _, package in EXTRAS.values()}
    assert not core & packages, core & packages
    extras = project["optional-dependencies"]
    listed = {d.split(">")[0] for name, deps in extras.items() for d in deps}
    assert packages <= listed
    assert {extra for extra, _ in EXTRAS.values()} <= set(extras)


@pytest.mark.parametrize(
    ("module", "key", "value"),
    [
        ("tensorboard", "metrics.tensorboard", "true"),
        ("prometheus_client", "metrics.prometheus_port", "9400"),
        ("bitsandbytes", "optim.state_8bit", "true"),
    ],
)
def test_a_feature_without_its_extra_is_one_line(monkeypatch, module, key, value):
    cfg = load_config([], [f"{key}={value}"])
    monkeypatch.setitem(sys.modules, module, None)  # import fails, find_spec raises/returns
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(MissingExtra, match=rf"{key} needs .*pip install 'meshtrain\["):
        check_extras(cfg)
    check_extras(load_config([], []))  # off: nothing asked of the extra


def test_a_plot_without_matplotlib_is_skipped_with_a_note(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(report, "_SAID", set())
    path = tmp_path / "loss.png"
    report.plot_curves({"a": [(1.0, 2.0), (2.0, 1.0)]}, path, "x", "y", "t")
    report.plot_curves({"a": [(1.0, 2.0)]}, path, "x", "y", "t")
    assert not path.exists()
    err = capsys.readouterr().err
    assert err.count("pip install 'meshtrain[plots]'") == 1, err  # said once


def test_a_plot_with_matplotlib_is_written(tmp_path):
    path = tmp_path / "loss.png"
    report.plot_curves({"a": [(1.0, 2.0), (2.0, 1.0)]}, path, "x", "y", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
