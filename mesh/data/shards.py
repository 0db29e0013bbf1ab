"""Token shards: flat little-endian uint16 (uint32 for vocabularies above 65,536) arrays, written
in bounded buffers with their sha256 taken on the way, and read back through np.memmap, so a
peer's memory holds the windows it reads, not the dataset.

imports: numpy, stdlib, mesh.errors; torch only where windows are read (`data prepare` never
loads it).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mesh.errors import DataError

if TYPE_CHECKING:
    import torch

BUFFER_TOKENS = 1 << 20  # tokens held before a write
HASH_CHUNK_BYTES = 16 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


class ShardWriter:
    """Appends token arrays to DIR/<split>-NNNNN.bin, a new file every `shard_tokens` tokens."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.dir, self.split, self.dtype, self.limit = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []  # {"file", "tokens", "sha256", "max_id"} of closed shards
        self._buf: list[np.ndarray] = []
        self._buffered = 0
        self._file = None
        self._hash = hashlib.sha256()
        self._in_shard = 0
        self._max_id = -1  # the largest token id in the open shard

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self._in_shard + self._buffered

    def write(self, tokens: np.ndarray) -> None:
        self._buf.append(tokens)
        self._buffered += len(tokens)
        if self._buffered >= BUFFER_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if not self._buffered:
            return
        data = np.concatenate(self._buf).astype(self.dtype, copy=False)
        self._buf, self._buffered = [], 0
        while len(data):
            if self._file is None:
                self._file = (self.dir / shard_name(self.split, len(self.shards))).open("wb")
            take = min(len(data), self.limit - self._in_shard)
            raw = data[:take].tobytes()
            if take:
                self._max_id = max(self._max_id, int(data[:take].max()))
            self._file.write(raw)
            self._hash.update(raw)
            self._in_shard += take
            data = data[take:]
            if self._in_shard == self.limit:
                self._close_shard()

    def _close_shard(self) -> None:
        assert self._file is not None
        self._file.close()
        name = Path(self._file.name).name
        self.shards.append(
            {
                "file": name,
                "tokens": self._in_shard,
                "sha256": self._hash.hexdigest(),
                "max_id": self._max_id,  # checked against the vocabulary at open, no scan
            }
        )
        self._file, self._hash, self._in_shard, self._max_id = None, hashlib.sha256(), 0, -1

    def close(self) -> list[dict]:
        self._flush()
        if self._file is not None:
            self._close_shard()
        return self.shards


def file_sha256(path: Path) -> str:
    """A file's sha256, read in chunks (plain reads: the page cache is not this process's
    memory, as a memory map's touched pages would be)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


class Tokens:
    """One token sequence held as consecutive arrays (a text's bytes, or a split's shards as
    memory maps): its length and windows at any offsets, across array ends.

    vocab_size (with the parts' names): every window read is checked to hold ids below it, a
    DataError naming the shard otherwise (a shard replaced by one of the same size, which only
    hashing would tell): one comparison per token read, against an IndexError deep in a step."""

    def __init__(
        self,
        parts: list[np.ndarray],
        vocab_size: int | None = None,
        names: list[str] | None = None,
    ) -> None:
        keep = [k for k, p in enumerate(parts) if len(p)]
        self.parts = [parts[k] for k in keep]
        self.names = [names[k] for k in keep] if names is not None else None
        self.vocab_size = vocab_size
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + len(p))

    def __len__(self) -> int:
        return self.starts[-1]

    def max(self) -> int:
        """The largest id (reads every token: for in-memory text, not a dataset)."""
        return max(int(p.max()) for p in self.parts)

    def windows(self, offsets: torch.Tensor, n: int) -> torch.Tensor:
        """(len(offsets), n) int64: tokens[o : o + n] for each offset o."""
        import torch

        if len(self.parts) == 1:
            idx = offsets.numpy()[:, None] + np.arange(n)
            return torch.from_numpy(self._checked(self.parts[0][idx].astype(np.int64), offsets))
        out = np.empty((len(offsets), n), dtype=np.int64)
        for row, offset in enumerate(offsets.tolist()):
            k = bisect_right(self.starts, offset) - 1
            pos, filled = offset - self.starts[k], 0
            while filled < n:
                take = min(n - filled, len(self.parts[k]) - pos)
                out[row, filled : filled + take] = self.parts[k][pos : pos + take]
                filled, k, pos = filled + take, k + 1, 0
        return torch.from_numpy(self._checked(out, offsets))

    def _checked(self, out: np.ndarray, offsets: torch.Tensor) -> np.ndarray:
        """`out` (windows at `offsets`) when every id is in the vocabulary; DataError naming
        the shard and the position of the first that is not."""
        if self.vocab_size is None or not out.size or int(out.max()) < self.vocab_size:
            return out
        row, col = (int(x) for x in np.argwhere(out >= self.vocab_size)[0])
        at = int(offsets[row]) + col
        k = bisect_right(self.starts, at) - 1
        name = self.names[k] if self.names is not None else f"part {k}"
        raise DataError(
            f"{name}: token {at - self.starts[k]:,} is id {int(out[row, col])}, outside the "
            f"tokenizer's vocabulary of {self.vocab_size}: a corrupted or replaced shard; check "
            "it with `meshtrain data verify` and copy or prepare the dataset again"
        )
