"""A hostile pipeline stage (faults.pipeline_poison) against the receivers' sentinel
(sentinel.enabled, mesh/algo/sentinel.py): in the simulator, the honest replica's loss stays
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


@pytest.fixture(scope="module")
def clean(text_file):
    run = _sim(text_file)
    assert run.rejects.get("poison", 0) == 0 and run.flagged == {}
    return run


def test_the_default_demo_drops_and_flags_nothing():
    """The default demo's grid and model (4x2, 8 blocks, 512 tokens a microbatch; seed 0, whose
    receivers once dropped honest tensors during the learning-rate warm-up and one then locked
    its sender out), through its learning-rate warm-up and the loss spikes just after: no
    receiver drops or flags an honest neighbour."""
    cfg = load_config(
        [], ["run.seed=0", "run.steps=150", "run.eval_every=1000", "data.val_batches=2"]
    )
    run = GridSim(cfg).run()
    assert run.rejects.get("poison", 0) == 0 and run.flagged == {}


@pytest.mark.parametrize(
    ("attack", "receiver", "onset"),
    [
        # stage 0 of replica 1 sends its activations x100 from update 64 on (the default onset)
        ("s0r1=scale:100", "s1r1", 64),
        # stage 1 of replica 1 sends its gradients back x100, sign-flipped, or as noise of the
        # same RMS; stage 0 drops them
        ("s1r1=scale:100@40", "s0r1", 40),
        ("s1r1=flip@40", "s0r1", 40),
        ("s1r1=random@40", "s0r1", 40),
    ],
)
def test_a_hostile_stage_is_dropped_and_the_honest_loss_holds(
    text_file, clean, attack, receiver, onset
):
    hostile = _sim(text_file, f"faults.pipeline_poison=['{attack}']")
    assert hostile.flagged == {receiver: [attack.split("=")[0]]}
    # every microbatch from the onset on (an honest stream may lose a rare spike besides)
    assert 200 - onset <= hostile.rejects["poison"] <= 200 - onset + 2
    honest, reference = hostile.val_loss_replicas[0], clean.val_loss_replicas[0]
    assert abs(honest - reference) / reference < 0.05, (honest, reference)


def test_an_undefended_gradient_flip_hurts_the_honest_replica(text_file, clean):
    """What the sentinel holds off: the same flip with sentinel.enabled off costs the honest
    replica (through the averaging) more than the 5% the defended run stays within."""
    hostile = _sim(text_file, "faults.pipeline_poison=['s1r1=flip@40']", "sentinel.enabled=false")
    honest, reference = hostile.val_loss_replicas[0], clean.val_loss_replicas[0]
    assert (honest - reference) / reference > 0.05, (honest, reference)


def _runtime(text_file, tmp_path, attack):
    cfg = load_config(
        [],
        [
            *helpers.TINY,
            f"data.path='{text_file}'",
            "grid.stages=2",
            "grid.replicas=1",
            "run.steps=30",
            "dp.mode=none",
            "transport.recv_timeout_s=30",
            "sentinel.warmup=8",
            f"faults.pipeline_poison=['{attack}']",
        ],
    )
    run = run_grid(cfg, tmp_path, timeout_s=240)
    assert run.ok, run.exit_codes
    return read_metrics(tmp_path)


def test_the_runtime_drops_counts_and_flags_a_hostile_stage(text_file, tmp_path):
    rows = _runtime(text_file, tmp_path, "s0r0=scale:100@12")
    last = [r for r in rows[(1, 0)] if "flagged" in r][-1]
    assert last["flagged"] == ["s0r0"]
    # from update 12's microbatch on (by the data's position, as in the simulator)
    assert last["rejects"]["poison"] == 30 - 12
    # the receiver skipped them: no loss from the dropped microbatches, the step still counted
    losses = [r for r in rows[(1, 0)] if "loss" in r]
    assert len(losses) == 30 and losses[-1]["loss"] is None
    # the skip went back to stage 0 as a void gradient: its sentinel drops nothing
    sender = [r for r in rows[(0, 0)] if "rejects" in r and "flagged" in r][-1]
    assert sender["flagged"] == [] and "poison" not in sender["rejects"]


def test_the_runtime_drops_a_sign_flipped_gradient(text_file, tmp_path):
    """Stage 1 sends its gradients back negated from update 12 on: stage 0 keys them by the
    microbatch's targets (every stage reads the data), drops each one and flags stage 1;
    stage 1 still trains on every microbatch."""
    rows = _runtime(text_file, tmp_path, "s1r0=flip@12")
    last = [r for r in rows[(0, 0)] if "flagged" in r][-1]
    assert last["flagged"] == ["s1r0"]
    assert last["rejects"]["poison"] == 30 - 12
    receiver = [r for r in rows[(1, 0)] if "flagged" in r][-1]
    assert receiver["flagged"] == [] and "poison" not in receiver["rejects"]
    losses = [r["loss"] for r in rows[(1, 0)] if "loss" in r]
    assert len(losses) == 30 and all(loss is not None for loss in losses)
