"""Replica pipeline sessions: how the P cells of one replica (re)start their pipeline together.

A session is (epoch, base microbatch, updates): every cell of the replica runs the schedule's
action list for `updates` updates with microbatches numbered from `base`, tags prefixed by the
epoch, so messages of an older session never mix into a newer one. Cells of one replica need not
be at the same step (a cell that joined adopted its stage's step from a live peer): each reads
weight versions relative to its own step at the session start (mesh/runtime/stage.py).

Two coordinators:
- `StaticCoordinator` (torch.distributed): one session from the cells' common step; it never
  breaks (a replica whose cell died is stopped and started again whole, by the launcher).
- `DhtCoordinator` (hivemind): every cell heartbeats a claim record
  (mesh/runtime/registry.py). Stage 0 leads its replica: once every cell of the replica has a live
  claim it writes a new session record (epoch = wall-clock ms, so a restarted leader still moves
  forward) listing the incarnation of each member it saw. A session is broken for the leader when a
  member's claim expires or changes incarnation (killed, frozen past the heartbeat lifetime,
  replaced by a join), and for a follower when the session record moves on. A cell blocked on a
  neighbour checks that between short waits, drops its in-flight microbatches and waits for the next
  session; nothing else in the grid waits on it (other replicas keep training).

A cell says what it waits for through `on_event(name, **fields)` (mesh/runtime/trainer.py writes
them as event rows; `join` prints them): `waiting` (the cells of its replica that are free or still
starting, once it has waited REPORT_EVERY_S, and again whenever that set changes; during a
running session, when a neighbour's claim is gone on two heartbeats in a row) and `session`
(a session started).

A heartbeat the DHT does not take is retried next period, and counted: the count rides in the
next beat that gets through (`beat_errors`, shown by `meshtrain status`), and the first failure
is logged once (a claim whose beats keep failing expires, and the cell is free to others).

imports: mesh, comms (errors) and stdlib.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from comms.errors import PeerTimeout
from mesh.runtime.registry import (
    CONFIG_TTL_S,
    HEARTBEAT_LIVES,
    CellRecord,
    Registry,
    RunRecord,
    SessionRecord,
    claim_ttl_s,
    running,
)

logger = logging.getLogger(__name__)
_UNREAD = object()  # _check's "claims not read yet" (None means the DHT did not answer)
# reads in a row without a member's claim before the leader calls the session broken (and its
# last read claim must have outlived its lifetime): after a DHT node dies, a read can miss a live
# claim stored on it (the soak saw a replica re-form every few seconds, each time for a member
# that was alive); a new incarnation breaks it at once
ABSENT_READS = 2
CHECK_EVERY_S = 0.25  # a blocked cell's wait slice, and the first poll period while no session
# the poll for a session backs off by this factor per empty poll, up to one heartbeat: 32 cells
# polling two records every 0.25 s swamped a 2-core box's DHT (bench scale: 200 gets/s)
POLL_BACKOFF = 1.5
# claims change once a heartbeat: a read of them is reused that long, but at most this long (a
# leader sees a member that just claimed within about a second)
REUSE_MAX_S = 1.0
GAPS_KEPT = 4  # beats whose gaps set a claim's lifetime (registry.claim_ttl_s)
CONFIG_PUTS_PER_TTL = 10  # the run's record is re-stored this many times per its lifetime
REPORT_EVERY_S = 1.0  # a cell waiting for its session says for whom after this long, and
# re-checks whom at this period (a session that forms at once is not worth a line)


class SessionBroken(Exception):
    """The replica's pipeline session ended under us: start over with the next one."""


class CellLost(Exception):
    """Another running peer owns this cell (its claim is earlier: two joins took the cell at
    once, one's claim reached the DHT late). The cell stops: sharing the name would shadow the
    owner's and stall its replica."""


class StageMove(Exception):  # noqa: N818 - a decision, not an error
    """Stage pools with elastic.rebalance: this cell leaves its over-served stage for the
    thinnest one (`join` starts over there: a new stage's module and state)."""

    def __init__(self, cell: str, to_stage: int) -> None:
        super().__init__(f"{cell} moves to stage {to_stage}, the thinnest")
        self.to_stage = to_stage


