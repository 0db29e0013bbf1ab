"""Build a Transport by backend name, and the local rendezvous that a group of them needs.

Role: the one place that maps "torch" / "hivemind" to a class, so the trainer, the tests and the
bench never import a backend module directly. Adding a backend = one branch in `make_transport`
and one in `local_rendezvous`, both marked below.

imports: comms only (backends imported lazily: hivemind is slow to import and optional here).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import socket
from collections.abc import Iterator
from typing import Any

from comms.names import BACKENDS
from comms.throttle import LinkShapers, Shaping
from comms.transport import Transport


def make_transport(
    backend: str,
    me: str,
    peers: list[str],
    groups: dict[str, list[str]],
    *,
    rendezvous: str | None = None,
    initial_peers: list[str] | None = None,
    host: str = "127.0.0.1",
    timeout_s: float = 10.0,
    shaping: Shaping = None,
    run_id: str = "meshtrain",
    **options: Any,
) -> Transport:
    """A started transport for peer `me`.

    Args:
        backend: "torch" (torch.distributed) or "hivemind" (libp2p through a DHT).
        me, peers, groups: this peer, every peer in rank order, averaging groups.
        rendezvous: torch only: "tcp://HOST:PORT" of the TCPStore (served by local_rendezvous
            with serve_store=False, else bound by peers[0]).
        initial_peers: hivemind only: multiaddrs of any DHT node to bootstrap from.
        host: address to bind (loopback by default; tests never leave 127.0.0.x).
        timeout_s: startup deadline and default deadline of waits.
        shaping: LinkProfile (or PROFILES name) for every link, a per-destination dict, or None.
        run_id: hivemind only: namespace of DHT keys.
        options: backend-specific keyword arguments, passed through.
    """
    if backend == "torch":
        if rendezvous is None:
            raise ValueError("the torch backend needs rendezvous='tcp://HOST:PORT'")
        from comms.torchdist.transport import TorchTransport

        return TorchTransport(
            me,
            peers,
            groups,
            rendezvous,
            timeout_s=timeout_s,
            shaping=shaping,
            host=host,
            **options,
        )
    if backend == "hivemind":
        # ---- hivemind branch ----
        p2p = _optional_module("comms.p2p.transport")
        return p2p.P2PTransport(
            me,
            run_id=run_id,
            initial_peers=list(initial_peers or ()),
            host_maddrs=options.pop("host_maddrs", None) or [f"/ip4/{host}/tcp/0"],
            timeout_s=timeout_s,
            shaping=LinkShapers(me, shaping) if shaping is not None else None,
            peers=peers,
            **options,
        )
        # ---- end of hivemind branch ----
    raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")


@contextlib.contextmanager
def local_rendezvous(backend: str, host: str = "127.0.0.1") -> Iterator[dict[str, Any]]:
    """What a group of local peers needs to find each other, as make_transport kwargs; lives
    as long as the context (the parent process of a test or bench holds it).

    torch: the rendezvous TCPStore, served from this process ({"rendezvous":
    "tcp://host:port", "serve_store": False}), so that it outlives every peer: a peer that is
    started again forms its links anew with the live ones.
    hivemind: a bootstrap DHT node on host ({"initial_peers": [maddr, ...]}).
    """
    if backend == "torch":
        from datetime import timedelta

        from comms.torchdist.gloo import store_server

        store = store_server(host, 0, timedelta(seconds=60))
        try:
            yield {"rendezvous": f"tcp://{host}:{store.port}", "serve_store": False}
        finally:
            del store  # stops the server, frees the port
        return
    if backend == "hivemind":
        # ---- hivemind branch ----
        _optional_module("comms.p2p.transport")
        # The node runs in a spawned process of its own: hivemind forks its DHT process from
        # whoever starts it, and a fork of a process with threads (a test's in-process gloo
        # groups and TCPStores, torch's pools) can hang before it says ready, every time.
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_bootstrap_node, args=(host, theirs), name="bootstrap-dht")
        proc.start()
        theirs.close()
        try:
            if not ours.poll(SPAWN_S + BOOTSTRAP_START_S):
                raise TimeoutError(
                    f"the bootstrap DHT node did not start in {SPAWN_S + BOOTSTRAP_START_S} s"
                )
            yield {"initial_peers": ours.recv()}  # EOFError: it failed (its stderr says why)
        finally:
            with contextlib.suppress(OSError):
                ours.send("stop")
            ours.close()
            proc.join(15)
            if proc.is_alive():
                proc.kill()
                proc.join()
        return
        # ---- end of hivemind branch ----
    raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")


BOOTSTRAP_START_S = 120.0  # a bootstrap DHT node's start, p2pd's retries with backoff included
SPAWN_S = 60.0  # a spawned interpreter's start, before its bootstrap node starts


def _bootstrap_node(host: str, conn: Any) -> None:
    """A spawned process: a bootstrap DHT node on host; sends its multiaddrs on `conn`, then
    serves until the parent says stop or goes away (the pipe closes)."""
    import signal

    from comms.p2p.dht import start_dht

    # Ctrl-C reaches the whole process group: the parent decides when this node stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    dht = start_dht([], BOOTSTRAP_START_S, host_maddrs=[f"/ip4/{host}/tcp/0"])
    try:
        conn.send([str(a) for a in dht.get_visible_maddrs()])
        with contextlib.suppress(EOFError, OSError):
            conn.recv()
    finally:
        dht.shutdown()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on host a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _optional_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise NotImplementedError(f"backend module {name} is not there yet") from e
