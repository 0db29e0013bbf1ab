"""The digest that trails every checkpoint (format 3): a SHA-256 of every byte torch.save wrote,
hashed as it is written (no copy, no second pass), in the same file so one rename publishes
both; a check reads the file once. mesh/runtime/checkpoint.py writes and checks with it."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

# hex, so the trailer never holds the zip's end-of-directory signature ("PK\5\6", which zip
# readers look for from the end of the file): torch.load and zipfile read the file as before
DIGEST_TAG = b"\nmeshtrain-checkpoint sha256 "
DIGEST_HEX = 64
TRAILER_BYTES = len(DIGEST_TAG) + DIGEST_HEX + 1  # and a newline
READ_BLOCK = 8 << 20  # bytes hashed at once when a digest is checked
PARALLEL_BYTES = 1 << 20  # a write this large is hashed beside its write (DigestWriter)


def _hasher() -> Any:
    return hashlib.sha256()


class DigestWriter:
    """A file's write() that hashes what it writes (torch.save hands it views of the tensors'
    own memory: nothing is copied), then `trailer()`: the digest line that ends the file. A
    large write is hashed on `pool`'s thread while it is written (SHA-256 and a file write both
    let go of the GIL on a large buffer: the hash costs no wall time where a core is free), and
    done before write() returns: the buffer may be a temporary of torch's (a GPU tensor's host
    copy), and the hash takes the writes in order."""

    def __init__(self, f: Any, pool: ThreadPoolExecutor | None = None) -> None:
        self.f, self.hash, self.pool = f, _hasher(), pool

    def write(self, data: Any) -> int:
        if self.pool is None or memoryview(data).nbytes < PARALLEL_BYTES:
            self.hash.update(data)
            return self.f.write(data)
        hashed = self.pool.submit(self.hash.update, data)
        try:
            return self.f.write(data)
        finally:
            hashed.result()

    def flush(self) -> None:
        self.f.flush()

    def trailer(self) -> bytes:
        return DIGEST_TAG + self.hash.hexdigest().encode() + b"\n"


def write_digested(obj: Any, f: Any) -> None:
    """torch.save(obj) into the open file f, then the line with the digest of what it wrote."""
    with ThreadPoolExecutor(1, thread_name_prefix="digest") as pool:
        out = DigestWriter(f, pool)
        torch.save(obj, out)
    f.write(out.trailer())


def digest_problem(path: Path) -> str | None:
    """Why the file's bytes are not the ones its save wrote ("no digest": none trails it), or
    None when they are. Reads the file once, a block at a time into two buffers (the next
    block is read while this one is hashed; no copy of the file is held)."""
    with open(path, "rb") as f, ThreadPoolExecutor(1, thread_name_prefix="digest") as pool:
        size = f.seek(0, os.SEEK_END)
        if size < TRAILER_BYTES:
            return "no digest"
        f.seek(size - TRAILER_BYTES)
        tail = f.read(TRAILER_BYTES)
        if not tail.startswith(DIGEST_TAG) or not tail.endswith(b"\n"):
            return "no digest"
        want = tail[len(DIGEST_TAG) : -1]
        h, left = _hasher(), size - TRAILER_BYTES
        views = [memoryview(bytearray(READ_BLOCK)), memoryview(bytearray(READ_BLOCK))]
        f.seek(0)
        k, reading = 0, pool.submit(f.readinto, views[0][: min(READ_BLOCK, left)])
        while left > 0:
            n = reading.result()
            if not n:
                return "shorter than it was written"
            left -= n
            if left > 0:
                reading = pool.submit(f.readinto, views[1 - k][: min(READ_BLOCK, left)])
            h.update(views[k][:n])
            k = 1 - k
    return None if h.hexdigest().encode() == want else "digest mismatch"


DAMAGED = "its bytes do not match the digest saved with it: damaged since the save"
