"""The DHT side of P2PTransport: its DHT process, and peer names as DHT records.

Role: `start_dht` starts a `PeerDHT` (one hivemind DHT process owning one p2pd) with retries;
`comms/p2p/peer_record.py` parses the name records it stores (`{run_id}.peer.{name}`,
subkey `<peer_id><owner marker>` (signed) -> {"v": 1, "peer_id": base58, "maddrs": [...],
"t": publish time, "auth": token}, MSGPack-encoded by hivemind, type-checked here because any
peer can write a key: a name holds one record per process that published it, and readers take
the newest one that proves membership, so an outsider cannot shadow a member's name).
`start_dht(..., p2pd_flags={...})` passes p2pd flags hivemind has no parameter for
(comms/p2p/relay.py); `relay_service=RelayLimits(...)` starts p2pd until its relay service is
the one with those limits (comms/p2p/relay_service.py). `watch_parent` makes forked helpers
(the DHT process) stop their p2pd, remove their /tmp/hivemind-*.sock files and exit when the
peer process dies, even by SIGKILL.
Every DHT process of ours bounds what junk can do (comms/p2p/bounds.py: what it stores, how
big a reply grows), and run-record reads (`get_records`) tell "nobody answered" from "nothing
there".

imports: hivemind, comms.p2p (auth, bounds, locks, relay_service, shm), comms (errors, procs),
stdlib (no torch, no mesh, no cli).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from comms import procs
from comms.errors import StartTimeout
from comms.p2p import bounds, locks, shm
from comms.p2p.relay_service import check_relay_service

logger = logging.getLogger(__name__)

# before any DHT process is forked: hivemind's process-shared locks stay stuck for ever when a
# process holding one dies, and every later DHT process of ours would hang on them
locks.install()
# and where a stop (SIGTERM, Ctrl-C) cannot spin a process's first shared tensor for ever
shm.install()


def watch_parent(on_orphan: Callable[[], None], period_s: float = 0.5) -> None:
    """In a forked helper process (the DHT's): once the process that started it is gone
    (we were re-parented), run on_orphan and exit. Each helper holds both ends of its control
    pipe, so it never sees EOF; without this a SIGKILLed peer leaves its DHT and p2pd
    running forever."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        with contextlib.suppress(Exception):
            on_orphan()
        os._exit(0)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def one_line(record: logging.LogRecord) -> bool:
    """Logging filter for hivemind loggers in our helper processes: an error logged with a
    traceback (a failed averaging step, a control pipe whose peer process died) becomes one
    warning line; the failure itself reaches our caller as a value."""
    if record.exc_info:
        record.msg, record.args = f"{record.getMessage()} (handled by meshtrain)", ()
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


class _RequestPipe:
    """The DHT process's end of its request pipe. A request is unpickled as it is read, and one
    whose sender (our peer process) was killed while handing it over
    cannot be: its pipe ends wait in the dead sender's multiprocessing resource sharer, and the
    read fails with EOFError or AuthenticationError instead of hivemind's expected OSError, which
    would end the DHT process (every later request of the live sender then hangs). Any failure
    to read a request becomes an OSError: hivemind logs it (one line, see one_line) and skips it.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def recv(self) -> Any:
        # hivemind's loop watches this pipe with add_reader, which makes it non-blocking: a
        # request larger than the pipe's buffer (64 KiB: a store of a big value) was then read
        # in part, failed with EAGAIN, and every later request read from the middle of it
        # (the DHT process answered nothing again). Blocking while one request is read: the
        # loop said a request is there, and its rest follows.
        fd = self._conn.fileno()
        os.set_blocking(fd, True)
        try:
            return self._conn.recv()
        except (OSError, RuntimeError):
            raise
        except Exception as e:  # noqa: BLE001 - unpickling runs arbitrary reducers
            raise OSError(f"skipped a request that cannot be read: {type(e).__name__}: {e}") from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class PeerDHT(hivemind.DHT):
    """hivemind.DHT whose process stops its p2pd and exits when our process dies."""

    def run(self) -> None:
        # Ctrl-C in a terminal (or `timeout`) signals the whole process group: our peer process
        # decides when this DHT stops (shutdown, or watch_parent once it is gone), so it can
        # still withdraw its records on the way out
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # e.g. a request pickled by a process that was killed mid-send cannot be read
        logging.getLogger("hivemind.dht.dht").addFilter(one_line)
        self._inner_pipe = _RequestPipe(self._inner_pipe)
        parent = os.getppid()
        watch_parent(self._orphaned)
        # our p2pd's socket files carry our pid, so that a start that fails half-way (p2pd
        # exits on a bootstrap peer it cannot reach and leaves its socket behind, or the DHT's
        # first ping fails with p2pd still running) can find what is ours and remove it
        P2P._UNIX_SOCKET_PREFIX = f"/unix/tmp/hivemind-{os.getpid()}-"
        _add_p2pd_flags(getattr(self, "p2pd_flags", {}))
        if getattr(self, "relay_service", None) is not None:  # comms/p2p/relay_service.py
            check_relay_service(self.relay_service)
        bounds.bound_storage()  # no junk stored, no reply over p2pd's limit (a flood)
        try:
            super().run()
            _stop_own_daemons()  # nothing left after a clean shutdown; a failed start's leftovers
        except (EOFError, OSError):
            # A request whose pipe our peer process was handing over when it was killed cannot
            # be read (multiprocessing's resource sharer died with it). Our parent is gone or
            # going: exit quietly, as watch_parent would, instead of a traceback on its stderr.
            for _ in range(40):
                if os.getppid() != parent:
                    self._orphaned()
                    os._exit(0)
                time.sleep(0.05)
            raise

    def _orphaned(self) -> None:
        # Plain syscalls only: this runs on the watchdog thread, and hivemind's client and
        # (uv)loop objects must not be touched from outside their loop thread.
        node = getattr(self, "_node", None)
        if node is None:
            # our parent died while we were starting: p2pd may be up already, its socket files
            # named after us (P2P._UNIX_SOCKET_PREFIX), before the node that knows it is
            _stop_own_daemons()
            return
        p2p = node.p2p
        with contextlib.suppress(ProcessLookupError):
            os.kill(p2p._child.pid, signal.SIGTERM)
        adopted = getattr(node, "adopted", [])
        for path in [p2p._daemon_listen_maddr, p2p._client_listen_maddr, *adopted]:
            with contextlib.suppress(OSError, KeyError, TypeError):
                os.remove(path if isinstance(path, str) else path["unix"])
        for _ in range(40):  # reap p2pd, so no zombie outlives us
            try:
                if os.waitpid(p2p._child.pid, os.WNOHANG)[0]:
                    return
            except ChildProcessError:
                return  # already reaped by the event loop's child watcher
            time.sleep(0.05)


def _add_p2pd_flags(flags: dict[str, Any]) -> None:
    """In the DHT process: every p2pd it starts gets these flags too (comms.p2p.relay's: p2pd
    takes options hivemind's P2P.create has no parameter for, e.g. -relayTimeLimit)."""
    if not flags:
        return
    make_args = P2P._make_process_args

    def with_flags(*args: Any, **kwargs: Any) -> list[str]:
        return make_args(*args, **{**kwargs, **flags})

    P2P._make_process_args = staticmethod(with_flags)


def _stop_own_daemons() -> None:
    """Stop any p2pd this process started and remove the socket files named after it."""
    me = os.getpid()
    for pid in _p2pd_children(me):
        # gone already, or reaped by the event loop's child watcher: nothing left to do
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGTERM)
            for _ in range(40):  # reap it: no zombie outlives us
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
                time.sleep(0.05)
            else:
                os.kill(pid, signal.SIGKILL)
    for path in Path("/tmp").glob(f"hivemind-{me}-*"):
        path.unlink(missing_ok=True)


def _p2pd_children(parent: int) -> list[int]:
    """The pids of the p2pd processes whose parent is `parent`."""
    return procs.children(parent, "p2pd")


def _daemons_named_after(pid: int) -> list[int]:
    """The p2pd processes listening on a socket named after DHT process `pid` (its
    -listen=/unix/tmp/hivemind-PID-p2pd-*.sock), wherever they were re-parented to."""
    return procs.named_with(f"/tmp/hivemind-{pid}-p2pd-".encode(), "p2pd")


async def adopt_socket(path: str, _dht: hivemind.DHT, node: Any) -> None:
    """Runs in the DHT process: remove `path` (our replica's socket) if we die."""
    node.adopted = [*getattr(node, "adopted", []), path]


def owner_marker() -> str:
    """This process's hivemind RSA ownership marker "[owner:ssh-rsa ...]": a record whose subkey
    contains it can only be written (or withdrawn) by this process; DHT nodes with an
    RSASignatureValidator reject forged ones."""
    return RSASignatureValidator().local_public_key.decode()


def permanent(start_error: BaseException) -> bool:
    """Whether a failed DHT start fails the same way when retried: p2pd cannot listen where it
    was told (a port in use, an address not of this machine), a malformed or port-0 multiaddr,
    a missing identity directory or p2pd binary."""
    text = str(start_error)
    return isinstance(start_error, ValueError | FileNotFoundError) or any(
        s in text for s in ("bind:", "failed to parse multiaddr", "no transport", "binary")
    )


# what a DHT process may take beyond p2pd's startup_timeout to say it is ready (its first
# routing-table work); past it the start is taken as stuck
READY_SLACK_S = 30.0


def _started(
    initial_peers: list[str], startup_s: float, ready_s: float | None = None, **kwargs: Any
) -> PeerDHT:
    """One start, bounded: hivemind waits for the DHT process without a deadline, and a process
    forked from one with many threads (torch's pools, an in-process gloo group) can hang before
    it says anything. A start not ready within ready_s (default: startup_s + READY_SLACK_S) is
    killed with its p2pd, and raises TimeoutError (start_dht retries it)."""
    ready_s = startup_s + READY_SLACK_S if ready_s is None else ready_s
    p2pd_flags = kwargs.pop("p2pd_flags", None) or {}
    relay_service = kwargs.pop("relay_service", None)
    dht = PeerDHT(initial_peers or None, start=False, startup_timeout=startup_s, **kwargs)
    dht.p2pd_flags, dht.relay_service = dict(p2pd_flags), relay_service
    # The forked process must never collect garbage it inherited: a cycle that holds a C++
    # object of ours (a gloo group, a thread pool) runs its destructor there, on locks and
    # threads that only exist here, and aborts the process ("Fatal Python error: Aborted",
    # garbage-collecting). Frozen at the fork, such objects are outside every collection of
    # the child; here they are unfrozen at once (CPython's gc.freeze idiom for fork).
    gc.freeze()
    try:
        dht.start()
    finally:
        gc.unfreeze()
    try:
        dht.wait_until_ready(ready_s)
    except TimeoutError:
        _kill_stuck(dht.pid)
        dht.join(5)
        raise TimeoutError(f"DHT process not ready in {ready_s:.0f} s") from None
    return dht


def _kill_stuck(pid: int | None) -> None:
    """SIGKILL a stuck DHT process and everything it started, and remove its socket files. It
    is stopped first, so it starts nothing while its children are listed; a p2pd that was
    still being exec'd then (not yet named p2pd) is found by the socket it listens on."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    _kill_and_wait([*procs.children(pid), pid])
    _remove_leftovers(pid)


def kill_unstopped(dht: PeerDHT, wait_s: float = 5.0) -> None:
    """A DHT process still running after shutdown and join (it ignores SIGTERM, so hivemind's
    "terminating it the hard way" does nothing): SIGKILL it with its p2pd and remove its socket
    files, instead of leaving both running for the rest of our process's life."""
    if dht.is_alive():
        _kill_stuck(dht.pid)
        dht.join(wait_s)


def _remove_leftovers(pid: int) -> None:
    """Kill the p2pd of DHT process `pid` (gone) and remove the socket files named after it."""
    _kill_and_wait(_daemons_named_after(pid))
    for path in Path("/tmp").glob(f"hivemind-{pid}-*"):
        path.unlink(missing_ok=True)


def _kill_and_wait(pids: list[int], wait_s: float = 5.0) -> None:
    """SIGKILL pids and wait until each is dead (gone, or a zombie for its parent to reap): a
    process killed in the middle of bind() still creates its socket file, after kill returns."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(map(procs.running, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)


def not_started(me: str, startup_s: float, step: str) -> StartTimeout:
    """A start past its deadline, in one line: the step it was at and the setting to raise."""
    return StartTimeout(
        f"{me!r}: the hivemind transport did not start within {startup_s:.3g} s (it was {step}); "
        "on a loaded machine raise transport.start_timeout_s"
    )


def start_dht(initial_peers: list[str], timeout_s: float, **kwargs: Any) -> PeerDHT:
    """Start a DHT, retrying with backoff: p2pd sometimes fails to bootstrap on a busy host.
    Records with an owner marker in their subkey are signed and checked (RSASignatureValidator,
    the process-wide key). No attempt waits past timeout_s from now; a DHT process not ready by
    then (a loaded machine) raises comms.errors.StartTimeout, which a caller that knows the
    setting behind timeout_s names (P2PTransport: transport.start_timeout_s)."""
    kwargs.setdefault("record_validators", [RSASignatureValidator()])
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    while True:
        try:
            left = deadline - time.monotonic()
            startup = max(5.0, min(15.0, left))
            # a stuck start may take half of what is left, so that a second one fits the
            # deadline (a healthy start is ready in seconds, p2pd's startup_timeout first);
            # never past the deadline itself
            ready = max(startup + 5.0, min(startup + READY_SLACK_S, left / 2))
            return _started(initial_peers, startup, max(0.0, min(ready, left)), **kwargs)
        except Exception as e:
            if permanent(e) or time.monotonic() + delay >= deadline:
                if isinstance(e, TimeoutError) and not isinstance(e, StartTimeout):
                    raise StartTimeout(
                        f"DHT process not ready within its start deadline of {timeout_s:.3g} s"
                    ) from None
                raise
            time.sleep(delay)
            delay *= 2


class DhtCounts:
    """This process's own DHT calls (store_record / get_records): calls and the MSGPack bytes
    of the values stored and of the values a get returned. hivemind's own routing, replication
    and ping traffic is not in it (it happens inside the DHT process); the health rows of a
    cell (mesh/runtime/trainer.py) and `meshtrain bench scale` report these."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stores = self.store_bytes = self.gets = self.get_records = self.get_bytes = 0

    def add(self, **fields: int) -> None:
        with self._lock:
            for name, n in fields.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            names = ("stores", "store_bytes", "gets", "get_records", "get_bytes")
            return {n: getattr(self, n) for n in names}


DHT_COUNTS = DhtCounts()


def msgpack_bytes(value: Any) -> int:
    """The size of a DHT value on the wire (0 if it does not encode)."""
    with contextlib.suppress(Exception):  # a count, never a failure
        return len(MSGPackSerializer.dumps(value))
    return 0


def store_record(
    dht: hivemind.DHT, key: str, subkey: str, value: Any, ttl_s: float, timeout_s: float
) -> bool:
    """Store a plain value (dict/list/str/number, MSGPack) under key/subkey for ttl_s; None
    "deletes" it (a None that outlives the old value). False if the DHT did not take it."""
    exp = get_dht_time() + ttl_s
    size = msgpack_bytes(value)
    if size > bounds.RECORD_MAX_BYTES - 1024:  # nodes would refuse it (with its signature)
        logger.warning("not stored: a %d-byte record under %s is over the DHT's limit", size, key)
        return False
    DHT_COUNTS.add(stores=1, store_bytes=size + len(key) + len(subkey))
    fut = dht.store(key, value, exp, subkey=subkey, return_future=True)
    try:
        return bool(fut.result(timeout_s))
    except Exception:  # noqa: BLE001 - an unreachable DHT: the caller retries (next beat)
        return False


def get_records(dht: hivemind.DHT, key: str, timeout_s: float) -> dict[str, Any] | None:
    """Every live subkey -> value under key ({} when nothing is there); None when the DHT did
    not answer within timeout_s, or could not tell (comms.p2p.bounds.read_records: no node
    answered, or a reply was trimmed). Unknown is not empty: a slow or flooded DHT must not
    read as "every peer left". Values are other peers' data: callers type-check them."""
    return get_many_records(dht, [key], timeout_s)[0]


def get_many_records(
    dht: hivemind.DHT, keys: Sequence[str], timeout_s: float, withdrawn: bool = False
) -> list[dict[str, Any] | None]:
    """get_records of several keys at once (one read in the DHT process, within timeout_s).
    withdrawn: also the subkeys their writer withdrew (stored None, see store_record) and
    whose withdrawal has not expired yet, with the value None."""
    # not cancelled on a timeout: hivemind would log the late result's failure; it ends by
    # itself within its RPC timeouts
    fut = dht.run_coroutine(partial(bounds.read_records, list(keys)), return_future=True)
    try:
        found = fut.result(timeout_s)
    except Exception:  # noqa: BLE001 - no answer in time
        return [None] * len(keys)
    return [_records(f, withdrawn) for f in found]


def _records(found: dict[str, Any] | None, withdrawn: bool) -> dict[str, Any] | None:
    if found is None:
        DHT_COUNTS.add(gets=1)
        return None
    records = {k: v for k, v in found.items() if withdrawn or v is not None}
    size = sum(len(k) + msgpack_bytes(v) for k, v in records.items())
    DHT_COUNTS.add(gets=1, get_records=len(records), get_bytes=size)
    return records


class RunRecords:
    """Records of a run in a DHT (mesh.runtime.registry's Directory): keys under `{run_id}.`, our
    owner marker for signed subkeys. Needs `dht`, `run_id` and `timeout_s` on the instance."""

    dht: hivemind.DHT
    run_id: str
    timeout_s: float

    @property
    def owner_marker(self) -> str:
        """See owner_marker(): put it in a subkey to make the record ours alone."""
        return owner_marker()

    def dht_store(
        self, key: str, subkey: str, value: Any, ttl_s: float, timeout_s: float | None = None
    ) -> bool:
        """See store_record."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        return store_record(self.dht, f"{self.run_id}.{key}", subkey, value, ttl_s, wait_s)

    def dht_get(self, key: str, timeout_s: float | None = None) -> dict[str, Any] | None:
        """See get_records."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        return get_records(self.dht, f"{self.run_id}.{key}", wait_s)

    def dht_get_many(
        self, keys: Sequence[str], timeout_s: float | None = None, withdrawn: bool = False
    ) -> list[dict[str, Any] | None]:
        """See get_many_records."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        keys = [f"{self.run_id}.{k}" for k in keys]
        return get_many_records(self.dht, keys, wait_s, withdrawn)


class DhtClient(RunRecords):
    """A DHT node that only reads and writes run records (join's scout, `meshtrain status`):
    the Directory of mesh.runtime.registry without a transport. Dead bootstrap peers: start_dht
    raises within timeout_s."""

    def __init__(self, initial_peers: list[str], run_id: str, timeout_s: float, **kwargs: Any):
        self.run_id, self.timeout_s = run_id, timeout_s
        self.dht = start_dht(initial_peers, timeout_s, **kwargs)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.dht.shutdown()
        self.dht.join(10.0)
