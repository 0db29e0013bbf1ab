"""A real-size stage in a process of its own, for `meshtrain bench scale-model`: the bench's
config of a preset, its largest stage, the cell built, and the process's RSS and peak RSS
(VmHWM, which a measurement resets before it starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# one sequence of 256 tokens a microbatch: the state is the stage's real one, only activations
# shrink (a 2-core CPU runs a llama-1b stage's update in seconds, not minutes)
SHAPE = ("pipeline.microbatch_size=1", "model.seq_len=256", "dp.codec='fp8_e4m3'")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _status_kb("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux: 5 > /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def bench_config(preset: str, extra: tuple[str, ...] = ()) -> Any:
    from mesh.config import load_config

    return load_config([f"configs/models/{preset}.toml"], [*SHAPE, *extra])


def largest_stage(cfg: Any) -> int:
    from mesh.model.build import stage_param_counts

    counts = stage_param_counts(cfg.model, cfg.grid.stages)
    return max(range(len(counts)), key=lambda j: counts[j])


def build_cell(preset: str, stage: int) -> tuple[Any, Any]:
    from mesh.engine.cell import Cell
    from mesh.model.build import build_cell_stage

    cfg = bench_config(preset)
    return cfg, Cell.build(cfg, stage, 0, build_cell_stage(cfg, stage))
