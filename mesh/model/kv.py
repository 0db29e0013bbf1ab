"""The key/value cache of incremental decoding: one (k, v) pair per block, and the position.

Both families' attention reads it the same way: new keys and values are appended to a block's
entry and the queries attend over everything cached so far (`generate` feeds one token a step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pos = 0  # tokens already cached (the positions of the next inputs start here)

    def extend(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's (B, H, t, hd) keys and values; return the whole cached sequence."""
        if layer in self.layers:
            k0, v0 = self.layers[layer]
            k, v = torch.cat([k0, k], dim=2), torch.cat([v0, v], dim=2)
        self.layers[layer] = (k, v)
        return k, v


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int, gqa: bool = False
) -> torch.Tensor:
    """Causal attention of t new queries over `cached` earlier keys plus their own.

    SDPA's is_causal aligns the mask top-left, right only without a cache; with one, each new
    query sees every cached key and the new keys up to its own position (bottom-right).
    """
    t = q.shape[2]
    if cached == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if t == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    mask = torch.ones(t, cached + t, dtype=torch.bool, device=q.device).tril(cached)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
