"""table.md and depth.png of the optimizer study."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mesh.bench.optimizers.analysis import (
    Groups,
    _async_labels,
    _by_seed,
    _group,
    _loss,
    _memory_rows,
    _s2t,
    _timing,
    targets,
)
from mesh.bench.optimizers.protocol import TWO_BW_M, TWO_BW_OPTIMIZERS, TWO_BW_P
from mesh.bench.report import fmt_gap, paired_gap
from mesh.report import format_table, plot_curves


def _fmt_s2t(rs: list[dict[str, Any]] | None) -> str:
    if not rs:
        return "-"
    mean, censored = _s2t(rs)
    if not censored:
        return f"{mean:.0f}"
    reached = sum(r["steps_to_target"] is not None for r in rs)
    return f">={mean:.0f} ({reached}/{len(rs)})"


def _runs_of(values: list[Any]) -> str:
    """Run-length text of a per-stage list: [1, 1, 1, 2, 10] -> "1 x3, 2, 10"."""
    parts: list[str] = []
    k = 0
    while k < len(values):
        n = 1
        while k + n < len(values) and values[k + n] == values[k]:
            n += 1
        text = "-" if values[k] is None else str(values[k])
        parts.append(f"{text} x{n}" if n > 1 else text)
        k += n
    return ", ".join(parts)


def write_outputs(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    runs = summary["runs"]
    a, b = _group(runs, "async"), _group(runs, "2bw")
    stages = sorted({p for _, p in a})
    labels = _async_labels(a)
    lines = [
        *_intro(summary),
        *_async_steps_section(a, stages, labels),
        *_async_loss_section(a, stages, labels),
        *_two_bw_section(b),
        *_cost_section(summary, a, stages),
        *_targets_section(summary),
    ]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    _plot(summary, out / "depth.png")


def _intro(summary: dict[str, Any]) -> list[str]:
    """table.md's title and the study's setting: model, tokens, seeds, learning rates, targets."""
    runs = summary["runs"]
    tg = summary["targets"]
    fmt_t = {k: ("n/a" if v is None else f"{v:.4f}") for k, v in tg.items()}
    horizon = {
        st: max((r["horizon_steps"] for r in runs if r["study"] == st), default=0) for st in tg
    }
    lr = summary["lr"]
    return [
        "# Optimizers for deep asynchronous pipelines",
        "",
        f"Model: {summary['model']['n_layers']} layers, d_model {summary['model']['d_model']}, "
        f"{summary['model']['n_heads']} heads, seq_len {summary['model']['seq_len']}; "
        f"{summary['microbatches_per_replica']} microbatches of "
        f"{summary['tokens_per_microbatch']} tokens per run (equal tokens), 1 replica; seeds "
        f"{summary['seeds']}; quick={summary['quick']}; {summary['wall_s']:.0f} s in all.",
        f"lr: adamw {lr['adamw']:g}, nadamw {lr['nadamw']:g}, muon {lr['muon_lr']:g} (AdamW part "
        f"{lr['muon']:g}), rotated_adam {lr['rotated_adam']:g} (rotate_every "
        f"{summary['rotate_every']}); grad clip 1.0, warmup 5%, cosine to 10%.",
        f"Targets ({summary['target_rule']}): async {fmt_t['async']} "
        f"(horizon {horizon['async']} updates), 2bw/gpipe {fmt_t['2bw']} "
        f"(horizon {horizon['2bw']} updates). Updates to target are interpolated between "
        f"evaluations (every horizon/{summary['evals_per_run']}); '>=N (k/n)': only k of n "
        "seeds reached it, the "
        "others count at the horizon.",
        "",
    ]


def _async_steps_section(a: Groups, stages: list[int], labels: list[str]) -> list[str]:
    """Updates each optimizer took to the target at each depth, and the deepest over the
    shallowest."""
    rows = []
    for lab in labels:
        row = [lab] + [_fmt_s2t(a.get((lab, p))) for p in stages]
        if len(stages) > 1 and a.get((lab, stages[0])) and a.get((lab, stages[-1])):
            s_hi, c_hi = _s2t(a[(lab, stages[-1])])
            s_lo, _ = _s2t(a[(lab, stages[0])])
            row.append(f"{s_hi / s_lo:.2f}x{'+' if c_hi else ''}")
        else:
            row.append("-")
        rows.append(row)
    head = ["optimizer"] + [f"P={p}" for p in stages] + [f"P={stages[-1]} / P={stages[0]}"]
    return [
        "## Async (PipeDream stashing): updates to reach the target",
        "",
        format_table(head, rows),
        "",
    ]


def _async_loss_section(a: Groups, stages: list[int], labels: list[str]) -> list[str]:
    """Each optimizer's final validation loss at each depth, and its paired gap to adamw."""
    rows = [[lab] + [f"{_loss(a.get((lab, p))):.4f}" for p in stages] for lab in labels]
    for lab in [x for x in labels if x != "adamw"]:
        rows.append(
            [f"{lab} - adamw (paired)"]
            + [
                fmt_gap(paired_gap(_by_seed(a.get((lab, p))), _by_seed(a.get(("adamw", p)))))
                for p in stages
            ]
        )
    return [
        "## Async: final validation loss at equal tokens",
        "",
        format_table(["optimizer"] + [f"P={p}" for p in stages], rows),
        "",
    ]


