"""`meshtrain bench model`: what one cell of a real model costs on this machine.

Per stage of llama-20m and llama-160m (or the models named: llama-1b on a GPU), fp32 against
bf16: the cell's forward+backward time per microbatch (the runtime's own path: the stashed
version's recompute-and-backward, Cell.backward, as the workers run it) against a plain
torch loop over the same layers (module(x), backward) - the runtime's overhead; the no-grad
forward an async cell runs first to send activations early, apart; tokens/s and achieved FLOP/s
(6 x matmul parameters per token + 12 x layers x seq_len x d for attention); and the cell's peak
memory (its build, a full stash, one microbatch, one update) against `meshtrain plan`. On CUDA,
memory is torch.cuda.max_memory_allocated and MFU is against the device's dense bf16 peak; on the
CPU it is the peak of live tensor storage, counted by a dispatch mode.
"""

from __future__ import annotations

import json
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mesh.config import Config, load_config
from mesh.engine.cell import Cell
from mesh.engine.plan import plan_cell
from mesh.model.build import (
    autocast,
    build_stage,
    lm_loss,
    stage_layers,
    stage_module,
)
from mesh.report import format_table

PRESETS = ("llama-20m", "llama-160m")  # the default; `--preset` names any of configs/models/
# dense bf16 tensor-core peaks (FLOP/s) by device name fragment, from the vendors' sheets: MFU's
# usual denominator. The H200 is the H100 SXM's chip with more and faster memory: the same
# 989 TFLOP/s dense (its sheet's 1979 counts 2:4 sparsity).
BF16_PEAK = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "4090": 165e12,
    "3090": 71e12,
}


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storage alive at once among the tensors made while active (each
    storage counted once, released when torch frees it): CPU's max_memory_allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._held: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._held:
                    self._held.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._held.discard(key)
        self.live -= nbytes


def stage_flops_per_token(cfg: Config, stage: int) -> float:
    """6 x matmul parameters (the embedding is a lookup) + attention's 12 x L x T x d."""
    layers, first, last = stage_layers(cfg.model, cfg.grid.stages, stage)
    module = stage_module(cfg.model, layers, first, last)  # shapes only
    matmul = sum(p.numel() for n, p in module.named_parameters() if p.ndim == 2 and "emb" not in n)
    return 6.0 * matmul + 12.0 * len(layers) * cfg.model.seq_len * cfg.model.d_model


