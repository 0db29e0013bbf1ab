"""runtime.precision = bf16: autocast compute, fp32 masters, the same training outcome."""

import pytest
import torch
from helpers import TINY

from mesh.config import load_config
from mesh.engine.sim import GridSim
from mesh.model.build import build_model, stage_forward

TINY_LLAMA = [
    "model.arch='llama'",
    "model.n_layers=4",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.seq_len=32",
]


@pytest.mark.slow
def test_bf16_run_of_the_tiny_llama_ends_within_3_percent_of_fp32(text_file):
    losses, sims = {}, {}
    for precision in ("fp32", "bf16"):
        cfg = load_config(
            [],
            [
                *TINY,
                *TINY_LLAMA,
                "grid.stages=2",
                "grid.replicas=2",
                "run.steps=60",
                "run.eval_every=1000",
                "pipeline.microbatch_size=4",
                f"data.path='{text_file}'",
                f"runtime.precision='{precision}'",
            ],
        )
        sims[precision] = GridSim(cfg)
        losses[precision] = sims[precision].run().val_loss
    assert losses["fp32"] < 0.85 * torch.log(torch.tensor(256.0)).item()  # it learned
    assert abs(losses["bf16"] - losses["fp32"]) <= 0.03 * losses["fp32"], losses
    cell = sims["bf16"].cells[0][0]  # masters, optimizer state and drift stay fp32
    assert cell.flat.dtype == cell.drift.dtype == torch.float32
    assert all(
        t.dtype == torch.float32
        for t in cell.optimizer.state_dict().values()
        if isinstance(t, torch.Tensor)
    )
    assert not torch.equal(sims["bf16"].cells[0][0].flat, sims["fp32"].cells[0][0].flat)


def test_bf16_stage_forward_computes_in_bf16_and_hands_fp32_on():
    cfg = load_config([], [*TINY_LLAMA, "grid.stages=1"]).model
    model = build_model(cfg, seed=0)
    params = dict(model.named_parameters())
    x = torch.randint(0, 256, (2, 16))
    seen = []
    hook = model.blocks["0"].mlp.down_proj.register_forward_hook(
        lambda m, i, o: seen.append(o.dtype)
    )
    fp32 = stage_forward(model, params, x, "fp32")
    bf16 = stage_forward(model, params, x, "bf16")
    hook.remove()
    assert seen == [torch.float32, torch.bfloat16]
    assert fp32.dtype == bf16.dtype == torch.float32
    assert 0 < (fp32 - bf16).abs().max() < 0.05
    bf16.sum().backward()  # gradients reach the fp32 masters in fp32
    assert params["blocks.0.attn.q_proj.weight"].grad.dtype == torch.float32
