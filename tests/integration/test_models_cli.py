"""A llama from the documented commands: train it as cell processes in bf16, export it, sample."""

import json

from click.testing import CliRunner

from cli.main import main

TINY_LLAMA = [
    "model.arch=llama", "model.n_layers=2", "model.d_model=16", "model.n_heads=2",
    "model.n_kv_heads=1", "model.seq_len=16", "data.val_batches=2", "runtime.precision=bf16",
]  # fmt: skip


def test_train_export_generate_a_llama_with_cell_processes(text_file, tmp_path):
    run = tmp_path / "run"
    sets = [a for s in [*TINY_LLAMA, f"data.path='{text_file}'"] for a in ("--set", s)]
    args = ["simulate", "--backend", "torch", "--grid", "2x2", "--steps", "4", "--out", str(run)]
    res = CliRunner().invoke(main, [*args, *sets])
    assert res.exit_code == 0, res.output
    assert json.loads((run / "summary.json").read_text())["val_loss"] < 6.0
    res = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "hf" / "meshtrain.json").read_text())["step"] == 4
    res = CliRunner().invoke(
        main, ["generate", str(tmp_path / "hf"), "--prompt", "To be", "--max-new-tokens", "8"]
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("To be")
