"""Where a pooled grid's time goes (mesh/bench/pools_cells.py): shares of the steady window from
each cell's running totals, a stage's weighted by its cells' speeds."""

import pytest

from mesh.bench import pools_cells as pc


def _rows(*points):
    return [{"time_s": t, "busy_s": b, "starved_s": s, "blocked_s": k} for t, b, s, k in points]


def test_a_cells_shares_are_its_totals_growth_over_the_window():
    rows = _rows((1, 0.5, 0.5, 0), (3, 2.0, 0.5, 0.5), (5, 3.0, 1.0, 1.0), (9, 6.0, 1.0, 2.0))
    # on the rows: [3, 5] grew busy 1, starved 0.5, blocked 0.5
    assert pc.cell_shares(rows, 3.0, 5.0) == {"busy": 0.5, "starved": 0.25, "blocked": 0.25}
    # between rows, read linearly: at 4, busy 2.5; at 7, busy 4.5 (and zero at the start)
    assert pc.cell_shares(rows, 4.0, 7.0)["busy"] == pytest.approx(2.0 / 3.0)
    assert pc.cell_shares(rows, 0.0, 0.5)["busy"] == pytest.approx(0.5)
    # past the last row: the cell has finished, its totals stand
    assert pc.cell_shares(rows, 9.0, 12.0) == {"busy": 0.0, "starved": 0.0, "blocked": 0.0}
    assert pc.cell_shares([], 1.0, 2.0) is None and pc.cell_shares(rows, 3.0, 3.0) is None


def test_the_steady_window_ends_at_the_first_streams_end():
    final = {"final": True, "wall_s": 40.0}  # a life's last row: no time_s
    rows = {
        (0, 0): [*_rows((1, 0, 0, 0), (20, 0, 0, 0)), final],
        (0, 1): _rows((1, 0, 0, 0), (12, 0, 0, 0)),
        (1, 0): _rows((2, 0, 0, 0), (30, 0, 0, 0)),
    }
    assert pc.steady_window(rows) == (3.0, 12.0)
    # a cell whose first row comes later (its start, its first microbatch): from there
    rows[(1, 1)] = _rows((5, 0, 0, 0), (11, 0, 0, 0))
    assert pc.steady_window(rows) == (5.0, 12.0)
    assert pc.cell_shares(rows[(0, 0)], 3.0, 50.0) is not None


def test_a_stages_shares_weigh_its_cells_by_speed_and_skip_the_dead():
    full = _rows((0, 0, 0, 0), (4, 4.0, 0, 0))  # a cell busy all the time
    half = _rows((0, 0, 0, 0), (4, 2.0, 0, 2.0))  # busy half, blocked half
    rows = {(0, 0): full, (0, 1): half, (1, 0): full, (1, 1): half}
    stages = pc.stage_shares(rows, [[1.0, 0.5], [0.5, 0.0]])
    # stage 0: the fast cell busy, the slow one half: (1 * 1 + 0.5 * 0.5) / 1.5
    assert stages[0]["busy"] == pytest.approx(0.833, abs=1e-3)
    assert stages[0]["blocked"] == pytest.approx(0.167, abs=1e-3)
    assert stages[0]["capacity"] == 1.5 and stages[0]["cells"] == 2
    # stage 1: its dead cell (speed 0) is no part of the capacity or the shares
    assert (stages[1]["busy"], stages[1]["cells"], stages[1]["capacity"]) == (1.0, 1, 0.5)
    assert pc.bottleneck(stages)["stage"] == 1
