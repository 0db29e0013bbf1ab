"""A local grid of `meshtrain dht` / `join` / `status` processes on 127.0.0.1.

Shared by `meshtrain bench join` (mesh/bench/join.py) and tests/integration/test_join.py: start a
meshtrain subprocess, read a cell's progress from its metrics file, wait for a condition, stop a
process. Every process runs in its own session, so a hung one is killed with its children
(p2pd) by its process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from comms.procs import process_tree
from mesh.algo.topology import Grid
from mesh.runtime.metrics import cell_of_file, newest_metrics_file, read_metrics
from mesh.testing.procstat import hivemind_sockets

if TYPE_CHECKING:
    from mesh.testing.prefork import Preforked

KEY = "correct horse battery staple"  # the run key of these local grids
LOOPBACK = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
# a join grid's pace (tiny_grid_config's min_compute_ms): each forward and backward at least
# this long, as on a device. Flat out, tiny cells' messages and bookkeeping took the 2 cores
# (about 50 updates a second each), and every process started beside them (a join, `status`)
# started slower: the sixth join of a pooled grid took 27 s to train, paced 7 s
PACE_MS = 50.0


WORDS = (
    "the king and queen of the realm speak to their lords with grace and fury while the fool "
    "laughs at all of them under a grey sky that will not rain though every man prays for it"
).split()


def generated_text(n_bytes: int, seed: int = 0) -> str:
    """Sentences of random words: enough text for a tiny model to learn from (the local grids'
    corpus, and the tests')."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < n_bytes:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + ".\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


def tiny_grid_config(
    directory: Path,
    text_file: Path | None,
    replicas: int = 2,
    local: str = "",
    steps: int = 100000,
    stages: int = 2,
    heartbeat_s: float = 1.0,
    round_timeout_s: float = 5,
    d_model: int = 16,
    seq_len: int = 16,
    schedule_steps: int | None = None,
    dp: str = "",
    slowdown: float = 1.0,
    min_compute_ms: float = 0.0,
) -> Path:
    """A `stages` x `replicas` grid of a tiny model (one block per stage) on `text_file` (None:
    the default corpus, Shakespeare) that runs until stopped (run.toml); `local`: more TOML
    lines of dotted keys of the local sections (e.g. 'elastic.rejoin_timeout_s = 600');
    `steps`: the run's horizon; `schedule_steps`: the lr and lambda schedules' (None: `steps`);
    `dp`: TOML lines for its [dp] table; `slowdown`: every cell's emulation.slowdowns factor
    (a cell then waits (slowdown - 1) x the CPU time of each forward and backward; its
    messages and bookkeeping are not slowed); `min_compute_ms`: emulation.min_compute_ms, a
    floor on each forward and backward (a grid of tiny cells paced as on devices, so that
    their messages leave CPU to the processes a test starts beside them)."""
    cells = [f'"{name}={slowdown}"' for name in Grid(stages, replicas).names()]
    if slowdown != 1.0:
        local = f"emulation.slowdowns = [{', '.join(cells)}]\n{local}"
    if min_compute_ms:
        local = f"emulation.min_compute_ms = {min_compute_ms}\n{local}"
    path = directory / "run.toml"
    data = "" if text_file is None else f'path = "{text_file}"\n'
    path.write_text(
        f"""
elastic.heartbeat_s = {heartbeat_s}
elastic.max_lag_steps = 5
transport.round_timeout_s = {round_timeout_s}
{local}
[model]
n_layers = {stages}
d_model = {d_model}
n_heads = 2
seq_len = {seq_len}
[grid]
stages = {stages}
replicas = {replicas}
[pipeline]
microbatch_size = 2
[dp]
{dp}
[data]
{data}val_batches = 2
[run]
steps = {steps}
{"" if schedule_steps is None else f"schedule_steps = {schedule_steps}"}
"""
    )
    return path


def meshtrain(
    *args: str,
    key: str | None = KEY,
    env_extra: dict[str, str] | None = None,
    fresh: bool = False,
    **popen_kw: Any,
) -> subprocess.Popen | Preforked:
    """Start `meshtrain ARGS` in its own session, with run key `key` (and the environment
    variables env_extra): a fork of the preloaded fork server (mesh.testing.prefork: ~0.1 s of
    CPU, not the ~4 s of a fresh interpreter's imports), or with fresh=True a new interpreter
    (this one) running `python -m cli.main ARGS`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    env.pop("MESHTRAIN_RUN_KEY", None)
    if key is not None:
        env["MESHTRAIN_RUN_KEY"] = key
    if not fresh:
        from mesh.testing.prefork import Preforked  # imports torch: not at this module's import

        return Preforked(list(args), env, **popen_kw)
    cmd = [sys.executable, "-m", "cli.main", *args]
    return subprocess.Popen(cmd, env=env, start_new_session=True, text=True, **popen_kw)


def run_meshtrain(
    *args: str, key: str | None = KEY, timeout_s: float = 60
) -> tuple[int, str, float]:
    """Run `meshtrain ARGS` to its end: (exit code, stdout+stderr, seconds it took)."""
    t0 = time.monotonic()
    p = meshtrain(*args, key=key, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = finish(p, timeout_s)
    return p.returncode, out, time.monotonic() - t0


def finish(p: Any, timeout_s: float) -> tuple[Any, Any]:
    """p.communicate() within timeout_s; past it, p and its process group are killed and
    TimeoutExpired raised (a hung command must not outlive its caller)."""
    try:
        return p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill(p)
        raise


def start_dht() -> tuple[subprocess.Popen, str]:
    """A bootstrap node on 127.0.0.1 and the multiaddr it printed first."""
    dht = meshtrain("dht", *LOOPBACK, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return dht, dht.stdout.readline().strip()


def status(maddr: str, key: str | None = KEY) -> dict:
    """`meshtrain status --json` of the run behind `maddr`."""
    code, out, _ = run_meshtrain("status", "--initial-peers", maddr, "--json", key=key)
    if code != 0:
        raise AssertionError(f"status exited {code}: {out}")
    return json.loads(out[out.index("{") :])


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str, period_s: float = 0.3) -> None:
    """Poll `cond` until it is true; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(period_s)


def cell_of(out: Path) -> tuple[int, int] | None:
    """(stage, replica) of the cell a join runs in run directory `out`, its newest if it held
    several (a claim lost to a racing join, a move); None before it wrote."""
    path = newest_metrics_file(out)
    return None if path is None else cell_of_file(path)


def rows(out: Path) -> list[dict]:
    """The metrics rows (events too) of the cell a join runs in run directory `out` (cell_of)."""
    cell = cell_of(out)
    return [] if cell is None else read_metrics(out, events=True).get(cell, [])


def step(out: Path) -> int:
    """The cell's last update in run directory `out` (0 before its first)."""
    return max((r["step"] for r in rows(out) if "step" in r and "event" not in r), default=0)


def stop(p: subprocess.Popen, timeout_s: float = 60) -> int:
    """SIGTERM (a clean stop), then its exit code; -9 if it had to be killed."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        kill(p)
        return -9


def kill(p: subprocess.Popen) -> None:
    """SIGKILL the process's whole group (its DHT process and p2pd too), reap it, and remove
    the /tmp/hivemind-* socket files the group had bound: killed at once, none of its
    processes lives to remove them (a machine that died; the next test's box is clean)."""
    if p.poll() is None:
        held = hivemind_sockets(process_tree(p.pid))
        # its whole group may have exited since poll(): nothing is left to kill, only to reap
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        for path in held:
            Path(path).unlink(missing_ok=True)
