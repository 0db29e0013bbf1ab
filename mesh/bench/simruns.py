"""Studies on the one-process simulator: a run's spec, its config at a budget, a pool of worker
processes, and resuming a stopped study (the runs already finished are kept, keyed by method,
seed, budget and config fingerprint). `bench convergence` and `bench ablations` share it.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.pool
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.config import Config, with_overrides
from mesh.runtime.launch import cell_context

if TYPE_CHECKING:
    from mesh.engine.sim import SimResult

# A --quick study's budget per run (the full studies' is 1600 microbatches); tests lower it.
QUICK_MICROBATCHES = 160

# Muon's matrices take 10x the lr of its AdamW part in every study's Muon arm (the optimizers
# study's 0.02 / 2e-3)
MUON_LR_FACTOR = 10.0


@dataclass(frozen=True)
class Spec:
    study: str
    method: str
    seed: int
    microbatches_per_update: int
    overrides: tuple[tuple[str, Any], ...]


def spec_config(base: Config, spec: Spec, microbatches: int) -> Config:
    """The run's config: equal tokens; the paper's step-counted settings as shares of the run
    (design: a setting given in steps is a share of the paper's 30k-step run). A spec's own
    overrides win."""
    steps = max(1, microbatches // spec.microbatches_per_update)
    ov = dict(spec.overrides)
    shares = {
        "run.seed": spec.seed,
        "run.steps": steps,
        "run.eval_every": max(1, steps // 12),
        "run.threads": 1,
        # the AsyncMesh paper warms up for 3k of its 30k updates
        "optim.warmup_steps": max(1, steps // 10),
        # NAdam's momentum ramp follows the paper's mu_t curve over this run's updates
        "optim.momentum_decay": "auto",
        # lambda counts the averages a coordinate has had (hold 50 of them, as the paper's 1k
        # steps at K = 20), so the EMA's memory stays shorter than the run at any length
        "dp.lambda_clock": "arrivals",
        # (the steps clock, where a spec asks for it: the paper's 1k of 30k steps)
        "dp.lambda_hold_steps": max(1, steps // 30),
        # the studies measure honest grids: the pipeline sentinel (on by default since the
        # studies' runs were made) drops honest microbatches at a loss spike, and its section
        # is outside the fingerprint, so a run with it would pass for the cached one
        "sentinel.enabled": False,
        # a study's arms are the settings they name: the depth rule (what `bench depth` picked
        # for deep async pipelines, mesh/depth_rule.py) only where a spec asks for it (it is
        # hashed away, so the studies' cached runs keep their fingerprints)
        "optim.depth_rule": "off",
    }
    return with_overrides(base, {**shares, **ov})


def run_one(args: tuple[dict[str, Any], Spec, int]) -> dict[str, Any]:
    """One simulator run (in a worker process): its record for summary.json."""
    from mesh.config import config_from_dict
    from mesh.engine.pools import make_sim

    base_tree, spec, microbatches = args
    cfg = spec_config(config_from_dict(base_tree), spec, microbatches)
    return record(cfg, spec, microbatches, make_sim(cfg).run())


def record(cfg: Config, spec: Spec, microbatches: int, r: SimResult) -> dict[str, Any]:
    """A finished run's record for summary.json."""
    return {
        "microbatches": microbatches,
        "config_fingerprint": cfg.fingerprint(),
        "study": spec.study,
        "method": spec.method,
        "seed": spec.seed,
        "val_loss": r.val_loss,
        "val_loss_avg_model": r.val_loss_avg_model,
        "val_bpb": r.val_bpb,
        "tokens": r.tokens,
        "steps": r.steps,
        "dp_bytes_per_replica_step": r.dp_bytes_per_replica_step,
        "pp_bytes_per_replica_step": r.pp_bytes_per_replica_step,
        "diverged": r.diverged,
        "rejects": r.rejects,  # e.g. boundary tensors a sentinel dropped ("poison")
        "clip_rate": round(r.clip_rate, 4),
        "wall_s": round(r.wall_s, 2),
        "curve": r.curve,
    }


def read_runs(partial: Path) -> list[dict[str, Any]]:
    if not partial.is_file():
        return []
    return [json.loads(ln) for ln in partial.read_text().splitlines() if ln.strip()]


def reuse(
    old: list[dict[str, Any]], specs: list[Spec], base: Config, budget: dict[str, int]
) -> list[dict[str, Any] | None]:
    """For each spec, its finished run among `old` (a stopped study, an earlier sweep): the same
    method, seed, budget and config fingerprint; None where it must run (again)."""
    # the fingerprint covers the whole config (seed and length included): a run of another
    # study or sweep with the same config is the same run, relabelled
    have = {(r.get("microbatches"), r.get("config_fingerprint")): r for r in old}
    out: list[dict[str, Any] | None] = []
    for s in specs:
        mbs = budget[s.study]
        r = have.get((mbs, spec_config(base, s, mbs).fingerprint()))
        out.append(None if r is None else {**r, "study": s.study, "method": s.method})
    return out


@contextlib.contextmanager
def worker_pool(workers: int) -> Iterator[multiprocessing.pool.Pool]:
    """A study's worker processes: forks of the cells' server (torch imported once, not once a
    worker), SIGTERM back at its default, so the pool's terminate ends them as it expects.

    Done, the workers are told to end (close, join), not terminated: a worker still starting
    (a study whose every run was cached closes its pool at once) has the server's SIGTERM
    ignored until its initializer runs, so terminate's SIGTERM was lost and its join waited for
    ever. An error still terminates them."""
    pool = cell_context().Pool(workers, initializer=_worker_started)
    try:
        yield pool
    except BaseException:
        pool.terminate()
        raise
    pool.close()
    pool.join()


def _worker_started() -> None:
    """A pool worker ends with its study: SIGTERM at its default (the pool's terminate), and
    a watch on the launcher, since a study killed by SIGKILL cannot end its workers, and each
    holds its task pipe's write end too, so an idle one would wait for a task for ever (and
    keep the fork server's resource tracker alive beside it)."""
    from mesh.runtime.stop import watch_parent

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    watch_parent()


def run_specs(
    base: Config,
    specs: list[Spec],
    budget: dict[str, int],
    out: Path,
    workers: int,
    desc: str,
    known: Sequence[dict[str, Any]] = (),
    report_only: bool = False,
) -> list[dict[str, Any]]:
    """Every spec's run at its study's budget, `workers` at a time, with a progress bar. Each
    finished run is appended to out/runs.partial.jsonl at once, so a stopped study resumes
    where it stopped; the caller removes that file once its outputs are written. Runs in `known`
    (another study's, a sweep's) are reused where their config is the same. report_only: run
    nothing and write nothing, answer with the runs finished so far (the others left out)."""
    from tqdm import tqdm

    partial = out / "runs.partial.jsonl"
    old = read_runs(partial)
    found = reuse([*known, *old], specs, base, budget)
    runs = [r for r in found if r is not None]
    if report_only:
        return sorted(runs, key=lambda r: (r["study"], r["method"], r["seed"]))
    out.mkdir(parents=True, exist_ok=True)
    todo = [s for s, r in zip(specs, found, strict=True) if r is None]
    # the file keeps what it had (another call's runs: a study of two stages, an lr sweep and
    # the rows at its best, resumes both) and gains the runs reused from `known`
    have = {(r.get("microbatches"), r.get("config_fingerprint")) for r in old}
    extra = [r for r in runs if (r["microbatches"], r["config_fingerprint"]) not in have]
    partial.write_text("".join(json.dumps(r) + "\n" for r in [*old, *extra]))
    tree = base.model_dump(mode="json")
    with worker_pool(workers) as pool:
        jobs = [(tree, s, budget[s.study]) for s in todo]
        for res in tqdm(pool.imap_unordered(run_one, jobs), total=len(jobs), desc=desc):
            runs.append(res)
            with partial.open("a") as f:
                f.write(json.dumps(res) + "\n")
    runs.sort(key=lambda r: (r["study"], r["method"], r["seed"]))
    return runs
