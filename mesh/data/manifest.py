"""A prepared dataset's manifest.json: what it holds, and the digest that is its identity.

The identity is what decides the tokens a run reads: the format, the tokenizer (sha256 of its
tokenizer.json, vocabulary, end-of-text id), the shards' dtype, and per split its text bytes and
every shard's name, token count and sha256. The digest is the sha256 of that identity as
canonical JSON: the same data prepared anywhere has the same digest; where the inputs lay, the
rejects, the time of preparation and each shard's largest token id (max_id, derived from its
tokens) are recorded but are not part of it.

Opening a dataset checks the manifest (its digest recomputed, every field of the type it must
be, shard files plain names inside the dataset's directory), every shard's size, and each
shard's max_id against the tokenizer's vocabulary (a manifest without max_id: the shard is
scanned once at open); the windows a run reads are checked against the vocabulary too
(mesh.data.shards.Tokens), which catches a shard replaced by one of the same size. Hashing
every shard (verify) is for `data prepare` itself and `--verify-data`.

imports: numpy, mesh.data.shards, mesh.data.tokenizer (names), mesh.errors.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mesh.data.shards import Tokens, file_sha256
from mesh.data.tokenizer import MANIFEST
from mesh.errors import DataError

FORMAT = 1
SPLITS = ("train", "val")
RECORD_SHARDS = 64
SHARD_IDENTITY = ("file", "tokens", "sha256")  # a shard's fields that decide its tokens
SCAN_TOKENS = 1 << 24  # tokens read at once when a shard without max_id is scanned


def identity(manifest: dict[str, Any]) -> dict[str, Any]:
    """The part of a manifest that decides the tokens (and nothing else)."""
    tok = manifest["tokenizer"]
    return {
        "format": manifest["format"],
        "tokenizer": {k: tok[k] for k in ("sha256", "vocab_size", "eot_id")},
        "dtype": manifest["dtype"],
        "splits": {
            s: {
                "bytes": manifest["splits"][s]["bytes"],
                "shards": [
                    {k: sh[k] for k in SHARD_IDENTITY} for sh in manifest["splits"][s]["shards"]
                ],
            }
            for s in SPLITS
        },
    }


def run_record_data(manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """The identity a run's DHT record carries so a joiner learns what differs; None for a
    text corpus, or a dataset of so many shards that the record would grow past a few KB."""
    if manifest is None:
        return None
    found = identity(manifest)
    shards = sum(len(found["splits"][s]["shards"]) for s in SPLITS)
    return found if shards <= RECORD_SHARDS else None


def digest(manifest: dict[str, Any]) -> str:
    text = json.dumps(identity(manifest), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def write_manifest(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Adds the digest and writes DIR/manifest.json (temp file, then rename)."""
    manifest = {**manifest, "digest": digest(manifest)}
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(directory / MANIFEST)
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    """DIR/manifest.json, checked: a format this version reads, and a digest that matches its
    contents (a hand-edited manifest would otherwise pass as the dataset it no longer is)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise DataError(
            f"data.path = {str(directory)!r}: a directory without {MANIFEST}; give a dataset "
            "made by `meshtrain data prepare` (or a UTF-8 text file)"
        )
    try:
        manifest = json.loads(path.read_text())
        ok = manifest.get("format") == FORMAT and digest(manifest) == manifest.get("digest")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise DataError(
            f"{path}: unreadable, of another format, or edited (its digest does not match its "
            "contents); prepare the data again"
        )
    why = malformed(manifest)
    if why is not None:
        raise DataError(f"{path}: {why}; prepare the data again")
    return manifest


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def plain_name(x: Any) -> bool:
    """A file name inside the dataset's directory: no folder, no '..', not absolute."""
    return isinstance(x, str) and x not in ("", ".", "..") and Path(x).name == x and "\\" not in x


