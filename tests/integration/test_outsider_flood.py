"""An outsider without the run key against a run's DHT records (issue 47), through real hivemind
DHT nodes on 127.0.0.1: junk subkeys under a key members read, a config record stored before the
owner's. What must hold: junk over the record limit is stored by no node of ours; junk within
it, more than a reply carries, makes a read unknown (None), never empty; a read nobody answers
is unknown; junk a plain hivemind node stored hides no record; and on a keyed grid of
`meshtrain join`s, the owner's `join --config` starts its run past a squatter's record, the
flood costs each cell at most one session, and `status` lists every live cell as live (with
the old read rules, it listed them free)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from hivemind.utils.timed_storage import get_dht_time

from comms.p2p.auth import Auth
from comms.p2p.bounds import RECORD_MAX_BYTES, REPLY_BUDGET_BYTES
from comms.p2p.dht import DhtClient, get_records, start_dht, store_record
from mesh.config import load_config
from mesh.runtime.registry import CONFIG_KEY, CONFIG_SLOT, claims_key
from mesh.testing.local_peers import (
    KEY,
    LOOPBACK,
    PACE_MS,
    kill,
    meshtrain,
    rows,
    run_meshtrain,
    status,
    step,
    stop,
    tiny_grid_config,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HANG_S = 90
BIG = 100_000  # the junk: over RECORD_MAX_BYTES, refused by every node of ours
MID = 30_000  # junk within the limit: stored; this much of it (4.8 MB) would not fit a reply
MID_COUNT = 160  # (p2pd's limit: 4 MiB a message; a reply of ours is trimmed to 2 MiB)
JUNK_TTL_S = 60.0  # how long the junk within the limit lives after its last store
LOOPBACK_MADDRS = ["/ip4/127.0.0.1/tcp/0"]


def flood(dht, key: str, count: int, size: int, ttl_s: float) -> int:
    """Store `count` junk subkeys of `size` bytes under key, as any hivemind client can (no
    seal, no owner marker); how many a node took."""
    exp = get_dht_time() + ttl_s
    futs = [
        dht.store(key, "x" * size, exp, subkey=f"junk{n}", return_future=True) for n in range(count)
    ]
    return sum(bool(f.result(HANG_S)) for f in futs)


def test_junk_is_refused_or_makes_reads_unknown_never_empty():
    assert MID * MID_COUNT > 4 * 1024**2 > REPLY_BUDGET_BYTES and BIG > RECORD_MAX_BYTES > MID
    boot = start_dht([], 60, host_maddrs=LOOPBACK_MADDRS)
    peers = [str(m) for m in boot.get_visible_maddrs()]
    member = start_dht(peers, 60, host_maddrs=LOOPBACK_MADDRS)
    reader = start_dht(peers, 60, host_maddrs=LOOPBACK_MADDRS, client_mode=True)
    outsider = start_dht(peers, 60, host_maddrs=LOOPBACK_MADDRS, client_mode=True)
    try:
        assert store_record(member, "run.cells.r0", "s0r0/me", {"v": 1}, 120, 20)
        assert get_records(reader, "run.cells.r0", 20) == {"s0r0/me": {"v": 1}}
        # over the limit: no node of ours takes any, every read sees the member's record only
        assert flood(outsider, "run.cells.r0", 250, BIG, 120) == 0
        assert not outsider.store("run.cells.r0", "plain", get_dht_time() + 60)  # no subkey
        for dht in (reader, member, boot):
            assert get_records(dht, "run.cells.r0", 20) == {"s0r0/me": {"v": 1}}
        # within it: stored, and more than a reply carries: every read says it cannot tell
        assert flood(outsider, "run.flooded", MID_COUNT, MID, 120) > 0
        assert store_record(member, "run.flooded", "s0r0/me", {"v": 1}, 120, 20)
        for dht in (reader, member, boot):
            assert get_records(dht, "run.flooded", 20) is None
        assert get_records(reader, "run.nothing", 20) == {}  # answered: nothing there
        member.shutdown()
        boot.shutdown()
        # nobody left to answer: unknown, not "every peer left"
        assert get_records(reader, "run.other", 20) is None
    finally:
        for dht in (outsider, reader, member, boot):
            dht.shutdown()


def test_junk_a_plain_hivemind_node_stored_does_not_hide_a_members_record():
    """A bootstrap that is any hivemind node (docs/wan.md) stores the junk ours refuse: its
    replies carry it (under p2pd's limit), and a reader of ours still reads the member's
    record beside it (hivemind drops a reply's whole key when one record fails a validator:
    the bounds are not one)."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    boot = hivemind.DHT(
        start=True, host_maddrs=LOOPBACK_MADDRS, record_validators=[RSASignatureValidator()]
    )
    peers = [str(m) for m in boot.get_visible_maddrs()]
    member = start_dht(peers, 60, host_maddrs=LOOPBACK_MADDRS, client_mode=True)
    reader = start_dht(peers, 60, host_maddrs=LOOPBACK_MADDRS, client_mode=True)
    try:
        assert store_record(member, "run.cells.r0", "s0r0/me", {"v": 1}, 120, 20)
        assert flood(member, "run.cells.r0", 30, BIG, 120) == 30  # all on the plain node
        found = get_records(reader, "run.cells.r0", 20)
        assert found is not None and found["s0r0/me"] == {"v": 1} and len(found) == 31
    finally:
        for dht in (reader, member, boot):
            dht.shutdown()


