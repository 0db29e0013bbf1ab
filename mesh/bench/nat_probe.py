"""One process of `meshtrain bench nat`'s stream measurement (mesh/bench/nat.py), run in a
network namespace of comms.natns: a libp2p peer as the cells have one (comms.p2p.dht.start_dht
with comms.p2p.relay's options), talking through its own p2pd.

    python -m mesh.bench.nat_probe relay DIR ADDR [--default-relay]
        a public peer that relays: forced public (p2pd's relay service, its -relay* limits at
        p2pd's defaults), or with --default-relay not (go-libp2p's default relay serves)
    python -m mesh.bench.nat_probe server DIR NAME ADDR [--nat]
        echo and sink handlers; --nat: behind NAT, reserved on DIR's relay (client mode)
    python -m mesh.bench.nat_probe race DIR ADDR STARTS
        starts a forced-public p2pd (relay limits RACE_LIMITS) STARTS times without the check
        of comms/p2p/relay_service.py and asks each which limit its relay service answers;
        writes DIR/race.json
    python -m mesh.bench.nat_probe client DIR ADDR BULK_BYTES NAME... [--no-rtt]
        from behind NAT, measures each named server (RTT_MESSAGES round trips unless --no-rtt,
        then BULK_BYTES on one stream); writes DIR/client.json

Each peer writes DIR/NAME.json (its peer ID and the addresses to dial it at) once it serves,
then runs until its parent (the bench) stops it. The echo handler answers each message (a
4-byte length, then the body) with one byte, as a cell's receiver acks a message; the sink
reads an 8-byte length and that many bytes, then answers the count, and appends
{"want", "got"} to DIR/NAME.sink.jsonl (what arrived before a relay reset the connection).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RTT_MESSAGES, MESSAGE_BYTES = 200, 4096
CHUNK = 64 << 10


def _start(
    directory: Path, addr: str, nat: bool, relays: list[str] = (), default_relay: bool = False
) -> Any:
    from comms.p2p.dht import start_dht
    from comms.p2p.relay import RelayLimits, p2pd_options

    kwargs, flags = p2pd_options(nat, list(relays), None if nat else RelayLimits())
    if default_relay:  # not public: go-libp2p's default relay service alone (no check of it)
        kwargs.pop("force_reachability", None)
        kwargs.pop("relay_service", None)
    boot = [] if not relays else list(relays)
    return start_dht(
        boot, 60, host_maddrs=[f"/ip4/{addr}/tcp/0"], client_mode=nat, p2pd_flags=flags, **kwargs
    )


def _write(directory: Path, name: str, peer_id: str, maddrs: list[str]) -> None:
    tmp = directory / f"{name}.json.tmp"
    tmp.write_text(json.dumps({"peer_id": peer_id, "maddrs": maddrs}))
    tmp.rename(directory / f"{name}.json")


def _wait_json(path: Path, timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.1)
    return json.loads(path.read_text())


def _direct_maddrs(dht: Any) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


def relay(directory: Path, addr: str, default_relay: bool) -> None:
    dht = _start(directory, addr, nat=False, default_relay=default_relay)
    _write(directory, "relay", dht.peer_id.to_base58(), _direct_maddrs(dht))
    _serve_forever()


def server(directory: Path, name: str, addr: str, nat: bool) -> None:
    relays = [_wait_json(directory / "relay.json")["maddrs"][0]] if nat else []
    dht = _start(directory, addr, nat, relays)
    sinks = directory / f"{name}.sink.jsonl"

    async def echo(_info: Any, reader: Any, writer: Any) -> None:
        try:
            while True:
                n = int.from_bytes(await reader.readexactly(4), "big")
                await reader.readexactly(n)
                writer.write(b"\x01")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def sink(_info: Any, reader: Any, writer: Any) -> None:
        want, got = int.from_bytes(await reader.readexactly(8), "big"), 0
        try:
            while got < want:
                data = await reader.read(1 << 20)
                if not data:
                    break
                got += len(data)
            writer.write(got.to_bytes(8, "big"))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            with sinks.open("a") as f:
                f.write(json.dumps({"want": want, "got": got}) + "\n")
            writer.close()

    async def setup() -> Any:
        p2p = await dht.replicate_p2p()
        await p2p.add_binary_stream_handler("echo", echo)
        await p2p.add_binary_stream_handler("sink", sink)
        return p2p

    loop = asyncio.new_event_loop()
    loop.run_until_complete(setup())
    circuits = [f"{r}/p2p-circuit" for r in relays]
    _write(directory, name, dht.peer_id.to_base58(), circuits or _direct_maddrs(dht))
    loop.run_forever()


async def _measure(
    p2p: Any, target: dict[str, Any], bulk_bytes: int, rtt: bool = True
) -> dict[str, Any]:
    from hivemind.p2p import PeerID

    from comms.p2p.relay import dialable

    peer = PeerID.from_base58(target["peer_id"])
    bare = [m.rsplit(f"/p2p/{target['peer_id']}", 1)[0] for m in target["maddrs"]]
    await asyncio.wait_for(p2p._client.connect(peer, dialable(bare)), 30)
    out: dict[str, Any] = {}
    if rtt:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, "echo")
        message = MESSAGE_BYTES.to_bytes(4, "big") + b"x" * MESSAGE_BYTES
        rtts = []
        for k in range(RTT_MESSAGES + 10):
            t = time.perf_counter()
            writer.write(message)
            await writer.drain()
            await reader.readexactly(1)
            if k >= 10:  # warm-up
                rtts.append((time.perf_counter() - t) * 1e3)
        writer.close()
        out["rtt_ms_p50"] = round(statistics.median(rtts), 3)
        out["rtt_ms_p90"] = round(statistics.quantiles(rtts, n=10)[-1], 3)
    _, reader, writer = await p2p.call_binary_stream_handler(peer, "sink")
    t, sent = time.perf_counter(), 0
    try:
        writer.write(bulk_bytes.to_bytes(8, "big"))
        chunk = b"z" * CHUNK
        while sent < bulk_bytes:
            writer.write(chunk[: bulk_bytes - sent])
            await writer.drain()
            sent += min(CHUNK, bulk_bytes - sent)
        got = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), 60), "big")
        out["bulk_mbit_s"] = round(8 * got / (time.perf_counter() - t) / 1e6, 1)
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as e:
        out["bulk_error"] = f"{type(e).__name__} after {sent} bytes written"
    writer.close()
    return out


def client(directory: Path, addr: str, bulk_bytes: int, names: list[str], rtt: bool) -> None:
    relays = [_wait_json(directory / "relay.json")["maddrs"][0]]
    dht = _start(directory, addr, True, relays)

    async def run() -> dict[str, Any]:
        p2p = await dht.replicate_p2p()
        results = {}
        for name in names:
            target = _wait_json(directory / f"{name}.json")
            try:
                results[name] = await _measure(p2p, target, bulk_bytes, rtt)
            except Exception as e:  # noqa: BLE001 - recorded: the bench says what failed
                results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        return results

    results = asyncio.new_event_loop().run_until_complete(run())
    tmp = directory / "client.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    tmp.rename(directory / "client.json")  # whole, once there
    dht.shutdown()


RACE_LIMITS = (1800, 4 << 30)  # p2pd's defaults, asked for explicitly


def race(directory: Path, addr: str, starts: int) -> None:
    from hivemind.p2p import P2P

    from comms.p2p.dht import _add_p2pd_flags
    from comms.p2p.relay_service import own_limit, start_probe

    _add_p2pd_flags({"relayTimeLimit": f"{RACE_LIMITS[0]}s", "relayDataLimit": RACE_LIMITS[1]})

    async def run() -> list[Any]:
        answers, probe = [], await start_probe(P2P.create)
        try:
            for _ in range(starts):
                host = [f"/ip4/{addr}/tcp/0"]
                p2p = await P2P.create(host_maddrs=host, force_reachability="public")
                try:
                    answers.append(await own_limit(p2p, probe))
                finally:
                    await p2p.shutdown()
        finally:
            await probe.shutdown()
        return answers

    answers = asyncio.new_event_loop().run_until_complete(run())
    (directory / "race.json").write_text(json.dumps(answers))


def _serve_forever() -> None:
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    role, d = sys.argv[1], Path(sys.argv[2])
    if role == "relay":
        relay(d, sys.argv[3], "--default-relay" in sys.argv)
    elif role == "race":
        race(d, sys.argv[3], int(sys.argv[4]))
    elif role == "server":
        server(d, sys.argv[3], sys.argv[4], "--nat" in sys.argv)
    else:
        names = [a for a in sys.argv[5:] if a != "--no-rtt"]
        client(d, sys.argv[3], int(sys.argv[4]), names, "--no-rtt" not in sys.argv)
