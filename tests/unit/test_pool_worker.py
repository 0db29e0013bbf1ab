"""The stage-pool worker's protocol (mesh/runtime/pool.py) on an in-memory hub: whole frames
through comms.wire, every cell a PoolWorker on its own thread (emulated compute, 1-2 ms ops).
A full cell refuses and the sender picks another; each gradient goes back to the cell that sent
the activation; a dead cell's microbatches are routed again or voided and counted, never
awaited. The same rules over real links: tests/integration/test_pools.py."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import helpers

from comms import wire
from comms.errors import PeerLost, PeerTimeout
from comms.transport import TransportStats
from mesh.algo import routing
from mesh.config import load_config
from mesh.engine.cell import Cell
from mesh.model.build import build_cell_stage
from mesh.runtime.pool import PoolWorker
from mesh.runtime.pool_wire import parse_tag
from mesh.runtime.worker_settings import WorkerSettings


class Hub:
    """Every cell's mailbox, by (receiver, sender); a log of (sender, receiver, tag); dead
    cells' frames vanish and a take from a dead cell raises PeerLost."""

    def __init__(self) -> None:
        self.boxes: dict[tuple[str, str], list[wire.Message]] = defaultdict(list)
        self.log: list[tuple[str, str, str]] = []
        self.dead: set[str] = set()
        self.cond = threading.Condition()


class _Sent:
    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> None:
        return None


class HubTransport:
    backend = "hub"

    def __init__(self, hub: Hub, me: str) -> None:
        self.hub, self.me, self.stats = hub, me, TransportStats()

    def send(self, to: str, tag: str, kind: Any, enc: Any, step: int) -> _Sent:
        frame = wire.pack(tag, kind, enc, step)
        msg = wire.unpack(frame)
        assert isinstance(msg, wire.Message), msg
        with self.hub.cond:
            if self.me not in self.hub.dead and to not in self.hub.dead:
                self.hub.boxes[(to, self.me)].append(msg)
                self.hub.log.append((self.me, to, tag))
                self.hub.cond.notify_all()
        self.stats.add_sent(to, kind, len(frame))
        return _Sent()

    def _take(self, frm: str, match: Any, expect: wire.Expect, timeout_s: float) -> wire.Message:
        deadline = time.monotonic() + timeout_s
        with self.hub.cond:
            while True:
                box = self.hub.boxes[(self.me, frm)]
                for k, msg in enumerate(box):
                    if match(msg.name):
                        del box[k]
                        bad = wire.expect_reject(msg, expect)
                        if bad is None:
                            return msg
                        self.stats.add_reject(bad.reason)
                        break
                else:
                    if frm in self.hub.dead:
                        raise PeerLost(f"{frm} is dead")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PeerTimeout(f"nothing from {frm}")
                    self.hub.cond.wait(left)

    def recv(self, frm: str, tag: str, expect: wire.Expect, timeout_s: float) -> wire.Message:
        return self._take(frm, lambda n: n == tag, expect, timeout_s)

    def recv_prefix(self, frm: str, prefix: str, expect: wire.Expect, timeout_s: float):
        return self._take(frm, lambda n: n.startswith(prefix), expect, timeout_s)

    def drop_tags(self, prefix: str) -> int:
        return 0

    def wait_arrival(self, seen: int, timeout_s: float) -> int:
        with self.hub.cond:
            if len(self.hub.log) == seen:
                self.hub.cond.wait(timeout_s)
            return len(self.hub.log)


def _grid(tmp_path, stages: int, replicas: int, steps: int, *extra: str):
    cfg = load_config(
        [],
        [
            *helpers.TINY,
            f"grid.stages={stages}",
            f"grid.replicas={replicas}",
            f"run.steps={steps}",
            "pipeline.routing='pools'",
            "dp.mode='none'",
            "emulation.compute='emulated'",
            "emulation.forward_ms=1",
            "emulation.backward_ms=2",
            "elastic.pool_timeout_s=2",
            f"model.n_layers={stages}",
            *extra,
        ],
    )
    hub = Hub()
    workers = {}
    absent = {
        f"s{j}r{i}"
        for j, i in routing.absent(
            routing.parse_deaths(cfg.emulation.deaths, stages, replicas), stages, replicas, True
        )
    }
    for i in range(replicas):
        for j in range(stages):
            if f"s{j}r{i}" in absent:
                continue
            cell = Cell.build(cfg, j, i, build_cell_stage(cfg, j))
            settings = WorkerSettings.of(cfg, j, i)
            workers[f"s{j}r{i}"] = PoolWorker(settings, cell, HubTransport(hub, f"s{j}r{i}"), None)
    return cfg, hub, workers


