"""The pure parts of a chunked state download (mesh/runtime/state_chunks.py): exact wire values
for every dtype, a plan that covers every value once, manifests that round-trip and malformed
ones refused. The protocol over real transports: tests/integration/test_state_download.py."""

from __future__ import annotations

import json

import pytest
import torch

from mesh.runtime.state_chunks import (
    CHUNKS_AT_LEAST,
    DIGEST_BYTES,
    MAX_MANIFEST_BYTES,
    MIN_CHUNK_VALUES,
    ChunkHasher,
    Entry,
    Manifest,
    StateFormatError,
    chunk_count,
    chunk_range,
    chunk_values_for,
    decode_manifest,
    digest,
    encode_manifest,
    entry_for,
    entry_offsets,
    entry_pieces,
    from_wire,
    number_tensor,
    to_wire,
    whole_digest,
    wire_error,
)

ENTRIES = (
    Entry("flat", "float32", (1000,)),
    Entry("drift", "float32", (1000,)),
    Entry("opt/w/m.q", "uint8", (10, 30)),
    Entry("opt/w/step", "int", ()),
    Entry("opt/w/mu_product", "float", ()),
    Entry("opt/w/idx", "int64", (7,)),
)


def _manifest(chunk_values: int = 256) -> Manifest:
    total = sum(e.values for e in ENTRIES)
    chunks = tuple(digest(bytes([i])) for i in range(chunk_count(total, chunk_values)))
    return Manifest(12345, 77, chunk_values, ENTRIES, chunks, whole_digest(chunks))


def _doc(m: Manifest) -> dict:
    return json.loads(bytes(encode_manifest(m).to(torch.uint8).numpy()))


def _encoded(doc: object) -> torch.Tensor:
    raw = json.dumps(doc).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).float()


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(50),
        torch.randn(50).to(torch.bfloat16),
        torch.randn(50).to(torch.float16),
        torch.randint(0, 256, (50,), dtype=torch.uint8),
        torch.randint(-128, 128, (50,), dtype=torch.int8),
        torch.randint(-(1 << 15), 1 << 15, (50,), dtype=torch.int16),
        torch.rand(50) > 0.5,
        torch.randint(-(1 << 31), (1 << 31) - 1, (50,), dtype=torch.int32),
        torch.randint(-(1 << 62), 1 << 62, (50,), dtype=torch.int64),
        torch.randn(50, dtype=torch.float64) * 1e300,
    ],
    ids=lambda x: str(x.dtype),
)
def test_every_dtype_crosses_as_float32_values_bit_exactly(x):
    wire = to_wire(x)
    entry = entry_for("e", x)
    assert wire.dtype == torch.float32 and wire.numel() == entry.values
    assert wire_error(entry.dtype, wire) is None
    back = from_wire(wire, entry.dtype)
    assert back.dtype == x.dtype and torch.equal(back, x)


def test_python_numbers_cross_exactly():
    for value in (3, -(1 << 62), 0.9**0.5, 1e-300):
        entry = entry_for("n", value)
        wire = to_wire(number_tensor(entry, value))
        assert entry.shape == () and wire_error(entry.dtype, wire) is None
        got = from_wire(wire, entry.dtype).item()
        assert got == value and type(got) is type(value)
    with pytest.raises(StateFormatError):
        entry_for("b", True)  # a bool is not carried as an int
    with pytest.raises(StateFormatError):
        entry_for("c", torch.zeros(2, dtype=torch.complex64))


def test_values_a_dtype_cannot_have_are_caught():
    assert wire_error("uint8", torch.tensor([1.0, 256.0])) is not None
    assert wire_error("uint8", torch.tensor([1.5])) is not None
    assert wire_error("bool", torch.tensor([2.0])) is not None
    assert wire_error("bfloat16", torch.tensor([1.0 + 2**-20])) is not None
    assert wire_error("int64", torch.tensor([1.0, 2.0, 3.0])) is not None  # a split element
    assert wire_error("int64", torch.tensor([65536.0, 0, 0, 0])) is not None
    nan = to_wire(torch.tensor([float("nan")], dtype=torch.float64))
    assert wire_error("float64", nan) is not None


def test_the_plan_covers_every_value_exactly_once():
    total = sum(e.values for e in ENTRIES)
    for chunk_values in (1, 7, 256, total - 1, total, total + 5):
        seen = torch.zeros(total, dtype=torch.int32)
        for i in range(chunk_count(total, chunk_values)):
            start, stop = chunk_range(total, chunk_values, i)
            assert 0 < stop - start <= chunk_values
            seen[start:stop] += 1
        assert bool((seen == 1).all()), chunk_values
        with pytest.raises(StateFormatError):
            chunk_range(total, chunk_values, chunk_count(total, chunk_values))
    for piece in (1, 3, 4, 64, 10**6):
        seen = torch.zeros(total, dtype=torch.int32)
        for entry, at in zip(ENTRIES, entry_offsets(ENTRIES), strict=True):
            for lo, hi in entry_pieces(entry, piece):
                # whole elements, no larger than asked (or one element)
                assert lo % entry.words == 0 and hi % entry.words == 0 or hi == entry.values
                assert hi - lo <= max(piece, entry.words)
                seen[at + lo : at + hi] += 1
        assert bool((seen == 1).all()), piece


