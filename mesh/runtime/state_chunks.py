"""The pure parts of a chunked state download: entries, wire values, the chunk plan, manifests.

A stage's state is a list of entries ("flat", "drift", "opt/<param>/<key>"), each a tensor or a
Python number. On the wire it is ONE stream of float32 values, the entries back to back in
order, cut into chunks of `chunk_values` values (the last one shorter); the wire only carries
float32 (comms.wire.DType), so every entry is turned into float32 values that give back its
exact bits:
- float32, bfloat16, float16, uint8, int8, int16, bool: one value per element (an exact cast:
  8-bit optimizer codes stay integers 0..255);
- int32, int64, float64 and Python numbers (ints as int64, floats as float64: nadamw's
  mu_product is a Python float): the element's little-endian 16-bit words, one value each
  (0..65535, exact in float32), so no number loses a bit.
The manifest says what the stream holds: every entry (name, dtype, shape), the donor's step,
the chunk size, a blake2b digest of each chunk's bytes and one of the whole stream (of the
chunk digests in order). It travels
as JSON, one byte per float32 value, parsed strictly here (sizes first, then every field's type
and range) and never unpickled.

imports: torch and stdlib only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

FORMAT = 1
VALUE_BYTES = 4  # a float32 wire value
CHUNK_BYTES = 32 << 20  # default payload of one chunk
MIN_CHUNK_VALUES = 1 << 18  # 1 MiB: smaller chunks only cost round trips
CHUNKS_AT_LEAST = 64  # a small state still goes in this many chunks (see chunk_values_for)
# a chunk index, a chunk size or an id travel as float32 numbers in a request: exact below 2^24
REQUEST_NUMBERS = 1 << 24
MAX_CHUNK_VALUES = REQUEST_NUMBERS
MAX_CHUNKS = REQUEST_NUMBERS
MAX_ENTRIES = 1 << 16
MAX_NAME_CHARS = 512
MAX_NDIM = 8
MAX_TOTAL_VALUES = 1 << 40
MAX_MANIFEST_BYTES = 8 << 20
DIGEST_BYTES = 32
_HEX = re.compile(f"[0-9a-f]{{{2 * DIGEST_BYTES}}}")
_WORD = 1 << 16

# dtype name -> (element dtype on the host, wire values per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "float32": (torch.float32, 1),
    "bfloat16": (torch.bfloat16, 1),
    "float16": (torch.float16, 1),
    "uint8": (torch.uint8, 1),
    "int8": (torch.int8, 1),
    "int16": (torch.int16, 1),
    "bool": (torch.bool, 1),
    "int32": (torch.int32, 2),
    "int64": (torch.int64, 4),
    "float64": (torch.float64, 4),
    "int": (torch.int64, 4),  # a Python int
    "float": (torch.float64, 4),  # a Python float
}
_NAME_OF = {dt: name for name, (dt, _) in DTYPES.items() if name not in ("int", "float")}
_INT_RANGE = {"uint8": (0, 255), "int8": (-128, 127), "int16": (-(1 << 15), (1 << 15) - 1)}


class StateFormatError(ValueError):
    """A manifest, an entry or wire values that this stage cannot take."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # a DTYPES name
    shape: tuple[int, ...]  # () for a Python number

    @property
    def words(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def values(self) -> int:
        """Wire values of the entry."""
        return self.numel * self.words


def entry_for(name: str, value: torch.Tensor | int | float) -> Entry:
    """The entry of one state value; StateFormatError for a type the wire cannot carry."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _NAME_OF:
            raise StateFormatError(f"{name}: dtype {value.dtype} cannot be sent")
        return Entry(name, _NAME_OF[value.dtype], tuple(value.shape))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise StateFormatError(f"{name}: a {type(value).__name__} cannot be sent")
    return Entry(name, "int" if isinstance(value, int) else "float", ())


def number_tensor(entry: Entry, value: int | float) -> torch.Tensor:
    """A Python number as the one-element tensor its wire values come from."""
    return torch.tensor([value], dtype=DTYPES[entry.dtype][0])


def to_wire(x: torch.Tensor) -> torch.Tensor:
    """Float32 wire values of a flat run of elements (a view for contiguous float32 on the CPU)."""
    x = x.detach().reshape(-1).cpu()
    words = DTYPES[_NAME_OF[x.dtype]][1]
    if words == 1:
        return x.to(torch.float32)
    # little-endian host (as comms.wire): the element's bytes read as 16-bit words, low first
    return x.contiguous().view(torch.int16).to(torch.int32).bitwise_and_(_WORD - 1).float()


def from_wire(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """The elements whose wire values these are (values checked with wire_error first)."""
    dt, words = DTYPES[dtype]
    if words == 1:
        return values.to(dt)
    w = values.to(torch.int32)
    return torch.where(w >= _WORD // 2, w - _WORD, w).to(torch.int16).view(dt)


def wire_error(dtype: str, values: torch.Tensor) -> str | None:
    """Why these wire values (whole elements of a `dtype` entry) are not what to_wire makes of
    some elements (a donor's bug or lie, never adopted), or None."""
    if dtype == "float32":
        return None  # any finite float32 (comms.wire checked finiteness)
    if dtype in ("bfloat16", "float16"):
        exact = torch.equal(values.to(DTYPES[dtype][0]).float(), values)
        return None if exact else f"values that are not {dtype}"
    lo, hi = _INT_RANGE.get(dtype, (0, 1) if dtype == "bool" else (0, _WORD - 1))
    if values.numel() and not (
        torch.equal(values, values.trunc())
        and float(values.min()) >= lo
        and float(values.max()) <= hi
    ):
        return f"{dtype} values outside {lo}..{hi} or not integers"
    if values.numel() % DTYPES[dtype][1]:
        return "a split element"
    if dtype in ("float64", "float") and not bool(from_wire(values, dtype).isfinite().all()):
        return "non-finite values"
    return None


# ---- the plan: chunks over the stream, element-aligned pieces of each entry --------------------


def chunk_values_for(total_values: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Values per chunk: chunk_bytes of payload, less for a small state (at least
    CHUNKS_AT_LEAST chunks, none under MIN_CHUNK_VALUES), so the few chunks in flight on a
    joiner stay a small part of the state it holds."""
    cap = max(1, min(MAX_CHUNK_VALUES, chunk_bytes // VALUE_BYTES))
    return min(cap, max(MIN_CHUNK_VALUES, -(-total_values // CHUNKS_AT_LEAST)))


def chunk_count(total_values: int, chunk_values: int) -> int:
    return -(-total_values // chunk_values)


def chunk_range(total_values: int, chunk_values: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk `index` in the stream, in values."""
    start = index * chunk_values
    if not 0 <= start < total_values:
        raise StateFormatError(f"no chunk {index} in {total_values} values")
    return start, min(total_values, start + chunk_values)


def entry_offsets(entries: tuple[Entry, ...] | list[Entry]) -> list[int]:
    """Stream offset of each entry's first value."""
    out, at = [], 0
    for e in entries:
        out.append(at)
        at += e.values
    return out


def entry_pieces(entry: Entry, piece_values: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) runs of the entry's wire values, whole elements, each at most piece_values
    (or one element): what is converted and copied at a time, so no entry is copied whole."""
    step = max(entry.words, piece_values - piece_values % entry.words)
    for lo in range(0, entry.values, step):
        yield lo, min(entry.values, lo + step)


def new_hasher() -> Any:
    return hashlib.blake2b(digest_size=DIGEST_BYTES)


def digest(data: bytes | memoryview) -> str:
    h = new_hasher()
    h.update(data)
    return h.hexdigest()


def whole_digest(chunks: tuple[str, ...] | list[str]) -> str:
    """The whole stream's digest: of its chunks' digests in order (a hash list), so a byte is
    hashed once however it is checked."""
    return digest(b"".join(bytes.fromhex(c) for c in chunks))


class ChunkHasher:
    """The digests of a stream's chunks, fed the stream's bytes in order in pieces of any size
    (entry pieces and chunks do not share boundaries)."""

    def __init__(self, chunk_values: int) -> None:
        self.chunk_bytes = chunk_values * VALUE_BYTES
        self.digests: list[str] = []
        self._h, self._filled = new_hasher(), 0

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.chunk_bytes - self._filled)
            self._h.update(data[:take])
            self._filled, data = self._filled + take, data[take:]
            if self._filled == self.chunk_bytes:
                self._next()

    def finish(self) -> tuple[str, ...]:
        if self._filled:
            self._next()
        return tuple(self.digests)

    def _next(self) -> None:
        self.digests.append(self._h.hexdigest())
        self._h, self._filled = new_hasher(), 0


# ---- the manifest ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    step: int  # the donor's step when it took the snapshot
    snapshot: int  # the donor's id of the snapshot (what chunk requests name)
    chunk_values: int
    entries: tuple[Entry, ...]
    chunks: tuple[str, ...]  # hex blake2b of each chunk's bytes
    whole: str  # whole_digest(chunks)

    @property
    def total_values(self) -> int:
        return sum(e.values for e in self.entries)

    def chunk_range(self, index: int) -> tuple[int, int]:
        return chunk_range(self.total_values, self.chunk_values, index)

    @property
    def identity(self) -> tuple[object, ...]:
        """What two donors' manifests share when their chunks can be combined: the same
        bytes in the same chunks (the snapshot id is only a donor's handle)."""
        return (self.step, self.chunk_values, self.entries, self.chunks, self.whole)


def encode_manifest(m: Manifest) -> torch.Tensor:
    """The manifest as float32 values, one per byte of its JSON."""
    doc = {
        "format": FORMAT,
        "step": m.step,
        "snapshot": m.snapshot,
        "chunk_values": m.chunk_values,
        "entries": [[e.name, e.dtype, list(e.shape)] for e in m.entries],
        "chunks": list(m.chunks),
        "whole": m.whole,
    }
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if len(raw) > MAX_MANIFEST_BYTES:
        raise StateFormatError(f"manifest of {len(raw)} bytes > {MAX_MANIFEST_BYTES}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).float()


def decode_manifest(values: torch.Tensor) -> Manifest:
    """Parse a received manifest; StateFormatError on anything malformed."""
    if values.dtype != torch.float32 or values.dim() != 1:
        raise StateFormatError("a manifest is a 1-D float32 tensor")
    if not 0 < values.numel() <= MAX_MANIFEST_BYTES:
        raise StateFormatError(f"manifest of {values.numel()} bytes")
    if not (torch.equal(values, values.trunc()) and values.min() >= 0 and values.max() <= 255):
        raise StateFormatError("manifest values are not bytes")
    raw = bytes(values.to(torch.uint8).numpy())
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_refuse, object_pairs_hook=_unique)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateFormatError(f"manifest is not JSON ({e})") from None
    return _manifest_of(doc)


def _refuse(name: str) -> None:
    raise StateFormatError(f"{name} in a manifest")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise StateFormatError("a key repeated in a manifest")
    return out


def _int(doc: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = doc[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise StateFormatError(f"manifest {key} {v!r} is not an int in {lo}..{hi}")
    return v


def _hex(v: object, what: str) -> str:
    if not isinstance(v, str) or not _HEX.fullmatch(v):
        raise StateFormatError(f"{what} is not a {DIGEST_BYTES}-byte hex digest")
    return v


def _entry(e: object) -> Entry:
    if not (isinstance(e, list) and len(e) == 3):
        raise StateFormatError("a manifest entry is [name, dtype, shape]")
    name, dtype, shape = e
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise StateFormatError("an entry name is a short string")
    if dtype not in DTYPES:
        raise StateFormatError(f"entry {name}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise StateFormatError(f"entry {name}: shape is a list of <= {MAX_NDIM} dims")
    if any(
        isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_TOTAL_VALUES
        for d in shape
    ):
        raise StateFormatError(f"entry {name}: bad dims {shape}")
    if dtype in ("int", "float") and shape:
        raise StateFormatError(f"entry {name}: a number has shape []")
    return Entry(name, dtype, tuple(shape))


def _manifest_of(doc: object) -> Manifest:
    keys = {"format", "step", "snapshot", "chunk_values", "entries", "chunks", "whole"}
    if not isinstance(doc, dict) or set(doc) != keys:
        raise StateFormatError(f"manifest keys are not {sorted(keys)}")
    if doc["format"] != FORMAT:
        raise StateFormatError(f"manifest format {doc['format']!r}")
    step = _int(doc, "step", 0, (1 << 63) - 1)
    snapshot = _int(doc, "snapshot", 0, REQUEST_NUMBERS - 1)
    chunk_values = _int(doc, "chunk_values", 1, MAX_CHUNK_VALUES)
    if not isinstance(doc["entries"], list) or not 0 < len(doc["entries"]) <= MAX_ENTRIES:
        raise StateFormatError(f"a manifest has 1..{MAX_ENTRIES} entries")
    entries = tuple(_entry(e) for e in doc["entries"])
    if len({e.name for e in entries}) != len(entries):
        raise StateFormatError("an entry name repeated")
    total = 0
    for e in entries:  # summed one by one: a huge shape stops it before the next
        total += e.values
        if total > MAX_TOTAL_VALUES:
            raise StateFormatError(f"a state of more than {MAX_TOTAL_VALUES} values")
    if total == 0:
        raise StateFormatError("an empty state")
    chunks = doc["chunks"]
    n = chunk_count(total, chunk_values)
    if n > MAX_CHUNKS or not isinstance(chunks, list) or len(chunks) != n:
        raise StateFormatError(f"{total} values in chunks of {chunk_values} are {n} chunks")
    digests = tuple(_hex(c, f"chunk digest {i}") for i, c in enumerate(chunks))
    whole = _hex(doc["whole"], "whole")
    if whole != whole_digest(digests):
        raise StateFormatError("the whole digest is not that of the chunk digests")
    return Manifest(step, snapshot, chunk_values, entries, digests, whole)
