"""A process stopped while it makes its first shared tensor (hivemind's first MPFuture, in a
DHT's start) handles the stop instead of spinning for ever (comms/p2p/shm.py)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("hivemind")

HANG_S = 60.0  # only catches a hang (the child imports torch and hivemind first)

ROOT = Path(__file__).resolve().parents[2]

# a fresh process: torch's manager starts with the first shared tensor of a process
CHILD = """
import json, signal, sys
import comms.p2p.dht  # installs the guard, as every process of ours that starts a DHT does
from hivemind.utils.mpfuture import SharedBytes

seen = [0]
signal.signal(signal.SIGTERM, lambda *_: seen.__setitem__(0, seen[0] + 1))
print("ready", flush=True)
sys.stdin.readline()  # the parent's signals flow from now on
before = seen[0]
SharedBytes.next()  # starts torch_shm_manager and reads its socket name from a pipe
after = seen[0]
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the parent floods until we exit
print(json.dumps({"before": before, "after": after}), flush=True)
"""


def test_a_first_shared_tensor_under_a_stream_of_sigterms_completes() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    flooding = threading.Event()
    try:
        assert child.stdout.readline().strip() == "ready"

        def flood() -> None:  # a signal every half millisecond, into the manager's start
            while flooding.is_set():
                os.kill(child.pid, signal.SIGTERM)
                time.sleep(0.0005)

        flooding.set()
        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        child.stdin.write("go\n")
        child.stdin.flush()
        try:
            out, _ = child.communicate(timeout=HANG_S)
        finally:
            flooding.clear()
            sender.join()
    finally:
        if child.poll() is None:  # spinning in torch's start_manager: the bug
            child.kill()
            child.wait()
    assert child.returncode == 0, out
    counts = json.loads(out.strip().splitlines()[-1])
    assert counts["after"] > counts["before"]  # the stops came while it shared, and were handled
