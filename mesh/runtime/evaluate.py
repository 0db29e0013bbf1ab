"""Validation loss of a multi-process run, from its cells' checkpoints.

No cell holds a whole model, so a replica is evaluated where its checkpoints meet: the stages'
weights at one step, chained on the fixed validation batches. `simulate` does it while the grid
trains, each time every cell of a replica has saved a new step (at most once per
run.eval_every updates, and at the end), and appends a row to DIR/val.jsonl (the loss in nats
per token, and in bits per byte of text: comparable across tokenizers); the run's loss plot and
summary read them.

imports: torch, mesh (config, data, model, checkpoint, rows).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from mesh.algo.schedule import microbatches_per_update
from mesh.config import Config
from mesh.data.corpus import Corpus, bits_per_byte, val_batches
from mesh.model.build import build_cell_stages, lm_loss, run_stages
from mesh.runtime.checkpoint import CheckpointError, checkpoint_path, read_checkpoint, saved_steps
from mesh.runtime.rows import append_row, parse_rows

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def validation_batches(cfg: Config, corpus: Corpus) -> Batches:
    return val_batches(
        corpus, cfg.data.val_batches, cfg.pipeline.microbatch_size, cfg.model.seq_len
    )


def tokens_at(cfg: Config, step: int) -> int:
    """Training tokens the whole grid has seen when every replica is at `step`."""
    mpu = microbatches_per_update(cfg.pipeline.schedule, cfg.pipeline.microbatches)
    return step * mpu * cfg.tokens_per_microbatch * cfg.grid.replicas


def replica_loss(
    cfg: Config,
    run_dir: Path,
    replica: int,
    step: int | Sequence[int | None] | None,
    batches: Batches,
) -> float:
    """Mean validation loss of `replica`'s stages chained at checkpoint `step` (None: the
    untrained model every run starts from; a list: each stage's own step, as stage pools'
    cells take different numbers of updates)."""
    stages = build_cell_stages(cfg)
    per_stage = step if isinstance(step, Sequence) else [step] * len(stages)
    for j, (st, at) in enumerate(zip(stages, per_stage, strict=True)):
        if at is not None:
            # mapped: only the weights are read, not the whole cell (10.5 GB at llama-1b stage 0)
            state = read_checkpoint(checkpoint_path(run_dir, j, replica, at)).state
            torch.nn.utils.vector_to_parameters(state["flat"], st.parameters())
    total = 0.0
    with torch.no_grad():
        for x, y in batches:
            total += lm_loss(run_stages(stages, x), y).item()
    return total / len(batches)


def latest_steps(run_dir: Path, cfg: Config, replica: int) -> list[int | None]:
    """Each stage's newest checkpoint of `replica`'s cells (None: none): a pooled grid's
    replica chain, whose cells took different numbers of updates."""
    return [(saved_steps(run_dir, j, replica) or [None])[-1] for j in range(cfg.grid.stages)]


def common_steps(run_dir: Path, cfg: Config, replica: int) -> list[int]:
    """Steps that every cell of `replica` has a checkpoint of, oldest first."""
    sets = [set(saved_steps(run_dir, j, replica)) for j in range(cfg.grid.stages)]
    return sorted(set.intersection(*sets)) if sets else []


def final_steps(run_dir: Path, cfg: Config, replica: int) -> list[int | None]:
    """Each stage's step that `replica`'s final loss is evaluated at, by the run's summary and
    its last val.jsonl row alike: a fixed torch replica where its cells' checkpoints meet; a
    pool's cells (different numbers of updates) and hivemind's (a stop saves each where it
    finds it; a cell that downloaded state saves from the step it took) at each one's newest.
    Their newest common step may be one long past (a periodic save's, the stop a resume
    started from), and was reported as the resumed run's loss."""
    newest = cfg.pipeline.pooled or cfg.transport.backend == "hivemind"
    common = common_steps(run_dir, cfg, replica) if not newest else []
    if common:
        return [common[-1]] * cfg.grid.stages
    return latest_steps(run_dir, cfg, replica)  # also a fixed replica whose saves never met


