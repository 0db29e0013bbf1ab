"""The Llama family as stage modules: RMSNorm, rotary positions, SwiGLU, grouped-query attention,
untied embedding and head.

Names and tensor layouts are those of Hugging Face `LlamaForCausalLM` under a rename
(mesh.model.hf): rotary embeddings rotate the two halves of each head (HF's `rotate_half`), so
q_proj and k_proj are stored exactly as HF stores them and export copies tensors as they are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mesh.config import ModelConfig
from mesh.model import boundary as ends
from mesh.model.gpt import embedding
from mesh.model.kv import KVCache, attend


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics under autocast too, as HF's LlamaRMSNorm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, head_dim) of HF's default rotary embedding at these positions (fp32)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads, self.n_kv = layer, cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        d, hd = cfg.d_model, self.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        cached = 0
        if cache is not None:
            cached = cache.pos
            k, v = cache.extend(self.layer, k, v)
        y = attend(q, k, v, cached, gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.mlp_width, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.mlp_width, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_width, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache)
        return x + self.mlp(self.mlp_norm(x))


class StageModule(nn.Module):
    """Blocks `layers`, plus the token embedding if `first` and norm + head if `last`; the same
    inputs and outputs as the GPT's stage module. With a compressed boundary
    (mesh/model/boundary.py) a stage takes and gives the boundary's coordinates instead of the
    residual stream, and reads the microbatch's `tokens` for the anchors."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: range,
        first: bool,
        last: bool,
        stage: int = 0,
        boundary: ends.BoundarySpec | None = None,
    ) -> None:
        super().__init__()
        self.first, self.last, self.layers = first, last, layers
        self.head_dim, self.theta = cfg.d_model // cfg.n_heads, cfg.rope_theta
        if first:
            self.tok_emb = embedding(cfg.vocab_size, cfg.d_model)
        spec = boundary or ends.BoundarySpec()
        self.boundary = ends.build_ends(spec, cfg.d_model, cfg.vocab_size, stage, first, last)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in layers})
        if last:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.first:
            tokens = x
            x = self.tok_emb(x)
        elif self.boundary is not None:
            assert tokens is not None, "a compressed boundary's anchors read the tokens"
            x = ends.receive(self.boundary, x, tokens)
        start = cache.pos if cache is not None else 0
        # computed per call, not a buffer: a stage built on the meta device has no buffers to
        # fill, and this is (T, head_dim), small beside any block
        rope = rotary(
            torch.arange(start, start + x.shape[1], device=x.device), self.head_dim, self.theta
        )
        for i in self.layers:
            x = self.blocks[str(i)](x, rope, cache)
        if self.last:
            x = self.head(self.norm(x))
        elif self.boundary is not None:
            x = ends.send(self.boundary, x, tokens)
        return x


def init_std(name: str, cfg: ModelConfig) -> float:
    """A matrix's init std: N(0, 0.02) (HF's initializer_range), the residual projections
    (o_proj, down_proj) scaled by 1/sqrt(2 L) as in GPT-2."""
    residual = name.endswith(("o_proj.weight", "down_proj.weight"))
    return 0.02 / math.sqrt(2 * cfg.n_layers) if residual else 0.02
