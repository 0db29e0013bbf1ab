"""Both axes sized to an uplink: which pipeline boundary and which averaging interval let every
cell of a grid carry a replica's tokens/s over B Mbit/s (`meshtrain plan --uplink-mbit`).

A cell sends its pipeline traffic (activations on, gradients back: plan.pp_bytes_per_token) and
its share of the averaging rounds (a round every dp.interval_steps = H updates, so 1/H of one
round's bytes an update) over the same uplink. Both settings are run-wide, so a setting fits
when it fits the busiest cell. Among the settings that fit, the one chosen is the cheapest in
loss as the studies measured it (the boundary study for the boundary, the convergence study's
interval axis for H; their gaps add; mesh/engine/measured.py ships them); settings a study has
not measured rank after measured ones. A tie in cost goes to the least compressed boundary (it
carries more of the activations for the same measured loss; a gap below zero is noise and counts
as none), then to the shortest interval. Pure: the measured costs come in as arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mesh.config import Config, with_overrides
from mesh.engine.plan import compression_vs_bf16, link_mbps, plan_cell, rank_for_compression

RATIOS = (4, 8, 16, 32, 64)
INTERVALS = (1, 2, 4, 8, 16, 32, 64)
COMPRESSED_CODEC = "fp8_e4m3"
# 4-bit coordinates (learned boundaries only, as the boundary study measures them)
INT4_CODEC = "int4_hadamard"
INT4_RATIOS = (16, 32, 64, 128)


def arm_label(method: str, ratio: int, codec: str) -> str:
    """A compressed boundary's name, as the boundary study's arms and plan's options spell it:
    "learned 16x" (fp8 coordinates), "learned 32x int4" (4-bit ones)."""
    return f"{method} {ratio}x" + ("" if codec == COMPRESSED_CODEC else f" {codec.split('_')[0]}")


@dataclass(frozen=True)
class BoundaryOption:
    """One pipeline boundary setting: what `--set` spells and its size against full bf16."""

    label: str  # "full bf16", "learned 16x": the boundary study's arm names
    method: str
    rank: int
    codec: str
    compression: float

    def overrides(self) -> dict[str, object]:
        ov: dict[str, object] = {"pipeline.boundary": self.method, "pipeline.codec": self.codec}
        if self.method != "full":
            ov["pipeline.boundary_rank"] = self.rank
        return ov


@dataclass(frozen=True)
class Setting:
    option: BoundaryOption
    interval_steps: int
    needs_mbps: tuple[float, ...]  # per stage: pipeline + averaging uplink
    cost: float | None  # measured loss gap (a share), None where a study has not measured it

    @property
    def busiest_mbps(self) -> float:
        return max(self.needs_mbps)

    def overrides(self) -> dict[str, object]:
        return {**self.option.overrides(), "dp.interval_steps": self.interval_steps}


def boundary_options(cfg: Config) -> list[BoundaryOption]:
    """full bf16, full fp8, and (for a llama) each compressed method at each ratio in fp8, and
    learned boundaries at 16-128x in 4 bits."""
    tokens, d = cfg.tokens_per_microbatch, cfg.model.d_model
    out = [
        BoundaryOption(
            f"full {c.split('_')[0]}", "full", d, c, compression_vs_bf16(tokens, d, "full", d, c)
        )
        for c in ("bf16", COMPRESSED_CODEC)
    ]
    if cfg.model.arch != "llama" or cfg.grid.stages < 2:
        return out
    arms = [(m, ratio, COMPRESSED_CODEC) for m in ("learned", "subspace") for ratio in RATIOS]
    arms += [("learned", ratio, INT4_CODEC) for ratio in INT4_RATIOS]
    for method, ratio, codec in arms:
        r = min(d, rank_for_compression(tokens, d, ratio, codec))
        comp = compression_vs_bf16(tokens, d, method, r, codec)
        out.append(BoundaryOption(arm_label(method, ratio, codec), method, r, codec, comp))
    return out


def needs_mbps(cfg: Config, option: BoundaryOption, tokens_per_s: float) -> list[tuple]:
    """Per stage, (pipeline, averaging at one round an update) uplink Mbit/s at this boundary;
    a round every H updates needs 1/H of the averaging figure (plan: a round's bytes / H)."""
    other = with_overrides(cfg, {**option.overrides(), "dp.interval_steps": 1})
    return [link_mbps(plan_cell(other, j), other, tokens_per_s) for j in range(cfg.grid.stages)]


def settings(
    cfg: Config,
    tokens_per_s: float,
    boundary_costs: dict[str, float] | None = None,
    interval_costs: dict[int, float] | None = None,
) -> list[Setting]:
    """Every boundary option with every interval (with replicas to average; else H = the run's),
    its per-stage needs and its measured cost."""
    averaging = cfg.grid.replicas > 1 and cfg.dp.mode == "param_avg"
    intervals = INTERVALS if averaging else (cfg.dp.interval_steps,)
    out = []
    for opt in boundary_options(cfg):
        per_stage = needs_mbps(cfg, opt, tokens_per_s)
        for h in intervals:
            b = 0.0 if opt.label == "full bf16" else (boundary_costs or {}).get(opt.label)
            i = 0.0 if h == 1 or not averaging else (interval_costs or {}).get(h)
            # a gap below zero is the seeds' noise, not a gain: it counts as none
            cost = None if b is None or i is None else max(0.0, b) + max(0.0, i)
            needs = tuple(pp + dp / h for pp, dp in per_stage)
            out.append(Setting(opt, h, needs, cost))
    return out


def rank_key(s: Setting) -> tuple[float, float, int]:
    """Measured cost first (unmeasured after), then the least compression, the shortest H."""
    return (math.inf if s.cost is None else s.cost, s.option.compression, s.interval_steps)


def choose(candidates: list[Setting], uplink_mbps: float) -> Setting | None:
    """The cheapest setting whose busiest cell fits the uplink (None: none fits)."""
    fits = [s for s in candidates if s.busiest_mbps <= uplink_mbps]
    return min(fits, key=rank_key) if fits else None


def leanest(candidates: list[Setting]) -> Setting:
    """The setting that needs the least uplink at its busiest cell."""
    return min(candidates, key=lambda s: s.busiest_mbps)


def per_option(candidates: list[Setting], uplink_mbps: float) -> list[Setting]:
    """For each boundary option (in order): its shortest interval that fits, else its leanest."""
    out: dict[str, Setting] = {}
    for opt in dict.fromkeys(s.option for s in candidates):
        mine = [s for s in candidates if s.option == opt]
        fits = [s for s in mine if s.busiest_mbps <= uplink_mbps]
        out[opt.label] = (
            min(fits, key=lambda s: s.interval_steps)
            if fits
            else min(mine, key=lambda s: s.busiest_mbps)
        )
    return list(out.values())
