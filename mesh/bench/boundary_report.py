"""The boundary study's outputs (mesh/bench/boundary.py): its table, summary.json and the
trade-off plot of loss against bytes, with the published points and MAPL's equal-token band."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mesh.bench.regime import rule_line
from mesh.bench.report import fmt_gap
from mesh.engine.uplink import INT4_CODEC
from mesh.report import format_table, pyplot

REFERENCE = "full bf16"  # the arm every gap is measured against

# published points, drawn at the bytes per token they would mean for our boundary (bf16 / ratio)
PUBLISHED = [
    ("SSN (claimed)", 100, 0.0),  # arXiv 2506.01260: up to 100x, "no convergence degradation"
    ("SSN (MAPL, token-matched)", 100, 0.14),  # arXiv 2606.05484: up to ~14% worse
    ("MAPL", 4, 0.01),  # 4-16x at ~1% loss, 150M-1B LLaMA
    ("MAPL", 16, 0.01),
]
# MAPL's equal-token results (its workshop version), drawn as a band: (ratio, low %, high %)
# of loss cost, 4-8x within about 2% and 16x at about 3%
MAPL_BAND = [(4, 0.0, 2.0), (8, 0.0, 2.0), (16, 1.0, 3.0)]


def table(summary: dict[str, Any]) -> str:
    rows = []
    for r in summary["rows"]:
        gap = None if r["loss_gap"] is None else (r["loss_gap"], r["loss_gap_se"] or math.nan)
        na = "not run" if not r["seeds"] else "n/a"
        rows.append(
            [
                r["P"],
                r["arm"],
                r["rank"],
                r["codec"],
                f"{r['compression']:.1f}x",
                f"{r['bytes_per_token']:.2f}",
                na if r["val_loss"] is None else f"{r['val_loss']:.4f}",
                na if r["val_bpb"] is None else f"{r['val_bpb']:.4f}",
                na if gap is None else fmt_gap((100 * gap[0], 100 * gap[1])) + " %",
                len(r["seeds"]),
            ]
        )
    headers = [
        "P",
        "arm",
        "width",
        "codec",
        "vs bf16",
        "B/token/boundary",
        "val loss",
        "val bits/byte",
        "gap vs full bf16 async",
        "seeds",
    ]
    m = summary["model"]
    params = f"{summary['params'] / 1e6:.2f}M parameters, " if summary.get("params") else ""
    lines = [
        f"# Stage boundaries: loss against bytes at equal tokens ({summary['tokens_per_run']:,} "
        f"tokens a run)",
        "",
        f"{m['arch']} d {m['d_model']} x {m['n_layers']} layers ({params}vocab {m['vocab_size']}, "
        f"seq {m['seq_len']}), {summary['tokens_per_run']:,} tokens a run, on {summary['data']}; "
        f"grid P x 1; seeds {summary['seeds']} (lrs tuned on seed {summary['tune_seed']}: "
        f"{summary['lrs']}); learned anchors of rank {summary['anchor_rank']}. Gap: mean over "
        "seeds of loss / reference loss - 1, +- its standard error."
        + (
            " Optimizer: what each depth ships (--optimizer shipped): the async arms with "
            "optim.depth_rule = auto (Muon, its matrices at the rule's lr; the lr sweep moves "
            "the rest), FullSync with Muon (its matrices at 10x the lr)."
            if summary.get("optimizer") == "shipped"
            else ""
        ),
        "",
        rule_line(summary),
        "",
    ]
    if summary.get("complete") is False:
        lines += [
            "**Part of the study**: the rows marked 'not run', or with fewer seeds than "
            "the study's, are still to run (the study resumes where it stopped).",
            "",
        ]
    lines += [
        format_table(headers, rows),
        "",
    ]
    for p, r in summary["best_within_1pct"].items():
        lines.append(
            f"- P = {p}: "
            + (
                "no compressed arm within 1%"
                if r is None
                else f"most compressed within 1%: {r['arm']} ({r['compression']:.1f}x, "
                f"{100 * r['loss_gap']:+.2f}%)"
            )
        )
    return "\n".join(lines) + "\n"


def write_outputs(summary: dict[str, Any], out: Path) -> None:
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text(table(summary))
    plot(summary, out / "tradeoff.png")


def plot(summary: dict[str, Any], path: Path) -> None:
    """Loss gap (%) against bytes per token per boundary, one line per method and P; the
    published points at the bytes their ratio means here."""
    plt = pyplot()
    if plt is None:
        return

    rows = summary["rows"]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    full_bf16 = next((r["bytes_per_token"] for r in rows if r["arm"] == REFERENCE), None)
    markers = {4: "o", 8: "s", 2: "^"}
    lines = {
        ("learned", "fp8_e4m3"): "-",
        ("subspace", "fp8_e4m3"): "--",
        ("learned", INT4_CODEC): "-.",
    }
    for p in sorted({r["P"] for r in rows}):
        for (method, codec), ls in lines.items():
            pts = sorted(
                (r["bytes_per_token"], 100 * r["loss_gap"])
                for r in rows
                if r["P"] == p
                and r["method"] == method
                and r["codec"] == codec
                and r["loss_gap"] is not None
            )
            if pts:
                ax.plot(
                    *zip(*pts, strict=True),
                    marker=markers.get(p, "o"),
                    ls=ls,
                    label=f"{method} {codec.split('_')[0]}, P={p}",
                )
        for r in rows:
            if r["P"] == p and r["arm"] in ("full fp8", "FullSync") and r["loss_gap"] is not None:
                ax.scatter(
                    [r["bytes_per_token"]],
                    [100 * r["loss_gap"]],
                    marker="x",
                    label=f"{r['arm']}, P={p}",
                )
    if full_bf16:
        band = summary.get("mapl_equal_token_band") or [
            {"compression": c, "loss_cost_pct": [lo, hi]} for c, lo, hi in MAPL_BAND
        ]
        xs = [full_bf16 / b["compression"] for b in band]
        ax.fill_between(
            xs,
            [b["loss_cost_pct"][0] for b in band],
            [b["loss_cost_pct"][1] for b in band],
            color="grey",
            alpha=0.2,
            label="MAPL, equal tokens (4-8x within ~2%, 16x ~3%)",
        )
        for name, ratio, gap in PUBLISHED:
            ax.scatter([full_bf16 / ratio], [100 * gap], marker="*", s=90, color="grey")
            ax.annotate(
                name,
                (full_bf16 / ratio, 100 * gap),
                fontsize=7,
                xytext=(4, 3),
                textcoords="offset points",
            )
    ax.axhline(1.0, color="red", lw=0.8, ls=":", label="1% gap")
    ax.axhline(0.0, color="black", lw=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per token per boundary, each way (full bf16 = reference)")
    ax.set_ylabel("validation loss gap vs full bf16 async (%)")
    m, ratio = summary["model"], summary.get("reference_to_bigram_ratio")
    where = "" if ratio is None else f", reference at {ratio:.2f} x bigram CE"
    ax.set_title(
        f"Stage boundaries at equal tokens: {m['arch']} d {m['d_model']}, "
        f"{summary['tokens_per_run'] / 1e6:.2f}M tokens a run{where}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
