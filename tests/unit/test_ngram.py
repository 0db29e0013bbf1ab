"""The data's reference points: the validation split's unigram and bigram cross-entropy with
counts from the training split (a hand-computed case, the smoothing at unseen pairs and ids, the
dense and the sorted counts agreeing), `data prepare` writing them into the manifest, a manifest
written before them still loading (its numbers counted at load), and the rule's verdict."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mesh.data import ngram
from mesh.data.corpus import load_corpus, ngram_ce
from mesh.data.manifest import read_manifest
from mesh.data.ngram import BigramCounts, cross_entropy, ngram_reference
from mesh.data.prepare import prepare
from mesh.testing.local_peers import generated_text

TRAIN = np.array([0, 1, 0, 1, 2])  # c = (2, 2, 1); pairs 01 x2, 10, 12
VAL = np.array([0, 1, 2])


def test_a_hand_computed_case():
    counts = BigramCounts([TRAIN], 3)
    p = {0: 3 / 8, 1: 3 / 8, 2: 2 / 8}  # add-one: (c + 1) / (5 + 3)
    # p(1|0) = (2 - .75) / 2 + .75 * 1 / 2 * p(1); p(2|1) = (1 - .75) / 2 + .75 * 2 / 2 * p(2)
    p10 = 1.25 / 2 + 0.375 * p[1]
    p21 = 0.25 / 2 + 0.75 * p[2]
    assert p10 == pytest.approx(0.765625) and p21 == pytest.approx(0.3125)
    uni, bi, n = cross_entropy(counts, [VAL])
    assert n == 3
    assert uni == pytest.approx(-(math.log(p[0]) + math.log(p[1]) + math.log(p[2])) / 3)
    # the first token has no context: the unigram predicts it
    assert bi == pytest.approx(-(math.log(p[0]) + math.log(p10) + math.log(p21)) / 3)
    ref = ngram_reference([TRAIN], [VAL], 3, val_bytes_per_token=2.0)
    assert ref["bigram"]["nats_per_token"] == pytest.approx(bi, abs=1e-6)
    assert ref["bigram"]["bits_per_byte"] == pytest.approx(bi / (2 * math.log(2)), abs=1e-6)
    assert ref["train_tokens_counted"] == 5 and ref["val_tokens"] == 3
    assert "absolute discounting" in ref["smoothing"]


def test_unseen_pairs_ids_and_contexts_get_finite_mass_and_every_row_sums_to_one():
    counts = BigramCounts([TRAIN], 4)  # id 3 never occurs in training
    a = np.repeat(np.arange(4), 4)
    b = np.tile(np.arange(4), 4)
    rows = counts.bigram_prob(a, b).reshape(4, 4)
    assert np.all(rows > 0)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0)
    # an unseen pair after a seen context: only the backoff's share, D * n(a) / c(a) * p(b)
    assert rows[0, 0] == pytest.approx(0.75 * 1 / 2 * (2 + 1) / (5 + 4))
    # a context never seen (2 ends the text, 3 never occurs): the unigram itself
    np.testing.assert_allclose(rows[2], counts.unigram_prob(np.arange(4)))
    np.testing.assert_allclose(rows[3], counts.unigram_prob(np.arange(4)))
    uni, bi, _ = cross_entropy(counts, [np.array([3, 3, 0])])
    assert math.isfinite(uni) and math.isfinite(bi)


def test_the_sorted_counts_of_a_large_vocabulary_are_the_dense_ones(monkeypatch):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 40, 3000), rng.integers(0, 40, 500)
    dense = ngram_reference([train[:1000], train[1000:]], [val], 40, 1.0)
    monkeypatch.setattr(ngram, "DENSE_PAIRS", 0)
    assert ngram_reference([train[:1000], train[1000:]], [val], 40, 1.0) == dense


@pytest.mark.parametrize("dense_pairs", [ngram.DENSE_PAIRS, 0])
def test_counting_a_window_at_a_time_gives_the_whole_arrays_numbers(monkeypatch, dense_pairs):
    """Memory stays bounded (a 200 MB dataset's prepare, tests/integration/test_data_scale.py)
    because the counts and the cross-entropy go CHUNK_TOKENS at a time; the pairs across each
    cut are counted once, and a part's first token still has no context."""
    rng = np.random.default_rng(1)
    train, val = rng.integers(0, 40, 3000), rng.integers(0, 40, 500)
    parts, val_parts = [train[:1001], train[1001:], train[:1]], [val[:250], val[250:]]
    monkeypatch.setattr(ngram, "DENSE_PAIRS", dense_pairs)
    whole = ngram_reference(parts, val_parts, 40, 1.0)
    monkeypatch.setattr(ngram, "CHUNK_TOKENS", 7)
    assert ngram_reference(parts, val_parts, 40, 1.0) == whole
    counts = BigramCounts(parts, 40)
    assert counts.tokens == 3001 and int(counts.counts.sum()) == 3001 - 3  # 3 parts, 3 firsts
    assert BigramCounts(parts, 40, limit=1500).tokens == 1500


def test_the_rule_and_the_fields_beside_a_loss():
    entry = ngram_reference([TRAIN], [VAL], 3, 1.0)
    bigram = entry["bigram"]["nats_per_token"]
    fields = ngram.beside_loss(0.5 * bigram, entry)
    assert fields["data_bigram_ce"] == bigram and fields["val_loss_to_bigram"] == 0.5
    assert ngram.regime(0.85) == "passes the rule"
    assert ngram.regime(0.86) == ngram.EARLY == "early-training regime"
    assert ngram.regime(None) == "n/a" and ngram.beside_loss(1.0, None) == {}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ng")
    src = root / "src.jsonl"
    docs = [generated_text(1200 + 40 * i, seed=i) for i in range(30)]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(src)], root / "ds", "bytes", shard_tokens=5000)
    return root / "ds"


