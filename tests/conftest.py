"""Shared fixtures: a small generated corpus so unit tests never need the real one."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.bench.join_procs import generated_text


@pytest.fixture(scope="session")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text(generated_text(60_000))
    return path
