"""Replica sessions through the registry: who leads, when a session breaks, the run's end."""

import time

import pytest
from fakes import FakeDirectory

from comms.errors import PeerTimeout
from mesh.runtime.registry import (
    CLAIMING,
    HEARTBEAT_LIVES,
    MAX_CLAIM_STRETCH,
    CellRecord,
    Registry,
    claim_ttl_s,
)
from mesh.runtime.session import DhtCoordinator, Session, StaticCoordinator


def coordinator(d, cell, leader, **kw):
    # each cell its own process: its own owner marker, one shared DHT
    reg = Registry(d.joined(f"[owner:{cell}-{len(d.data)}]"), None, 60.0)  # no background beats
    c = DhtCoordinator(
        reg,
        cell=cell,
        peer=f"peer-{cell}",
        replica_cells=["s0r0", "s1r0"],
        leader=leader,
        replica=0,
        steps=kw.pop("steps", 100),
        mpu=1,
        wait_s=kw.pop("wait_s", 2.0),
        **kw,
    )
    return c


def test_static_coordinator_gives_one_session_from_the_common_step():
    c = StaticCoordinator(steps=10, mpu=4)
    assert c.next_session(lambda: 3) == Session(0, 12, 7)
    assert c.next_session(lambda: 10) is None
    assert not c.broken(Session(0, 12, 7))


def test_leader_announces_once_every_member_claims_and_breaks_on_a_new_incarnation():
    d = FakeDirectory()
    lead = coordinator(d, "s0r0", True)
    follow = coordinator(d, "s1r0", False)
    s = lead.next_session(lambda: 5)
    assert (s.base_mb, s.updates) == (5, 95)
    assert follow.next_session(lambda: 5) == s
    assert not lead._check(lead._active) and not follow._check(follow._active)
    # the follower's process is replaced (a restart or a join): its claim expires, a new
    # incarnation claims the same cell
    follow.reg.release("s1r0", follow.peer)
    again = coordinator(d, "s1r0", False)
    assert lead._check(lead._active)
    s2 = lead.next_session(lambda: 9)
    assert s2.epoch > s.epoch
    assert follow._check(follow._active)  # the old follower sees the record move on
    assert again.next_session(lambda: 9) == s2


def test_leader_waits_for_a_missing_member_then_gives_up_clearly():
    d = FakeDirectory()
    lead = coordinator(d, "s0r0", True, wait_s=0.6)
    with pytest.raises(PeerTimeout, match="s1r0"):
        lead.next_session(lambda: 0)


def test_the_run_end_stops_followers():
    d = FakeDirectory()
    lead = coordinator(d, "s0r0", True, steps=10, step=10)
    follow = coordinator(d, "s1r0", False, steps=10)
    assert follow.reg.session(0, "s0r0") is None  # nothing announced yet
    assert lead.next_session(lambda: 10) is None
    lead.close()  # the leader is done and gone; its `done` record still stops the follower
    assert follow.next_session(lambda: 3) is None


def test_a_joins_placeholder_claim_is_not_a_member_yet():
    d = FakeDirectory()
    lead = coordinator(d, "s0r0", True, wait_s=0.6)
    scout = Registry(d.joined("[owner:scout]"), None, 60.0)
    scout.beat(CellRecord("s1r0", "scout", CLAIMING, 1.0, 0, -1, 0.0, 1.0, None))
    with pytest.raises(PeerTimeout):  # the cell's own process has not claimed yet
        lead.next_session(lambda: 0)
    follow = coordinator(d, "s1r0", False)  # claims a hair earlier than the scout: owns it
    follow.since = 0.5
    follow.heartbeat()
    lead.wait_s = 3.0  # the leader re-reads the claims within session.REUSE_MAX_S
    s = lead.next_session(lambda: 0)
    assert s.updates == 100 and lead._active.members["s1r0"] == follow.inc