# what `join` prints when it starts over after CellLost (a bench counts these lines)
REJOIN_NOTE = "joining again for another free cell"


def lost_to(owned: dict[str, CellRecord], cell: str, peer: str, since: float) -> CellRecord | None:
    """The claim that owns `cell` when it is another peer's running cell that beat after we
    claimed (so it is alive; a dead claim read late has not beaten since); else None."""
    owner = owned.get(cell)
    if owner is None or owner.peer == peer or not running(owner) or owner.t <= since:
        return None
    return owner


@dataclass(frozen=True)
class Session:
    epoch: int
    base_mb: int
    updates: int

    def tag(self, kind: str, microbatch: int) -> str:
        return f"{self.epoch}/{kind}/{microbatch}"

    @property
    def prefix(self) -> str:
        """What every tag of this session starts with (and no other session's does)."""
        return f"{self.epoch}/"


def waiting_for(replica_cells: list[str], owned: dict[str, CellRecord], me: str) -> dict[str, str]:
    """The cells of a replica, other than `me`, that keep its session from starting: cell ->
    "free" (nobody claims it) or "joining" (a join's placeholder claim: its process is not up
    yet)."""
    out = {}
    for c in replica_cells:
        if c != me and c not in owned:
            out[c] = "free"
        elif c != me and not running(owned[c]):
            out[c] = "joining"
    return out


class Coordinator(Protocol):
    """What a StageWorker asks of whoever forms its pipeline sessions."""

    elastic: bool  # True: a lost neighbour is waited for (its replica re-forms around it)
    # the step a stop ends this fixed cell at, asked after each update (`due(step)`): a
    # launcher's own (`train`: mesh/runtime/cluster_stop.py); None: DIR/stop.json's (StopAt)
    stop_at: object | None

    def next_session(self, align: Callable[[], int]) -> Session | None:
        """The next session this cell runs (None: the run is over); align() is the cell's step."""

    def broken(self, session: Session) -> bool:
        """Whether `session` no longer stands (a member left or the leader started another)."""

    def close(self) -> None: ...


class StaticCoordinator:
    """One session for a fixed grid (every cell starts at the same step)."""

    elastic = False
    stop_at = None

    def __init__(self, steps: int, mpu: int) -> None:
        self.steps, self.mpu, self._given = steps, mpu, False

    def next_session(self, align: Callable[[], int]) -> Session | None:
        step = align()
        if self._given or step >= self.steps:
            return None
        self._given = True
        return Session(0, step * self.mpu, self.steps - step)

    def broken(self, session: Session) -> bool:
        return False

    def close(self) -> None:
        pass


@dataclass
class Beat:
    """What this cell reports in its heartbeat (filled by the worker as it trains)."""

    step: int = 0
    tps: float = 0.0
    epoch: int = 0
    stats: dict | None = None  # claim_stats.parse_stats: loss, rounds, rejects, bytes


