"""A hostile pipeline stage (runtime.pipeline_poison) against the receivers' sentinel
(runtime.sentinel, mesh/algo/sentinel.py): in the simulator, the honest replica's loss stays
within 5% of a clean run with the same seed and a clean run drops nothing; in the process
runtime, the same drops are counted in the rows and the sender is flagged."""

import helpers
import pytest

from mesh.config import load_config
from mesh.engine.sim import GridSim
from mesh.runtime.launch import run_grid
from mesh.runtime.metrics import read_metrics

pytestmark = pytest.mark.integration

SMALL = [
    *helpers.TINY,
    "model.d_model=32",
    "model.n_layers=4",
    "grid.stages=2",
    "grid.replicas=2",
    "run.steps=200",
    "run.eval_every=1000",
]


def _sim(text_file, *extra):
    cfg = load_config([], [*SMALL, f"data.path='{text_file}'", *extra])
    return GridSim(cfg).run()


def test_a_hostile_stage_is_dropped_and_the_honest_loss_holds(text_file):
    clean = _sim(text_file)
    assert clean.rejects.get("poison", 0) == 0 and clean.flagged == {}
    # stage 0 of replica 1 sends its activations x100 from update 64 on (the default onset)
    hostile = _sim(text_file, "runtime.pipeline_poison=['s0r1=scale:100']")
    assert hostile.flagged == {"s1r1": ["s0r1"]}
    # every microbatch from the onset on (an honest stream may lose a rare spike besides)
    assert 200 - 64 <= hostile.rejects["poison"] <= 200 - 64 + 2
    honest, reference = hostile.val_loss_replicas[0], clean.val_loss_replicas[0]
    assert abs(honest - reference) / reference < 0.05, (honest, reference)
    # gradients: stage 1 of replica 1 sends them back x100; stage 0 drops them
    back = _sim(text_file, "runtime.pipeline_poison=['s1r1=scale:100@40']")
    assert back.flagged == {"s0r1": ["s1r1"]}
    assert 200 - 40 <= back.rejects["poison"] <= 200 - 40 + 2
    honest = back.val_loss_replicas[0]
    assert abs(honest - reference) / reference < 0.05, (honest, reference)


def test_the_runtime_drops_counts_and_flags_a_hostile_stage(text_file, tmp_path):
    cfg = load_config(
        [],
        [
            *helpers.TINY,
            f"data.path='{text_file}'",
            "grid.stages=2",
            "grid.replicas=1",
            "run.steps=30",
            "dp.mode=none",
            "runtime.timeout_s=30",
            "runtime.sentinel_warmup=8",
            "runtime.pipeline_poison=['s0r0=scale:100@12']",
        ],
    )
    run = run_grid(cfg, tmp_path, timeout_s=240)
    assert run.ok, run.exit_codes
    rows = read_metrics(tmp_path)
    last = [r for r in rows[(1, 0)] if "flagged" in r][-1]
    assert last["flagged"] == ["s0r0"]
    # stage 0 is at update 12 when it sends microbatch 13 (async: one forward ahead)
    assert last["rejects"]["poison"] == 30 - 13
    # the receiver skipped them: no loss from the dropped microbatches, the step still counted
    losses = [r for r in rows[(1, 0)] if "loss" in r]
    assert len(losses) == 30 and losses[-1]["loss"] is None
    # the skip went back to stage 0 as a void gradient: its sentinel drops nothing
    sender = [r for r in rows[(0, 0)] if "rejects" in r and "flagged" in r][-1]
    assert sender["flagged"] == [] and "poison" not in sender["rejects"]
