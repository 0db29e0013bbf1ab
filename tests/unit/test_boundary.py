"""Compressed stage boundaries (pipeline.boundary): the math, the stage ends, a run that learns."""

import math
from collections import Counter

import helpers
import pytest
import torch

from comms import codecs
from mesh.algo import boundary as bmath
from mesh.config import load_config, with_overrides
from mesh.engine.plan import boundary_bytes, compression_vs_bf16, rank_for_compression
from mesh.engine.sim import GridSim
from mesh.model.boundary import constrain_
from mesh.model.build import build_cell_stages, build_model, run_stages

LLAMA = [
    *helpers.TINY,
    "model.arch=llama",
    "model.n_layers=4",
    "pipeline.schedule=async",
    "pipeline.codec=fp8_e4m3",
]


def llama(text_file, *extra):
    return load_config([], [*LLAMA, f"data.path='{text_file}'", *extra])


# ---- the pure math ------------------------------------------------------------------------


def test_basis_is_orthonormal_and_the_same_for_a_key():
    u = bmath.initial_basis(7, "boundary0", 64, 8)
    assert u.shape == (64, 8)
    assert bmath.orthonormality_error(u) < 1e-6
    assert torch.equal(u, bmath.initial_basis(7, "boundary0", 64, 8))
    assert not torch.equal(u, bmath.initial_basis(7, "boundary1", 64, 8))
    # a point maps to itself
    torch.testing.assert_close(bmath.retract(u.double()), u.double(), rtol=0, atol=1e-6)


def test_projection_stays_orthonormal_under_its_update_rule():
    """Riemannian gradient (tangent projection) then QR retraction, 200 large steps: still on
    the manifold to float precision, and the steps moved it (a no-op rule would pass too)."""
    gen = torch.Generator().manual_seed(0)
    u0 = bmath.initial_basis(0, "b", 32, 6)
    u = u0.clone()
    for _ in range(200):
        g = torch.randn(32, 6, generator=gen)
        step = bmath.tangent(u, g)
        ug = u.T @ step  # a tangent vector: u^T step is skew-symmetric
        assert (ug + ug.T).abs().max() < 1e-4
        u = bmath.retract(u - 0.1 * step)
    assert bmath.orthonormality_error(u) < 1e-5
    assert (u - u0).abs().max() > 0.1


@pytest.mark.parametrize("anchored", [False, True])
def test_encode_decode_is_exact_inside_the_subspace(anchored):
    gen = torch.Generator().manual_seed(1)
    u = bmath.initial_basis(3, "b", 48, 12)
    c = torch.randn(2, 5, 12, generator=gen)
    anchor = torch.randn(2, 5, 48, generator=gen) if anchored else None
    h = bmath.decode(c, u, anchor)
    torch.testing.assert_close(bmath.encode(h, u, anchor), c, rtol=0, atol=1e-5)
    torch.testing.assert_close(bmath.decode(bmath.encode(h, u, anchor), u, anchor), h)
    # outside the subspace the rebuild loses exactly the orthogonal part
    off = torch.randn(2, 5, 48, generator=gen)
    off_perp = off - (off @ u) @ u.T
    back = bmath.decode(bmath.encode(h + off_perp, u, anchor), u, anchor)
    torch.testing.assert_close(back, h, rtol=0, atol=1e-5)


@pytest.mark.parametrize("codec", ["bf16", "fp8_e4m3", "fp32"])
@pytest.mark.parametrize(("method", "rank"), [("full", 0), ("subspace", 8), ("learned", 20)])
def test_bytes_per_boundary_are_the_formula(codec, method, rank):
    d, tokens = 64, 3 * 17
    w = d if method == "full" else rank
    expected = tokens * w * {"bf16": 2, "fp8_e4m3": 1, "fp32": 4}[codec]
    if codec == "fp8_e4m3":  # one fp32 scale per block of 128 values
        expected += 4 * math.ceil(tokens * w / 128)
    assert boundary_bytes(tokens, d, method, rank, codec) == expected
    # and that is what the codec puts on the wire for the (B, T, width) payload
    x = torch.randn(bmath.payload_shape(3, 17, d, method, rank))
    assert codecs.encode(x, codec).nbytes == expected


def test_rank_for_compression_meets_the_ratio():
    tokens, d = 8 * 1024, 2304
    for ratio in (4, 8, 16, 32, 64):
        r = rank_for_compression(tokens, d, ratio, "fp8_e4m3")
        assert compression_vs_bf16(tokens, d, "learned", r, "fp8_e4m3") >= ratio
        assert compression_vs_bf16(tokens, d, "learned", r + 1, "fp8_e4m3") < ratio
    assert rank_for_compression(tokens, d, 16, "bf16") == d // 16


