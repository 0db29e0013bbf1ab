"""Wires one cell: config -> corpus -> stage module -> transport -> worker loop -> metrics.

`run_cell` is what each peer process runs (spawned by cli/launch.py for `simulate`, or by
`join`). It writes one JSON line per update to `metrics/<stage>-<replica>.jsonl` and a final
line with the cell's totals, so the launcher can draw progress and build the summary without
talking to the workers.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import torch

from comms.build import make_transport
from comms.transport import Transport
from mesh.cell import Cell
from mesh.checkpoint import checkpoint_path, load_cell, save_cell
from mesh.config import Config, config_from_dict
from mesh.data import load_corpus
from mesh.emulate import link_profile, resolve_window
from mesh.model import build_stage
from mesh.stage import StageWorker, cell_name, group_name


def grid_names(cfg: Config) -> tuple[list[str], dict[str, list[str]]]:
    """All peer names in rank order (replica-major) and the averaging groups (one per stage)."""
    P, m = cfg.grid.stages, cfg.grid.replicas
    names = [cell_name(j, i) for i in range(m) for j in range(P)]
    groups = {group_name(j): [cell_name(j, i) for i in range(m)] for j in range(P)}
    return names, groups


def cell_transport(cfg: Config, stage: int, replica: int, options: dict[str, Any]) -> Transport:
    """This cell's transport: the grid's names and groups, the configured links shaped."""
    names, groups = grid_names(cfg)
    return make_transport(
        cfg.runtime.backend,
        cell_name(stage, replica),
        names,
        groups,
        host=cfg.runtime.host,
        timeout_s=cfg.runtime.timeout_s,
        **{"shaping": link_profile(cfg), **options},
    )


def run_cell(
    cfg_tree: dict[str, Any],
    stage: int,
    replica: int,
    out_dir: str,
    transport_options: dict[str, Any],
    resume_step: int | None = None,
) -> None:
    cfg = config_from_dict(cfg_tree)
    torch.set_num_threads(cfg.run.threads)
    emulated = cfg.runtime.compute == "emulated"
    if emulated:
        cfg = resolve_window(cfg)  # deterministic here; real compute: the launcher resolves it
    corpus = (
        None if emulated else load_corpus(cfg.data.path, cfg.data.val_fraction, cfg.model.seq_len)
    )
    cell = Cell(cfg, stage, replica, build_stage(cfg.model, cfg.grid.stages, stage, cfg.run.seed))
    if resume_step is not None:
        load_cell(cell, cfg.fingerprint(), checkpoint_path(out_dir, stage, replica, resume_step))
    names, groups = grid_names(cfg)
    metrics = Path(out_dir) / "metrics" / f"{stage}-{replica}.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    transport = cell_transport(cfg, stage, replica, transport_options)
    # SIGTERM (the launcher stopping us, or a user): unwind through `finally` so the transport
    # is closed (p2pd children reaped) and the checkpoint written
    signal.signal(signal.SIGTERM, _exit_cleanly)
    start = time.perf_counter()
    with metrics.open("a") as f:

        def on_step(worker: StageWorker) -> None:
            every = cfg.runtime.checkpoint_every
            if every and cell.step % every == 0:
                save_cell(cell, cfg.fingerprint(), out_dir)
            st = worker.stats
            row = {
                "stage": stage,
                "replica": replica,
                "step": cell.step,
                "time_s": round(time.perf_counter() - start, 4),
                "loss": st.losses[-1] if st.losses else None,
                "lr_scale": cell.lr_scale(),
                "bytes_sent": transport.stats.sent_by_kind(),
                "rounds_started": st.rounds_started,
                "rounds_applied": st.rounds_applied,
                "rounds_partial": st.rounds_partial,
                "rounds_failed": st.rounds_failed,
                "rejects": dict(transport.stats.rejects),
                "microbatches": st.microbatches,
                "busy_s": round(st.busy_s, 6),
                "staleness_max": st.staleness_max,
                "stash_bytes_peak": st.stash_bytes_peak,
                "rss_peak_mb": round(st.rss_peak_mb(), 1),
            }
            f.write(json.dumps(row) + "\n")
            f.flush()

        try:
            worker = StageWorker(cfg, cell, transport, corpus)
            worker.run(cfg.run.steps - cell.step, on_step)
            final = {
                "final": True,
                "stage": stage,
                "replica": replica,
                "step": cell.step,
                "flat_sha": _digest(cell.flat),
                "wall_s": time.perf_counter() - start,
                "bytes_sent": transport.stats.sent_by_kind(),  # sends drained: final counts
                "staleness_hist": {str(k): n for k, n in sorted(worker.stats.staleness.items())},
            }
            f.write(json.dumps(final) + "\n")
        finally:
            transport.close()
            save_cell(cell, cfg.fingerprint(), out_dir)


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]
