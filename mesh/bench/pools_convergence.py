"""`meshtrain bench pools --convergence`: does routing cost loss? The convergence study's headline
arm (AsyncMesh-fp8 with its tuned settings, 4x2) on the simulator with one cell twice as slow
(s1r0), fixed wiring against pools (each microbatch's next cell the one that would finish it
first, with replica affinity AFFINITY: it stays on its own replica's next cell unless that cell
is more than AFFINITY x slower than the best other), on the evaluation seeds 10-17: validation
loss at equal tokens, the paired gap with its 95% interval; and pools with no slow cell, the
control that tells the slow cell's share of a gap from the routing's (with affinity and equal
speeds a pool is fixed wiring: the simulator trains the same numbers bit for bit). 3,200
microbatches a replica (1.64M tokens; 3.3M a run): at 1,600 the fixed arm ended at 0.86 of the
data's bigram cross-entropy, short of the rule every study is read by (0.85). The simulator's
fixed grid has no clock: a slow cell changes nothing there. Resumable (convergence.partial.jsonl).

`--controls` isolates what costs the loss (`run_controls`): pools with no slow cell, routing alone
(every cell one microbatch a tick, half the hops across replicas: PairedPoolSim), pools with
replica affinity, and pools against fixed under DPAvg (the replicas' weights equal every tick),
each against its fixed arm, one run at a time in this process.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mesh.algo.routing import unit
from mesh.bench.convergence import _dp_spec
from mesh.bench.regime import data_reference
from mesh.bench.simruns import Spec, read_runs, record, run_one, spec_config, worker_pool
from mesh.bench.tuning import load_tuned
from mesh.config import Config
from mesh.data.ngram import regime, to_bigram
from mesh.engine.pools import PoolSim
from mesh.report import format_table

# eight: on four (10-13) the 95% interval spanned 2.5 points, too wide to tell a 1% target
SEEDS = tuple(range(10, 18))
MICROBATCHES = 3200
CONTROL_MICROBATCHES = 1600  # the controls' (results/pools/controls.md)
SLOW = ["s1r0=2.0"]
AFFINITY = 1.5  # pipeline.pool_affinity of the pools arms (the controls' measured ratio)
TARGET_GAP = 0.01  # pools within 1% of fixed


# arm -> (routing, slowdowns, label): "even" is pools with no slow cell, the control that
# separates what the slow cell's fewer updates cost from what routing across replicas does
ARMS = {
    "fixed": ("fixed", SLOW, "AsyncMesh-fp8 fixed"),
    "pools": ("pools", SLOW, f"AsyncMesh-fp8 pools (delay), affinity {AFFINITY}"),
    "even": ("pools", [], f"AsyncMesh-fp8 pools (delay), affinity {AFFINITY}, no slow cell"),
}
CHOICE = "delay"  # pipeline.pool_choice of the pools arms (runs of another choice: other labels)


def specs(seeds: tuple[int, ...] = SEEDS) -> dict[str, list[Spec]]:
    tuned, _ = load_tuned()
    out: dict[str, list[Spec]] = {}
    for arm, (routing, slow, label) in ARMS.items():
        out[arm] = []
        for seed in seeds:
            s = _dp_spec("AsyncMesh-fp8", seed, tuned=tuned)
            ov = {**dict(s.overrides), "pipeline.routing": routing, "emulation.slowdowns": slow}
            if routing == "pools":
                ov["pipeline.pool_choice"] = CHOICE
                ov["pipeline.pool_affinity"] = AFFINITY
            out[arm].append(Spec("pools", label, seed, 1, tuple(ov.items())))
    return out


# the pool simulator's numbers by version: runs of another version are not reused
POOL_ENGINE = 2


def run_convergence(base: Config, out: Path, workers: int = 2) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "convergence.partial.jsonl"
    # a run by its arm and config: emulated speeds are a local setting, out of the fingerprint
    # a pooled run is kept only if the pool simulator of today made it: its numbers changed
    # under the same fingerprints (versions stored after the tick's arrivals, POOL_ENGINE 2)
    done = {
        _key(r["method"], r["config_fingerprint"]): r
        for r in read_runs(partial)
        if r["method"] == ARMS["fixed"][2] or r.get("pool_engine") == POOL_ENGINE
    }
    _reuse_fixed_runs(done, ARMS["fixed"][2], MICROBATCHES)
    arms = specs()

    def key(s: Spec) -> str:
        return _key(s.method, spec_config(base, s, MICROBATCHES).fingerprint())

    todo = [s for arm in arms.values() for s in arm if key(s) not in done]
    if todo:
        with worker_pool(workers) as pool:
            args = [(base.model_dump(mode="json"), s, MICROBATCHES) for s in todo]
            for r in tqdm(pool.imap(run_one, args), total=len(args), desc="pools convergence"):
                r = {**r, "pool_engine": POOL_ENGINE}
                with partial.open("a") as f:
                    f.write(json.dumps({k: v for k, v in r.items() if k != "curve"}) + "\n")
                done[_key(r["method"], r["config_fingerprint"])] = r
    loss = {arm: [done[key(s)]["val_loss"] for s in ss] for arm, ss in arms.items()}
    gap = relative_gap(loss["pools"], loss["fixed"])
    even = relative_gap(loss["even"], loss["fixed"])
    ref = data_reference(base)
    ratio = to_bigram(sum(loss["fixed"]) / len(loss["fixed"]), ref)
    summary = {
        "seeds": list(SEEDS),
        "microbatches_per_replica": MICROBATCHES,
        "tokens_per_replica": MICROBATCHES * base.tokens_per_microbatch,
        "slowdowns": SLOW,
        "val_loss": loss,
        "pools_vs_fixed": gap,
        "pools_no_slow_cell_vs_fixed": even,
        "target": {"within": TARGET_GAP, "met": bool(gap["high"] <= TARGET_GAP)},
        "reference_arm": "AsyncMesh-fp8 fixed",
        "reference_to_bigram_ratio": ratio,
        "regime": regime(ratio),
    }
    (out / "convergence.json").write_text(json.dumps(summary, indent=2))
    rows = [
        [str(seed), *(f"{v:.4f}" for v in vs)]
        for seed, *vs in zip(SEEDS, loss["fixed"], loss["pools"], loss["even"], strict=True)
    ]
    verdict = "met" if summary["target"]["met"] else "MISSED"
    (out / "convergence.md").write_text(
        format_table(
            ["seed", "fixed", f"pools, affinity {AFFINITY}", "the same, no slow cell"], rows
        )
        + f"\n\npools against fixed: {_gap(gap)} (target: within {TARGET_GAP:.0%}: {verdict}). "
        f"Pools with no slow cell against fixed (the control): {_gap(even)}. Regime: the "
        f"fixed arm ends at {ratio} of the data's bigram cross-entropy ({regime(ratio)}). "
        f"4x2, {MICROBATCHES:,} microbatches a replica, s1r0 {SLOW[0].split('=')[1]}x slower in "
        "the pools arm.\n"
    )
    return summary


def _reuse_fixed_runs(done: dict[str, Any], label: str, microbatches: int) -> None:
    """The convergence study's runs of the same length into `done` under `label`, the fixed
    AsyncMesh-fp8 arm: the same configs (at 3,200 microbatches it has none, and they run here)."""
    study = Path("results/convergence/summary.json")
    if study.is_file():
        for r in json.loads(study.read_text()).get("runs", []):
            if r.get("microbatches") == microbatches:
                done.setdefault(_key(label, r["config_fingerprint"]), r)


def _key(label: str, fingerprint: str) -> str:
    return f"{label} | {fingerprint}"


def _gap(g: dict[str, float]) -> str:
    return f"{g['mean']:+.2%} [95%: {g['low']:+.2%}, {g['high']:+.2%}]"


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365}


def relative_gap(values: list[float], reference: list[float]) -> dict[str, float]:
    """Mean of the per-seed (value - reference) / reference, with its 95% t interval."""
    import statistics

    diffs = [(v - r) / r for v, r in zip(values, reference, strict=True)]
    mean = statistics.mean(diffs)
    half = T95[len(diffs) - 1] * statistics.stdev(diffs) / len(diffs) ** 0.5
    return {"mean": round(mean, 5), "low": round(mean - half, 5), "high": round(mean + half, 5)}


# ---- the controls (`--controls`): what in pools costs the loss -------------------------------
CONTROL_SEEDS = (10, 11)
PAIRED = "paired"  # the arm whose engine is PairedPoolSim
# arm -> (method, routing, slowdowns, extra overrides, label), each against its fixed arm at
# equal tokens: "even" is pools on this engine (versions after the tick's arrivals); "paired"
# routing alone (every microbatch to a random cell of another replica or its own, exactly one a
# cell a tick: no cell steps twice); "affinity" pools with replica affinity 1.5 and the slow
# cell (its stream leaves it, the equal cells keep theirs); the DPAvg pair the same routing
# with the replicas' weights made equal every tick (a blocking full average).
# the controls measure pools routed by load (every hop drawn): affinity off, as they ran
NO_AFFINITY: dict[str, Any] = {"pipeline.pool_affinity": 0.0}
CONTROL_ARMS: dict[str, tuple[str, str, list[str], dict[str, Any], str]] = {
    "fixed": ("AsyncMesh-fp8", "fixed", SLOW, {}, "AsyncMesh-fp8 fixed"),
    "even": (
        "AsyncMesh-fp8",
        "pools",
        [],
        NO_AFFINITY,
        "AsyncMesh-fp8 pools (delay), no slow cell",
    ),
    PAIRED: ("AsyncMesh-fp8", "pools", [], NO_AFFINITY, "AsyncMesh-fp8 paired across replicas"),
    "affinity": (
        "AsyncMesh-fp8",
        "pools",
        SLOW,
        {"pipeline.pool_affinity": 1.5},
        "AsyncMesh-fp8 pools (delay), affinity 1.5",
    ),
    "dpavg-fixed": ("DPAvg", "fixed", [], {}, "DPAvg fixed"),
    "dpavg-pools": ("DPAvg", "pools", [], NO_AFFINITY, "DPAvg pools (delay), no slow cell"),
}
# each arm's reference: the fixed arm of its method
CONTROL_REFERENCE = {
    "even": "fixed",
    PAIRED: "fixed",
    "affinity": "fixed",
    "dpavg-pools": "dpavg-fixed",
}


def control_specs(seeds: tuple[int, ...] = CONTROL_SEEDS) -> dict[str, list[Spec]]:
    tuned, _ = load_tuned()
    out: dict[str, list[Spec]] = {}
    for arm, (method, routing_, slow, extra, label) in CONTROL_ARMS.items():
        out[arm] = []
        for seed in seeds:
            s = _dp_spec(method, seed, tuned=tuned)
            ov = {**dict(s.overrides), "pipeline.routing": routing_, "emulation.slowdowns": slow}
            if routing_ == "pools":
                ov["pipeline.pool_choice"] = CHOICE
            ov.update(extra)
            out[arm].append(Spec("pools", label, seed, 1, tuple(ov.items())))
    return out


def run_control(args: tuple[dict[str, Any], Spec, int]) -> dict[str, Any]:
    """One control run: the paired arm on PairedPoolSim, the others as every study's run."""
    from mesh.config import config_from_dict

    base_tree, spec, microbatches = args
    if spec.method != CONTROL_ARMS[PAIRED][4]:
        return run_one(args)
    cfg = spec_config(config_from_dict(base_tree), spec, microbatches)
    return record(cfg, spec, microbatches, PairedPoolSim(cfg).run())


