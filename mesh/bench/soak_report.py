"""The soak's summary.json, table.md and soak.png, from its samples.jsonl (mesh/bench/soak.py).

Growth of a peer = (median of its last 3 samples) - (median of its first 3 samples at least
warmup_s into the run and into the peer's own life): robust to one noisy sample, and a peer
that joined late is measured from its own warm-up (a fresh join downloads state first). Slope:
least squares over the same samples, per hour. A peer with fewer than 4 such samples has none.
Targets (issue #16): RSS growth < 100 MB per peer; threads and descriptors flat (growth of the
whole tree at most FLAT_ABS, or FLAT_FRAC of its level, whichever is larger); no orphaned p2pd or
socket file after the run (nor after each kill); loss falling: each window's mean train loss
(last stage) below the previous window's.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from mesh.bench.report import checks_table
from mesh.report import format_table, pyplot

RSS_LIMIT_MB = 100.0
FLAT_ABS, FLAT_FRAC = 4, 0.10
WINDOWS = 6  # loss windows per run (10 minutes each in an hour)
METRICS = {  # sample key -> plot title
    "rss_mb": "RSS of the peer's tree (MB)",
    "pss_mb": "PSS of the peer's tree (MB; shared pages split)",
    "rss_mb_p2pd": "RSS of p2pd (MB)",
    "fds": "open descriptors (tree)",
    "threads": "threads (tree)",
    "asyncio_tasks": "live asyncio tasks (cell)",
    "mailbox_pending": "mailbox depth (cell)",
    "sockets": "hivemind socket files held",
}


def read_samples(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by a crash
            continue
    return out


def growth(values: list[float]) -> float | None:
    """Median of the last 3 minus median of the first 3 (None with fewer than 4 values)."""
    if len(values) < 4:
        return None
    return round(statistics.median(values[-3:]) - statistics.median(values[:3]), 2)


def slope_per_hour(ts: list[float], values: list[float]) -> float | None:
    """Least-squares slope of values over times ts (seconds), per hour."""
    if len(ts) < 4:
        return None
    mt, mv = statistics.fmean(ts), statistics.fmean(values)
    den = sum((t - mt) ** 2 for t in ts)
    if den == 0:
        return None
    return round(3600 * sum((t - mt) * (v - mv) for t, v in zip(ts, values)) / den, 2)


def flat(g: float | None, level: float) -> bool | None:
    return None if g is None else g <= max(FLAT_ABS, FLAT_FRAC * level)


def per_peer(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, Any]]:
    """Each peer's cell, life and the growth and slope of every metric after its warm-up."""
    peers: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        if s.get("kind") == "sample":
            peers.setdefault(s["peer"], []).append(s)
    out = {}
    for name, rows in peers.items():
        kept = [r for r in rows if r["t_s"] >= warmup_s and r["age_s"] >= warmup_s]
        peer: dict[str, Any] = {
            "cell": rows[-1].get("cell"),
            "first_s": rows[0]["t_s"],
            "last_s": rows[-1]["t_s"],
            "samples": len(rows),
            "measured_samples": len(kept),
            "rounds": {k: rows[-1].get(f"rounds_{k}", 0) for k in ("applied", "partial", "failed")},
        }
        for key in (*METRICS, "rss_mb_cell", "rss_mb_dht", "threads_cell", "fds_cell"):
            pts = [(r["t_s"], r[key]) for r in kept if r.get(key) is not None]
            vals = [v for _, v in pts]
            peer[key] = {
                "first": vals[0] if vals else None,
                "last": vals[-1] if vals else None,
                "max": max((r.get(key) or 0) for r in rows),
                "growth": growth(vals),
                "slope_per_h": slope_per_hour([t for t, _ in pts], vals),
            }
        out[name] = peer
    return out


