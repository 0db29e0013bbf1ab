"""`meshtrain bench scale`'s summary.json, table.md and scale.png (mesh/bench/scale.py).

Targets (issue #16): every cell training within 180 s of the first join's start; at least 95%
of the averaging rounds of the steady window complete (applied, not partial or failed).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from mesh.bench.report import checks_table
from mesh.report import format_table, pyplot

ALL_TRAINING_S = 180.0
ROUNDS_COMPLETE = 0.95
DHT_KEYS = ("stores", "store_bytes", "gets", "get_records", "get_bytes")


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "median": None, "max": None}
    return {
        "n": len(values),
        "median": round(statistics.median(values), 1),
        "max": round(max(values), 1),
    }


def share(rounds: dict[str, int] | None) -> float | None:
    """applied / (applied + partial + failed); None with no finished round."""
    if not rounds:
        return None
    done = sum(rounds.values())
    return round(rounds["applied"] / done, 4) if done else None


def summarize(meta: dict[str, Any]) -> dict[str, Any]:
    dht = meta.get("dht_per_peer_per_min") or {}
    per_key = {k: _stats([v[k] for v in dht.values()]) for k in DHT_KEYS}
    records = _stats([v["stores"] + v["get_records"] for v in dht.values()])
    nbytes = _stats([v["store_bytes"] + v["get_bytes"] for v in dht.values()])
    window_share = share(meta.get("rounds_window"))
    t_all = meta.get("time_to_all_training_s")
    left = meta.get("leftovers") or {}
    checks = {
        "all_training_within_180_s": t_all is not None and t_all <= ALL_TRAINING_S,
        "rounds_complete_95pct": window_share is not None and window_share >= ROUNDS_COMPLETE,
        "no_orphan_after_run": bool(left)
        and not left.get("orphan_processes")
        and not left.get("socket_files_left"),
        "torch_threads_1": meta.get("torch_threads") == [1],
    }
    return {
        **meta,
        "join_to_training_stats_s": _stats(list((meta.get("join_to_training_s") or {}).values())),
        "status_latency_s": (meta.get("status") or {}).get("median_s"),
        "dht_records_per_peer_per_min": records,
        "dht_bytes_per_peer_per_min": nbytes,
        "dht_calls_per_peer_per_min": per_key,
        "dht_counted": "each cell's own DHT stores (MSGPack value + key bytes) and gets (records "
        "returned and their bytes), from its health rows; not hivemind's routing, replication "
        "or pings",
        "rounds_complete_share": window_share,
        "rounds_complete_share_whole_run": share(meta.get("rounds_whole_run")),
        "cell_threads_stats": _stats(meta.get("cell_threads") or []),
        "machine": {"cores": os.cpu_count(), "load_1m_at_end": round(os.getloadavg()[0], 2)},
        "checks": checks,
        "all_targets_met": all(checks.values()) and bool(meta.get("completed")),
    }


def to_markdown(s: dict[str, Any]) -> str:
    def v(x: Any, unit: str = "") -> str:
        return "n/a" if x is None else f"{x}{unit}"

    j, r, b = (
        s["join_to_training_stats_s"],
        s["dht_records_per_peer_per_min"],
        s["dht_bytes_per_peer_per_min"],
    )
    st = s.get("status") or {}
    rows = [
        ["peers", s["peers"], f"grid {s['grid']}, emulated compute, one bootstrap"],
        [
            "time to all training",
            v(s.get("time_to_all_training_s"), " s"),
            f"target <= {ALL_TRAINING_S:.0f} s; not training: {len(s.get('not_training') or [])}",
        ],
        [
            "join to training",
            f"median {v(j['median'], ' s')}, max {v(j['max'], ' s')}",
            "each join's (first) start to its first update",
        ],
        [
            "joins started again",
            sum(map(len, (s.get("join_retries") or {}).values())),
            f"gave up on start-up: {s.get('join_retries') or 'none'}",
        ],
        [
            "joins that started over",
            sum((s.get("join_self_restarts") or {}).values()),
            f"lost their cell, joined again by themselves: {s.get('join_self_restarts') or 'none'}",
        ],
        [
            "status latency",
            v(s.get("status_latency_s"), " s"),
            f"`meshtrain status --json`, runs {st.get('runs_s')}, cells {st.get('cells_listed')}, "
            f"failed {len(st.get('failed') or [])}",
        ],
        [
            "DHT records / peer / min",
            f"median {v(r['median'])}, max {v(r['max'])}",
            "stores + records returned by gets",
        ],
        [
            "DHT bytes / peer / min",
            f"median {v(b['median'])}, max {v(b['max'])}",
            "stored + returned value bytes",
        ],
        [
            "rounds complete",
            v(s.get("rounds_complete_share")),
            f"steady window of {s['window_s']:.0f} s {s.get('rounds_window')}; target >= "
            f"{ROUNDS_COMPLETE}; whole run {v(s.get('rounds_complete_share_whole_run'))}",
        ],
        [
            "threads per cell",
            f"median {v(s['cell_threads_stats']['median'])}",
            f"torch threads {s.get('torch_threads')}",
        ],
        [
            "memory",
            f"{v((s.get('resources') or {}).get('pss_mb_per_peer_median'), ' MB')} PSS/peer",
            f"all peers {v((s.get('resources') or {}).get('pss_mb_all_peers'), ' MB')}",
        ],
    ]
    checks = checks_table(s["checks"])
    left = s.get("leftovers") or {}
    return (
        f"{format_table(['measure', 'value', 'what'], rows)}\n\n{checks}\n\n"
        f"After the run: {len(left.get('orphan_processes', []))} orphaned processes, "
        f"{len(left.get('socket_files_left', []))} socket files left. "
        f"{s['machine']['cores']} cores (1-min load {s['machine']['load_1m_at_end']} at the end); "
        f"`{s['command']}`" + ("" if s["completed"] else f"; NOT COMPLETED: {s['error']}") + "\n"
    )


def plot(s: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), dpi=100)
    times = sorted((s.get("join_to_training_s") or {}).values())
    axes[0].step(times, range(1, len(times) + 1), where="post")
    axes[0].axhline(s["peers"], color="grey", ls="--", lw=1)
    axes[0].set(title="cells training", xlabel="s from the join's start", ylabel="cells")
    dht = s.get("dht_per_peer_per_min") or {}
    names = sorted(dht)
    axes[1].bar(range(len(names)), [dht[n]["store_bytes"] + dht[n]["get_bytes"] for n in names])
    axes[1].set(title="DHT bytes per minute, per peer", xlabel="peer", ylabel="bytes / min")
    rw = s.get("rounds_window") or {}
    axes[2].bar(list(rw), list(rw.values()), color=["tab:green", "tab:orange", "tab:red"])
    axes[2].set(title=f"averaging rounds in the {s['window_s']:.0f} s window")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"bench scale: {s['grid']} grid of joins on one box", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_reports(out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    summary = summarize(meta)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = to_markdown(summary)
    (out / "table.md").write_text(table)
    try:
        plot(summary, out / "scale.png")
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
        summary["plot_error"] = str(e)
    print(table, end="")
    return summary
