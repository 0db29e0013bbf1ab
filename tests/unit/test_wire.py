"""Unit tests for comms/wire.py: round trips, every reject reason, fuzzing, no deserialization."""

from __future__ import annotations

import ast
import inspect
import io
import itertools
import math
import pickle
import struct
import threading
import tracemalloc
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comms import codecs, wire
from comms.codecs import CODECS, Encoded, encode, roundtrip
from comms.errors import CodecError, WireError, WireReject
from comms.wire import (
    REASONS,
    Expect,
    Kind,
    Message,
    Reject,
    RejectCounter,
    pack,
    pack_tensor,
    unpack,
    unpack_or_raise,
)

FUZZ = settings(
    max_examples=1000,
    deadline=None,
    database=None,  # no .hypothesis/ directory in a shared working tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def raw(
    *,
    magic: bytes = b"MSHT",
    version: int = 1,
    kind: int = 2,
    codec_id: int = 0,
    dtype: int = 1,
    ndim: int | None = None,
    block_size: int = 128,
    step: int = 0,
    name: bytes = b"w",
    name_len: int | None = None,
    dims: tuple[int, ...] = (4,),
    data_len: int | None = None,
    scales_len: int | None = None,
    crc: int | None = None,
    body: bytes | None = None,
) -> bytes:
    """A message built field by field; defaults form a valid all-zero message."""
    codec = CODECS[codec_id] if codec_id < len(CODECS) else "fp32"
    n = math.prod(dims) if all(d >= 0 for d in dims) else 0
    want_data = codecs.data_nbytes(n, codec)
    want_scales = 4 * codecs.num_blocks(n, max(block_size, 1)) if codecs.is_blocked(codec) else 0
    data_len = min(want_data, 2**64 - 1) if data_len is None else data_len
    scales_len = min(want_scales, 2**64 - 1) if scales_len is None else scales_len
    if body is None:  # the builder must not allocate what a hostile header declares
        body = bytes(data_len + scales_len) if data_len + scales_len < 1 << 20 else b""
    crc = zlib.crc32(body) if crc is None else crc
    head = struct.pack(
        "<4sBBBBBIqH",
        magic,
        version,
        kind,
        codec_id,
        dtype,
        len(dims) if ndim is None else ndim,
        block_size,
        step,
        len(name) if name_len is None else name_len,
    )
    tail = struct.pack("<QQI", data_len, scales_len, crc)
    return head + name + struct.pack(f"<{len(dims)}q", *dims) + tail + body


def reason(result: Message | Reject) -> str:
    return result.reason if isinstance(result, Reject) else "ok"


def assert_total(result: object) -> None:
    """unpack's contract on arbitrary input: a Message (finite) or a known, non-fallback Reject."""
    assert isinstance(result, Message | Reject)
    if isinstance(result, Reject):
        assert result.reason in REASONS and result.reason != "malformed", result
    else:
        assert bool(torch.isfinite(result.tensor()).all())


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("kind", list(Kind))
def test_round_trip_every_codec_and_kind(codec: str, kind: Kind) -> None:
    x = randn(3, 50)
    buf = pack_tensor("stage1.act", kind, x, codec, sender_step=-7)
    m = unpack(buf, Expect(name="stage1.act", kind=kind, shape=(3, 50), codecs=frozenset(CODECS)))
    assert isinstance(m, Message), m
    assert (m.name, m.kind, m.sender_step, m.encoded.codec) == ("stage1.act", kind, -7, codec)
    assert torch.equal(m.tensor(), roundtrip(x, codec))
    assert len(buf) == 23 + len("stage1.act") + 8 * 2 + 20 + codecs.encoded_nbytes(150, codec)


