"""A cell's metrics rows for the tools people already run: TensorBoard event files
(metrics.tensorboard) and a Prometheus endpoint (metrics.prometheus_port). Both see the rows
mesh.runtime.metrics.MetricsSink has just written as JSON; a cell killed mid-run loses at most
the TensorBoard events of its last FLUSH_S seconds, never a JSONL row.

What each exports of a row (cell = "s<stage>r<replica>"):
  loss, lr_scale, grad_norm, step, tokens_per_s (over the last update), bytes_sent by link
  kind, rounds (started / applied / partial / failed), rejects by reason.

imports: stdlib; tensorboard via torch.utils.tensorboard and prometheus_client, only when on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mesh.algo.topology import cell_name
from mesh.errors import need_extra

FLUSH_S = 5  # TensorBoard writes its events at least this often
ROUNDS = ("started", "applied", "partial", "failed")


def prometheus_port_of(base: int, stage: int, replica: int, stages: int) -> int:
    """Each cell its own port: base + the cell's index in the grid, replica-major (the order
    `simulate` starts them in), so one host can run every cell of a grid."""
    return base + replica * stages + stage


def scalars(row: dict[str, Any], tokens_per_update: int, prev: dict[str, Any] | None) -> dict:
    """The numbers of a row by name (tag): what both exporters publish."""
    out: dict[str, float] = {"step": float(row["step"])}
    for key in ("loss", "lr_scale", "grad_norm"):
        if isinstance(row.get(key), int | float):
            out[key] = float(row[key])
    if prev is not None:
        dt = row.get("time_s", 0) - prev.get("time_s", 0)
        steps = row["step"] - prev["step"]
        if dt > 0 and steps >= 0:
            out["tokens_per_s"] = steps * tokens_per_update / dt
    for kind, n in (row.get("bytes_sent") or {}).items():
        out[f"bytes_sent/{kind}"] = float(n)
    for k in ROUNDS:
        out[f"rounds/{k}"] = float(row.get(f"rounds_{k}", 0))
    for reason, n in (row.get("rejects") or {}).items():
        out[f"rejects/{reason}"] = float(n)
    return out


class TensorBoardExporter:
    def __init__(self, log_dir: Path, tokens_per_update: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise need_extra("tensorboard", "metrics.tensorboard") from None

        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=FLUSH_S)
        self.tokens_per_update, self.prev = tokens_per_update, None

    def write(self, row: dict[str, Any]) -> None:
        for tag, value in scalars(row, self.tokens_per_update, self.prev).items():
            if tag != "step":
                self.writer.add_scalar(tag, value, global_step=row["step"])
        self.prev = row

    def close(self) -> None:
        self.writer.close()


class PrometheusExporter:
    """Gauges named meshtrain_<name>, labelled by cell (and kind / result / reason), on an
    HTTP server of its own registry (a process's default registry would also export Python's
    process metrics, which are not the run's)."""

    def __init__(self, host: str, port: int, cell: str, tokens_per_update: int) -> None:
        try:
            import prometheus_client as pc
        except ImportError:
            raise need_extra("prometheus_client", "metrics.prometheus_port") from None

        self.pc, self.cell, self.tokens_per_update, self.prev = pc, cell, tokens_per_update, None
        self.registry = pc.CollectorRegistry()
        self.gauges: dict[str, Any] = {}
        try:
            self.server, self.thread = pc.start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            from mesh.config import ConfigError

            raise ConfigError(
                f"metrics.prometheus_port: cell {cell} cannot serve on {host}:{port} ({e}); "
                "pick another base port (each cell takes base + replica x stages + stage)"
            ) from e

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...]) -> Any:
        if name not in self.gauges:
            self.gauges[name] = self.pc.Gauge(
                f"meshtrain_{name}", doc, ("cell", *labels), registry=self.registry
            )
        return self.gauges[name]

    def write(self, row: dict[str, Any]) -> None:
        for tag, value in scalars(row, self.tokens_per_update, self.prev).items():
            group, _, label = tag.partition("/")
            if not label:
                self._gauge(group, f"the cell's {group} at its last update", ()).labels(
                    self.cell
                ).set(value)
                continue
            label_name = {"bytes_sent": "kind", "rounds": "result", "rejects": "reason"}[group]
            doc = f"{group.replace('_', ' ')} so far, by {label_name}"
            self._gauge(group, doc, (label_name,)).labels(self.cell, label).set(value)
        self.prev = row

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def open_exporters(
    cfg: Any, stage: int, replica: int, out_dir: Path, tokens_per_update: int
) -> list[Any]:
    out: list[Any] = []
    rt = cfg.metrics
    if rt.tensorboard:
        log_dir = out_dir / "tensorboard" / cell_name(stage, replica)
        out.append(TensorBoardExporter(log_dir, tokens_per_update))
    if rt.prometheus_port is not None:
        port = prometheus_port_of(rt.prometheus_port, stage, replica, cfg.grid.stages)
        out.append(
            PrometheusExporter(
                cfg.transport.host, port, cell_name(stage, replica), tokens_per_update
            )
        )
    return out
