"""`meshtrain dashboard`: watch a run in a browser. The page (mesh/runtime/dashboard/page.html)
polls /api/status: a run directory's files (--run DIR), or the DHT as `meshtrain status` reads
it (--initial-peers), each cell with its state.

imports: click, cli (join, status, options), mesh.runtime.dashboard.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from cli.options import run_options, user_errors
from mesh.config import ConfigError
from mesh.runtime.dashboard.server import Source, SourceError, make_server


def dht_source(initial_peers: list[str], run_id: str, run_key: str | None) -> tuple[Source, Any]:
    """The JSON of a live run from the DHT, and the scout to close. A run with a key is shown
    only with that key: a dashboard without it (or with another) says so and exits 2."""
    from cli.join import JoinError, open_scout
    from cli.status import KEY_OK, key_error, read_status
    from mesh.runtime.dashboard.live import LiveView

    scout = open_scout(
        initial_peers, run_id, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
    view = LiveView()

    def source() -> dict[str, Any]:
        try:
            rows = read_status(scout, run_key, reread_s=None)
        except JoinError as e:  # the DHT did not answer this time: the page polls again
            raise SourceError(str(e)) from None
        if rows["run_key"] != KEY_OK:
            raise SourceError(key_error(rows["run_key"]) or "no run record in the DHT yet")
        return view.json(rows, time.time())

    try:
        first = read_status(scout, run_key, reread_s=None)
    except BaseException:
        scout.close()
        raise
    problem = key_error(first["run_key"])
    if problem:
        scout.close()
        raise ConfigError(problem)
    return source, scout


def run_dir_source(run_dirs: list[Path]) -> Source:
    """The JSON of a run directory; of several (a `train` run's node directories), of a view
    linking them into one, linked again before each read (mesh/runtime/node_dirs.py)."""
    import tempfile

    from mesh.runtime.dashboard.rundir import RunDirView
    from mesh.runtime.node_dirs import check_dirs, merge_into

    if len(run_dirs) == 1:
        return RunDirView(run_dirs[0]).json
    dirs = check_dirs(run_dirs, "--run")
    merged = Path(tempfile.mkdtemp(prefix="meshtrain-dashboard-")) / "run"
    nodes = [d.resolve() for d in dirs]
    view = RunDirView(merge_into(nodes, merged))

    def source() -> dict[str, Any]:
        merge_into(nodes, merged)  # cells whose files appeared since
        return view.json()

    return source


@click.command()
@click.option(
    "--initial-peers",
    multiple=True,
    metavar="MADDR",
    help="A live WAN run: any DHT node of it, as `meshtrain dht` prints it.",
)
@click.option(
    "--run",
    "run_dirs",
    multiple=True,
    type=click.Path(file_okay=False),
    help="A run directory (`simulate --out`, `join --out`), running or finished: files only; "
    "repeated: the node directories of one `train` run.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to serve on.")
@click.option("--port", type=int, default=8080, show_default=True, help="Port (0: any free).")
@run_options(
    "The run's shared secret (or MESHTRAIN_RUN_KEY): a run with a key is shown only to it."
)
@user_errors
def dashboard(
    initial_peers: tuple[str, ...],
    run_dirs: tuple[str, ...],
    host: str,
    port: int,
    run_key: str | None,
    run_id: str,
) -> None:
    """Serve a page that shows the grid as it trains: every cell's peer, step, tokens/s,
    heartbeat, rounds, rejects and state; the loss curves; bytes sent per link kind. It polls
    GET /api/status, the JSON of `meshtrain status --json` with each cell's state."""
    if bool(initial_peers) == bool(run_dirs):
        raise ConfigError("give either --initial-peers MADDR (a live run) or --run DIR, not both")
    scout = None
    if run_dirs:
        source = run_dir_source([Path(d) for d in run_dirs])
    else:
        source, scout = dht_source(list(initial_peers), run_id, run_key)
    try:
        server = make_server(source, host, port)
    except OSError as e:
        if scout is not None:
            scout.close()
        raise ConfigError(f"--host {host} --port {port}: cannot serve there ({e})") from None
    import signal

    # SIGTERM as Ctrl-C: the scout's p2pd is shut down and its socket file removed
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    bound_host, bound_port = server.server_address[:2]
    click.echo(f"dashboard: http://{bound_host}:{bound_port}/  (Ctrl-C stops it)")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if scout is not None:
            scout.close()
    sys.stdout.flush()
    os._exit(0)  # as `status`: nothing left to tear down once the scout is closed