def _sessions_since(out, epoch_ms: int) -> int:
    """The sessions a cell started whose epoch (the leader's clock, ms) is epoch_ms or later."""
    return sum(1 for r in rows(out) if r.get("event") == "session" and r["epoch"] >= epoch_ms)


def _live(peers: list[str]) -> list[str] | str:
    """The cells `status` lists live and running, or what it said when it could not read the
    grid (its last line: a failed test shows it)."""
    code, out, _ = run_meshtrain("status", *peers, "--json")
    if code != 0:
        return f"{time.strftime('%H:%M:%S')} exit {code}: {out.strip().splitlines()[-1:]}"
    grid = json.loads(out[out.index("{") :])
    return sorted(c["cell"] for c in grid["cells"] if c["running"] and c["verified"])


def _squat(outsider: DhtClient, cfg_path, space: str) -> None:
    """Unsigned config records of the owner's own config (with its key check copied), where
    an outsider can name (`config`) and where one that learned the run's space would."""
    cfg = load_config([cfg_path], [])
    check = Auth.of(KEY, cfg.fingerprint()).key_check
    value = {"v": 1, "fingerprint": cfg.fingerprint(), "toml": cfg.to_toml(), "key_check": check}
    for where in ("", space):
        assert outsider.dht_store(where + CONFIG_KEY, CONFIG_SLOT, value, 300)