@pytest.mark.parametrize("codec", CODECS)
def test_buffer_types_shapes_and_no_check(codec: str) -> None:
    for shape in [(), (0,), (2, 0, 3), (1,) * 8, (129,)]:
        x = randn(*shape)
        buf = pack_tensor("n\u00e9", Kind.STATE, x, codec, 2**62, block_size=64)
        strided = bytearray(2 * len(buf))
        strided[::2] = buf
        views = (
            buf,
            bytearray(buf),
            memoryview(buf),
            memoryview(b"xx" + buf)[2:],  # unaligned tensors
            memoryview(strided)[::2],  # non-contiguous
            memoryview(buf).cast("b"),  # signed bytes
        )
        for b in views:
            m = unpack(b)
            assert isinstance(m, Message), m
            assert m.tensor().shape == shape and m.name == "n\u00e9"
        m = unpack(buf, check_finite=False)
        assert torch.equal(m.tensor(), roundtrip(x, codec, 64))


def test_unpack_or_raise_and_pack_errors() -> None:
    buf = pack_tensor("w", Kind.CONTROL, randn(4), "fp32", 1)
    assert isinstance(unpack_or_raise(buf), Message)
    with pytest.raises(WireReject) as ei:
        unpack_or_raise(buf[:-1])
    assert ei.value.reason == "truncated"
    enc = encode(randn(4), "fp32")
    with pytest.raises(WireError):
        pack("x" * 257, Kind.GRADIENT, enc, 0)
    with pytest.raises(WireError):
        pack("w", 9, enc, 0)  # type: ignore[arg-type]
    with pytest.raises(WireError):
        pack("w", Kind.GRADIENT, enc, 2**63)
    with pytest.raises(WireError):
        pack("w", Kind.GRADIENT, encode(torch.zeros((1,) * 9), "fp32"), 0)
    with pytest.raises(CodecError):
        pack("w", Kind.GRADIENT, Encoded("fp32", (5,), enc.data, None), 0)
    with pytest.raises(CodecError):
        pack_tensor("w", Kind.GRADIENT, torch.tensor([math.inf]), "fp8_e4m3", 0)


def nan_message(codec: str) -> bytes:
    """A well-formed message whose payload decodes to NaN/Inf (as a broken or hostile peer)."""
    enc = encode(randn(300), codec)
    data = enc.data.clone()
    bad = {"fp32": math.nan, "bf16": math.inf, "fp8_e4m3": 0x7F, "fp8_e5m2": 0x7C}
    if codec in bad:
        data[17] = bad[codec]
        enc = Encoded(codec, enc.shape, data, enc.scales, enc.block_size)
        return pack("w", Kind.AVERAGE, enc, 3)
    body = bytearray(pack("w", Kind.AVERAGE, enc, 3))  # int8, int4: an Inf scale, crc recomputed
    struct.pack_into("<f", body, len(body) - 4, math.inf)
    size = codecs.encoded_nbytes(300, codec)
    return raw(codec_id=CODECS.index(codec), dims=(300,), kind=3, step=3, body=bytes(body[-size:]))


@pytest.mark.parametrize("codec", CODECS)
def test_non_finite_payload_rejected_and_counted(codec: str) -> None:
    counter = RejectCounter()
    buf = nan_message(codec)
    r = counter.observe(unpack(buf))
    assert reason(r) == "not_finite"
    assert counter.counts() == {"not_finite": 1} and counter.total == 1
    if codec not in ("int8_blockwise", "int4_hadamard"):  # structure is fine; values: on decode
        m = unpack(buf, check_finite=False)
        assert isinstance(m, Message)
        with pytest.raises(CodecError):
            m.tensor()


