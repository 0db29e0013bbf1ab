"""Seed-paired statistics and a bench's targets as a table: what the studies' reports are made of
(their tables and plots: mesh/report.py)."""

from __future__ import annotations

import math
import statistics
from typing import Any, NamedTuple

from mesh.report import format_table


def checks_table(checks: dict[str, bool]) -> str:
    """A bench's targets as a table: yes, or MISSED."""
    return format_table(
        ["target", "met"], [[k, "yes" if ok else "MISSED"] for k, ok in checks.items()]
    )


def paired_gap(values: dict[int, float], reference: dict[int, float]) -> tuple[float, float] | None:
    """Mean and standard error of (value - reference) over the seeds both have."""
    seeds = sorted(set(values) & set(reference))
    diffs = [values[s] - reference[s] for s in seeds]
    if not diffs or not all(map(math.isfinite, diffs)):
        return None
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return statistics.mean(diffs), se


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with df degrees of freedom (via the incomplete beta)."""
    x = df / (df + t * t)
    a, b = df / 2.0, 0.5
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(lbeta + a * math.log(x) + b * math.log1p(-x)) if 0 < x < 1 else 0.0
    # I_x(a, b) from the fraction where it converges, else by the symmetry I_x = 1 - I_(1-x)
    if x < (a + 1) / (a + b + 2):
        tail = front * _betacf(a, b, x) / a
    else:
        tail = 1.0 - front * _betacf(b, a, 1.0 - x) / b
    return 1.0 - 0.5 * tail if t >= 0 else 0.5 * tail


def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p (Student's t, df >= 1), by bisection on t_cdf."""
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1 (got p={p}, df={df})")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


class PairedInterval(NamedTuple):
    """A paired comparison over seeds: the per-seed differences, their mean, its standard
    error and the two-sided t interval at `level` (low and high are nan with one seed)."""

    diffs: dict[int, float]
    mean: float
    se: float
    low: float
    high: float
    level: float


def paired_interval(
    values: dict[int, float],
    reference: dict[int, float],
    level: float = 0.95,
    relative: bool = False,
) -> PairedInterval | None:
    """The per-seed differences value - reference over the seeds both have (relative: value /
    reference - 1) with their mean, standard error and t interval; None without a finite one."""
    seeds = sorted(set(values) & set(reference))
    diffs = {
        s: values[s] / reference[s] - 1.0 if relative else values[s] - reference[s] for s in seeds
    }
    if not diffs or not all(map(math.isfinite, diffs.values())):
        return None
    mean = statistics.mean(diffs.values())
    n = len(diffs)
    if n < 2:
        return PairedInterval(diffs, mean, math.nan, math.nan, math.nan, level)
    se = statistics.stdev(diffs.values()) / math.sqrt(n)
    half = t_quantile(0.5 + level / 2, n - 1) * se
    return PairedInterval(diffs, mean, se, mean - half, mean + half, level)


def fmt_interval(iv: PairedInterval | None, pct: bool = False) -> str:
    """`+0.0123 +- 0.0045 [+0.0016, +0.0230]` (mean +- SE [t interval]); pct: in percent."""
    if iv is None:
        return "n/a"
    k, f = (100.0, "{:+.2f}%") if pct else (1.0, "{:+.4f}")
    se = f"{k * iv.se:.2f}%" if pct else f"{iv.se:.4f}"
    if not math.isfinite(iv.se):
        return f.format(k * iv.mean)
    return f"{f.format(k * iv.mean)} +- {se} [{f.format(k * iv.low)}, {f.format(k * iv.high)}]"


def fmt_gap(g: tuple[float, float] | None) -> str:
    """A paired gap as `+0.0123 +- 0.0045` (no SE with one seed; n/a without a gap)."""
    if g is None:
        return "n/a"
    return f"{g[0]:+.4f} +- {g[1]:.4f}" if math.isfinite(g[1]) else f"{g[0]:+.4f}"


def study_scale(base: Any) -> dict[str, Any]:
    """What a study's summary says of its model and data: the model's shape, its parameters,
    the data, the tokens a microbatch (every claim names its scale)."""
    from mesh.model.build import stage_param_counts

    return {
        "model": {
            k: getattr(base.model, k)
            for k in ("arch", "d_model", "n_layers", "vocab_size", "seq_len")
        },
        "params": sum(stage_param_counts(base.model, 1)),
        "data": base.data.path or "Shakespeare bytes (the default corpus)",
        "microbatch_tokens": base.tokens_per_microbatch,
    }