def test_chunk_digests_do_not_depend_on_how_the_stream_is_fed():
    data = torch.randint(0, 256, (4 * 1000 + 12,), dtype=torch.uint8)
    view = memoryview(data.numpy())
    chunk_values = 37
    direct = [digest(view[a : a + 4 * chunk_values]) for a in range(0, len(view), 4 * chunk_values)]
    for piece in (1, 4, 100, 148, 5000):
        hasher = ChunkHasher(chunk_values)
        for a in range(0, len(view), piece):
            hasher.update(view[a : a + piece])
        assert list(hasher.finish()) == direct, piece


def test_chunk_size_shrinks_for_a_small_state_within_bounds():
    assert chunk_values_for(10**10) == (32 << 20) // 4
    assert chunk_values_for(10**6) == MIN_CHUNK_VALUES
    n = 10 * CHUNKS_AT_LEAST * MIN_CHUNK_VALUES + 1
    assert chunk_values_for(n) == 10 * MIN_CHUNK_VALUES + 1  # CHUNKS_AT_LEAST chunks
    assert chunk_values_for(10**10, chunk_bytes=4096) == 1024


def test_manifest_round_trip():
    m = _manifest()
    values = encode_manifest(m)
    assert values.dtype == torch.float32 and values.dim() == 1
    assert decode_manifest(values) == m
    assert decode_manifest(values).identity == m.identity


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda d: d["chunks"].pop(), "chunks"),  # one chunk digest too few
        (lambda d: d["chunks"].append(d["whole"]), "chunks"),
        (lambda d: d["entries"][0][2].__setitem__(0, 5000), "chunks"),  # sizes disagree
        (lambda d: d.__setitem__("whole", d["whole"][:-2]), "hex"),  # bad hash length
        (lambda d: d["chunks"].__setitem__(0, "Z" * 2 * DIGEST_BYTES), "hex"),
        (lambda d: d["chunks"].__setitem__(0, digest(b"other")), "whole digest"),
        (lambda d: d.__setitem__("whole", digest(b"other")), "whole digest"),
        (lambda d: d.__setitem__("step", -1), "step"),
        (lambda d: d.__setitem__("step", 1.5), "step"),
        (lambda d: d.__setitem__("step", True), "step"),
        (lambda d: d.__setitem__("chunk_values", 0), "chunk_values"),
        (lambda d: d.__setitem__("chunk_values", 1 << 30), "chunk_values"),
        (lambda d: d.__setitem__("format", 2), "format"),
        (lambda d: d.pop("snapshot"), "keys"),
        (lambda d: d.__setitem__("extra", 1), "keys"),
        (lambda d: d["entries"][2].__setitem__(1, "complex64"), "dtype"),
        (lambda d: d["entries"][3].__setitem__(2, [1]), "number"),
        (lambda d: d["entries"][1].__setitem__(0, "flat"), "repeated"),
        (lambda d: d["entries"][0].__setitem__(2, [1 << 40, 1 << 40]), "more than"),
        (lambda d: d["entries"].__setitem__(0, ["x", "float32"]), "entry"),
        (lambda d: d.__setitem__("entries", []), "entries"),
    ],
)
def test_a_malformed_manifest_is_refused(change, why):
    doc = _doc(_manifest())
    change(doc)
    with pytest.raises(StateFormatError, match=why):
        decode_manifest(_encoded(doc))


def test_manifest_bytes_that_are_not_json_bytes_are_refused():
    good = encode_manifest(_manifest())
    with pytest.raises(StateFormatError, match="bytes"):
        decode_manifest(torch.cat([good, torch.tensor([256.0])]))
    with pytest.raises(StateFormatError, match="bytes"):
        decode_manifest(torch.cat([good, torch.tensor([1.5])]))
    with pytest.raises(StateFormatError, match="bytes"):
        decode_manifest(torch.cat([good, torch.tensor([float("nan")])]))
    with pytest.raises(StateFormatError, match="manifest of"):  # too large: before parsing
        decode_manifest(torch.zeros(MAX_MANIFEST_BYTES + 1))
    with pytest.raises(StateFormatError, match="manifest of"):
        decode_manifest(torch.zeros(0))
    with pytest.raises(StateFormatError, match="1-D float32"):
        decode_manifest(good.double())
    with pytest.raises(StateFormatError, match="JSON"):
        decode_manifest(good[:-1])  # truncated
    text = bytes(good.to(torch.uint8).numpy()).decode()
    for bad in (text.replace('"step":12345', '"step":NaN'), text[:-1] + ',"step":1}'):
        raw = torch.frombuffer(bytearray(bad.encode()), dtype=torch.uint8).float()
        with pytest.raises(StateFormatError):  # a JSON NaN constant; a repeated key
            decode_manifest(raw)
