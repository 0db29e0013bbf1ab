"""A cell's slice of the config (mesh.engine.cell.CellSettings): what it holds, and that an
emulated hostile cell's behaviour is parsed for that cell alone."""

from __future__ import annotations

import dataclasses

from mesh.config import Config, load_config
from mesh.engine.cell import Cell, CellSettings
from mesh.model.build import build_stage


def test_a_hostile_cell_carries_its_own_factor_and_the_others_none():
    cfg = load_config([], ["grid.stages=2", "grid.replicas=2", 'faults.poison=["s1r0=-1000"]'])
    assert CellSettings.of(cfg, 1, 0).poison == -1000.0
    assert CellSettings.of(cfg, 1, 1).poison is None
    assert CellSettings.of(cfg, 0, 0).pipeline_poison is None


def test_the_slice_is_what_the_cell_reads_of_the_config():
    cfg = load_config([], ["grid.stages=2", "run.seed=7", "run.steps=40"])
    got = CellSettings.of(cfg, 0, 0)
    assert (got.stages, got.seed, got.schedule_horizon) == (2, 7, 40)
    assert got.optim == cfg.optim and got.dp == cfg.dp and got.pipeline == cfg.pipeline
    # the cell holds the slice, not the run's whole config
    cell = Cell.build(cfg, 0, 0, build_stage(cfg.model, 2, 0, 7))
    assert cell.settings == got
    assert not any(isinstance(getattr(cell, f.name), Config) for f in dataclasses.fields(cell))
