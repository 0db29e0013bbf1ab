"""The store keys of the torch transport's pairs (comms/torchdist/pairs.py): the same from
both sides, and never shared by two pairs, whatever the names and incarnations."""

from __future__ import annotations

import itertools

from comms.torchdist.pairs import pair_key


def test_a_pair_key_is_the_same_from_both_sides():
    assert pair_key("s0r1", 3, "s1r1", 1) == pair_key("s1r1", 1, "s0r1", 3)


def test_no_two_pairs_share_a_key():
    names = ["a", "b", "a.1", "1", "a/b", "b.1/2:", "s0r1", "s1r1"]
    seen: dict[str, tuple] = {}
    for (x, y), ix, iy in itertools.product(itertools.combinations(names, 2), (1, 2, 12), (1, 21)):
        key = pair_key(x, ix, y, iy)
        pair = frozenset([(x, ix), (y, iy)])
        assert seen.setdefault(key, pair) == pair, (key, seen[key], pair)
    # a new incarnation on either side is a new pair
    assert pair_key("a", 1, "b", 1) != pair_key("a", 2, "b", 1) != pair_key("a", 1, "b", 2)
