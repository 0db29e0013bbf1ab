"""A run's metrics files: a cell's rows written (MetricsSink: the JSONL record, then the
TensorBoard / Prometheus exporters), read back (every cell's rows), and the summary.json of a
multi-process run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mesh.algo.topology import cell_name
from mesh.runtime.lives import (
    POOL,
    ROUNDS,
    add_counts,
    cell_totals,
    split_lives,
    without_replayed,
)
from mesh.runtime.rows import append_row, parse_rows


def metrics_offsets(run_dir: Path) -> dict[str, int]:
    """Each metrics file's size now: read_metrics(since=...) then reads only what comes after
    (a resumed run appends to the files of the run it continues)."""
    return {p.name: p.stat().st_size for p in (Path(run_dir) / "metrics").glob("*.jsonl")}


def read_metrics(
    run_dir: Path,
    events: bool = False,
    since: dict[str, int] | None = None,
    replayed: bool = False,
) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Every cell's metrics rows, keyed (stage, replica). A line a running cell is still
    writing (no closing brace yet) is skipped, so this is safe to call during a run. Event rows
    ({"event": "started" | "session_broken" | "state_loaded" | ..., "step"}) only with
    events=True. A torn line (a crash or a full disk cut it) is skipped too. The update rows of
    steps a later life of the cell replayed (a restart or resume from an older checkpoint) are
    left out, unless replayed=True (mesh/runtime/lives.py)."""
    rows: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for path in sorted((Path(run_dir) / "metrics").glob("*.jsonl")):
        stage, replica = cell_of_file(path)
        with path.open("rb") as f:
            f.seek((since or {}).get(path.name, 0))
            parsed = parse_rows(f.read())
        if not replayed:
            parsed = without_replayed(parsed)
        rows[(stage, replica)] = [r for r in parsed if events or "event" not in r]
    return rows


def newest_metrics_file(run_dir: Path) -> Path | None:
    """The metrics file appended to last: a `join`'s current cell. A join that lost its claim
    to a racing one, or moved stage, has written a file for each cell it held."""
    files = list((Path(run_dir) / "metrics").glob("*.jsonl"))
    return max(files, key=lambda p: p.stat().st_mtime_ns, default=None)


def cell_of_file(path: Path) -> tuple[int, int]:
    stage, replica = (int(x) for x in path.stem.split("-"))
    return stage, replica


class RowTail:
    """The rows appended to one metrics file since the last read: a long run's file is never
    parsed whole again (a `join` that re-read it every half second for its progress bar grew
    by the parsed rows, ~6 KB per update, for the run's life: the soak's RSS growth)."""

    def __init__(self, path: Path, start: int = 0) -> None:
        self.path, self.offset = Path(path), start

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += end
        return parse_rows(chunk[:end])  # another process's file: a torn line is skipped


def summarize_run(
    cfg: Any, out_dir: Path, wall_s: float, start_step: int = 0, since: dict[str, int] | None = None
) -> dict[str, Any]:
    """summary.json of a multi-process run, from the cells' metrics files and checkpoints.
    A resumed run (from start_step; its rows after the file offsets `since`): rates are of this
    segment; tokens and the loss of the whole run; bytes, rounds and rejects of every life of
    every cell (mesh/runtime/lives.py: restarts and resumes included, a replayed step's bytes
    counted each time they were sent), bytes per replica step over the updates all those lives
    trained."""

    from mesh.data.corpus import bits_per_byte, load_corpus, ngram_ce
    from mesh.data.ngram import beside_loss
    from mesh.runtime.emulate import throughput
    from mesh.runtime.evaluate import tokens_at, validation_batches

    segment = read_metrics(out_dir, events=True, since=since)
    rows = {k: [r for r in v if "event" not in r] for k, v in segment.items()}
    # rates: each cell's latest life (a restarted cell's clock starts again at 0)
    current = {
        k: [r for r in split_lives(v)[-1] if "event" not in r] for k, v in segment.items() if v
    }
    every = read_metrics(out_dir, events=True, replayed=True)  # every life of every cell
    totals = {k: cell_totals(v) for k, v in every.items()}
    P, m = cfg.grid.stages, cfg.grid.replicas
    pools = cfg.pipeline.pooled  # a pool's cells take different numbers of updates
    dropped = left_out(cfg)
    steps, tokens, segment_tokens = (
        _pool_progress(cfg, rows, start_step)
        if pools
        else _fixed_progress(cfg, rows, dropped, start_step)
    )
    corpus = load_corpus(cfg.data.path, cfg.data.val_fraction, cfg.model.seq_len, cfg.data.digest)
    batches = validation_batches(cfg, corpus)
    losses = _replica_losses(cfg, out_dir, batches, dropped)
    kept = [x for x in losses if x is not None]
    val_loss = sum(kept) / len(kept) if kept else None
    bpt = corpus.val_bytes_per_token
    rounds = {k: sum(t[k] for t in totals.values()) for k in ROUNDS}
    sent, rejects = _sent_and_rejects(totals)
    updates = whole_updates({k: t["steps"] for k, t in totals.items()}, P, m, pools)
    # steady state (warm-up rows left out) against the ideal of the same run
    # (mesh/runtime/emulate.py)
    tp = throughput(cfg, current)
    return {
        "grid": f"{P}x{m}",
        "steps": steps,
        "tokens": tokens,
        "wall_s": round(wall_s, 2),
        "tokens_per_s": segment_tokens / wall_s if wall_s > 0 else None,
        "updates_trained": updates,  # by all replicas, every life: replayed ones again
        "tokens_trained": tokens if pools else round(updates * tokens_at(cfg, 1) / m),
        "val_loss": val_loss,
        "val_bpb": None if val_loss is None else bits_per_byte(val_loss, bpt),
        "val_loss_replicas": losses,
        # the data's reference points beside the loss (mesh/data/ngram.py)
        **beside_loss(val_loss, ngram_ce(corpus)),
        "bytes": _bytes_per_replica_step(sent, updates),
        "rounds": rounds,
        "rejects": sum(rejects.values()),
        "rejects_by_reason": rejects,
        "lives": {cell_name(*k): t["lives"] for k, t in sorted(totals.items())},
        # replicas not counted, and why: in the tokens and the loss, or in the loss alone
        "replicas_left_out": [dropped[i] for i in sorted(dropped)],
        # stage pools: microbatches sent on from one stage to the next (of them, to another
        # replica's cell), refusals of full cells, sent again elsewhere, given up
        **({"pools": {k: sum(t[k] for t in totals.values()) for k in POOL}} if pools else {}),
        "compute": cfg.emulation.compute,
        **_steady_state(tp),
    }


