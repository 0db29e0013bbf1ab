"""Dial-back: can other peers open a connection to me? Asked of a peer that already serves the DHT.

Role: before `meshtrain join` claims a cell, its scout asks a helper (the bootstrap node, then
other DHT peers) to dial it back at its announced addresses. The helper starts a fresh probe
p2pd of its own (no connection to the asker, empty peerstore, not listening), connects to the
asker's PeerID at those addresses, and answers whether the connection came up. libp2p's
handshake authenticates the PeerID, so "ok" means the asker itself answered there.

Bounds, so that a helper cannot be made into a dialer of other machines or a fork bomb: only
the asker's own PeerID is dialed, only at addresses on the host it connected from
(comms.addrs.dial_plan, at most MAX_DIALS), at most PROBES probes run at once (a request that
waits more than BUSY_S, or finds MAX_WAITING others waiting, is answered "busy"), one request
per peer per MIN_INTERVAL_S, requests of at most MAX_REQUEST_BYTES, every step under a timeout.
A probe p2pd is reaped when its check ends (one whose helper process is killed exits within
seconds by itself).

Wire: one stream of protocol PROTOCOL per question; each side sends one frame, a 4-byte
big-endian length then UTF-8 JSON. Request {"v": 1, "maddrs": [str]}; answer {"v": 1,
"observed": str | null, "ok": bool, "via": str | null, "why": str, "skipped": [[maddr, why]]}.
Nothing is unpickled; both sides check types and sizes before use.

Both functions run in a DHT process (hivemind.DHT.run_coroutine): `serve` registers the handler
on its p2pd, `ask` questions helpers through it.

imports: hivemind, comms.addrs, stdlib (no torch, no mesh, no cli).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from comms.addrs import MAX_DIALS, dial_plan, observed_host

PROTOCOL = "meshtrain::dial_back"
MAX_REQUEST_BYTES = 4096
MAX_ANSWER_BYTES = 16384
READ_S = 5.0  # reading a frame
DIAL_S = 6.0  # the probe's connect (a firewall that drops SYNs makes it wait this long)
PROBE_START_S = 15.0  # starting the probe p2pd (seconds on a busy machine)
BUSY_S = 10.0  # how long a request waits for a probe slot before it is answered "busy"
PROBES = 2
MAX_WAITING = 8
MIN_INTERVAL_S = 3.0
ASK_S = READ_S + BUSY_S + PROBE_START_S + DIAL_S + 5.0  # an asker's wait for one answer


async def _read_frame(reader: asyncio.StreamReader, limit: int, first_s: float = READ_S) -> Any:
    """One frame; first_s: how long its first bytes may take (an answer waits for a probe)."""
    size = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), first_s), "big")
    if size > limit:
        raise ValueError(f"frame of {size} bytes (at most {limit})")
    return json.loads((await asyncio.wait_for(reader.readexactly(size), READ_S)).decode())


async def _write_frame(writer: asyncio.StreamWriter, value: Any) -> None:
    body = json.dumps(value).encode()
    writer.write(len(body).to_bytes(4, "big") + body)
    await asyncio.wait_for(writer.drain(), READ_S)


class DialBackService:
    """The helper side (see the module docstring); one per DHT process."""

    def __init__(self) -> None:
        self._slots = asyncio.Semaphore(PROBES)
        self._waiting = 0  # requests waiting for a slot: beyond MAX_WAITING, answered "busy"
        self._last: dict[PeerID, float] = {}  # when each peer last asked

    async def _on_stream(self, info: Any, reader: asyncio.StreamReader, writer: Any) -> None:
        try:
            with contextlib.suppress(Exception):  # a broken asker gets no answer, nothing else
                answer = await self._answer(info, reader)
                await _write_frame(writer, answer)
        finally:
            writer.close()

    async def _answer(self, info: Any, reader: asyncio.StreamReader) -> dict[str, Any]:
        request = await _read_frame(reader, MAX_REQUEST_BYTES)
        maddrs = request.get("maddrs") if isinstance(request, dict) else None
        if not isinstance(maddrs, list) or not all(isinstance(m, str) for m in maddrs):
            return _refusal(None, "malformed request")
        observed = observed_host(str(info.addr))
        now = time.monotonic()
        self._last = {p: t for p, t in self._last.items() if now - t < MIN_INTERVAL_S}
        if info.peer_id in self._last:
            return _refusal(observed, f"asked again within {MIN_INTERVAL_S:.0f} s")
        self._last[info.peer_id] = now
        dial, skipped = dial_plan(maddrs[: 4 * MAX_DIALS], observed)
        answer = {"v": 1, "observed": observed, "ok": False, "via": None, "skipped": skipped}
        if not dial:
            return {**answer, "why": "no address to dial"}
        if self._waiting >= MAX_WAITING:
            return _refusal(observed, "busy")
        self._waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), BUSY_S)
        except TimeoutError:
            return _refusal(observed, "busy")
        finally:
            self._waiting -= 1
        try:
            ok, via, why = await _probe(info.peer_id, dial)
        except Exception as e:  # noqa: BLE001 - our own probe did not start: we cannot tell
            return _refusal(observed, f"could not start a probe ({str(e)[:200]})")
        finally:
            self._slots.release()
        return {**answer, "ok": ok, "via": via, "why": why}


def _refusal(observed: str | None, why: str) -> dict[str, Any]:
    return {"v": 1, "observed": observed, "ok": False, "via": None, "why": why, "refused": True}


async def _probe(peer_id: PeerID, dial: list[str]) -> tuple[bool, str | None, str]:
    """Connect a fresh, non-listening p2pd to peer_id at `dial`: (ok, address used, why not)."""
    probe = await P2P.create(
        no_listen=True,
        auto_nat=False,
        nat_port_map=False,
        use_relay=False,
        dht_mode="client",
        startup_timeout=PROBE_START_S,
    )
    try:
        try:
            addrs = [Multiaddr(m) for m in dial]
            await asyncio.wait_for(probe._client.connect(peer_id, addrs), DIAL_S)
        except TimeoutError:
            return False, None, f"no answer within {DIAL_S:.0f} s"
        except Exception as e:  # noqa: BLE001 - p2pd's reason (refused, wrong peer, ...)
            return False, None, str(e).strip()[:300] or type(e).__name__
        peers = await asyncio.wait_for(probe.list_peers(), READ_S)
        via = next((str(a) for p in peers if p.peer_id == peer_id for a in p.addrs), dial[0])
        return True, via, ""
    finally:
        await probe.shutdown()


async def serve(_dht: Any, node: Any) -> None:
    """Run in a DHT process: answer dial-back requests on its p2pd from now on."""
    if getattr(node, "dial_back", None) is None:
        node.dial_back = DialBackService()
        await node.p2p.add_binary_stream_handler(PROTOCOL, node.dial_back._on_stream)


async def ask(
    helpers: list[str],
    max_answers: int,
    within_s: float,
    own_maddrs: list[str] | None,
    _dht: Any,
    node: Any,
) -> dict[str, Any]:
    """Run in the asker's DHT process: ask `helpers` (base58 PeerIDs), then the other peers of
    its routing table, to dial it back at `own_maddrs` (default: the addresses its p2pd
    announces), until one answers ok, `max_answers` have tried (a refusal, e.g. busy, does not
    count) or `within_s` passed
    (no helper is asked after that; the one being asked may take ASK_S more). Returns
    {"maddrs": what was asked, "answers": [{"helper": base58, **answer}], "silent": [base58
    that did not answer, or do not serve dial-backs]}."""
    if own_maddrs is None:
        own = f"/p2p/{node.p2p.peer_id.to_base58()}"
        visible = await node.p2p.get_visible_maddrs(latest=True)
        own_maddrs = [str(m).replace(own, "") for m in visible]
    order = list(helpers)
    for peer_id in list(node.protocol.routing_table.peer_id_to_uid):
        if peer_id.to_base58() not in order and peer_id != node.p2p.peer_id:
            order.append(peer_id.to_base58())
    answers: list[dict[str, Any]] = []
    silent: list[str] = []
    deadline = time.monotonic() + within_s
    for helper in order[: max_answers + 4]:
        if time.monotonic() > deadline:
            break
        answer = await _ask_one(node.p2p, helper, own_maddrs)
        if answer is None:
            silent.append(helper)
            continue
        answers.append({"helper": helper, **answer})
        if answer["ok"] or sum(not a["refused"] for a in answers) >= max_answers:
            break
    return {"maddrs": own_maddrs, "answers": answers, "silent": silent}


async def _ask_one(p2p: P2P, helper: str, maddrs: list[str]) -> dict[str, Any] | None:
    """One helper's checked answer; None when it does not answer or does not serve this."""
    writer = None
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(helper), PROTOCOL), READ_S
        )
        await _write_frame(writer, {"v": 1, "maddrs": maddrs})
        answer = await _read_frame(reader, MAX_ANSWER_BYTES, ASK_S)
    except Exception:  # noqa: BLE001 - unreachable, no such protocol, closed, malformed
        return None
    finally:
        if writer is not None:
            writer.close()
    return checked_answer(answer)


def checked_answer(answer: object) -> dict[str, Any] | None:
    """A helper's answer with every field type-checked (None if any is wrong)."""
    if not isinstance(answer, dict) or answer.get("v") != 1:
        return None
    ok, via, why = answer.get("ok"), answer.get("via"), answer.get("why")
    obs = answer.get("observed")
    skipped = answer.get("skipped", [])
    if not isinstance(ok, bool) or not isinstance(why, str):
        return None
    if not all(v is None or isinstance(v, str) for v in (via, obs)):
        return None
    if not isinstance(skipped, list) or not all(
        isinstance(s, list) and len(s) == 2 and all(isinstance(x, str) for x in s) for s in skipped
    ):
        return None
    refused = answer.get("refused") is True
    return {
        "ok": ok,
        "via": via,
        "why": why[:300],
        "observed": obs,
        "skipped": skipped[:16],
        "refused": refused,
    }
