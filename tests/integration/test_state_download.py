"""State download in verified chunks (mesh/runtime/state_sync.py) over real transports on
127.0.0.1: a stage larger than a frame arrives bit-identical on both backends, a chunk damaged
in flight is asked again (and one damaged every time is never adopted), a donor closed
mid-transfer is replaced by the next. Donor and joiner are threads of this process (the
transports are real: gloo pairs, libp2p streams through p2pd); the pure parts have their own
tests in tests/unit/test_state_chunks.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator

import helpers
import pytest
import torch
from p2p_procs import p2pd_descendants

from comms.build import local_rendezvous, make_transport
from comms.transport import Transport
from comms.wire import Kind
from mesh.config import load_config
from mesh.engine.cell import Cell
from mesh.model.build import build_stage
from mesh.runtime.state_chunks import chunk_count, chunk_values_for
from mesh.runtime.state_files import entries_of, live_state
from mesh.runtime.state_sync import StateServer, download_state

BACKENDS = ["torch", "hivemind"]
# a llama stage wider than a frame: 21.5M parameters, 329 MiB of state (weights, drift, two
# nadamw moments) against the transports' 256 MiB max_message_bytes
WIDE = ["model.arch=llama", "model.n_layers=2", "model.d_model=1152", "model.n_heads=8"]
SMALL_CHUNKS = 16 << 10  # bytes: a tiny cell still goes in dozens of chunks
TIMEOUT_S = 30.0
# a DHT forked from this many-threaded test process can hang before it is ready: room for a
# second start (comms.p2p.dht.start_dht gives a stuck one half of it)
START_S = 60.0

pytestmark = pytest.mark.timeout(300)


def _cell(extra: list[str], replica: int = 0, stage: int = 1) -> Cell:
    cfg = load_config([], [*helpers.TINY_MODEL, "grid.stages=2", "grid.replicas=3", *extra])
    return Cell.build(cfg, stage, replica, build_stage(cfg.model, 2, stage, cfg.run.seed))


def _train(cell: Cell, steps: int, seed: int) -> None:
    """Move the cell's every state entry off its init: weights, moments, step counts, drift."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        cell.apply_update([torch.randn(p.shape, generator=gen) * 0.01 for p in cell.params])
        cell.push_version()
    cell.drift.copy_(torch.randn(cell.drift.shape, generator=gen))


def _state(cell: Cell) -> list[tuple[str, object]]:
    """A copy of the cell's state (to compare with later)."""
    return [
        (s.name, s.value.clone() if isinstance(s.value, torch.Tensor) else s.value)
        for s in live_state(cell)
    ]


