"""The one-process grid against hand-rolled references (same seed, same numbers)."""

import math

import helpers
import pytest
import torch

from comms import codecs, wire
from mesh.algo import sparse
from mesh.algo.optim import StageOptimizer
from mesh.algo.optim_schedules import lr_at
from mesh.config import load_config
from mesh.data.corpus import load_corpus, train_batch
from mesh.engine.cell import optim_spec
from mesh.engine.sim import GridSim
from mesh.model.build import build_model, lm_loss

TINY = [
    *helpers.TINY,
    "model.n_layers=4",
    "pipeline.codec=fp32",
    "optim.grad_clip=0",  # the references clip the whole model, the grid clips per stage
]


def tiny(text_file, *extra):
    return load_config([], [*TINY, f"data.path='{text_file}'", *extra])


def flat_replica(sim, replica):
    return torch.cat([c.flat for c in sim.cells[replica]])


def test_deterministic_for_a_seed(text_file):
    cfg = tiny(text_file, "run.steps=6", "grid.stages=2", "grid.replicas=2", "dp.tau=2")
    a, b = GridSim(cfg), GridSim(cfg)
    for _ in range(6):
        assert a.step() == b.step()
    assert torch.equal(flat_replica(a, 1), flat_replica(b, 1))


@pytest.mark.parametrize("optimizer", ["adamw", "nadamw", "muon"])
def test_one_stage_one_replica_equals_plain_training(text_file, optimizer):
    steps = 5
    cfg = tiny(
        text_file,
        f"run.steps={steps}",
        "grid.stages=1",
        "grid.replicas=1",
        "dp.mode=none",
        f"optim.name={optimizer}",
    )
    sim = GridSim(cfg)
    losses = [sim.step() for _ in range(steps)]
    model = build_model(cfg.model, cfg.run.seed)
    opt = StageOptimizer(list(model.named_parameters()), optim_spec(cfg.optim))
    corpus = load_corpus(str(cfg.data.path), cfg.data.val_fraction, cfg.model.seq_len)
    for t in range(steps):
        x, y = train_batch(corpus, cfg.run.seed, 0, t, 2, cfg.model.seq_len)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step(lr_at(t, steps, 1.0, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio))
        opt.zero_grad()
        assert loss.item() == pytest.approx(losses[t], rel=1e-6)
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(flat_replica(sim, 0), ref)


def test_async_uses_stashed_versions_with_delay_p_minus_1_minus_j(text_file):
    """Two stages: stage 0 computes with weights one update old, stage 1 with the newest."""
    steps = 4
    cfg = tiny(
        text_file,
        f"run.steps={steps}",
        "grid.stages=2",
        "grid.replicas=1",
        "dp.mode=none",
        "optim.name=adamw",
    )
    sim = GridSim(cfg)
    for _ in range(steps):
        sim.step()
    # reference: whole-model copies per version, gradients taken at (v-1, v)
    model = build_model(cfg.model, cfg.run.seed)
    names = [n for n, _ in model.named_parameters()]
    stage0 = {n for n in names if not n.startswith(("blocks.2", "blocks.3", "ln_f", "head"))}
    opt = StageOptimizer(list(model.named_parameters()), optim_spec(cfg.optim))
    corpus = load_corpus(str(cfg.data.path), cfg.data.val_fraction, cfg.model.seq_len)
    versions = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    for t in range(steps):
        old, new = versions[max(0, t - 1)], versions[t]
        mixed = {n: (old if n in stage0 else new)[n].clone().requires_grad_() for n in names}
        x, y = train_batch(corpus, cfg.run.seed, 0, t, 2, cfg.model.seq_len)
        loss = lm_loss(torch.func.functional_call(model, mixed, (x,)), y)
        grads = torch.autograd.grad(loss, [mixed[n] for n in names])
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        opt.step(lr_at(t, steps, 1.0, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio))
        versions.append({n: p.detach().clone() for n, p in model.named_parameters()})
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(flat_replica(sim, 0), ref)


def test_fullsync_keeps_replicas_identical_and_equals_mean_gradient(text_file):
    cfg = tiny(
        text_file,
        "run.steps=3",
        "grid.stages=2",
        "grid.replicas=2",
        "pipeline.schedule=gpipe",
        "pipeline.microbatches=2",
        "dp.mode=grad_allreduce",
        "dp.codec=fp32",
        "optim.name=adamw",
    )
    sim = GridSim(cfg)
    for _ in range(3):
        sim.step()
    assert torch.equal(flat_replica(sim, 0), flat_replica(sim, 1))
    # reference: one model, gradient = mean over 2 replicas x 2 microbatches
    model = build_model(cfg.model, cfg.run.seed)
    opt = StageOptimizer(list(model.named_parameters()), optim_spec(cfg.optim))
    corpus = load_corpus(str(cfg.data.path), cfg.data.val_fraction, cfg.model.seq_len)
    for t in range(3):
        for r in range(2):
            for k in range(2):
                x, y = train_batch(corpus, cfg.run.seed, r, t * 2 + k, 2, cfg.model.seq_len)
                (lm_loss(model(x), y) / 4).backward()
        opt.step(lr_at(t, 3, 1.0, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio))
        opt.zero_grad()
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(flat_replica(sim, 0), ref, rtol=1e-5, atol=1e-6)


