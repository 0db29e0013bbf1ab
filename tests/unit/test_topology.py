"""The grid's names, in the one place that owns them (mesh/algo/topology.py): rank order, a
replica's path, a stage's column and averaging group, a cell's neighbours on a fixed grid and in
pools, and cells that never start left out of all of them."""

from __future__ import annotations

import pytest

from mesh.algo.topology import Grid, Place, cell_name, group_name, stage_of


def test_names_ranks_and_places_agree():
    grid = Grid(3, 2)
    assert grid.names() == ["s0r0", "s1r0", "s2r0", "s0r1", "s1r1", "s2r1"]
    for rank, name in enumerate(grid.names()):
        place = grid.place(rank)
        assert str(place) == name and grid.rank(place) == rank
        assert Place.parse(name) == place and stage_of(name) == place.stage


@pytest.mark.parametrize("name", ["", "s0", "r0s0", "s0r0x", "s-1r0", "s12345r0", "stage0"])
def test_what_is_not_a_cell_name_parses_to_none(name):
    assert Place.parse(name) is None and stage_of(name) is None


def test_paths_columns_and_groups():
    grid = Grid(2, 3)
    assert grid.path(1) == ["s0r1", "s1r1"]
    assert grid.column(1) == ["s1r0", "s1r1", "s1r2"]
    assert grid.column(1, without=2) == ["s1r0", "s1r1"]  # a cell's partners
    assert grid.groups() == {
        group_name(0): ["s0r0", "s0r1", "s0r2"],
        group_name(1): ["s1r0", "s1r1", "s1r2"],
    }
    assert group_name(1) == "stage1" and cell_name(1, 2) == "s1r2"


def test_neighbours_on_a_fixed_grid_and_in_pools():
    grid = Grid(3, 2)
    assert grid.neighbours(1, 0, pooled=False) == ["s0r0", "s2r0"]
    assert grid.neighbours(0, 1, pooled=False) == ["s1r1"]  # the first stage: one neighbour
    assert grid.neighbours(1, 0, pooled=True) == ["s0r0", "s0r1", "s2r0", "s2r1"]


def test_cells_that_never_start_are_in_no_column_group_or_neighbour_list():
    grid = Grid(2, 3, absent=frozenset({(1, 2)}))
    assert grid.names() == Grid(2, 3).names()  # still named: the grid's shape is unchanged
    assert grid.column(1) == ["s1r0", "s1r1"]
    assert grid.groups()[group_name(1)] == ["s1r0", "s1r1"]
    assert grid.neighbours(0, 2, pooled=False) == []
    assert grid.neighbours(0, 0, pooled=True) == ["s1r0", "s1r1"]
