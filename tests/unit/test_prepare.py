"""`data prepare`: every input kind round-trips (the ids the tokenizer gives directly), bad
records are counted by file and line, validation holds whole documents, shards and manifest
are what the manifest says, and an interrupted prepare leaves nothing behind."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mesh.data import sources
from mesh.data.manifest import digest, read_manifest
from mesh.data.prepare import choose_val, prepare
from mesh.data.shards import file_sha256
from mesh.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from mesh.errors import DataError
from mesh.testing.local_peers import generated_text

DOCS = [generated_text(800 + 37 * i, seed=i) for i in range(40)] + ["caf\u00e9 \u2603 na\u00efve\n"]


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> Path:
    """A small byte-level BPE saved as tokenizer.json (the --tokenizer PATH form)."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(DOCS, 400).tok.save(str(path))
    return path


def documents(directory: Path) -> list[list[int]]:
    """The documents of a prepared dataset (both splits), as token id lists."""
    manifest = read_manifest(directory)
    eot = manifest["tokenizer"]["eot_id"]
    out = []
    for split in ("train", "val"):
        ids = np.concatenate(
            [
                np.fromfile(directory / s["file"], dtype=manifest["dtype"])
                for s in manifest["splits"][split]["shards"]
            ]
        ).tolist()
        assert ids[-1] == eot, "every document ends with end-of-text"
        doc: list[int] = []
        for t in ids:
            if t == eot:
                out.append(doc)
                doc = []
            else:
                doc.append(t)
    return out


def write_inputs(kind: str, directory: Path, docs: list[str]) -> list[str]:
    directory.mkdir()
    if kind == "txt":
        for i, d in enumerate(docs):
            (directory / f"doc{i:03d}.txt").write_text(d)
        return [str(directory)]  # a directory of inputs
    if kind == "parquet":
        pq.write_table(pa.table({"body": docs}), directory / "docs.parquet", row_group_size=7)
        return [str(directory / "*.parquet")]  # a glob
    lines = "".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs))
    if kind == "jsonl.gz":
        (directory / "docs.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
        return [str(directory / "docs.jsonl.gz")]
    (directory / "docs.jsonl").write_text(lines)
    return [str(directory / "docs.jsonl")]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "jsonl.gz", "parquet"])
@pytest.mark.parametrize("spec", ["bytes", "file"])
def test_every_input_kind_round_trips(tmp_path, kind, spec, bpe_file):
    inputs = write_inputs(kind, tmp_path / "in", DOCS)
    out = tmp_path / "ds"
    tok_spec = "bytes" if spec == "bytes" else str(bpe_file)
    manifest = prepare(inputs, out, tok_spec, text_field="body", val_fraction=0.1)
    tok = load_tokenizer(str(out))
    assert sorted(documents(out)) == sorted(tok.encode(d) for d in DOCS)
    assert [tok.decode(tok.encode(d)) for d in DOCS] == DOCS
    split = manifest["splits"]
    assert split["train"]["documents"] + split["val"]["documents"] == len(DOCS)
    assert split["val"]["documents"] >= 2, "validation is whole documents, a tenth of the text"
    assert split["train"]["bytes"] + split["val"]["bytes"] == sum(len(d.encode()) for d in DOCS)
    assert manifest["rejects"]["count"] == 0
    assert manifest["digest"] == digest(manifest)
    if spec == "bytes":
        assert (tok.vocab_size, tok.eot_id, tok.files()) == (257, 256, [])
    else:
        assert tok.files() == [out / "tokenizer.json", out / "tokenizer_config.json"]


