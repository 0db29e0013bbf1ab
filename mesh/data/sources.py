"""The documents of `data prepare`'s inputs, streamed: .txt, .jsonl, .jsonl.gz, .parquet files,
directories of them and glob patterns.

A .txt file is one document, read in pieces of about PIECE_BYTES cut after a newline that a
non-space character follows, or before a space between two words (a byte-level BPE never merges
across such a cut, so the pieces tokenize to the same ids as the whole); a line that is not
UTF-8 is dropped and counted. A
.jsonl line, or a .parquet row, is one document: its text field. A bad record (not UTF-8,
malformed JSON, no such field, not a string, empty) is counted with its file and line and
skipped; a file with no usable record at all is an error.

imports: pyarrow (lazily, for parquet), mesh.errors.
"""

from __future__ import annotations

import glob
import gzip
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mesh.errors import DataError, need_extra

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
PIECE_BYTES = 1 << 20
PARQUET_ROWS = 1024
EXAMPLES = 20  # rejected records listed by file and line (all are counted)
_CUT = re.compile(rb"\n(?=[^\s])")  # a newline followed by a non-space (ASCII sense)
_WORD_CUT = re.compile(rb"(?<=[^\s]) (?=[^\s])")  # a space between two words


def kind_of(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files of the supported kinds named by INPUT arguments (files, directories searched
    recursively, glob patterns), sorted within each argument, each once."""
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and kind_of(f))
            if not found:
                raise DataError(f"{item}: no {', '.join(SUFFIXES)} files in this directory")
        elif p.is_file():
            if kind_of(p) is None:
                raise DataError(f"{item}: not a {', '.join(SUFFIXES)} file")
            found = [p]
        elif glob.has_magic(item):
            found = sorted(Path(f) for f in glob.glob(item, recursive=True) if kind_of(Path(f)))
            if not found:
                raise DataError(f"{item}: the pattern matches no {', '.join(SUFFIXES)} file")
        else:
            raise DataError(
                f"{item}: no such file or directory; give {', '.join(SUFFIXES)} files, "
                "directories of them or glob patterns"
            )
        out += [f for f in found if f not in out]
    return out


@dataclass
class Rejects:
    """Bad records: counted by reason, the first EXAMPLES listed as `file:line: reason`."""

    by_reason: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def add(self, path: Path, line: int, reason: str) -> None:
        self.by_reason[reason] += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(f"{path}:{line}: {reason}")

    @property
    def count(self) -> int:
        return sum(self.by_reason.values())

    def as_dict(self) -> dict:
        return {
            "count": self.count,
            "by_reason": dict(sorted(self.by_reason.items())),
            "examples": self.examples,
        }


@dataclass(frozen=True)
class Piece:
    """Text of one document (or a piece of a long one). doc_bytes: set on a document's first
    piece, its size in bytes (a .txt file's size); nbytes: this piece's UTF-8 bytes; advanced:
    input bytes consumed since the previous piece (for the progress bar)."""

    text: str
    doc_bytes: int | None
    nbytes: int
    advanced: int


def read_pieces(path: Path, text_field: str, rejects: Rejects) -> Iterator[Piece]:
    """Every usable document of one input file; DataError when it has none."""
    kind = kind_of(path)
    if kind == ".txt":
        reader = _txt(path, rejects)
    elif kind == ".parquet":
        reader = _parquet(path, text_field, rejects)
    else:
        reader = _jsonl(path, text_field, rejects)
    usable = 0
    for piece in reader:
        usable += piece.doc_bytes is not None
        yield piece
    if not usable:
        raise DataError(
            f"{path}: no usable document (see the rejected records above or in the manifest); "
            "fix the file or leave it out"
        )


def _txt(path: Path, rejects: Rejects) -> Iterator[Piece]:
    size = path.stat().st_size
    first, line, carry = True, 1, b""
    with path.open("rb") as f:
        while True:
            chunk = f.read(PIECE_BYTES)
            data = carry + chunk
            if not chunk:
                head, carry = data, b""
            else:
                cut = _last_cut(data)
                head, carry = data[:cut], data[cut:]
            if head:
                text, nbytes = _decode_lines(head, path, line, rejects)
                line += head.count(b"\n")
                if text:
                    yield Piece(text, size if first else None, nbytes, len(head))
                    first = False
            if not chunk:
                return


def _last_cut(data: bytes) -> int:
    """Where a piece may end without changing how a byte-level BPE splits the text into words:
    after the newline before a non-space, else before a space between two words (the last of
    either); with neither in a buffer of twice PIECE_BYTES, at its last character boundary
    (memory stays bounded; only such a space-free run may tokenize differently). 0: read on."""
    tail = max(0, len(data) - PIECE_BYTES)  # search the newest part only (a long carry)
    for pattern, at in ((_CUT, "end"), (_WORD_CUT, "start")):
        found = None
        for m in pattern.finditer(data, tail):
            found = getattr(m, at)()
        if found:
            return found
    if len(data) < 2 * PIECE_BYTES:
        return 0
    cut = len(data) - 1
    while cut > 0 and data[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte: back up
        cut -= 1
    return cut  # the next piece starts with a whole character


def _decode_lines(data: bytes, path: Path, first_line: int, rejects: Rejects) -> tuple[str, int]:
    """(text, its UTF-8 bytes): lines that are not UTF-8 dropped and counted."""
    try:
        return data.decode("utf-8"), len(data)
    except UnicodeDecodeError:
        pass
    good = []
    for k, raw in enumerate(data.split(b"\n")):
        try:
            good.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            rejects.add(path, first_line + k, f"not UTF-8 (byte {e.start} of the line)")
    text = "\n".join(good)
    return text, len(text.encode("utf-8"))


def _jsonl(path: Path, text_field: str, rejects: Rejects) -> Iterator[Piece]:
    gz = path.name.lower().endswith(".gz")
    with path.open("rb") as raw_file:
        f = gzip.GzipFile(fileobj=raw_file) if gz else raw_file
        pos, n = 0, 0
        try:
            for n, raw in enumerate(f, 1):
                now = raw_file.tell() if gz else pos + len(raw)
                advanced, pos = now - pos, now
                if not raw.strip():
                    continue
                text = _record_text(raw, text_field)
                if isinstance(text, _Bad):
                    rejects.add(path, n, text.reason)
                    continue
                nbytes = len(text.encode("utf-8"))
                yield Piece(text, nbytes, nbytes, advanced)
        except (OSError, EOFError) as e:  # a damaged or cut .gz: what came before counts
            rejects.add(path, n + 1, f"unreadable gzip stream ({e})")


@dataclass(frozen=True)
class _Bad:
    reason: str


def _record_text(raw: bytes, text_field: str) -> str | _Bad:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _Bad(f"not UTF-8 (byte {e.start})")
    try:
        record = json.loads(line)
    except ValueError:
        return _Bad("malformed JSON")
    return _field_text(record, text_field)


def _field_text(record: object, text_field: str) -> str | _Bad:
    if not isinstance(record, dict):
        return _Bad("not a JSON object")
    if text_field not in record:
        return _Bad(f"no {text_field!r} field (--text-field)")
    return _text_value(record[text_field], text_field)


def _text_value(value: object, text_field: str) -> str | _Bad:
    if value is None:
        return _Bad(f"{text_field!r} is null")
    if not isinstance(value, str):
        return _Bad(f"{text_field!r} is not a string")
    if not value:
        return _Bad(f"{text_field!r} is empty")
    return value


def _parquet(path: Path, text_field: str, rejects: Rejects) -> Iterator[Piece]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise need_extra("pyarrow", f"reading {path.name} (parquet)") from None

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise DataError(
            f"{path}: no column {text_field!r} (it has {', '.join(names)}); pick one with "
            "--text-field"
        )
    kind = pf.schema_arrow.field(text_field).type
    text_types = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
    if not any(is_text(kind) for is_text in text_types):
        raise DataError(f"{path}: column {text_field!r} holds {kind}, not text; see --text-field")
    size, rows = path.stat().st_size, max(1, pf.metadata.num_rows)
    row, done = 0, 0
    for batch in pf.iter_batches(batch_size=PARQUET_ROWS, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            row += 1
            text = _text_value(value, text_field)
            advanced = size * row // rows - done
            done += advanced
            if isinstance(text, _Bad):
                rejects.add(path, row, text.reason)
                continue
            nbytes = len(text.encode("utf-8"))
            yield Piece(text, nbytes, nbytes, advanced)