def test_dpavg_blocking_full_average_makes_replicas_equal(text_file):
    cfg = tiny(
        text_file,
        "run.steps=3",
        "grid.stages=2",
        "grid.replicas=2",
        "dp.fraction=1.0",
        "dp.tau=0",
        "dp.correction=replace",
        "dp.codec=fp32",
    )
    sim = GridSim(cfg)
    sim.step()
    assert torch.equal(flat_replica(sim, 0), flat_replica(sim, 1))


def test_rounds_land_exactly_tau_updates_late(text_file):
    tau = 3
    cfg = tiny(
        text_file,
        "run.steps=8",
        "grid.stages=2",
        "grid.replicas=2",
        "dp.fraction=0.25",
        f"dp.tau={tau}",
        "dp.correction=replace",
        "dp.codec=fp32",
    )
    sim = GridSim(cfg)
    sim.step()  # update 0 launches round 0 at the end
    snaps = [sim.cells[i][0].flat.clone() for i in range(2)]
    idx = sparse.subset_indices(0, 0, 0, 0, snaps[0].numel(), 0.25)
    for _ in range(tau - 1):
        sim.step()
        assert not torch.equal(sim.cells[0][0].flat[idx], sim.cells[1][0].flat[idx])
    sim.step()  # update tau: round 0 arrives and replaces the subset by the stale mean
    # round `tau` was launched right after and snapshotted its own (different) subset
    expected = (snaps[0][idx] + snaps[1][idx]) / 2
    for i in range(2):
        torch.testing.assert_close(sim.cells[i][0].flat[idx], expected)


def _framed_payload_bytes(x: torch.Tensor, codec: str, kind: wire.Kind) -> int:
    """What a tensor adds to a real wire frame: the frame's length less an empty frame's."""
    frame = wire.pack("t", kind, codecs.encode(x.reshape(-1), codec), 0)
    empty = wire.pack("t", kind, codecs.encode(torch.zeros(0), codec), 0)
    return len(frame) - len(empty)


def test_bytes_are_counted_exactly(text_file):
    """The simulator's byte counts equal what the real payloads take in real wire frames."""
    cfg = tiny(
        text_file,
        "run.steps=4",
        "grid.stages=2",
        "grid.replicas=2",
        "dp.tau=1",
        "dp.codec=fp8_e4m3",
        "pipeline.codec=bf16",
    )
    sim = GridSim(cfg)
    expected_dp = 0.0
    for _ in range(4):
        sim.step()
        for j in range(2):  # the round just launched (tau = 1: still pending), as framed
            payload = sim.cells[0][j].rounds.entries[-1][0].snapshot
            framed = _framed_payload_bytes(payload, "fp8_e4m3", wire.Kind.AVERAGE)
            expected_dp += 2 * sparse.ring_allreduce_bytes(framed, 2)  # m replicas send
    act = torch.randn(cfg.pipeline.microbatch_size, cfg.model.seq_len, cfg.model.d_model)
    framed_act = _framed_payload_bytes(act, "bf16", wire.Kind.ACTIVATION)
    assert sim.pp_bytes == 2 * 4 * 2 * framed_act  # m x steps x (activation + its gradient)
    assert sim.dp_bytes == pytest.approx(expected_dp)


def test_asyncmesh_fp8_moves_far_fewer_bytes_than_fullsync(text_file):
    am = GridSim(tiny(text_file, "run.steps=2", "grid.stages=2", "grid.replicas=2"))
    fs = GridSim(
        tiny(
            text_file,
            "run.steps=2",
            "grid.stages=2",
            "grid.replicas=2",
            "pipeline.schedule=gpipe",
            "dp.mode=grad_allreduce",
            "dp.codec=fp32",
        )
    )
    for _ in range(2):
        am.step()
        fs.step()
    assert fs.dp_bytes / am.dp_bytes > 64


def test_nan_loss_stops_the_run_as_diverged(text_file):
    cfg = tiny(
        text_file,
        "run.steps=5",
        "grid.stages=2",
        "grid.replicas=2",
        "optim.lr=1e30",
        "optim.grad_clip=0",
    )
    result = GridSim(cfg).run()
    assert result.diverged and result.val_loss is None and result.steps < 5


