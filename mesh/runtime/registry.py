"""The grid as the DHT sees it: cell claims with heartbeats, replica sessions, the run's config.

Records (values are plain dicts, MSGPack-encoded by hivemind; any peer can write any key, so every
field is type-checked here and records without a valid membership token are ignored and counted):
- `cells.r<i>`, subkey `<cell>/<peer_id>[owner:<RSA key>]`: a claim of a cell of replica i and
  its heartbeat (one key per replica: a replica's cells read only their own replica's claims,
  so no DHT key is read by every peer of a 32-peer grid and an answer is 1/m of the grid; a
  claim filed under another replica's key is rejected), signed (only
  the claiming process can write or withdraw it: hivemind's RSASignatureValidator), re-stored every
  `elastic.heartbeat_s` with a lifetime of HEARTBEAT_LIVES beats (of the beats as they come:
  longer while a loaded box spaces them out, claim_ttl_s): {cell, peer, inc (the
  process's incarnation), since (claim time), epoch, step, tps, t, auth, and optionally stats
  (loss, rounds, rejects, bytes: what `status --json` and the dashboard show)}. A claim that stops
  beating expires: the cell is free again. Two live claims of one cell: the earlier `since` owns
  it (ties: the smaller PeerID); the other claimer sees it lost and moves on.
  The membership token covers the PeerID and the signer (the subkey's owner marker), so a
  token copied out of someone's record is worthless under another signer.
- `session.r<i>`, subkey `leader<owner marker>`: replica i's current pipeline session
  (mesh/runtime/session.py), signed; readers take only the record signed by the current owner of the
  replica's leader cell, so nobody else can stop or redirect a replica.
- `config`, subkey `run`: the run's resolved config (TOML), its fingerprint and the run key's
  check value; what `join` reads before it claims anything.

Every record is sealed with the run key (comms.p2p.auth.Auth.seal: an `exp` and an HMAC `sig`
over key, subkey, value and exp, under a secret of run key and fingerprint). A reader with the
run's Auth takes only records that unseal; the others are ignored and counted
(`bad_signatures`, by record kind). A reader that does not know the run yet (join's first read,
`status` without the key) checks the config record itself with `RunRecord.signed_by(run_key)`.

Where: the keys above are under the run key's own prefix (comms.p2p.auth.records_space, e.g.
`k1f2e....cells.r0`; none without a key), which nobody without the key can name: a keyless
writer cannot flood a keyed run's claims, block their stores or squat its config record. A
keyed run's config record is also stored at the public `config` (the same sealed value), where
a joiner without the key, or with another one, learns that the run has a key.

Pure functions on parsed records (owner, free cells, status rows) have direct unit tests.

imports: stdlib, comms.p2p.auth, comms.transport and mesh.algo.topology (the records come
through a comms.transport.Directory: comms.p2p.transport.P2PTransport, comms.p2p.dht.DhtClient).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from comms.p2p.auth import Auth, records_space, signer_of
from mesh.algo.topology import Place
from mesh.runtime.claim_stats import is_number, parse_stats

if TYPE_CHECKING:  # the protocol only: `join` checks its arguments before torch is imported
    from comms.transport import Directory

T = TypeVar("T")

HEARTBEAT_LIVES = 4  # a claim lives this many heartbeat periods without a refresh
# a loaded box's beats come further apart than their period (a beat waits for its store's acks
# and a claims read): a claim then lives as many of the beats as it sees, at most this many
# times its idle lifetime (a dead holder's cell is free again within that)
MAX_CLAIM_STRETCH = 4.0


def claim_ttl_s(heartbeat_s: float, recent_gaps_s: Iterable[float]) -> float:
    """A claim's lifetime: HEARTBEAT_LIVES heartbeats, or HEARTBEAT_LIVES of the longest
    recent gap between this holder's beats where that is longer (so `status` and the other
    cells never read a beating holder's claim as expired between two slow beats), capped at
    MAX_CLAIM_STRETCH times the idle lifetime."""
    base = heartbeat_s * HEARTBEAT_LIVES
    longest = max(recent_gaps_s, default=0.0)
    return min(max(base, HEARTBEAT_LIVES * longest), MAX_CLAIM_STRETCH * base)


CONFIG_TTL_S = 600.0
SESSION_TTL_S = 600.0


@dataclass(frozen=True)
class CellRecord:
    cell: str
    peer: str
    inc: int
    since: float
    epoch: int
    step: int
    tps: float
    t: float
    auth: str | None
    signer: str = ""  # the owner marker of the subkey it was stored under (not in the value)
    stats: dict[str, Any] | None = None  # what a dashboard shows of it (parse_stats); optional


def parse_cell(value: object) -> CellRecord | None:
    """A claim/heartbeat record, or None when any field is missing or of the wrong type."""
    if not isinstance(value, dict) or value.get("v") != 1:
        return None
    cell, peer = value.get("cell"), value.get("peer")
    if not isinstance(cell, str) or not isinstance(peer, str):
        return None
    nums = [value.get(k) for k in ("inc", "since", "epoch", "step", "tps", "t")]
    if not all(is_number(x) for x in nums):
        return None
    auth = value.get("auth")
    inc, since, epoch, step, tps, t = nums
    return CellRecord(
        cell,
        peer,
        int(inc),
        float(since),
        int(epoch),
        int(step),
        float(tps),
        float(t),
        auth if isinstance(auth, str) else None,
        stats=parse_stats(value.get("stats")),
    )


def cell_value(rec: CellRecord) -> dict[str, Any]:
    fields = (k for k in CellRecord.__dataclass_fields__ if k not in ("signer", "stats"))
    value = {"v": 1, **{k: getattr(rec, k) for k in fields}}
    return value if rec.stats is None else {**value, "stats": rec.stats}


NO_CONFIG_REPLICAS = 64  # replicas a reader without the run's config probes at most


def replica_of(cell: str) -> int | None:
    """The replica of a cell name "s<stage>r<replica>" (None: not a cell name)."""
    found = Place.parse(cell)
    return None if found is None else found.replica


def claims_key(replica: int) -> str:
    """The DHT key of replica's claims."""
    return f"cells.r{replica}"


