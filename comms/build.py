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
from dataclasses import dataclass
from typing import Any

from comms.names import BACKENDS
from comms.throttle import LinkShapers, Shaping
from comms.transport import Transport


@dataclass(frozen=True)
class TorchMeeting:
    """Where torch peers meet: the rendezvous TCPStore "tcp://HOST:PORT", served by whoever
    launched them (serve_store False: comms.build.local_rendezvous, a cluster's launcher) or
    bound by peers[0]."""

    rendezvous: str
    serve_store: bool = True


@dataclass(frozen=True)
class HivemindMeeting:
    """Where hivemind peers meet and how others reach this one: multiaddrs of any DHT node to
    bootstrap from, the run's namespace of DHT keys, the addresses to listen on (empty: the
    transport's host, port 0) and to announce (NAT, port mapping), the identity file that keeps
    the PeerID across restarts, client mode (behind NAT: reached through `relays`) and what this
    peer relays for others (comms.p2p.relay.RelayLimits; None: p2pd's defaults)."""

    initial_peers: tuple[str, ...] = ()
    run_id: str = "meshtrain"
    host_maddrs: tuple[str, ...] = ()
    announce_maddrs: tuple[str, ...] = ()
    identity_path: str | None = None
    client_mode: bool = False
    relays: tuple[str, ...] = ()
    relay_limits: Any = None


Meeting = TorchMeeting | HivemindMeeting


@dataclass(frozen=True)
class TorchOptions:
    """The torch backend's own settings: the peers it links to (None: every other peer) and of
    those the ones it needs at its start (None: every link; a peer that closed before is not
    waited for unless needed), and its mailbox's bounds (messages, bytes decoded)."""

    links: tuple[str, ...] | None = None
    needed: tuple[str, ...] | None = None
    mailbox_messages: int = 64
    mailbox_bytes: int = 1 << 30


@dataclass(frozen=True)
class HivemindOptions:
    """The hivemind backend's own settings: the membership token's maker (comms.p2p.auth.Auth;
    None: an open run), whether its DHT node is a client (it serves no records), and its
    mailbox's bounds."""

    auth: Any = None
    dht_client: bool = False
    mailbox_messages: int = 256
    mailbox_bytes: int = 1 << 30


Options = TorchOptions | HivemindOptions


def make_transport(
    backend: str,
    me: str,
    peers: list[str],
    groups: dict[str, list[str]],
    meeting: Meeting,
    *,
    host: str = "127.0.0.1",
    timeout_s: float = 10.0,
    shaping: Shaping = None,
    options: Options | None = None,
) -> Transport:
    """A started transport for peer `me`.

    Args:
        backend: "torch" (torch.distributed) or "hivemind" (libp2p through a DHT).
        me, peers, groups: this peer, every peer in rank order, averaging groups.
        meeting: where the peers meet, the backend's (TorchMeeting, HivemindMeeting).
        host: address to bind (loopback by default; tests never leave 127.0.0.x).
        timeout_s: startup deadline and default deadline of waits.
        shaping: LinkProfile (or PROFILES name) for every link, a per-destination dict, or None.
        options: the backend's own settings (TorchOptions, HivemindOptions; None: its
            defaults).
    """
    if backend == "torch":
        if not isinstance(meeting, TorchMeeting):
            raise ValueError(f"the torch backend meets at a TorchMeeting, not {meeting!r}")
        opts = TorchOptions() if options is None else options
        if not isinstance(opts, TorchOptions):
            raise ValueError(f"the torch backend takes TorchOptions, not {opts!r}")
        from comms.torchdist.transport import TorchTransport

        return TorchTransport(
            me,
            peers,
            groups,
            meeting.rendezvous,
            serve_store=meeting.serve_store,
            timeout_s=timeout_s,
            shaping=shaping,
            host=host,
            links=None if opts.links is None else list(opts.links),
            needed=None if opts.needed is None else list(opts.needed),
            mailbox_messages=opts.mailbox_messages,
            mailbox_bytes=opts.mailbox_bytes,
        )
    if backend == "hivemind":
        # ---- hivemind branch ----
        if not isinstance(meeting, HivemindMeeting):
            raise ValueError(f"the hivemind backend meets at a HivemindMeeting, not {meeting!r}")
        hm = HivemindOptions() if options is None else options
        if not isinstance(hm, HivemindOptions):
            raise ValueError(f"the hivemind backend takes HivemindOptions, not {hm!r}")
        p2p = _optional_module("comms.p2p.transport")
        return p2p.P2PTransport(
            me,
            run_id=meeting.run_id,
            initial_peers=list(meeting.initial_peers),
            host_maddrs=list(meeting.host_maddrs) or [f"/ip4/{host}/tcp/0"],
            announce_maddrs=list(meeting.announce_maddrs) or None,
            identity_path=meeting.identity_path,
            client_mode=meeting.client_mode,
            relays=list(meeting.relays),
            relay_limits=meeting.relay_limits,
            timeout_s=timeout_s,
            shaping=LinkShapers(me, shaping) if shaping is not None else None,
            peers=peers,
            auth=hm.auth,
            dht_client=hm.dht_client,
            mailbox_messages=hm.mailbox_messages,
            mailbox_bytes=hm.mailbox_bytes,
        )
        # ---- end of hivemind branch ----
    raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")


@contextlib.contextmanager
def local_rendezvous(backend: str, host: str = "127.0.0.1") -> Iterator[Meeting]:
    """Where a group of local peers meets (make_transport's `meeting`); lives as long as the
    context (the parent process of a test or bench holds it).

    torch: the rendezvous TCPStore, served from this process (serve_store False), so that it
    outlives every peer: a peer that is started again forms its links anew with the live ones.
    hivemind: a bootstrap DHT node on host (its multiaddrs are the initial peers).
    """
    if backend == "torch":
        from datetime import timedelta

        from comms.torchdist.gloo import store_server

        store = store_server(host, 0, timedelta(seconds=60))
        try:
            yield TorchMeeting(f"tcp://{host}:{store.port}", serve_store=False)
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
            # EOFError: it failed (its stderr says why)
            yield HivemindMeeting(initial_peers=tuple(ours.recv()))
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