def test_prepare_writes_the_reference_points_and_an_older_manifest_still_loads(dataset, tmp_path):
    manifest = read_manifest(dataset)
    entry = manifest["ngram_ce"]
    corpus = load_corpus(str(dataset), 0.05, 16)
    direct = ngram_reference(
        corpus.train.parts, corpus.val.parts, corpus.vocab_size, corpus.val_bytes_per_token
    )
    assert entry == direct
    assert entry["bigram"]["nats_per_token"] < entry["unigram"]["nats_per_token"]
    assert ngram_ce(corpus) == entry
    # a manifest written before the field: the same digest, it loads, the numbers are counted
    old = tmp_path / "old"
    old.mkdir()
    for f in dataset.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    legacy = {k: v for k, v in manifest.items() if k != "ngram_ce"}
    (old / "manifest.json").write_text(json.dumps(legacy))
    assert "ngram_ce" not in read_manifest(old)
    assert ngram_ce(load_corpus(str(old), 0.05, 16)) == entry
    # a hand-edited entry the reports could not read is counted again, not trusted
    (old / "manifest.json").write_text(json.dumps({**legacy, "ngram_ce": {"bigram": "x"}}))
    assert ngram_ce(load_corpus(str(old), 0.05, 16)) == entry


def test_a_text_corpus_gets_the_same_on_bytes(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(generated_text(20000, seed=3))
    corpus = load_corpus(str(text), 0.1, 16)
    entry = ngram_ce(corpus)
    assert entry == ngram_reference(corpus.train.parts, corpus.val.parts, 256, 1.0)
    assert entry["bigram"]["bits_per_byte"] == pytest.approx(
        entry["bigram"]["nats_per_token"] / math.log(2), abs=1e-5
    )


def test_the_summaries_show_the_reference_points_beside_the_loss(tmp_path):
    from cli.join import _data_reference
    from cli.simulate import reference_cells
    from mesh.config import load_config

    text = tmp_path / "t.txt"
    text.write_text(generated_text(20000, seed=4))
    cfg = load_config([], [f"data.path='{text}'"])
    entry = _data_reference(cfg)
    assert entry == ngram_ce(load_corpus(str(text), cfg.data.val_fraction, cfg.model.seq_len))
    bigram = entry["bigram"]["nats_per_token"]
    cells = reference_cells(ngram.beside_loss(bigram * 0.5, entry))
    assert cells == [f"{entry['unigram']['nats_per_token']:.3f}/{bigram:.3f}", "0.50"]
    # data that cannot be read now: the summary still shows, its cells n/a
    gone = load_config([], [f"data.path='{tmp_path / 'gone.txt'}'"])
    assert _data_reference(gone) is None
    assert reference_cells(ngram.beside_loss(1.0, None)) == ["n/a", "n/a"]
