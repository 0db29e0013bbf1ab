"""The loss costs the studies measured, as `plan --uplink-mbit` ranks settings by them.

They ship with the package (measured_costs.json beside this file), so `plan` gives the same
advice from any directory; `bench boundary` and `bench convergence --interval` rewrite the file
when they finish their default study at full budget. `plan --results DIR` reads a results folder
instead (DIR/boundary/summary.json, DIR/convergence/interval/summary.json). Each entry says what
it was measured on (model, tokens, seeds) and where its reference sits against the data's bigram
(mesh/bench/regime.py), so plan can say which numbers it used.

imports: stdlib only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).with_name("measured_costs.json")


def boundary_entry(summary: dict[str, Any], source: str) -> dict[str, Any]:
    """What plan needs of a boundary study's summary.json: each arm's gap per P, and its scale."""
    gaps: dict[str, dict[str, float]] = {}
    for r in summary.get("rows", []):
        if r.get("loss_gap") is not None:
            gaps.setdefault(str(r["P"]), {})[r["arm"]] = r["loss_gap"]
    m = summary.get("model", {})
    return {
        "source": source,
        "model": f"{m.get('arch', '?')} d {m.get('d_model', '?')} x {m.get('n_layers', '?')}",
        "tokens_per_run": summary.get("tokens_per_run"),
        "seeds": summary.get("seeds"),
        "complete": summary.get("complete", True),
        "reference_to_bigram_ratio": summary.get("reference_to_bigram_ratio"),
        "regime": summary.get("regime", "n/a"),
        # the optimizer the async arms trained with ("shipped": what each depth gets without
        # flags; a study without the field is NAdamW's, as every study was before it)
        "optimizer": summary.get("optimizer", "nadamw"),
        "gaps_by_P": gaps,
    }


def interval_entry(summary: dict[str, Any], source: str) -> dict[str, Any]:
    """What plan needs of the averaging-interval study: each H's gap, and its scale."""
    return {
        "source": source,
        "model": f"{summary.get('grid', '?')} grid, {summary.get('method', '?')}",
        "tokens_per_run": summary.get("tokens_per_run"),
        "seeds": summary.get("seeds"),
        "reference_to_bigram_ratio": summary.get("reference_to_bigram_ratio"),
        "regime": summary.get("regime", "n/a"),
        "gaps_by_H": {
            str(r["interval_steps"]): r["loss_gap"]
            for r in summary.get("rows", [])
            if r.get("loss_gap") is not None
        },
    }


def read_shipped(path: Path = SHIPPED) -> dict[str, Any]:
    """The shipped costs ({} when the file is missing or unreadable)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def read_results(results: Path) -> tuple[dict[str, Any], list[Path]]:
    """The same entries from a results folder, and the files they were read from."""
    out: dict[str, Any] = {}
    read: list[Path] = []
    for kind, rel, make in (
        ("boundary", Path("boundary", "summary.json"), boundary_entry),
        ("interval", Path("convergence", "interval", "summary.json"), interval_entry),
    ):
        path = results / rel
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[kind] = make(summary, str(path))
        read.append(path)
    return out, read


def record(kind: str, entry: dict[str, Any], path: Path = SHIPPED) -> None:
    """Replace one kind ("boundary", "interval") of the shipped costs (temp file, rename)."""
    found = read_shipped(path)
    found[kind] = entry
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def costs_for(measured: dict[str, Any], stages: int) -> tuple[dict[str, float], dict[int, float]]:
    """(gap by boundary arm at the study's P nearest `stages`, gap by averaging interval)."""
    boundary: dict[str, float] = {}
    by_p = measured.get("boundary", {}).get("gaps_by_P", {})
    if by_p:
        p = min((int(k) for k in by_p), key=lambda p: (abs(p - stages), p))
        boundary = dict(by_p[str(p)])
    interval = {int(h): g for h, g in measured.get("interval", {}).get("gaps_by_H", {}).items()}
    return boundary, interval


def describe(measured: dict[str, Any], stages: int, optimizer: str = "nadamw") -> str:
    """What each kind of cost was measured on, for plan's line about what it used; where the
    boundary costs were measured with NAdamW and the run trains with another optimizer (Muon,
    which optim.depth_rule gives a deep async pipeline), it says so: under Muon the learned
    boundaries cost several times more (docs/boundaries.md)."""
    parts = []
    b = measured.get("boundary")
    if b and b.get("gaps_by_P"):
        p = min((int(k) for k in b["gaps_by_P"]), key=lambda p: (abs(p - stages), p))
        tokens = b.get("tokens_per_run")
        scale = f", {tokens / 1e6:.2f}M tokens a run" if tokens else ""
        ratio = b.get("reference_to_bigram_ratio")
        where = "" if ratio is None else f", reference at {ratio:.2f} x bigram: {b['regime']}"
        part = "" if b.get("complete", True) else ", part of the study"
        measured_with = b.get("optimizer", "nadamw")
        other = (
            f"; measured with NAdamW, and this run trains with {optimizer}: its costs are likely "
            "higher (docs/boundaries.md)"
            if measured_with == "nadamw" and optimizer != "nadamw"
            else ""
        )
        parts.append(f"boundary: {b['model']} at P = {p}{scale}{where}{part}{other}")
    i = measured.get("interval")
    if i and i.get("gaps_by_H"):
        ratio = i.get("reference_to_bigram_ratio")
        where = "" if ratio is None else f", reference at {ratio:.2f} x bigram: {i['regime']}"
        parts.append(f"interval: {i['model']}{where}")
    return "; ".join(parts)
