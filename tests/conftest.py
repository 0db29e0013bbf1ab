"""The tiers, and shared fixtures: a small generated corpus so unit tests never need the real one.

Tiers: everything under tests/integration and tests/throttled spawns processes (cells, DHTs,
p2pd, network namespaces) and is marked `integration` and `slow` here; a unit test that spawns
processes or runs a study carries `slow` itself. `python3 -m pytest -m "not slow"` is the fast
tier, the developer's loop; `python3 -m pytest` (CI) runs both.

Under pytest-xdist (`-n 2 --dist loadgroup`, what CI runs) two tests run at once, and:
- the process grids (GRID_MODULES: eight-peer soaks, join grids, cell kills) run one after the
  other, on one worker (`xdist_group("grid")`): two at once would be 16+ processes on 2 cores;
- a test marked `alone` (one that measures rates, as the kernel-shaping cross-check does)
  holds an exclusive lock that every other test holds shared, so it waits for the test running
  beside it and none starts beside it (a turnstile keeps a stream of shared holders from
  starving it). One test at a time (no -n), the locks are
  never contended.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.testing.local_peers import generated_text

PROCESS_DIRS = {"integration", "throttled"}
GRID_MODULES = {  # eight-peer grids and cell kills: one at a time
    "test_soak_scale_quick.py",
    "test_join.py",
    "test_join_race.py",  # nine joins at once, then sixteen
    "test_faults_torch.py",
    "test_train_cluster.py",
    "test_gpu_check.py",
    "test_pools.py",  # a pooled torch grid and a kill
    "test_join_pools.py",  # pooled join grids, a kill and a move
}


# first: pytest-xdist's own hook (registered later, so called earlier) reads xdist_group
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = set(item.path.parts)
        if PROCESS_DIRS & parts:
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)
        if item.path.name in GRID_MODULES:
            item.add_marker(pytest.mark.xdist_group("grid"))


# outermost (tryfirst), so that the wait for the lock is not in pytest-timeout's time: a test's
# timeout bounds the test, not the test that ran beside it
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Under pytest-xdist: an `alone` test holds the run's test lock exclusively, every other
    test holds it shared (see the module docstring). The lock files lie in the run's base
    temporary folder, shared by its workers (pytest keeps the last three runs')."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    base = item.config._tmp_path_factory.getbasetemp().parent  # type: ignore[attr-defined]
    # POSIX record locks (lockf), not flock: a process forked by the test (a hivemind DHT, a
    # module fixture's peer that outlives it) does not inherit them, where it would hold a
    # flock as long as it lives, and a waiting `alone` test with it for ever
    with open(base / "tests.turnstile", "a+") as turnstile, open(base / "tests.lock", "a+") as lock:
        fcntl.lockf(turnstile, fcntl.LOCK_EX)
        fcntl.lockf(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.lockf(turnstile, fcntl.LOCK_UN)
        yield


@pytest.fixture(scope="session")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text(generated_text(60_000))
    return path
