"""Message framing: one named tensor + metadata <-> bytes, and a pure, total decoder.

Role: `pack` frames an `Encoded` tensor; `unpack` turns ANY bytes into a `Message` or a `Reject`
(never raises). Sizes are checked against the buffer and `Expect.max_body_bytes` before anything
is allocated, the body is crc32-checked, and by default the payload is decoded and rejected if
not finite. Peer bytes are only ever read as raw numbers: no pickle, torch.load, eval or exec.

Layout (little-endian), body right after the header:
  magic b"MSHT" | version u8 (=1) | kind u8 | codec u8 (index in CODECS) | dtype u8 (decoded
  dtype, DType) | ndim u8 (<= 8) | block_size u32 | sender_step i64 | name_len u16 | name utf-8
  (<= 256 bytes) | dims ndim x i64 (>= 0) | data_len u64 | scales_len u64 | crc32(body) u32
  body = data bytes (codec's data dtype; a 4-bit codec packs two values a byte) then scale
  bytes (fp32, blocked codecs only).
Tensor bytes are little-endian too: they are read in place with torch.frombuffer, which uses
the host order (x86, ARM); a big-endian host would need a byteswap here.

imports: torch only (no mesh, no cli).
"""

from __future__ import annotations

import struct
import threading
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from comms import codecs
from comms.codecs import CODECS, Encoded
from comms.errors import CodecError, NotFiniteError, WireError, WireReject

MAGIC = b"MSHT"
VERSION = 1
MAX_NDIM = 8
MAX_NAME_BYTES = 256
_FIXED = struct.Struct("<4sBBBBBIqH")  # magic .. name_len
_TAIL = struct.Struct("<QQI")  # data_len, scales_len, crc32
_I64 = (-(1 << 63), (1 << 63) - 1)
# The longest header a valid frame can have: a transport reads this much (or the whole frame if
# shorter) to learn what the message will cost before it reads, or reserves room for, the body.
MAX_HEADER_BYTES = _FIXED.size + MAX_NAME_BYTES + 8 * MAX_NDIM + _TAIL.size


class Kind(IntEnum):
    ACTIVATION = 1
    GRADIENT = 2
    AVERAGE = 3
    STATE = 4
    CONTROL = 5


class DType(IntEnum):
    """dtype of the decoded tensor; only float32 today, a byte on the wire so it can grow."""

    FLOAT32 = 1


# Every reason unpack can return; tests assert each is reachable.
REASONS: frozenset[str] = frozenset(
    {
        "not_bytes",
        "truncated",
        "bad_magic",
        "bad_version",
        "bad_kind",
        "unknown_codec",
        "unknown_dtype",
        "bad_ndim",
        "bad_block_size",
        "bad_name",
        "bad_shape",
        "too_large",
        "length_mismatch",
        "unexpected_name",
        "unexpected_kind",
        "unexpected_shape",
        "unexpected_codec",
        "bad_checksum",
        "bad_payload",
        "not_finite",
        "malformed",
    }
)


@dataclass(frozen=True)
class Expect:
    """What the receiver is willing to accept; None means "any"."""

    name: str | None = None
    kind: Kind | None = None
    shape: tuple[int, ...] | None = None
    codecs: frozenset[str] | None = None
    max_body_bytes: int = 1 << 30


@dataclass(frozen=True)
class Reject:
    reason: str  # short stable code, one of REASONS
    detail: str = ""


@dataclass(frozen=True, eq=False)  # eq=False: holds tensors
class Message:
    """A validated message. `encoded.data` may alias the received buffer: do not write to it."""

    name: str
    kind: Kind
    sender_step: int
    encoded: Encoded
    _decoded: torch.Tensor | None = field(default=None, repr=False)

    @property
    def held_bytes(self) -> int:
        """What holding this message costs: the body (which `encoded` aliases) plus the decoded
        float32 copy when unpack made one. Mailboxes bound this, not the frame: an fp8 frame
        decodes to four times its size."""
        decoded = 0 if self._decoded is None else self._decoded.numel() * 4
        return self.encoded.nbytes + decoded

    def tensor(self) -> torch.Tensor:
        """The decoded float32 tensor (finite-checked). When unpack already decoded it, the
        same tensor is returned on every call."""
        if self._decoded is not None:
            return self._decoded
        return codecs.decode(self.encoded)


