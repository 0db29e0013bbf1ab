"""DeathSafeLock: what hivemind's process-shared locks are replaced with (comms/p2p/locks.py).
A process that dies holding one releases it; it still excludes threads and processes."""

import multiprocessing as mp
import os
import signal
import threading

import pytest

pytest.importorskip("hivemind")

from comms.p2p import locks  # noqa: E402

HANG_S = 20.0  # only catches a hang


def _acquired_within(lock, timeout_s: float) -> bool:
    """Whether a thread of ours gets `lock` within timeout_s (it releases it at once)."""
    got = threading.Event()

    def take() -> None:
        with lock:
            got.set()

    threading.Thread(target=take, daemon=True).start()
    return got.wait(timeout_s)


def _die_holding(lock) -> None:
    pid = os.fork()
    if pid == 0:  # child: take it and die without a word
        lock.acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_process_killed_holding_it_releases_it() -> None:
    lock = locks.DeathSafeLock()
    _die_holding(lock)
    assert _acquired_within(lock, HANG_S)


def test_the_semaphore_it_replaces_stays_held_by_the_dead() -> None:
    """Why it exists: the same death leaves a multiprocessing lock held for ever."""
    lock = mp.Lock()
    _die_holding(lock)
    assert not lock.acquire(timeout=0.5)


def test_it_excludes_another_process_until_that_one_releases_it() -> None:
    lock = locks.DeathSafeLock()
    holding, release = mp.get_context("fork").Event(), mp.get_context("fork").Event()
    pid = os.fork()
    if pid == 0:
        with lock:
            holding.set()
            release.wait(HANG_S)
        os._exit(0)
    try:
        assert holding.wait(HANG_S)
        assert not _acquired_within(lock, 0.5)  # held by the child
        release.set()
        assert _acquired_within(lock, HANG_S)
    finally:
        release.set()
        os.waitpid(pid, 0)


def test_it_excludes_the_threads_of_one_process() -> None:
    lock, inside, most = locks.DeathSafeLock(), [0], [0]

    def work() -> None:
        for _ in range(200):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert most[0] == 1


def test_a_child_forked_while_a_thread_held_it_can_take_it() -> None:
    """The record lock is the parent's, and the child's thread lock is a new one."""
    lock = locks.DeathSafeLock()
    with lock:
        pid = os.fork()
        if pid == 0:
            os._exit(3 if _acquired_within(lock, 1.0) else 0)  # the parent holds it
        _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    pid = os.fork()  # and once the parent let go, the child gets it
    if pid == 0:
        os._exit(0 if _acquired_within(lock, HANG_S) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_hiveminds_locks_are_replaced_once_comms_p2p_dht_is_imported() -> None:
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    import comms.p2p.dht  # noqa: F401

    for lock in (MPFuture._update_lock, MPFuture._initialization_lock, SharedBytes._lock):
        assert isinstance(lock, locks.DeathSafeLock)
