"""Bad input is refused in one line (exit 2), never crashed on: config values of the wrong type
(a bool for a number), a config file that is not UTF-8, a manifest whose fields are of the
wrong type or whose shard paths leave the dataset, and token ids outside the vocabulary (a
shard replaced by one of the same size, a manifest without max_id)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import TINY

from cli.main import main
from mesh.config import ConfigError, load_config
from mesh.data.corpus import load_corpus, train_batch
from mesh.data.manifest import digest
from mesh.data.prepare import prepare
from mesh.errors import DataError
from mesh.testing.local_peers import generated_text

DOCS = [generated_text(1500 + 50 * i, seed=i) for i in range(30)]


def _one_line_error(res) -> str:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


# ---- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[dp]\ntau = true\n", "dp.tau"),
        ("[optim]\nlr = false\n", "optim.lr"),
        ("[grid]\nstages = true\n", "grid.stages"),
    ],
)
def test_a_bool_where_a_number_goes_is_refused(tmp_path, toml, key):
    bad = tmp_path / "bad.toml"
    bad.write_text(toml)
    line = _one_line_error(CliRunner().invoke(main, ["simulate", "--config", str(bad)]))
    assert line.startswith(f"error: {key}: ") and "bool" in line, line


def test_numbers_still_fill_number_keys_and_bools_bool_keys():
    cfg = load_config([], ["optim.lr=1", "model.rope_theta=500", "optim.error_feedback=true"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.error_feedback is True
    with pytest.raises(ConfigError, match="^dp.tau: true is a bool"):
        load_config([], ["dp.tau=true"])


def test_a_config_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes("[run]\nname = 'caf\xe9'\n".encode("latin-1"))
    line = _one_line_error(CliRunner().invoke(main, ["simulate", "--config", str(bad)]))
    assert line.startswith(f"error: --config {bad}: not UTF-8"), line


# ---- prepared datasets -------------------------------------------------------------------------


@pytest.fixture
def dataset(tmp_path) -> Path:
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    prepare([str(src)], tmp_path / "ds", "bytes", shard_tokens=7000)
    return tmp_path / "ds"


def _edit_manifest(directory: Path, change) -> None:
    """Change the manifest and give it the digest of its new content (as anyone can)."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    manifest["digest"] = digest(manifest)
    path.write_text(json.dumps(manifest))


def _set_shard(key, value, index=0):
    return lambda m: m["splits"]["train"]["shards"][index].__setitem__(key, value)


def _simulate(directory: Path, tmp_path: Path):
    sets = [a for s in [*TINY, f"data.path='{directory}'"] for a in ("--set", s)]
    args = ["simulate", "--grid", "1x1", "--steps", "2", "--out", str(tmp_path / "run"), *sets]
    return CliRunner().invoke(main, args)


def test_prepare_records_each_shards_largest_id(dataset):
    manifest = json.loads((dataset / "manifest.json").read_text())
    for shard in manifest["splits"]["train"]["shards"]:
        tokens = np.fromfile(dataset / shard["file"], dtype=manifest["dtype"])
        assert shard["max_id"] == int(tokens.max()) < manifest["tokenizer"]["vocab_size"]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (_set_shard("tokens", "7000"), "splits.train.shards[0].tokens = '7000' is not an integer"),
        (_set_shard("file", "../outside.bin"), "file = '../outside.bin' is not a file name"),
        (_set_shard("file", "/etc/passwd"), "file = '/etc/passwd' is not a file name"),
        (_set_shard("max_id", 1.5), "splits.train.shards[0].max_id = 1.5 is not an integer"),
        (lambda m: m["splits"]["val"].__setitem__("tokens", True), "splits.val.tokens = True"),
    ],
    ids=["tokens-str", "dotdot", "absolute", "max-id-float", "count-bool"],
)
def test_a_malformed_manifest_is_refused_naming_the_field(dataset, tmp_path, change, why):
    _edit_manifest(dataset, change)
    line = _one_line_error(CliRunner().invoke(main, ["data", "verify", str(dataset)]))
    assert why in line and "manifest.json" in line, line
    assert why in _one_line_error(_simulate(dataset, tmp_path))


def test_a_same_size_shard_of_foreign_ids_is_refused_naming_it(dataset):
    """max_id recorded: the open is cheap and passes, the first window read from the shard is
    refused naming it (not an IndexError inside a step)."""
    manifest = json.loads((dataset / "manifest.json").read_text())
    shard = manifest["splits"]["train"]["shards"][0]
    path = dataset / shard["file"]
    path.write_bytes(np.full(shard["tokens"], 60_000, dtype=manifest["dtype"]).tobytes())
    corpus = load_corpus(str(dataset), 0.05, 16)
    with pytest.raises(DataError, match=f"^{path}: token [0-9,]+ is id 60000, outside"):
        for index in range(50):  # random windows: the first shard is hit within a few
            train_batch(corpus, 0, 0, index, 4, 16)


def test_an_older_manifest_without_max_id_is_scanned_at_open(dataset, tmp_path):
    def drop_max_id(m):
        for split in ("train", "val"):
            for shard in m["splits"][split]["shards"]:
                shard.pop("max_id")

    before = json.loads((dataset / "manifest.json").read_text())["digest"]
    _edit_manifest(dataset, drop_max_id)
    assert json.loads((dataset / "manifest.json").read_text())["digest"] == before, "identity"
    load_corpus(str(dataset), 0.05, 16)  # intact: opens
    manifest = json.loads((dataset / "manifest.json").read_text())
    shard = manifest["splits"]["train"]["shards"][1]
    path = dataset / shard["file"]
    tokens = np.fromfile(path, dtype=manifest["dtype"])
    tokens[100] = 5000
    tokens.tofile(path)
    line = _one_line_error(_simulate(dataset, tmp_path))
    assert f"{path}: holds token id 5000, outside the tokenizer's vocabulary" in line, line
    assert not (tmp_path / "run").exists(), "refused before any cell"


def test_a_manifest_max_id_beyond_the_vocabulary_is_refused_at_open(dataset):
    _edit_manifest(dataset, _set_shard("max_id", 9999, index=2))
    with pytest.raises(DataError, match="train-00002.bin: holds token id 9999"):
        load_corpus(str(dataset), 0.05, 16)


@pytest.mark.slow
def test_a_cell_that_reads_a_foreign_id_stops_the_run_in_one_line_naming_the_shard(
    dataset, tmp_path
):
    manifest = json.loads((dataset / "manifest.json").read_text())
    for shard in manifest["splits"]["train"]["shards"]:  # every train shard: the first read hits
        path = dataset / shard["file"]
        path.write_bytes(np.full(shard["tokens"], 60_000, dtype=manifest["dtype"]).tobytes())
    res = _simulate(dataset, tmp_path)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, res.output  # beside the progress bar and the report's path
    line = errors[0]
    assert line.startswith("error: cell s0r0: ") and "is id 60000, outside" in line, line
    assert str(dataset / "train-0000") in line, line