def pack(name: str, kind: Kind, enc: Encoded, sender_step: int) -> bytes:
    """Frame enc as one message. Raises WireError/CodecError on inputs no receiver would accept."""
    name_b = name.encode("utf-8") if isinstance(name, str) else None
    if name_b is None or len(name_b) > MAX_NAME_BYTES:
        raise WireError(f"name must be a str of <= {MAX_NAME_BYTES} utf-8 bytes")
    try:
        kind = Kind(kind)
    except ValueError as e:
        raise WireError(f"unknown kind {kind!r}") from e
    if not isinstance(sender_step, int) or not _I64[0] <= sender_step <= _I64[1]:
        raise WireError(f"sender_step must fit in an i64, got {sender_step!r}")
    codecs.check_encoded(enc)  # never send what the receiver would reject as malformed
    if len(enc.shape) > MAX_NDIM:
        raise WireError(f"ndim {len(enc.shape)} > {MAX_NDIM}")
    data = _as_bytes(enc.data)
    scales = _as_bytes(enc.scales) if enc.scales is not None else memoryview(b"")
    crc = zlib.crc32(scales, zlib.crc32(data))
    head = _FIXED.pack(
        MAGIC,
        VERSION,
        int(kind),
        CODECS.index(enc.codec),
        int(DType.FLOAT32),
        len(enc.shape),
        enc.block_size,
        sender_step,
        len(name_b),
    )
    dims = struct.pack(f"<{len(enc.shape)}q", *enc.shape)
    tail = _TAIL.pack(len(data), len(scales), crc)
    return b"".join((head, name_b, dims, tail, data, scales))


def pack_tensor(
    name: str,
    kind: Kind,
    x: torch.Tensor,
    codec: str,
    sender_step: int,
    block_size: int = codecs.DEFAULT_BLOCK_SIZE,
) -> bytes:
    """encode + pack. Raises CodecError on non-finite x (checked before any cast)."""
    return pack(name, kind, codecs.encode(x, codec, block_size), sender_step)


def unpack(
    buf: bytes | bytearray | memoryview,
    expect: Expect | None = None,
    *,
    check_finite: bool = True,
) -> Message | Reject:
    """Parse and validate one message. Never raises. With check_finite (default) the payload is
    decoded here and a NaN/Inf anywhere rejects it as "not_finite"."""
    try:
        return _unpack(buf, expect or Expect(), check_finite)
    except Exception as e:  # noqa: BLE001 - total by contract; the checks above should prevent it
        return Reject("malformed", f"{type(e).__name__}: {e}"[:200])


def unpack_or_raise(buf: bytes | bytearray | memoryview, expect: Expect | None = None) -> Message:
    """unpack, raising WireReject(reason, detail) instead of returning a Reject."""
    r = unpack(buf, expect)
    if isinstance(r, Reject):
        raise WireReject(r.reason, r.detail)
    return r


def held_bytes(
    head: bytes | bytearray | memoryview,
    *,
    decoded: bool = True,
    max_body_bytes: int | None = None,
) -> int | Reject:
    """What a message will cost its receiver once unpacked (Message.held_bytes), read from the
    first bytes of its frame (at least its header; MAX_HEADER_BYTES always suffice): body bytes
    plus, when unpack decodes (check_finite), 4 bytes per value. A Reject when the header is not
    one a valid frame has (or declares a body over max_body_bytes: "too_large", as unpack
    says); the body is not looked at (unpack checks it)."""
    try:
        h = _header(memoryview(head).cast("B"), max_body_bytes)
    except Exception as e:  # noqa: BLE001 - total like unpack
        return Reject("malformed", f"{type(e).__name__}: {e}"[:200])
    if isinstance(h, Reject):
        return h
    return h.data_len + h.scales_len + (4 * h.numel if decoded else 0)