CLAIMING = 0  # `inc` of a join's placeholder claim: the cell's process is not up yet


def running(rec: CellRecord) -> bool:
    """Whether a claim is a running cell's (not a join's placeholder, see cli/join.py)."""
    return rec.inc != CLAIMING


def owners(records: list[CellRecord]) -> dict[str, CellRecord]:
    """cell -> the claim that owns it: the earliest `since`, ties to the smaller PeerID."""
    out: dict[str, CellRecord] = {}
    for r in records:
        cur = out.get(r.cell)
        if cur is None or (r.since, r.peer) < (cur.since, cur.peer):
            out[r.cell] = r
    return out


def free_cells(all_cells: list[str], owned: dict[str, CellRecord]) -> list[str]:
    """Cells nobody holds, in the grid's order."""
    return [c for c in all_cells if c not in owned]


@dataclass(frozen=True)
class SessionRecord:
    epoch: int
    base_mb: int  # data index of the session's first microbatch
    updates: int  # updates each cell of the replica runs in the session
    members: dict[str, int]  # cell -> incarnation the leader saw
    done: bool = False  # the replica finished the run: followers stop


def parse_session(value: object) -> SessionRecord | None:
    if not isinstance(value, dict) or value.get("v") != 1:
        return None
    epoch, base, updates, members = (value.get(k) for k in ("epoch", "base", "updates", "members"))
    if not (isinstance(epoch, int) and isinstance(base, int) and isinstance(updates, int)):
        return None
    if not isinstance(members, dict) or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in members.items()
    ):
        return None
    return SessionRecord(epoch, base, updates, dict(members), bool(value.get("done", False)))


def session_value(s: SessionRecord) -> dict[str, Any]:
    return {
        "v": 1,
        "epoch": s.epoch,
        "base": s.base_mb,
        "updates": s.updates,
        "members": s.members,
        "done": s.done,
    }


@dataclass(frozen=True)
class RunRecord:
    fingerprint: str
    toml: str
    key_check: str
    # a prepared dataset's identity (mesh.data.manifest.identity): a joiner whose data differs
    # is told what differs (tokenizer, which shard), not only that the digests do
    data: dict[str, Any] | None = None
    # the record as read from the DHT (with its exp and sig), for signed_by; None when made here
    raw: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    subkey: str = field(default="run", compare=False, repr=False)  # the writer's slot

    def signed_by(self, run_key: str | None, now: float | None = None) -> bool:
        """Whether the record as read is sealed with run_key for its own fingerprint."""
        auth = Auth.of(run_key, self.fingerprint)
        when = time.time() if now is None else now
        return auth.unseal(CONFIG_KEY, self.subkey, self.raw, when) is not None

    @property
    def claims_a_key(self) -> bool:
        """Whether the record says its run has a key (its key check is not the keyless one)."""
        return self.key_check != Auth.of(None, self.fingerprint).key_check


