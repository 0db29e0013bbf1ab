"""The per-process runtime against the one-process simulator (same seed, same numbers)."""

from pathlib import Path

import helpers
import pytest
import torch

from comms import codecs
from mesh.config import load_config, with_overrides
from mesh.engine.sim import GridSim
from mesh.runtime.checkpoint import checkpoint_path, common_step
from mesh.runtime.emulate import activation_frame_bytes
from mesh.runtime.launch import run_grid
from mesh.runtime.metrics import read_metrics

pytestmark = pytest.mark.integration

TINY = [
    *helpers.TINY,
    "transport.recv_timeout_s=30",
    "transport.round_timeout_s=30",
]

LLAMA = [
    "model.arch=llama",
    "pipeline.schedule=async",
    "pipeline.codec=fp8_e4m3",
    "dp.tau=2",
    "dp.fraction=0.25",
]

DEPTH_LEVERS = [
    "model.n_layers=3",
    "grid.stages=3",
    "pipeline.schedule=async",
    "dp.tau=2",
    "dp.fraction=0.25",
    "optim.delay_lr_share=0.5",
    "optim.beta1=0.9",
    "optim.adaptive_momentum=true",
    "optim.mu_cap=0.95",
    "optim.min_lr_ratio=0.0",
]

DEPTH_MUON = [
    "model.n_layers=3",
    "grid.stages=3",
    "pipeline.schedule=async",
    "dp.tau=2",
    "dp.fraction=0.25",
    "optim.name=muon",
    "optim.muon_lr=0.01",
    "optim.delay_lr_share=0.5",
]


def _final_flats(out: Path, cfg) -> dict:
    flats = {}
    for i in range(cfg.grid.replicas):
        for j in range(cfg.grid.stages):
            path = checkpoint_path(out, j, i, cfg.run.steps)
            state = torch.load(path, weights_only=True)
            flats[(j, i)] = state["flat"]
    return flats


@pytest.mark.parametrize(
    "extra",
    [
        ["pipeline.schedule=async", "dp.tau=2", "dp.fraction=0.25"],
        # an in-flight window: stage 0 reads one version older, in both engines
        ["pipeline.schedule=async", "dp.tau=2", "dp.fraction=0.25", "pipeline.window=[1,0]"],
        # weight prediction: stage 0's versions extrapolated along its update velocity
        ["pipeline.schedule=async", "dp.tau=2", "dp.fraction=0.25", "pipeline.weight_prediction=1"],
        [
            "pipeline.schedule=gpipe",
            "pipeline.microbatches=2",
            "dp.mode=grad_allreduce",
            "dp.codec=fp32",
            "optim.name=adamw",
        ],
        # compressed boundaries: 4 of 16 values a token cross the link, both directions,
        # learned (the encoder retracted onto the Stiefel manifold) and the fixed subspace
        [*LLAMA, "pipeline.boundary=learned", "pipeline.boundary_rank=4", "pipeline.anchor_rank=4"],
        [*LLAMA, "pipeline.boundary=subspace", "pipeline.boundary_rank=4"],
        # the same bytes and numbers over libp2p streams
        [
            *LLAMA,
            "pipeline.boundary=learned",
            "pipeline.boundary_rank=4",
            "pipeline.anchor_rank=4",
            "transport.backend=hivemind",
        ],
        # a poisoned pipeline: s1r1 drops s0r1's activations from update 4 on, so replica 1's
        # cells have no gradient (stale weights): they sit their rounds out and take replica
        # 0's payload, which has no other member's to average with (Cell.sits_out)
        [
            "pipeline.schedule=async",
            "dp.tau=2",
            "dp.fraction=0.25",
            "run.steps=10",
            "faults.pipeline_poison=['s0r1=scale:100@4']",
            "sentinel.warmup=2",
        ],
        # the depth levers (bench depth's candidates) on three stages, so delays 2, 1, 0
        # differ: the per-stage lr correction, adaptive momentum, a cap on mu_t, cosine to 0
        [*DEPTH_LEVERS],
        [*DEPTH_LEVERS, "transport.backend=hivemind"],
        # P = 16's rule: Muon on top of the lr correction, on three stages
        [*DEPTH_MUON],
        [*DEPTH_MUON, "transport.backend=hivemind"],
    ],
    ids=[
        "asyncmesh-fp8",
        "asyncmesh-window",
        "asyncmesh-predict",
        "fullsync",
        "boundary-learned",
        "boundary-subspace",
        "boundary-learned-hivemind",
        "stalled-replica",
        "depth-levers",
        "depth-levers-hivemind",
        "depth-muon",
        "depth-muon-hivemind",
    ],
)
def test_torch_runtime_matches_simulator(text_file, tmp_path, extra):
    cfg = load_config(
        [],
        [
            *TINY,
            f"data.path='{text_file}'",
            "grid.stages=2",
            "grid.replicas=2",
            "run.steps=6",
            "dp.strict_tau=true",
            *extra,
        ],
    )
    run = run_grid(cfg, tmp_path, timeout_s=240)
    assert run.ok, run.exit_codes
    sim = GridSim(cfg)
    for _ in range(cfg.run.steps):
        sim.step()
    flats = _final_flats(tmp_path, cfg)
    for (j, i), flat in flats.items():
        torch.testing.assert_close(flat, sim.cells[i][j].flat, rtol=1e-5, atol=1e-6)
    rows = read_metrics(tmp_path)
    assert len([r for r in rows[(1, 0)] if "loss" in r]) == cfg.run.steps
    if cfg.pipeline.boundary != "full":  # what crossed the link: (B, T, rank) each way
        sent = [r for r in rows[(0, 0)] if "bytes_sent" in r][-1]["bytes_sent"]["activation"]
        per_message = sent / cfg.run.steps  # async: one activation per update
        # the frame of a (B, T, rank) payload; its header's tag may differ by a few bytes
        assert abs(per_message - activation_frame_bytes(cfg)) <= 32, (sent, cfg.boundary_shape)
        # against full width, the frame shrinks by exactly the payload of the dropped columns
        full = activation_frame_bytes(with_overrides(cfg, {"pipeline.boundary": "full"}))
        B, T, r = cfg.boundary_shape
        dropped = codecs.encoded_nbytes(B * T * cfg.model.d_model, cfg.pipeline.codec)
        dropped -= codecs.encoded_nbytes(B * T * r, cfg.pipeline.codec)
        assert full - activation_frame_bytes(cfg) == dropped