Rows = dict[tuple[int, int], list[dict[str, Any]]]


def _fixed_progress(
    cfg: Any, rows: Rows, dropped: dict[int, dict[str, Any]], start_step: int
) -> tuple[int, int, int]:
    """A fixed grid's (steps, tokens, this segment's tokens): each replica that ran at the step
    all its cells reached (one that never ran, or had nothing new in this segment, at the
    segment's start)."""
    from mesh.runtime.evaluate import tokens_at

    m = cfg.grid.replicas
    ran = [i for i in range(m) if "tokens" not in dropped.get(i, {}).get("left_out_of", [])]
    ends = {i: [v[-1]["step"] for (_, r), v in rows.items() if r == i and v] for i in ran}
    reached = [min(e) if e else start_step for e in ends.values()]
    steps = min(reached, default=0)
    per_update = tokens_at(cfg, 1) // m  # one formula with the validation rows (evaluate)
    tokens = sum(reached) * per_update  # what the replicas that ran trained
    segment_tokens = sum(s - min(start_step, s) for s in reached) * per_update
    return steps, tokens, segment_tokens


def _pool_progress(cfg: Any, rows: Rows, start_step: int) -> tuple[int, int, int]:
    """A pooled grid's (steps, tokens, this segment's tokens), from its stage 0 streams."""
    from mesh.runtime.evaluate import tokens_at

    streams = [v[-1]["step"] for k, v in rows.items() if v and k[0] == 0]
    steps = min(streams, default=0)
    tokens = sum(streams) * cfg.tokens_per_microbatch  # every microbatch a stream got back
    segment_tokens = tokens - tokens_at(cfg, min(start_step, steps))
    return steps, tokens, segment_tokens


def _replica_losses(
    cfg: Any, out_dir: Path, batches: Any, dropped: dict[int, dict[str, Any]]
) -> list[float | None]:
    """Each replica's validation loss (None where it has none to show); a replica none of whose
    cells saved is added to `dropped`, with why."""
    from mesh.runtime.evaluate import final_steps, replica_loss

    m = cfg.grid.replicas
    # where val.jsonl's final row evaluates each replica too (simulate writes it just before)
    at = [final_steps(out_dir, cfg, i) for i in range(m)]
    # the mean over the replicas with a loss to show: not one left out (a cell of its chain
    # never ran), nor one none of whose cells saved (stopped before its first save)
    losses = [
        replica_loss(cfg, out_dir, i, at[i], batches)
        if _saved(at[i]) and i not in dropped
        else None
        for i in range(m)
    ]
    for i, x in enumerate(losses):
        if x is None and i not in dropped:
            dropped[i] = {
                "replica": i,
                "left_out_of": ["val_loss"],
                "why": "none of its cells saved a checkpoint: it stopped before "
                f"checkpoint.every = {cfg.checkpoint.every} updates",
            }
    return losses