# ---- the stage ends -----------------------------------------------------------------------


def test_subspace_stages_compose_to_the_plain_llama(text_file):
    """The fixed subspace's rebuild is exact: P = 2 stages with constrained weights (after
    random perturbation and re-projection) give the logits of the one-stage Llama holding the
    same weights, though only `rank` of d_model values per token cross the boundary."""
    cfg = llama(
        text_file, "grid.stages=2", "pipeline.boundary=subspace", "pipeline.boundary_rank=4"
    )
    stages = build_cell_stages(cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for mod in stages:
            for p in mod.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
            constrain_(mod)
    whole = build_model(cfg.model, cfg.run.seed)
    weights = {k: v for mod in stages for k, v in mod.state_dict().items()}
    whole.load_state_dict(weights, strict=True)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=gen)
    with torch.no_grad():
        mid = stages[0](tokens)
        assert mid.shape == (2, cfg.model.seq_len, 4)
        torch.testing.assert_close(run_stages(stages, tokens), whole(tokens), rtol=1e-4, atol=1e-4)
    # without the constraint the rebuild is not exact (the test can fail)
    with torch.no_grad():
        stages[0].blocks["0"].mlp.down_proj.weight.add_(0.1)
        assert not torch.allclose(run_stages(stages, tokens), whole(tokens), atol=1e-3)


def test_learned_ends_start_equal_and_the_encoder_stays_orthonormal(text_file):
    cfg = llama(
        text_file,
        "grid.stages=3",
        "grid.replicas=1",
        "run.steps=8",
        "pipeline.boundary=learned",
        "pipeline.boundary_rank=4",
        "pipeline.anchor_rank=4",
    )
    s0, s1, _ = build_cell_stages(cfg)
    torch.testing.assert_close(s0.boundary["enc0"].basis, s1.boundary["dec0"].basis)
    assert set(s1.boundary) == {"dec0", "enc1"}
    sim = GridSim(cfg)
    start = sim.cells[0][0].module.boundary["enc0"].basis.detach().clone()
    for _ in range(cfg.run.steps):
        sim.step()
    for cell in sim.cells[0][:2]:
        for end in cell.module.boundary.values():
            if end.encoder:
                assert bmath.orthonormality_error(end.basis.detach()) < 1e-5
    moved = sim.cells[0][0].module.boundary["enc0"].basis.detach() - start
    assert moved.abs().max() > 0  # trained, not frozen


def test_defaults_keep_the_fingerprint(text_file):
    cfg = llama(text_file)
    assert cfg.pipeline.boundary == "full"
    # the ranks mean nothing for a full boundary: same run, same hash
    same = with_overrides(cfg, {"pipeline.boundary_rank": 3, "pipeline.anchor_rank": 2})
    assert same.fingerprint() == cfg.fingerprint()
    other = with_overrides(cfg, {"pipeline.boundary": "subspace", "pipeline.boundary_rank": 3})
    assert other.fingerprint() != cfg.fingerprint()
    # the subspace has no anchors
    sub = with_overrides(other, {"pipeline.anchor_rank": 2})
    assert sub.fingerprint() == other.fingerprint()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.arch=gpt", "pipeline.boundary=learned"], "model.arch"),
        (["pipeline.boundary=learned", "pipeline.boundary_rank=99"], "pipeline.boundary_rank"),
    ],
)
def test_unusable_boundary_settings_name_the_key(text_file, overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        llama(text_file, *overrides)


# ---- a run that learns --------------------------------------------------------------------


def unigram_entropy_nats(tokens) -> float:
    counts = Counter(int(t) for part in tokens.parts for t in part)
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["learned", "subspace"])
def test_a_compressed_run_learns_below_the_unigram_entropy(text_file, method):
    """4 of 32 values per token cross each of 3 boundaries (8x fewer bytes than full fp8):
    the validation loss still falls well below the data's unigram entropy, which a model
    that ignores context (or cannot rebuild its input) cannot beat."""
    cfg = llama(
        text_file,
        "model.d_model=32",
        "model.n_heads=4",
        "grid.stages=4",
        "grid.replicas=1",
        "run.steps=150",
        "optim.lr=0.01",
        "pipeline.microbatch_size=8",
        f"pipeline.boundary={method}",
        "pipeline.boundary_rank=4",
        "pipeline.anchor_rank=4",
    )
    sim = GridSim(cfg)
    h1 = unigram_entropy_nats(sim.corpus.val)
    result = sim.run()
    assert result.val_loss < h1 - 0.3, (result.val_loss, h1)
