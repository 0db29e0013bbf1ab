import pytest
import torch

from mesh.algo.topology import partition_layers
from mesh.config import ModelConfig
from mesh.model.gpt import build_model, build_stages, lm_loss, split_model


@pytest.mark.parametrize(("n_layers", "n_stages"), [(8, 1), (8, 3), (8, 8), (5, 2), (7, 4)])
def test_partition_is_balanced_and_complete(n_layers, n_stages):
    parts = partition_layers(n_layers, n_stages)
    assert [i for p in parts for i in p] == list(range(n_layers))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_partition_rejects_more_stages_than_layers():
    with pytest.raises(ValueError):
        partition_layers(3, 4)


@pytest.mark.parametrize("n_stages", [2, 3, 4])
def test_composed_stages_match_whole_model(n_stages):
    cfg = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16)
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


def test_same_seed_same_weights_on_every_peer():
    cfg = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16)
    a, b = build_stages(cfg, 2, seed=7), build_stages(cfg, 2, seed=7)
    c = build_stages(cfg, 2, seed=8)
    for sa, sb, sc in zip(a, b, c, strict=True):
        for (na, pa), (_, pb), (_, pc) in zip(
            sa.named_parameters(), sb.named_parameters(), sc.named_parameters(), strict=True
        ):
            assert torch.equal(pa, pb), na
            if pa.ndim == 2:
                assert not torch.equal(pa, pc)


def test_building_does_not_disturb_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model(ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8), seed=1)
    assert torch.equal(torch.rand(3), expected)
