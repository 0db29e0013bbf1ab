"""The rule every study is read by, and the reference points each report prints beside its loss.

A study's reference arm must end at least 15% below its data's bigram cross-entropy on the
validation split (mesh/data/ngram.py: RULE_RATIO = 0.85 of it). Below that, a model has learned
little beyond token frequencies, and a method's small cost there says little about a model that
has learned language: such a study says "early-training regime" in its table, and its claims are
early-training observations, never results. Every study's summary.json records
`reference_to_bigram_ratio` (its reference's worst ratio over the settings it ran: a depth, a
grid, a horizon), the data's unigram and bigram cross-entropy and the verdict (`regime`).

REFERENCES says which arm is the reference of each study and how to read its losses from the
study's own summary.json, so the same numbers come from a study as it writes its outputs and from
scripts/reference_ratios.py, which adds them to summaries written before the rule.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh.data.ngram import EARLY, RULE_RATIO, regime, to_bigram

__all__ = [
    "EARLY",
    "REFERENCES",
    "RULE_RATIO",
    "data_reference",
    "rule_fields",
    "rule_line",
    "stamp",
]


def data_reference(base: Any) -> dict[str, Any]:
    """The unigram and bigram cross-entropy of the data a study's base config trains on."""
    from mesh.data.corpus import load_corpus, ngram_ce

    corpus = load_corpus(
        base.data.path, base.data.val_fraction, base.model.seq_len, base.data.digest
    )
    return ngram_ce(corpus)


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.mean(xs) if xs else None


def _runs_by(summary: dict[str, Any], key: str, method: str) -> dict[str, float]:
    """Mean final loss of `method`'s runs, per value of the runs' `key` (a study, a setting)."""
    groups: dict[str, list[float]] = {}
    for r in summary.get("runs", []):
        if r.get("method") == method and not r.get("diverged"):
            groups.setdefault(str(r.get(key)), []).append(r.get("val_loss"))
    return {k: v for k, v in ((k, _mean(xs)) for k, xs in groups.items()) if v is not None}


def _boundary(s: dict[str, Any]) -> dict[str, float]:
    rows = [r for r in s.get("rows", []) if r.get("arm") == "full bf16"]
    return {f"P{r['P']}": r["val_loss"] for r in rows if r.get("val_loss") is not None}


def _convergence(s: dict[str, Any]) -> dict[str, float]:
    dp = [r for r in s.get("runs", []) if r.get("study") == "dp"]
    fs = _mean([r["val_loss"] for r in dp if r["method"] == "FullSync" and not r.get("diverged")])
    return {} if fs is None else {"dp FullSync": fs}


def _like_for_like(s: dict[str, Any]) -> dict[str, float]:
    loss = _mean(list(s.get("evaluation", {}).get("FullSync rotated_adam", {}).values()))
    return {} if loss is None else {"FullSync rotated_adam": loss}


def _optimizers(s: dict[str, Any]) -> dict[str, float]:
    runs = [
        r
        for r in s.get("runs", [])
        if r.get("study") == "async"
        and r.get("stages") == 1
        and r.get("label") == "adamw"
        and not r.get("diverged")
    ]
    loss = _mean([r["val_loss"] for r in runs])
    return {} if loss is None else {"P1 adamw": loss}


def _by_arm(key: str, arm: str, name: str) -> Callable[[dict[str, Any]], dict[str, float]]:
    def read(s: dict[str, Any]) -> dict[str, float]:
        runs = [r for r in s.get("runs", []) if r.get(key) == arm and not r.get("diverged")]
        loss = _mean([r.get("val_loss") for r in runs])
        return {} if loss is None else {name: loss}

    return read


def _depth(s: dict[str, Any]) -> dict[str, float]:
    """FullSync's loss at each depth of the finals; before them, its best on the screen."""
    rows = [r for r in s.get("rows", []) if r.get("arm") == "FullSync"]
    out = {f"P{r['P']}": r["val_loss"] for r in rows if r.get("val_loss") is not None}
    if out:
        return out
    screen = [r for r in s.get("screen", []) if r.get("arm") == "FullSync"]
    return {f"P{r['P']} (screen)": r["best_loss"] for r in screen if r.get("best_loss")}


def _interval(s: dict[str, Any]) -> dict[str, float]:
    losses = [r.get("val_loss") for r in s.get("rows", []) if r.get("interval_steps") == 1]
    return {"H1": losses[0]} if losses and losses[0] is not None else {}


def _data(s: dict[str, Any]) -> dict[str, float]:
    return {k: r["val_loss_nats_per_token"] for k, r in s.get("runs", {}).items()}