class DhtCoordinator:
    """Sessions and heartbeats through the DHT registry (see the module docstring)."""

    elastic = True
    stop_at = None

    def __init__(
        self,
        registry: Registry,
        *,
        cell: str,
        peer: str,
        replica_cells: list[str],
        leader: bool,
        replica: int,
        steps: int,
        mpu: int,
        wait_s: float,
        run_record: RunRecord | None = None,
        since: float | None = None,
        step: int = 0,
        watch: list[int] | None = None,
    ) -> None:
        self.reg, self.cell, self.peer = registry, cell, peer
        # the replicas whose claims each beat reads: its own, or (stage pools) every replica,
        # whose cells of the stages before and after it routes to
        self.watch = [replica] if watch is None else watch
        self.token = registry.token(peer)  # bound to the signer of our claims
        self.replica_cells, self.leader, self.replica = replica_cells, leader, replica
        self.steps, self.mpu, self.wait_s = steps, mpu, wait_s
        self.run_record = run_record
        self.inc = random.getrandbits(62) | 1  # never CLAIMING (a join's placeholder)
        self.since = time.time() if since is None else since
        self.beat = Beat(step=step)
        self._session: SessionRecord | None = None
        self._active: SessionRecord | None = None  # the session the worker is running
        self._broken = False
        self._lost: CellRecord | None = None  # see CellLost
        self._absent: dict[str, int] = {}  # member -> reads in a row without its claim
        self._seen: dict[str, float] = {}  # member -> monotonic time its claim was last read
        self.on_event: Callable[..., None] | None = None  # (name, **fields); see module doc
        self.on_beat: Callable[[], None] | None = None  # after each heartbeat (health rows)
        self._reported: dict[str, str] = {}  # the last `waiting` set said
        self._missing: dict[str, str] = {}  # during a session: what the last beat saw missing
        self._stop = threading.Event()
        # the claims as last read (monotonic time, owners or None): the heartbeat thread reads
        # them once a beat and the waits use that read, so a cell reads the grid's claims about
        # once per heartbeat, not once per poll
        self._owned: tuple[float, dict[str, CellRecord] | None] = (-math.inf, None)
        self._run_put_at = -math.inf
        self._reuse_s = min(registry.heartbeat_s, REUSE_MAX_S)
        self.beat_errors = 0  # heartbeats the DHT did not take (see the module docstring)
        # the gaps between our last beats' starts (monotonic), which set our claim's lifetime
        self._beat_gaps_s: deque[float] = deque(maxlen=GAPS_KEPT)
        self._last_beat_at: float | None = None
        self.claim_ttl_s = claim_ttl_s(registry.heartbeat_s, ())
        self.heartbeat()  # claim at once: the leader may be waiting for us
        self._thread = threading.Thread(target=self._beat_forever, name="heartbeat", daemon=True)
        self._thread.start()

    # ---- heartbeats -------------------------------------------------------------------------
    def record(self) -> CellRecord:
        b = self.beat
        now = time.time()
        stats = b.stats
        if self.beat_errors:
            stats = {**(stats or {}), "beat_errors": self.beat_errors}
        return CellRecord(
            self.cell,
            self.peer,
            self.inc,
            self.since,
            b.epoch,
            b.step,
            b.tps,
            now,
            self.token,
            stats=stats,
        )

    def heartbeat(self) -> None:
        """Store our claim (and now and then the run's record); a failure is counted and
        retried next period, never raised."""
        now = time.monotonic()
        if self._last_beat_at is not None:
            self._beat_gaps_s.append(now - self._last_beat_at)
        self._last_beat_at = now
        self.claim_ttl_s = claim_ttl_s(self.reg.heartbeat_s, self._beat_gaps_s)
        try:
            taken = self.reg.beat(self.record(), self.claim_ttl_s)
            why = "the DHT did not take it"
            # the run's record lives CONFIG_TTL_S: re-stored a few times per lifetime, not per
            # beat (32 cells re-storing a few KB of TOML each beat is most of a DHT's traffic)
            due = time.monotonic() - self._run_put_at >= CONFIG_TTL_S / CONFIG_PUTS_PER_TTL
            if self.run_record is not None and due and self.reg.put_run(self.run_record):
                self._run_put_at = time.monotonic()
        except Exception as e:  # noqa: BLE001 - a missed beat is retried next period
            taken, why = False, f"{type(e).__name__}: {e}"[:300]
        if not taken:
            self.beat_errors += 1
            if self.beat_errors == 1:
                logger.warning(
                    "%s: a heartbeat failed (%s); retrying every %.1f s, failures are counted "
                    "in `meshtrain status`",
                    self.cell,
                    why,
                    self.reg.heartbeat_s,
                )

    def owners(self, max_age_s: float | None = None) -> dict[str, CellRecord] | None:
        """The live claims, read now or (max_age_s given) reused from a read that recent."""
        at, owned = self._owned
        if max_age_s is not None and owned is not None and time.monotonic() - at <= max_age_s:
            return owned
        owned = self.reg.owners(self.watch)
        if owned is not None:
            self._owned = (time.monotonic(), owned)
            self._lost = self._lost or lost_to(owned, self.cell, self.peer, self.since)
        return owned

    def cached_owners(self, max_age_s: float) -> dict[str, CellRecord] | None:
        """The live claims as the heartbeat thread last read them, if that read is at most
        max_age_s old (None: unknown; never a DHT read on the caller's thread)."""
        at, owned = self._owned
        return owned if owned is not None and time.monotonic() - at <= max_age_s else None

    def _beat_forever(self) -> None:
        """Heartbeats, and the check whether the running session still stands: here, off the
        training thread, so a slow DHT delays a verdict but never a microbatch."""
        while not self._stop.wait(self.reg.heartbeat_s):
            self.heartbeat()
            if self._active is None:
                with contextlib.suppress(Exception):
                    self.owners()  # for the session waits (next_session, _lead)
            self._watch()
            if self.on_beat is not None:
                with contextlib.suppress(Exception):  # a health row is never worth a beat
                    self.on_beat()

    def _watch(self) -> None:
        """One heartbeat's look at the running session: is it broken, and is a neighbour gone
        (said once it is missing on two beats in a row: a single read may miss a claim)."""
        active = self._active
        if active is None:
            return
        with contextlib.suppress(Exception):
            owned = self.owners()
            if not self._broken:
                verdict = self._check(active, owned)
                if self._active is active:
                    self._broken = verdict
            if owned is None or self._active is not active:
                return
            missing = waiting_for(self.replica_cells, owned, self.cell)
            if missing and missing == self._missing:
                self._report(missing)
            self._missing = missing

    def close(self) -> bool:
        """Stop beating and withdraw our claim; whether the DHT took the withdrawal (if not,
        the claim expires by itself within HEARTBEAT_LIVES beats)."""
        self._stop.set()
        self._thread.join(5)
        try:
            return self.reg.release(self.cell, self.peer, self.claim_ttl_s)
        except Exception:  # noqa: BLE001 - the DHT is gone: the claim expires by itself
            return False

    # ---- sessions ---------------------------------------------------------------------------
    def next_session(self, align: Callable[[], int]) -> Session | None:
        """Block until the replica's next session (None: the run is over for this replica).
        align() brings the cell up to its stage's live peers if it fell behind and returns its
        step: the leader calls it right before it announces a session (whose updates count
        from that step), a follower once it has its session. PeerTimeout after wait_s without
        a session (a cell of the replica never came back)."""
        deadline = time.monotonic() + self.wait_s
        report_at = time.monotonic() + REPORT_EVERY_S
        last = self._session.epoch if self._session else -1
        self._active = None  # the worker runs no session now (one that broke is over)
        poll_s = CHECK_EVERY_S
        while True:
            if self._lost is not None:
                raise CellLost(
                    f"{self.cell} is held by peer {self._lost.peer} (claimed at the same time, "
                    "earlier)"
                )
            if self.leader:
                rec = self._lead(align, last)
            else:
                # {} for a silent DHT: the leader's last signer seen, not a second read now
                owned = self.owners(self._reuse_s) or {}
                rec = self.reg.session(self.replica, self.replica_cells[0], owned)
                seen = rec is not None and (rec.done or rec.members.get(self.cell) == self.inc)
                if rec is None or rec.epoch <= last or not seen:
                    rec = None
            if rec is not None:
                self._session, self._active, self._broken = rec, None, False
                self._absent = {}
                self._seen = dict.fromkeys(rec.members, time.monotonic())
                self.beat.epoch = rec.epoch
                if rec.done:
                    return None
                if not self.leader:
                    align()
                self._reported, self._missing = {}, {}
                self._emit(
                    "session", replica=self.replica, epoch=rec.epoch, members=sorted(rec.members)
                )
                self._active = rec
                return Session(rec.epoch, rec.base_mb, rec.updates)
            if time.monotonic() >= report_at:
                report_at = time.monotonic() + REPORT_EVERY_S
                owned = self.owners(self._reuse_s)
                if owned is not None:
                    self._report(waiting_for(self.replica_cells, owned, self.cell))
            if time.monotonic() > deadline:
                owned = self.owners() or {}
                missing = [c for c in self.replica_cells if c not in owned]
                raise PeerTimeout(
                    f"{self.cell}: no pipeline session for replica {self.replica} within "
                    f"{self.wait_s:.0f} s (cells without a live peer: {missing or 'none'})"
                )
            time.sleep(poll_s)
            poll_s = min(poll_s * POLL_BACKOFF, max(CHECK_EVERY_S, self.reg.heartbeat_s))

    def _report(self, missing: dict[str, str]) -> None:
        """Say whom the replica waits for, once per change (nothing when that is nobody: the
        session is then only moments away)."""
        if missing and missing != self._reported:
            self._emit("waiting", replica=self.replica, waiting_for=missing)
        self._reported = missing

    def _emit(self, name: str, **fields: object) -> None:
        if self.on_event is not None:
            self.on_event(name, **fields)

    def _lead(self, align: Callable[[], int], last: int) -> SessionRecord | None:
        epoch = max(last + 1, int(time.time() * 1000))
        done = SessionRecord(epoch, 0, 0, {}, True)  # the run is over: followers stop
        if self._step_now() >= self.steps:
            return done if self.reg.put_session(self.replica, done) else None
        # every member's own process must be up (a join's placeholder claim is not: a session
        # with it would break as soon as the cell's process claims for itself), and our own
        # claim visible; on the recent read first, then on one made now, which the session's
        # members are taken from
        for max_age_s in (self._reuse_s, None):
            owned = self.owners(max_age_s)
            if owned is None or not self._members_up(owned):
                return None
        step = align()  # every member is there: catch up now, the session counts from here
        if step >= self.steps:
            return done if self.reg.put_session(self.replica, done) else None
        members = {c: owned[c].inc for c in self.replica_cells}
        rec = SessionRecord(epoch, step * self.mpu, self.steps - step, members)
        return rec if self.reg.put_session(self.replica, rec) else None

    def _members_up(self, owned: dict[str, CellRecord]) -> bool:
        mine = owned.get(self.cell)
        if mine is None or mine.inc != self.inc:
            return False  # our own claim is not visible yet (or someone else owns our cell)
        return all(c in owned and running(owned[c]) for c in self.replica_cells)

    def _step_now(self) -> int:
        return self.beat.step

    @property
    def lost(self) -> bool:
        """Whether another peer's live claim owns our cell (see CellLost): its state is not ours
        to save."""
        return self._lost is not None

    def broken(self, session: Session) -> bool:
        """Whether the running session no longer stands (the heartbeat thread's verdict; a
        lost cell ends it too, and the next session's wait says why)."""
        return self._broken or self._lost is not None

    def _check(self, active: SessionRecord, owned: object = _UNREAD) -> bool:
        """Leader: a member's claim changed incarnation, or is missing from ABSENT_READS reads
        in a row (in `owned`, the claims this beat read, None if the DHT did not answer; not
        given: read them now). Follower: the session record moved on. Unknown (the DHT did not
        answer) is not broken."""
        if self.leader:
            owned = self.owners() if owned is _UNREAD else owned
            if not isinstance(owned, dict):  # a silent DHT once is not asked twice per beat
                return False
            now = time.monotonic()
            gone = [c for c in active.members if owned.get(c) is None]
            self._seen.update({c: now for c in active.members if c not in gone})
            self._absent = {c: self._absent.get(c, 0) + 1 for c in gone}
            changed = any(owned[c].inc != inc for c, inc in active.members.items() if c not in gone)
            # a claim read within its lifetime cannot have expired yet: missing from a read,
            # it was missed (a loaded DHT answering from a node without it; bench scale saw
            # a 32-peer grid re-form every few seconds so), not gone
            lifetime = self.reg.heartbeat_s * HEARTBEAT_LIVES
            expired = {c for c in gone if now - self._seen.get(c, -math.inf) > lifetime}
            return changed or any(
                n >= ABSENT_READS and c in expired for c, n in self._absent.items()
            )
        read = self.owners(self._reuse_s) if owned is _UNREAD else owned
        rec = self.reg.session(self.replica, self.replica_cells[0], read or {})
        return rec is not None and rec.epoch != active.epoch
