"""What a stage's forward keeps for its backward: bytes of the tensors autograd saves, per
microbatch, from the model's shapes alone (no tensor is built).

Counted tensor by tensor from what the families' forwards save (SDPA keeps q, k, v, its output
and the log-sum-exp; a linear keeps its input; RMSNorm / LayerNorm keep their input and
statistics). bf16 autocast keeps the bf16 copies a matmul casts (its input, and its weight once
per forward) beside the fp32 norms. tests/unit/test_plan.py checks every figure against the
tensors autograd saves on real stages (CPU kernels; CUDA's save the same set).
"""

from __future__ import annotations

from mesh.config import ModelConfig


def _norm_bytes(cfg: ModelConfig) -> int:
    """Per token, one norm in fp32: llama RMSNorm input, rsqrt, normed and weighted (the
    weighted product is what fp32 matmuls then keep, so it is not counted twice);
    GPT LayerNorm input, mean, rstd and output."""
    d = cfg.d_model
    return 4 * (3 * d + 1) if cfg.arch == "llama" else 4 * (2 * d + 2)


def _matmul_inputs(cfg: ModelConfig, precision: str) -> int:
    """Per token, the inputs a block's matmuls keep that are not already kept elsewhere."""
    d, mlp = cfg.d_model, cfg.mlp_width
    kv = cfg.kv_heads * (d // cfg.n_heads)
    if cfg.arch == "llama":
        if precision == "fp32":  # q and k after rotation, v, attention out; 4 SwiGLU tensors
            return 4 * (2 * d + 2 * kv + 4 * mlp)
        # bf16: a cast input per q/k/v/gate/up linear (5), q, k, v, out, 4 SwiGLU tensors
        return 2 * (5 * d + 2 * d + 2 * kv + 4 * mlp)
    r = cfg.mlp_ratio * d
    if precision == "fp32":  # qkv, attention out, MLP fc out and gelu out
        return 4 * (3 * d + d + 2 * r)
    return 2 * (2 * d + 3 * d + d + 2 * r)  # + the casts of qkv's and fc's inputs


def block_bytes_per_token(cfg: ModelConfig, precision: str) -> int:
    """Bytes one block saves per token of a microbatch (its weights' bf16 copies apart)."""
    norms = 2 * _norm_bytes(cfg)
    if precision == "bf16":  # a norm's fp32 output is cast for the matmuls and not kept
        norms -= 2 * 4 * cfg.d_model
    lse = 4 * cfg.n_heads  # SDPA's log-sum-exp, fp32
    return norms + _matmul_inputs(cfg, precision) + lse


def block_weight_copy_bytes(cfg: ModelConfig, precision: str) -> int:
    """bf16 autocast's copies of a block's matrices, kept for the backward; fp32: none."""
    if precision == "fp32":
        return 0
    d, mlp = cfg.d_model, cfg.mlp_width
    if cfg.arch == "llama":
        kv = cfg.kv_heads * (d // cfg.n_heads)
        return 2 * (2 * d * d + 2 * d * kv + 3 * d * mlp)
    return 2 * (4 * d * d + 2 * cfg.mlp_ratio * d * d)


def saved_bytes(
    cfg: ModelConfig, n_layers: int, first: bool, last: bool, batch: int, precision: str
) -> int:
    """Bytes autograd keeps between a stage's forward of one microbatch (batch x seq_len
    tokens) and its backward, the last stage's loss included."""
    tokens, d, t = batch * cfg.seq_len, cfg.d_model, cfg.seq_len
    total = n_layers * (tokens * block_bytes_per_token(cfg, precision))
    total += n_layers * block_weight_copy_bytes(cfg, precision)
    if cfg.arch == "llama":  # rotary cos and sin (T, head_dim), shared by the stage's blocks
        hd = d // cfg.n_heads
        total += 2 * t * hd * 4 + (n_layers * 2 * t * hd * 2 if precision == "bf16" else 0)
    if first:  # the token ids the embedding keeps (and the GPT's positions)
        total += tokens * 8 + (t * 8 if cfg.arch == "gpt" else 0)
    if last:
        if precision == "fp32":
            total += tokens * _norm_bytes(cfg)
        else:  # the norm minus its cast-away output, the head's bf16 input and weight
            total += tokens * (_norm_bytes(cfg) - 4 * d + 2 * d) + 2 * d * cfg.vocab_size
        total += tokens * (4 * cfg.vocab_size + 8)  # the loss: log-softmax and the targets
    return total


def output_bytes(cfg: ModelConfig, last: bool, batch: int) -> int:
    """A stage's fp32 output for one microbatch: logits on the last stage, else activations."""
    return batch * cfg.seq_len * 4 * (cfg.vocab_size if last else cfg.d_model)
