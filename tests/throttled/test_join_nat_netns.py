"""Peers behind NAT, for real: a 2x2 join grid whose replica 1 is two `join --client-mode` peers
in two homes behind nftables masquerade routers (mesh/bench/nat_grid.py), so its two adjacent
cells reach each other only through relays, each relaying at most RELAY_MIB per connection and
direction for RELAY_S. Replica 1 trains past many such resets, `status` marks its cells
relayed, and when the relay carrying it is killed it goes on through another. Root and
nftables only; skipped cleanly otherwise."""

from __future__ import annotations

import subprocess

import pytest

from comms import procs
from comms.natns import PUBLIC_ADDR, unavailable
from mesh.bench.nat_grid import HOME0, HOME1, NatGrid, nat_grid
from mesh.testing.local_peers import kill, rows, wait_for

pytestmark = [pytest.mark.throttled, pytest.mark.integration, pytest.mark.slow]
RELAY_S, RELAY_MIB = 8.0, 0.25  # far below p2pd's 30 min / 4 GiB, so the run outlives many
RESETS = 4  # relayed connections replica 1 must at least have gone through
WAIT_S = 150


def _rows(grid: NatGrid, cell: str) -> list[dict]:
    return [r for r in rows(grid.out(cell)) if "event" not in r]


def _sent(grid: NatGrid, cell: str, kind: str) -> int:
    sent = [r["bytes_sent"] for r in _rows(grid, cell) if "bytes_sent" in r]
    return sent[-1].get(kind, 0) if sent else 0


def _relay_limits(grid: NatGrid, cell: str) -> list:
    """What each of the cell's relays answered to its reservation, by its last health row."""
    last = [r["relay_limits"] for r in grid.health(cell) if r.get("relay_limits")]
    return sorted(last[-1].values(), key=str) if last else []


def _wait_for_answers(grid: NatGrid, cell: str, want: list) -> None:
    """Until each of `cell`'s three relays answered its reservation with `want`; on timeout,
    what they answered and what the relays' logs said of their relay service."""
    try:
        wait_for(lambda: _relay_limits(grid, cell) == [want] * 3, WAIT_S, f"{cell}'s answers")
    except AssertionError as e:
        said = [
            f"{name}: {line}"
            for name in ("dht", "s0r0", "s1r0", cell)
            if grid.log(name).exists()
            for line in grid.log(name).read_text().splitlines()
            if "relay" in line.lower()
        ]
        last = [r.get("relay_limits") for r in grid.health(cell)][-3:]
        raise AssertionError(f"{e}: last answers {last}; logs: {said[-20:]}") from None


def _said(grid: NatGrid) -> str:
    """Each process's state for a failed wait: alive or its exit code, its step, its last
    health row's relays and the last lines of its log (progress bars left out)."""
    out = []
    for name, proc in grid.procs.items():
        code = proc.poll()
        state = "alive" if code is None else f"exited {code}"
        lines = []
        if grid.log(name).exists():
            text = grid.log(name).read_text(errors="replace").replace("\r", "\n")
            lines = [ln for ln in text.splitlines() if ln.strip() and "it/s" not in ln]
            lines = [ln for ln in lines if not ln.startswith(f"join {name}:")][-6:]
        health = grid.health(name)[-1:] if name != "dht" else []
        step_now = grid.step(name) if name != "dht" else None
        relays = health[0].get("relayed_via") if health else None
        out.append(f"{name} {state} step {step_now} relayed_via {relays}: {lines}")
    return "\n".join(out)


def _wait(grid: NatGrid, cond, what: str) -> None:
    """wait_for, and on a timeout what each process was doing (a loaded CI box's failure
    says why, not only which wait)."""
    try:
        wait_for(cond, WAIT_S, what)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_said(grid)}") from None


def _relays_in_use(grid: NatGrid, cell: str, since_s: float = 0.0) -> set[str]:
    return {
        relay
        for r in grid.health(cell)
        if r["time_s"] >= since_s
        for relay in (r.get("relayed_via") or {})
    }


@pytest.mark.timeout(900)
def test_cells_behind_nat_train_through_relays_past_their_limits_and_a_killed_relay(
    text_file, tmp_path
):
    why = unavailable()
    if why:
        pytest.skip(f"NAT namespaces unavailable: {why}")
    with nat_grid(tmp_path, text_file, RELAY_S, RELAY_MIB) as grid:
        # the relays got the limits (forced public: p2pd's own relay service), and it is that
        # one, not go-libp2p's default one (2 min, 128 KiB), that answers each home's
        # reservation: the bootstrap and both public cells (comms/p2p/relay_service.py)
        limit = f"-relayDataLimit={int(RELAY_MIB * 2**20)}".encode()
        relays = procs.named_with(limit, "p2pd")
        assert len(relays) >= 3, relays
        assert set(relays) <= set(procs.named_with(b"-forceReachabilityPublic=1", "p2pd"))
        want = [int(RELAY_S), int(RELAY_MIB * 2**20)]
        for cell in ("s0r1", "s1r1"):
            _wait_for_answers(grid, cell, want)

        # replica 1 trains through relays: the homes' only TCP peers are on the public side
        for home in (HOME0, HOME1):
            conns = subprocess.run(
                grid.topo.cmd(grid.ns(home), "ss", "-tnH"),
                text=True,
                capture_output=True,
                check=True,
            ).stdout.split("\n")
            remote = {c.split()[-1].rsplit(":", 1)[0] for c in conns if c.strip()}
            assert remote == {PUBLIC_ADDR}, (home, conns)
        # each relayed connection carries at most RELAY_MIB each way: this many bytes from s0r1
        # to s1r1 (its only pipeline peer) crossed at least RESETS of them, and as many seconds
        need = RESETS * RELAY_MIB * 2**20
        start = grid.step("s0r1")
        _wait(grid, lambda: _sent(grid, "s0r1", "activation") > need, "bytes past limits")
        t0 = _rows(grid, "s0r1")[-1]["time_s"]
        _wait(grid, lambda: _rows(grid, "s0r1")[-1]["time_s"] > t0 + 2 * RELAY_S, "time")
        assert grid.step("s1r1") > start, "s1r1 stalled"

        status = {c["cell"]: c for c in grid.status()["cells"]}
        relayed = {c for c, row in status.items() if row["relayed"]}
        assert relayed == {"s0r1", "s1r1"}, [status[c] for c in ("s0r1", "s1r1")]

        # the relay carrying replica 1 is killed: it goes on through another one
        in_use = _relays_in_use(grid, "s0r1") | _relays_in_use(grid, "s1r1")
        who = {grid.bootstrap.rsplit("/p2p/", 1)[1]: "dht"}
        who.update({status[c]["peer"]: c for c in ("s0r0", "s1r0")})
        victims = [who[r] for r in in_use if r in who]
        assert victims, (in_use, who)
        victim = "dht" if "dht" in victims else victims[0]
        kill(grid.procs[victim])
        killed = next(r for r, name in who.items() if name == victim)
        t_kill = _rows(grid, "s0r1")[-1]["time_s"]  # s0r1's clock (each cell has its own)
        at = grid.step("s1r1")
        _wait(grid, lambda: grid.step("s1r1") > at + 40, "replica 1 after the relay died")
        # carried by a live relay now (a health row a beat after the kill)
        _wait(grid, lambda: _relays_in_use(grid, "s0r1", t_kill + 6), "a later health row")
        after = _relays_in_use(grid, "s0r1", t_kill + 6)
        assert killed not in after and after <= set(who), (after, killed)