# where the run's record lives: one slot per writer, f"run{owner marker}" (only its writer can
# store there: comms.p2p.dht.owner_marker), so a forger cannot push the real record out
CONFIG_KEY, CONFIG_SLOT = "config", "run"


def parse_run(value: object, subkey: str = CONFIG_SLOT) -> RunRecord | None:
    if not isinstance(value, dict) or value.get("v") != 1:
        return None
    fp, toml, check = value.get("fingerprint"), value.get("toml"), value.get("key_check")
    if not (isinstance(fp, str) and isinstance(toml, str) and isinstance(check, str)):
        return None
    data = value.get("data")
    return RunRecord(fp, toml, check, data if isinstance(data, dict) else None, dict(value), subkey)


def pick_run(records: list[RunRecord], run_key: str | None) -> RunRecord | None:
    """The record a peer with run_key takes among the writers' slots at the public `config`
    (what its key_verdict is told from): one sealed with its key (a key is given); else a
    sealed one that claims a key, so that a peer without the key hears that the run needs one
    rather than following an empty-key record a forger wrote beside it; else one sealed with
    the empty key (an open run), else any that claims a key; else any."""
    sealed = lambda r: isinstance((r.raw or {}).get("sig"), str)  # noqa: E731
    for ok in (
        lambda r: bool(run_key) and r.signed_by(run_key),
        lambda r: sealed(r) and r.claims_a_key,
        lambda r: r.signed_by(None),
        lambda r: r.claims_a_key,
        lambda r: True,
    ):
        found = [r for r in records if ok(r)]
        if found:
            return found[0]
    return None


