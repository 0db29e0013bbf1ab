"""The tiers, and shared fixtures: a small generated corpus so unit tests never need the real one.

Tiers: everything under tests/integration and tests/throttled spawns processes (cells, DHTs,
p2pd, network namespaces) and is marked `integration` and `slow` here; a unit test that spawns
processes or runs a study carries `slow` itself. `python3 -m pytest -m "not slow"` is the fast
tier, the developer's loop; `python3 -m pytest` (CI) runs both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.bench.join_procs import generated_text

PROCESS_DIRS = {"integration", "throttled"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = set(item.path.parts)
        if PROCESS_DIRS & parts:
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)
        if "throttled" in parts:  # shaped links measure rates: one at a time (pytest-xdist)
            item.add_marker(pytest.mark.xdist_group("netns"))


@pytest.fixture(scope="session")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text(generated_text(60_000))
    return path
