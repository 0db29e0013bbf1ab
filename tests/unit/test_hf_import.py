"""model.init_from / `simulate --init-from`: a Hugging Face LlamaForCausalLM made by the real
`transformers` starts a run. Its config.json gives the model keys, its weights' digest enters
the fingerprint, each stage reads its own tensors (sharded files or not, tied head or not), and
meshtrain's forward equals transformers' on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import TINY, TINY_MODEL

from cli.main import main
from mesh.config import ConfigError, load_config
from mesh.hf_checkpoint import HFImportError, hf_model_keys
from mesh.model.build import build_cell_stages, build_model, stage_shapes
from mesh.model.hf_import import load_stage

pytestmark = pytest.mark.slow  # imports transformers (seconds)

RUN = [s for s in TINY if s not in TINY_MODEL]  # the model keys come from config.json
HF = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


def hf_model(path, tie: bool = False, shard: str | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**HF, tie_word_embeddings=tie)).eval()
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    return model


def _cfg(path, *extra: str):
    sets = [
        *RUN,
        "grid.stages=2",
        "grid.replicas=1",
        "model.seq_len=16",
        f"model.init_from='{path}'",
        *extra,
    ]
    return load_config([], sets)


@pytest.mark.parametrize(("tie", "shard"), [(False, None), (True, None), (False, "20KB")])
def test_an_hf_llama_starts_the_model_with_transformers_logits(tmp_path, tie, shard):
    theirs = hf_model(tmp_path / "hf", tie, shard)
    if shard:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    cfg = _cfg(tmp_path / "hf")
    m = cfg.model
    assert (m.arch, m.d_model, m.n_layers, m.n_heads, m.kv_heads, m.mlp_width) == (
        "llama",
        32,
        4,
        4,
        2,
        48,
    )
    assert m.init_digest and len(m.init_digest) == 16
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(x).logits
        torch.testing.assert_close(build_model(m, cfg.run.seed)(x), ref, atol=1e-4, rtol=0)
        h = x
        for stage in build_cell_stages(cfg):  # each stage its own layers, composed
            h = stage(h)
        torch.testing.assert_close(h, ref, atol=1e-4, rtol=0)


def test_a_stage_reads_its_own_tensors_and_the_digest_is_the_weights(tmp_path):
    hf_model(tmp_path / "a")
    cfg = _cfg(tmp_path / "a")
    stage1 = build_cell_stages(cfg)[1]
    want = sum(torch.Size(s).numel() for s in stage_shapes(cfg.model, 2, 1).values())
    assert load_stage(stage1, tmp_path / "a") == want  # stage 1's values, none of stage 0's
    # the same weights elsewhere: the same digest and fingerprint; other weights: another
    hf_model(tmp_path / "b")
    assert _cfg(tmp_path / "b").fingerprint() == cfg.fingerprint()
    data = json.loads((tmp_path / "b" / "config.json").read_text())
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    LlamaForCausalLM(LlamaConfig(**HF)).save_pretrained(tmp_path / "c", safe_serialization=True)
    assert json.loads((tmp_path / "c" / "config.json").read_text())["hidden_size"] == 32
    assert _cfg(tmp_path / "c").model.init_digest != cfg.model.init_digest
    assert _cfg(tmp_path / "c").fingerprint() != cfg.fingerprint()
    assert data["num_hidden_layers"] == 4


def test_a_model_key_that_disagrees_and_an_unsupported_model_are_one_line(tmp_path):
    hf_model(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"model.d_model = 64.*config.json has 32"):
        _cfg(tmp_path / "hf", "model.d_model=64")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    with pytest.raises(HFImportError, match="attention_bias"):
        hf_model_keys(tmp_path / "hf")
    res = CliRunner().invoke(main, ["show-config", "--set", f"model.init_from='{tmp_path}'"])
    assert res.exit_code == 2 and "no config.json" in res.output, res.output


def test_simulate_init_from_trains_from_the_models_weights(tmp_path, text_file):
    theirs = hf_model(tmp_path / "hf")
    sets = [f"--set={s}" for s in [*RUN, "model.seq_len=16", f"data.path='{text_file}'"]]
    run = tmp_path / "run"
    res = CliRunner().invoke(
        main,
        [
            "simulate",
            "--backend",
            "logical",
            "--grid",
            "2x1",
            "--steps",
            "6",
            "--init-from",
            str(tmp_path / "hf"),
            "--set=checkpoint.every=0",
            *sets,
            "--out",
            str(run),
        ],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_loss"] is not None and summary["steps"] == 6
    res = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    # it trained from the model's weights: close to them (6 small steps), not to a fresh init
    a = trained.model.layers[3].mlp.down_proj.weight
    b = theirs.model.layers[3].mlp.down_proj.weight
    assert 0 < float((a - b).abs().max()) < 0.05 * float(b.abs().max()) + 0.01


def _load_llama_1b_stage0(path: str) -> dict:
    """In a fresh process: write stage 0 of 4 of llama-1b (328M values) as the one existing
    shard of a sharded HF directory whose index names every tensor of the model (the other
    shards do not exist: a stage that opened one would fail), then build the stage on the meta
    device and load it; the load's extra peak RSS over the stage's own storage, and checks."""
    import resource  # noqa: F401 - (Linux: /proc/self is read below)
    from pathlib import Path

    from safetensors.torch import save_file

    from mesh.config import load_config
    from mesh.model.build import stage_layers, stage_module, stage_shapes
    from mesh.model.hf import hf_config, hf_name

    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    d = Path(path)
    d.mkdir()
    m = load_config(["configs/models/llama-1b.toml"], []).model
    shapes = [stage_shapes(m, 4, j) for j in range(4)]
    (d / "config.json").write_text(json.dumps(hf_config(m)))
    weight_map = {
        hf_name(n): f"model-{j + 1:05d}-of-00004.safetensors"
        for j, s in enumerate(shapes)
        for n in s
    }
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    own = {hf_name(n): torch.full(s, 1e-3 * (k + 1)) for k, (n, s) in enumerate(shapes[0].items())}
    save_file(own, d / "model-00001-of-00004.safetensors")
    del own
    stage = stage_module(m, *stage_layers(m, 4, 0), stage=0)
    stage.to_empty(device="cpu")
    for p in stage.parameters():  # its storage touched, as build_stage's init does
        p.data.zero_()
    params = sum(p.numel() for p in stage.parameters())
    largest = max(p.numel() for p in stage.parameters()) * 4
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    read = load_stage(stage, d)
    extra = status("VmHWM") - before
    ok = all(
        float(p.view(-1)[-1]) == pytest.approx(1e-3 * (k + 1))
        for k, (_, p) in enumerate(stage.named_parameters())
    )
    return {"params": params, "read": read, "extra": extra, "largest": largest, "ok": ok}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs /proc/self")
def test_a_llama_1b_stage_loads_its_own_tensors_one_at_a_time(tmp_path):
    """The real size: stage 0 of llama-1b (328M values, 1.3 GB) reads only its own shard and
    holds at most about one tensor beyond its own storage while it loads."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        got = pool.submit(_load_llama_1b_stage0, str(tmp_path / "hf")).result(timeout=400)
    print(json.dumps(got))
    assert got["params"] >= 300_000_000 and got["read"] == got["params"] and got["ok"], got
    assert got["extra"] <= 2 * got["largest"] + 200 * 2**20, got  # not a second stage


def test_a_bf16_checkpoint_is_read_into_fp32_parameters(tmp_path):
    """Most published Llamas are bf16 files: each tensor is read in its dtype and widened."""
    theirs = hf_model(tmp_path / "fp32")
    theirs.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
    cfg = _cfg(tmp_path / "bf16")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = theirs.float()(x).logits  # the bf16 weights, widened, computed in fp32
        torch.testing.assert_close(build_model(cfg.model, 0)(x), ref, atol=1e-4, rtol=0)
