"""A 2x2 join grid whose replica 1 lives behind two NAT routers, in network namespaces.

Shared by tests/throttled/test_join_nat_netns.py and `meshtrain bench nat` (mesh/bench/nat.py).
The topology is comms.natns.nat_homes(2): the public namespace runs `meshtrain dht` and the
public cells s0r0 and s1r0; home k runs s{k}r1 with `--client-mode` behind its own nftables
masquerade, so s0r1 and s1r1, adjacent in replica 1's pipeline, reach each other only through a
relay (the bootstrap node or a public cell, each relaying within `relay_time_s` and
`relay_data_mib` per connection). The public cells join and train first, so that the homes
find them as relays besides the bootstrap node.

Processes are fresh interpreters under `ip netns exec`, each in its own session (killed with
its group by mesh.testing.local_peers.kill). Needs root, iproute2 and nftables
(comms.natns.unavailable says why not).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comms.natns import PUBLIC_ADDR, NatHomes, nat_homes
from mesh.testing.local_peers import KEY, kill, rows, step, tiny_grid_config, wait_for

PUBLIC, HOME0, HOME1 = "public", "home0", "home1"
CELLS = {"s0r0": PUBLIC, "s1r0": PUBLIC, "s0r1": HOME0, "s1r1": HOME1}
WAIT_S = 240  # a stage of the start that takes longer is a failure, not a slow box


@dataclass
class NatGrid:
    topo: NatHomes
    directory: Path
    bootstrap: str = ""
    procs: dict[str, Any] = field(default_factory=dict)  # "dht" and the cell names

    def ns(self, where: str) -> str:
        return {PUBLIC: self.topo.public, HOME0: self.topo.homes[0], HOME1: self.topo.homes[1]}[
            where
        ]

    def addr(self, where: str) -> str:
        return PUBLIC_ADDR if where == PUBLIC else self.topo.home_addrs[int(where[-1])]

    def out(self, cell: str) -> Path:
        return self.directory / cell

    def log(self, name: str) -> Path:
        return self.directory / f"{name}.log"

    def start(self, name: str, where: str, *args: str) -> Any:
        """`meshtrain ARGS` in namespace `where`, output to NAME.log (the dht's stdout piped, its
        stderr to dht.log)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHTRAIN_RUN_KEY": KEY}
        maddr = ["--host-maddrs", f"/ip4/{self.addr(where)}/tcp/0"]
        cmd = self.topo.cmd(self.ns(where), sys.executable, "-m", "cli.main", *args, *maddr)
        out: Any = subprocess.PIPE if name == "dht" else self.log(name).open("w")
        err = self.log(name).open("w") if name == "dht" else subprocess.STDOUT
        p = subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
            cwd=self.directory,
        )
        self.procs[name] = p
        return p

    def meshtrain(self, where: str, *args: str, timeout_s: float = 120) -> tuple[int, str]:
        """Run `meshtrain ARGS` (no --host-maddrs) in namespace `where` to its end."""
        env = {**os.environ, "MESHTRAIN_RUN_KEY": KEY}
        cmd = self.topo.cmd(self.ns(where), sys.executable, "-m", "cli.main", *args)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        return p.returncode, p.stdout + p.stderr

    def status(self) -> dict[str, Any]:
        code, out = self.meshtrain(PUBLIC, "status", "--initial-peers", self.bootstrap, "--json")
        if code != 0:
            raise AssertionError(f"status exited {code}: {out}")
        return json.loads(out[out.index("{") :])

    def step(self, cell: str) -> int:
        return step(self.out(cell))

    def health(self, cell: str) -> list[dict[str, Any]]:
        return [r for r in rows(self.out(cell)) if r.get("event") == "health"]

    def stop_all(self, timeout_s: float = 60) -> None:
        """SIGTERM every process at once (a clean stop each), SIGKILL what outlives timeout_s."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill(p)


def join_args(grid: NatGrid, cell: str, cfg: Path, relay: list[str]) -> list[str]:
    args = ["join", "--initial-peers", grid.bootstrap, "--out", str(grid.out(cell))]
    args += ["--stage", cell[1], *relay]
    if cell == "s0r0":
        args += ["--config", str(cfg)]
    if CELLS[cell] != PUBLIC:
        args.append("--client-mode")
    return args


@contextlib.contextmanager
def nat_grid(
    directory: Path, text_file: Path, relay_time_s: float, relay_data_mib: float, local: str = ""
) -> Iterator[NatGrid]:
    """The grid of the module docstring, training (every cell has updated) when it is yielded;
    every process stopped (SIGTERM, then SIGKILL) and the namespaces deleted on exit."""
    cfg = tiny_grid_config(directory, text_file, local=local)
    limits = [
        "--relay-time-limit-s",
        f"{relay_time_s:g}",
        "--relay-data-limit-mib",
        f"{relay_data_mib:g}",
    ]
    relay_sets = [
        "--set",
        f"transport.relay_time_limit_s={relay_time_s:g}",
        "--set",
        f"transport.relay_data_limit_mib={relay_data_mib:g}",
    ]
    with nat_homes(2) as topo:
        grid = NatGrid(topo, directory)
        try:
            dht = grid.start("dht", PUBLIC, "dht", *limits)
            grid.bootstrap = dht.stdout.readline().strip()
            if not grid.bootstrap.startswith(f"/ip4/{PUBLIC_ADDR}/"):
                raise AssertionError(f"dht printed {grid.bootstrap!r}")
            for cell in ("s0r0", "s1r0", "s0r1", "s1r1"):
                grid.start(cell, CELLS[cell], *join_args(grid, cell, cfg, relay_sets))
                joined = f"joined run 'meshtrain' as {cell} "
                wait_for(lambda c=cell, j=joined: j in grid.log(c).read_text(), WAIT_S, cell)
                if cell == "s1r0":  # the homes find the public cells as relays
                    wait_for(lambda: grid.step("s0r0") > 0, WAIT_S, "replica 0 training")
            wait_for(lambda: grid.step("s0r1") > 0, WAIT_S, "replica 1 (behind NAT) training")
            yield grid
        finally:
            try:
                grid.stop_all()
            finally:
                for p in grid.procs.values():
                    kill(p)
