"""State download: a joining (or far-behind) cell takes its stage's live state from a peer, in
verified chunks that fit any frame cap.

Both transports refuse a frame over max_message_bytes (256 MiB), and a stage's state (weights,
drift, optimizer state) is larger: ~330 MiB for a llama-160m middle stage, ~5 GB for a llama-1b
one. So the state goes as the chunked stream of mesh/runtime/state_chunks.py, described by a
manifest (entries, the donor's step, a digest per chunk and of the whole).

Protocol. A request is a CONTROL message "state/req" of four float32 numbers [op, nonce, a, b]:
- MANIFEST [1, nonce, chunk_values, 0]: the donor snapshots its state and answers the manifest,
  a STATE message "state/<nonce>/m" (its JSON, one byte per value);
- CHUNK [2, nonce, snapshot, i]: chunk i of that snapshot, a STATE message "state/<nonce>/<i>";
- DONE [3, nonce, snapshot, 0]: the joiner is finished with the snapshot.
A donor that cannot answer says why on the same tag, as a CONTROL message of one value (a
REFUSAL code). Every answer is checked before use: sizes by the transport (the wire's Expect),
then the manifest's schema, each chunk's shape and digest.

Consistency: the donor holds the worker's step lock only while it writes its state into a
snapshot file (a local copy at page-cache speed: the same pause as the one-vector snapshot
before; never the network transfer), then hashes and serves chunks from that file. Copying
chunk by chunk under the lock instead would not be one consistent update: averaging arrivals
change the weights without moving the step, so no step check could tell a torn state. A
snapshot in memory would be a whole-state copy on the donor; the file's pages sit in the page
cache, not in the process. Snapshots are anonymous temporary files (gone with the process), at
most MAX_SNAPSHOTS per donor, dropped when the joiner is done, after SNAPSHOT_IDLE_S unused, or
for a newer one (the joiner then starts over from a new manifest).

Joiner (`download_state`): keeps WINDOW chunk requests in flight; a chunk whose digest differs
or that timed out is asked again from the same donor (CHUNK_TRIES times, TIMEOUTS timeouts);
then, or when the donor is lost or refuses, the next donor in the list takes over. Chunks of two
donors are combined only when their manifests have the same identity (step, chunking, digests);
otherwise the new donor's manifest starts over. Verified chunks go to an anonymous staging file,
so the joiner holds its own state plus the few chunks in flight, never two states. Once every
chunk is in, the staging file is read back once (every chunk's digest again, each entry's dtype
range) and only then copied into the cell, piece by piece: a failed download leaves the cell
unchanged and says why (logged, and in the result). `timeout_s` bounds the wait for each
answer (a manifest needs the donor's snapshot and hashing; a chunk its transfer), not the whole
download.

imports: mesh, comms.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

import torch

from comms import codecs
from comms.errors import CommsError, PeerLost, PeerTimeout
from comms.transport import SendHandle, Transport
from comms.wire import Expect, Kind, Message
from mesh.engine.cell import Cell
from mesh.runtime.state_chunks import (
    CHUNK_BYTES,
    MAX_CHUNK_VALUES,
    MAX_MANIFEST_BYTES,
    REQUEST_NUMBERS,
    VALUE_BYTES,
    Manifest,
    StateFormatError,
    chunk_values_for,
    decode_manifest,
    digest,
    encode_manifest,
    whole_digest,
)
from mesh.runtime.state_files import (
    PIECE_VALUES,
    adopt_staged,
    as_bytes,
    buffer_for,
    check_staged,
    entries_of,
    hash_stream,
    live_state,
    read_at,
    write_at,
    write_snapshot,
)

LOG = logging.getLogger(__name__)

REQUEST_TAG = "state/req"
OP_MANIFEST, OP_CHUNK, OP_DONE = 1, 2, 3
GONE, UNFIT, BAD = 1, 2, 3  # refusal codes
REFUSALS = {GONE: "snapshot gone", UNFIT: "cannot serve its state", BAD: "bad request"}
POLL_S = 0.1
WINDOW = 2  # chunk requests in flight: hides the round trip, bounds the chunks held
CHUNK_TRIES = 3  # digest failures of one chunk from one donor before the next donor
TIMEOUTS = 2  # timed-out answers from one donor before the next donor
MANIFEST_TRIES = 2  # snapshots of one donor dropped under a joiner before the next donor
MAX_SNAPSHOTS = 2  # per donor: each is a state-sized file
SNAPSHOT_IDLE_S = 300.0
_FP32 = frozenset({"fp32"})
_NONCES = itertools.count(random.randrange(REQUEST_NUMBERS))


# ---- the donor ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _Snapshot:
    file: IO[bytes]
    manifest: Manifest
    used: float  # time.monotonic() of its last request


class StateServer:
    """Answers state requests from the other replicas of this stage, in a background thread.

    spool_dir: where snapshot files go (None: the system's temporary folder).
    """

    def __init__(
        self,
        transport: Transport,
        cell: Cell,
        lock: threading.Lock,
        peers: list[str],
        *,
        spool_dir: str | None = None,
    ) -> None:
        self.t, self.cell, self.lock, self.peers = transport, cell, lock, peers
        self.spool_dir = spool_dir
        self.served = 0  # manifests answered
        self.chunks_served = 0
        self._snapshots: dict[tuple[str, int], _Snapshot] = {}
        self._ids = itertools.count(random.randrange(REQUEST_NUMBERS))
        self._buffer = buffer_for(0)
        self._stop = threading.Event()
        self._expect = Expect(kind=Kind.CONTROL, shape=(4,), codecs=_FP32)
        self._thread = threading.Thread(target=self._serve, name="state-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            busy = False  # waited on a link or answered: else every link is gone, do not spin
            for peer in self.peers:
                timeout = POLL_S
                while not self._stop.is_set():
                    try:
                        msg = self.t.recv(peer, REQUEST_TAG, self._expect, timeout)
                    except PeerTimeout:
                        busy = busy or timeout > 0
                        break
                    except PeerLost:
                        break
                    self._answer(peer, msg)
                    busy, timeout = True, 0.0  # this peer's other requests, now
            self._expire()
            if not busy:
                self._stop.wait(POLL_S)

    def _answer(self, peer: str, msg: Message) -> None:
        try:
            op, nonce, a, b = _request_numbers(msg.tensor())
        except StateFormatError:
            self.t.stats.add_reject("bad_state_request")
            return
        with contextlib.suppress(CommsError):
            if op == OP_MANIFEST:
                self._send_manifest(peer, nonce, a)
            elif op == OP_CHUNK:
                self._send_chunk(peer, nonce, a, b)
            else:
                self._release((peer, a))

    def _send_manifest(self, peer: str, nonce: int, chunk_values: int) -> None:
        tag = f"state/{nonce}/m"
        if not 1 <= chunk_values <= MAX_CHUNK_VALUES:
            return self._refuse(peer, tag, BAD)
        try:
            snap = self._snapshot(peer, chunk_values)
        except (StateFormatError, OSError):  # a dtype the wire cannot carry; a full disk
            snap = None
        if snap is None:
            return self._refuse(peer, tag, UNFIT)
        m = snap.manifest
        self.t.send(peer, tag, Kind.STATE, codecs.encode(encode_manifest(m), "fp32"), m.step)
        self.served += 1

    def _snapshot(self, peer: str, chunk_values: int) -> _Snapshot | None:
        """A new snapshot of the cell for `peer` (None: its state is not finite)."""
        while len(self._snapshots) >= MAX_SNAPSHOTS:
            self._release(min(self._snapshots, key=lambda k: self._snapshots[k].used))
        file = tempfile.TemporaryFile(dir=self.spool_dir)
        try:
            with self.lock:
                slots = live_state(self.cell)
                entries, step = entries_of(slots), self.cell.step
                write_snapshot(slots, entries, file.fileno())
            if self._buffer.numel() < chunk_values:
                self._buffer = buffer_for(chunk_values)
            total = sum(e.values for e in entries)
            chunks, finite = hash_stream(file.fileno(), total, chunk_values, self._buffer)
        except BaseException:
            file.close()
            raise
        if not finite:
            file.close()
            return None
        sid = next(self._ids) % REQUEST_NUMBERS
        manifest = Manifest(step, sid, chunk_values, entries, chunks, whole_digest(chunks))
        snap = self._snapshots[(peer, sid)] = _Snapshot(file, manifest, time.monotonic())
        return snap

    def _send_chunk(self, peer: str, nonce: int, sid: int, index: int) -> None:
        tag = f"state/{nonce}/{index}"
        snap = self._snapshots.get((peer, sid))
        if snap is None:
            return self._refuse(peer, tag, GONE)
        m = snap.manifest
        if index >= len(m.chunks):
            return self._refuse(peer, tag, BAD)
        snap.used = time.monotonic()
        start, stop = m.chunk_range(index)
        if self._buffer.numel() < stop - start:
            self._buffer = buffer_for(m.chunk_values)
        try:
            part = read_at(snap.file.fileno(), self._buffer[: stop - start], start * VALUE_BYTES)
        except OSError:
            return self._refuse(peer, tag, UNFIT)
        # send frames the buffer at once (a copy), so the buffer serves the next chunk
        self.t.send(peer, tag, Kind.STATE, codecs.encode(part, "fp32"), m.step)
        self.chunks_served += 1

    def _refuse(self, peer: str, tag: str, code: int) -> None:
        enc = codecs.encode(torch.tensor([float(code)]), "fp32")
        self.t.send(peer, tag, Kind.CONTROL, enc, self.cell.step)

    def _release(self, key: tuple[str, int]) -> None:
        snap = self._snapshots.pop(key, None)
        if snap is not None:
            snap.file.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._snapshots.items() if now - s.used > SNAPSHOT_IDLE_S]:
            self._release(key)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if not self._thread.is_alive():  # else it may still read them: freed at exit
            for key in list(self._snapshots):
                self._release(key)


def _request_numbers(v: torch.Tensor) -> tuple[int, int, int, int]:
    """[op, nonce, a, b] of a request (finite float32, checked by the wire), as ints."""
    if not (torch.equal(v, v.trunc()) and v.min() >= 0 and v.max() < REQUEST_NUMBERS):
        raise StateFormatError("request numbers are not ints in range")
    op, nonce, a, b = (int(x) for x in v.tolist())
    if op not in (OP_MANIFEST, OP_CHUNK, OP_DONE):
        raise StateFormatError(f"unknown request {op}")
    return op, nonce, a, b


# ---- the joiner --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Download:
    """What download_state did: true when the cell holds `donor`'s state now."""

    ok: bool
    donor: str | None = None
    reason: str = ""  # why each donor passed over failed, one clause each ("" if none)

    def __bool__(self) -> bool:
        return self.ok


Progress = Callable[[str, int, int], None]  # (donor, chunks staged, chunks in all)


class _DonorFailed(Exception):
    """This donor will not deliver (the message says why); the next one is tried."""


class _SnapshotGone(Exception):
    """The donor dropped the snapshot being fetched: ask it for a new manifest."""


class _Joiner:
    """One download: the staging file and what it holds (the chunks of `manifest` in
    `have`), and how the donors are asked."""

    def __init__(
        self,
        t: Transport,
        cell: Cell,
        fd: int,
        chunk_bytes: int,
        timeout_s: float,
        window: int,
        progress: Progress | None,
    ) -> None:
        self.t, self.fd, self.timeout_s, self.progress = t, fd, timeout_s, progress
        self.window, self.step = max(1, window), cell.step  # the step: requests' wire header
        self.expected = entries_of(live_state(cell))  # a donor's entries must be the same
        self.chunk_values = chunk_values_for(sum(e.values for e in self.expected), chunk_bytes)
        self.buffer = buffer_for(PIECE_VALUES)
        self.manifest: Manifest | None = None
        self.have: set[int] = set()

    def fetch(self, donor: str) -> Manifest:
        """Stage every chunk of one of donor's snapshots; its manifest. Chunks staged from an
        earlier manifest of the same identity (any donor's) are kept."""
        for _ in range(MANIFEST_TRIES):
            nonce, m = next(_NONCES) % REQUEST_NUMBERS, None
            try:
                m = self._ask_manifest(donor, nonce)
                if self.manifest is None or self.manifest.identity != m.identity:
                    self.have = set()
                self.manifest = m
                self._fetch_chunks(donor, nonce, m)
                return m
            except _SnapshotGone:
                continue
            finally:
                if m is not None:  # the donor may drop the snapshot now
                    with contextlib.suppress(_DonorFailed):
                        self._request(donor, OP_DONE, nonce, m.snapshot)
                self.t.drop_tags(f"state/{nonce}/")  # answers still on their way are dropped
        raise _DonorFailed(f"its snapshot was dropped {MANIFEST_TRIES} times while fetching")

    def _request(self, donor: str, op: int, nonce: int, a: int, b: int = 0) -> SendHandle:
        enc = codecs.encode(torch.tensor([op, nonce, a, b], dtype=torch.float32), "fp32")
        try:
            return self.t.send(donor, REQUEST_TAG, Kind.CONTROL, enc, self.step)
        except (CommsError, ValueError) as e:  # ValueError: a name the transport does not know
            raise _DonorFailed(f"request not sent ({e})") from None

    def _answer(self, donor: str, tag: str, max_values: int) -> Message:
        """The STATE answer on `tag`; _SnapshotGone or _DonorFailed on a refusal; PeerTimeout."""
        expect = Expect(name=tag, codecs=_FP32, max_body_bytes=VALUE_BYTES * max_values)
        try:
            msg = self.t.recv(donor, tag, expect, self.timeout_s)
        except PeerLost as e:
            raise _DonorFailed(f"lost ({e})") from None
        if msg.kind == Kind.CONTROL and msg.encoded.shape == (1,):
            code = int(msg.tensor()[0].item())
            if code == GONE:
                raise _SnapshotGone()
            raise _DonorFailed(f"it refused: {REFUSALS.get(code, f'code {code}')}")
        if msg.kind != Kind.STATE:
            raise _DonorFailed(f"a {msg.kind.name} message {msg.encoded.shape} as an answer")
        return msg

    def _ask_manifest(self, donor: str, nonce: int) -> Manifest:
        self._request(donor, OP_MANIFEST, nonce, self.chunk_values)
        try:
            msg = self._answer(donor, f"state/{nonce}/m", MAX_MANIFEST_BYTES)
        except PeerTimeout:
            raise _DonorFailed(f"no manifest within {self.timeout_s:g}s") from None
        try:
            m = decode_manifest(msg.tensor())
        except StateFormatError as e:
            raise _DonorFailed(f"bad manifest ({e})") from None
        if m.entries != self.expected:
            odd = sorted(e.name for e in set(self.expected) ^ set(m.entries))[:3]
            raise _DonorFailed(f"its state does not fit this stage (entries {odd} differ)")
        if m.chunk_values != self.chunk_values or msg.sender_step != m.step:
            raise _DonorFailed("its manifest is not the one asked for (chunk size or step)")
        return m

    def _fetch_chunks(self, donor: str, nonce: int, m: Manifest) -> None:
        todo = deque(i for i in range(len(m.chunks)) if i not in self.have)
        inflight: deque[tuple[int, SendHandle]] = deque()
        tries: Counter[int] = Counter()
        timeouts = 0
        while todo or inflight:
            while todo and len(inflight) < self.window:
                i = todo.popleft()
                inflight.append((i, self._request(donor, OP_CHUNK, nonce, m.snapshot, i)))
            i, sent = inflight.popleft()
            try:
                msg = self._answer(donor, f"state/{nonce}/{i}", m.chunk_values)
            except PeerTimeout:
                if sent.done():  # a request that could not leave: the link is gone
                    with contextlib.suppress(PeerTimeout):
                        try:
                            sent.wait(0)
                        except PeerLost as e:
                            raise _DonorFailed(f"lost ({e})") from None
                timeouts += 1
                if timeouts >= TIMEOUTS:
                    raise _DonorFailed(
                        f"no chunk {i} within {self.timeout_s:g}s, {timeouts} times"
                    ) from None
                todo.appendleft(i)  # a frame lost or rejected on the way: ask again
                continue
            start, stop = m.chunk_range(i)
            data = as_bytes(msg.encoded.data)
            if msg.encoded.shape == (stop - start,) and digest(data) == m.chunks[i]:
                write_at(self.fd, data, start * VALUE_BYTES)
                self.have.add(i)
                if self.progress is not None:
                    self.progress(donor, len(self.have), len(m.chunks))
                continue
            tries[i] += 1
            if tries[i] >= CHUNK_TRIES:
                raise _DonorFailed(f"chunk {i} failed its digest {tries[i]} times")
            todo.appendleft(i)


def download_state(
    transport: Transport,
    cell: Cell,
    donors: str | Sequence[str],
    timeout_s: float,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    window: int = WINDOW,
    staging_dir: str | None = None,
    progress: Progress | None = None,
) -> Download:
    """Replace the cell's state with the first of `donors` (in preference order) that delivers
    it whole and verified; Download(ok=False, reason) with the cell unchanged if none did.
    timeout_s bounds each answer; chunks carry at most chunk_bytes of payload (see
    state_chunks.chunk_values_for); staging_dir holds the staging file (None: the system's
    temporary folder); progress(donor, staged, total) is called after each verified chunk."""
    donors = [donors] if isinstance(donors, str) else list(donors)
    failures: list[str] = []
    try:
        with tempfile.TemporaryFile(dir=staging_dir) as staging:
            job = _Joiner(
                transport, cell, staging.fileno(), chunk_bytes, timeout_s, window, progress
            )
            for donor in donors:
                try:
                    manifest = job.fetch(donor)
                    why = check_staged(job.fd, manifest, job.buffer)
                    if why is not None:
                        job.manifest = None  # nothing staged is trusted any more
                        raise _DonorFailed(why)
                except _DonorFailed as e:
                    failures.append(f"state download from {donor} failed: {e}")
                    continue
                adopt_staged(cell, job.fd, manifest, job.buffer)
                return Download(True, donor, "; ".join(failures))
    except (OSError, StateFormatError) as e:  # no room to stage; a state the wire cannot carry
        failures.append(f"state download failed: {e}")
    reason = "; ".join(failures) or "state download failed: no donor to ask"
    LOG.warning(reason)
    return Download(False, None, reason)