def test_one_read_that_misses_a_members_claim_does_not_break_the_session():
    d = FakeDirectory()
    lead = coordinator(d, "s0r0", True)
    coordinator(d, "s1r0", False)  # its claim is in the DHT
    lead.next_session(lambda: 0)
    owned = lead.reg.owners([0])
    partial = {c: r for c, r in owned.items() if c != "s1r0"}  # a read that missed s1r0
    assert not lead._check(lead._active, partial)
    assert not lead._check(lead._active, owned)  # it is back: the count starts again
    assert not lead._check(lead._active, partial)
    # missing twice in a row, but read a moment ago: its claim cannot have expired yet
    assert not lead._check(lead._active, partial)
    lead._seen["s1r0"] -= HEARTBEAT_LIVES * lead.reg.heartbeat_s + 1  # a lifetime ago
    assert lead._check(lead._active, partial)  # missing twice in a row and expired: gone


@pytest.mark.slow
def test_a_waiting_cell_reads_the_claims_about_once_a_second_not_once_a_poll():
    # 32 cells polling the claims and the session every 0.25 s swamped a 2-core box's DHT
    # (bench scale); a follower waiting for a leader that never comes reuses one read of the
    # claims for session.REUSE_MAX_S and backs its session polls off to one per heartbeat
    d = FakeDirectory()
    reg = Registry(d.joined("[owner:f]"), None, 1.0)  # heartbeat 1 s (the background beats)
    follow = DhtCoordinator(
        reg,
        cell="s1r0",
        peer="p",
        replica_cells=["s0r0", "s1r0"],
        leader=False,
        replica=0,
        steps=10,
        mpu=1,
        wait_s=4.0,
    )
    with pytest.raises(PeerTimeout):
        follow.next_session(lambda: 0)
    follow.close()
    # 4 s: the beats' reads (~4), the waits' own reads (at most one per second), the timeout's
    # read; the session record polled with a backoff from 0.25 s to 1 s (~7 polls)
    assert reg.d.reads["cells.r0"] <= 4 + 5 + 1, reg.d.reads
    assert reg.d.reads["session.r0"] <= 9, reg.d.reads


def test_a_cell_claimed_twice_stops_on_the_peer_that_claimed_later():
    """Two joins that took one cell at once (a claim reached the DHT late): the later one stops
    with CellLost once the earlier owner beats again; the owner trains on; a dead claim read late
    (it has not beaten since we claimed) is not a rival."""
    from mesh.runtime.session import CellLost, lost_to

    def claim(peer, since, t, inc=7):
        return CellRecord("s1r0", peer, inc, since, 0, 0, 0.0, t, None)

    owner = claim("A", 10.0, 20.0)
    assert lost_to({"s1r0": owner}, "s1r0", "B", since=15.0) == owner
    assert lost_to({"s1r0": owner}, "s1r0", "A", since=10.0) is None  # ours
    assert lost_to({"s1r0": claim("A", 10.0, 14.0)}, "s1r0", "B", since=15.0) is None  # dead
    assert lost_to({"s1r0": claim("A", 10.0, 20.0, CLAIMING)}, "s1r0", "B", since=15.0) is None
    assert lost_to({}, "s1r0", "B", since=15.0) is None

    d = FakeDirectory()
    lead = coordinator(d, "s0r0", True)
    first = coordinator(d, "s1r0", False, since=1.0)
    late = DhtCoordinator(
        Registry(d.joined("[owner:late]"), None, 60.0),
        cell="s1r0",
        peer="peer-late",
        replica_cells=["s0r0", "s1r0"],
        leader=False,
        replica=0,
        steps=100,
        mpu=1,
        wait_s=2.0,
        since=2.0,
    )
    first.heartbeat()  # the owner beats after the late claim: alive
    s = lead.next_session(lambda: 0)
    assert first.next_session(lambda: 0) == s
    with pytest.raises(CellLost, match="claimed at the same time, earlier"):
        late.next_session(lambda: 0)
    assert late.broken(s) and not first.broken(s)


def test_catch_up_reads_a_silent_dht_again_before_it_trains_on():
    """A replacement cell asks the DHT where its stage's peers are; an unanswered read is read
    again (a leader that took silence for "nobody ahead" led its replica from step 0 beside a
    follower at step 58k in the soak), up to CATCH_UP_READS times."""
    from types import SimpleNamespace

    from mesh.config import load_config
    from mesh.runtime.trainer import CATCH_UP_READS, catch_up

    class SilentTwice(FakeDirectory):
        def dht_get(self, key, timeout_s=None):
            found = super().dht_get(key, timeout_s)
            return None if self.reads[key] <= 2 else found

    d = SilentTwice()
    coordinator(d, "s0r0", True)  # the other replica's cell, in step
    coord = SimpleNamespace(reg=Registry(d, None, 60.0))  # reads through the silent DHT
    cfg = load_config([], ["grid.stages=2", "grid.replicas=2"])
    worker = SimpleNamespace(cell=SimpleNamespace(stage=0, replica=1, step=0))
    assert catch_up(cfg, worker, coord, transport=None) is None  # in step: nothing to load
    assert d.reads["cells.r0"] == 3 <= CATCH_UP_READS