def run_controls(
    base: Config,
    out: Path,
    seeds: tuple[int, ...] = CONTROL_SEEDS,
    microbatches: int = CONTROL_MICROBATCHES,
) -> dict[str, Any]:
    """The controls, one run at a time in this process (resumable: controls.partial.jsonl),
    a group of arms on every seed before the next group; the fixed AsyncMesh-fp8 runs are the
    convergence study's where the fingerprint is the same. Writes controls.json and .md."""
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "controls.partial.jsonl"
    done = {_key(r["method"], r["config_fingerprint"]): r for r in read_runs(partial)}
    _reuse_fixed_runs(done, CONTROL_ARMS["fixed"][4], microbatches)
    arms = control_specs(seeds)

    def key(s: Spec) -> str:
        return _key(s.method, spec_config(base, s, microbatches).fingerprint())

    # by what each tells, every seed of a group before the next group: a stopped study has pairs
    groups = (("even", PAIRED), ("dpavg-fixed", "dpavg-pools"), ("fixed", "affinity"))
    order = [arms[arm][k] for group in groups for k in range(len(seeds)) for arm in group]
    todo = [s for s in order if key(s) not in done]
    tree = base.model_dump(mode="json")
    for s in tqdm(todo, desc="pools controls"):
        r = run_control((tree, s, microbatches))
        with partial.open("a") as f:
            f.write(json.dumps({k: v for k, v in r.items() if k != "curve"}) + "\n")
        done[key(s)] = r
    loss = {arm: [done[key(s)]["val_loss"] for s in ss] for arm, ss in arms.items()}
    gaps = {
        arm: relative_gap_or_one(loss[arm], loss[ref]) for arm, ref in CONTROL_REFERENCE.items()
    }
    summary = {"seeds": list(seeds), "microbatches_per_replica": microbatches, "val_loss": loss}
    summary["gaps"] = gaps
    (out / "controls.json").write_text(json.dumps(summary, indent=2))
    rows = [
        [
            CONTROL_ARMS[arm][4],
            *(f"{v:.4f}" for v in loss[arm]),
            _gap(gaps[arm]) if arm in gaps else "",
        ]
        for arm in arms
    ]
    head = ["arm", *(f"seed {s}" for s in seeds), "against its fixed arm"]
    (out / "controls.md").write_text(format_table(head, rows) + "\n")
    return summary


def relative_gap_or_one(values: list[float], reference: list[float]) -> dict[str, float]:
    """relative_gap, or with one seed its value alone (no interval)."""
    if len(values) > 1:
        return relative_gap(values, reference)
    d = round((values[0] - reference[0]) / reference[0], 5)
    return {"mean": d, "low": d, "high": d}


class PairedPoolSim(PoolSim):
    """Routing alone: at every tick and stage each stream's microbatch goes to the cell a random
    permutation of the replicas gives it (keyed by seed, tick and stage), so every cell takes
    exactly one microbatch a tick, as on a fixed grid, and half of the hops (at m = 2) cross
    replicas, as pools' do. No deaths."""

    def _path(
        self, u: int, s: int, dead: set[tuple[int, int]], queue: Counter[tuple[int, int]]
    ) -> list[int] | None:
        assert not dead, "the paired control has no deaths"
        seed = self.cfg.run.seed
        path = [s]
        for j in range(1, self.P):
            order = sorted(range(self.m), key=lambda i: unit(seed, u, j, i, "pair"))
            path.append(order[s])
        return path
