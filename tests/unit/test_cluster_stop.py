"""`train`'s stop at one step (mesh/runtime/cluster_stop.py) on a real TCPStore on loopback: the
signalled cell's proposal is the step every cell of its scope reads, a cell past it or without a
store stops where it is, and the margin covers what a pipeline has in flight."""

from __future__ import annotations

import signal
from datetime import timedelta

import helpers
import pytest

from comms.torchdist.gloo import store_server
from mesh.config import load_config
from mesh.runtime.cluster_stop import StoreStop, stop_margin
from mesh.runtime.stop import STOP, StopSignal


@pytest.fixture
def stop_state():
    """STOP is the process's one handler: each test leaves it as it found it."""
    saved = STOP.one_step, STOP.asked
    yield STOP
    STOP.one_step, STOP.asked = saved


def _cfg(*keys: str):
    return load_config([], [*helpers.TINY, "model.n_layers=4", "grid.stages=2", *keys])


def test_the_margin_covers_the_microbatches_in_flight_and_the_replicas_a_step_needs():
    assert stop_margin(_cfg("grid.stages=2")) == 3  # async: stage 1 two updates past stage 0
    assert (
        stop_margin(_cfg("grid.stages=4", "model.n_layers=4", "pipeline.window=[1, 1, 0, 0]")) == 6
    )
    assert stop_margin(_cfg("grid.stages=4", "model.n_layers=4", "pipeline.schedule='1f1b'")) == 3
    assert stop_margin(_cfg("grid.stages=2", "dp.strict_tau=true", "dp.tau=4")) == 7
    assert (
        stop_margin(_cfg("grid.stages=2", "dp.mode='grad_allreduce'", "pipeline.schedule='1f1b'"))
        == 4
    )


def test_a_signal_while_armed_asks_for_a_stop_and_the_cell_trains_on():
    stop = StopSignal()
    with pytest.raises(SystemExit):
        stop.handler(signal.SIGTERM, None)  # not armed: a clean stop at once
    stop.one_step = True
    stop.handler(signal.SIGTERM, None)
    stop.handler(signal.SIGINT, None)  # torchrun's forward of a Ctrl-C the cell had too
    assert stop.asked
    stop.give_up.cancel()  # its SIGTERM to this process once the step is not reached in time


def test_the_signalled_cells_step_is_the_one_every_cell_of_its_replica_stops_at(stop_state):
    server = store_server("127.0.0.1", 0, timedelta(seconds=10))
    rows: list[tuple] = []
    cfg = _cfg("grid.stages=2", "grid.replicas=2")

    def cell(replica: int) -> StoreStop:
        event = lambda name, **f: rows.append((replica, name, f))  # noqa: E731
        return StoreStop(cfg, replica, "127.0.0.1", server.port, event)

    s0, s1, other = cell(0), cell(0), cell(1)
    server.set("mt/stop/r0", "2")  # a past start's stop: cleared before this one trains
    s0.clear()
    assert not s1.due(6)
    stop_state.asked = True
    assert not s0.due(5)  # proposes 5 + 3
    assert not s0.due(7) and s0.due(8)
    stop_state.asked = False
    assert not s1.due(7) and s1.due(8)
    assert not other.due(7)  # replica 1 stops on its own key
    assert rows == [(0, "stop_step", {"at": 8}), (0, "stop_step", {"at": 8})]
    late = cell(0)
    with pytest.raises(SystemExit):  # past the step: where it is
        late.due(9)
    assert rows[-1] == (0, "stop_step_passed", {"at": 8})
    together = _cfg("dp.mode='grad_allreduce'", "pipeline.schedule='1f1b'")
    assert StoreStop(together, 1, "127.0.0.1", server.port, print).key == "mt/stop/all"


def test_without_its_store_a_signalled_cell_stops_where_it_is(stop_state):
    server = store_server("127.0.0.1", 0, timedelta(seconds=10))
    stop = StoreStop(_cfg(), 0, "127.0.0.1", server.port, print)
    stop.arm()
    assert stop_state.one_step and not stop.due(3)
    del server  # its node lost
    assert not stop.due(4) and stop.broken and not stop_state.one_step
    stop_state.asked = True
    with pytest.raises(SystemExit):
        stop.due(5)
