"""A decoder-only LM (pre-norm, causal attention) and its cut into pipeline stage modules.

Stage 0 owns the token and position embeddings, the last stage the final norm, the head and the
loss. Parameter names are global (`blocks.5.attn.qkv.weight` lives in whichever stage holds
block 5), so a stage's state means the same thing on every peer and the optimizer can tell hidden
matrices (Muon) from embeddings, head and norms (AdamW) by name.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from mesh.algo.topology import partition_layers
from mesh.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, ratio: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, ratio * d_model, bias=False)
        self.proj = nn.Linear(ratio * d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_heads)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
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
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        if last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        for i in self.layers:
            x = self.blocks[str(i)](x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def init_weights(module: nn.Module, n_layers: int) -> None:
    """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 L) so depth stays stable."""
    for name, p in module.named_parameters():
        if p.ndim == 1:
            nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
        elif name.endswith("proj.weight"):
            nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layers))
        else:
            nn.init.normal_(p, 0.0, 0.02)


def build_model(cfg: ModelConfig, seed: int) -> StageModule:
    """The whole LM as one module (the one-stage reference). Same seed, same weights everywhere."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = StageModule(cfg, range(cfg.n_layers), first=True, last=True)
    init_weights(model, cfg.n_layers)
    torch.random.set_rng_state(gen_state)
    return model


def split_model(model: StageModule, cfg: ModelConfig, n_stages: int) -> list[StageModule]:
    """Cut a whole model into n_stages stage modules with copies of its weights."""
    stages = []
    full = model.state_dict()
    for s, layers in enumerate(partition_layers(cfg.n_layers, n_stages)):
        stage = StageModule(cfg, layers, first=s == 0, last=s == n_stages - 1)
        own = {k: v for k, v in full.items() if k in stage.state_dict()}
        stage.load_state_dict(copy.deepcopy(own), strict=True)
        stages.append(stage)
    return stages


def build_stages(cfg: ModelConfig, n_stages: int, seed: int) -> list[StageModule]:
    """The P stage modules of one replica, initialised as the whole model would be."""
    return split_model(build_model(cfg, seed), cfg, n_stages)


def build_stage(cfg: ModelConfig, n_stages: int, stage: int, seed: int) -> StageModule:
    """One cell's stage module (a peer builds only its own, with the run's common init)."""
    return build_stages(cfg, n_stages, seed)[stage]