def test_every_reject_reason_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    good = raw()
    fp8 = dict(codec_id=2, dims=(300,))
    neg_scales = struct.pack("<3f", 1.0, -1.0, 1.0)
    cases: dict[str, tuple[object, Expect | None]] = {
        "not_bytes": ("MSHT", None),
        "truncated": (good[:-1], None),
        "bad_magic": (b"PK\x03\x04" + good[4:], None),
        "bad_version": (raw(version=2), None),
        "bad_kind": (raw(kind=0), None),
        "unknown_codec": (raw(codec_id=len(CODECS)), None),
        "unknown_dtype": (raw(dtype=2), None),
        "bad_ndim": (raw(ndim=9, dims=(1,) * 9), None),
        "bad_block_size": (raw(block_size=0), None),
        "bad_name": (raw(name=b"\xff\xfe"), None),
        "bad_shape": (raw(dims=(-1, -4)), None),
        "too_large": (raw(data_len=2**40), None),
        "length_mismatch": (good + b"\0", None),
        "unexpected_name": (good, Expect(name="v")),
        "unexpected_kind": (good, Expect(kind=Kind.ACTIVATION)),
        "unexpected_shape": (good, Expect(shape=(2, 2))),
        "unexpected_codec": (good, Expect(codecs=frozenset({"bf16"}))),
        "bad_checksum": (good[:-1] + b"\x01", None),
        "bad_payload": (raw(**fp8, body=bytes(300) + neg_scales), None),
        "not_finite": (nan_message("fp32"), None),
    }
    assert set(cases) | {"malformed"} == REASONS
    counter = RejectCounter()
    for want, (buf, expect) in cases.items():
        got = counter.observe(unpack(buf, expect))  # type: ignore[arg-type]
        assert reason(got) == want, (want, got)
    # "malformed" is the catch-all for what the checks did not foresee: simulate a bug.
    with monkeypatch.context() as mp:
        mp.setattr(codecs, "decode", lambda enc: 1 / 0)
        assert reason(counter.observe(unpack(good))) == "malformed"
    assert counter.counts() == dict.fromkeys(REASONS, 1) and counter.total == len(REASONS)


def test_more_header_rejects() -> None:
    assert reason(unpack(raw(name=b"x" * 257))) == "bad_name"
    assert reason(unpack(raw(name_len=300, name=b""))) == "bad_name"
    assert reason(unpack(raw(codec_id=4, block_size=100))) == "bad_block_size"
    assert reason(unpack(raw(dims=(2**40, 3)))) == "too_large"
    assert reason(unpack(raw(dims=(0, 2**32, 2**32)))) == "bad_shape"  # numel 0, strides overflow
    assert reason(unpack(raw(data_len=15))) == "length_mismatch"
    assert reason(unpack(raw(codec_id=2, scales_len=8))) == "length_mismatch"
    assert reason(unpack(b"MS")) == "truncated"
    assert reason(unpack(b"")) == "truncated"


def test_huge_declared_body_rejected_before_allocation() -> None:
    buf = raw(dims=(2**38,), body=b"")  # 2**38 fp32 values = 2**40 bytes declared
    tracemalloc.start()
    r1 = unpack(buf)
    r2 = unpack(buf, Expect(max_body_bytes=2**50))
    r3 = unpack(raw(data_len=2**40, scales_len=2**40, body=b"x" * 16))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # rejects, not a MemoryError turned "malformed", and nothing near the declared size was
    # allocated on the way
    assert (reason(r1), reason(r2), reason(r3)) == ("too_large", "truncated", "too_large")
    assert peak < 1 << 20


def test_truncated_at_every_length() -> None:
    for codec in CODECS:
        buf = pack_tensor("act", Kind.ACTIVATION, randn(130), codec, 5)
        for cut in range(len(buf)):
            assert reason(unpack(buf[:cut])) == "truncated", (codec, cut)


def test_reject_counter_thread_safe() -> None:
    counter = RejectCounter()

    def work() -> None:
        for i in range(500):
            counter.add(Reject("bad_magic") if i % 2 else "too_large")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.counts() == {"bad_magic": 1000, "too_large": 1000} and counter.total == 2000


VALID = [pack_tensor("g", Kind.GRADIENT, randn(40, seed=i), c, i) for i, c in enumerate(CODECS)]
MAXLEN = max(len(b) for b in VALID)


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    assert_total(unpack(data))
    assert_total(unpack(b"MSHT\x01" + data))


