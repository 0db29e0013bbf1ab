"""Which averaging rounds a cell's state download skips (mesh/runtime/rounds.py)."""

import pytest

from mesh.runtime.rounds import skipped_rounds


@pytest.mark.parametrize(
    ("old", "new", "interval", "skipped"),
    [
        (0, 0, 1, []),  # no jump
        (10, 14, 1, [10, 11, 12, 13]),  # updates 10..13 (their rounds) were never run here
        (10, 14, 4, [3]),  # rounds at updates 0, 4, 8 ran (0..2); 12 is skipped; 16 will run
        (9, 12, 4, []),  # update 8 ran round 2; update 12 will run round 3
        (0, 5, 2, [0, 1, 2]),  # a fresh joiner: every round before its step
    ],
)
def test_the_rounds_a_state_download_skips(old, new, interval, skipped):
    # the rounds the cell launched (at its updates 0..old-1) and those it will (new on) do
    # not overlap the skipped ones, and together they are every round
    launched = {u // interval for u in range(old) if u % interval == 0}
    later = {u // interval for u in range(new, new + 3 * interval) if u % interval == 0}
    got = list(skipped_rounds(old, new, interval))
    assert got == skipped
    assert not launched & set(got) and not later & set(got)
    assert launched | set(got) | later >= set(range(max(later) + 1))
