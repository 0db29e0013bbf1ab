"""`meshtrain data prepare`: text in, token shards and a manifest out, in bounded memory.

Documents stream from the inputs (mesh/data/sources.py) in batches of about BATCH_BYTES of
text, are tokenized together (HF `tokenizers` encodes a batch in parallel), and each is
appended, followed by the end-of-text token, to the training or the validation split's shard
writer. The validation split is made of whole documents: a document goes there when that keeps
the validation share of the text bytes seen so far nearest --val-fraction (a systematic sample
spread over the inputs, the same whatever the tokenizer).

The manifest records the validation split's unigram and bigram cross-entropy with counts from
the training split (mesh/data/ngram.py): the reference points a run's loss is read against.

Everything is written into a staging directory beside DIR that is renamed to DIR at the very
end, after the manifest: an interrupted prepare leaves no DIR (and no manifest) behind.

imports: numpy, mesh.data (sources, shards, manifest, ngram, tokenizer), mesh.errors, comms.procs.
"""

from __future__ import annotations

import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from comms.procs import pid_alive
from mesh.data.manifest import FORMAT, write_manifest
from mesh.data.ngram import ngram_reference
from mesh.data.shards import ShardWriter, file_sha256, token_dtype
from mesh.data.sources import Piece, Rejects, expand_inputs, read_pieces
from mesh.data.tokenizer import ByteTokenizer, Tokenizer, parse_spec, tokenizer_from_spec
from mesh.errors import DataError

BATCH_BYTES = 1 << 20  # text tokenized at once (an HF encoding holds ~40 bytes per byte)
BPE_SAMPLE_BYTES = 32 << 20  # a BPE is trained on at most this much text
DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_VAL_FRACTION = 0.05


def choose_val(val_bytes: int, seen_bytes: int, doc_bytes: int, fraction: float) -> bool:
    """Whether a document of doc_bytes goes to validation: it does when the validation share
    after it is nearer `fraction` than without it (val + doc/2 <= fraction x all so far)."""
    return val_bytes + doc_bytes / 2 <= fraction * (seen_bytes + doc_bytes)


@dataclass
class _Split:
    writer: ShardWriter
    documents: int = 0
    bytes: int = 0


