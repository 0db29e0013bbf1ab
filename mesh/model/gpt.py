"""The byte-level demo GPT (pre-norm, LayerNorm, learned positions, GELU MLP) as stage modules.

Stage 0 owns the token and position embeddings, the last stage the final norm and the head.
Parameter names are global (`blocks.5.attn.qkv.weight` lives in whichever stage holds block 5),
so a stage's state means the same thing on every peer and the optimizer can tell hidden
matrices (Muon) from embeddings, head and norms (AdamW) by name. Construction and init:
mesh.model.build.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mesh.config import ModelConfig
from mesh.model.kv import KVCache, attend


def embedding(n: int, d: int) -> nn.Embedding:
    """An (n, d) embedding left uninitialised: stages are built on the meta device and then
    initialised by mesh.model.build, and nn.Embedding's own init (normal_) on the meta device
    imports torch._dynamo, 1.5 s of CPU in every process that builds a first stage."""
    return nn.Embedding(n, d, _weight=torch.empty(n, d))


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, layer: int) -> None:
        super().__init__()
        self.n_heads, self.layer = n_heads, layer
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        cached = 0
        if cache is not None:
            cached = cache.pos
            k, v = cache.extend(self.layer, k, v)
        y = attend(q, k, v, cached)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, ratio: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, ratio * d_model, bias=False)
        self.proj = nn.Linear(ratio * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_heads, layer)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class StageModule(nn.Module):
    """Blocks `layers` of the LM, plus the embeddings if `first` and norm + head if `last`.

    forward: token ids (B, T) int64 on the first stage, activations (B, T, d) otherwise;
    returns logits (B, T, V) on the last stage, activations (B, T, d) otherwise.
    """

    def __init__(self, cfg: ModelConfig, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last, self.layers = first, last, layers
        if first:
            self.tok_emb = embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in layers})
        if last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if self.first:
            start = cache.pos if cache is not None else 0
            pos = torch.arange(start, start + x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        for i in self.layers:
            x = self.blocks[str(i)](x, cache)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def init_std(name: str, cfg: ModelConfig) -> float:
    """GPT-2 init of a matrix: N(0, 0.02), the residual projections' std scaled by 1/sqrt(2 L)
    so depth stays stable (norm gains start at one, biases at zero: mesh.model.build)."""
    return 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith("proj.weight") else 0.02
