"""Exact all-gather through hivemind's DecentralizedAverager: carriers, codec, checked averager.

Role: the pieces comms/p2p/mean.py needs to make hivemind's all-reduce move bytes exactly.
- Carriers: a wire frame is spread over float32 values that hold integers 0..65535 (two bytes
  each), after a 2-carrier length header; `frame_to_carriers` / `carriers_to_frame`.
- Weights: member i averages with weight w_i, powers of two summing to 2**c
  (`member_weights`), and scales its slot by 2**c / w_i, so a reducer's weighted sum divided by
  the summed weights returns every carrier exactly (power-of-two scaling and adding zeros are
  exact in fp32) and every delta it sends back is an integer.
- `CarrierCompression`: hivemind's codec enum is closed and its reducers look codecs up by enum
  NAME in a global dict, so the codec is installed under BLOCKWISE_8BIT (hivemind's 8-bit codecs
  are broken by numpy 2.4 anyway) when this module is imported, i.e. before any averager forks.
  It sends integer tensors as uint16 (times a power of two) or int32, all-zero parts as a
  header, anything else as raw fp32: lossless on every input, with a magic and version byte.
- `CheckedAverager`: DecentralizedAverager that always forks, records partial all-reduces (the
  hook of the hivemind reference, section 2.6) and carrier byte counts in shared memory, logs
  expected failures in one line, cleans its socket file, and exits when its parent dies.

imports: torch, numpy, hivemind, comms only (no mesh, no cli).
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import signal
from typing import Any

import numpy as np
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.compression.serialization import _BASE_COMPRESSION_TYPES
from hivemind.proto import runtime_pb2

from comms import codecs
from comms.p2p.dht import one_line, watch_parent

HEAD_CARRIERS = 2  # frame length, low and high 16 bits
HEADER_BOUND = 512  # > any wire header: fixed fields + name (<= 256 B) + dims + tail
_MAGIC, _VERSION = 0x4D, 1  # first bytes of every CarrierCompression buffer
_ZERO, _U16, _I32, _F32 = 0, 1, 2, 3
_MAX_PART_VALUES = 1 << 26


def member_weights(n: int) -> list[int]:
    """n powers of two summing to the smallest power of two >= n, largest first."""
    w = [1 << (n - 1).bit_length()]
    while len(w) < n:
        w.sort(reverse=True)
        half = w.pop(0) // 2
        w += [half, half]
    return sorted(w, reverse=True)


def slot_carriers(numel: int, codec: str) -> int:
    """Carriers per member slot: a function of (numel, codec) only, so all members agree."""
    return HEAD_CARRIERS + (codecs.encoded_nbytes(numel, codec) + HEADER_BOUND + 1) // 2


def frame_to_carriers(frame: bytes, cap: int) -> torch.Tensor:
    """[len lo, len hi, byte pairs as integers 0..65535, zero padding] as float32 of size cap."""
    n = len(frame)
    if n >= 1 << 32 or HEAD_CARRIERS + (n + 1) // 2 > cap:
        raise ValueError(f"frame of {n} bytes does not fit {cap} carriers")
    out = torch.zeros(cap, dtype=torch.float32)
    out[0], out[1] = n & 0xFFFF, n >> 16
    raw = bytearray(frame) + (b"\0" if n % 2 else b"")
    pairs = torch.frombuffer(raw, dtype=torch.uint8).to(torch.int32).view(-1, 2)
    out[HEAD_CARRIERS : HEAD_CARRIERS + len(pairs)] = pairs[:, 0] + pairs[:, 1] * 256
    return out


def carriers_to_frame(slot: torch.Tensor) -> bytes | None:
    """Inverse of frame_to_carriers; None unless the used carriers are integers in range."""
    if slot.numel() < HEAD_CARRIERS or not _are_u16(slot[:HEAD_CARRIERS]):
        return None
    n = int(slot[0]) + (int(slot[1]) << 16)
    used = slot[HEAD_CARRIERS : HEAD_CARRIERS + (n + 1) // 2]
    if n == 0 or used.numel() < (n + 1) // 2 or not _are_u16(used):
        return None
    c = used.to(torch.int32)
    return torch.stack((c & 255, c >> 8), dim=1).to(torch.uint8).reshape(-1)[:n].numpy().tobytes()


def _are_u16(x: torch.Tensor) -> bool:
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return bool(lo >= 0) and bool(hi < 65536) and bool(torch.equal(x, x.trunc()))


class CarrierCompression(CompressionBase):
    """Lossless hivemind codec for carrier tensors (see module docstring); safe on any input."""

    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT
    counter: torch.Tensor | None = None  # [compressed, extracted] bytes; set in averager processes

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        t = tensor.detach().reshape(-1).to(torch.float32)
        mode, shift, body = _F32, 0, b""
        lo, hi = torch.aminmax(t) if t.numel() else (torch.tensor(0.0), torch.tensor(0.0))
        lo, hi = float(lo), float(hi)
        if lo == 0.0 and hi == 0.0:
            mode = _ZERO
        elif math.isfinite(lo) and math.isfinite(hi) and lo >= 0:
            shift = max(0, math.ceil(math.log2((hi + 1) / 65536)))
            q = t * 2.0**-shift  # exact: power-of-two scaling
            if shift <= 16 and bool(torch.equal(q, q.trunc())):
                mode, body = _U16, q.to(torch.int32).numpy().astype(np.uint16).tobytes()
        if mode == _F32 and math.isfinite(lo) and math.isfinite(hi) and -(2.0**31) <= lo:
            if hi < 2.0**31 and bool(torch.equal(t, t.trunc())):
                mode, body = _I32, t.to(torch.int32).numpy().tobytes()
        if mode == _F32:
            body = t.numpy().tobytes()
        buf = bytes((_MAGIC, _VERSION, mode, shift)) + body
        if self.counter is not None:
            self.counter[0] += len(buf)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=buf,
            size=tensor.shape,
            dtype="float32",
            requires_grad=False,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buf, shape = serialized_tensor.buffer, tuple(serialized_tensor.size)
        numel = math.prod(shape)
        if len(buf) < 4 or buf[0] != _MAGIC or buf[1] != _VERSION or buf[3] > 16:
            raise ValueError("not a meshtrain carrier buffer")
        if any(d < 0 for d in shape) or numel > _MAX_PART_VALUES:
            raise ValueError(f"bad carrier part shape {shape}")
        mode, shift, body = buf[2], buf[3], memoryview(buf)[4:]
        width = {_ZERO: 0, _U16: 2, _I32: 4, _F32: 4}.get(mode)
        if width is None or len(body) != width * numel:
            raise ValueError(f"carrier part: mode {mode}, {len(body)} bytes for {numel} values")
        if self.counter is not None:
            self.counter[1] += len(buf)
        if mode == _ZERO:
            return torch.zeros(shape)
        dtype = {_U16: np.uint16, _I32: np.int32, _F32: np.float32}[mode]
        out = torch.from_numpy(np.frombuffer(body, dtype=dtype).astype(np.float32))
        return (out * 2.0**shift if shift else out).reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 0.5  # uint16 per float32 carrier


CARRIER = CarrierCompression()


def register_carrier_codec() -> None:
    """Install CARRIER in hivemind's codec table (idempotent). Must run in every peer before
    its averager forks; importing this module does it."""
    _BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = CARRIER


register_carrier_codec()


class CheckedAverager(DecentralizedAverager):
    """DecentralizedAverager plus the partial-failure hook of the reference (section 2.6)."""

    ATTEMPTS, FAILED_VALUES, BANNED, SENT, RECEIVED = range(5)
    # hivemind assumes fork (the averager inherits tensors, pipes and MPFuture state), but its
    # mp.Process follows the default start method, which is spawn inside a spawned process: it
    # would pickle itself, and skip the after-fork hooks (the child then answers fd requests
    # with its parent's resource_sharer, and the DHT process dies). Be a fork process always.
    _start_method = "fork"
    _Popen = staticmethod(mp.context.ForkProcess._Popen)
    _after_fork = staticmethod(mp.context.ForkProcess._after_fork)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.status = torch.zeros(5, dtype=torch.int64).share_memory_()  # before the fork
        super().__init__(*args, **kwargs)

    def start_quietly(self, timeout_s: float) -> None:
        """Start without hivemind's run_in_background, which sets SIGINT to SIG_IGN in the
        parent (and only works on the main thread); the child ignores SIGINT itself."""
        self.start()
        self.wait_until_ready(timeout_s)

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
        # hivemind logs every failed step with a traceback; the caller gets the failure as a
        # MeanResult with its reason, so one warning line is enough here
        logging.getLogger("hivemind.averaging.averager").addFilter(one_line)
        # an all-reduce that hits allreduce_timeout ends its step task with an exception that
        # asyncio reports (with a traceback) as never retrieved; the caller has it already
        logging.getLogger("asyncio").addFilter(one_line)
        watch_parent(self._orphaned)
        CARRIER.counter = self.status[self.SENT :]  # in this averager's own process only
        super().run()

    def _orphaned(self) -> None:
        p2p = getattr(self, "_p2p", None)  # a replica: owns no daemon, only its socket file
        if p2p is not None:
            with contextlib.suppress(OSError, KeyError, TypeError):
                os.remove(p2p._client_listen_maddr["unix"])

    async def _shutdown(self, timeout: float | None) -> None:
        try:
            await super()._shutdown(timeout)
        finally:  # hivemind leaves the replica's /tmp/hivemind-p2pclient-*.sock behind
            await self._p2p.shutdown()

    async def _run_allreduce_inplace_(
        self, tensors: Any, group_info: Any, group_id: Any = None, **kwargs: Any
    ) -> None:
        gid = group_info.group_id if group_id is None else group_id
        self.status[self.ATTEMPTS] += 1
        try:
            await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        finally:
            fut = self._running_groups.get(gid)
            if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
                runner = fut.result()  # hivemind reports these parts as success: record them
                self.status[self.FAILED_VALUES] += runner.tensor_part_container.failed_size
                self.status[self.BANNED] += len(runner.banned_senders)
