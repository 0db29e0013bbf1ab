import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mesh.algo.muon import is_hidden_matrix
from mesh.algo.optim import OptimSpec, StageOptimizer
from mesh.algo.topology import partition_layers
from mesh.config import ModelConfig, load_config
from mesh.model.build import (
    build_model,
    build_stage,
    build_stages,
    lm_loss,
    param_seed,
    split_model,
    stage_param_counts,
)

ROOT = Path(__file__).resolve().parents[2]
GPT = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16)
LLAMA = ModelConfig(
    arch="llama",
    n_layers=4,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    intermediate_size=48,
    seq_len=16,
)


@pytest.mark.parametrize(("n_layers", "n_stages"), [(8, 1), (8, 3), (8, 8), (5, 2), (7, 4)])
def test_partition_is_balanced_and_complete(n_layers, n_stages):
    parts = partition_layers(n_layers, n_stages)
    assert [i for p in parts for i in p] == list(range(n_layers))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_partition_rejects_more_stages_than_layers():
    with pytest.raises(ValueError):
        partition_layers(3, 4)


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("n_stages", [2, 3, 4])
def test_composed_stages_match_whole_model(cfg, n_stages):
    whole = build_model(cfg, seed=3)
    stages = split_model(whole, cfg, n_stages)
    assert stages[0].first and stages[-1].last
    assert not any(s.first for s in stages[1:]) and not any(s.last for s in stages[:-1])
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    ref = lm_loss(whole(x), y)
    ref.backward()
    h = x
    for s in stages:
        h = s(h)
    loss = lm_loss(h, y)
    loss.backward()
    torch.testing.assert_close(loss, ref)
    whole_grads = {n: p.grad for n, p in whole.named_parameters()}
    seen = set()
    for s in stages:
        for n, p in s.named_parameters():
            torch.testing.assert_close(p.grad, whole_grads[n])
            seen.add(n)
    assert seen == set(whole_grads)


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("n_stages", [2, 4])
def test_stage_built_alone_equals_the_whole_models_layers_bit_for_bit(cfg, n_stages):
    whole = dict(build_model(cfg, seed=5).named_parameters())
    for j in range(n_stages):
        stage = build_stage(cfg, n_stages, j, seed=5)
        for name, p in stage.named_parameters():
            assert p.device.type == "cpu" and p.dtype == torch.float32
            assert torch.equal(p, whole[name]), name


def test_init_is_seeded_by_run_seed_and_global_name():
    assert param_seed(0, "blocks.1.attn.q_proj.weight") != param_seed(
        0, "blocks.2.attn.q_proj.weight"
    )
    assert param_seed(0, "head.weight") != param_seed(1, "head.weight")
    a, b = build_stages(LLAMA, 2, seed=7), build_stages(LLAMA, 2, seed=7)
    c = build_stages(LLAMA, 2, seed=8)
    for sa, sb, sc in zip(a, b, c, strict=True):
        for (na, pa), (_, pb), (_, pc) in zip(
            sa.named_parameters(), sb.named_parameters(), sc.named_parameters(), strict=True
        ):
            assert torch.equal(pa, pb), na
            if pa.ndim == 2:
                assert not torch.equal(pa, pc)
                assert 0.004 < pa.std().item() < 0.03, na  # N(0, 0.02), projections scaled


def test_building_does_not_disturb_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model(LLAMA, seed=1)
    build_model(GPT, seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_llama_names_split_between_muon_and_adamw():
    stage = build_model(LLAMA, seed=0)
    named = dict(stage.named_parameters())
    hidden = {n for n, p in named.items() if is_hidden_matrix(n, p)}
    assert hidden == {
        f"blocks.{i}.{m}.{w}_proj.weight"
        for i in range(4)
        for m, ws in (("attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for w in ws
    }
    kinds = StageOptimizer(list(named.items()), OptimSpec(name="muon", lr=1e-3)).kinds()
    assert kinds["tok_emb.weight"] == kinds["head.weight"] == kinds["norm.weight"] == "adamw"
    assert kinds["blocks.0.attn_norm.weight"] == "adamw"
    assert kinds["blocks.3.mlp.down_proj.weight"] == "muon"


def test_llama_grouped_query_shapes():
    named = dict(build_model(LLAMA, seed=0).named_parameters())
    assert named["blocks.0.attn.q_proj.weight"].shape == (32, 32)
    assert named["blocks.0.attn.k_proj.weight"].shape == (16, 32)  # 2 kv heads of width 8
    assert named["blocks.0.mlp.gate_proj.weight"].shape == (48, 32)
    assert "tok_emb.weight" in named and "head.weight" in named  # untied


@pytest.mark.parametrize(
    ("preset", "millions"),
    [("tiny", 0.43), ("llama-20m", 18.9), ("llama-160m", 162.1), ("llama-1b", 1166.7)],
)
def test_presets_have_their_size(preset, millions):
    cfg = load_config([f"configs/models/{preset}.toml"])
    counts = stage_param_counts(cfg.model, cfg.grid.stages)
    assert len(counts) == cfg.grid.stages
    assert sum(counts) / 1e6 == pytest.approx(millions, abs=0.05)


def test_tiny_preset_is_the_default_model():
    assert load_config(["configs/models/tiny.toml"]).model == ModelConfig()


# VmHWM, not getrusage's ru_maxrss: the latter keeps the forking parent's RSS across exec, so
# inside a long pytest process it reported the test runner's own peak (2.3 GB for 1.3 GB)
_PEAK_RSS = """
from pathlib import Path
from mesh.config import load_config
from mesh.model.build import build_stage
cfg = load_config(["configs/models/llama-1b.toml"])
stage = build_stage(cfg.model, 4, 1, 0)
n = sum(p.numel() for p in stage.parameters())
status = dict(ln.split(":", 1) for ln in Path("/proc/self/status").read_text().splitlines())
print(n, int(status["VmHWM"].split()[0]) * 1024)  # kB
"""


@pytest.mark.slow
def test_llama_1b_stage_1_of_4_is_built_alone():
    """A peer of stage 1 never holds the other stages: its peak RSS (torch included) stays
    below 1.5 x its own fp32 parameter bytes + 500 MB (the whole model would be 4.7 GB)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    numel, peak_bytes = map(int, proc.stdout.split())
    assert numel == 254_822_400  # 4 of 16 blocks of d 2304
    assert peak_bytes < 1.5 * 4 * numel + 500e6, peak_bytes / 1e6
