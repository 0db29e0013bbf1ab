"""What junk in the DHT can do to our nodes, bounded; and reads that say when they do not know.

Role: any peer can store under any DHT key, and hivemind answers a get with every subkey of a
key in one reply. A flood (hundreds of 100 KB subkeys under a run's claims) made every reply
for that key larger than p2pd's 4 MiB message limit: the replying node sent an error, the
reader took it for a dead node (out of its routing table, blacklisted), and hivemind's get,
having heard nothing, returned what it returns for a key nobody holds. A reader took that for
"no claims": every partner free, every session broken. Three defences, in every DHT process of
ours (comms.p2p.dht.PeerDHT and start_dht install them):

- `bound_storage` (`storable`): a node stores no value over RECORD_MAX_BYTES (ours are a few
  KB), no value without a subkey (ours all have one; a plain value with a far expiration would
  block every subkey store under its key) and nothing that outlives RECORD_MAX_TTL_S, whether
  another node asks it to or it is one of the nearest to a key it stores itself. Checked in
  its storage, not in a record validator: hivemind also validates every record of a reply and
  drops the whole key when one fails, so a node that stored junk (one not of ours, e.g. a
  plain hivemind bootstrap) would make the key read as empty.
- `bound_storage` (`trim`): a reply never outgrows p2pd's limit. A key whose subkeys exceed its
  share of REPLY_BUDGET_BYTES is answered with its smallest subkeys and a TRIMMED marker.
- `read_records`, the get every run-record read goes through (run in the DHT process): per
  key, the records, or None when nobody answered (every node asked failed, timed out or
  overflowed, and this node holds nothing), when a reply was trimmed, or when the key holds a
  plain value. Unknown is never "nobody": a caller keeps what it knew (mesh/runtime/session.py).

Not defended: a node of an outsider's among the nearest to a key can answer what it likes for
that key (hivemind's DHT has no proof that a reply is complete). Readers merge every node's
answer: it can add junk (the records' seals drop it) or make the key's reads unknown (a plain
value masks its subkeys), not make records others hold read as gone.

imports: hivemind, stdlib (no torch, no mesh, no cli).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2
from hivemind.utils.timed_storage import get_dht_time

RECORD_MAX_BYTES = 32 * 1024  # a value a node of ours stores (a run's config record: <15 KB)
RECORD_MAX_TTL_S = 24 * 3600.0  # how far ahead a stored value may expire (ours: 10 min)
REPLY_BUDGET_BYTES = 2 * 1024**2  # values in one find reply (p2pd's limit: 4 MiB a message)
TRIMMED = "~trimmed"  # the subkey that marks a trimmed reply (value: how many were left out)
TRIMMED_TTL_S = 5.0  # how long the marker stands in a reader's cache


def storable(value: bytes, expiration: float) -> bool:
    """Whether a node of ours stores a subkey's value (see the module docstring)."""
    return len(value) <= RECORD_MAX_BYTES and expiration <= get_dht_time() + RECORD_MAX_TTL_S


_plain_store, _plain_store_subkey = DHTLocalStorage.store, DHTLocalStorage.store_subkey


def _store(
    self: DHTLocalStorage, key: DHTID, value: Any, expiration_time: float, subkey: Any = None
) -> bool:
    if subkey is not None:
        return _store_subkey(self, key, subkey, value, expiration_time)
    if not isinstance(value, DictionaryDHTValue):
        return False  # a plain value (a whole dictionary is a read's result, cached)
    return _plain_store(self, key, value, expiration_time)


def _store_subkey(
    self: DHTLocalStorage, key: DHTID, subkey: Any, value: bytes, expiration_time: float
) -> bool:
    if not storable(value, expiration_time):
        return False
    return _plain_store_subkey(self, key, subkey, value, expiration_time)


def trim(dictionary: DictionaryDHTValue, budget: int) -> tuple[DictionaryDHTValue, int]:
    """The subkeys of a dictionary value that fit `budget` bytes, smallest first (a flood's
    values are the large ones), and how many were left out (0: it fitted as it was)."""
    items = sorted(dictionary.items(), key=lambda kv: len(kv[1].value))
    kept, used = DictionaryDHTValue(), 0
    for n, (subkey, (value, expiration)) in enumerate(items):
        cost = len(value) + len(str(subkey)) + 16
        if used + cost > budget:
            return kept, len(items) - n
        kept.store(subkey, value, expiration)
        used += cost
    return kept, 0


