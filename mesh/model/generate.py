"""Sampling text from a model's stages with a KV cache: prefill the prompt once, then one token
a step through every stage (greedy at temperature 0, else temperature and top-k sampling).
"""

from __future__ import annotations

import torch
from torch import nn

from mesh.model.kv import KVCache


def forward_cached(stages: list[nn.Module], ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits of `ids` (B, t) after the tokens already in `cache`; the cache then holds them."""
    h = ids
    for stage in stages:
        h = stage(h, cache)
    cache.pos += ids.shape[1]
    return h


def next_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator
) -> int:
    """One token from the last position's logits (V,): argmax at temperature 0."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.no_grad()
def generate(
    stages: list[nn.Module],
    prompt: list[int],
    max_new_tokens: int,
    context: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    eot_id: int | None = None,
) -> list[int]:
    """The tokens sampled after `prompt` (stops early at eot_id). `context` is the model's
    seq_len: when the cache fills, it is rebuilt from the last half of the text (the positions a
    model was trained on are never exceeded)."""
    if not prompt:
        raise ValueError("an empty prompt: give at least one token")
    device = next(stages[0].parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    cache = KVCache()
    logits = forward_cached(stages, torch.tensor([ids[-context:]], device=device), cache)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = next_token(logits[0, -1].cpu(), temperature, top_k, gen)
        out.append(token)
        ids.append(token)
        if token == eot_id or len(out) == max_new_tokens:
            break
        if cache.pos >= context:
            cache = KVCache()
            window = torch.tensor([ids[-(context // 2) :]], device=device)
            logits = forward_cached(stages, window, cache)
        else:
            logits = forward_cached(stages, torch.tensor([[token]], device=device), cache)
    return out