@pytest.mark.timeout(1100)  # its phases' own waits (about 880 s at most) fail first, saying which
def test_a_keyed_grid_rides_out_a_squatter_and_a_flood(text_file, tmp_path):
    """A 2x1 grid of joins (the least that has a replica's session to break)."""
    cfg = tiny_grid_config(tmp_path, text_file, replicas=1, min_compute_ms=PACE_MS)
    space = Auth.of(KEY, "").space  # where the run's records live (the key's space)
    dht = meshtrain("dht", *LOOPBACK, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    joins: dict[str, subprocess.Popen] = {}
    outsider = None
    try:
        maddr = dht.stdout.readline().strip()
        peers = ["--initial-peers", maddr]
        outsider = DhtClient(
            [maddr], "meshtrain", 60, host_maddrs=LOOPBACK_MADDRS, client_mode=True
        )
        _squat(outsider, cfg, space)
        outs = {n: tmp_path / n for n in ("j0", "j1")}

        def join(name: str, *extra: str) -> None:
            log = (tmp_path / f"{name}.log").open("w")
            joins[name] = meshtrain(
                "join",
                *peers,
                *LOOPBACK,
                "--out",
                str(outs[name]),
                *extra,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        # -- the owner starts its run past the squatter's records; a second peer joins it
        join("j0", "--config", str(cfg))
        # its cell up and claiming (not only the join's placeholder claim, which a second
        # join could outlive and take the cell over: a rejoin, slow on a loaded box)
        wait_for(
            lambda: "waiting for s1r0" in (tmp_path / "j0.log").read_text() or joins["j0"].poll(),
            HANG_S,
            "the owner's cell",
        )
        assert joins["j0"].poll() is None, (tmp_path / "j0.log").read_text()
        join("j1")
        wait_for(lambda: all(step(o) >= 10 for o in outs.values()), HANG_S, "both cells training")
        # a keyless joiner is told the run needs a key, an empty-key forgery beside it or not
        forged = Auth.of(None, "fp")
        slot = f"{CONFIG_SLOT}{outsider.owner_marker}"
        body = {"v": 1, "fingerprint": "fp", "toml": "x", "key_check": forged.key_check}
        value = forged.seal(CONFIG_KEY, slot, body, time.time() + 300)
        assert outsider.dht_store(CONFIG_KEY, slot, value, 300)
        code, out, _ = run_meshtrain("join", *peers, *LOOPBACK, key=None)
        assert code == 2 and "this run needs a key" in out, out

        # -- 250 junk subkeys of 100 KB under replica 0's claims, where an outsider can name
        #    them and where the run's records live: refused by every node, nothing changes
        began_ms = int(time.time() * 1000)
        for where in ("", space):
            assert flood(outsider.dht, f"meshtrain.{where}{claims_key(0)}", 250, BIG, 120) == 0
        at = {n: step(o) for n, o in outs.items()}
        wait_for(lambda: all(step(o) >= at[n] + 10 for n, o in outs.items()), HANG_S, "training")
        grid = status(maddr)
        assert sorted(c["cell"] for c in grid["cells"]) == ["s0r0", "s1r0"], grid
        assert all(c["running"] and c["verified"] for c in grid["cells"]) and grid["free"] == []
        assert grid["bad_signatures"].get("config", 0) >= 3, grid  # the squatter's, the forgery

        # -- junk within the record limit, more than a reply carries: the claims' reads are
        #    unknown while it lives, never "free"; the replica's session stands. A read may
        #    still answer, from a node the junk did not reach (hivemind stores on the nodes the
        #    outsider knows of): every read that answers lists every live cell, and the junk is
        #    stored again until a read has met it. Then it is left to expire: a node the
        #    outsider's stores stopped reaching (a node that answered late on a loaded box
        #    drops out of its routing table) keeps the junk it holds, so overwriting it with
        #    small values would clear only the nodes still reached
        junk_key = f"meshtrain.{space}{claims_key(0)}"
        answered: list[str] = []
        assert flood(outsider.dht, junk_key, MID_COUNT, MID, JUNK_TTL_S)
        # each read is a `status` process (its imports, its DHT) meeting the junk: on a loaded
        # box one took most of HANG_S, and a read that answered from a node the junk missed
        # left too little of it for the next (the suite beside a study: 1 read in 90 s)
        unknown, deadline = 0, time.monotonic() + 3 * HANG_S
        while not unknown and time.monotonic() < deadline:
            code, out, _ = run_meshtrain("status", *peers, "--json")
            if code == 0:  # a read that answered: every live cell live
                assert json.loads(out[out.index("{") :])["free"] == [], out
                answered.append(out[-300:])
                assert flood(outsider.dht, junk_key, MID_COUNT, MID, JUNK_TTL_S)
            else:
                assert "did not answer" in out, out
                unknown += 1
        assert unknown > 0, answered  # the junk was read (and not taken for free cells)
        # once the junk expired, the claims read again, every cell live
        seen: list[list[str] | str] = []

        def read_again() -> bool:
            seen.append(_live(peers))
            return seen[-1] == ["s0r0", "s1r0"]

        try:
            wait_for(read_again, JUNK_TTL_S + HANG_S, "the claims read again", 1.0)
        except AssertionError as e:  # what the reads saw: why unknown, or which cells
            raise AssertionError(f"{e}; the last reads: {seen[-4:]}") from None
        at = {n: step(o) for n, o in outs.items()}
        wait_for(lambda: all(step(o) >= at[n] + 10 for n, o in outs.items()), HANG_S, "training")
        breaks = {n: _sessions_since(o, began_ms) for n, o in outs.items()}
        assert all(b <= 1 for b in breaks.values()), breaks
        assert all(p.poll() is None for p in joins.values())
        assert all(stop(p) == 0 for p in joins.values())
    finally:
        if outsider is not None:
            outsider.close()
        for p in [*joins.values(), dht]:
            kill(p)
