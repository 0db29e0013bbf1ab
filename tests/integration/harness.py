"""Run one real process per peer, each with its own transport, on 127.0.0.1.

`run_peers(backend, names, groups, scenario, timeout_s, **kwargs)` starts a process per name
(forked from the cells' fork server, mesh.runtime.launch.cell_context: no inherited threads or
sockets, torch already imported), each builds its transport with
`comms.build.make_transport` and runs `scenarios.<scenario>(transport, peer, **kwargs)`, whose
JSON-able dict comes back through a pipe. The parent holds the rendezvous
(`comms.build.local_rendezvous`: the TCPStore for torch, a bootstrap DHT for hivemind).

Faults are scripted, never raced: a scenario calls `peer.checkpoint("point")`, which tells the
parent it reached that point and waits for a go. For `faults={"p3": ("kill", "before_mean")}`
the parent SIGKILLs p3 there; with ("stop", point) it SIGSTOPs p3 and, once every other peer
has reported, lets it go and SIGCONTs it; with ("restart", point) it SIGKILLs p3 there and, once
every other peer waits at checkpoint RESPAWN, starts p3 again (a new process, `peer.life` 2,
the scenario from its start) and lets them go when the new p3's transport is built (its
STARTED). Peers at points without a fault get a go at once,
except at STARTED, every peer's first checkpoint once its transport is built: a barrier, so the
scenarios begin together (start-up on a loaded 2-core host can differ by more than a round's
deadline; a member still starting is not what a scenario tests).

Every child's stderr goes to a file; the parent asserts no child printed a traceback (this also
catches exceptions in background threads) and that only the killed peers died. Children are
joined with a timeout and leftovers are killed by PID and reaped.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comms.build import local_rendezvous, make_transport
from mesh.runtime.launch import cell_context

KILLED = {"killed": True}
STARTED = "started"  # every peer's first checkpoint: its transport is built
RESPAWN = "respawn"  # where the other peers wait while a restarted peer starts again
HANG_S = 60.0  # beyond the scenario's own deadlines, how long a run may take before it is hung


@dataclass
class Peer:
    """What a scenario knows about its own process."""

    name: str
    names: list[str]
    groups: dict[str, list[str]]
    backend: str
    timeout_s: float
    life: int = 1  # 2 for a peer started again after a "restart" fault
    _events: Any = field(repr=False, default=None)
    _go: Any = field(repr=False, default=None)

    def checkpoint(self, point: str) -> None:
        """Report reaching `point` and wait until the parent says go (it may kill us here)."""
        self._events.send(("ready", self.name, point))
        if not self._go.poll(max(60.0, 4 * self.timeout_s)):
            raise TimeoutError(f"no go from the parent at checkpoint {point!r}")
        got = self._go.recv()
        assert got == ("go", point), got


def run_peers(
    backend: str,
    names: list[str],
    groups: dict[str, list[str]],
    scenario: str,
    timeout_s: float,
    *,
    faults: dict[str, tuple[str, str]] | None = None,
    build: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, dict]:
    """Run `scenario` on one process per name; results by name (KILLED for killed peers).

    Args:
        timeout_s: the transports' deadline; the whole run gets HANG_S plus 4 times that.
        faults: name -> ("kill" | "stop" | "restart", checkpoint name).
        build: extra make_transport kwargs (e.g. shaping).
        kwargs: passed to the scenario function.
    """
    faults = faults or {}
    ctx = cell_context()
    procs: dict[str, Any] = {}
    go: dict[str, Any] = {}
    events: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="mt-peers-") as tmp, local_rendezvous(backend) as rz:

        def spawn(n: str, life: int = 1) -> None:
            # one pipe per child and direction: a child killed while writing cannot hold a
            # lock that the others need (a shared mp.Queue has one)
            event_end, to_parent = ctx.Pipe(duplex=False)
            from_parent, go_end = ctx.Pipe(duplex=False)
            args = (backend, n, names, groups, scenario, timeout_s, rz, build or {}, life)
            err = str(Path(tmp) / f"{n}.err")
            p = ctx.Process(
                target=_child, args=(*args, kwargs, to_parent, from_parent, err), name=f"peer-{n}"
            )
            p.start()
            to_parent.close()  # the child holds its ends
            from_parent.close()
            procs[n], go[n] = p, go_end
            events.append(event_end)

        for n in names:
            spawn(n)
        try:
            # a hang guard, not a stopwatch: start-up of 4 peers alone can take half a minute
            # on a loaded 2-core box
            results = _drive(
                procs, events, go, faults, time.monotonic() + HANG_S + 4 * timeout_s, spawn
            )
        finally:
            _reap(procs)
        errs = {n: (Path(tmp) / f"{n}.err").read_text(errors="replace") for n in names}
    problems = [f"{n}: no result" for n in names if n not in results]
    problems += [f"{n}: {r['error']}" for n, r in results.items() if "error" in r]
    for n, p in procs.items():  # a restarted peer: its second process
        killed = faults.get(n, ("",))[0] == "kill"
        if "Traceback" in errs[n]:
            problems.append(f"{n} printed a traceback:\n{errs[n][-3000:]}")
        if not killed and p.exitcode != 0:
            problems.append(f"{n} exit code {p.exitcode}:\n{errs[n][-6000:]}")
    assert not problems, "\n".join(problems)
    json.dumps(results)  # JSON-able by contract
    return results


def _drive(procs, events, go, faults, deadline: float, spawn) -> dict[str, dict]:
    """Answer checkpoints, apply faults, collect results until every live peer reported."""
    results: dict[str, dict] = {}
    stopped: dict[str, str] = {}  # name -> point where it waits
    started: set[str] | None = set()  # peers waiting at STARTED; None once they all went on
    respawning: list[str] = []  # killed peers to start again once the others wait at RESPAWN
    waiting: set[str] = set()  # peers waiting at RESPAWN
    restarted: str | None = None  # the peer whose new process is starting
    open_ = events
    while True:
        live = [n for n in procs if n not in results]
        if not live:
            return results
        if started is not None and set(live) <= started:  # a barrier: see run_peers
            for n in started & set(live):
                go[n].send(("go", STARTED))
            started = None
        if set(live) <= set(stopped):  # everyone else reported: let the frozen peers go on
            for n, point in stopped.items():
                go[n].send(("go", point))
                os.kill(procs[n].pid, signal.SIGCONT)
            stopped = {}
        if respawning and restarted is None and set(live) - set(respawning) <= waiting:
            restarted = respawning.pop(0)
            spawn(restarted, life=2)
            results.pop(restarted)
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not open_:
            return results
        ready = mp_connection.wait(open_, timeout=min(remaining, 1.0))
        if not ready:
            continue
        try:
            msg = ready[0].recv()
        except EOFError:  # that child is gone (killed, or died without a result)
            open_.remove(ready[0])
            continue
        if msg[0] == "ready":
            _, n, point = msg
            action, at = faults.get(n, ("", ""))
            if point == STARTED and n == restarted:  # its transport is up: all go on
                for m in [n, *waiting]:
                    go[m].send(("go", STARTED if m == n else RESPAWN))
                waiting, restarted = set(), None
            elif point == STARTED and started is not None:
                started.add(n)
            elif point == RESPAWN:
                waiting.add(n)
            elif at == point and action in ("kill", "restart") and n not in respawning:
                os.kill(procs[n].pid, signal.SIGKILL)
                procs[n].join(10)
                results[n] = dict(KILLED)
                if action == "restart":
                    respawning.append(n)
                    faults = {**faults, n: ("", "")}  # its second life runs without a fault
            elif at == point and action == "stop":
                os.kill(procs[n].pid, signal.SIGSTOP)
                stopped[n] = point
            else:
                go[n].send(("go", point))
        elif msg[0] == "result":
            results[msg[1]] = msg[2]
        elif msg[0] == "error":
            results[msg[1]] = {"error": msg[2]}


def _reap(procs: dict[str, mp.Process], grace_s: float = 30.0) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():  # hung: dump its stacks into its stderr file, then kill it
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
                os.kill(p.pid, signal.SIGUSR1)
                time.sleep(0.5)
                os.kill(p.pid, signal.SIGKILL)  # SIGKILL works on stopped processes too
            p.join(5)


def _child(
    backend, name, names, groups, scenario, timeout_s, meeting, build, life, kwargs, events, go, err
):
    """Child process body: stderr to a file, build, run, report, close."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a cell's fork server ignores it
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks before a kill
    try:
        import torch

        torch.set_num_threads(1)  # 2 cores for up to 4 peers
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        module, _, fn_name = scenario.rpartition(":")  # "module:function", or one of scenarios'
        fn = getattr(importlib.import_module(module or "scenarios"), fn_name)
        peer = Peer(name, list(names), dict(groups), backend, timeout_s, life, events, go)
        t = make_transport(backend, name, names, groups, meeting, timeout_s=timeout_s, **build)
        try:
            peer.checkpoint(STARTED)
            result = fn(t, peer, **kwargs)
        finally:
            t.close()
        events.send(("result", name, result))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        events.send(("error", name, traceback.format_exc()))
