"""A pooled cell's weight versions at the size of a llama-1b stage (305M parameters, 1.2 GB a
version): Cell.push_pinned_version keeps exactly the versions its held microbatches read plus the
live one (plan.stash_versions: pool_window + 1), whatever their age, and a version let go gives
its buffer to the next one, so the stash never grows past its window. Measured in a fresh process
(its peak resident memory reset before the pushes), which hands the memory back at the end."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pytest
import torch
from test_checkpoint_scale import WIDE_LLAMA, _peak_during

WINDOW = 2


def measure() -> dict[str, object]:
    """Build the wide cell with pools, then push versions as a cell holding up to WINDOW
    microbatches does: a held microbatch reads an old version for several updates."""
    from mesh.config import load_config
    from mesh.engine.cell import Cell
    from mesh.engine.plan import stash_versions
    from mesh.model.build import stage_layers, stage_module

    torch.set_num_threads(2)
    # (the cell is a stream's: its window is pool_window's, not sized from its round trip)
    pools = [
        "pipeline.routing='pools'",
        f"pipeline.pool_window={WINDOW}",
        "pipeline.pool_stream_window='window'",
    ]
    cfg = load_config([], [*WIDE_LLAMA, *pools])
    module = stage_module(cfg.model, *stage_layers(cfg.model, 1, 0))
    module.to_empty(device="cpu")
    cell = Cell.build(cfg, 0, 0, module)
    cell.flat.zero_()
    cell.history[0].zero_()  # version 0: the weights of step 0
    version_bytes = cell.flat.numel() * 4
    # which versions the held microbatches read after each update: one microbatch holds on to
    # version 0 for four updates while others come and go
    pinned_after = [{0}, {0, 1}, {0, 2}, {0, 3}, {3, 4}, {4, 5}, {5, 6}, {6, 7}]
    sizes, ptrs, values_ok = [], [], True

    def update(step: int) -> None:
        cell.flat.fill_(float(step))  # the live weights of this step, told apart by value
        cell.step = step

    for step, pinned in enumerate(pinned_after[:3], start=1):  # fill the window
        update(step)
        cell.push_pinned_version(pinned)
        sizes.append(len(cell.history))
    buffers = {t.data_ptr() for t in cell.history.values()}

    def more() -> None:
        nonlocal values_ok
        for step, pinned in enumerate(pinned_after[3:], start=4):
            update(step)
            cell.push_pinned_version(pinned)
            sizes.append(len(cell.history))
            ptrs.extend(t.data_ptr() for t in cell.history.values())
            for v, t in cell.history.items():  # each kept version holds its step's weights
                values_ok &= float(t[0]) == float(v) and float(t[-1]) == float(v)

    _, _, extra = _peak_during(more)
    return {
        "params": cell.flat.numel(),
        "version_bytes": version_bytes,
        "sizes": sizes,
        "plan_versions": stash_versions(cfg, 0),
        "kept": sorted(cell.history),
        "new_buffers": len(set(ptrs) - buffers),
        "values_ok": values_ok,
        "pushes_extra_bytes": extra,
    }


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_a_300m_pooled_stage_keeps_its_window_of_versions_in_reused_buffers():
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no /proc/self/clear_refs: the peak cannot be reset")
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        got = pool.submit(measure).result(timeout=240)
    print(json.dumps(got))
    assert got["params"] >= 300_000_000
    assert max(got["sizes"]) <= got["plan_versions"] == WINDOW + 1, got
    assert got["kept"] == [6, 7, 8] and got["values_ok"], got  # pinned 6, 7 and the live 8
    assert got["new_buffers"] == 0, got  # every new version in a buffer let go
    assert got["pushes_extra_bytes"] <= 0.15 * got["version_bytes"], got