def test_a_long_text_is_read_in_pieces_with_the_same_ids(tmp_path, monkeypatch, bpe_file):
    text = "".join(DOCS[:10])
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "long.txt").write_text(text)
    (tmp_path / "in" / "other.txt").write_text(DOCS[11] * 20)  # validation gets this one
    monkeypatch.setattr(sources, "PIECE_BYTES", 300)  # a piece per few lines
    prepare([str(tmp_path / "in")], tmp_path / "ds", str(bpe_file), val_fraction=0.45)
    tok = load_tokenizer(str(tmp_path / "ds"))
    assert tok.encode(text) in documents(tmp_path / "ds")
    # one long line: cut before the spaces between words, the same ids again
    line = text.replace("\n", " ")
    (tmp_path / "in" / "long.txt").write_text(line)
    prepare([str(tmp_path / "in")], tmp_path / "ds2", str(bpe_file), val_fraction=0.45)
    assert tok.encode(line) in documents(tmp_path / "ds2")
    # no space at all: bounded pieces, cut between whole characters (the text is all there)
    (tmp_path / "in" / "long.txt").write_text("\u00e9" * 20000)
    prepare([str(tmp_path / "in")], tmp_path / "ds3", "bytes", val_fraction=0.45)
    as_text = [ByteTokenizer().decode(d) for d in documents(tmp_path / "ds3")]
    assert "\u00e9" * 20000 in as_text


def test_bad_records_are_counted_by_file_and_line(tmp_path):
    good = [json.dumps({"text": d}) for d in DOCS[:30]]
    lines = [
        good[0].encode(),
        b"{not json",
        json.dumps({"body": "no text field"}).encode(),
        b'{"text": "caf\xe9"}',  # latin-1, not UTF-8
        b"[1, 2]",
        json.dumps({"text": None}).encode(),
        json.dumps({"text": 7}).encode(),
        b"",  # a blank line is not a record
        *(g.encode() for g in good[1:]),
    ]
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "b.txt").write_bytes(b"fine line\n\xff\xfe broken line\nanother fine line\n")
    pq.write_table(pa.table({"text": ["", None, *DOCS[30:36]]}), tmp_path / "c.parquet")
    inputs = [str(tmp_path / n) for n in ("a.jsonl", "b.txt", "c.parquet")]
    manifest = prepare(inputs, tmp_path / "ds", "bytes", val_fraction=0.1)
    rejects = manifest["rejects"]
    assert rejects["count"] == 9
    a, b, c = (str(tmp_path / n) for n in ("a.jsonl", "b.txt", "c.parquet"))
    assert rejects["examples"] == [
        f"{a}:2: malformed JSON",
        f"{a}:3: no 'text' field (--text-field)",
        f"{a}:4: not UTF-8 (byte 13)",
        f"{a}:5: not a JSON object",
        f"{a}:6: 'text' is null",
        f"{a}:7: 'text' is not a string",
        f"{b}:2: not UTF-8 (byte 0 of the line)",
        f"{c}:1: 'text' is empty",
        f"{c}:2: 'text' is null",
    ]
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == 37
    assert "fine line\nanother fine line\n" in [
        ByteTokenizer().decode(d) for d in documents(tmp_path / "ds")
    ]


def test_a_file_with_nothing_usable_is_an_error_and_leaves_nothing(tmp_path):
    (tmp_path / "good.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    pq.write_table(pa.table({"text": ["", None, ""]}), tmp_path / "empty.parquet")
    out = tmp_path / "ds"
    inputs = [str(tmp_path / "good.jsonl"), str(tmp_path / "empty.parquet")]
    with pytest.raises(DataError, match=r"empty\.parquet: no usable document"):
        prepare(inputs, out, "bytes")
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "other.parquet")
    with pytest.raises(DataError, match=r"no column 'text' \(it has body\); pick one"):
        prepare([str(tmp_path / "other.parquet")], out, "bytes")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00" * 50)
    with pytest.raises(DataError, match=r"binary\.txt: no usable document"):
        prepare([str(tmp_path / "binary.txt")], out, "bytes")


