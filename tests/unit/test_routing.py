"""Stage pools' pure rules (mesh/algo/routing.py): the choice by load, the capacity bounds, the
thinnest stage, rebalancing, the seeded paths and the death schedule."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from mesh.algo import routing
from mesh.runtime.pool_wire import parse_tag


def test_weights_are_rate_over_queue_plus_one_and_an_unmeasured_cell_gets_the_mean() -> None:
    assert routing.weights([2.0, 1.0], [0, 1]) == [2.0, 0.5]
    assert routing.weights([2.0, None, 4.0], [0, 0, 3]) == [2.0, 3.0, 1.0]
    assert routing.weights([None, None], [0, 0]) == [1.0, 1.0]
    with pytest.raises(ValueError):
        routing.weights([1.0], [0, 0])


def test_pick_draws_in_proportion_to_the_weights() -> None:
    rng = random.Random(0)
    counts = Counter(routing.pick([1.0, 3.0, 0.0], rng.random()) for _ in range(20000))
    assert counts[2] == 0  # a zero weight is never drawn
    assert counts[1] / 20000 == pytest.approx(0.75, abs=0.02)
    assert routing.pick([1.0, 1.0], 0.0) == 0
    assert routing.pick([1.0, 1.0], 0.999999) == 1
    with pytest.raises(ValueError):
        routing.pick([], 0.5)
    with pytest.raises(ValueError):
        routing.pick([0.0, 0.0], 0.5)


def test_the_load_book_sends_more_to_the_fast_and_idle_cell() -> None:
    book = routing.LoadBook()
    book.report("fast", 4.0, 0)
    book.report("slow", 1.0, 0)
    rng = random.Random(1)
    counts = Counter(book.choose(["fast", "slow"], rng.random()) for _ in range(4000))
    assert counts["fast"] / 4000 == pytest.approx(0.8, abs=0.03)
    for _ in range(7):  # the fast cell now holds 7 of ours: 4/8 against 1/1
        book.sent("fast")
    assert book.queue("fast") == 7
    counts = Counter(book.choose(["fast", "slow"], rng.random()) for _ in range(4000))
    assert counts["slow"] > counts["fast"]
    book.back("fast")
    assert book.queue("fast") == 6


def test_a_cell_known_to_be_full_is_not_drawn_while_another_has_room() -> None:
    book = routing.LoadBook()
    book.report("a", 100.0, 3)  # fast, but holding 3 of others' already
    book.sent("a")  # and one of ours: 4 = the window
    rng = random.Random(3)
    assert {book.choose(["a", "b"], rng.random(), window=4) for _ in range(100)} == {"b"}
    for _ in range(4):
        book.sent("b")
    # both full as far as it knows: it draws among all (the refusal then says for sure)
    assert {book.choose(["a", "b"], rng.random(), window=4) for _ in range(200)} == {"a", "b"}


def test_a_full_cell_is_left_out_and_the_sender_picks_another() -> None:
    book = routing.LoadBook()
    live = ["s1r0", "s1r1", "s1r2"]
    refused = {"s1r1"}
    rng = random.Random(2)
    picks = {book.choose([c for c in live if c not in refused], rng.random()) for _ in range(200)}
    assert picks == {"s1r0", "s1r2"}


def test_the_bounds_of_fixed_wiring_and_pools() -> None:
    speeds = [[1.0, 1.0], [1.0, 0.5], [0.25, 1.0]]  # stage x replica
    assert routing.fixed_bound(speeds) == 0.25 + 0.5
    assert routing.pool_bound(speeds) == 1.25
    dead = [[1.0, 1.0], [0.0, 1.0]]
    assert routing.fixed_bound(dead) == 1.0
    assert routing.pool_bound(dead) == 1.0


def test_a_joiner_takes_the_thinnest_stage_with_a_free_cell() -> None:
    assert routing.thinnest_stage([3.0, 1.0, 2.0], [1, 1, 1]) == 1
    assert routing.thinnest_stage([3.0, 1.0, 2.0], [1, 0, 1]) == 2
    assert routing.thinnest_stage([1.0, 1.0], [1, 1]) == 0  # ties: the lowest stage
    assert routing.thinnest_stage([1.0, 1.0], [0, 0]) is None


def test_rebalancing_moves_a_cell_only_after_the_stage_held_twice_the_capacity_for_a_while() -> (
    None
):
    watch = routing.Rebalancer(ratio=2.0, after_s=10.0)
    caps = [4.0, 1.0, 2.0]
    assert watch.check(0.0, caps, my_stage=0, my_rate=1.0) is None
    assert watch.check(5.0, caps, my_stage=0, my_rate=1.0) is None
    assert watch.check(6.0, caps, my_stage=2, my_rate=1.0) is None  # at 2x too, but since 6 s
    assert watch.check(10.0, caps, my_stage=0, my_rate=1.0) == (0, 1)
    # a break resets the clock
    watch = routing.Rebalancer(ratio=2.0, after_s=10.0)
    watch.check(0.0, caps, my_stage=0)
    watch.check(5.0, [1.5, 1.0, 2.0], my_stage=0)
    assert watch.check(12.0, caps, my_stage=0, my_rate=1.0) is None
    assert watch.check(22.0, caps, my_stage=0, my_rate=1.0) == (0, 1)


def test_a_move_that_would_only_swap_the_bottleneck_is_not_made() -> None:
    watch = routing.Rebalancer(ratio=2.0, after_s=0.0)
    assert watch.check(0.0, [2.0, 1.0], my_stage=0, my_rate=1.0) is None  # 1:2 after: no gain
    assert watch.check(1.0, [3.0, 1.0], my_stage=0, my_rate=1.0) == (0, 1)  # 2:2 after


def test_a_move_pays_when_the_bottleneck_rises_and_no_move_back_would() -> None:
    # 3:1 of about equal cells: 2:2 after, whichever way the measured rates jitter
    assert routing.move_pays(2.0, 1.3, 1.0, 2.0) and routing.move_pays(2.0, 0.9, 1.1, 2.0)
    assert not routing.move_pays(1.0, 1.0, 1.0, 2.0)  # 2:1 -> 1:2: only swapped
    # a fast cell that would make the thin stage the fat one (1.5 : 5.5): it would move back
    assert not routing.move_pays(1.5, 1.0, 4.5, 2.0)
    assert not routing.move_pays(4.0, 1.0, 0.0, 2.0)  # an unmeasured cell (rate 0) adds nothing


def test_the_mover_is_the_highest_replica_and_a_lone_cell_stays() -> None:
    assert routing.mover({"s0r0": 1.0, "s0r2": 1.0, "s0r1": 3.0}) == "s0r2"
    assert routing.mover({"s0r0": 1.0}) is None


def test_seeded_paths_start_at_the_stream_and_agree_everywhere() -> None:
    pools = [["s0r0", "s0r1"], ["s1r0", "s1r1"], ["s2r0", "s2r1"]]
    paths = [routing.seeded_path(7, s, b, pools) for s in range(2) for b in range(200)]
    assert all(p[0] == f"s0r{i // 200}" for i, p in enumerate(paths))
    assert paths == [routing.seeded_path(7, s, b, pools) for s in range(2) for b in range(200)]
    crossing = sum(p[1][-1] != p[0][-1] for p in paths) / len(paths)
    assert 0.35 < crossing < 0.65  # uniform over the pool: about half leave their replica
    assert paths != [routing.seeded_path(8, s, b, pools) for s in range(2) for b in range(200)]


def test_the_death_schedule_parses_and_names_the_key() -> None:
    spans = routing.parse_deaths(["s2r1@100-300", "s0r0@50"], 4, 2)
    assert spans == {(2, 1): [(100, 300)], (0, 0): [(50, None)]}
    assert routing.dead_at(spans, (2, 1), 100) and not routing.dead_at(spans, (2, 1), 300)
    assert routing.dead_at(spans, (0, 0), 10**6) and not routing.dead_at(spans, (0, 0), 49)
    for bad in ("s2r1", "s9r0@1", "s1r1@5-5", "x@1"):
        with pytest.raises(ValueError, match="emulation.deaths"):
            routing.parse_deaths([bad], 4, 2)


def test_pool_tags_are_parsed_and_bounded() -> None:
    assert parse_tag("pool/a/1/42") == ("a", 1, 42, 0, 0.0, 0)
    assert parse_tag("pool/g/0/7/3/2500") == ("g", 0, 7, 3, 2.5, 0)  # no window said
    assert parse_tag("pool/g/0/7/3/2500/6") == ("g", 0, 7, 3, 2.5, 6)
    assert parse_tag("pool/r/1/9/0/0/999") == ("r", 1, 9, 0, 0.0, 999)
    assert parse_tag("pool/f/0") == ("f", 0, 0, 0, 0.0, 0)
    assert parse_tag("pool/l/1/9/2/2222") == ("l", 1, 9, 2, 2.222, 0)
    bad_tags = (
        "pool/a/x/1",
        "pool/z/1/1",
        "pool/a/1/1/",
        "pool/a/1234567/1",
        "mean/a/1/1",
        "pool/g/0/7/3/2500/0",  # a window of nothing
        "pool/g/0/7/3/2500/1000",  # past the bound
        "pool/g/0/7/3/2500/4/1",
    )
    for bad in bad_tags:
        assert parse_tag(bad) is None, bad


def test_a_cell_window_grows_only_while_the_cell_idles_and_the_next_stage_starves() -> None:
    # floor 4, cap 16: held 4, nothing left to compute here, a next cell holds nothing -> 5
    assert routing.cell_window(4, 16, 4, idle=True, next_starved=True) == 5
    assert routing.cell_window(4, 16, 9, idle=True, next_starved=True) == 10
    assert routing.cell_window(4, 16, 16, idle=True, next_starved=True) == 16  # the cap
    assert routing.cell_window(4, 16, 1, idle=True, next_starved=True) == 4  # never below
    # every next cell has work, or this one has its own to compute: the floor at once
    assert routing.cell_window(4, 16, 9, idle=True, next_starved=False) == 4
    assert routing.cell_window(4, 16, 9, idle=False, next_starved=True) == 4


def test_a_sender_honours_the_window_each_cell_last_said() -> None:
    book = routing.LoadBook()
    for _ in range(4):
        book.sent("a")
        book.sent("b")
    book.report("a", 1.0, 0, window=6)  # a said it takes 6: room for two more
    book.report("b", 1.0, 0)  # b said nothing: the sender's own window
    assert book.window_of("a", 4) == 6 and book.window_of("b", 4) == 4
    rng = random.Random(5)
    assert {book.choose(["a", "b"], rng.random(), window=4) for _ in range(100)} == {"a"}
    book.report("a", 1.0, 0, window=4)  # back to the floor: both full as it knows
    assert {book.choose(["a", "b"], rng.random(), window=4) for _ in range(200)} == {"a", "b"}


def test_rebalanced_speeds_fill_a_thin_stages_free_cells_without_swapping_the_bottleneck():
    # stage 1 has a free cell (0) and half stage 0's capacity: stage 0's highest replica moves
    speeds = [[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0]]
    moved = routing.rebalanced(speeds, 2.0)
    assert moved == [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
    assert routing.pool_bound(moved) == 3.0 > routing.pool_bound(speeds)
    # a move that would only swap the bottleneck does not happen (4:2 would be 2:4)
    assert routing.rebalanced([[2.0, 2.0], [2.0, 0.0]], 2.0) == [[2.0, 2.0], [2.0, 0.0]]
    # a thin stage with no free cell takes nobody: every cell of a full grid stays
    full = [[0.25, 0.25, 0.5, 1.0], [1.0, 1.0, 1.0, 1.0]]
    assert routing.rebalanced(full, 2.0) == full
    # below the ratio nothing moves
    assert routing.rebalanced([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], 2.0) == [
        [1.0] * 3,
        [1.0, 1.0, 0.0],
    ]


def test_a_streams_window_covers_its_round_trip_within_its_bounds():
    # unmeasured: the floor
    assert routing.stream_window(None, 0.5, 4, 16) == 4
    assert routing.stream_window(2.0, None, 4, 16) == 4
    # 2.7 s downstream at 0.45 s of own compute a microbatch: 6 cover the wait, plus this one
    assert routing.stream_window(2.7, 0.45, 4, 16) == 7
    # a slow stream's own compute covers the wait: the floor
    assert routing.stream_window(2.7, 1.8, 4, 16) == 4
    # a very fast stream is capped
    assert routing.stream_window(30.0, 0.1, 4, 16) == 16


def test_a_streams_window_grows_only_while_a_next_cell_starves():
    # down to the target at once, starved or not
    assert routing.next_window(9, 5, next_starved=False) == 5
    assert routing.next_window(9, 5, next_starved=True) == 5
    # up one a look toward it while a next cell holds nothing, held where every one has work
    assert routing.next_window(4, 7, next_starved=True) == 5
    assert routing.next_window(4, 7, next_starved=False) == 4
    w = 4
    for _ in range(10):
        w = routing.next_window(w, 7, next_starved=True)
    assert w == 7


def test_a_streams_window_fits_the_memory_it_trains_in():
    # 10 GB at the cap of 16, 1 GB a microbatch (a weight version and its tokens)
    assert routing.windows_that_fit(10e9, 1e9, None, 4, 16) == 16
    assert routing.windows_that_fit(10e9, 1e9, 12e9, 4, 16) == 16
    assert routing.windows_that_fit(10e9, 1e9, 7.5e9, 4, 16) == 13  # 2.5 GB over: 3 fewer
    assert routing.windows_that_fit(10e9, 1e9, 1e9, 4, 16) == 7
    assert routing.windows_that_fit(20e9, 1e9, 1e9, 4, 16) == 4  # never below the floor


def test_the_delay_choice_takes_the_sooner_done_of_two_draws():
    rates, queues = [1.0, 0.25], [2, 0]  # a fast cell with 2 queued, a slow idle one
    ws = routing.weights(rates, queues)  # 1/3 against 1/4: the draw alone sends the slow 3/7
    u_fast, u_slow = 0.1, 0.9
    assert routing.pick(ws, u_fast) == 0 and routing.pick(ws, u_slow) == 1
    # the fast cell is done with a new one after 3 of its units (3 / 1), the slow after 4
    assert routing.pick_by_delay(rates, queues, u_slow, u_fast) == 0
    assert routing.pick_by_delay(rates, queues, u_fast, u_slow) == 0
    # both draws the slow cell: it is the one (a draw, not a global minimum)
    assert routing.pick_by_delay(rates, queues, u_slow, 0.95) == 1
    # a tie goes to the first drawn
    assert routing.pick_by_delay([1.0, 0.5], [1, 0], 0.9, 0.1) == 1
    # the book: its own outstanding count makes a cell look slower
    book = routing.LoadBook()
    book.report("a", 1.0, 2)
    book.report("b", 0.25, 0)
    assert book.choose(["a", "b"], u_slow, 4, u_fast) == "a"
    for _ in range(2):
        book.sent("a")  # a now has 4 queued: (4 + 1) / 1 against (0 + 1) / 0.25
    assert book.choose(["a", "b"], u_slow, 8, u_fast) == "b"


def test_affinity_keeps_the_own_cell_unless_it_is_clearly_slower():
    # equal peers: the own cell (index 1) at any affinity >= 1; never with affinity off
    assert routing.stays([1.0, 1.0, 1.0], 1, 1.5)
    assert routing.stays([1.0, 1.0], 0, 1.0)
    assert not routing.stays([1.0, 1.0], 1, 0.0)
    # measured jitter within the ratio stays; a cell 2x slower than the best other sheds at 1.5
    assert routing.stays([0.8, 1.0, 1.1], 0, 1.5)
    assert not routing.stays([0.5, 1.0], 0, 1.5)
    assert routing.stays([0.5, 1.0], 0, 2.0)  # at 2: exactly 2x is not "clearly"
    # the best other counts, not the mean
    assert not routing.stays([1.0, 0.1, 2.0], 0, 1.5)
    # no own cell among the candidates (dead, or full), or it alone
    assert not routing.stays([1.0, 1.0], None, 1.5)
    assert routing.stays([0.1], 0, 1.0)
    # a candidate not measured yet: routed by load (which measures it), not kept
    assert not routing.stays([1.0, None], 0, 1.5)
    assert not routing.stays([None, 1.0], 0, 1.5)


def test_the_load_book_keeps_the_own_cell_with_room_and_draws_past_a_full_or_slow_one():
    book = routing.LoadBook()
    cells = ["a", "b", "c"]
    assert len({book.choose(cells, k / 50, 4, None, "b", 1.5) for k in range(50)}) == 3
    for cell in cells:  # measured: equal peers
        book.report(cell, 1.0, 0)
    kept = Counter(
        book.choose(cells, random.random(), 4, random.random(), "b", 1.5) for _ in range(200)
    )
    assert kept == Counter({"b": 200})  # fixed wiring
    off = Counter(book.choose(cells, random.random(), 4, random.random(), "b") for _ in range(200))
    assert len(off) == 3  # off (the default): the draw
    # the own cell full as this sender knows it (its window): routed by load elsewhere
    for _ in range(4):
        book.sent("b")
    assert book.choose(cells, 0.5, 4, 0.5, "b", 1.5) != "b"
    # with room again but reported 2x slower: routed by load
    book.back("b")
    book.report("b", 0.5, 0)
    got = {book.choose(cells, random.random(), 4, random.random(), "b", 1.5) for _ in range(50)}
    assert got & {"a", "c"}