def _two_bw_section(b: Groups) -> list[str]:
    """2bw, with and without error feedback, against gpipe at the same microbatches."""
    rows = []
    for opt in TWO_BW_OPTIMIZERS:
        ref = b.get((f"gpipe {opt}", TWO_BW_P))
        v0, v1 = b.get((f"2bw {opt}", TWO_BW_P)), b.get((f"2bw {opt} +EF", TWO_BW_P))
        if not ref:
            continue
        rows.append(
            [
                opt,
                _fmt_s2t(ref),
                _fmt_s2t(v0),
                _fmt_s2t(v1),
                f"{_loss(ref):.4f}",
                fmt_gap(paired_gap(_by_seed(v0), _by_seed(ref))),
                fmt_gap(paired_gap(_by_seed(v1), _by_seed(ref))),
            ]
        )
    return [
        f"## 2bw (P={TWO_BW_P}, M={TWO_BW_M}, delay 1) vs gpipe at the same M",
        "",
        format_table(
            [
                "optimizer",
                "gpipe updates",
                "2bw updates",
                "2bw+EF updates",
                "gpipe val loss",
                "2bw gap (paired)",
                "2bw+EF gap (paired)",
            ],
            rows,
        ),
        "",
    ]


def _cost_section(summary: dict[str, Any], a: Groups, stages: list[int]) -> list[str]:
    """Optimizer state and time per update at each depth (async), against adamw's."""
    rows = []
    mem = {p: (ad, ex) for p, ad, ex in _memory_rows(a, stages)}
    times = _timing(summary)
    for p in stages:
        nan2 = (math.nan, math.nan)
        t_ad, o_ad = times.get(("adamw", p), nan2)
        t_ro, o_ro = times.get(("rotated_adam", p), nan2)
        t_sa, o_sa = times.get(("rotated_adam+SA", p), nan2)
        t_mu, _ = times.get(("muon", p), nan2)
        sa_runs = a.get(("rotated_adam+SA", p))
        periods = sa_runs[0]["refresh_period_per_stage"] if sa_runs else []
        ad, ex = mem.get(p, (0, 0))
        rows.append(
            [
                p,
                f"{ad / 1024:.1f}",
                f"+{ex / 1024:.1f} ({ex / ad:.2f}x)" if ad else "-",
                f"{t_ad:.1f}",
                f"{t_ro:.1f} ({t_ro / t_ad:.2f}x)",
                f"{t_sa:.1f} ({t_sa / t_ad:.2f}x)",
                f"{t_mu:.1f} ({t_mu / t_ad:.2f}x)",
                f"{o_ad:.1f} / {o_ro:.1f} / {o_sa:.1f}",
                _runs_of(periods),
            ]
        )
    return [
        "## Cost: optimizer state and time per update (async)",
        "",
        format_table(
            [
                "P",
                "adamw state KiB (largest stage)",
                "rotated_adam extra KiB (largest)",
                "adamw ms/update",
                "rotated_adam ms",
                "rotated_adam+SA ms",
                "muon ms",
                "optimizer ms: adamw / rot / rot+SA",
                "SA refresh period per stage",
            ],
            rows,
        ),
        "",
        "ms per simulated update (all stages, no evaluation), the optimizers timed side by side "
        "(interleaved update by update, one process) so that they share the machine's load; "
        "summary.json also has each run's own mean, taken under whatever load it met.",
        "",
    ]


def _targets_section(summary: dict[str, Any]) -> list[str]:
    """Each of the study's targets, what was measured and whether it was met."""
    return [
        "## Targets",
        "",
        format_table(
            ["target", "measured", "verdict", "note"],
            [
                [
                    n,
                    s,
                    "inconclusive"
                    if ok is None and not n.startswith("(info)")
                    else ("-" if ok is None else ("met" if ok else "MISSED")),
                    note,
                ]
                for n, s, ok, note in targets(summary)
            ],
        ),
    ]


def _plot(summary: dict[str, Any], path: Path) -> None:
    a = _group(summary["runs"], "async")
    stages = sorted({p for _, p in a})
    curves = {
        lab: [(float(p), _s2t(a[(lab, p)])[0]) for p in stages if (lab, p) in a]
        for lab in _async_labels(a)
    }
    t = summary["targets"]["async"]
    plot_curves(
        curves,
        path,
        "pipeline stages P (async, delay P-1-j)",
        "updates to reach the target",
        f"Updates to val loss {'n/a' if t is None else f'{t:.3f}'} (mean of seeds; "
        "never reached = horizon)",
        logx=True,
    )