def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "bytes",
    text_field: str = "text",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    on_phase: Callable[[str, int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Prepare the dataset DIR = out; returns its manifest. on_phase(name, total bytes) starts
    a phase ("sample" for a BPE's training text, then "tokenize"), on_bytes(n) advances it."""
    out = Path(out)
    if not 0 < val_fraction < 0.5:
        raise DataError(f"--val-fraction {val_fraction}: must be between 0 and 0.5")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens}: must be at least 1")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out}: already exists and is not empty; pick a new directory")
    kind, _ = parse_spec(tokenizer)  # a bad --tokenizer answers before any input is read
    files = expand_inputs(inputs)
    total = sum(f.stat().st_size for f in files)
    on_phase = on_phase or (lambda name, n: None)
    on_bytes = on_bytes or (lambda n: None)
    _remove_stale_stages(out)
    stage = out.parent / f".{out.name}.partial-{os.getpid()}"
    stage.mkdir(parents=True)
    try:
        if kind == "bpe":
            on_phase("sample", total)
        tok = tokenizer_from_spec(tokenizer, _sample(files, text_field, total, on_bytes))
        on_phase("tokenize", total)
        manifest = _write(files, tok, stage, text_field, val_fraction, shard_tokens, on_bytes)
        manifest["sources"] = {"inputs": list(inputs), "files": len(files), "bytes": total}
        manifest = write_manifest(stage, manifest)
        if out.exists():
            out.rmdir()
        stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return manifest


def _remove_stale_stages(out: Path) -> None:
    """Staging directories of earlier prepares of DIR that were killed (their process is
    gone): never a dataset, only litter."""
    for old in out.parent.glob(f".{out.name}.partial-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)


def _sample(
    files: list[Path], text_field: str, total: int, on_bytes: Callable[[int], None]
) -> Iterator[str]:
    """Text to train a BPE on: every document when the inputs hold at most BPE_SAMPLE_BYTES,
    else a deterministic share of them (by a hash of their position), up to that much."""
    keep = min(1.0, BPE_SAMPLE_BYTES / max(1, total))
    taken, n = 0, 0
    for path in files:
        for piece in _whole_file(path, read_pieces(path, text_field, Rejects()), on_bytes):
            n += 1
            if keep < 1 and zlib.crc32(n.to_bytes(8, "little")) / 2**32 >= keep:
                continue
            taken += piece.nbytes
            yield piece.text
            if taken >= BPE_SAMPLE_BYTES:
                return


def _write(
    files: list[Path],
    tok: Tokenizer,
    stage: Path,
    text_field: str,
    val_fraction: float,
    shard_tokens: int,
    on_bytes: Callable[[int], None],
) -> dict[str, Any]:
    dtype = token_dtype(tok.vocab_size)
    splits = {s: _Split(ShardWriter(stage, s, dtype, shard_tokens)) for s in ("train", "val")}
    eot = np.array([tok.eot_id], dtype=dtype)
    rejects = Rejects()
    current: _Split | None = None
    batch: list[Piece] = []

    def flush() -> None:
        nonlocal current
        for piece, ids in zip(batch, tok.encode_batch([p.text for p in batch]), strict=True):
            if piece.doc_bytes is not None:  # a new document: the one before it ends
                if current is not None:
                    current.writer.write(eot)
                seen = splits["train"].bytes + splits["val"].bytes
                val = choose_val(splits["val"].bytes, seen, piece.doc_bytes, val_fraction)
                current = splits["val" if val else "train"]
                current.documents += 1
            assert current is not None
            current.writer.write(ids)
            current.bytes += piece.nbytes
        batch.clear()

    start, size = time.perf_counter(), 0
    for path in files:
        for piece in _whole_file(path, read_pieces(path, text_field, rejects), on_bytes):
            batch.append(piece)
            size += piece.nbytes
            if size >= BATCH_BYTES:
                flush()
                size = 0
    flush()
    if current is not None:
        current.writer.write(eot)
    out = {s: {**_counts(sp), "shards": sp.writer.close()} for s, sp in splits.items()}
    for name, split in out.items():
        if not split["shards"]:
            docs = out["train"]["documents"] + out["val"]["documents"]
            raise DataError(
                f"the {name} split is empty ({docs} documents, --val-fraction {val_fraction}): "
                "validation holds whole documents, so give more documents (e.g. a long text "
                "as several files) or a larger --val-fraction"
            )
    # the reference points a run's validation loss is read against (not part of the digest)
    ngram_ce = ngram_reference(
        _split_arrays(stage, out["train"]["shards"], dtype),
        _split_arrays(stage, out["val"]["shards"], dtype),
        tok.vocab_size,
        out["val"]["bytes"] / out["val"]["tokens"],
    )
    tokenizer_entry: dict[str, Any] = {"name": tok.name, "file": None, "sha256": tok.sha256()}
    if not isinstance(tok, ByteTokenizer):
        tok.save(stage)
        tokenizer_entry.update(file="tokenizer.json", sha256=file_sha256(stage / "tokenizer.json"))
    return {
        "format": FORMAT,
        "tokenizer": {**tokenizer_entry, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
        "vocab_size": tok.vocab_size,
        "dtype": dtype.str,
        "shard_tokens": shard_tokens,
        "val_fraction": val_fraction,
        "splits": out,
        "ngram_ce": ngram_ce,
        "rejects": rejects.as_dict(),
        "prepare_s": round(time.perf_counter() - start, 2),
    }


def _split_arrays(stage: Path, shards: list[dict[str, Any]], dtype: np.dtype) -> list[np.ndarray]:
    return [np.memmap(stage / s["file"], dtype=dtype, mode="r") for s in shards]


def _whole_file(
    path: Path, pieces: Iterator[Piece], on_bytes: Callable[[int], None]
) -> Iterator[Piece]:
    """The pieces, reporting the input bytes they consumed, and at the end the file's rest
    (rejected records, blank lines)."""
    done = 0
    for piece in pieces:
        on_bytes(piece.advanced)
        done += piece.advanced
        yield piece
    on_bytes(path.stat().st_size - done)


def _counts(split: _Split) -> dict[str, Any]:
    tokens = split.writer.tokens
    return {
        "documents": split.documents,
        "bytes": split.bytes,
        "tokens": tokens,
        "bytes_per_token": round(split.bytes / tokens, 6) if tokens else None,
    }