def test_stopped_grid_resumes_to_the_same_weights(text_file, tmp_path):
    """SIGTERM the whole grid mid-run, resume from the common checkpoint: same numbers as a run
    that never stopped (no averaging here, so nothing in flight is lost at the cut). Weight
    prediction is on, so the velocity and the predicted stashes must come back exactly too."""
    base = [
        *TINY,
        f"data.path='{text_file}'",
        "grid.stages=2",
        "grid.replicas=2",
        "run.steps=40",
        "dp.mode=none",
        "checkpoint.every=2",
        "pipeline.weight_prediction=1",
    ]
    cfg = load_config([], base)
    # the stopped run's cells wait 4x their compute (the numbers are the same: emulation is
    # each peer's own setting): flat out, a tiny grid's 40 steps can end before the launcher's
    # progress poll sees step 4 on a loaded box
    slowed = ", ".join(f'"s{j}r{i}=5"' for i in range(2) for j in range(2))
    slow_cfg = load_config([], [*base, f"emulation.slowdowns=[{slowed}]"])
    assert slow_cfg.state_fingerprint() == cfg.state_fingerprint()
    stopped = tmp_path / "stopped"

    def stop_at_step_4(step, loss):
        if (common_step(stopped, [(0, 0), (1, 0), (0, 1), (1, 1)]) or 0) >= 4:
            raise KeyboardInterrupt

    first = run_grid(slow_cfg, stopped, on_progress=stop_at_step_4, timeout_s=240)
    assert first.interrupted
    resumed = run_grid(cfg, stopped, resume=True, timeout_s=240)
    assert resumed.ok, resumed.exit_codes
    straight = tmp_path / "straight"
    assert run_grid(cfg, straight, timeout_s=240).ok
    for i in range(2):
        for j in range(2):
            a = torch.load(checkpoint_path(stopped, j, i, 40), weights_only=True)["flat"]
            b = torch.load(checkpoint_path(straight, j, i, 40), weights_only=True)["flat"]
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "hivemind"])
def test_poisoning_replica_is_refused_and_counted_by_the_runtime(text_file, tmp_path, backend):
    """1x3 (gloo, or libp2p streams), s0r2 sends its weights x -1000 every round: each honest
    cell refuses the payload in every round it applies (counted `outlier`), combines the rest
    by the median, and ends with the simulator's weights (mesh/algo/robust.py in both)."""
    cfg = load_config(
        [],
        [
            *TINY,
            f"data.path='{text_file}'",
            "grid.stages=1",
            "grid.replicas=3",
            "run.steps=6",
            "dp.strict_tau=true",
            "dp.tau=1",
            "dp.fraction=0.25",
            "dp.aggregate=median",
            "dp.outlier_k=10",
            'faults.poison=["s0r2=-1000"]',
            f"transport.backend={backend}",
        ],
    )
    run = run_grid(cfg, tmp_path, timeout_s=240)
    assert run.ok, run.exit_codes
    rows = read_metrics(tmp_path)
    for i in (0, 1):
        last = [r for r in rows[(0, i)] if "rounds_applied" in r][-1]
        assert last["rounds_applied"] > 0, last
        assert last["rejects"].get("outlier") == last["rounds_applied"], last
    sim = GridSim(cfg)
    for _ in range(cfg.run.steps):
        sim.step()
    flats = _final_flats(tmp_path, cfg)
    for i in (0, 1):
        torch.testing.assert_close(flats[(0, i)], sim.cells[i][0].flat, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "hivemind"])
def test_the_depth_rule_trains_the_same_numbers_in_processes_as_in_the_simulator(
    text_file, tmp_path, backend
):
    """An 8-stage async pipeline with the defaults takes optim.depth_rule's settings (the
    shipped pick of bench depth): every cell process trains with them, to the simulator's
    weights, and they change the numbers (the same grid with the rule off ends elsewhere)."""
    sets = [
        *TINY,
        f"data.path='{text_file}'",
        "model.n_layers=8",
        "grid.stages=8",
        "grid.replicas=1",
        "run.steps=6",
        "pipeline.schedule=async",
        f"transport.backend={backend}",
    ]
    cfg = load_config([], sets)
    assert cfg.depth_rule_settings(), "no depth rule applies at P = 8"
    run = run_grid(cfg, tmp_path, timeout_s=300)
    assert run.ok, run.exit_codes
    sim = GridSim(cfg)
    off = GridSim(load_config([], [*sets, "optim.depth_rule=off"]))
    for _ in range(cfg.run.steps):
        sim.step()
        off.step()
    flats = _final_flats(tmp_path, cfg)
    for (j, i), flat in flats.items():
        torch.testing.assert_close(flat, sim.cells[i][j].flat, rtol=1e-5, atol=1e-6)
    assert not torch.equal(sim.cells[0][0].flat, off.cells[0][0].flat)
