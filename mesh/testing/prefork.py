"""`meshtrain ARGS` as a fork of a server that imported torch once, for the benches and tests that
start many peers on one machine: a fresh interpreter spends ~4 s of CPU importing torch, hivemind
and the runtime before a join says a word (on a 2-core box, an 8-peer grid's start is 30 s of
CPU); a fork of the cells' fork server (mesh.runtime.launch.cell_context) spends ~0.1 s.

The child is what `python -m cli.main ARGS` would be once its imports are done: its own session
(a process group the caller can kill whole), the caller's environment and working directory,
stdout/stderr where the caller said (a pipe, a file, /dev/null), default SIGINT/SIGTERM, and
cli.main run as `python -m` runs it. `Preforked` answers as much of subprocess.Popen as the
benches and tests use. Its parent is the fork server, not the caller
(mesh.runtime.stop.watch_parent watches the caller through multiprocessing's pipe all the same).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import runpy
import selectors
import signal
import subprocess
import sys
import time
from multiprocessing import reduction
from typing import IO, Any

from mesh.runtime.launch import cell_context


class _PassedFd:
    """A file descriptor that travels to the forked child (multiprocessing sends it over the
    fork server's socket as it pickles the process object)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup: Any) -> int:
    return dup.detach()


def _child_main(args: list[str], env: dict[str, str], cwd: str, out_fd: int, err_fd: int) -> None:
    """The forked child: become `meshtrain ARGS` (see the module docstring)."""
    # started daemonic, so that a caller that exits without stopping it terminates it (SIGTERM,
    # a clean stop) rather than waiting for it; but a daemonic process may start no child of its
    # own, and a join starts its DHT process: within, it is not one
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in {out_fd, err_fd} - {1, 2}:
        os.close(fd)
    unbuffered = env.get("PYTHONUNBUFFERED", "") not in ("", "0")
    sys.stdout = _text_stream(1, write_through=unbuffered)
    sys.stderr = _text_stream(2, write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # run as `python -m cli.main` runs it (the CLI is a program here, not an import of this
    # layer's: mesh.bench starts it as it would start `python -m cli.main`)
    sys.argv = ["-m", *args]
    try:
        runpy.run_module("cli.main", run_name="__main__", alter_sys=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _text_stream(fd: int, write_through: bool) -> io.TextIOWrapper:
    """sys.stdout/err on fd, as an interpreter started on it would have them."""
    raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115
    return io.TextIOWrapper(
        raw,
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
        write_through=write_through,
    )


def _fd_of(target: Any, default: int) -> tuple[int, IO[str] | None, bool]:
    """(the fd the child gets, the caller's end of a pipe or None, whether the fd is ours to
    close once the child has it) for a Popen stdout/stderr argument."""
    if target is None:
        return default, None, False
    if target == subprocess.PIPE:
        r, w = os.pipe()
        return w, open(r, errors="replace"), True  # noqa: SIM115
    if target == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_WRONLY), None, True
    return (target if isinstance(target, int) else target.fileno()), None, False


class Preforked:
    """A forked `meshtrain ARGS` with the part of subprocess.Popen's interface the benches and
    tests use (pid, poll, wait, send_signal, terminate, kill, communicate, stdout, stderr)."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        stdout: Any = None,
        stderr: Any = None,
        cwd: str | None = None,
    ) -> None:
        self.args = ["meshtrain", *args]
        out_fd, self.stdout, close_out = _fd_of(stdout, 1)
        if stderr == subprocess.STDOUT:
            err_fd, self.stderr, close_err = out_fd, None, False
        else:
            err_fd, self.stderr, close_err = _fd_of(stderr, 2)
        ctx = cell_context()
        passed = (_PassedFd(out_fd), _PassedFd(err_fd))
        self._proc = ctx.Process(
            target=_child_main, args=(args, env, cwd or os.getcwd(), *passed), daemon=True
        )
        try:
            self._proc.start()
        finally:
            for fd, ours in ((out_fd, close_out), (err_fd, close_err)):
                if ours:
                    os.close(fd)
        self.pid: int = self._proc.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped: the pid is still the child's
            # it can exit (and the forkserver reap it) between the two: as Popen, ignore that
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Everything the child writes to its pipes until it closes them, then its exit."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: dict[int, list[bytes]] = {}  # decoded whole: a read may split a character
        with selectors.DefaultSelector() as sel:
            for f in (self.stdout, self.stderr):
                if f is not None:
                    sel.register(f, selectors.EVENT_READ)
                    chunks[f.fileno()] = []
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        sel.unregister(key.fileobj)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)

        def text(f: IO[str] | None) -> str | None:
            return None if f is None else b"".join(chunks[f.fileno()]).decode(errors="replace")

        return text(self.stdout), text(self.stderr)