def _sent_and_rejects(
    totals: dict[tuple[int, int], dict[str, Any]],
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes sent by kind and rejects by reason, summed over every cell's lives."""
    sent: dict[str, int] = {}
    rejects: dict[str, int] = {}
    for t in totals.values():
        add_counts(sent, t["bytes_sent"])
        add_counts(rejects, t["rejects"])
    return sent, rejects


def whole_updates(
    steps: dict[tuple[int, int], int], stages: int, replicas: int, pools: bool
) -> int:
    """The updates every stage applied, summed over the replicas, from each cell's updates over
    every life (`steps` by (stage, replica); replayed ones count again): a fixed replica's the
    fewest of its stages' (one that stopped a step behind the others has not finished that
    update; a cell that never ran: none), a pool's the updates its stage-0 cells applied
    (a microbatch's update is complete when its gradient reaches stage 0)."""
    if pools:
        return sum(n for (j, _), n in steps.items() if j == 0)
    return sum(min(steps.get((j, i), 0) for j in range(stages)) for i in range(replicas))


def _bytes_per_replica_step(sent: dict[str, int], updates: float) -> dict[str, Any]:
    """Each life's final row when present (written after its sends drained)."""
    per = max(updates, 1)
    return {
        "pp_per_replica_step": (sent.get("activation", 0) + sent.get("gradient", 0)) / per,
        "dp_per_replica_step": sent.get("average", 0) / per,
        "sent": sent,
    }


def _steady_state(tp: Any) -> dict[str, Any]:
    """The summary's steady-state rates, stage times, staleness and peak memory."""
    return {
        "steady_tokens_per_s": tp.tokens_per_s,
        "ideal_tokens_per_s": tp.ideal_tokens_per_s,
        "fraction_of_ideal": tp.fraction_of_ideal,
        "stage_times_s": tp.stage_s,
        "staleness": tp.staleness,
        "peak_memory": {"stash_bytes": tp.peak_stash_bytes, "rss_mb": tp.peak_rss_mb},
    }


def left_out(cfg: Any) -> dict[int, dict[str, Any]]:
    """The replicas a process grid's emulation.deaths leaves out, keyed by replica: a cell dead
    from update 0 (`routing.absent`: never started) takes its whole replica out of a fixed grid
    (tokens and validation loss), and its replica's chain out of a pooled grid's validation
    loss (its stage's other cells take its work)."""
    from mesh.algo import routing

    P, m = cfg.grid.stages, cfg.grid.replicas
    spans = routing.parse_deaths(cfg.emulation.deaths, P, m)
    dead = routing.absent(spans, P, m, pooled=True)  # the cells themselves
    out: dict[int, dict[str, Any]] = {}
    for i in range(m):
        cells = [cell_name(j, i) for j in range(P) if (j, i) in dead]
        if not cells:
            continue
        said = f"emulation.deaths takes {', '.join(cells)} out from update 0"
        if cfg.pipeline.pooled:
            why = f"{said}: its stage's other cells took its work, and its replica's chain lacks it"
            out[i] = {"replica": i, "left_out_of": ["val_loss"], "why": why}
        else:
            why = f"{said}, and a fixed replica trains only with all its stages: it never ran"
            out[i] = {"replica": i, "left_out_of": ["tokens", "val_loss"], "why": why}
    return out


def _saved(step: int | list[int | None]) -> bool:
    """Whether a replica has weights to evaluate at `step` (each stage's, for a list)."""
    return any(s is not None for s in (step if isinstance(step, list) else [step]))


def beat_stats(row: dict[str, Any]) -> dict[str, Any]:
    """What a heartbeat carries of a metrics row for `status --json` and the dashboard
    (mesh.runtime.claim_stats.parse_stats reads it back)."""
    out: dict[str, Any] = {
        "rounds": [int(row.get(f"rounds_{k}", 0)) for k in ("applied", "partial", "failed")],
        "rejects": sum(int(n) for n in (row.get("rejects") or {}).values()),
        "bytes": {k: int(n) for k, n in (row.get("bytes_sent") or {}).items()},
    }
    if row.get("loss") is not None:
        out["loss"] = float(row["loss"])
    if "routed" in row:  # a pooled cell: how much of its traffic crossed to other replicas
        out["routed"] = sum(int(n) for n in row["routed"].values())
        out["cross"] = int(row.get("cross_replica", 0))
    return out


class MetricsSink:
    """Where a cell's per-update rows go: one JSON line each, flushed (the record everything
    else reads), then the exporters metrics.tensorboard / metrics.prometheus_port ask for
    (mesh/runtime/exporters.py), which see the same rows."""

    def __init__(
        self, f: Any, cfg: Any, stage: int, replica: int, out_dir: Path, tokens_per_update: int
    ) -> None:
        from mesh.runtime.exporters import open_exporters

        self.f = f
        self.exporters = open_exporters(cfg, stage, replica, Path(out_dir), tokens_per_update)

    def write(self, row: dict[str, Any]) -> None:
        append_row(self.f, row)  # whole or not at all (a full disk raises DiskFull)
        for e in self.exporters:
            e.write(row)

    def close(self) -> None:
        for e in self.exporters:
            e.close()
        self.exporters = []