def test_an_interrupted_prepare_leaves_no_manifest(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))

    def interrupt(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare([str(tmp_path / "a.jsonl")], tmp_path / "ds", "bytes", on_bytes=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]
    # a killed prepare's staging directory (its process gone) is cleared by the next one
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (tmp_path / f".ds.partial-{dead}").mkdir()
    prepare([str(tmp_path / "a.jsonl")], tmp_path / "ds", "bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "ds"]


def test_user_mistakes_name_the_flag(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    cases = [
        (["a.txt"], {"tokenizer": "bpe:12"}, r"--tokenizer bpe:12: VOCAB must be"),
        (["a.txt"], {"tokenizer": "nope.json"}, r"--tokenizer nope.json: no such file"),
        (["missing.txt"], {}, r"missing.txt: no such file"),
        (["*.csv"], {}, r"the pattern matches no"),
        (["a.txt"], {"val_fraction": 0.7}, r"--val-fraction 0.7"),
        (["a.txt"], {}, r"the val split is empty \(1 documents"),
    ]
    for inputs, kwargs, match in cases:
        with pytest.raises(DataError, match=match):
            prepare([str(tmp_path / i) for i in inputs], tmp_path / "ds", **kwargs)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(DataError, match="--out .*full: already exists and is not empty"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "full")


def test_shards_split_at_shard_tokens_and_hash_as_the_manifest_says(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    manifest = prepare([str(tmp_path / "a.jsonl")], tmp_path / "ds", "bytes", shard_tokens=5000)
    train = manifest["splits"]["train"]
    assert [s["file"] for s in train["shards"]][:2] == ["train-00000.bin", "train-00001.bin"]
    assert all(s["tokens"] == 5000 for s in train["shards"][:-1])
    assert sum(s["tokens"] for s in train["shards"]) == train["tokens"]
    for s in train["shards"]:
        path = tmp_path / "ds" / s["file"]
        assert path.stat().st_size == 2 * s["tokens"] and file_sha256(path) == s["sha256"]
    assert manifest["dtype"] == "<u2"


def test_validation_takes_documents_near_the_fraction():
    val = seen = 0
    picks = []
    for k in range(200):
        if choose_val(val, seen, 100, 0.05):
            val += 100
            picks.append(k)
        seen += 100
    assert len(picks) == 10 and picks[0] > 0, "a twentieth, spread out, never the first"
    assert not choose_val(0, 0, 100, 0.05)


def test_a_bpe_is_trained_and_transformers_loads_it(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    manifest = prepare([str(tmp_path / "a.jsonl")], tmp_path / "ds", "bpe:300")
    tok = load_tokenizer(str(tmp_path / "ds"))
    assert tok.name == "bpe:300" and tok.vocab_size == manifest["tokenizer"]["vocab_size"] <= 300
    assert manifest["tokenizer"]["sha256"] == file_sha256(tmp_path / "ds" / "tokenizer.json")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "ds"))
    text = DOCS[3] + " caf\u00e9"
    assert hf(text)["input_ids"] == tok.encode(text)
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == tok.eot_id
    assert hf.decode(tok.encode(text)) == text


def test_the_command_shows_rejects_and_a_summary_and_exits_2_on_a_mistake(tmp_path):
    from click.testing import CliRunner

    from cli.main import main

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS) + "{oops\n")
    out = tmp_path / "ds"
    res = CliRunner().invoke(main, ["data", "prepare", str(src), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert f"{src}:{len(DOCS) + 1}: malformed JSON" in res.output
    assert "| val " in res.output and "MB/s" in res.output
    assert f"--set data.path={out}" in res.output
    res = CliRunner().invoke(
        main, ["data", "prepare", str(src), "--out", str(tmp_path / "x"), "--tokenizer", "bpe"]
    )
    assert res.exit_code == 2 and "error: --tokenizer bpe: no such file" in res.output


def test_a_tokenizer_without_end_of_text_gets_one(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(DOCS, trainer=trainer)
    tok.save(str(tmp_path / "plain.json"))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    manifest = prepare([str(tmp_path / "a.jsonl")], tmp_path / "ds", str(tmp_path / "plain.json"))
    assert manifest["tokenizer"]["vocab_size"] == tok.get_vocab_size() + 1
    loaded = load_tokenizer(str(tmp_path / "ds"))
    assert loaded.eot_id == tok.get_vocab_size() and loaded.name == "file:plain.json"
    assert sorted(documents(tmp_path / "ds")) == sorted(tok.encode(d).ids for d in DOCS)
