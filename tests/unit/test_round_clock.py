"""The shared round clock (mesh/algo/round_clock.py): which round a cell launches."""

from comms.means import FrameId
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
    fid = FrameId("stage-3", 1234, 1)
    assert fid.name == "mean/stage-3/1234/1" and FrameId.parse(fid.name) == fid
    for other in ("mean/a/b/1", "epoch/1/act/5", "mean/", "mean/a/1/²", "mean//1/0"):
        assert FrameId.parse(other) is None, other


def test_no_round_past_the_runs_last_index() -> None:
    """A trailer whose clock ran ahead after a jump stops launching at the run's last index:
    no partner ever launches a round past it."""
    assert next_round(280, 298, 299, 12, final_index=299) == 299
    assert next_round(281, 299, 299, 12, final_index=299) is None
    assert next_round(299, 298, 299, 12, final_index=299) == 299  # the leader's own last
    assert next_round(290, 299, 299, 12) == 300  # without a bound: past it


def test_a_fast_cell_launches_no_further_ahead_than_its_partner_reaches():
    from mesh.algo.round_clock import lead_limit, pace

    # 3x faster than the partner's launches: bounded by what the partner launches in half a
    # round's open time (1 s open, partner 4 rounds/s: 2), never below 1, never above the cap
    assert lead_limit(1.0, 12.0, 4.0, 12) == 2
    assert lead_limit(0.1, 12.0, 4.0, 12) == 1
    assert lead_limit(100.0, 12.0, 4.0, 12) == 12
    # a cell not clearly faster (the column's pace, or the trailer) is not bounded
    assert lead_limit(1.0, 4.5, 4.0, 12) is None
    assert lead_limit(1.0, 2.0, 4.0, 12) is None
    assert lead_limit(1.0, 12.0, None, 12) is None  # the partners' pace not known yet
    assert lead_limit(1.0, 12.0, 4.0, NEVER) is None  # strict tau: rounds at own steps
    assert pace([(0.0, 3), (2.0, 11)]) == 4.0
    assert pace([(0.0, 3)]) is None and pace([(1.0, 3), (1.0, 5)]) is None
    # bounded: past newest_seen + lead it launches the partner's newest round, or the index
    # after its last when that is newer and within the bound, or nothing
    assert next_round(30, 4, 9, 12, lead=2) == 9  # its last far behind: meet the partner's newest
    assert next_round(30, 10, 9, 12, lead=2) == 11
    assert next_round(31, 11, 9, 12, lead=2) is None
    assert next_round(31, 11, 10, 12, lead=2) == 12
    assert next_round(5, 4, 9, 12, lead=2) == 5  # within the bound: its own count
    assert next_round(30, None, -1, 12, lead=2) == 30  # no partner's round seen yet: no bound


def test_two_cells_with_a_lead_bound_never_wait_for_each_other():
    """Whichever cell's last round is the older one can always launch the next (lead >= 1)."""
    last = {"a": 4, "b": 4}
    for _ in range(50):
        launched = 0
        for me, other in (("a", "b"), ("b", "a")):
            got = next_round(1000, last[me], last[other], 12, lead=1)
            if got is not None:
                last[me] = got
                launched += 1
        assert launched >= 1, last
    assert min(last.values()) >= 50
