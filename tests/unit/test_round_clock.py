"""The shared round clock (mesh/algo/round_clock.py): which round a cell launches."""

from comms.p2p.mean import frame_name, parse_frame_name
from mesh.algo.round_clock import NEVER, jump_threshold, next_round


def test_a_cell_in_step_numbers_rounds_by_its_own_updates():
    assert next_round(0, None, -1, 12) == 0
    assert next_round(7, 6, 8, 12) == 7  # a peer a round ahead (formed a moment earlier)
    assert next_round(7, 6, 18, 12) == 7  # 11 behind: still within reach of the leader


def test_a_trailing_cell_jumps_to_the_newest_round():
    assert next_round(7, 6, 19, 12) == 19
    # after the jump it counts on from there, not from its own updates
    assert next_round(8, 19, 19, 12) == 20
    # a state download moved its own count past the clock: its own count wins
    assert next_round(40, 19, 25, 12) == 40
    assert next_round(7, 6, 10**6, NEVER) == 7  # strict tau: never


def test_a_jump_never_puts_a_coordinate_in_flight_twice():
    # K = 20: round 27 is in the same part as the open round 7, 28 as 8; 29 in neither
    assert next_round(9, 8, 27, 12, in_flight=[7, 8], parts=20) is None
    assert next_round(9, 8, 28, 12, in_flight=[7, 8], parts=20) is None
    assert next_round(9, 8, 29, 12, in_flight=[7, 8], parts=20) == 29
    assert next_round(9, 8, 27, 12, in_flight=[7, 8], parts=None) == 27  # bernoulli: no promise


def test_replicas_at_different_speeds_keep_meeting():
    """A leader 3x faster than its trailer: with the clock the trailer meets the leader in every
    round it launches, and every round the trailer launches lands on the leader's side before
    the leader cuts it (tau + lag updates after launch). Counting rounds by own updates, none
    does once the gap passes what a round stays open."""
    tau, lag = 2, 20
    jump = jump_threshold(tau, lag, 1)

    def simulate(jump_after):
        leader_launch = {}  # round -> leader's step at launch
        last, met = None, 0
        for t in range(3000):  # the trailer's updates
            leader_step = 3 * t
            for s in range(3 * t, 3 * t + 3):
                leader_launch[s] = s
            idx = next_round(t, last, leader_step + 2, jump_after)
            last = idx
            # the round lands on the leader's side if it is still open there
            met += leader_step <= leader_launch[idx] + tau + lag
        return met

    assert simulate(jump) >= 0.99 * 3000
    assert simulate(NEVER) < 0.01 * 3000


def test_jump_threshold():
    assert jump_threshold(5, 20, 1) == 12
    assert jump_threshold(2, 0, 1) == 2  # never below 2
    assert jump_threshold(5, 20, 4) == 3


def test_round_ids_read_from_payload_names():
    assert parse_frame_name(frame_name("stage-3", 1234, 1)) == ("stage-3", 1234)
    assert parse_frame_name("mean/a/b/1") is None
    assert parse_frame_name("epoch/1/act/5") is None
    assert parse_frame_name("mean/") is None
