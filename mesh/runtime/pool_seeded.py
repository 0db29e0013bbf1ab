"""A pool cell's loop under seeded routing (`pipeline.pool_choice = "seeded"`): every path a pure
function of the microbatch's name (mesh/algo/routes.py), each cell taking its microbatches one
at a time in (index, stream) order: forward, wait for its gradient, backward, step.
Deterministic, so the one-process simulator computes the same numbers (mesh/engine/pools.py);
a check of the engines, not a way to train (it serializes each cell); a lost cell is a
PeerTimeout here. The compute and the messages are the pool worker's (mesh/runtime/pool.py).
"""

from __future__ import annotations

from typing import Any

from comms.wire import Kind
from mesh.algo.topology import Grid
from mesh.runtime.pool_wire import Held

# a mesh.runtime.pool.PoolWorker, which imports this module (layers point one way: no import back)
PoolWorker = Any


def run_seeded(w: PoolWorker, on_step: object) -> None:
    """w's microbatches in (index, stream) order, each along its seeded path; a resumed cell
    skips the w.cell.step it took already."""
    everyone = Grid(w.P, w.m)  # the seeded paths are drawn over every cell
    pools = [everyone.column(j) for j in range(w.P)]
    done = w.cell.step
    for b, s in ((b, s) for b in range(w.settings.steps) for s in range(w.m)):
        path = w.route.path(w.settings.seed, s, b, pools)
        assert path is not None, "a seeded routing knows every path"
        if path[w.j] == w.cell_name:
            if done > 0:
                done -= 1
            else:
                _one(w, s, b, path, on_step)


def _one(w: PoolWorker, s: int, b: int, path: list[str], on_step: object) -> None:
    wait = w.settings.elastic.pool_timeout_s
    up, down = path[w.j - 1] if w.j else None, path[w.j + 1] if w.next else None
    if up is None:
        x = w._batch_of(s, b)[0]
    else:
        x = w.transport.recv(up, f"pool/a/{s}/{b}", w._expect_act, wait).tensor()
    h = w.held[(s, b)] = Held(s, b, x.to(w.device), w.cell.step, up)
    if down is None:
        w._backward_held(h, None, on_step)
        return
    w._send(down, f"pool/a/{s}/{b}", Kind.ACTIVATION, w._activation(h))
    h.sent_to, w._fwd_s = down, 0.0
    msg = w.transport.recv_prefix(down, f"pool/g/{s}/{b}/", w._expect_grad, wait)
    w._backward_held(h, msg.tensor().to(w.device), on_step)