def _assert_same_state(a: Cell | list, b: Cell) -> None:
    """Every entry bit-identical: flat, drift, each optimizer tensor (own dtype) and number."""
    left = _state(a) if isinstance(a, Cell) else a
    right = _state(b)
    assert [n for n, _ in left] == [n for n, _ in right]
    for (name, x), (_, y) in zip(left, right, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            assert type(x) is type(y) and x == y, name


def _chunks(cell: Cell, chunk_bytes: int) -> int:
    total = sum(e.values for e in entries_of(live_state(cell)))
    return chunk_count(total, chunk_values_for(total, chunk_bytes))


@contextlib.contextmanager
def _transports(backend: str, names: list[str]) -> Iterator[dict[str, Transport]]:
    """A started transport per name on 127.0.0.1, closed after (hivemind: with its p2pd)."""
    out: dict[str, Transport] = {}
    with local_rendezvous(backend) as where:
        try:
            if backend == "torch":  # every peer must be starting at once: threads

                def start(name: str) -> None:
                    out[name] = make_transport(backend, name, names, {}, where, timeout_s=60.0)

                threads = [threading.Thread(target=start, args=(n,)) for n in names]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert set(out) == set(names), "a torch transport did not start"
            else:
                for name in names:
                    meeting = dataclasses.replace(where, run_id="state")
                    out[name] = make_transport(backend, name, names, {}, meeting, timeout_s=START_S)
            yield out
        finally:  # at once: a torch peer's close waits for the others' goodbyes
            closing = [threading.Thread(target=t.close) for t in out.values()]
            for t in closing:
                t.start()
            for t in closing:
                t.join()
    if backend == "hivemind":
        helpers.wait_for(lambda: not p2pd_descendants(), 30, "p2pd children to exit")


class DamagingLink:
    """A donor's transport whose chunks are damaged in flight: chunk index -> how many of its
    sends get one bit flipped after the donor hashed the chunk (the frame's crc is taken over
    the damaged bytes: only the manifest's digests can catch it). Still finite."""

    def __init__(self, t: Transport, damage: dict[int, int]) -> None:
        self.t, self.damage = t, dict(damage)

    def send(self, to, tag, kind, enc, step):
        index = tag.rsplit("/", 1)[-1]
        if kind == Kind.STATE and index.isdigit() and self.damage.get(int(index), 0) > 0:
            self.damage[int(index)] -= 1
            data = enc.data.clone()
            data.view(torch.int32)[0] ^= 1
            enc = dataclasses.replace(enc, data=data)
        return self.t.send(to, tag, kind, enc, step)

    def __getattr__(self, name: str) -> object:
        return getattr(self.t, name)


@contextlib.contextmanager
def _serving(t: Transport, cell: Cell, peers: list[str], **kw: object) -> Iterator[StateServer]:
    server = StateServer(t, cell, threading.Lock(), peers, **kw)
    try:
        yield server
    finally:
        server.close()


# ---- (b) a stage larger than one frame, over each transport --------------------------------


@pytest.fixture(scope="module")
def wide_donor() -> Cell:
    donor = _cell(WIDE, replica=0)
    _train(donor, 1, seed=1)
    return donor


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stage_larger_than_a_frame_arrives_bit_identical(backend, wide_donor, tmp_path):
    joiner = _cell(WIDE, replica=1)
    state_bytes = 4 * sum(e.values for e in entries_of(live_state(joiner)))
    assert state_bytes >= 300 << 20
    with _transports(backend, ["s1r0", "s1r1"]) as ts:
        # one frame could not carry it: a frame over the cap cuts (torch) or is refused
        assert state_bytes > ts["s1r1"].max_message_bytes
        with _serving(ts["s1r0"], wide_donor, ["s1r1"], spool_dir=str(tmp_path)) as server:
            start = time.monotonic()
            got = download_state(ts["s1r1"], joiner, ["s1r0"], TIMEOUT_S, staging_dir=str(tmp_path))
            took = time.monotonic() - start
        assert got and got.donor == "s1r0", got.reason
        assert server.chunks_served == _chunks(joiner, 32 << 20), "each chunk sent once"
    assert joiner.step == wide_donor.step == 1 and list(joiner.history) == [1]
    _assert_same_state(wide_donor, joiner)
    print(f"{backend}: {state_bytes / 2**20:.0f} MiB in {took:.1f} s")
    assert not list(tmp_path.iterdir()), "snapshot and staging files are anonymous"


# ---- (c) chunks damaged in flight --------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("extra", [[], ["optim.state_8bit=true"], ["optim.name=rotated_adam"]])
def test_a_damaged_chunk_is_fetched_again_and_the_state_is_exact(extra):
    """Chunks 1 and 3 arrive damaged (one bit, after the donor hashed them: the wire's crc is
    fine) once and twice; each is asked again, and the state is bit-identical, in every
    optimizer's own dtypes (8-bit codes, rotated bases, step counts, nadamw's float)."""
    donor, joiner = _cell(extra, replica=0), _cell(extra, replica=1)
    _train(donor, 3, seed=2)
    with _transports("torch", ["s1r0", "s1r1"]) as ts:
        damaging = DamagingLink(ts["s1r0"], {1: 1, 3: 2})
        with _serving(damaging, donor, ["s1r1"]) as srv:
            got = download_state(ts["s1r1"], joiner, "s1r0", TIMEOUT_S, chunk_bytes=SMALL_CHUNKS)
        assert got, got.reason
        assert srv.chunks_served == _chunks(joiner, SMALL_CHUNKS) + 3
    _assert_same_state(donor, joiner)
    for c in (donor, joiner):  # the joiner trains on exactly as the donor
        _train(c, 2, seed=3)
    assert torch.equal(donor.flat, joiner.flat)


@pytest.mark.integration
def test_a_chunk_damaged_every_time_is_never_adopted():
    donor, joiner = _cell([], replica=0), _cell([], replica=1)
    _train(donor, 2, seed=4)
    _train(joiner, 1, seed=5)
    before = _state(joiner)
    with _transports("torch", ["s1r0", "s1r1"]) as ts:
        with _serving(DamagingLink(ts["s1r0"], {2: 10**9}), donor, ["s1r1"]):
            got = download_state(ts["s1r1"], joiner, ["s1r0"], TIMEOUT_S, chunk_bytes=SMALL_CHUNKS)
    assert not got and got.donor is None
    assert got.reason == "state download from s1r0 failed: chunk 2 failed its digest 3 times"
    _assert_same_state(before, joiner)
    assert joiner.step == 1


# ---- (d) donors that fail -------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["torch", pytest.param("hivemind", marks=pytest.mark.slow)])
def test_a_donor_closed_mid_transfer_is_replaced_by_the_next(backend):
    """s1r0 is closed after 3 of its chunks; s1r2 (at another step, so another manifest) is
    asked next, from its first chunk, and its state is adopted."""
    first, second, joiner = (_cell([], replica=r) for r in range(3))
    _train(first, 3, seed=6)
    _train(second, 4, seed=7)
    seen: list[tuple[str, int]] = []
    with _transports(backend, ["s1r0", "s1r1", "s1r2"]) as ts:
        with (
            _serving(ts["s1r0"], first, ["s1r1"]) as closing,
            _serving(ts["s1r2"], second, ["s1r1"]),
        ):

            def progress(donor: str, staged: int, total: int) -> None:
                seen.append((donor, staged))
                if donor == "s1r0" and staged == 3:
                    closing.close()
                    ts["s1r0"].close()

            got = download_state(
                ts["s1r1"],
                joiner,
                ["s1r0", "s1r2"],
                4.0,
                chunk_bytes=SMALL_CHUNKS,
                progress=progress,
            )
    assert got and got.donor == "s1r2", got.reason
    assert seen[:3] == [("s1r0", 1), ("s1r0", 2), ("s1r0", 3)]
    assert ("s1r2", 1) in seen, "the new donor's manifest starts over"
    _assert_same_state(second, joiner)
    assert joiner.step == 4


@pytest.mark.integration
def test_chunks_of_the_same_snapshot_from_two_donors_are_combined():
    """Two donors with the same bytes at the same step (both fresh here) give manifests of the
    same identity: the second only sends the chunks the first did not."""
    first, second, joiner = (_cell([], replica=r) for r in range(3))
    _train(joiner, 1, seed=8)  # the joiner differs from both
    total = _chunks(joiner, SMALL_CHUNKS)
    with _transports("torch", ["s1r0", "s1r1", "s1r2"]) as ts:
        with (
            _serving(ts["s1r0"], first, ["s1r1"]) as closing,
            _serving(ts["s1r2"], second, ["s1r1"]) as other,
        ):

            def progress(donor: str, staged: int, total: int) -> None:
                if donor == "s1r0" and staged == 5:
                    closing.close()
                    ts["s1r0"].close()

            got = download_state(
                ts["s1r1"],
                joiner,
                ["s1r0", "s1r2"],
                4.0,
                chunk_bytes=SMALL_CHUNKS,
                progress=progress,
            )
            served = other.chunks_served
    assert got and got.donor == "s1r2", got.reason
    assert 0 < served <= total - 5, "the chunks staged from the first donor were kept"
    _assert_same_state(first, joiner)


@pytest.mark.integration
def test_a_donor_of_another_shape_is_refused_and_the_next_one_used():
    other_model = _cell(["model.d_model=32"], replica=0)
    donor, joiner = _cell([], replica=2), _cell([], replica=1)
    _train(donor, 2, seed=9)
    with _transports("torch", ["s1r0", "s1r1", "s1r2"]) as ts:
        with _serving(ts["s1r0"], other_model, ["s1r1"]), _serving(ts["s1r2"], donor, ["s1r1"]):
            got = download_state(ts["s1r1"], joiner, ["s1r0", "s1r2"], TIMEOUT_S)
    assert got and got.donor == "s1r2"
    assert got.reason.startswith("state download from s1r0 failed: its state does not fit")
    _assert_same_state(donor, joiner)
    refused = download_state(ts["s1r1"], joiner, [], TIMEOUT_S)
    assert not refused and "no donor" in refused.reason
