"""Two "nodes" of a `meshtrain train` grid as two torchrun launches (c10d rendezvous), for the
tests on 127.0.0.x and in network namespaces: start one, read its cells' rows, kill it whole."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from comms.procs import process_tree, running
from mesh.runtime.rows import parse_rows

ROOT = Path(__file__).resolve().parents[2]


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@dataclass
class Node:
    """One torchrun launch: `nproc` cells of the grid, writing under `out`."""

    index: int
    addr: str  # its --local-addr (the rendezvous sorts nodes by it: node 0 first)
    out: Path
    log: Path
    proc: subprocess.Popen | None = None
    lives: list[subprocess.Popen] = field(default_factory=list)

    def start(
        self,
        endpoint: str,
        args: list[str],
        env: dict[str, str],
        host: bool = True,
        prefix: list[str] = (),
        launcher: list[str] = (),
    ) -> None:
        """torchrun on this node (again: a relaunch, appending to its log); prefix: before the
        interpreter (ip netns exec NS), launcher: more torchrun options."""
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            *launcher,
            "--node-rank",
            str(self.index),  # c10d ignores it: nodes are sorted by address
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            f"test{endpoint.rsplit(':', 1)[1]}",
            "--local-addr",
            self.addr,
            # node 0 serves the rendezvous: torchrun would tell by the hostname, which names
            # both nodes here (and no address of a network namespace)
            "--rdzv-conf",
            f"is_host={str(self.index == 0).lower()}",
            "--monitor-interval",
            "0.5",
            "-m",
            "cli.main",
            "train",
            "--out",
            str(self.out),
            *args,
            *(["--host", self.addr] if host else []),
        ]
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.lives.append(self.proc)

    def kill(self) -> None:
        """SIGKILL torchrun and every worker it started (they run in sessions of their own)."""
        if self.proc is None:
            return
        for pid in process_tree(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"node {self.index} did not finish in {timeout_s} s:\n"
                + self.log.read_text()[-3000:]
            ) from None

    def rows(self, stage: int, replica: int) -> list[dict]:
        path = self.out / "metrics" / f"{stage}-{replica}.jsonl"
        return parse_rows(path.read_bytes()) if path.exists() else []

    def cells(self) -> set[str]:
        return {p.stem for p in (self.out / "metrics").glob("*.jsonl")}


def lives(rows: list[dict]) -> list[list[dict]]:
    """A cell's rows split by process (each life starts with its `started` event)."""
    out: list[list[dict]] = []
    for r in rows:
        if r.get("event") == "started":
            out.append([])
        if out:
            out[-1].append(r)
    return out


def updates(life: list[dict]) -> list[int]:
    return [r["step"] for r in life if "event" not in r and not r.get("final")]


def step(rows: list[dict]) -> int:
    return max(updates(rows), default=0)


def final_step(life: list[dict]) -> int | None:
    return next((r["step"] for r in life if r.get("final")), None)


def events(life: list[dict], name: str) -> list[dict]:
    return [r for r in life if r.get("event") == name]


def leftover(*nodes: Node) -> list[int]:
    """Cell processes of any life still running."""
    pids = [
        r["pid"]
        for n in nodes
        for path in (n.out / "metrics").glob("*.jsonl")
        for r in parse_rows(path.read_bytes())
        if r.get("event") == "started"
    ]
    return [p for p in pids if running(p)]