def _bounded_result(result: Any, budget: int, serializer: Any) -> None:
    """Trim one key's result of a find reply in place to `budget` bytes, with the marker."""
    if result.type == dht_pb2.FOUND_DICTIONARY:
        kept, left_out = trim(serializer.loads(result.value), budget)
    else:  # a plain value: no record of ours (bound_storage refuses it)
        kept, left_out = DictionaryDHTValue(), 1
    kept.store(TRIMMED, serializer.dumps(left_out), get_dht_time() + TRIMMED_TTL_S)
    result.type, result.value = dht_pb2.FOUND_DICTIONARY, serializer.dumps(kept)


_plain_rpc_find = DHTProtocol.rpc_find


async def _rpc_find_bounded(
    self: DHTProtocol, request: dht_pb2.FindRequest, context: P2PContext
) -> dht_pb2.FindResponse:
    response = await _plain_rpc_find(self, request, context)
    budget = REPLY_BUDGET_BYTES // max(1, len(response.results))
    for result in response.results:
        if result.type != dht_pb2.NOT_FOUND and len(result.value) > budget:
            _bounded_result(result, budget, self.serializer)
    return response


def bound_storage() -> None:
    """In a DHT process, before its node starts (the node registers its handlers then): what
    it stores and every find reply it sends are bounded (see the module docstring)."""
    DHTLocalStorage.store, DHTLocalStorage.store_subkey = _store, _store_subkey
    DHTProtocol.rpc_find = _rpc_find_bounded


class Answers:
    """Which keys some node answered for (a find reply that came back, found or not), counted
    only for the keys a read_records call is waiting on. One per DHT node."""

    def __init__(self, protocol: DHTProtocol) -> None:
        self.waiting: Counter[DHTID] = Counter()
        self.heard: dict[DHTID, int] = {}  # key -> number of the last reply that answered it
        self.replies = 0
        plain_call_find = protocol.call_find

        async def call_find(peer: Any, keys: Sequence[DHTID]) -> Any:
            response = await plain_call_find(peer, keys)
            if response:  # None: no reply (failed, timed out, refused as too large)
                self.replies += 1
                for key in keys:
                    if key in self.waiting:
                        self.heard[key] = self.replies
            return response

        protocol.call_find = call_find

    @classmethod
    def of(cls, node: DHTNode) -> Answers:
        found = getattr(node, "meshtrain_answers", None)
        if found is None:
            found = node.meshtrain_answers = cls(node.protocol)
        return found


def settle(found: Any, answered: bool) -> dict[str, Any] | None:
    """One key's read: subkey -> value (None: withdrawn), or None when unknown (see the module
    docstring). `found`: hivemind's result for the key (None: nothing found); `answered`: some
    node replied for it during the read."""
    if found is None:
        return {} if answered else None
    if not isinstance(found.value, dict):  # a plain value masks every subkey: unknown
        return None
    records = {str(k): v.value for k, v in found.value.items() if hasattr(v, "value")}
    return None if TRIMMED in records else records


async def read_records(
    keys: Sequence[str], _dht: Any, node: DHTNode
) -> list[dict[str, Any] | None]:
    """In the DHT process (DHT.run_coroutine): the latest records of each key, each settled."""
    answers = Answers.of(node)
    ids = [DHTID.generate(source=k) for k in keys]
    answers.waiting.update(ids)
    start = answers.replies
    try:
        found = await node.get_many(list(keys), sufficient_expiration_time=float("inf"))
        out = []
        for key, key_id in zip(keys, ids):
            held = node.protocol.storage.get(key_id) is not None
            answered = held or answers.heard.get(key_id, -1) > start
            out.append(settle(found.get(key), answered))
        return out
    except Exception:  # noqa: BLE001 - a failed read is unknown, never an exception there
        return [None] * len(keys)
    finally:
        answers.waiting.subtract(ids)
        for key_id in ids:
            if answers.waiting[key_id] <= 0:
                del answers.waiting[key_id]
                with contextlib.suppress(KeyError):
                    del answers.heard[key_id]