class ValTracker:
    """Evaluates each replica at its new common checkpoints during a run (DIR/val.jsonl)."""

    def __init__(self, cfg: Config, run_dir: Path, corpus: Corpus, start_step: int = 0) -> None:
        self.cfg, self.dir = cfg, run_dir
        self.batches = validation_batches(cfg, corpus)
        self.bytes_per_token = corpus.val_bytes_per_token
        self.done = {i: start_step for i in range(cfg.grid.replicas)}
        # each replica's stage steps last evaluated: the final row is written once per chain
        self.evaluated: dict[int, list[int | None]] = {}
        self.path = run_dir / "val.jsonl"

    def start(self) -> None:
        """The untrained model's loss, once per fresh run (every replica starts from it)."""
        loss = replica_loss(self.cfg, self.dir, 0, None, self.batches)
        for i in range(self.cfg.grid.replicas):
            self._write({"replica": i, "step": 0, "tokens": 0, "val_loss": loss})

    def poll(self, final: bool = False) -> None:
        """Evaluate every replica whose cells all saved a step at least run.eval_every past the
        last one evaluated (final: at the steps the run's summary evaluates, final_steps)."""
        every = self.cfg.run.eval_every
        for i in self.done:
            steps = common_steps(self.dir, self.cfg, i)
            for step in steps:  # in order: a poll that comes late still evaluates each mark
                last = self.done[i]
                if step <= last or not step >= last + every:
                    continue
                self._evaluate(i, [step] * self.cfg.grid.stages)
            if final:
                self._evaluate(i, final_steps(self.dir, self.cfg, i))

    def _evaluate(self, i: int, at: list[int | None]) -> None:
        """A row for replica i with each stage at its step in `at`, unless that chain was the
        last one evaluated or no stage saved. A chain of different steps is reported at the
        fewest (the tokens every stage has trained on), its stages' steps beside it."""
        saved = [s for s in at if s is not None]
        last = self.evaluated.get(i, [self.done[i]] * len(at))
        if not saved or at == last or max(saved) < self.done[i]:  # nothing newer to show
            return
        try:
            loss = replica_loss(self.cfg, self.dir, i, at, self.batches)
        except (FileNotFoundError, RuntimeError, CheckpointError):  # pruned under us
            return
        step = min(saved)
        self.done[i], self.evaluated[i] = max(self.done[i], step), at
        row: dict[str, Any] = {"replica": i, "step": step, "tokens": tokens_at(self.cfg, step)}
        if len(set(at)) > 1:
            row["stage_steps"] = at
        self._write({**row, "val_loss": loss})

    @contextlib.contextmanager
    def background(self, period_s: float = 1.0) -> Iterator[None]:
        """poll() every period_s on a thread of its own while the body runs: an evaluation
        (every stage built and chained over the validation batches: seconds on a busy machine)
        must not hold up the launcher's watch loop, whose progress bar otherwise stood still
        through it and then jumped (34% to 77%). An error in a poll is raised here at the end."""
        stop, errors = threading.Event(), []

        def loop() -> None:
            try:
                while not stop.wait(period_s):
                    self.poll()
            except BaseException as e:  # noqa: BLE001 - handed to the launcher's thread
                errors.append(e)

        thread = threading.Thread(target=loop, name="validation", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()  # an evaluation under way ends first: val.jsonl is written whole
        if errors:
            raise errors[0]

    def _write(self, row: dict[str, Any]) -> None:
        """A row with the loss in nats per token and in bits per byte of text."""
        row = {**row, "val_bpb": bits_per_byte(row["val_loss"], self.bytes_per_token)}
        append_row(self.path, row)  # whole or not at all: a full disk leaves no torn row


def read_val(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "val.jsonl"
    if not path.is_file():
        return []
    return parse_rows(path.read_bytes())  # a torn line (a crash, a full disk) is skipped
