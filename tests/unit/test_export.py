"""`meshtrain export`: a run's checkpoints as a directory the real `transformers` loads."""

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import TINY

from cli.main import main
from mesh.config import load_config
from mesh.engine.sim import GridSim
from mesh.model.hf import hf_name, meshtrain_name
from mesh.runtime.checkpoint import cell_dir, checkpoint_path, save_cell
from mesh.runtime.export import load_export

TINY_LLAMA = [
    "model.arch='llama'", "model.n_layers=4", "model.d_model=32", "model.n_heads=4",
    "model.n_kv_heads=2", "model.intermediate_size=48", "model.seq_len=16",
]  # fmt: skip


def llama_run(tmp_path, text_file, model=TINY_LLAMA):
    """A 2x1 llama grid trained 3 updates in the simulator, its cells saved as a run would."""
    cfg = load_config(
        [], [*TINY, *model, "grid.stages=2", "grid.replicas=1", "run.steps=3",
             f"data.path='{text_file}'"],
    )  # fmt: skip
    sim = GridSim(cfg)
    for _ in range(3):
        sim.step()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(cfg.to_toml())
    for cell in sim.cells[0]:
        save_cell(cell, cfg.state_fingerprint(), run)
    return run, sim


def test_export_loads_in_transformers_with_the_same_logits(tmp_path, text_file):
    from transformers import AutoModelForCausalLM

    run, sim = llama_run(tmp_path, text_file)
    res = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    assert "model.safetensors" in res.output and "config.json" in res.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    x = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(x).logits
        ours = x
        for cell in sim.cells[0]:  # meshtrain's forward: the trained stages composed
            ours = cell.module(ours)
    assert theirs.shape == ours.shape == (3, 16, 256)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    # and our own loader of an export gives the same model back
    _, whole = load_export(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(whole(x), ours, atol=1e-6, rtol=0)
    meta = json.loads((tmp_path / "hf" / "meshtrain.json").read_text())
    assert (meta["step"], meta["replica"]) == (3, 0)


def test_hf_names_round_trip():
    for name in ["tok_emb.weight", "blocks.11.attn.k_proj.weight", "blocks.0.mlp_norm.weight",
                 "blocks.3.mlp.gate_proj.weight", "norm.weight", "head.weight"]:  # fmt: skip
        assert meshtrain_name(hf_name(name)) == name
    assert hf_name("blocks.2.attn_norm.weight") == "model.layers.2.input_layernorm.weight"
    with pytest.raises(KeyError):
        hf_name("blocks.0.attn.qkv.weight")


def _export(run, out):
    return CliRunner().invoke(main, ["export", str(run), "--out", str(out)])


def test_export_refuses_a_missing_stage(tmp_path, text_file):
    run, _ = llama_run(tmp_path, text_file)
    for f in cell_dir(run, 1, 0).iterdir():
        f.unlink()
    res = _export(run, tmp_path / "hf")
    assert res.exit_code == 2
    assert "stage 1 of replica 0 has no checkpoint" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "hf").exists()


def test_export_refuses_stages_without_a_common_step(tmp_path, text_file):
    run, _ = llama_run(tmp_path, text_file)
    path = checkpoint_path(run, 1, 0, 3)
    path.rename(path.with_name("step-00000002.pt"))  # stage 1 says it is at another step
    res = _export(run, tmp_path / "hf")
    assert res.exit_code == 2
    assert "share no intact checkpoint step" in res.output


def test_export_refuses_a_gpt_run_and_a_missing_replica(tmp_path, text_file):
    run, _ = llama_run(tmp_path, text_file)
    res = CliRunner().invoke(
        main, ["export", str(run), "--out", str(tmp_path / "x"), "--replica", "1"]
    )
    assert res.exit_code == 2 and "--replica 1" in res.output
    (run / "config.toml").write_text(load_config([], [*TINY, "grid.stages=2"]).to_toml())  # GPT
    res = _export(run, tmp_path / "hf")
    assert res.exit_code == 2 and "model.arch = 'gpt'" in res.output
    res = _export(tmp_path, tmp_path / "hf")
    assert res.exit_code == 2 and "not a run directory" in res.output


def _generate(source, *extra):
    args = ["generate", str(source), "--prompt", "ROMEO:", "--max-new-tokens", "12", *extra]
    return CliRunner().invoke(main, args)


def test_generate_from_a_run_and_from_its_export_agree(tmp_path, text_file):
    run, _ = llama_run(tmp_path, text_file)
    assert _export(run, tmp_path / "hf").exit_code == 0
    from_run = _generate(run, "--temperature", "0")
    from_export = _generate(tmp_path / "hf", "--temperature", "0")
    assert from_run.exit_code == 0, from_run.output
    assert from_run.stdout == from_export.stdout
    assert from_run.stdout.startswith("ROMEO:") and len(from_run.stdout) > len("ROMEO:")
    sampled = _generate(run, "--temperature", "1.0", "--top-k", "5", "--seed", "1")
    assert (
        sampled.exit_code == 0
        and sampled.stdout
        == _generate(run, "--temperature", "1.0", "--top-k", "5", "--seed", "1").stdout
    )


def test_generate_from_a_gpt_run_and_its_mistakes(tmp_path, text_file):
    run, _ = llama_run(tmp_path, text_file, model=["grid.stages=2"])  # the tiny GPT
    res = _generate(run, "--temperature", "0")
    assert res.exit_code == 0 and res.stdout.startswith("ROMEO:")
    assert _generate(run, "--top-k", "0").exit_code == 2
    res = _generate(tmp_path / "run" / "checkpoints")
    assert res.exit_code == 2 and "neither a run directory" in res.output


def test_export_of_a_run_on_a_prepared_bpe_dataset_carries_its_tokenizer(tmp_path):
    """The end-to-end path of the two issues: a BPE dataset, a llama trained on it (vocab from
    the manifest), exported with the tokenizer files that transformers loads, and sampled."""
    from transformers import AutoTokenizer

    from mesh.bench.join_procs import generated_text
    from mesh.data.prepare import prepare

    src = tmp_path / "src.jsonl"
    src.write_text(
        "".join(json.dumps({"text": generated_text(2000, seed=i)}) + "\n" for i in range(20))
    )
    prepare([str(src)], tmp_path / "ds", "bpe:320")
    run, _ = llama_run(tmp_path, tmp_path / "ds")
    cfg = load_config([run / "config.toml"])
    assert (
        cfg.model.vocab_size
        == json.loads((tmp_path / "ds" / "manifest.json").read_text())["vocab_size"]
    )
    assert _export(run, tmp_path / "hf").exit_code == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == cfg.model.vocab_size
    assert config["eos_token_id"] == hf_tok.eos_token_id is not None
    res = _generate(tmp_path / "hf", "--temperature", "0")
    assert res.exit_code == 0 and res.stdout.startswith("ROMEO:")