class Registry:
    """Reads and writes the records above through a Directory. With an Auth, claims must carry
    its token for their PeerID (others are ignored and counted in `rejected`); without one
    (`status` before it knows the run), every well-formed claim counts. Records live in the
    run key's space: the Auth's key, else run_key (a reader that has the key but not yet the
    run's fingerprint)."""

    def __init__(
        self,
        directory: Directory,
        auth: Auth | None,
        heartbeat_s: float,
        run_key: str | None = None,
    ) -> None:
        self.d, self.auth, self.heartbeat_s = directory, auth, heartbeat_s
        self.space = auth.space if auth is not None else records_space((run_key or "").encode())
        self.rejected = 0  # claims ignored: malformed, unsealed or without a valid token
        self.bad_signatures: Counter[str] = Counter()  # record kind -> records that did not unseal
        self._leaders: dict[str, str] = {}  # leader cell -> signer of its last owner seen
        # cell -> signers whose claim on it the last read found withdrawn (release(): a clean
        # stop) and not yet expired; a claim that expired without one was never released
        self.withdrawn: dict[str, set[str]] = {}

    def _seal(self, key: str, subkey: str, value: dict[str, Any], ttl_s: float) -> dict[str, Any]:
        """value as stored: sealed with the run's Auth (unsealed without one: tests of the
        pure logic, whose readers have none either)."""
        if self.auth is None:
            return value
        return self.auth.seal(key, subkey, value, round(time.time() + ttl_s, 3))

    def _open(self, kind: str, key: str, subkey: str, value: object) -> object:
        """A record's value once its seal is checked (None, counted, when it does not unseal);
        without an Auth the value as it is."""
        if self.auth is None:
            return value
        body = self.auth.unseal(key, subkey, value, time.time())
        if body is None:
            self.bad_signatures[kind] += 1
        return body

    def valid(self, peer: str, signer: str, token: str | None) -> bool:
        return self.auth is None or self.auth.valid(peer, signer, token)

    def token(self, peer: str) -> str | None:
        """The membership token for our claims (signed with our directory's owner marker)."""
        return None if self.auth is None else self.auth.token(peer, self.d.owner_marker)

    def _get(self, key: str, space: str | None = None) -> dict[str, Any] | None:
        where = self.space if space is None else space
        return self.d.dht_get(where + key, timeout_s=max(2.0, 2 * self.heartbeat_s))

    def _put(self, key: str, subkey: str, value: Any, ttl_s: float, **kw: Any) -> bool:
        return self.d.dht_store(self.space + key, subkey, value, ttl_s, **kw)

    def cells(self, replicas: Iterable[int]) -> list[CellRecord] | None:
        """Every valid live claim of those replicas' cells (read in parallel); None when the
        DHT did not answer for one of them (unknown, not empty: a replica missing from a
        read would look free)."""
        replicas = list(replicas)
        found = self.d.dht_get_many(
            [self.space + claims_key(i) for i in replicas],
            timeout_s=max(2.0, 2 * self.heartbeat_s),
            withdrawn=True,
        )
        if any(f is None for f in found):
            return None
        out = []
        for replica, claims in zip(replicas, found):
            claims = claims or {}
            self._withdrawn(replica, [k for k, v in claims.items() if v is None])
            out.extend(self._valid(replica, {k: v for k, v in claims.items() if v is not None}))
        return out

    def _withdrawn(self, replica: int, subkeys: list[str]) -> None:
        """Note the claims of `replica`'s cells their owners withdrew (by the subkey's signer:
        only the owner can write under its marker, so nobody withdraws another's claim)."""
        for cell in [c for c in self.withdrawn if replica_of(c) == replica]:
            del self.withdrawn[cell]
        for subkey in subkeys:
            cell, _, rest = subkey.partition("/")
            at = rest.find("[owner:")
            signer = signer_of(subkey, f"{cell}/{rest[:at]}") if at > 0 else None
            if signer and replica_of(cell) == replica:
                self.withdrawn.setdefault(cell, set()).add(signer)

    def _valid(self, replica: int, found: dict[str, Any]) -> list[CellRecord]:
        out = []
        for subkey, sealed in found.items():
            value = self._open("claim", claims_key(replica), subkey, sealed)
            rec = parse_cell(value)
            signer = None if rec is None else signer_of(subkey, f"{rec.cell}/{rec.peer}")
            if (
                rec is None
                or signer is None
                or replica_of(rec.cell) != replica
                or not self.valid(rec.peer, signer, rec.auth)
            ):
                self.rejected += 1
                continue
            out.append(replace(rec, signer=signer))
        return out

    def owners(self, replicas: Iterable[int]) -> dict[str, CellRecord] | None:
        """cell -> its owning claim, over those replicas' cells (None: no answer)."""
        cells = self.cells(replicas)
        return None if cells is None else owners(cells)

    def probe_owners(self) -> dict[str, CellRecord] | None:
        """owners() for a reader that does not know the grid (no readable run config): replica
        by replica from 0 until one has no claim, at most NO_CONFIG_REPLICAS."""
        out: dict[str, CellRecord] = {}
        for replica in range(NO_CONFIG_REPLICAS):
            found = self.owners([replica])
            if found is None:
                return None if replica == 0 else out
            if not found:
                return out
            out.update(found)
        return out

    def _subkey(self, cell: str, peer: str) -> str:
        # signed: only this process can write or withdraw its claim (comms.p2p.dht.owner_marker)
        return f"{cell}/{peer}{self.d.owner_marker}"

    def _claims_key_of(self, cell: str) -> str:
        replica = replica_of(cell)
        assert replica is not None, f"not a cell name: {cell!r}"
        return claims_key(replica)

    def beat(self, rec: CellRecord, min_ttl_s: float = 0.0) -> bool:
        """Store a claim for HEARTBEAT_LIVES heartbeats (at least min_ttl_s)."""
        ttl = max(self.heartbeat_s * HEARTBEAT_LIVES, min_ttl_s)
        key, subkey = self._claims_key_of(rec.cell), self._subkey(rec.cell, rec.peer)
        return self._put(key, subkey, self._seal(key, subkey, cell_value(rec), ttl), ttl)

    def release(self, cell: str, peer: str, min_ttl_s: float = 0.0) -> bool:
        """Withdraw a claim (bounded wait: on Ctrl-C the DHT may already be going down with
        the terminal's process group; the claim then expires by itself). Whether it was.
        min_ttl_s: the claim's own (beat's); the withdrawal outlives it, or a node that missed
        the withdrawal would bring the claim back in a read's merge."""
        ttl = max(self.heartbeat_s * HEARTBEAT_LIVES, min_ttl_s) + 1
        key = self._claims_key_of(cell)
        return self._put(key, self._subkey(cell, peer), None, ttl, timeout_s=2.0)

    def session(
        self, replica: int, leader_cell: str, owned: dict[str, CellRecord] | None = None
    ) -> SessionRecord | None:
        """Replica's session as written by the current owner of leader_cell, or by its last
        owner we saw while none holds it (None: none yet, or the DHT did not answer). `owned`:
        claims the caller read lately (not given: read them now)."""
        if owned is None:
            owned = self.owners([replica])
        lead = (owned or {}).get(leader_cell)
        if lead is not None:
            self._leaders[leader_cell] = lead.signer
        key = f"session.r{replica}"
        found = self._get(key)
        if not found:
            return None
        # a leader that finished the run writes `done` and leaves: its last signer still counts
        signer = self._leaders.get(leader_cell)
        if signer is None or f"leader{signer}" not in found:
            return None
        subkey = f"leader{signer}"
        return parse_session(self._open("session", key, subkey, found[subkey]))

    def put_session(self, replica: int, s: SessionRecord) -> bool:
        key, subkey = f"session.r{replica}", f"leader{self.d.owner_marker}"
        value = self._seal(key, subkey, session_value(s), SESSION_TTL_S)
        return self._put(key, subkey, value, SESSION_TTL_S)

    def run_records(self, space: str | None = None) -> list[RunRecord] | None:
        """Every writer's copy of the run's record in `space` (default: this registry's; ""
        the public `config`), as stored (seals not checked); None: the DHT did not answer."""
        found = self._get(CONFIG_KEY, space)
        if found is None:
            return None
        recs = [parse_run(v, k) for k, v in sorted(found.items()) if k.startswith(CONFIG_SLOT)]
        return [r for r in recs if r is not None]

    def runs(self) -> list[RunRecord]:
        """The copies at the public `config` ([] when the DHT did not answer)."""
        return self.run_records("") or []

    def sealed_runs(self, run_key: str, space: str | None = None) -> list[RunRecord] | None:
        """The copies in run_key's space (or `space`) sealed with run_key; the others there are
        counted (bad_signatures["config"]) and ignored. None: the DHT did not answer."""
        found = self.run_records(records_space(run_key.encode()) if space is None else space)
        if found is None:
            return None
        good = [r for r in found if r.signed_by(run_key)]
        self.forged_runs(len(found) - len(good))
        return good

    def forged_runs(self, n: int) -> None:
        """Count n config records that did not unseal with the run key."""
        if n:
            self.bad_signatures["config"] += n

    def run(self, run_key: str | None = None) -> RunRecord | None:
        """The run's record a peer with run_key follows. With a key: one sealed with it, from
        the key's own space (sealed_runs), so that no record a peer without the key wrote is
        ever followed or refused (an owner starting its run cannot be squatted). Without one:
        pick_run at the public `config`; the caller checks its seal (RunRecord.signed_by, then
        cli.join.key_verdict says why it is refused)."""
        if run_key:
            return next(iter(self.sealed_runs(run_key) or []), None)
        return pick_run(self.runs(), None)

    def put_run(self, rec: RunRecord) -> bool:
        """Store our copy of the run's record in our slot: in the key's space, and (a keyed
        run) at the public `config` too. Whether the first store was taken."""
        value = {"v": 1, "fingerprint": rec.fingerprint, "toml": rec.toml}
        if rec.data is not None:
            value["data"] = rec.data
        slot = f"{CONFIG_SLOT}{self.d.owner_marker}"
        sealed = self._seal(CONFIG_KEY, slot, {**value, "key_check": rec.key_check}, CONFIG_TTL_S)
        taken = self._put(CONFIG_KEY, slot, sealed, CONFIG_TTL_S)
        if self.space:  # the public copy: best effort, members never read it
            self.d.dht_store(CONFIG_KEY, slot, sealed, CONFIG_TTL_S)
        return taken


def read_again(read: Callable[[], T | None], reads: int, pause_s: float = 1.0) -> T | None:
    """read(), again pause_s apart while it answers None (a busy DHT did not answer), up to
    `reads` times."""
    for k in range(reads):
        found = read()
        if found is not None or k == reads - 1:
            return found
        time.sleep(pause_s)
    return None


def now() -> float:
    return time.time()
