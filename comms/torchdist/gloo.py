"""The gloo groups and the TCPStore TorchTransport's links are built on.

imports: torch only.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

FOREVER = timedelta(days=30)  # waits that must not time out: a timed-out gloo op kills the pair


def pair_group(store: dist.Store, rank: int, device, timeout: timedelta):
    """A 2-member gloo group on `device` (one per transport, shared by its pairs). `timeout`
    bounds only its construction (the wait for the other member's address in the store): every
    send and recv on it waits with an explicit deadline (FOREVER), since the group's own
    timeout, which set_timeout does not change afterwards, would close the pair (measured)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [device]
    opts._timeout = timeout
    opts._threads = 1  # p2p sends and recvs do not use gloo's worker threads
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def gloo_device(host: str):
    """The gloo device (listening socket and event loop) of one transport."""
    return dist.ProcessGroupGloo.create_device(hostname=host)


def store_server(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore server on host:port (port 0: the kernel picks one; read it from `.port`),
    bound by us so that it listens on that address only."""
    listen = socket.create_server((host, port), reuse_port=False)
    return dist.TCPStore(
        host,
        listen.getsockname()[1],
        None,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=listen.detach(),
    )


def store_client(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A client of the TCPStore at host:port (retries the connect until `timeout`)."""
    return dist.TCPStore(host, port, None, False, timeout)
