"""Training on a prepared dataset: memory-mapped batches that are a pure function of (seed,
replica, index), the vocabulary and the digest from the manifest, the digest in the
fingerprint, damaged shards refused (sizes at start, hashes on --verify-data), a join with
other data refused naming the difference, status showing the digest, bits per byte."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from fakes import FakeDirectory
from helpers import TINY

from cli.main import main
from cli.preflight import check_data
from cli.run_record import run_config
from cli.status import data_label, read_status
from comms.p2p.auth import Auth
from mesh.config import ConfigError, load_config, with_overrides
from mesh.data.corpus import bits_per_byte, load_corpus, train_batch, val_batches
from mesh.data.manifest import describe_difference, identity, run_record_data
from mesh.data.prepare import prepare
from mesh.data.shards import Tokens
from mesh.engine.sim import GridSim
from mesh.errors import DataError
from mesh.runtime.registry import Registry, RunRecord
from mesh.testing.local_peers import generated_text

DOCS = [generated_text(1500 + 50 * i, seed=i) for i in range(40)]
GRID = [*TINY, "grid.stages=2", "grid.replicas=1"]


def _make(directory: Path, docs: list[str], tokenizer: str = "bytes", **kw) -> Path:
    directory.mkdir(exist_ok=True)
    src = directory / "src.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(src)], directory / "ds", tokenizer, **kw)
    return directory / "ds"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return _make(tmp_path_factory.mktemp("a"), DOCS, shard_tokens=7000)


@pytest.fixture(scope="module")
def bpe_dataset(tmp_path_factory) -> Path:
    return _make(tmp_path_factory.mktemp("b"), DOCS, "bpe:320")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_batches_are_windows_of_the_shards_and_a_pure_function(dataset):
    corpus = load_corpus(str(dataset), 0.05, 32)
    assert all(isinstance(p, torch.Tensor) is False for p in corpus.train.parts)
    assert len(corpus.train.parts) > 1, "several shards (memory maps)"
    whole = torch.cat([torch.from_numpy(p.astype("int64")) for p in corpus.train.parts])
    x, y = train_batch(corpus, 3, 1, 17, 6, 32)
    again = train_batch(load_corpus(str(dataset), 0.05, 32), 3, 1, 17, 6, 32)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row in x:  # every window is a run of the concatenated shards (some cross a shard end)
        starts = [k for k in range(len(whole) - 32) if torch.equal(whole[k : k + 32], row)]
        assert starts
    assert not torch.equal(train_batch(corpus, 3, 0, 17, 6, 32)[0], x), "replicas differ"
    assert val_batches(corpus, 2, 4, 32)[0][0].shape == (4, 32)
    assert corpus.vocab_size == 257 and int(x.max()) <= 256


def test_windows_cross_part_ends():
    import numpy as np

    parts = [np.arange(0, 5), np.arange(5, 7), np.arange(7, 20)]
    got = Tokens(parts).windows(torch.tensor([0, 3, 4, 12]), 6)
    assert got.tolist() == [list(range(o, o + 6)) for o in (0, 3, 4, 12)]


def test_the_config_takes_vocab_and_digest_from_the_manifest(dataset, bpe_dataset, tmp_path):
    cfg = load_config([], [f"data.path='{bpe_dataset}'"])
    manifest = json.loads((bpe_dataset / "manifest.json").read_text())
    assert cfg.model.vocab_size == manifest["vocab_size"] and cfg.data.digest == manifest["digest"]
    assert load_config([], []).model.vocab_size == 256 and load_config([], []).data.digest is None
    # where a peer keeps its copy is not in the fingerprint; what the data holds is
    copy = _copy(bpe_dataset, tmp_path / "copy")
    assert load_config([], [f"data.path='{copy}'"]).fingerprint() == cfg.fingerprint()
    other = load_config([], [f"data.path='{dataset}'", f"model.vocab_size={cfg.model.vocab_size}"])
    assert other.fingerprint() != cfg.fingerprint()
    # a vocabulary set larger is kept; smaller is a user error naming the key
    assert load_config([], [f"data.path='{bpe_dataset}'", "model.vocab_size=999"]).model.vocab_size
    small = load_config([], [f"data.path='{bpe_dataset}'", "model.vocab_size=256"])
    with pytest.raises(ConfigError, match=r"model.vocab_size = 256, but the dataset's tokenizer"):
        check_data(small)
    # a config derived from another (benchmarks: with_overrides) gets the digest too
    moved = with_overrides(load_config([], []), {"data.path": str(bpe_dataset)})
    assert moved.data.digest == manifest["digest"]
    # the resolved config round-trips through its TOML (what a run's config.toml holds)
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    assert load_config([path]).fingerprint() == cfg.fingerprint()


def test_a_truncated_shard_is_refused_at_start_a_corrupted_one_on_verify(dataset, tmp_path):
    bad = _copy(dataset, tmp_path / "trunc")
    shard = bad / "train-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    cfg = load_config([], [f"data.path='{bad}'"])
    with pytest.raises(DataError, match=r"train-00001.bin holds .* bytes, the manifest says"):
        check_data(cfg)
    res = CliRunner().invoke(
        main, ["simulate", "--backend", "logical", "--set", f"data.path='{bad}'"]
    )
    assert res.exit_code == 2 and "train-00001.bin holds" in res.output, res.output
    missing = _copy(dataset, tmp_path / "missing")
    (missing / "val-00000.bin").unlink()
    with pytest.raises(DataError, match=r"val-00000.bin is missing, the manifest says"):
        check_data(load_config([], [f"data.path='{missing}'"]))
    bad = _copy(dataset, tmp_path / "flip")
    raw = bytearray((bad / "val-00000.bin").read_bytes())
    raw[100] ^= 1
    (bad / "val-00000.bin").write_bytes(bytes(raw))
    cfg = load_config([], [f"data.path='{bad}'"])
    check_data(cfg)  # sizes only: a flipped bit passes
    with pytest.raises(DataError, match=r"val-00000.bin: its sha256 is not the manifest's"):
        check_data(cfg, verify=True)
    res = CliRunner().invoke(main, ["data", "verify", str(bad)])
    assert res.exit_code == 2 and "val-00000.bin: its sha256" in res.output
    res = CliRunner().invoke(
        main, ["simulate", "--backend", "logical", "--verify-data", "--set", f"data.path='{bad}'"]
    )
    assert res.exit_code == 2 and "val-00000.bin" in res.output, res.output
    (bad / "manifest.json").write_text((bad / "manifest.json").read_text().replace('"val"', '"x"'))
    with pytest.raises(DataError, match="edited"):
        load_corpus(str(bad), 0.05, 32)


def test_a_join_with_other_data_is_refused_naming_the_difference(dataset, bpe_dataset, tmp_path):
    run = load_config([], [*GRID, f"data.path='{dataset}'"])
    d = FakeDirectory()
    auth = Auth.of(None, run.fingerprint())
    data = run_record_data(check_data(run).manifest)
    Registry(d, auth, 60.0).put_run(
        RunRecord(run.fingerprint(), run.to_toml(), auth.key_check, data)
    )
    reg = Registry(d, None, 60.0)
    # the same data elsewhere: accepted (a --set of data.path does not change the fingerprint)
    copy = _copy(dataset, tmp_path / "copy")
    same = load_config([], [*GRID, f"data.path='{copy}'"])
    assert run_config(reg, same, [], None).fingerprint() == run.fingerprint()
    assert run_config(reg, None, [f"data.path='{copy}'"], None).data.path == str(copy)
    # another tokenizer
    other = load_config([], [*GRID, f"data.path='{bpe_dataset}'", "model.vocab_size=257"])
    with pytest.raises(DataError, match=r"not the run's dataset .*another tokenizer \(sha256"):
        run_config(reg, other, [], None)
    # the same tokenizer, one document more: the shards differ, named
    more = _make(tmp_path / "more", [*DOCS, DOCS[0]], shard_tokens=7000)
    local = load_config([], [*GRID, f"data.path='{more}'"])
    with pytest.raises(DataError, match=r"train-0000\d.bin: other tokens|tokens here"):
        run_config(reg, local, [], None)
    # a joiner without --config whose copy at the run's path is other data: refused at the check
    cfg = run_config(reg, None, [f"data.path='{more}'"], None)
    with pytest.raises(DataError, match=r"not the run's dataset"):
        check_data(cfg, run_data=data)
    rows = read_status(d, None)
    assert rows["data"]["digest"] == run.data.digest
    assert data_label(rows["data"]) == f"dataset {run.data.digest[:16]} ({dataset})"


def test_describe_difference_names_shards_and_counts(dataset):
    ours = identity(json.loads((dataset / "manifest.json").read_text()))
    theirs = json.loads(json.dumps(ours))
    theirs["splits"]["train"]["shards"][1]["sha256"] = "0" * 64
    theirs["splits"]["train"]["shards"][2]["tokens"] += 5
    theirs["splits"]["train"]["shards"].append({"file": "train-09999.bin", "tokens": 1})
    text = describe_difference(ours, theirs)
    assert "train-00001.bin: other tokens (sha256 differs)" in text
    assert "train-00002.bin: 7,000 tokens here, 7,005 in the run" in text
    assert "train-09999.bin missing here" in text and "train: " in text
    assert describe_difference(ours, ours) == "nothing (the same data)"


def test_a_grid_trains_on_a_bpe_dataset_and_reports_bits_per_byte(bpe_dataset):
    cfg = load_config(
        [], [*TINY, "grid.stages=2", "grid.replicas=2", "run.steps=3", f"data.path='{bpe_dataset}'"]
    )
    corpus = check_data(cfg)
    result = GridSim(cfg, corpus).run()
    assert result.val_loss is not None and math.isfinite(result.val_loss)
    assert corpus.val_bytes_per_token > 2, "BPE tokens hold several bytes"
    assert result.val_bpb == pytest.approx(
        bits_per_byte(result.val_loss, corpus.val_bytes_per_token)
    )
    assert bits_per_byte(math.log(2), 1.0) == pytest.approx(1.0)


@pytest.mark.slow
def test_a_process_grid_trains_on_a_dataset_and_logs_bits_per_byte(bpe_dataset, tmp_path):
    out = tmp_path / "run"
    args = ["simulate", "--grid", "2x1", "--steps", "4", "--out", str(out)]
    for item in [*TINY, "run.eval_every=2", f"data.path='{bpe_dataset}'"]:
        args += ["--set", item]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "val bits/byte" in res.output
    rows = [json.loads(ln) for ln in (out / "val.jsonl").read_text().splitlines()]
    corpus = load_corpus(str(bpe_dataset), 0.05, 16)
    for r in rows:
        assert r["val_bpb"] == pytest.approx(
            bits_per_byte(r["val_loss"], corpus.val_bytes_per_token)
        )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_bpb"] == pytest.approx(
        bits_per_byte(summary["val_loss"], corpus.val_bytes_per_token)
    )
    stored = load_config([out / "config.toml"])
    assert stored.data.digest == corpus.digest and stored.model.vocab_size == corpus.vocab_size