@pytest.mark.parametrize("feedback", [False, True])
def test_asyncmesh_ema_path_equals_a_hand_rolled_two_replica_reference(text_file, feedback):
    """The EMA drift correction as the paper writes it, by hand: a round launched after update u
    snapshots the raw fp32 subset, every replica averages the decoded fp8 payloads (its own
    included), and tau updates later lambda is taken at that arrival step and d is read and
    written on the round's subset only. With dp.payload_error_feedback (the default) each
    replica applies the mean relative to its own decoded payload: mean + snapshot - own."""
    steps, tau, frac = 9, 2, 0.25
    cfg = tiny(
        text_file,
        f"run.steps={steps}",
        "grid.stages=1",
        "grid.replicas=2",
        "optim.name=adamw",
        f"dp.tau={tau}",
        f"dp.fraction={frac}",
        "dp.codec=fp8_e4m3",
        "dp.correction=ema",
        "dp.lambda_initial=0.5",
        "dp.lambda_final=0.05",
        "dp.lambda_hold_steps=3",
        f"dp.payload_error_feedback={str(feedback).lower()}",
    )
    sim = GridSim(cfg)
    for _ in range(steps):
        sim.step()

    dp, o = cfg.dp, cfg.optim
    corpus = load_corpus(str(cfg.data.path), cfg.data.val_fraction, cfg.model.seq_len)
    models = [build_model(cfg.model, cfg.run.seed) for _ in range(2)]
    opts = [StageOptimizer(list(m.named_parameters()), optim_spec(o)) for m in models]
    flats = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
    drift = [torch.zeros_like(f) for f in flats]
    in_flight = []  # (lands after update, indices, raw snapshots, mean of decoded payloads)
    for u in range(steps):
        for i, (model, opt) in enumerate(zip(models, opts, strict=True)):
            x, y = train_batch(corpus, cfg.run.seed, i, u, 2, cfg.model.seq_len)
            lm_loss(model(x), y).backward()
            opt.step(lr_at(u, steps, 1.0, o.warmup_steps, o.min_lr_ratio))
            opt.zero_grad()
        live = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
        for _, idx, snaps, owns, mean in [r for r in in_flight if r[0] == u]:
            t = u + 1  # the arrival step (updates applied): hold 0.5 for 3, cosine to 0.05
            cos = math.cos(math.pi * (t - 3) / (steps - 3))
            lam = 0.5 if t < 3 else 0.05 + 0.45 * 0.5 * (1 + cos)
            for i in range(2):
                d = (1 - lam) * drift[i][idx] + lam * (live[i][idx] - snaps[i])
                drift[i][idx] = d
                applied = mean + snaps[i] - owns[i] if feedback else mean
                live[i][idx] = applied + d
        idx = sparse.subset_indices(cfg.run.seed, 0, 0, u, live[0].numel(), frac)
        snaps = [live[i][idx].clone() for i in range(2)]
        owns = [codecs.roundtrip(s, "fp8_e4m3", dp.block_size) for s in snaps]
        in_flight.append((u + tau, idx, snaps, owns, sum(owns) / 2))
        for model, flat in zip(models, live, strict=True):
            torch.nn.utils.vector_to_parameters(flat, model.parameters())
    for i in range(2):
        torch.testing.assert_close(flat_replica(sim, i), live[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sim.cells[i][0].drift, drift[i], rtol=1e-5, atol=1e-6)


def test_clip_rate_counts_the_updates_whose_norm_was_clipped(text_file):
    always = GridSim(tiny(text_file, "run.steps=3", "optim.grad_clip=1e-9")).run()
    never = GridSim(tiny(text_file, "run.steps=3", "optim.grad_clip=0")).run()
    assert always.clip_rate == 1.0
    assert never.clip_rate == 0.0


def test_fp8_noise_moves_an_fp32_run_by_about_what_fp8_payloads_do(text_file):
    """dp.noise_codec adds fp8's error on a shuffled mean: the replicas end elsewhere than a
    clean fp32 run, and by the order of the change real fp8 payloads make."""
    ov = ["run.steps=6", "grid.stages=2", "grid.replicas=2", "dp.tau=1", "dp.fraction=0.5"]
    runs = {}
    for name, extra in {
        "fp32": ["dp.codec=fp32"],
        "noise": ["dp.codec=fp32", "dp.noise_codec=fp8_e4m3"],
        "fp8": ["dp.codec=fp8_e4m3"],
    }.items():
        sim = GridSim(tiny(text_file, *ov, *extra))
        sim.run()
        runs[name] = flat_replica(sim, 0)
    moved_by_noise = (runs["noise"] - runs["fp32"]).norm().item()
    moved_by_fp8 = (runs["fp8"] - runs["fp32"]).norm().item()
    assert moved_by_noise > 0 and moved_by_fp8 > 0
    assert 0.1 < moved_by_noise / moved_by_fp8 < 10


def test_payload_error_feedback_changes_no_number_with_fp32_payloads(text_file):
    """A lossless codec's own decoded payload is its snapshot: the feedback adds exactly zero,
    which is why the fingerprint leaves the key out for dp.codec = fp32 (such runs are reused)."""
    runs = {}
    for feedback in ("false", "true"):
        cfg = tiny(
            text_file,
            "run.steps=8",
            "grid.stages=2",
            "grid.replicas=2",
            "dp.tau=2",
            "dp.fraction=0.25",
            "dp.codec=fp32",
            f"dp.payload_error_feedback={feedback}",
        )
        sim = GridSim(cfg)
        for _ in range(8):
            sim.step()
        runs[feedback] = (cfg.fingerprint(), flat_replica(sim, 0), flat_replica(sim, 1))
    assert runs["false"][0] == runs["true"][0]
    for a, b in zip(runs["false"][1:], runs["true"][1:], strict=True):
        assert torch.equal(a, b)
