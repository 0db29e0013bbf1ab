"""The pipeline sentinel (mesh/algo/sentinel.py) on replays of real boundary tensors.

A simulator run records every activation and gradient that crosses a pipeline boundary, with
the token ids its receiver keys it by (`record`). `replay` then feeds one such stream to a
fresh sentinel, with an emulated attack (faults.pipeline_poison's modes) on every message
from an onset on: what share of the attacked messages is dropped, and how many of a clean
replay are. Replays are cheap and exact (one recording, every attack), which a grid run per
attack is not; tests/unit/test_sentinel.py replays a small recording the same way.

    python3 -m mesh.bench.sentinel_replay [--out results/sentinel] [--models tiny,...]

Writes summary.json and table.md: per model and message kind, the clean replay's drops and
each attack's detection rate with an early onset (update 64, twice the warm-up: what the
emulator does by default) and a late one (update 160, when the streams have settled).
About 11 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from mesh.algo.pipeline_poison import parse_pipeline_poison, poisoned
from mesh.algo.sentinel import Sentinel, SentinelSpec
from mesh.config import Config, load_config

Message = tuple[torch.Tensor, torch.Tensor]  # the tensor and its rows' token ids
Stream = tuple[str, str, str]  # (receiver, sender, kind)

ATTACKS = ("flip", "random", "scale:2", "scale:4", "scale:16", "scale:0.5", "scale:0.25")
ONSETS = (64, 160)
UPDATES = 300
# --set overrides per model: all 2 stages x 2 replicas (averaging on), a microbatch per update
BASE = ["grid.stages=2", "grid.replicas=2", "optim.warmup_steps=2", "data.val_batches=2"]
TINY = ["model.n_layers=4", "model.d_model=32", "model.n_heads=2", "model.seq_len=16"]
TINY_RUN = [*TINY, "pipeline.microbatch_size=2"]  # 32 tokens a microbatch
MID = ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.seq_len=64"]
MID_RUN = [*MID, "pipeline.microbatch_size=8"]  # 512 tokens a microbatch
MODELS: dict[str, list[str]] = {
    "tiny gpt": TINY_RUN,
    "tiny llama": [*TINY_RUN, "model.arch=llama"],
    "tiny gpt 4 stages": [*TINY_RUN, "grid.stages=4"],
    "mid gpt": MID_RUN,
    "mid llama": [*MID_RUN, "model.arch=llama"],
}


class Recorder(Sentinel):
    """A receiving cell's sentinel that keeps every message it judges (verdicts unchanged)."""

    def __init__(self, spec: SentinelSpec) -> None:
        super().__init__(spec)
        self.messages: dict[tuple[str, str], list[Message]] = {}

    def check(self, sender: str, kind: str, x: torch.Tensor, tokens: torch.Tensor) -> bool:
        self.messages.setdefault((sender, kind), []).append((x.detach().clone(), tokens.clone()))
        return super().check(sender, kind, x, tokens)


def record(cfg: Config) -> tuple[dict[Stream, list[Message]], int]:
    """Every boundary message of a simulator run of cfg (sentinel.enabled on), per stream,
    and how many the run's own sentinels dropped."""
    from mesh.algo.topology import cell_name
    from mesh.engine.sim import GridSim

    sim = GridSim(cfg)
    recorders = {}
    for cell in (c for row in sim.cells for c in row):
        assert cell.sentinel is not None, "record needs sentinel.enabled on"
        cell.sentinel = Recorder(cell.sentinel.spec)
        recorders[cell_name(cell.stage, cell.replica)] = cell.sentinel
    sim.run()
    streams = {
        (receiver, sender, kind): messages
        for receiver, rec in recorders.items()
        for (sender, kind), messages in rec.messages.items()
    }
    return streams, sum(rec.dropped for rec in recorders.values())


def replay(
    messages: list[Message],
    kind: str,
    mode: str | None = None,
    onset: int = 0,
    spec: SentinelSpec | None = None,
) -> list[bool]:
    """A fresh sentinel's verdicts (True: accepted) on a recorded stream, every message from
    `onset` on attacked by `mode` (faults.pipeline_poison's MODE; None: clean)."""
    poison = (
        None if mode is None else next(iter(parse_pipeline_poison([f"s0r0={mode}"], 1, 1).values()))
    )
    s = Sentinel(spec or SentinelSpec())
    return [
        s.check("sender", kind, x if poison is None or k < onset else poisoned(x, poison, k), ids)
        for k, (x, ids) in enumerate(messages)
    ]


def detection(messages: list[Message], kind: str, mode: str, onset: int) -> float:
    """The share of the attacked messages (from onset on) that were dropped."""
    got = replay(messages, kind, mode, onset)[onset:]
    return got.count(False) / max(1, len(got))


def study(data: str, models: list[str]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name in models:
        t0 = time.perf_counter()
        overrides = [*BASE, *MODELS[name], f"run.steps={UPDATES}", "run.eval_every=100000"]
        cfg = load_config([], [*overrides, f"data.path='{data}'"])
        streams, dropped_in_run = record(cfg)
        for kind in ("activation", "gradient"):
            ours = {k: v for k, v in streams.items() if k[2] == kind}
            clean = sum(replay(m, kind).count(False) for m in ours.values())
            rates = {
                f"{mode}@{onset}": [detection(m, kind, mode, onset) for m in ours.values()]
                for mode in ATTACKS
                for onset in ONSETS
            }
            rows[f"{name} / {kind}"] = {
                "streams": len(ours),
                "messages": sum(len(m) for m in ours.values()),
                "clean_drops": clean,
                "detection_min": {a: min(r) for a, r in rates.items()},
                "detection_mean": {a: sum(r) / len(r) for a, r in rates.items()},
            }
        rows[f"{name} / activation"]["run_drops"] = dropped_in_run
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def table(rows: dict[str, Any]) -> str:
    from mesh.report import format_table

    head = ["model / kind", "clean drops", *(f"{m} @{o}" for m in ATTACKS for o in ONSETS)]
    body = []
    for name, r in rows.items():
        cells = [f"{100 * r['detection_mean'][f'{m}@{o}']:.0f}%" for m in ATTACKS for o in ONSETS]
        body.append([name, f"{r['clean_drops']} of {r['messages']}", *cells])
    return format_table(head, body)


def main() -> None:
    from mesh.testing.local_peers import generated_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/sentinel")
    ap.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS)
    )
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "corpus.txt"  # the tests' generated corpus (no download)
    data.write_text(generated_text(60_000))
    torch.set_num_threads(1)
    rows = study(str(data), [m.strip() for m in a.models.split(",")])
    data.unlink()
    summary = {"updates": UPDATES, "onsets": ONSETS, "attacks": ATTACKS, "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = (
        "Pipeline sentinel on replays of real boundary tensors (python3 -m "
        "mesh.bench.sentinel_replay): per model and message kind, drops in a clean replay and "
        "the mean share of attacked messages dropped, attack from update 64 / 160 on.\n\n"
    )
    (out / "table.md").write_text(text + table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