def _inputs(cfg: Config, stage: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A microbatch's input of stage j (token ids or activations) and its targets / incoming
    gradient (the last stage's targets, else dL/d(output))."""
    _, first, last = stage_layers(cfg.model, cfg.grid.stages, stage)
    B, T, d, V = (
        cfg.pipeline.microbatch_size,
        cfg.model.seq_len,
        cfg.model.d_model,
        cfg.model.vocab_size,
    )
    gen = torch.Generator().manual_seed(stage)
    x = torch.randint(0, V, (B, T), generator=gen) if first else torch.randn(B, T, d, generator=gen)
    y = (
        torch.randint(0, V, (B, T), generator=gen)
        if last
        else torch.randn(B, T, d, generator=gen) * 1e-3
    )
    return x.to(device), y.to(device)


def _cell_step(
    cell: Cell, x: torch.Tensor, y: torch.Tensor, last: bool, precision: str
) -> list[torch.Tensor]:
    """The runtime's backward of an update's first (async: only) microbatch, as the workers
    compute it (Cell.backward): the parameters' gradients."""
    grad_out, targets = (None, y) if last else (y, None)
    return cell.backward(max(cell.history), x, precision, None, grad_out, targets).weights


def _plain_step(
    module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str, last: bool
) -> None:
    """The same layers as a plain torch training loop would run them."""
    if x.is_floating_point():
        x = x.detach().requires_grad_()
    with autocast(precision, x.device):
        out = module(x)
    if last:
        lm_loss(out, y).backward()
    else:
        out.float().backward(y)
    for p in module.parameters():
        p.grad = None


def _time_ms(
    fns: dict[str, Callable[[], None]], reps: int, device: torch.device
) -> dict[str, float]:
    """Each function's fastest run in ms, the functions taking turns (so a busy moment of a
    shared machine hits them alike; the minimum is the least disturbed run)."""
    for fn in fns.values():
        fn()  # warm-up: first-call allocations and kernel choices
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: min(ts) for name, ts in times.items()}


def peak_memory_bytes(cfg: Config, stage: int, device: torch.device) -> int:
    """A cell's peak: built, its stash full, one microbatch's forward+backward, one update."""
    _, _, last = stage_layers(cfg.model, cfg.grid.stages, stage)

    def run() -> None:
        cell = Cell.build(
            cfg, stage, 0, build_stage(cfg.model, cfg.grid.stages, stage, 0).to(device)
        )
        for _ in range(cell.versions_to_keep() - 1):
            cell.step += 1
            cell.push_version()
        x, y = _inputs(cfg, stage, device)
        cell.apply_update(_cell_step(cell, x, y, last, cfg.runtime.precision))

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        return torch.cuda.max_memory_allocated(device) - base
    tracker = LiveBytes()
    with tracker:
        run()
    return tracker.peak


def bench_stage(cfg: Config, stage: int, reps: int, device: torch.device) -> dict[str, Any]:
    _, _, last = stage_layers(cfg.model, cfg.grid.stages, stage)
    precision = cfg.runtime.precision
    cell = Cell.build(cfg, stage, 0, build_stage(cfg.model, cfg.grid.stages, stage, 0).to(device))
    plain = build_stage(cfg.model, cfg.grid.stages, stage, 0).to(device)
    x, y = _inputs(cfg, stage, device)

    def forward() -> None:  # an async cell's own forward (no grad): it sends activations early
        cell.forward(max(cell.history), x, precision, None)

    fns = {
        "cell": lambda: _cell_step(cell, x, y, last, cfg.runtime.precision),
        "plain": lambda: _plain_step(plain, x, y, precision, last),
    }
    if not last:  # the last stage's forward is its backward's recompute
        fns["forward"] = forward
    ms = _time_ms(fns, reps, device)
    cell_ms, plain_ms, forward_ms = ms["cell"], ms["plain"], ms.get("forward", 0.0)
    tokens = cfg.tokens_per_microbatch
    flops = stage_flops_per_token(cfg, stage) * tokens
    planned = plan_cell(cfg, stage)
    predicted = (
        planned.total_bytes
        - planned.averaging_bytes
        - planned.inflight_bytes
        - planned.transport_bytes
    )
    peak = peak_memory_bytes(cfg, stage, device)
    row: dict[str, Any] = {
        "stage": stage,
        "precision": precision,
        "params": planned.params,
        "cell_ms": cell_ms,
        "plain_ms": plain_ms,
        "overhead": cell_ms / plain_ms - 1,
        "forward_ms": forward_ms,
        "tokens_per_s": tokens / ((cell_ms + forward_ms) / 1e3),
        "flop_per_s": flops / (cell_ms / 1e3),
        "peak_bytes": peak,
        "plan_bytes": predicted,
        "peak_vs_plan": peak / predicted - 1,
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak_flops = next((v for k, v in BF16_PEAK.items() if k in name), None)
        row["mfu"] = row["flop_per_s"] / peak_flops if peak_flops else None
    return row


def run_model_bench(
    out: Path,
    quick: bool = False,
    device: str = "auto",
    on_row: Callable[[dict[str, Any]], None] | None = None,
    presets: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Every stage of each preset in fp32 and bf16; writes summary.json and table.md after each
    stage, so a run stopped at its time limit keeps the stages it finished."""
    dev = torch.device(
        "cuda"
        if device == "auto" and torch.cuda.is_available()
        else ("cpu" if device == "auto" else device)
    )
    # the CPU keeps microbatches small (one sequence); quick: llama-20m only, shorter sequences
    presets = presets or (PRESETS[:1] if quick else PRESETS)
    shape = {
        "cpu": ["pipeline.microbatch_size=1"] + (["model.seq_len=128"] if quick else []),
        "cuda": ["pipeline.microbatch_size=8"],
    }[dev.type]
    reps = 5 if quick else 11
    rows: list[dict[str, Any]] = []
    summary = {
        "device": _device_name(dev),
        "threads": torch.get_num_threads(),
        "quick": quick,
        "torch": torch.__version__,
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    for preset in presets:
        for precision in ("fp32", "bf16"):
            cfg = load_config(
                [f"configs/models/{preset}.toml"], [*shape, f"runtime.precision='{precision}'"]
            )
            for j in range(cfg.grid.stages):
                row = {
                    "preset": preset,
                    "microbatch": f"{cfg.pipeline.microbatch_size}x{cfg.model.seq_len}",
                    **bench_stage(cfg, j, reps, dev),
                }
                rows.append(row)
                (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
                (out / "table.md").write_text(model_table(summary) + "\n")
                if on_row:
                    on_row(row)
    return summary


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def model_table(summary: dict[str, Any]) -> str:
    cuda = any("mfu" in r for r in summary["rows"])
    headers = [
        "model",
        "stage",
        "precision",
        "microbatch",
        "cell ms",
        "plain torch ms",
        "overhead",
        "send forward ms",
        "tokens/s",
        "GFLOP/s",
        "peak MB",
        "plan MB",
        "peak vs plan",
    ]
    if cuda:
        headers.append("MFU")
    rows = []
    for r in summary["rows"]:
        row = [
            r["preset"],
            r["stage"],
            r["precision"],
            r["microbatch"],
            f"{r['cell_ms']:.1f}",
            f"{r['plain_ms']:.1f}",
            f"{r['overhead']:+.1%}",
            f"{r['forward_ms']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['flop_per_s'] / 1e9:,.1f}",
            f"{r['peak_bytes'] / 1e6:,.0f}",
            f"{r['plan_bytes'] / 1e6:,.0f}",
            f"{r['peak_vs_plan']:+.1%}",
        ]
        if cuda:
            row.append("-" if r.get("mfu") is None else f"{r['mfu']:.1%}")
        rows.append(row)
    head = (
        f"Device: {summary['device']}, {summary['threads']} threads, torch {summary['torch']}"
        f"{' (quick)' if summary['quick'] else ''}.\n\n"
    )
    return head + format_table(headers, rows)
