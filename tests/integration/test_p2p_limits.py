"""What outsiders can cost a hivemind peer, and the run's records through a real DHT, with real
P2PTransports on 127.0.0.1: half-open streams are dropped after stream_idle_s, unproven streams
past the cap are refused, a round's sends to an unreachable member stay bounded, and a forged
config record is refused by a joiner's reader in one line.

Each test closes the transports it started (their DHT processes reap their p2pd).
"""

from __future__ import annotations

import os
import time

import hivemind
import pytest
import torch
from helpers import wait_for

from comms import codecs
from comms.group_means import LINGER_ROUNDS
from comms.p2p.auth import Auth
from comms.p2p.dht import DhtClient
from comms.p2p.stream import STREAM_HEAD, STREAM_MAGIC, STREAM_VERSION
from comms.p2p.transport import LOOPBACK, P2PTransport
from comms.wire import Expect, Kind

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture
def boot():
    node = hivemind.DHT(start=True, host_maddrs=[LOOPBACK])
    try:
        yield [str(m) for m in node.get_visible_maddrs()]
    finally:
        node.shutdown()
        node.join(10)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_half_open_streams_are_dropped_and_the_excess_refused(boot):
    """An outsider (here a peer of another run: its streams never prove a member) opens raw
    streams to a member and sends nothing, or a header and no name: the first
    max_unproven_streams are held until stream_idle_s, the rest are closed at once; all are
    counted, their fds come back, and a member's message still goes through after."""
    victim = P2PTransport(
        "s0r0",
        run_id="lim",
        initial_peers=boot,
        peers=["s1r0"],
        stream_idle_s=1.0,
        max_unproven_streams=8,
    )
    member = P2PTransport("s1r0", run_id="lim", initial_peers=boot, peers=["s0r0"])
    try:
        target = victim.dht.peer_id
        handler = victim._handler_name
        base_fds = _fds()

        async def open_streams(n: int, header_only: int):
            streams = []
            for k in range(n):
                _, reader, writer = await member._p2p.call_binary_stream_handler(target, handler)
                if k < header_only:  # a header announcing a 40-byte name that never comes
                    writer.write(STREAM_HEAD.pack(STREAM_MAGIC, STREAM_VERSION, 40, 100))
                    await writer.drain()
                streams.append((reader, writer))
            return streams

        async def all_closed(streams) -> bool:
            for reader, _ in streams:
                if await reader.read(1) != b"":
                    return False
            return True

        t0 = time.monotonic()
        streams = member._run(open_streams(20, header_only=2), 60)
        wait_for(lambda: victim.stats.rejects["stream_cap"] == 12, 30, "the excess refused")
        assert victim.unproven_streams() <= 8
        assert member._run(all_closed(streams), 30)  # the victim closed every one
        assert time.monotonic() - t0 < 20
        wait_for(lambda: victim.stats.rejects["stream_timeout"] == 8, 10, "timeouts counted")
        assert victim.unproven_streams() == 0

        async def close_all() -> None:
            for _, writer in streams:
                writer.close()

        member._run(close_all(), 10)
        # (the count while held is not asserted: the DHT's own connections come and go beside it)
        wait_for(lambda: _fds() <= base_fds + 4, 10, "the streams' fds given back")
        # members are unaffected: a message goes through, on a stream proven at once
        enc = codecs.encode(torch.ones(4), "fp32")
        member.send("s0r0", "ok", Kind.ACTIVATION, enc, 0).wait(30)
        got = victim.recv("s1r0", "ok", Expect(kind=Kind.ACTIVATION, shape=(4,)), 30)
        assert torch.equal(got.tensor(), torch.ones(4)) and victim.unproven_streams() == 0
    finally:
        victim.close()
        member.close()


def test_a_rounds_sends_to_an_unreachable_member_stay_bounded(boot):
    """Rounds with a member that is never found end at their deadline; our sends to it would
    wait for the transport's timeout each: only LINGER_ROUNDS rounds' worth are kept."""
    a = P2PTransport("s0r0", run_id="linger", initial_peers=boot, timeout_s=60.0)
    try:
        handles = [
            a.start_mean("g", ["s0r0", "s0r9"], rid, torch.ones(8), "fp32", 0.2)
            for rid in range(3 * LINGER_ROUNDS)
        ]
        assert all(h.result(30).status.name == "FAILED" for h in handles)
        wait_for(lambda: len(a._inflight) <= LINGER_ROUNDS, 10, "old rounds' sends cancelled")
        assert a.means.lingering_sends() <= LINGER_ROUNDS
    finally:
        a.close()