def frame_label(head: bytes | bytearray | memoryview) -> tuple[Kind, str] | None:
    """The kind and name a frame's header declares (its first bytes, as held_bytes reads
    them), or None when the header is not one a valid frame has: what a receiver that rejected
    the frame's body can still say about it (the body was not valid, the label is the
    sender's claim; the stream it came on says who the sender is)."""
    try:
        h = _header(memoryview(head).cast("B"))
    except Exception:  # noqa: BLE001 - total like unpack
        return None
    return None if isinstance(h, Reject) else (Kind(h.kind), h.name)


def expect_reject(msg: Message, expect: Expect) -> Reject | None:
    """The metadata checks of unpack, for a message already validated on arrival (transports
    validate bytes as they arrive, then match what a receiver expects when it asks)."""
    if expect.name is not None and msg.name != expect.name:
        return Reject("unexpected_name", f"{msg.name!r} != {expect.name!r}")
    if expect.kind is not None and msg.kind != expect.kind:
        return Reject("unexpected_kind", f"{msg.kind.name} != {Kind(expect.kind).name}")
    if expect.shape is not None and msg.encoded.shape != tuple(expect.shape):
        return Reject("unexpected_shape", f"{msg.encoded.shape} != {tuple(expect.shape)}")
    if expect.codecs is not None and msg.encoded.codec not in expect.codecs:
        return Reject("unexpected_codec", msg.encoded.codec)
    if msg.encoded.nbytes > expect.max_body_bytes:
        return Reject("too_large", f"body {msg.encoded.nbytes} > {expect.max_body_bytes}")
    return None