# Strategies are kept flat (few draws per example): hypothesis' own per-draw cost dominates
# these tests, and each must stay well under 2 s for 1000 examples on a shared 2-core box.
bit = st.integers(0, MAXLEN * 8 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
u64 = st.integers(0, 2**64 - 1)
# Each pick list is mostly valid values, so that fuzzing also gets past the first checks.
DIMS = [1, 3, 3, 40, 40, 0, -1, -(2**63), 2**31, 2**62, 2**63 - 1]
LENS = [None, None, None, None, 0, 3, 4, 160, 2**40, 2**64 - 1]


@FUZZ
@given(st.integers(0, len(VALID) - 1), bit, bit, st.integers(0, MAXLEN))
def test_fuzz_bit_flips_and_cuts(i: int, flip1: int, flip2: int, cut: int) -> None:
    b = bytearray(VALID[i])
    for pos in (flip1, flip2):  # equal positions cancel: the message must then be accepted
        pos %= len(b) * 8
        b[pos // 8] ^= 1 << (pos % 8)
    assert_total(unpack(bytes(b)))
    assert_total(unpack(bytes(b[:cut])))


MAGIC_VERSION = [(b"MSHT", 1)] * 5 + [(b"MSHT", 0), (b"MSHT", 2), (b"MSHU", 1)]
KINDS = [1, 2, 3, 4, 5, 0, 6, 255]
DTYPES = [1, 1, 1, 0, 2, 255]
BLOCKS = [128, 128, 64, 1, 0, 100, 2**32 - 1]
LEN_PAIRS = list(itertools.product(LENS, LENS))


# The header fields are decoded from one drawn byte string (as atheris' FuzzedDataProvider
# does): one draw per example instead of one per field keeps hypothesis' own cost low.
@FUZZ
@given(st.binary(min_size=15, max_size=15))
def test_fuzz_fixed_header_fields(b: bytes) -> None:
    magic, version = MAGIC_VERSION[b[0] % len(MAGIC_VERSION)]
    fields = dict(magic=magic, version=version, kind=KINDS[b[1] % 8], codec_id=b[2] % 7)
    fields |= dict(dims=(3, 5))
    fields |= dict(dtype=DTYPES[b[3] % len(DTYPES)], block_size=BLOCKS[b[4] % len(BLOCKS)])
    fields |= dict(step=struct.unpack("<q", b[5:13])[0], name=b[14:] if b[13] % 2 else b"w")
    assert_total(unpack(raw(**fields)))
    assert_total(unpack(raw(**fields, ndim=b[13] % 13)))  # ndim disagreeing with the dims


@FUZZ
@given(st.binary(min_size=14, max_size=214))
def test_fuzz_shape_and_length_fields(b: bytes) -> None:
    # negative, huge, overflowing dims and ndim > 8; lengths right (None) or not; any body
    dims = tuple(DIMS[c % len(DIMS)] for c in b[2 : 2 + b[1] % 10])
    data_len, scales_len = LEN_PAIRS[b[11] % len(LEN_PAIRS)]
    f = dict(codec_id=b[0] % len(CODECS), dims=dims, data_len=data_len, scales_len=scales_len)
    other, body = int.from_bytes(b[12:14], "little"), b[14:]
    assert_total(unpack(raw(**f)))  # body: zeros of the declared size, when that is small
    assert_total(unpack(raw(**f, body=body, crc=other if other % 2 else None)))
    assert_total(unpack(raw(**f, name_len=other % 300, body=body)))


class _Boom:
    """Unpickling this creates the marker file: proof that a payload was deserialized."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def test_pickle_blob_is_never_deserialized(tmp_path: Path) -> None:
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Boom(control)))  # the blob really does create its marker
    assert control.exists()

    marker = tmp_path / "marker"
    blob = pickle.dumps(_Boom(marker))
    saved = io.BytesIO()
    torch.save(_Boom(marker), saved)
    padded = blob + bytes(-len(blob) % 4)
    n = len(padded) // 4
    bufs = [
        blob,
        saved.getvalue(),
        raw(dims=(n,), body=padded),  # fp32 body
        raw(codec_id=2, dims=(len(blob),), body=blob + bytes(4 * -(-len(blob) // 128))),
        raw(codec_id=4, dims=(len(blob),), body=blob + bytes(4 * -(-len(blob) // 128))),
    ]
    for b in bufs:
        r = unpack(b)
        if isinstance(r, Message):
            r.tensor()
        r = unpack(b, check_finite=False)
        if isinstance(r, Message):
            try:
                r.tensor()
            except CodecError:
                pass
    assert reason(unpack(blob)) == "bad_magic"
    assert reason(unpack(saved.getvalue())) == "bad_magic"
    assert not marker.exists()


def test_no_deserializers_in_comms_sources() -> None:
    banned_calls = {"eval", "exec", "load", "loads", "Unpickler", "__import__"}
    banned_modules = {"pickle", "marshal", "dill", "cloudpickle", "shelve"}
    for mod in (wire, codecs):
        tree = ast.parse(inspect.getsource(mod))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not banned_modules & {n.split(".")[0] for n in names}, mod.__name__
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                assert name not in banned_calls, (mod.__name__, name)


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_held_bytes_from_the_header_equals_the_message_it_becomes(codec: str) -> None:
    """A transport reserves room from the frame's first bytes; the message unpack makes holds
    exactly that: its body plus the decoded float32 copy (4x an fp8 body)."""
    x = torch.randn(3, 1000)
    frame = wire.pack_tensor("held", Kind.AVERAGE, x, codec, 5)
    held = wire.held_bytes(frame[: wire.MAX_HEADER_BYTES])
    msg = wire.unpack(frame)
    assert isinstance(msg, wire.Message) and held == msg.held_bytes
    assert held == codecs.encoded_nbytes(x.numel(), codec) + 4 * x.numel()
    assert wire.held_bytes(frame[:64], decoded=False) == codecs.encoded_nbytes(x.numel(), codec)
    assert wire.unpack(frame, check_finite=False).held_bytes == held - 4 * x.numel()


def test_held_bytes_refuses_a_header_no_valid_frame_has() -> None:
    frame = bytearray(wire.pack_tensor("held", Kind.AVERAGE, torch.ones(10), "fp32", 0))
    assert wire.held_bytes(b"\x00garbage").reason == "bad_magic"
    assert wire.held_bytes(bytes(frame[:10])).reason == "truncated"
    frame[-40 - 20 + 4] ^= 0xFF  # data_len (20 bytes of tail before the 40-byte body)
    assert isinstance(wire.held_bytes(bytes(frame)), wire.Reject)


def test_malformed_int4_frames_rejected() -> None:
    """A 4-bit frame packs two values a byte: its sizes are checked as such before anything is
    allocated, and a body that no encoder writes is refused."""
    int4 = CODECS.index("int4_hadamard")
    x = randn(301)
    good = pack_tensor("act", Kind.ACTIVATION, x, "int4_hadamard", 1)
    m = unpack(good)
    assert isinstance(m, Message) and torch.equal(m.tensor(), roundtrip(x, "int4_hadamard"))
    assert len(good) == 23 + 3 + 8 + 20 + 151 + 4 * 3
    scales = bytes(4 * 3)
    # a byte a value (as int8 would be), a byte short, a byte long: the lengths disagree
    for data_len in (301, 150, 152):
        frame = raw(codec_id=int4, dims=(301,), data_len=data_len, body=bytes(data_len) + scales)
        assert reason(unpack(frame)) == "length_mismatch", data_len
    # a block size with no Hadamard matrix
    assert reason(unpack(raw(codec_id=int4, dims=(301,), block_size=96))) == "bad_block_size"
    # the pad nibble after an odd count is not 0 (crc valid: the body is what the peer meant)
    body = bytearray(good[-(151 + 12) :])
    body[150] |= 0xF0
    bad = raw(codec_id=int4, dims=(301,), body=bytes(body))
    assert reason(unpack(bad)) == "bad_payload"
    # a declared size far past the bound, refused before allocation
    tracemalloc.start()
    r = unpack(raw(codec_id=int4, dims=(2**40,), body=b""))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert reason(r) == "too_large" and peak < 1 << 20
    assert reason(unpack(nan_message("int4_hadamard"))) == "not_finite"