class _OtherOwner(DhtClient):
    """A DHT client with its own RSA key, as another process has (the key is process-wide)."""

    def __init__(self, *args, **kwargs) -> None:
        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.utils.crypto import RSAPrivateKey

        validator = RSASignatureValidator(RSAPrivateKey())
        self._marker = validator.local_public_key.decode()
        super().__init__(*args, record_validators=[validator], **kwargs)

    @property
    def owner_marker(self) -> str:
        return self._marker


def test_a_forged_config_record_is_refused_by_a_joiners_reader(boot):
    """Through a real DHT (MSGPack both ways): the run's sealed record reads back as signed
    by its key. An outsider cannot store into the owner's slot, and its own records beside it
    (unsigned, or sealed with a guessed key) neither push the real one out nor are followed:
    a joiner with the key picks the real one, one alone is refused in one line, and a keyless
    joiner is told the run needs a key."""
    from cli.join import JoinError, config_of_record, read_run_record
    from mesh.config import load_config
    from mesh.runtime.registry import CONFIG_KEY, CONFIG_SLOT, Registry, RunRecord

    cfg = load_config([], ["grid.stages=2", "grid.replicas=1", "model.n_layers=2"])
    auth = Auth.of("the key", cfg.fingerprint())
    record = RunRecord(cfg.fingerprint(), cfg.to_toml(), auth.key_check, {"digest": "x"})
    owner = DhtClient(boot, "forge", 30.0)
    forger = _OtherOwner(boot, "forge", 30.0)
    reader = DhtClient(boot, "forge", 30.0)
    try:
        assert Registry(owner, auth, 1.0).put_run(record)
        rec = read_run_record(Registry(reader, None, 1.0), 5, "the key")
        assert rec is not None and rec.signed_by("the key")
        assert config_of_record(rec, None, [], "the key").fingerprint() == cfg.fingerprint()
        with pytest.raises(JoinError, match="this run needs a key"):
            config_of_record(rec, None, [], None)
        owners_slot = f"{CONFIG_SLOT}{owner.owner_marker}"
        assert not forger.dht_store(CONFIG_KEY, owners_slot, {"v": 1}, 60.0)
        for forger_auth in (None, Auth.of("guess", cfg.fingerprint())):
            assert Registry(forger, forger_auth, 1.0).put_run(record)  # the forger's own slot

            def seen(r, unsigned=forger_auth is None):  # this round's forged record
                return r.subkey != owners_slot and (
                    "sig" not in r.raw if unsigned else r.signed_by("guess")
                )

            wait_for(
                lambda f=seen: any(f(r) for r in Registry(reader, None, 1.0).runs()),
                30,
                "the forged record in the DHT",
            )
            runs = Registry(reader, None, 1.0).runs()
            assert [r.subkey for r in runs if r.signed_by("the key")] == [owners_slot]
            assert read_run_record(Registry(reader, None, 1.0), 5, "the key").subkey == owners_slot
            forged = next(r for r in runs if r.subkey != owners_slot)
            with pytest.raises(JoinError) as e:
                config_of_record(forged, None, [], "the key")
            assert "not signed by the run key" in str(e.value) and "\n" not in str(e.value)
            with pytest.raises(JoinError, match="this run needs a key"):
                config_of_record(Registry(reader, None, 1.0).run(None), None, [], None)
    finally:
        owner.close()
        forger.close()
        reader.close()


def test_a_withdrawn_claim_reads_back_as_released_through_a_real_dht(boot):
    """release() stores None over a claim (MSGPack through a real DHT): status reads the cell
    free and released, by the claim's signer, while the withdrawal lives; plain reads (every
    peer's claim logic) never see it."""
    from cli.status import status_rows
    from mesh.config import load_config
    from mesh.runtime.registry import CellRecord, Registry, claims_key

    cfg = load_config([], ["grid.stages=2", "grid.replicas=1", "model.n_layers=2"])
    owner = DhtClient(boot, "withdraw", 30.0)
    reader = DhtClient(boot, "withdraw", 30.0)
    try:
        claimant = Registry(owner, None, 1.0)
        for j in range(2):
            assert claimant.beat(
                CellRecord(f"s{j}r0", "QmPeer", 1, 1.0, 0, 3, 5.0, time.time(), None)
            )
        reg = Registry(reader, None, 1.0)
        wait_for(lambda: status_rows(reg, cfg)["free"] == [], 30, "both claims in the DHT")
        assert claimant.release("s1r0", "QmPeer")
        wait_for(lambda: status_rows(reg, cfg)["free"] == ["s1r0"], 30, "the release")
        rows = status_rows(reg, cfg)
        assert rows["released"] == {"s1r0": [owner.owner_marker]}
        assert [c["signer"] for c in rows["cells"]] == [owner.owner_marker]
        assert rows["rejected_claims"] == 0  # a withdrawal is not a bad claim
        plain = reader.dht_get(claims_key(0))
        assert plain is not None and all(v is not None for v in plain.values())
    finally:
        owner.close()
        reader.close()
