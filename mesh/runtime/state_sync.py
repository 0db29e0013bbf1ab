"""State download: a joining (or far-behind) cell takes its stage's live state from a peer.

The requester sends a CONTROL message `state/req` whose payload is one number (a nonce); the
serving peer answers with a STATE message `state/<nonce>`: the float32 vector of
mesh.runtime.checkpoint.state_vector, sent with its step in the wire header. The server snapshots
the state under the worker's step lock, so the vector is one consistent update. The requester checks
the length, finiteness and step before loading (mesh.runtime.checkpoint.load_state_vector).

imports: mesh, comms.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

import torch

from comms import codecs
from comms.errors import CommsError, PeerLost, PeerTimeout
from comms.transport import Transport
from comms.wire import Expect, Kind
from mesh.engine.cell import Cell
from mesh.runtime.checkpoint import CheckpointError, load_state_vector, state_numel, state_vector

REQUEST_TAG = "state/req"
POLL_S = 0.1
RETRY_S = 3.0


class StateServer:
    """Answers state requests from the other replicas of this stage, in a background thread."""

    def __init__(self, transport: Transport, cell: Cell, lock: threading.Lock, peers: list[str]):
        self.t, self.cell, self.lock, self.peers = transport, cell, lock, peers
        self.served = 0
        self._stop = threading.Event()
        self._expect = Expect(kind=Kind.CONTROL, shape=(1,))
        self._thread = threading.Thread(target=self._serve, name="state-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for peer in self.peers:
                try:
                    msg = self.t.recv(peer, REQUEST_TAG, self._expect, POLL_S)
                except (PeerTimeout, PeerLost):
                    continue
                nonce = int(msg.tensor()[0].item())
                with self.lock:
                    vec, step = state_vector(self.cell), self.cell.step
                with contextlib.suppress(CommsError):
                    enc = codecs.encode(vec, "fp32")
                    self.t.send(peer, f"state/{nonce}", Kind.STATE, enc, step)
                    self.served += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


def download_state(transport: Transport, cell: Cell, donor: str, timeout_s: float) -> bool:
    """Replace the cell's state with `donor`'s; False (cell unchanged) if it did not work within
    timeout_s. The request is repeated every RETRY_S (a request or answer lost with a link that
    broke is not waited for), each under a new nonce."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        nonce = random.getrandbits(20)
        req = codecs.encode(torch.tensor([float(nonce)]), "fp32")
        expect = Expect(
            name=f"state/{nonce}",
            kind=Kind.STATE,
            shape=(state_numel(cell),),
            codecs=frozenset({"fp32"}),
        )
        try:
            transport.send(donor, REQUEST_TAG, Kind.CONTROL, req, cell.step).wait(RETRY_S)
            left = max(0.0, min(RETRY_S, deadline - time.monotonic()))
            msg = transport.recv(donor, f"state/{nonce}", expect, left)
            load_state_vector(cell, msg.tensor(), msg.sender_step)
        except PeerTimeout:
            continue
        except (CommsError, CheckpointError):
            return False
        return True
    return False