def malformed(manifest: dict[str, Any]) -> str | None:
    """What is wrong with the fields a run reads from a manifest (one whose digest matches can
    still have been written by hand), or None."""
    tok = manifest.get("tokenizer")
    if not isinstance(tok, dict) or not all(_is_int(tok.get(k)) for k in ("vocab_size", "eot_id")):
        return "tokenizer.vocab_size and tokenizer.eot_id must be integers"
    if manifest.get("vocab_size") != tok["vocab_size"]:
        return f"vocab_size = {manifest.get('vocab_size')!r} is not the tokenizer's"
    if tok.get("file") is not None and not plain_name(tok["file"]):
        return f"tokenizer.file = {tok['file']!r} is not a file name inside the dataset"
    if manifest.get("dtype") not in ("<u2", "<u4"):
        return f"dtype = {manifest.get('dtype')!r} is not <u2 or <u4"
    splits = manifest.get("splits")
    for split in SPLITS:
        entry = splits.get(split) if isinstance(splits, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
            return f"splits.{split} has no list of shards"
        for key in ("bytes", "tokens"):
            if not _is_int(entry.get(key)) or entry[key] < 0:
                return f"splits.{split}.{key} = {entry.get(key)!r} is not a count"
        for i, shard in enumerate(entry["shards"]):
            where = f"splits.{split}.shards[{i}]"
            if not isinstance(shard, dict) or not plain_name(shard.get("file")):
                file = shard.get("file") if isinstance(shard, dict) else shard
                return f"{where}.file = {file!r} is not a file name inside the dataset"
            for key in ("tokens", "max_id"):
                if (key in shard or key == "tokens") and not _is_int(shard.get(key)):
                    return f"{where}.{key} = {shard.get(key)!r} is not an integer"
            if shard["tokens"] < 0 or not isinstance(shard.get("sha256"), str):
                return f"{where}: a negative token count or no sha256"
    return None


def open_split(directory: Path, manifest: dict[str, Any], split: str) -> Tokens:
    """The split's shards as memory maps; DataError naming a shard that is missing or whose
    size is not what the manifest says (truncated, or another file)."""
    dtype = np.dtype(manifest["dtype"])
    vocab = manifest["tokenizer"]["vocab_size"]
    parts = []
    for shard in manifest["splits"][split]["shards"]:
        path = directory / shard["file"]
        want = shard["tokens"] * dtype.itemsize
        have = path.stat().st_size if path.is_file() else None
        if have != want:
            found = "is missing" if have is None else f"holds {have:,} bytes"
            raise DataError(
                f"{path} {found}, the manifest says {want:,} ({shard['tokens']:,} tokens): "
                "a truncated or missing shard; copy the dataset again or prepare it again"
            )
        tokens = np.memmap(path, dtype=dtype, mode="r")
        largest = shard.get("max_id")
        if largest is None and np.iinfo(dtype).max >= vocab:  # an older manifest: scan it once
            starts = range(0, len(tokens), SCAN_TOKENS)
            largest = max((int(tokens[i : i + SCAN_TOKENS].max()) for i in starts), default=-1)
        if largest is not None and largest >= vocab:
            raise DataError(
                f"{path}: holds token id {largest}, outside the tokenizer's vocabulary of {vocab} "
                "(a shard of another tokenizer, or corrupted); copy or prepare the dataset again"
            )
        parts.append(tokens)
    names = [str(directory / s["file"]) for s in manifest["splits"][split]["shards"]]
    return Tokens(parts, vocab, names)


def verify_shards(
    directory: Path, manifest: dict[str, Any], on_bytes: Callable[[int], None] | None = None
) -> None:
    """Hash every shard against the manifest; DataError naming the first that differs."""
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            path = directory / shard["file"]
            if not path.is_file():
                raise DataError(f"{path} is missing: copy the dataset again or prepare it again")
            if file_sha256(path) != shard["sha256"]:
                raise DataError(
                    f"{path}: its sha256 is not the manifest's (a corrupted or replaced shard); "
                    "copy the dataset again or prepare it again"
                )
            if on_bytes is not None:
                on_bytes(path.stat().st_size)


def describe_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """What differs between two datasets' identities, for people: the tokenizer, which shards,
    how many tokens ("; "-joined; the first few shard differences only)."""
    out = []
    t_ours, t_theirs = ours["tokenizer"], theirs["tokenizer"]
    if t_ours["sha256"] != t_theirs["sha256"]:
        out.append(
            f"another tokenizer (sha256 {t_ours['sha256'][:12]} here, {t_theirs['sha256'][:12]} "
            f"in the run; vocab {t_ours['vocab_size']} here, {t_theirs['vocab_size']} there)"
        )
        return out[0]  # every shard differs then: naming them says nothing more
    if ours["dtype"] != theirs["dtype"] or t_ours != t_theirs:
        out.append("another token layout (dtype or end-of-text id)")
    shard_notes = []
    for split in SPLITS:
        a = {s["file"]: s for s in ours["splits"][split]["shards"]}
        b = {s["file"]: s for s in theirs["splits"][split]["shards"]}
        if len(a) != len(b):
            out.append(f"{split}: {len(a)} shards here, {len(b)} in the run")
        for name in sorted(b.keys() - a.keys()):
            shard_notes.append(f"{name} missing here")
        for name in sorted(a.keys() - b.keys()):
            shard_notes.append(f"{name} not in the run's data")
        for name in sorted(a.keys() & b.keys()):
            if a[name]["tokens"] != b[name]["tokens"]:
                shard_notes.append(
                    f"{name}: {a[name]['tokens']:,} tokens here, {b[name]['tokens']:,} in the run"
                )
            elif a[name]["sha256"] != b[name]["sha256"]:
                shard_notes.append(f"{name}: other tokens (sha256 differs)")
    more = [f"{len(shard_notes) - 4} more shards"] if len(shard_notes) > 4 else []
    out += shard_notes[:4] + more
    if not out and ours != theirs:
        out.append("the text byte counts differ")
    return "; ".join(out) or "nothing (the same data)"