def test_a_claim_lives_heartbeat_lives_of_its_beats_as_they_come():
    # idle: HEARTBEAT_LIVES periods; beats spaced out by a loaded box: as many of those gaps,
    # so `status` never reads a beating holder's claim as expired; capped, so a dead one's
    # cell comes free
    assert claim_ttl_s(1.0, ()) == HEARTBEAT_LIVES
    assert claim_ttl_s(1.0, [0.9, 1.0]) == HEARTBEAT_LIVES  # on time: unchanged
    assert claim_ttl_s(1.0, [1.0, 3.0, 1.5]) == pytest.approx(HEARTBEAT_LIVES * 3.0)
    assert claim_ttl_s(1.0, [60.0]) == MAX_CLAIM_STRETCH * HEARTBEAT_LIVES


class TtlDirectory(FakeDirectory):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.ttls: list[tuple[str, float]] = []

    def joined(self, marker):
        other = TtlDirectory(marker, self.data)
        other.ttls = self.ttls
        return other

    def dht_store(self, key, subkey, value, ttl_s, timeout_s=None):
        self.ttls.append((subkey, ttl_s))
        return super().dht_store(key, subkey, value, ttl_s, timeout_s)


def test_a_late_beat_stores_a_longer_claim_and_the_release_outlives_it():
    d = TtlDirectory()
    c = coordinator(d, "s0r0", True)  # heartbeat 60 s: its own beats never come in the test
    assert d.ttls[-1][1] == 60.0 * HEARTBEAT_LIVES
    c._last_beat_at = time.monotonic() - 150.0  # this beat comes 150 s after the last
    c.heartbeat()
    assert d.ttls[-1][1] == pytest.approx(150.0 * HEARTBEAT_LIVES, rel=0.01)
    c.close()
    assert d.ttls[-1][1] > 150.0 * HEARTBEAT_LIVES  # the withdrawal, over the claim's life


def test_a_cell_lost_to_an_earlier_claim_writes_no_checkpoint(tmp_path):
    """A cell another join owns (CellLost) leaves the state to its owner: neither its periodic
    checkpoints nor its last save write under its --out; the owner's do."""
    from mesh.config import load_config
    from mesh.engine.cell import Cell
    from mesh.model.build import build_stages
    from mesh.runtime.trainer import CellRun

    d = FakeDirectory()
    coordinator(d, "s0r0", True)
    owner = coordinator(d, "s1r0", False, since=1.0)
    late = DhtCoordinator(
        Registry(d.joined("[owner:late]"), None, 60.0),
        cell="s1r0",
        peer="peer-late",
        replica_cells=["s0r0", "s1r0"],
        leader=False,
        replica=0,
        steps=100,
        mpu=1,
        wait_s=2.0,
        since=2.0,
    )
    owner.heartbeat()  # it beats after the late claim: alive, and the owner
    assert late.owners() is not None and late.lost and not owner.lost

    cfg = load_config(
        [],
        ["model.n_layers=2", "model.d_model=16", "model.n_heads=2", "model.seq_len=16"]
        + ["grid.stages=2", "grid.replicas=1", "checkpoint.every=1"],
    )
    module = build_stages(cfg.model, 2, 0)[1]
    for coord, out in ((late, tmp_path / "late"), (owner, tmp_path / "owner")):
        run = CellRun(cfg, 1, 0, str(out), Cell.build(cfg, 1, 0, module), None, None, out / "m")
        run.coord = coord
        run.checkpoint_if_due()  # step 0: due
    assert not any((tmp_path / "late").rglob("*.pt*")), list((tmp_path / "late").rglob("*"))
    assert any((tmp_path / "owner").rglob("*")), "the owner's checkpoint"
