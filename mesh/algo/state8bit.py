"""8-bit storage of optimizer moments between steps (optim.state_8bit, CUDA): bitsandbytes'
blockwise dynamic codes, as its 8-bit optimizers store them. StageOptimizer (mesh/algo/optim.py)
encodes and decodes around each step; plan counts the bytes."""

from __future__ import annotations

import torch


class _Blockwise8bit:
    """bitsandbytes blockwise dynamic 8-bit codes for moments between steps (as bnb's 8-bit
    optimizers: block 256, signed map for m, unsigned for v, tensors under 4096 stay fp32)."""

    BLOCK = 256
    MIN_NUMEL = 4096

    def __init__(self) -> None:
        try:
            import bitsandbytes.functional as bnbf
        except Exception as e:  # ImportError, or a broken native library
            raise ValueError(
                f"optim.state_8bit needs bitsandbytes ({e}); set optim.state_8bit=false"
            ) from e
        self._f = bnbf
        self._maps = {s: bnbf.create_dynamic_map(signed=s) for s in (True, False)}
        self._probed: set[torch.device] = set()

    def probe(self, device: torch.device) -> None:
        """Fail at construction, not mid-training, where bnb lacks this device."""
        if device in self._probed:
            return
        try:
            self.decode(*self.encode(torch.ones(self.BLOCK, device=device), True), True)
        except Exception as e:
            raise ValueError(
                f"optim.state_8bit: bitsandbytes 8-bit states do not work on {device} ({e}); "
                "set optim.state_8bit=false"
            ) from e
        self._probed.add(device)

    def encode(self, x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        code = self._maps[signed].to(x.device)
        q, qs = self._f.quantize_blockwise(x.float().contiguous(), code=code, blocksize=self.BLOCK)
        return q, qs.absmax

    def decode(self, q: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
        code = self._maps[signed].to(q.device)
        return self._f.dequantize_blockwise(q, absmax=absmax, code=code, blocksize=self.BLOCK)
