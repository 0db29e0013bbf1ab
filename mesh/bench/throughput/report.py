"""table.md and the one-line progress report of the throughput study."""

from __future__ import annotations

from typing import Any

from mesh.report import format_table


def _line(e: dict[str, Any]) -> str:
    f, a = e["FullSync"], e["AsyncMesh"]
    return (
        f"  {e['id']}: FullSync {_num(f['tokens_per_s'])} tok/s ({_pct(f['fraction_of_ideal'])} "
        f"of ideal), AsyncMesh {_num(a['tokens_per_s'])} tok/s "
        f"({_pct(a['fraction_of_ideal'])}), ratio {_x(e['ratio'])} "
        f"(predicted {_x(e['predicted_ratio'])})"
    )


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def table_md(summary: dict[str, Any]) -> str:
    rows = []
    for e in summary["configs"]:
        f, a = e["FullSync"], e["AsyncMesh"]
        link = e["link"]
        rows.append(
            [
                e["id"],
                e["grid"],
                f"{link['bandwidth_mbps']:g} Mbit/s, {link['latency_ms']:g} ms",
                ", ".join(e["slowdowns"]) or "all 1.0",
                f"{_num(f['tokens_per_s'])} ({_pct(f['fraction_of_ideal'])}; "
                f"pred {_pct(f['predicted_fraction_of_ideal'])})",
                f"{_num(a['tokens_per_s'])} ({_pct(a['fraction_of_ideal'])})",
                f"{_x(e['ratio'])} ({_x(e['ratio_min'])}-{_x(e['ratio_max'])})",
                _x(e["predicted_ratio"]),
                f"{a['window']} / {a['staleness']}",
                f"{f['dp_bytes_per_replica_step']:,.0f} / {a['dp_bytes_per_replica_step']:,.0f} "
                f"({a['dp_bytes_vs_formula']:.3f})",
                f"{f['pp_bytes_per_replica_step']:,.0f} / {a['pp_bytes_per_replica_step']:,.0f}",
                f"{f['peak_stash_bytes'] / 2**20:.1f} / {a['peak_stash_bytes'] / 2**20:.1f}",
            ]
        )
    head = [
        "id",
        "grid",
        "link",
        "slowdowns",
        "FullSync tok/s (frac of ideal; predicted)",
        "AsyncMesh tok/s (frac)",
        "ratio (min-max)",
        "predicted ratio",
        "AM window / staleness",
        "dp B/replica/step FS / AM (AM vs formula)",
        "pp B/replica/step FS / AM",
        "peak stash MiB FS / AM",
    ]
    p = summary["protocol"]
    codec = summary["pp_codec_bytes"]["vs_fp32"]
    t = summary["targets"]
    lines = [
        f"Emulated compute t_f={p['forward_ms']:g} ms, t_b={p['backward_ms']:g} ms per "
        f"microbatch per stage; {p['tokens_per_microbatch']} tokens per microbatch, "
        f"M={p['microbatches']}; {p['windows']} window(s) of ~{p['window_s']:g} s per method, "
        "interleaved; medians. Ratio = AsyncMesh / FullSync tokens/s.",
        "",
        format_table(head, rows),
        "",
        f"Pipeline frame bytes vs fp32: bf16 {codec['bf16']:.3f}, fp8_e4m3 "
        f"{codec['fp8_e4m3']:.3f}.",
        "",
        "Targets: " + "; ".join(f"{k}: {'pass' if v['pass'] else 'FAIL'}" for k, v in t.items()),
        "",
    ]
    return "\n".join(lines)