def _run(workers: dict[str, PoolWorker], hub: Hub, kill: str | None = None) -> dict[str, Any]:
    errors: dict[str, BaseException] = {}

    def main(name: str, w: PoolWorker) -> None:
        def on_step(worker: PoolWorker) -> None:
            if name == kill and worker.cell.step >= 3:
                with hub.cond:
                    hub.dead.add(name)
                    hub.cond.notify_all()
                raise SystemExit  # the process is gone: nothing more from it

        try:
            w.run_pools(on_step)
        except SystemExit:
            pass
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors[name] = e

    threads = [threading.Thread(target=main, args=(n, w), daemon=True) for n, w in workers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a cell never finished"
    assert not errors, errors
    return errors


def test_a_full_cell_refuses_and_the_sender_picks_another(tmp_path):
    """pool_window = 1 (the streams' too) with two streams into two middle cells: a cell
    holding one microbatch (waiting for its gradient) refuses the other stream's, which goes
    to the other cell; every microbatch completes."""
    one = ("pipeline.pool_window=1", "pipeline.pool_stream_window='window'")
    # routed by load: with replica affinity each stream keeps to its own cell, and one that
    # knows that cell is full waits for it, so a refusal would need a race to happen
    by_load = ("pipeline.pool_affinity=0",)
    cfg, hub, workers = _grid(tmp_path, 3, 2, 40, *one, *by_load)
    _run(workers, hub)
    refused = sum(workers[c].stats.refused for c in ("s1r0", "s1r1"))
    rerouted = sum(workers[c].stats.rerouted for c in ("s0r0", "s0r1"))
    assert refused > 0 and rerouted >= refused - 1, (refused, rerouted)
    assert [workers[c].cell.step for c in ("s0r0", "s0r1")] == [40, 40]
    assert workers["s1r0"].cell.step + workers["s1r1"].cell.step == 80
    assert workers["s2r0"].cell.step + workers["s2r1"].cell.step == 80
    assert all(w.stats.held_peak <= 1 for w in workers.values())
    # idle time by cause: a stream with its one microbatch out downstream is blocked, never
    # starved (it can always issue); the last stage waits for its first activation: starved
    for c in ("s0r0", "s0r1"):
        assert workers[c].stats.starved_s == 0 and workers[c].stats.blocked_s > 0, c
    assert all(workers[c].stats.starved_s > 0 for c in ("s2r0", "s2r1"))


def test_each_gradient_returns_along_the_path_its_activation_took(tmp_path):
    _, hub, workers = _grid(tmp_path, 3, 2, 30)
    _run(workers, hub)
    acts = {}
    for frm, to, tag in hub.log:
        parsed = parse_tag(tag)
        assert parsed is not None, tag
        kind, stream, index = parsed[:3]
        if kind == "a":
            acts[(to, stream, index)] = frm
    grads = [(frm, to, parse_tag(tag)) for frm, to, tag in hub.log if tag.startswith("pool/g/")]
    assert len(grads) == 2 * 30 * 2  # every microbatch, back across both boundaries
    for frm, to, (_, stream, index, _, _, _) in grads:
        assert acts[(frm, stream, index)] == to, (frm, to, stream, index)
    crossed = sum(w.stats.cross_replica for w in workers.values())
    assert crossed > 0  # the pools mixed the replicas


def test_a_dead_cells_microbatches_are_routed_again_or_voided_never_awaited(tmp_path):
    cfg, hub, workers = _grid(tmp_path, 2, 2, 40)
    t0 = time.monotonic()
    _run(workers, hub, kill="s1r1")
    streams = [workers[c] for c in ("s0r0", "s0r1")]
    assert all(w.next_index == 40 for w in streams)
    lost = sum(w.stats.voided + w.stats.rerouted for w in streams)
    assert lost >= 1  # what s1r1 held when it died went elsewhere or was counted
    done = sum(w.cell.step for w in streams) + sum(w.stats.voided for w in streams)
    assert done == 80  # every microbatch either completed or was counted as voided
    assert time.monotonic() - t0 < 45, "a dead cell's work was awaited"


def test_an_auto_stream_window_covers_a_slow_downstream(tmp_path):
    """pool_stream_window = auto: a stream whose microbatches spend 8x its own compute
    downstream keeps more than pool_window in flight (at most 4x it); every microbatch
    completes and no downstream cell holds more than pool_window."""
    slow = '["s1r0=8", "s1r1=8"]'
    # routed by load (affinity off): with it each stream waits for its own next cell, as a fixed
    # chain does, and holds what that cell holds
    auto = (
        "pipeline.pool_window=2",
        "pipeline.pool_stream_window='auto'",
        "pipeline.pool_affinity=0",
    )
    _, hub, workers = _grid(tmp_path, 2, 2, 30, *auto, f"emulation.slowdowns={slow}")
    _run(workers, hub)
    streams = [workers[c] for c in ("s0r0", "s0r1")]
    assert [w.cell.step for w in streams] == [30, 30]
    assert all(2 < w.stats.held_peak <= 8 for w in streams), [w.stats.held_peak for w in streams]
    assert all(workers[c].stats.held_peak <= 2 for c in ("s1r0", "s1r1"))


def test_with_replica_affinity_equal_peers_keep_to_their_own_replicas(tmp_path):
    """pipeline.pool_affinity = 1.5, equal peers: once every next cell's rate is measured (the
    first few microbatches are drawn by load, which measures them) each microbatch keeps to its
    stream's replica, and a stream waits for its own full cell rather than cross; without
    affinity about half of the hops cross."""
    # compute long enough that a loaded box's scheduling jitter (which the cells measure as
    # their rates) stays well inside the 1.5x threshold: at 4/8 ms a CI box crossed 54 times
    slow = ("emulation.forward_ms=20", "emulation.backward_ms=40")
    _, hub, workers = _grid(tmp_path, 3, 2, 60, "pipeline.pool_affinity=1.5", *slow)
    _run(workers, hub)
    crossed = sum(w.stats.cross_replica for w in workers.values())
    # of 240 hops; measured 10-14 (the unmeasured start), also beside three CPU burners;
    # without affinity about half cross (120)
    assert crossed <= 60, crossed
    for j in range(3):  # every microbatch, each cell about its own stream's
        steps = [workers[f"s{j}r{i}"].cell.step for i in range(2)]
        assert sum(steps) == 120 and min(steps) >= 50, (j, steps)


def test_a_cell_reports_room_to_its_replicas_upstream_cell_when_another_senders_microbatch_frees_it(
    tmp_path,
):
    """Affinity 1.5, s1r1 absent: stage 1's one cell takes stream 1's microbatches too. Its own
    replica's stream (s0r0) hears its load with stream 0's gradients only, a round trip apart,
    so each time a stream-1 microbatch frees a slot there, s1r0 tells s0r0 its load
    (pool/l/...; a stream waits for its own full cell, and would wait on a stale count).
    Nothing else reports: the stage-2 cells' microbatches all come from s1r0, and s2r1's
    replica has no stage-1 cell; without affinity no cell reports."""
    thin = ("emulation.deaths=['s1r1@0']", "pipeline.pool_affinity=1.5")
    _, hub, workers = _grid(tmp_path, 3, 2, 30, *thin)
    _run(workers, hub)
    assert [workers[c].cell.step for c in ("s0r0", "s0r1")] == [30, 30]
    reports = [(f, to, parse_tag(t)) for f, to, t in hub.log if t.startswith("pool/l/")]
    assert {(f, to) for f, to, _ in reports} == {("s1r0", "s0r0")}
    assert sorted(p[2] for _, _, p in reports) == list(range(30))  # one per stream-1 microbatch
    assert all(p[1] == 1 for _, _, p in reports)
    assert not workers["s0r0"].transport.stats.rejects["bad_tag"]  # none it could not read
    _, hub, workers = _grid(tmp_path, 3, 2, 30, thin[0], "pipeline.pool_affinity=0")
    _run(workers, hub)
    assert not [t for _, _, t in hub.log if t.startswith("pool/l/")]


def test_an_auto_cell_window_fills_the_next_stage_where_a_stage_is_thin(tmp_path):
    """pool_cell_window = auto, s1r1 absent: stage 1's one cell serves both streams into two
    stage-2 cells. At pool_window = 1 it holds one microbatch at a time and a stage-2 cell
    always waits; auto lets it take more while a stage-2 cell starves (its window said in its
    answers). Every microbatch completes either way; with the window fixed it never holds two."""
    thin = (
        "pipeline.pool_window=1",
        "pipeline.pool_stream_window=2",
        "emulation.deaths=['s1r1@0']",
    )
    for cell_window in ("window", "auto"):
        _, hub, workers = _grid(
            tmp_path, 3, 2, 30, *thin, f"pipeline.pool_cell_window='{cell_window}'"
        )
        assert "s1r1" not in workers
        _run(workers, hub)
        thin_cell = workers["s1r0"]
        assert [workers[c].cell.step for c in ("s0r0", "s0r1")] == [30, 30]
        assert thin_cell.cell.step == 60
        assert workers["s2r0"].cell.step + workers["s2r1"].cell.step == 60
        windows = [parse_tag(t)[5] for f, _, t in hub.log if f == "s1r0" and t[5] in "gr"]
        if cell_window == "window":  # the tags as before the key: no window in them
            assert thin_cell.stats.held_peak == 1 and set(windows) == {0}
        else:
            assert thin_cell.stats.held_peak >= 2, thin_cell.stats
            assert 2 <= max(windows) <= 4 and thin_cell.stats.window_peak == max(windows)
