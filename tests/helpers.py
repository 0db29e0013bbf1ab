"""What several test files share: the tiny model's overrides and a bounded wait (a tiny run's
TOML for `join` peers: mesh.testing.local_peers.tiny_grid_config).

Imported as `helpers` (pytest puts tests/, where conftest.py lives, on sys.path).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from mesh.testing import local_peers

# --set overrides of the smallest model the tests train: 2 blocks of d=16.
TINY_MODEL = ["model.n_layers=2", "model.d_model=16", "model.n_heads=2", "model.seq_len=16"]
# ... and of a run of it that is quick to train and evaluate.
TINY = [
    *TINY_MODEL,
    "pipeline.microbatch_size=2",
    "data.val_batches=2",
    "optim.warmup_steps=2",
]


# the bounded wait lives with the local-grid helpers that `meshtrain bench join` shares with the
# join tests (mesh/testing/local_peers.py); this is the same function
wait_for = local_peers.wait_for


def cli(*args: str, cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """`meshtrain ARGS` in its own process (forked from the preloaded server:
    mesh.testing.prefork) run to its end: the exit code and the streams a user sees."""
    p = local_peers.meshtrain(
        *args, key=None, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = local_peers.finish(p, timeout_s)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


class BootNode:
    """A bootstrap DHT node on 127.0.0.1 for a test's peers, in a spawned process
    (comms.build.local_rendezvous): one hivemind forks from a test process that holds threads
    (an earlier test's transports, gloo groups) can hang before it says ready. It answers the
    two calls the tests make of a hivemind.DHT: get_visible_maddrs() and shutdown()."""

    def __init__(self) -> None:
        from comms.build import local_rendezvous

        self._rendezvous = local_rendezvous("hivemind")
        self._maddrs: list[str] = list(self._rendezvous.__enter__().initial_peers)

    def get_visible_maddrs(self) -> list[str]:
        return list(self._maddrs)

    def shutdown(self) -> None:
        self._rendezvous.__exit__(None, None, None)

    def join(self, timeout_s: float | None = None) -> None:
        """shutdown() already waited for the node's process."""


def hivemind_files(pids, since: float) -> list[Path]:
    """/tmp/hivemind-PID-* files of these pids made at or after `since` (time.time()): pids
    wrap at 32768, and a file an earlier process of the same pid left is not the test's."""
    out = []
    for pid in pids:
        for f in Path("/tmp").glob(f"hivemind-{pid}-*"):
            try:
                if f.lstat().st_mtime >= since:
                    out.append(f)
            except OSError:  # removed meanwhile
                pass
    return out
