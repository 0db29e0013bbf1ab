"""Tensor codecs: what a float tensor becomes before it crosses a link, and back.

Role: pure functions between a float tensor and an `Encoded` (raw data tensor + optional per-block
fp32 scales). No framing and no I/O here (that is comms/wire.py). Every value that leaves
`decode` is finite, and `encode` refuses non-finite input, because FP8 hides Inf (a cast to
float8_e4m3fn turns +Inf into NaN or 448).

Codecs (bytes per value at block 128):
- fp32: raw float32 (4).            - bf16: raw bfloat16 (2).
- fp8_e4m3 / fp8_e5m2: per-block absmax scale s = amax / qmax, q = cast(clamp(x / s)), data sent
  as a uint8 view (numpy and hivemind cannot carry fp8 dtypes), scales fp32 (1 + 4/128).
- int8_blockwise: bitsandbytes' dynamic 8-bit blockwise format (1 + 4/128): per-block absmax
  (sent as the fp32 scale), values / absmax mapped to the nearest of the 256 entries of
  `create_dynamic_map(signed=True)`. The map is rebuilt here bit-identically (never sent).
  Implemented in torch, not by calling bnb: bnb 0.50.2's CPU kernels do work, but they run on
  the system libgomp while torch runs its own OpenMP; after any multi-threaded torch op the two
  contend and each bnb call costs ~10 ms even for 40 values (2 cores). Importing bnb also takes
  ~3 s (it pulls in torch._dynamo). Our decode is bit-identical to bnb.dequantize_blockwise;
  our encode picks the exactly nearest code (bnb's CPU search picks the second nearest for
  ~0.15% of values), so bytes differ from bnb's but bnb decodes them (tests check both).
  Block sizes are limited to the ones bnb documents (64..4096) so a bnb peer could decode them.

- int4_hadamard: 4 bits a value, two values a byte (the first in the low nibble; an odd count
  leaves the last high nibble 0), one fp32 scale per block (0.5 + 4/128). Each full block is
  rotated by the orthonormal Hadamard matrix H / sqrt(block) before it is quantized (as
  TAH-Quant, arXiv 2506.01352, does per tile), so an outlier spreads over its block instead of
  flattening the rest of it to zero; then s = absmax(rotated block) / 7 and q = round(r / s) in
  [-7, 7] (two's complement nibbles). Decode undoes both: x = (q H) s. The partial tail block is
  quantized unrotated (no Hadamard matrix of its size). Block sizes are powers of two up to
  1024. Per value the rotated error is at most s / 2, so a block's L2 error is at most
  sqrt(block) x s / 2. Inputs past +-2**122 are clamped first (as bf16 clamps near its max), so
  neither the scales nor the decode overflow float32.

Blocks are taken over the flattened tensor; the last block may be partial. Full blocks are a
reshape, the partial tail is handled separately (no padding copy, no Python loop over blocks).

imports: torch only (no mesh, no cli).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from comms.errors import CodecError, NotFiniteError
from comms.names import CODECS

DEFAULT_BLOCK_SIZE = 128
MAX_BLOCK_SIZE = 1 << 16
INT8_BLOCK_SIZES = frozenset({64, 128, 256, 512, 1024, 2048, 4096})

_FP8: dict[str, tuple[torch.dtype, float]] = {
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
}
_INT4 = "int4_hadamard"
_INT4_QMAX = 7
_INT4_MAX_BLOCK = 1024  # its Hadamard matrix is 4 MB
_INT4_LIMIT = 2.0**122  # |x| past this is clamped: scale <= limit x sqrt(1024) / 7 stays finite
_BLOCKED = frozenset({"fp8_e4m3", "fp8_e5m2", "int8_blockwise", _INT4})
_DATA_DTYPE: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.uint8,
    "fp8_e5m2": torch.uint8,
    "int8_blockwise": torch.uint8,
    _INT4: torch.uint8,  # two values a byte
}
_BF16_MAX = torch.finfo(torch.bfloat16).max


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no boolean ==
class Encoded:
    """A tensor as it crosses the wire. `data` is 1-D in the codec's data dtype; `scales` is
    1-D float32 with one entry per block for blocked codecs, else None."""

    codec: str
    shape: tuple[int, ...]
    data: torch.Tensor
    scales: torch.Tensor | None
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exact bytes that cross the wire: data bytes plus scale bytes."""
        n = self.data.numel() * self.data.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n


