"""A llama from the documented commands: train it as cell processes in bf16, export it, sample."""

import json

from click.testing import CliRunner

from cli.main import main
from mesh.runtime.evaluate import read_val

TINY_LLAMA = [
    "model.arch=llama",
    "model.n_layers=2",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.seq_len=16",
    "data.val_batches=2",
    "runtime.precision=bf16",
    "optim.warmup_steps=2",
]


def test_train_export_generate_a_llama_with_cell_processes(text_file, tmp_path):
    run = tmp_path / "run"
    sets = [a for s in [*TINY_LLAMA, f"data.path='{text_file}'"] for a in ("--set", s)]
    args = ["simulate", "--backend", "torch", "--grid", "2x2", "--steps", "4", "--out", str(run)]
    res = CliRunner().invoke(main, [*args, *sets])
    assert res.exit_code == 0, res.output
    # it trained: 4 updates after a 2-step warmup take ~0.03 off the untrained model's loss
    # (the run's first validation, ~ln 256 = 5.55); with no update it would not move at all
    untrained = [r["val_loss"] for r in read_val(run) if r["step"] == 0]
    trained = json.loads((run / "summary.json").read_text())["val_loss"]
    assert untrained and trained < min(untrained) - 0.01, (trained, untrained)
    res = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "hf" / "meshtrain.json").read_text())["step"] == 4
    res = CliRunner().invoke(
        main, ["generate", str(tmp_path / "hf"), "--prompt", "To be", "--max-new-tokens", "8"]
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("To be")
