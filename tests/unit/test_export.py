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
    "model.arch='llama'",
    "model.n_layers=4",
    "model.d_model=32",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.intermediate_size=48",
    "model.seq_len=16",
]


def llama_run(tmp_path, text_file, model=TINY_LLAMA, extra=()):
    """A 2x1 llama grid trained 3 updates in the simulator, its cells saved as a run would."""
    cfg = load_config(
        [],
        [
            *TINY,
            *model,
            "grid.stages=2",
            "grid.replicas=1",
            "run.steps=3",
            f"data.path='{text_file}'",
            *extra,
        ],
    )
    sim = GridSim(cfg)
    for _ in range(3):
        sim.step()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(cfg.to_toml())
    for cell in sim.cells[0]:
        save_cell(cell, cfg.state_fingerprint(), run)
    return run, sim


@pytest.mark.slow
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
    for name in [
        "tok_emb.weight",
        "blocks.11.attn.k_proj.weight",
        "blocks.0.mlp_norm.weight",
        "blocks.3.mlp.gate_proj.weight",
        "norm.weight",
        "head.weight",
    ]:
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


def test_a_subspace_boundary_run_exports_as_a_plain_llama(tmp_path, text_file):
    """The fixed subspace's stages compose to a plain Llama: transformers' logits are the
    pipeline's, rebuilt from 4 of 32 values a token at the boundary."""
    from transformers import AutoModelForCausalLM

    extra = ["pipeline.boundary=subspace", "pipeline.boundary_rank=4"]
    run, sim = llama_run(tmp_path, text_file, extra=extra)
    res = _export(run, tmp_path / "hf")
    assert res.exit_code == 0, res.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mid = sim.cells[0][0].module(x)
        ours = sim.cells[0][1].module(mid, tokens=x)
        theirs = model(x).logits
    assert mid.shape == (3, 16, 4)  # what crossed the boundary
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


def test_a_learned_boundary_run_is_refused_with_the_way_out(tmp_path, text_file):
    extra = ["pipeline.boundary=learned", "pipeline.boundary_rank=4"]
    run, _ = llama_run(tmp_path, text_file, extra=extra)
    res = _export(run, tmp_path / "hf")
    assert res.exit_code == 2, res.output
    assert "pipeline.boundary = 'learned'" in res.output and "'subspace'" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "hf").exists()


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

    from mesh.data.prepare import prepare
    from mesh.testing.local_peers import generated_text

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


def _meshtrain_logits(sim, x):
    with torch.no_grad():
        for cell in sim.cells[0]:  # meshtrain's forward: the trained stages composed
            x = cell.module(x)
    return x