def is_blocked(codec: str) -> bool:
    """True when the codec sends one fp32 scale per block."""
    return codec in _BLOCKED


def data_dtype(codec: str) -> torch.dtype:
    """dtype of `Encoded.data` for this codec (what the receiver reads the data bytes as)."""
    _check_codec(codec)
    return _DATA_DTYPE[codec]


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def data_nbytes(numel: int, codec: str) -> int:
    """Bytes of `Encoded.data` for numel values (4-bit codecs: two values a byte)."""
    _check_codec(codec)
    if codec == _INT4:
        return -(-numel // 2)
    return numel * _DATA_DTYPE[codec].itemsize


def check_block_size(codec: str, block_size: int) -> None:
    """Raise CodecError unless block_size is usable with codec."""
    _check_codec(codec)
    if not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise CodecError(f"block_size must be an int in [1, {MAX_BLOCK_SIZE}], got {block_size!r}")
    if codec == "int8_blockwise" and block_size not in INT8_BLOCK_SIZES:
        raise CodecError(f"int8_blockwise block_size must be one of {sorted(INT8_BLOCK_SIZES)}")
    if codec == _INT4 and (block_size > _INT4_MAX_BLOCK or block_size & (block_size - 1)):
        raise CodecError(
            f"{_INT4} block_size must be a power of two <= {_INT4_MAX_BLOCK} (a Hadamard "
            f"block), got {block_size}"
        )


def encoded_nbytes(numel: int, codec: str, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Exact wire bytes of encode(x, codec, block_size) for a tensor of numel values."""
    check_block_size(codec, block_size)
    if numel < 0:
        raise CodecError(f"numel must be >= 0, got {numel}")
    n = data_nbytes(numel, codec)
    if codec in _BLOCKED:
        n += 4 * num_blocks(numel, block_size)
    return n


def bytes_per_value(codec: str, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Asymptotic wire bytes per value (scales amortized over full blocks)."""
    check_block_size(codec, block_size)
    b = 0.5 if codec == _INT4 else float(_DATA_DTYPE[codec].itemsize)
    return b + 4.0 / block_size if codec in _BLOCKED else b


def encode(x: torch.Tensor, codec: str, block_size: int = DEFAULT_BLOCK_SIZE) -> Encoded:
    """Encode a floating tensor. Raises CodecError on unknown codec or any non-finite value."""
    check_block_size(codec, block_size)
    if not isinstance(x, torch.Tensor) or not (x.is_floating_point()):
        raise CodecError(f"encode expects a floating-point tensor, got {_describe(x)}")
    shape = tuple(x.shape)
    # reshape copies only when x is non-contiguous; fp64/fp16 inputs are cast to fp32 here.
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()

    if codec in _BLOCKED:
        amax = _block_absmax(flat, block_size)
        # amax propagates NaN and Inf, so this checks every input value BEFORE any cast.
        if n and not bool(torch.isfinite(amax).all()):
            raise NotFiniteError("encode: input is not finite")
        if codec == "int8_blockwise":
            return Encoded(codec, shape, _int8_codes(flat, amax, block_size), amax, block_size)
        if codec == _INT4:
            data, scales = _int4_encode(flat, amax, block_size)
            return Encoded(codec, shape, data, scales, block_size)
        fp8, qmax = _FP8[codec]
        scales = amax / qmax
        # An all-zero block (or one so tiny that amax / qmax underflows) gets scale 1: no 0/0.
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        y = torch.empty_like(flat)
        _per_block(torch.div, flat, scales, block_size, y)
        # x / s can land past qmax (rounding; subnormal scales); out-of-range casts give Inf
        # (e5m2) or NaN (e4m3fn, backend-dependent), so clamp first.
        y.clamp_(-qmax, qmax)
        return Encoded(codec, shape, y.to(fp8).view(torch.uint8), scales, block_size)

    if n:
        lo, hi = torch.aminmax(flat)
        if not (math.isfinite(lo.item()) and math.isfinite(hi.item())):
            raise NotFiniteError("encode: input is not finite")
    if codec == "fp32":
        # clone: the Encoded is a snapshot, later in-place updates of x must not leak into it.
        data = flat.clone() if flat.data_ptr() == x.data_ptr() else flat
        return Encoded(codec, shape, data, None, block_size)
    if codec == "bf16":
        if n and max(-lo.item(), hi.item()) > _BF16_MAX:
            flat = flat.clamp(-_BF16_MAX, _BF16_MAX)  # fp32 values near 3.4e38 round to bf16 Inf
        return Encoded(codec, shape, flat.to(torch.bfloat16), None, block_size)
    raise AssertionError(codec)  # unreachable: check_block_size validated the codec


def decode(enc: Encoded) -> torch.Tensor:
    """Decode to a new float32 tensor of shape enc.shape. Raises CodecError if enc is
    inconsistent (sizes, dtypes, scales) or the result is not finite."""
    check_encoded(enc)
    codec, n, bs = enc.codec, enc.numel, enc.block_size
    data = enc.data.reshape(-1)
    if codec == "fp32":
        out = data.clone()  # fresh memory: data may alias a received (read-only) buffer
    elif codec == "bf16":
        out = data.to(torch.float32)
    elif codec in _FP8:
        out = data.view(_FP8[codec][0]).to(torch.float32)
        _per_block(torch.mul, out, enc.scales, bs, out)
    elif codec == _INT4:
        assert enc.scales is not None  # check_encoded: a blocked codec carries its scales
        out = _int4_decode(data, enc.scales, n, bs)
    else:  # int8_blockwise: code[q] * absmax, the same float ops as bnb's dequantize
        out = _int8_tables(data.device)[0].index_select(0, data.to(torch.int32))
        _per_block(torch.mul, out, enc.scales, bs, out)
    if n:
        lo, hi = torch.aminmax(out)
        if not (math.isfinite(lo.item()) and math.isfinite(hi.item())):
            raise NotFiniteError("decode: result is not finite")
    return out.reshape(enc.shape)


def roundtrip(x: torch.Tensor, codec: str, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """decode(encode(x)): what the receiver sees. Useful to simulate a link in one process."""
    return decode(encode(x, codec, block_size))


def check_shape(shape: tuple[int, ...]) -> int:
    """Return numel; raise CodecError unless shape is a tuple of ints >= 0 that torch can hold
    (the product of the non-zero dims, i.e. every stride, must fit in an int64 even if numel
    is 0)."""
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise CodecError(f"bad shape {shape!r}")
    if math.prod(d for d in shape if d) >= 1 << 63:
        raise CodecError(f"shape {shape} overflows int64")
    return math.prod(shape)


def check_encoded(enc: Encoded) -> None:
    """Raise CodecError unless enc is self-consistent (codec, block size, shape, data dtype and
    size, scale count, finite non-negative scales). Does not look at the data values."""
    if not isinstance(enc, Encoded):
        raise CodecError(f"decode expects an Encoded, got {_describe(enc)}")
    check_block_size(enc.codec, enc.block_size)
    shape = enc.shape
    n = check_shape(shape)
    data = enc.data
    if not isinstance(data, torch.Tensor) or data.dtype != _DATA_DTYPE[enc.codec]:
        raise CodecError(
            f"{enc.codec} data must be {_DATA_DTYPE[enc.codec]}, got {_describe(data)}"
        )
    want = data_nbytes(n, enc.codec) // data.element_size()
    if data.numel() != want:
        raise CodecError(f"data has {data.numel()} entries, shape {shape} needs {want}")
    if enc.codec not in _BLOCKED:
        if enc.scales is not None:
            raise CodecError(f"{enc.codec} carries no scales")
        return
    scales = enc.scales
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise CodecError(f"{enc.codec} scales must be float32, got {_describe(scales)}")
    nb = num_blocks(n, enc.block_size)
    if scales.numel() != nb:
        raise CodecError(
            f"{scales.numel()} scales, {n} values in blocks of {enc.block_size} need {nb}"
        )
    # Encoders only produce finite, non-negative scales; anything else is corruption or attack.
    if nb and not bool(torch.isfinite(scales).all()):
        raise NotFiniteError("scales are not finite")
    if nb and bool((scales < 0).any()):
        raise CodecError("scales must be >= 0")


def _block_absmax(flat: torch.Tensor, bs: int) -> torch.Tensor:
    """max |x| per block; aminmax avoids materializing |x| (one pass, no n-sized temporary)."""
    n = flat.numel()
    nf = n // bs
    out = flat.new_empty(num_blocks(n, bs))
    if nf:
        lo, hi = torch.aminmax(flat[: nf * bs].view(nf, bs), dim=1)
        torch.maximum(hi, lo.neg(), out=out[:nf])
    if n > nf * bs:
        lo, hi = torch.aminmax(flat[nf * bs :])
        out[nf] = torch.maximum(hi, lo.neg())
    return out


def _per_block(
    op: Callable[..., torch.Tensor],
    src: torch.Tensor,
    scales: torch.Tensor,
    bs: int,
    out: torch.Tensor,
) -> None:
    """out[i] = op(src[i], scales[i // bs]) on flat tensors: full blocks 2-D, the tail apart."""
    n = src.numel()
    nf = n // bs
    if nf:
        op(src[: nf * bs].view(nf, bs), scales[:nf, None], out=out[: nf * bs].view(nf, bs))
    if n > nf * bs:
        op(src[nf * bs :], scales[nf], out=out[nf * bs :])


def _int4_encode(
    flat: torch.Tensor, amax: torch.Tensor, bs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed nibbles, scales) of finite values whose per-block absmax is amax."""
    n = flat.numel()
    if n and float(amax.max()) > _INT4_LIMIT:
        flat = flat.clamp(-_INT4_LIMIT, _INT4_LIMIT)
    nf = n // bs
    rotated = flat.clone() if nf * bs < n else flat.new_empty(n)
    if nf:
        torch.mm(
            flat[: nf * bs].view(nf, bs),
            _hadamard(bs, flat.device),
            out=rotated[: nf * bs].view(nf, bs),
        )
    scales = _block_absmax(rotated, bs) / _INT4_QMAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero block: no 0/0
    _per_block(torch.div, rotated, scales, bs, rotated)
    q = rotated.round_().clamp_(-_INT4_QMAX, _INT4_QMAX).to(torch.int8).view(torch.uint8)
    if n % 2:
        q = torch.cat([q, q.new_zeros(1)])
    nib = q.view(-1, 2) & 0x0F
    return nib[:, 0] | (nib[:, 1] << 4), scales


def _int4_decode(data: torch.Tensor, scales: torch.Tensor, n: int, bs: int) -> torch.Tensor:
    """The float32 values of n packed nibbles (sizes checked by check_encoded)."""
    if n % 2 and int(data[-1]) >> 4:
        raise CodecError(f"{_INT4}: the pad nibble after {n} values must be 0")
    # one lookup a byte gives both of its values (two's complement nibbles; -8 decodes too)
    out = _int4_pairs(data.device).index_select(0, data.to(torch.int32)).view(-1)[:n]
    nf = n // bs
    if nf:  # x = (q H) s: the rotation first, on small integers (nothing near float32's max)
        full = out[: nf * bs].view(nf, bs)
        full.copy_(full @ _hadamard(bs, out.device))
    _per_block(torch.mul, out, scales, bs, out)
    return out


@cache
def _int4_pairs(device: torch.device) -> torch.Tensor:
    """(256, 2) float32: the (low, high) nibble values of every byte."""
    nib = torch.arange(16)
    value = torch.where(nib > 7, nib - 16, nib).to(torch.float32)
    byte = torch.arange(256)
    return torch.stack([value[byte & 0x0F], value[byte >> 4]], dim=1).to(device)


@cache
def _hadamard(bs: int, device: torch.device) -> torch.Tensor:
    """The orthonormal Hadamard matrix of order bs (a power of two; Sylvester's construction),
    symmetric, so it is its own inverse."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < bs:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(bs)).to(torch.float32).to(device)


def _check_codec(codec: str) -> None:
    if codec not in _DATA_DTYPE:
        raise CodecError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")


def _describe(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return f"tensor(dtype={obj.dtype}, shape={tuple(obj.shape)})"
    return type(obj).__name__


def _int8_codes(flat: torch.Tensor, amax: torch.Tensor, bs: int) -> torch.Tensor:
    """Index of the nearest dynamic-map entry to each x / absmax(block), as uint8."""
    _, lut_q, lut_thr = _int8_tables(flat.device)
    y = torch.empty_like(flat)
    _per_block(torch.div, flat, torch.where(amax > 0, amax, torch.ones_like(amax)), bs, y)
    # y is in [-1, 1]. Its top 16 bits (sign, exponent, 7 mantissa bits) pick a LUT cell; a
    # cell is narrower than the gap between two map midpoints, so it holds at most one: the
    # answer is lut_q or lut_q + 1, decided by one compare. No search, no loop.
    key = (y.view(torch.int32) >> 16).add_(1 << 15)
    q = lut_q.index_select(0, key)
    q += lut_thr.index_select(0, key) < y
    return q


@cache
def _int8_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(code, lut_q, lut_thr): the 256-entry map and the 2**16-cell nearest-code lookup."""
    code = _dynamic_map()
    mid = (code[1:] + code[:-1]) / 2
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32) << 16
    ends = torch.stack([bits, bits | 0xFFFF]).view(torch.float32)  # first/last float of a cell
    # y is finite and in [-1, 1]: cells holding Inf/NaN are never hit, cells past +-1 only at +-1
    ends = torch.where(torch.isfinite(ends).all(0), ends, 0.0).clamp(-1.0, 1.0)
    lo, hi = ends.amin(0), ends.amax(0)  # for negative floats the bit order is reversed
    q_lo, q_hi = torch.bucketize(lo, mid), torch.bucketize(hi, mid)
    assert int((q_hi - q_lo).max()) <= 1, "a LUT cell straddles two map midpoints"
    thr = torch.where(q_hi > q_lo, mid[q_lo.clamp(max=254)], torch.full_like(lo, math.inf))
    return code.to(device), q_lo.to(torch.uint8).to(device), thr.to(device)


def _dynamic_map() -> torch.Tensor:
    """bitsandbytes.functional.create_dynamic_map(signed=True), same float ops: decade i
    (1e-6 .. 1) holds the 2**i midpoints of linspace(0.1, 1, 2**i + 1), both signs, + 0 and 1."""
    data: list[float] = []
    for i in range(7):
        b = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (i - 6)) * means).tolist()
        data += (-(10 ** (i - 6)) * means).tolist()
    data += [0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


def shuffled_error(x: torch.Tensor, codec: str, block_size: int, seed: int) -> torch.Tensor:
    """The codec's rounding error on a shuffled copy of x (dp.noise_codec): noise of the size
    the codec adds to a payload like x, but not tied to x's own coordinates, so adding it to a
    mean separates what the codec's noise does from what its bias on particular values does."""
    g = torch.Generator().manual_seed(seed)
    shuffled = x[torch.randperm(x.numel(), generator=g)]
    return roundtrip(shuffled, codec, block_size) - shuffled