def loss_windows(samples: list[dict[str, Any]], duration_s: float) -> list[dict[str, Any]]:
    """Mean train loss of the last-stage cells (s1r*) per window of duration_s / WINDOWS."""
    width = duration_s / WINDOWS
    acc = [[0.0, 0] for _ in range(WINDOWS)]
    for s in samples:
        if (
            s.get("kind") != "sample"
            or not s.get("loss_n")
            or not str(s.get("cell")).startswith("s1")
        ):
            continue
        k = min(WINDOWS - 1, int(s["t_s"] // width))
        acc[k][0] += s["loss_mean"] * s["loss_n"]
        acc[k][1] += s["loss_n"]
    return [
        {
            "from_min": round(k * width / 60, 1),
            "to_min": round((k + 1) * width / 60, 1),
            "train_loss": round(total / n, 4) if n else None,
            "updates": n,
        }
        for k, (total, n) in enumerate(acc)
    ]


def summarize(samples: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    p = meta["plan"]
    peers = per_peer(samples, p["warmup_s"])
    rss = {n: v["rss_mb"]["growth"] for n, v in peers.items() if v["rss_mb"]["growth"] is not None}
    thr = {n: v["threads"]["growth"] for n, v in peers.items()}
    fds = {n: v["fds"]["growth"] for n, v in peers.items()}
    kills = [s for s in samples if s.get("kind") == "kill"]
    replaced = [s for s in samples if s.get("kind") == "replaced"]
    windows = loss_windows(samples, p["duration_s"])
    losses = [w["train_loss"] for w in windows if w["train_loss"] is not None]
    left = meta.get("leftovers") or {}
    rounds = {
        k: sum(v["rounds"][k] for v in peers.values()) for k in ("applied", "partial", "failed")
    }
    done = sum(rounds.values())
    checks = {
        "rss_growth_under_100mb": bool(rss) and max(rss.values()) < RSS_LIMIT_MB,
        "threads_flat": all(
            flat(thr[n], v["threads"]["first"] or 0) is not False for n, v in peers.items()
        ),
        "fds_flat": all(
            flat(fds[n], v["fds"]["first"] or 0) is not False for n, v in peers.items()
        ),
        "no_orphan_after_kills": all(
            not k["helpers_outlived"] and not k["sockets_left"] for k in kills
        ),
        "no_orphan_after_run": bool(left)
        and not left.get("orphan_processes")
        and not left.get("socket_files_left"),
        "loss_falling": len(losses) >= 2 and all(b < a for a, b in zip(losses, losses[1:])),
    }
    return {
        **meta,
        "grid": "2x2 gpt (2 layers, d_model 48, seq 32, Shakespeare bytes), real compute x4 "
        "slowdown, wan100 links",
        "rss_growth_mb": rss,
        "rss_growth_mb_max": max(rss.values()) if rss else None,
        "threads_growth": thr,
        "fds_growth": fds,
        "kills": kills,
        "replacements": replaced,
        "loss_by_window": windows,
        "rounds": rounds,  # averaging rounds of every peer (a replaced peer's until its kill)
        "rounds_complete_share": round(rounds["applied"] / done, 4) if done else None,
        "peers": peers,
        "checks": checks,
        "all_targets_met": all(checks.values()) and bool(meta.get("completed")),
    }


def to_markdown(summary: dict[str, Any]) -> str:
    rows = []
    for name, v in summary["peers"].items():
        rows.append(
            [
                name,
                v["cell"],
                f"{v['first_s'] / 60:.1f}-{v['last_s'] / 60:.1f}",
                _g(v["rss_mb"]),
                _g(v["rss_mb_p2pd"]),
                _g(v["threads"]),
                _g(v["fds"]),
                _g(v["asyncio_tasks"]),
                v["mailbox_pending"]["max"],
                v["sockets"]["max"],
            ]
        )
    peers = format_table(
        [
            "peer",
            "cell",
            "alive min",
            "RSS MB",
            "p2pd RSS MB",
            "threads",
            "fds",
            "asyncio tasks",
            "mailbox max",
            "sockets max",
        ],
        rows,
    )
    loss = format_table(
        ["minutes", "train loss (last stage)", "updates"],
        [
            [f"{w['from_min']}-{w['to_min']}", w["train_loss"], w["updates"]]
            for w in summary["loss_by_window"]
        ],
    )
    kills = format_table(
        ["killed", "cell", "at min", "helpers gone s", "left behind", "replacement trains s"],
        [
            [
                k["peer"],
                k["cell"],
                f"{k['t_s'] / 60:.1f}",
                k["helpers_exit_s"],
                len(k["helpers_outlived"]) + len(k["sockets_left"]),
                r.get("join_to_training_s", "n/a"),
            ]
            for k, r in zip(summary["kills"], summary["replacements"] + [{}] * 9)
        ],
    )
    checks = checks_table(summary["checks"])
    left = summary.get("leftovers") or {}
    return (
        f"Growth = median of the last 3 samples - median of the first 3 after the warm-up "
        f"({summary['plan']['warmup_s'] / 60:.1f} min into the run and the peer's life); "
        f"cells: first (last).\n\n{peers}\n\n{loss}\n\n{kills}\n\n{checks}\n\n"
        f"After the run: {len(left.get('orphan_processes', []))} orphaned processes "
        f"({left.get('orphan_p2pd', 0)} p2pd), {len(left.get('socket_files_left', []))} socket "
        f"files left. Averaging rounds: {summary['rounds']} "
        f"(complete share {summary['rounds_complete_share']}). "
        f"{summary['grid']}; `{summary['command']}`"
        + ("" if summary["completed"] else f"; NOT COMPLETED: {summary['error']}")
        + "\n"
    )


def _g(m: dict[str, Any]) -> str:
    """`growth (first -> last)` of one metric of a peer."""
    if m["growth"] is None:
        return "n/a"
    return f"{m['growth']:+g} ({m['first']:g} -> {m['last']:g})"


def plot(samples: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    """One panel per metric, a line per peer, kills marked; the loss by window last."""
    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(3, 3, figsize=(16, 11), dpi=100)
    peers: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        if s.get("kind") == "sample":
            peers.setdefault(s["peer"], []).append(s)
    for ax, (key, title) in zip(axes.flat, METRICS.items()):
        for name, rows in peers.items():
            pts = [(r["t_s"] / 60, r[key]) for r in rows if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, label=f"{name} {rows[-1].get('cell')}", lw=1)
        for k in summary["kills"]:
            ax.axvline(k["t_s"] / 60, color="red", alpha=0.3, lw=1)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("minutes")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=6)
    ax = axes.flat[len(METRICS)]
    wins = [w for w in summary["loss_by_window"] if w["train_loss"] is not None]
    ax.plot(
        [(w["from_min"] + w["to_min"]) / 2 for w in wins],
        [w["train_loss"] for w in wins],
        marker="o",
    )
    ax.set_title("train loss by window (last stage)", fontsize=9)
    ax.set_xlabel("minutes")
    ax.grid(alpha=0.3)
    fig.suptitle(f"bench soak: {summary['grid']} (red: a peer SIGKILLed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_reports(out: Path, samples_path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """summary.json, table.md, soak.png in out; the table printed. Never raises for a plot."""
    samples = read_samples(samples_path)
    summary = summarize(samples, meta)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = to_markdown(summary)
    (out / "table.md").write_text(table)
    try:
        plot(samples, summary, out / "soak.png")
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
        summary["plot_error"] = str(e)
    print(table, end="")
    return summary