class RejectCounter:
    """Thread-safe count of rejects by reason (for metrics and for excluding noisy senders)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, reject: Reject | str) -> None:
        reason = reject.reason if isinstance(reject, Reject) else str(reject)
        with self._lock:
            self._counts[reason] += 1

    def observe(self, result: Message | Reject) -> Message | Reject:
        """Count result if it is a Reject; return it unchanged (for `c.observe(unpack(b))`)."""
        if isinstance(result, Reject):
            self.add(result)
        return result

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


@dataclass(frozen=True)
class _Header:
    kind: int
    codec: str
    block_size: int
    step: int
    name: str
    shape: tuple[int, ...]
    numel: int
    data_len: int
    scales_len: int
    crc: int
    body_at: int


def _header(mv: memoryview, max_body_bytes: int | None = None) -> _Header | Reject:
    """The frame header's fields, every size checked against the codec's and the bound, all in
    Python ints (nothing is allocated)."""
    size = len(mv)
    if size < len(MAGIC):
        return Reject("truncated", f"{size} bytes")
    if mv[:4] != MAGIC:
        return Reject("bad_magic", repr(bytes(mv[:4])))
    if size < _FIXED.size:
        return Reject("truncated", f"{size} bytes < fixed header {_FIXED.size}")
    _, version, kind, codec_id, dtype_id, ndim, block_size, step, name_len = _FIXED.unpack_from(mv)
    if version != VERSION:
        return Reject("bad_version", str(version))
    if kind not in Kind._value2member_map_:
        return Reject("bad_kind", str(kind))
    if codec_id >= len(CODECS):
        return Reject("unknown_codec", str(codec_id))
    codec = CODECS[codec_id]
    if dtype_id not in DType._value2member_map_:
        return Reject("unknown_dtype", str(dtype_id))
    if ndim > MAX_NDIM:
        return Reject("bad_ndim", str(ndim))
    try:
        codecs.check_block_size(codec, block_size)
    except CodecError as e:
        return Reject("bad_block_size", str(e))
    if name_len > MAX_NAME_BYTES:
        return Reject("bad_name", f"name_len {name_len}")

    body_at = _FIXED.size + name_len + 8 * ndim + _TAIL.size
    if size < body_at:
        return Reject("truncated", f"{size} bytes < header {body_at}")
    off = _FIXED.size
    try:
        name = bytes(mv[off : off + name_len]).decode("utf-8")
    except UnicodeDecodeError as e:
        return Reject("bad_name", str(e))
    off += name_len
    shape = struct.unpack_from(f"<{ndim}q", mv, off)
    off += 8 * ndim
    data_len, scales_len, crc = _TAIL.unpack_from(mv, off)
    try:
        numel = codecs.check_shape(shape)
    except CodecError as e:
        return Reject("bad_shape", str(e))
    want_data = codecs.data_nbytes(numel, codec)
    want_scales = 4 * codecs.num_blocks(numel, block_size) if codecs.is_blocked(codec) else 0
    if max_body_bytes is not None and (
        data_len + scales_len > max_body_bytes or want_data > max_body_bytes
    ):
        return Reject("too_large", f"body {data_len}+{scales_len}, shape {shape}")
    if data_len != want_data or scales_len != want_scales:
        return Reject(
            "length_mismatch",
            f"{codec} {shape}: data {data_len} != {want_data} or scales {scales_len} != "
            f"{want_scales}",
        )
    return _Header(
        kind, codec, block_size, step, name, shape, numel, data_len, scales_len, crc, body_at
    )


def _unpack(buf: object, expect: Expect, check_finite: bool) -> Message | Reject:
    if not isinstance(buf, bytes | bytearray | memoryview):
        return Reject("not_bytes", type(buf).__name__)
    mv = memoryview(buf)
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())  # a strided view: crc32 and frombuffer need one block
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")  # e.g. a view of floats or signed chars: compare and read as bytes
    size = len(mv)
    h = _header(mv, expect.max_body_bytes)
    if isinstance(h, Reject):
        return h
    kind, codec, block_size, step, name, shape = (
        h.kind,
        h.codec,
        h.block_size,
        h.step,
        h.name,
        h.shape,
    )
    data_len, scales_len, crc, body_at = h.data_len, h.scales_len, h.crc, h.body_at
    end = body_at + data_len + scales_len
    if size < end:
        return Reject("truncated", f"{size} bytes < {end}")
    if size > end:
        return Reject("length_mismatch", f"{size - end} trailing bytes")

    if expect.name is not None and name != expect.name:
        return Reject("unexpected_name", f"{name!r} != {expect.name!r}")
    if expect.kind is not None and kind != expect.kind:
        return Reject("unexpected_kind", f"{Kind(kind).name} != {Kind(expect.kind).name}")
    if expect.shape is not None and shape != tuple(expect.shape):
        return Reject("unexpected_shape", f"{shape} != {tuple(expect.shape)}")
    if expect.codecs is not None and codec not in expect.codecs:
        return Reject("unexpected_codec", codec)
    if zlib.crc32(mv[body_at:end]) != crc:
        return Reject("bad_checksum", f"crc32 != {crc:#010x}")

    dtype = codecs.data_dtype(codec)
    data = _view(mv, dtype, data_len // dtype.itemsize, body_at)
    scales = None
    if codecs.is_blocked(codec):
        scales = _view(mv, torch.float32, scales_len // 4, body_at + data_len)
    enc = Encoded(codec, shape, data, scales, block_size)
    decoded = None
    try:
        codecs.check_encoded(enc)
        if check_finite:
            decoded = codecs.decode(enc)
    except NotFiniteError as e:
        return Reject("not_finite", str(e))
    except CodecError as e:
        return Reject("bad_payload", str(e))
    return Message(name, Kind(kind), step, enc, decoded)


def _view(buf: memoryview, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    """Copy-free tensor over buf[offset:]; may be unaligned (fine on CPU for reads)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)  # frombuffer refuses count == 0
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a tensor (CPU, contiguous) without going through numpy dtypes (no fp8/bf16)."""
    u8 = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return memoryview(u8.numpy())


# torch warns once per process that tensors over read-only buffers (bytes) are writable. Spend
# that one warning here, silenced: we never write through those views, decode copies.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)
