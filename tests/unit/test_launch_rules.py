"""The launcher's rule for a dead cell of a pooled grid (mesh/runtime/launch.py): started again
while another cell is at work or nobody has finished; once no other cell runs and one finished,
a restart would wait for links to nobody, time out and die again for as long as it is restarted
(the churn scenario of `bench pools` once looped so for 15 minutes)."""

from __future__ import annotations

from mesh.runtime.launch import run_over_around

DEAD = (2, 2)


def test_a_dead_cell_is_started_again_while_another_cell_works():
    codes = {(0, 0): 0, (1, 0): None, (2, 2): -9}  # s1r0 still running
    assert not run_over_around(DEAD, codes, set())


def test_not_once_no_other_cell_runs_and_one_finished():
    codes = {(0, 0): 0, (1, 0): 0, (1, 1): -9, (2, 2): -9}
    assert run_over_around(DEAD, codes, set())  # s1r1 died with it: over too
    assert run_over_around((1, 1), codes, {DEAD})  # and once s2r2 is left, s1r1 is not restarted
    assert run_over_around(DEAD, {(0, 0): 0, (2, 2): -9}, set())


def test_a_grid_whose_every_cell_died_at_once_is_started_again():
    codes = {(0, 0): -9, (1, 0): -9, (2, 2): -9}  # nobody finished: the run is not over
    assert not run_over_around(DEAD, codes, set())