def test_a_sharded_export_loads_in_transformers_with_the_same_logits(tmp_path, text_file):
    """Past --max-shard-size the weights are shards with transformers' index: tensors larger
    than a shard alone in one, a shard that begins in stage 0 and ends in stage 1."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    run, sim = llama_run(tmp_path, text_file)
    out = tmp_path / "hf"
    args = ["export", str(run), "--out", str(out), "--max-shard-size", "20KB"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    shards = [f"model-{k:05d}-of-00009.safetensors" for k in range(1, 10)]
    assert sorted(p.name for p in out.glob("model*")) == [*shards, "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    names = {hf_name(n) for stage in sim.cells[0] for n, _ in stage.module.named_parameters()}
    assert set(index["weight_map"]) == names and set(index["weight_map"].values()) == set(shards)
    held, total = {}, 0
    for shard in shards:
        with safe_open(out / shard, "pt") as f:
            keys = set(f.keys())
            size = sum(f.get_tensor(k).numel() * 4 for k in keys)
        assert keys == {k for k, v in index["weight_map"].items() if v == shard}
        assert size <= 20_000 or len(keys) == 1, (shard, size)
        held[shard], total = keys, total + size
    assert index["metadata"]["total_size"] == total
    layers = [
        {k.split(".")[2] for k in keys if k.startswith("model.layers.")} for keys in held.values()
    ]
    assert {"1", "2"} in layers, "a shard spans the two stages (layers 0-1 | 2-3)"
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    ours = _meshtrain_logits(sim, x)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ours, atol=1e-4, rtol=0)
        torch.testing.assert_close(load_export(out)[1](x), ours, atol=1e-6, rtol=0)
    assert (
        _generate(out, "--temperature", "0").stdout == _generate(run, "--temperature", "0").stdout
    )


def test_a_new_export_replaces_the_weights_of_an_earlier_one(tmp_path, text_file):
    """transformers reads model.safetensors before an index: an earlier export's weights left
    beside new ones would be what it loads."""
    run, sim = llama_run(tmp_path, text_file)
    out = tmp_path / "hf"
    args = ["export", str(run), "--out", str(out)]
    assert CliRunner().invoke(main, args).exit_code == 0
    assert [p.name for p in out.glob("model*")] == ["model.safetensors"]
    assert CliRunner().invoke(main, [*args, "--max-shard-size", "40000"]).exit_code == 0
    assert not (out / "model.safetensors").exists() and len(list(out.glob("model-*"))) == 5
    (out / "model-00002-of-00005.safetensors").unlink()
    res = _generate(out)
    assert res.exit_code == 2 and "names shard model-00002-of-00005.safetensors" in res.output
    assert CliRunner().invoke(main, args).exit_code == 0
    assert [p.name for p in out.glob("model*")] == ["model.safetensors"]


def test_max_shard_size_is_spelled_as_transformers_spells_it(tmp_path, text_file):
    from mesh.config import ConfigError
    from mesh.runtime.export import MAX_SHARD_BYTES, parse_size

    assert [parse_size(s) for s in ["5GB", "200MB", "1.5gb", "20KB", "123"]] == [
        5 * 10**9,
        200 * 10**6,
        1_500_000_000,
        20_000,
        123,
    ]
    assert MAX_SHARD_BYTES == 2 * 10**9
    for bad in ["5XB", "0", "-1GB", "GB", "inf"]:
        with pytest.raises(ConfigError):
            parse_size(bad)
    run, _ = llama_run(tmp_path, text_file)
    args = ["export", str(run), "--out", str(tmp_path / "hf"), "--max-shard-size", "5 parsecs"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "--max-shard-size '5 parsecs'" in res.output
    assert "Traceback" not in res.output


def test_a_llama_1b_export_is_planned_in_shards_from_shapes_alone():
    """The plan reads no weights: llama-1b's 1.17B fp32 parameters (4.7 GB) in shards of at
    most 2 GB (the default), in stage order, every parameter once."""
    from mesh.model.build import stage_param_counts
    from mesh.runtime.export import MAX_SHARD_BYTES, shard_names, shard_plan

    cfg = load_config(["configs/models/llama-1b.toml"])
    plan = shard_plan(cfg.model, cfg.grid.stages, MAX_SHARD_BYTES)
    assert len(plan) == 3 and all(sum(t.nbytes for t in s) <= MAX_SHARD_BYTES for s in plan)
    flat = [t for s in plan for t in s]
    assert [t.stage for t in flat] == sorted(t.stage for t in flat)
    assert sum(t.nbytes for t in flat) == 4 * sum(stage_param_counts(cfg.model, cfg.grid.stages))
    assert shard_names(3)[0] == "model-00001-of-00003.safetensors"
    assert shard_names(1) == ["model.safetensors"]


@pytest.mark.slow
def test_a_logical_simulate_run_is_a_run_export_and_generate_read(tmp_path, text_file):
    """`simulate --backend logical --out DIR` saves every cell at checkpoint.every and
    at its end, in the cell processes' format: export gives a model `transformers` loads with
    the simulator's own logits, generate samples from the run directory; --resume of the
    finished run has nothing to do."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    sets = [
        f"--set={s}" for s in [*TINY, *TINY_LLAMA, f"data.path='{text_file}'", "checkpoint.every=2"]
    ]
    args = ["simulate", "--backend", "logical", "--grid", "2x2", "--steps", "5", *sets]
    res = CliRunner().invoke(main, [*args, "--out", str(run)])
    assert res.exit_code == 0, res.output
    for cell in ("0-0", "1-0", "0-1", "1-1"):  # steps 2 and 4 at the interval, 5 at the end
        saved = sorted(p.name for p in (run / "checkpoints" / cell).glob("step-*.pt"))
        assert saved == ["step-00000002.pt", "step-00000004.pt", "step-00000005.pt"], saved
    res = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "hf" / "meshtrain.json").read_text())
    assert (meta["step"], meta["replica"]) == (5, 0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    _, whole = load_export(tmp_path / "hf")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, whole(x), atol=1e-4, rtol=0)
    res = CliRunner().invoke(
        main, ["generate", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "8"]
    )
    assert res.exit_code == 0 and "ROMEO:" in res.output, res.output
    res = CliRunner().invoke(main, ["simulate", "--resume", str(run)])  # logical, from its files
    assert res.exit_code == 0 and "nothing to do: the run is at step 5" in res.output


@pytest.mark.slow
def test_a_pooled_run_exports_each_stages_newest_checkpoint(tmp_path, text_file):
    """Stage pools: a replica's cells end at different steps (each took the microbatches
    routed to it), so the export chains each stage's newest intact checkpoint, which the
    real `transformers` loads with the logits of those cells composed."""
    from transformers import AutoModelForCausalLM

    from mesh.engine.pools import PoolSim

    cfg = load_config(
        [],
        [
            *TINY,
            *TINY_LLAMA,
            "grid.stages=2",
            "grid.replicas=2",
            "run.steps=6",
            "pipeline.routing='pools'",
            'emulation.slowdowns=["s1r0=4.0"]',
            f"data.path='{text_file}'",
        ],
    )
    sim = PoolSim(cfg)
    for _ in range(cfg.run.steps):
        sim.step()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(cfg.to_toml())
    for row in sim.cells:
        for cell in row:
            save_cell(cell, cfg.state_fingerprint(), run)
    chain = sim.cells[0]  # replica 0's cells: s0r0 and the slow s1r0
    assert chain[0].step != chain[1].step  # no step the two share
    res = _export(run, tmp_path / "hf")
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "hf" / "meshtrain.json").read_text())
    assert meta["stage_steps"] == [c.step for c in chain]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = x
        for cell in chain:
            ours = cell.module(ours)
        torch.testing.assert_close(model(x).logits, ours, atol=1e-4, rtol=0)
