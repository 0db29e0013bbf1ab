"""Unit tests for comms/codecs.py: error bounds, sizes, clamping, non-finite handling."""

from __future__ import annotations

import math

import pytest
import torch

from comms import codecs
from comms.codecs import (
    CODECS,
    Encoded,
    bytes_per_value,
    check_encoded,
    decode,
    encode,
    encoded_nbytes,
    roundtrip,
)
from comms.errors import CodecError, CommsError, NotFiniteError

try:  # at collection, not in a test: importing bitsandbytes takes ~3 s (torch._dynamo)
    import bitsandbytes.functional as bnbf
except ImportError:  # pragma: no cover - bnb is a dependency; only the interop tests need it
    bnbf = None
needs_bnb = pytest.mark.skipif(bnbf is None, reason="bitsandbytes not installed")

FP8 = {"fp8_e4m3": (448.0, 2.0**-4, 2.0**-10), "fp8_e5m2": (57344.0, 2.0**-3, 2.0**-17)}
BLOCKED = ("fp8_e4m3", "fp8_e5m2", "int8_blockwise", "int4_hadamard")
INT4 = "int4_hadamard"


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def block_amax(x: torch.Tensor, bs: int) -> torch.Tensor:
    """Per-value absmax of its block (reference, padded, independent of the codec code)."""
    flat = x.reshape(-1)
    n = flat.numel()
    padded = torch.zeros(-(-n // bs) * bs)
    padded[:n] = flat.abs()
    return padded.view(-1, bs).amax(1).repeat_interleave(bs)[:n]


def rel_err(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    nz = x != 0
    return ((y - x).abs()[nz] / x.abs()[nz]).reshape(-1)


def test_codec_list_and_errors_hierarchy() -> None:
    # a frame names its codec by its index here: a new codec goes last
    assert CODECS == ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8_blockwise", INT4)
    assert issubclass(CodecError, CommsError) and issubclass(CodecError, ValueError)
    assert issubclass(NotFiniteError, CodecError)


def test_fp32_exact() -> None:
    x = randn(1000)
    assert torch.equal(roundtrip(x, "fp32"), x)
    assert encode(x, "fp32").nbytes == 4000


def test_bf16_error() -> None:
    x = randn(100_000)
    y = roundtrip(x, "bf16")
    assert rel_err(y, x).max().item() < 0.004  # round to nearest, 8 significant bits
    assert encode(x, "bf16").nbytes == 200_000


@pytest.mark.parametrize("codec", list(FP8))
def test_fp8_error_bound_per_value(codec: str) -> None:
    qmax, unit, sub = FP8[codec]
    x = randn(100_000) * torch.logspace(-3, 3, 100_000)  # wide dynamic range across blocks
    y = roundtrip(x, codec)
    s = block_amax(x, 128) / qmax
    # normal range: relative error <= unit roundoff; subnormal range: absolute <= half a step
    bound = x.abs() * unit + s * sub
    assert bool(((y - x).abs() <= bound * 1.0001 + 1e-30).all())


@pytest.mark.parametrize(
    ("codec", "max_median"), [("fp8_e4m3", 0.03), ("fp8_e5m2", 0.06), ("int8_blockwise", 0.02)]
)
def test_blocked_median_error_and_size(codec: str, max_median: float) -> None:
    x = randn(128 * 800)
    enc = encode(x, codec)
    y = decode(enc)
    assert rel_err(y, x).median().item() < max_median
    assert enc.nbytes / x.numel() < 1.04
    assert bytes_per_value(codec) == pytest.approx(1 + 4 / 128)


def test_int8_error_bound_per_value() -> None:
    code = codecs._int8_tables(torch.device("cpu"))[0]
    half_gap = code.diff().max().item() / 2
    x = randn(10_000) * 3
    y = roundtrip(x, "int8_blockwise")
    assert bool(((y - x).abs() <= block_amax(x, 128) * half_gap * 1.0001).all())


def test_int8_picks_exactly_nearest_code() -> None:
    code = codecs._int8_tables(torch.device("cpu"))[0]
    mid = (code[1:] + code[:-1]) / 2
    x = torch.cat([randn(20_000) * torch.logspace(-8, 0, 20_000), code, -code, mid, -mid])
    for bs in (64, 128):
        enc = encode(x, "int8_blockwise", bs)
        y = (x.reshape(-1) / block_amax(x, bs)).nan_to_num(0.0)
        assert torch.equal(enc.data, torch.bucketize(y, mid).to(torch.uint8))


@needs_bnb
def test_int8_matches_bitsandbytes() -> None:
    assert torch.equal(codecs._dynamic_map(), bnbf.create_dynamic_map(signed=True))
    x = randn(100_003) * 2
    ours = encode(x, "int8_blockwise")
    code = bnbf.create_dynamic_map(signed=True)
    theirs_q, state = bnbf.quantize_blockwise(x, code=code, blocksize=128)
    assert torch.equal(ours.scales, state.absmax)
    # bnb decodes our bytes to exactly what we decode
    bnb_of_ours = bnbf.dequantize_blockwise(ours.data, absmax=ours.scales, code=code, blocksize=128)
    assert torch.equal(bnb_of_ours, decode(ours))
    # we decode bnb's bytes to exactly what bnb decodes
    theirs = Encoded("int8_blockwise", (100_003,), theirs_q, state.absmax, 128)
    assert torch.equal(decode(theirs), bnbf.dequantize_blockwise(theirs_q, state))
    # our codes are never farther from x than bnb's
    assert bool(((decode(ours) - x).abs() <= (decode(theirs) - x).abs() + 1e-7).all())


@pytest.mark.parametrize("codec", list(FP8))
def test_clamp_before_cast_keeps_values_finite(codec: str) -> None:
    qmax = FP8[codec][0]
    # Block amax so small that amax / qmax is a subnormal float32: x / s then lands far above
    # qmax (a cast of that would be NaN/Inf without the clamp).
    a = torch.arange(1, 2000, dtype=torch.float32) * (2.0**-149) * qmax * 0.37
    s = a / qmax
    assert bool((a / torch.where(s > 0, s, torch.ones_like(s)) > qmax * 1.07).any())
    x = torch.stack([a, -a, a * 0.5], dim=1)  # one 3-value block per amax
    enc = encode(x, codec, block_size=3)
    y = decode(enc)
    assert bool(torch.isfinite(y).all())
    # And at the top of the float32 range.
    big = torch.tensor([3.4e38, -3.4e38, 1.0, 1e-30])
    assert bool(torch.isfinite(roundtrip(big, codec)).all())


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", [0, 200, 299])  # first block, middle block, partial tail
def test_non_finite_input_rejected(codec: str, bad: float, where: int) -> None:
    x = randn(300)
    x[where] = bad
    with pytest.raises(NotFiniteError):
        encode(x, codec)


def test_bf16_overflow_near_float32_max_is_clamped() -> None:
    x = torch.tensor([3.4e38, -3.4e38, 1.0])
    enc = encode(x, "bf16")
    assert bool(torch.isfinite(enc.data.float()).all())


@pytest.mark.parametrize("codec", CODECS)
def test_all_zero(codec: str) -> None:
    x = torch.zeros(4, 100)
    enc = encode(x, codec)
    y = decode(enc)
    assert y.shape == (4, 100) and bool((y == 0).all())
    if codec in FP8:
        assert bool((enc.scales == 1).all())  # no 0/0


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [1, 127, 128, 129, 1000, 1_000_003])
def test_odd_sizes(codec: str, n: int) -> None:
    x = randn(n, seed=n)
    enc = encode(x, codec)
    assert enc.nbytes == encoded_nbytes(n, codec)
    y = decode(enc)
    assert y.shape == (n,) and y.dtype == torch.float32
    worst = 0.25 if codec == INT4 else 0.13  # 4 bits: a step is a seventh of a block's range
    assert (y - x).abs().max().item() <= worst * x.abs().max().item()


@pytest.mark.parametrize("codec", CODECS)
def test_shapes_scalar_empty_and_dtypes(codec: str) -> None:
    assert roundtrip(torch.tensor(1.5), codec).shape == ()
    for shape in [(0,), (3, 0, 2)]:
        enc = encode(torch.empty(shape), codec)
        assert enc.nbytes == 0 and decode(enc).shape == shape
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        x = randn(200).to(dt)
        assert roundtrip(x, codec).dtype == torch.float32
    with pytest.raises(NotFiniteError):  # finite in float64, Inf as float32
        encode(torch.tensor([1e300], dtype=torch.float64), codec)


@pytest.mark.parametrize("codec", CODECS)
def test_non_contiguous_input(codec: str) -> None:
    base = randn(64, 50)
    for x in (base.t(), base[:, ::3], base.expand(2, 64, 50)[:, ::2]):
        assert not x.is_contiguous()
        y = roundtrip(x, codec)
        assert y.shape == x.shape
        assert torch.equal(y, roundtrip(x.contiguous(), codec))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bs", [64, 128, 256])
def test_encoded_nbytes_matches(codec: str, bs: int) -> None:
    for n in (0, 1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 5000):
        assert encode(randn(n), codec, bs).nbytes == encoded_nbytes(n, codec, bs), n
    assert bytes_per_value(codec, bs) == encoded_nbytes(bs * 1000, codec, bs) / (bs * 1000)


def test_bad_arguments() -> None:
    x = randn(10)
    with pytest.raises(CodecError):
        encode(x, "fp16")
    with pytest.raises(CodecError):
        encode(torch.arange(10), "fp32")  # integers are not a float payload
    for bs in (0, -1, 1 << 20):
        with pytest.raises(CodecError):
            encode(x, "fp8_e4m3", bs)
    with pytest.raises(CodecError):
        encode(x, "int8_blockwise", 100)  # not a bitsandbytes block size
    with pytest.raises(CodecError):
        encoded_nbytes(10, "nope")
    assert roundtrip(x, "fp8_e4m3", 7).shape == (10,)  # fp8 takes any block size


def test_encode_is_a_snapshot_and_decode_is_fresh() -> None:
    x = randn(256)
    x0 = x.clone()
    enc = encode(x, "fp32")
    x.add_(1.0)
    y = decode(enc)
    assert torch.equal(y, x0)
    y.zero_()
    assert not bool((decode(enc) == 0).all())


def _tamper(enc: Encoded, **kw: object) -> Encoded:
    fields = dict(
        codec=enc.codec,
        shape=enc.shape,
        data=enc.data,
        scales=enc.scales,
        block_size=enc.block_size,
    )
    fields.update(kw)
    return Encoded(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("codec", "byte"),
    [("fp8_e4m3", 0x7F), ("fp8_e4m3", 0xFF), ("fp8_e5m2", 0x7C), ("fp8_e5m2", 0x7E)],
)
def test_decode_rejects_nan_inf_bytes(codec: str, byte: int) -> None:
    enc = encode(randn(300), codec)
    data = enc.data.clone()
    data[5] = byte
    with pytest.raises(NotFiniteError):
        decode(_tamper(enc, data=data))


def test_decode_rejects_non_finite_other_codecs() -> None:
    x = randn(300)
    for codec in ("fp32", "bf16"):
        enc = encode(x, codec)
        data = enc.data.clone()
        data[299] = math.nan
        with pytest.raises(NotFiniteError):
            decode(_tamper(enc, data=data))
    for codec in BLOCKED:
        enc = encode(x, codec)
        for bad in (math.nan, math.inf):
            scales = enc.scales.clone()
            scales[1] = bad
            with pytest.raises(NotFiniteError):
                decode(_tamper(enc, scales=scales))
    for codec in (*FP8, INT4):  # finite scale times finite code (up to qmax) overflows float32
        enc = encode(x, codec)
        with pytest.raises(NotFiniteError):
            decode(_tamper(enc, scales=torch.full_like(enc.scales, 3e38)))


def test_decode_rejects_inconsistent_encoded() -> None:
    enc = encode(randn(300), "fp8_e4m3")
    bad = [
        _tamper(enc, shape=(301,)),
        _tamper(enc, shape=(-1, -300)),
        _tamper(enc, data=enc.data[:-1]),
        _tamper(enc, data=enc.data.to(torch.int8)),
        _tamper(enc, scales=None),
        _tamper(enc, scales=enc.scales[:-1]),
        _tamper(enc, scales=enc.scales.double()),
        _tamper(enc, scales=-enc.scales),
        _tamper(enc, block_size=64),
        _tamper(enc, block_size=0),
        _tamper(enc, codec="fp9"),
        _tamper(encode(randn(3), "fp32"), scales=torch.ones(1)),
    ]
    for e in bad:
        with pytest.raises(CodecError):
            check_encoded(e)
        with pytest.raises(CodecError):
            decode(e)
    with pytest.raises(CodecError):
        decode("not an Encoded")  # type: ignore[arg-type]


def test_shuffled_error_is_the_codecs_error_on_a_shuffled_payload() -> None:
    x = torch.randn(4096) * 0.02
    noise = codecs.shuffled_error(x, "fp8_e4m3", 128, seed=7)
    assert torch.equal(noise, codecs.shuffled_error(x, "fp8_e4m3", 128, seed=7))
    assert not torch.equal(noise, codecs.shuffled_error(x, "fp8_e4m3", 128, seed=8))
    own = codecs.roundtrip(x, "fp8_e4m3", 128) - x
    # the size of fp8's error on x, but not x's own error coordinate by coordinate
    assert 0.7 < noise.norm() / own.norm() < 1.4
    assert abs(torch.nn.functional.cosine_similarity(noise, own, dim=0)) < 0.2
    assert torch.count_nonzero(codecs.shuffled_error(x, "fp32", 128, seed=7)) == 0


# ---- int4_hadamard --------------------------------------------------------------------------


def int4_reference(x: torch.Tensor, bs: int, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded values, integer codes) of a 4-bit absmax round trip of full blocks, written out
    apart from the codec, in float64 (the Hadamard matrix by its definition:
    H[i, j] = (-1)^popcount(i & j) / sqrt(bs))."""
    i = torch.arange(bs).tolist()
    signs = torch.tensor([[bin(a & b).count("1") % 2 for b in i] for a in i])
    h = (1 - 2 * signs).to(torch.float64) / math.sqrt(bs)
    blocks = x.reshape(-1, bs).double()
    r = blocks @ h if rotate else blocks
    s = r.abs().amax(1, keepdim=True) / 7
    s = torch.where(s > 0, s, torch.ones_like(s))
    codes = (r / s).round().clamp(-7, 7)
    q = codes * s
    return ((q @ h) if rotate else q).float().reshape(x.shape), codes.reshape(-1)


def int4_codes(enc: Encoded) -> torch.Tensor:
    """The signed codes of an int4 payload, unpacked here (low nibble first)."""
    nib = torch.stack([enc.data & 15, enc.data >> 4], 1).reshape(-1)[: enc.numel].long()
    return torch.where(nib > 7, nib - 16, nib).double()


@pytest.mark.parametrize("bs", [16, 128, 1024])
def test_int4_error_bound_per_block(bs: int) -> None:
    x = randn(64 * bs) * torch.logspace(-2, 2, 64).repeat_interleave(bs)  # scales vary by block
    enc = encode(x, INT4, bs)
    err = (decode(enc) - x).view(-1, bs)
    # the rotated values round to within s / 2 each; H is orthonormal, so a block's L2 error is
    # at most sqrt(bs) x s / 2 (plus float32 rounding of the two rotations)
    bound = math.sqrt(bs) * enc.scales / 2
    assert bool((err.norm(dim=1) <= bound * 1.001 + 1e-6).all())
    # the codes are the reference's (a float32 rotation may tip a value at a rounding tie)
    ref_y, ref_codes = int4_reference(x, bs, rotate=True)
    diff = (int4_codes(enc) - ref_codes).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    if not bool((diff > 0).any()):  # float32 rounding, relative to the block's scale
        tol = 1e-5 * enc.scales.repeat_interleave(bs) + 1e-4 * ref_y.abs()
        assert bool(((decode(enc) - ref_y).abs() <= tol).all())
    # and on Gaussian values the relative L2 error is 8.5% (blocks of 16) to 14% (1024)
    g = randn(1 << 16, seed=1)
    assert 0.07 < ((roundtrip(g, INT4, bs) - g).norm() / g.norm()).item() < 0.15


def test_int4_exact_bytes_per_value_and_packing() -> None:
    assert bytes_per_value(INT4) == 0.5 + 4 / 128
    for n in (0, 1, 2, 3, 127, 128, 129, 256, 1001):
        enc = encode(randn(n), INT4)
        assert enc.data.numel() == (n + 1) // 2 and enc.data.dtype == torch.uint8
        assert enc.scales.numel() == -(-n // 128)
        assert enc.nbytes == (n + 1) // 2 + 4 * -(-n // 128) == encoded_nbytes(n, INT4)
    # two values a byte, the first in the low nibble, two's complement: a block of one value
    # each (no rotation at size 1) whose codes are 7 and -7
    enc = encode(torch.tensor([2.0, -2.0, 1.0]), INT4, 1)
    assert enc.data.tolist() == [0x7 | (0x9 << 4), 0x7]  # -7 = 0b1001; the pad nibble is 0
    assert torch.equal(decode(enc), torch.tensor([2.0, -2.0, 1.0]))


def test_int4_rotation_spreads_outliers() -> None:
    """Heavy tails and outlier channels (what activations have): the Hadamard rotation keeps
    the error of a block's small values far below what plain 4-bit absmax gives."""
    bs = 128
    heavy = torch.distributions.StudentT(3.0).sample((512 * bs,))
    channels = randn(512 * bs, seed=2) * torch.where(torch.arange(512 * bs) % 17 == 0, 20.0, 1.0)
    for x in (heavy, channels):
        plain = (int4_reference(x, bs, rotate=False)[0] - x).norm() / x.norm()
        ours = (roundtrip(x, INT4, bs) - x).norm() / x.norm()
        assert ours < 0.7 * plain, (ours, plain)


def test_int4_adversarial_inputs() -> None:
    # all-zero blocks beside non-zero ones decode to exact zeros, scale 1 (no 0/0)
    x = torch.cat([torch.zeros(256), randn(128), torch.zeros(5)])
    enc = encode(x, INT4)
    y = decode(enc)
    assert bool((y[:256] == 0).all()) and bool((y[-5:] == 0).all())
    assert enc.scales[0] == 1 and enc.scales[1] == 1
    # a huge outlier: finite, the block still within its bound, other blocks untouched
    x = randn(384)
    x[130] = 3.0e38
    enc = encode(x, INT4)
    y = decode(enc)
    assert bool(torch.isfinite(y).all()) and bool(torch.isfinite(enc.scales).all())
    # (the first block as if alone: the same up to the rotation's float rounding, which a
    # matmul of 3 blocks and one of 1 may round apart in the last bit on some CPUs)
    alone = encode(x[:128].clone(), INT4)
    torch.testing.assert_close(enc.scales[:1], alone.scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(y[:128], decode(alone), rtol=0, atol=1e-5)
    assert y[130] > 1e36
    # values at float32's limit in every position (the rotation's sum must not overflow)
    for v in (3.4e38, -3.4e38):
        assert bool(torch.isfinite(roundtrip(torch.full((300,), v), INT4)).all())
    # tiny values (subnormal block absmax) round-trip finite and near
    tiny = randn(256) * 1e-42
    assert bool(torch.isfinite(roundtrip(tiny, INT4)).all())
    # Inf and NaN are refused before anything is cast, a finite float64 past float32 too
    for bad in (math.inf, -math.inf, math.nan):
        x = randn(300)
        x[299] = bad
        with pytest.raises(NotFiniteError):
            encode(x, INT4)


def test_int4_decode_refuses_malformed() -> None:
    enc = encode(randn(301), INT4)
    data = enc.data.clone()
    data[-1] |= 0x30  # the pad nibble after an odd count
    with pytest.raises(CodecError):
        decode(_tamper(enc, data=data))
    for bad in (
        _tamper(enc, data=enc.data[:-1]),  # one byte short
        _tamper(enc, data=torch.cat([enc.data, enc.data[:1]])),  # one byte long
        _tamper(enc, shape=(303,)),  # 152 bytes, not 151
        _tamper(enc, block_size=96),  # no Hadamard matrix of that order
        _tamper(enc, block_size=2048),
    ):
        with pytest.raises(CodecError):
            check_encoded(bad)
    # the unused code -8 decodes (finite, never produced by encode)
    data = enc.data.clone()
    data[0] = 0x88
    assert bool(torch.isfinite(decode(_tamper(enc, data=data))).all())
