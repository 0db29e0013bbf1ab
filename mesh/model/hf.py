"""The Hugging Face `LlamaForCausalLM` layout of the llama family: parameter names and
config.json as `transformers` writes them. Tensors are the same; only names change.

Pure: no transformers import (it is not a runtime dependency), so an export runs anywhere and
the test checks the result against the real package.
"""

from __future__ import annotations

import re
from typing import Any

from mesh.config import ModelConfig
from mesh.hf_checkpoint import model_keys_of

# (meshtrain name, HF name): "{}" is a block's index or a projection's letter(s)
_NAMES = [
    ("tok_emb.weight", "model.embed_tokens.weight"),
    ("blocks.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("blocks.{}.attn.{}_proj.weight", "model.layers.{}.self_attn.{}_proj.weight"),
    ("blocks.{}.mlp_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("blocks.{}.mlp.{}_proj.weight", "model.layers.{}.mlp.{}_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("head.weight", "lm_head.weight"),
]


def _rename(name: str, pairs: list[tuple[str, str]]) -> str | None:
    for src, dst in pairs:
        m = re.fullmatch(re.escape(src).replace(r"\{\}", r"(\w+)"), name)
        if m:
            return dst.format(*m.groups())
    return None


def hf_name(name: str) -> str:
    """A llama parameter's global name in LlamaForCausalLM's state dict."""
    out = _rename(name, _NAMES)
    if out is None:
        raise KeyError(f"{name}: not a llama parameter")
    return out


def meshtrain_name(hf: str) -> str:
    """The inverse of hf_name."""
    out = _rename(hf, [(b, a) for a, b in _NAMES])
    if out is None:
        raise KeyError(f"{hf}: not a LlamaForCausalLM parameter meshtrain knows")
    return out


def hf_config(cfg: ModelConfig, eos_token_id: int | None = None) -> dict[str, Any]:
    """config.json of LlamaForCausalLM for this model (the keys transformers writes; the rotary
    base both as v4's rope_theta and v5's rope_parameters)."""
    if cfg.arch != "llama":
        raise ValueError(f"model.arch = {cfg.arch!r} has no Hugging Face layout; only llama")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_width,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.d_model // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def model_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The [model] section of a meshtrain config from a LlamaForCausalLM config.json (an
    export's: its context is max_position_embeddings)."""
    return {**model_keys_of(hf), "seq_len": hf["max_position_embeddings"]}
