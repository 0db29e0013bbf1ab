"""A stage pool's seeded mode (`pipeline.pool_choice = "seeded"`): every path a pure function
of the microbatch's name (mesh/algo/routing.seeded_path), and each cell takes its microbatches
one at a time in (index, stream) order, so the one-process simulator (mesh/engine/pools.py)
computes the same numbers cell for cell. A check of the engines, not a way to train: it
serializes each cell. A lost cell is a PeerTimeout here."""

from __future__ import annotations

from comms.wire import Kind
from mesh.algo import routing
from mesh.algo.topology import Grid
from mesh.runtime.pool import PoolWorker
from mesh.runtime.pool_wire import Held, PoolStats


class SeededPoolWorker(PoolWorker):
    """A pool cell of `pool_choice = "seeded"` (the trainer builds this one for it)."""

    def run_pools(self, on_step: object = None) -> PoolStats:
        self.run_seeded(on_step)
        self.finish()
        return self.stats

    def run_seeded(self, on_step: object = None) -> None:
        """Take this cell's microbatches one at a time in (index, stream) order, each along its
        seeded path: forward, wait for its gradient, backward, step. Deterministic, so the
        simulator reproduces it (mesh/engine/pools.py); a lost cell is a PeerTimeout here."""
        everyone = Grid(self.P, self.m)  # the seeded paths are drawn over every cell
        pools = [everyone.column(j) for j in range(self.P)]
        me, seed = self.cell_name, self.settings.seed
        wait = self.settings.elastic.pool_timeout_s
        done = self.cell.step  # a resumed cell took this many of its microbatches already
        for b in range(self.settings.steps):
            for s in range(self.m):
                path = routing.seeded_path(seed, s, b, pools)
                if path[self.j] != me:
                    continue
                if done > 0:
                    done -= 1
                    continue
                self._seeded_one(s, b, path, wait, on_step)

    def _seeded_one(self, s: int, b: int, path: list[str], wait: float, on_step: object) -> None:
        up = path[self.j - 1] if self.j > 0 else None
        down = path[self.j + 1] if self.j + 1 < self.P else None
        if up is None:
            x = self._batch_of(s, b)[0]
        else:
            x = self.transport.recv(up, f"pool/a/{s}/{b}", self._expect_act, wait).tensor()
            x = x.to(self.device)
        h = Held(s, b, x, self.cell.step, up)
        self.held[(s, b)] = h
        if down is None:
            self._backward_held(h, None, on_step)
            return
        self._send(down, f"pool/a/{s}/{b}", Kind.ACTIVATION, self._activation(h))
        h.sent_to, self._fwd_s = down, 0.0
        msg = self.transport.recv_prefix(down, f"pool/g/{s}/{b}/", self._expect_grad, wait)
        self._backward_held(h, msg.tensor().to(self.device), on_step)
