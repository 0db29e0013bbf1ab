"""The data-parallel baselines as settings of one system: a method name -> config overrides."""

from __future__ import annotations

from typing import Any

from mesh.config import Config, with_overrides

# NAdamW with beta1 0.99 takes larger effective steps than AdamW: half the lr (800-step sweep,
# 4x1 async, lr in {1, 2, 3, 5}e-3: 1e-3 best)
NADAMW_LR = 1e-3
_ASYNC = {"pipeline.schedule": "async", "optim.name": "nadamw", "optim.lr": NADAMW_LR}
_SPARSE = {**_ASYNC, "dp.mode": "param_avg", "dp.fraction": 0.05, "dp.codec": "fp32"}

METHODS: dict[str, dict[str, Any]] = {
    # sync pipeline with flush + blocking fp32 gradient all-reduce: the classic data center recipe
    "FullSync": {
        "pipeline.schedule": "gpipe",
        "optim.name": "adamw",
        "optim.lr": 2e-3,
        "dp.mode": "grad_allreduce",
        "dp.codec": "fp32",
    },
    "DPAvg": {**_SPARSE, "dp.fraction": 1.0, "dp.tau": 0, "dp.correction": "replace"},
    "SPARTA": {**_SPARSE, "dp.tau": 0, "dp.correction": "replace"},
    "AsyncSPARTA": {**_SPARSE, "dp.correction": "replace"},
    "AsyncMesh": {**_SPARSE, "dp.correction": "ema"},
    "AsyncMesh-fp8": {**_SPARSE, "dp.correction": "ema", "dp.codec": "fp8_e4m3"},
    "DeltaRule": {**_SPARSE, "dp.correction": "delta"},
    "NoComm": {**_ASYNC, "dp.mode": "none"},
}


def apply_method(cfg: Config, method: str) -> Config:
    """cfg with the method's settings (tau and the rest keep cfg's values unless pinned)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return with_overrides(cfg, METHODS[method])