# study -> (its reference arm in words, the reference's final loss per setting from its summary)
REFERENCES: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, float]]]] = {
    "boundary": ("full bf16 async pipeline", _boundary),
    "depth": ("FullSync at each depth", _depth),
    "convergence": ("FullSync (the DP study, evaluation seeds)", _convergence),
    "like_for_like": ("FullSync rotated_adam (evaluation seeds)", _like_for_like),
    "ablations": ("full AsyncMesh", lambda s: _runs_by(s, "study", "full AsyncMesh")),
    "horizon": ("FullSync at each length", lambda s: _runs_by(s, "study", "FullSync")),
    "precision": ("AsyncMesh fp32", lambda s: _runs_by(s, "study", "AsyncMesh fp32")),
    "scaling": ("DPAvg on each grid", lambda s: _runs_by(s, "study", "DPAvg")),
    "optimizers": ("delay-free adamw (P = 1)", _optimizers),
    "fp8-feedback": ("fp32 payloads", _by_arm("arm", "fp32", "fp32")),
    "runtime": ("the logical engine", _by_arm("engine", "logical", "logical")),
    "interval": ("AsyncMesh-fp8 at H = 1", _interval),
    "data": ("each tokenizer's run", _data),
    "demo": ("the run", lambda s: {} if s.get("val_loss") is None else {"run": s["val_loss"]}),
}


def rule_fields(
    study: str,
    summary: dict[str, Any],
    entry: dict[str, Any] | None,
    per_setting: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """What a study's summary.json records of the rule: the data's reference points, the
    reference's loss and ratio to the bigram per setting, the worst ratio, the verdict.
    per_setting: the data of a setting that trains on other data than `entry`'s (the data
    study's tokenizers)."""
    arm, read = REFERENCES[study]
    losses = read(summary)
    per_setting = per_setting or {}
    ratios = {k: to_bigram(v, per_setting.get(k, entry)) for k, v in losses.items()}
    known = [r for r in ratios.values() if r is not None]
    worst = max(known) if known else None
    return {
        "data_ngram_ce": None
        if entry is None
        else {
            "unigram_nats_per_token": entry["unigram"]["nats_per_token"],
            "bigram_nats_per_token": entry["bigram"]["nats_per_token"],
            "unigram_bits_per_byte": entry["unigram"]["bits_per_byte"],
            "bigram_bits_per_byte": entry["bigram"]["bits_per_byte"],
            "smoothing": entry.get("smoothing"),
        },
        "reference_arm": arm,
        "reference_val_loss": {k: round(v, 4) for k, v in losses.items()},
        "reference_to_bigram_by_setting": ratios,
        "reference_to_bigram_ratio": worst,
        "regime": regime(worst),
    }


def stamp(out: Path, study: str, entry: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
    """Record the rule in a written study (out/summary.json and out/table.md, the line above
    the first table; a line of an earlier stamp is replaced): what a study calls after writing
    its outputs, and what scripts/reference_ratios.py does to studies written before the rule."""
    path = out / "summary.json"
    text = path.read_text()
    summary = json.loads(text)
    fields = rule_fields(study, summary, entry, **kw)
    summary.update(fields)
    second = text.split("\n", 2)[1] if text.count("\n") > 1 else ""
    indent = len(second) - len(second.lstrip(" ")) or 1  # the file's own, so a diff shows fields
    path.write_text(json.dumps(summary, indent=indent) + "\n")
    table = out / "table.md"
    if table.is_file():
        lines = []
        for ln in table.read_text().splitlines():  # an earlier stamp's line, with its blank
            if ln.startswith("Regime: ") or (ln == "" and lines[-1:] == ["\0"]):
                lines.append("\0")
                continue
            lines.append(ln)
        lines = [ln for ln in lines if ln != "\0"]
        at = next((k for k, ln in enumerate(lines) if ln.startswith("|")), len(lines))
        lines[at:at] = [rule_line(fields), ""]
        text = "\n".join(lines) + "\n"
        table.write_text(text.replace("\n\n\n", "\n\n"))
    return fields


def rule_line(fields: dict[str, Any]) -> str:
    """The table's line on the rule: where the reference ends against the data's bigram."""
    ce, ratio = fields.get("data_ngram_ce"), fields.get("reference_to_bigram_ratio")
    if ce is None or ratio is None:
        return "Regime: n/a (no reference loss or no reference points for the data)."
    per = ", ".join(
        f"{k} {fields['reference_val_loss'][k]:.3f} ({r:.2f})"
        for k, r in fields["reference_to_bigram_by_setting"].items()
        if r is not None
    )
    head = (
        f"Regime: the reference ({fields['reference_arm']}) ends at {per} nats/token (its ratio to "
        f"the data's bigram cross-entropy); the data's validation cross-entropy, counts from its "
        f"train split: unigram {ce['unigram_nats_per_token']:.3f}, bigram "
        f"{ce['bigram_nats_per_token']:.3f} nats/token."
    )
    if ratio <= RULE_RATIO:
        return f"{head} Passes the rule (reference <= {RULE_RATIO} x bigram)."
    return (
        f"{head} **{EARLY}**: the reference ends above {RULE_RATIO} x the bigram (worst "
        f"{ratio:.2f}), so the models have learned little beyond token frequencies; what this "
        "study measures are early-training observations, not results."
    )
