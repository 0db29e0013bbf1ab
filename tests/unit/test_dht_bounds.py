"""comms/p2p/bounds.py's rules, on hivemind's own types: what a node of ours stores, how a reply
is trimmed, and how a read settles to records, "nothing there" or unknown (the real DHT under a
flood: tests/integration/test_outsider_flood.py)."""

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.proto import dht_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from comms.p2p.bounds import (
    RECORD_MAX_BYTES,
    RECORD_MAX_TTL_S,
    TRIMMED,
    _bounded_result,
    _store,
    _store_subkey,
    settle,
    trim,
)


def test_a_node_stores_no_oversized_plain_or_long_lived_value():
    storage, key, exp = DHTLocalStorage(), DHTID.generate(source="k"), get_dht_time() + 60
    ok = b"x" * RECORD_MAX_BYTES
    assert _store(storage, key, ok, exp, subkey="s0r0/a")
    assert not _store(storage, key, ok + b"x", exp, subkey="s0r0/b")
    assert not _store_subkey(storage, key, "s0r0/c", b"x", get_dht_time() + RECORD_MAX_TTL_S + 60)
    assert not _store(storage, DHTID.generate(source="p"), b"x", exp)  # a plain value
    assert [k for k, _ in storage.get(key).value.items()] == ["s0r0/a"]
    # a whole dictionary (a read's result, in a node's cache) is stored as it is
    assert _store(DHTLocalStorage(), key, _dictionary({"a": 10}), exp)


def _found(entries: dict) -> ValueWithExpiration:
    """A key's result as hivemind's get gives it (subkey -> ValueWithExpiration)."""
    exp = get_dht_time() + 60
    return ValueWithExpiration({k: ValueWithExpiration(v, exp) for k, v in entries.items()}, exp)


def test_a_read_is_unknown_unless_someone_answered_in_full():
    assert settle(None, answered=False) is None  # every node failed, timed out or overflowed
    assert settle(None, answered=True) == {}  # a node answered: nothing there
    found = _found({"s0r0/a": {"v": 1}, "s1r0/b": None})
    assert settle(found, answered=True) == {"s0r0/a": {"v": 1}, "s1r0/b": None}
    assert settle(_found({"s0r0/a": {"v": 1}, TRIMMED: 3}), answered=True) is None
    plain = ValueWithExpiration("a plain value over the key", get_dht_time() + 60)
    assert settle(plain, answered=True) is None  # it masks every subkey: cannot tell


def _dictionary(sizes: dict[str, int]) -> DictionaryDHTValue:
    d = DictionaryDHTValue()
    for subkey, n in sizes.items():
        d.store(subkey, b"x" * n, get_dht_time() + 60)
    return d


def test_a_trimmed_reply_keeps_the_smallest_values_and_says_how_many_it_left_out():
    d = _dictionary({"claim-a": 300, "claim-b": 400, **{f"junk{n}": 30_000 for n in range(10)}})
    kept, left_out = trim(d, 100_000)
    assert {"claim-a", "claim-b"} <= {k for k, _ in kept.items()} and left_out == 12 - len(kept)
    assert sum(len(v.value) for _, v in kept.items()) <= 100_000 and left_out == 7
    whole, none_left = trim(d, 10**6)
    assert none_left == 0 and len(whole) == 12


def test_a_reply_over_its_budget_is_trimmed_and_marked():
    d = _dictionary({"claim": 500, **{f"junk{n}": 30_000 for n in range(100)}})
    value = MSGPackSerializer.dumps(d)
    result = dht_pb2.FindResult(type=dht_pb2.FOUND_DICTIONARY, value=value, expiration_time=1.0)
    _bounded_result(result, 200_000, MSGPackSerializer)
    assert len(result.value) < 200_000 + 1000
    back = MSGPackSerializer.loads(result.value)
    assert (
        "claim" in {k for k, _ in back.items()}
        and MSGPackSerializer.loads(back.get(TRIMMED).value) > 90
    )
    plain = dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR, value=b"x" * 300_000)
    _bounded_result(plain, 200_000, MSGPackSerializer)  # no record of ours: only the marker
    back = MSGPackSerializer.loads(plain.value)
    assert plain.type == dht_pb2.FOUND_DICTIONARY and [k for k, _ in back.items()] == [TRIMMED]
