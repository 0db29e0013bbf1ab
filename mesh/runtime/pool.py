"""A cell of a stage pool (`pipeline.routing = "pools"`): takes microbatches from any cell of the
stage before, routes each onward to a cell of the stage after by load, returns gradients along
the recorded path. With replica affinity (`pipeline.pool_affinity`) it keeps to its own replica's
next cell (its stream's) unless that cell is clearly slower than the best other one, full or down
(mesh/algo/routing.stays); a stream waits for its own full cell rather than cross.

A microbatch is named by (stream, index): stage 0's cell of replica i is stream i and issues
indices 0 .. run.steps-1; every cell reads the microbatch's tokens and targets from its name
(mesh/data/corpus.train_batch), so only activations and gradients cross links. The async
schedule's rules hold per microbatch: the forward reads the newest weights and stashes that
version, the backward recomputes on the stash, and every backward is one update of the live
weights (then the averaging rounds run as on a fixed grid: mesh/runtime/rounds.py).

Its messages are activations, gradients (with the sender's load and the window it takes now),
refusals, load reports (to its replica's upstream cell, when a slot frees for another sender's
microbatch) and FINs, each tagged `pool/...` (mesh/runtime/pool_wire.py). A cell past stage 0
holds at most pipeline.pool_window microbatches and refuses more; with `pool_cell_window =
"auto"` it takes one more while nothing it holds is left to compute here and a next-stage cell
starves (routing.cell_window), and says so in its answers, which its senders' LoadBook reads.

Faults: a microbatch whose gradient is not back within elastic.pool_timeout_s, or whose cell is
cut off (PeerLost), is routed to another live cell (its activation is kept until then) or, with
no other cell, voided and counted; nothing waits for ever. A cell finishes when it holds nothing
and every upstream cell sent FIN.

With seeded routing (`pipeline.pool_choice = "seeded"`, mesh/algo/routes.py) every path is a
pure function of the name and each cell takes its microbatches one at a time in (index, stream)
order (mesh/runtime/pool_seeded.py): the one-process simulator computes the same numbers.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

import torch

from comms import codecs
from comms.errors import PeerLost, PeerTimeout
from comms.transport import Transport
from comms.wire import Expect, Kind, Message
from mesh.algo import routing, sentinel
from mesh.algo.topology import cell_name
from mesh.data.corpus import Corpus
from mesh.engine.cell import Cell
from mesh.runtime.cell_worker import CellWorker
from mesh.runtime.pool_seeded import run_seeded
from mesh.runtime.pool_wire import Held, PoolStats, parse_tag
from mesh.runtime.worker_settings import WorkerSettings

IDLE_S = 0.05  # the loop's longest sleep with nothing filed (timeouts and claims to look at)
DOWN_S = 2.0  # a cell found cut off is not routed to for this long (a restart may bring it back)
RATE_EMA = 0.2
MEMBERS_S = 0.5  # how often a pooled cell looks at the live claims (hivemind)


class PoolWorker(CellWorker):
    """A cell of a stage pool: no schedule; its routing's loop (run_pools) takes its work."""

    stats: PoolStats

    def __init__(
        self, settings: WorkerSettings, cell: Cell, transport: Transport, corpus: Corpus | None
    ) -> None:
        super().__init__(settings, cell, transport, corpus)
        self.ups = self.grid.column(self.j - 1) if self.j > 0 else []
        self.downs = self.grid.column(self.j + 1) if self.next else []
        self.held: dict[tuple[int, int], Held] = {}
        self.book = routing.LoadBook()
        self.down_until: dict[str, float] = {}  # cells found cut off, not routed to till then
        self.down_since: dict[str, float] = {}  # cut off since (cleared when heard again)
        # the live cells by their claims (hivemind: the heartbeat's last read; None: unknown,
        # which changes nothing); torch has none and learns a loss from its links
        self.live: Callable[[], set[str] | None] | None = None
        self._members_at = -math.inf
        self.fins: set[str] = set()
        self.heard: dict[str, float] = {}  # upstream cell -> when its last activation came
        self._turn = 0  # which upstream cell _take_work asks first
        self._started = time.monotonic()
        self.rng = random.Random(routing.unit(settings.seed, self.j, self.i, "pool") * 2**32)
        self.next_index = cell.step  # stage 0: the stream's next microbatch
        self.sec_per_mb: float | None = None  # EMA of this cell's compute per microbatch
        self.round_trip_s: float | None = None  # EMA of its microbatches' time downstream
        self._fwd_s = 0.0  # the last forward's time (its backward adds it to the measure)
        self.window = settings.pipeline.pool_window  # a stream's, as `auto` last sized it
        self._expect_ctl = Expect(kind=Kind.CONTROL, shape=(1,))
        self._ctl = codecs.encode(torch.zeros(1), "fp32")

    def _new_stats(self) -> PoolStats:
        return PoolStats()

    # ---- names and data -----------------------------------------------------------------
    def _load_tag(self, kind: str, stream: int, index: int, to: str) -> str:
        """A gradient's or refusal's tag with this cell's load as `to` should see it, and the
        window it takes now."""
        mine = sum(1 for h in self.held.values() if h.sender == to)
        rate = 0 if not self.sec_per_mb else int(1000 / self.sec_per_mb)
        tag = f"pool/{kind}/{stream}/{index}/{len(self.held) - mine}/{rate}"
        window = min(self._window_now(), 999)
        # the window only where it can move (a grid of cells that predate it reads the rest)
        return tag if self.settings.pipeline.pool_cell_window != "auto" else f"{tag}/{window}"

    def _window_now(self) -> int:
        """The microbatches this cell takes at most now: pipeline.pool_window, or with
        pool_cell_window = "auto" one more than it holds while nothing it holds is left to
        compute here and a cell of the next stage starves as it knows (routing.cell_window)."""
        pipe = self.settings.pipeline
        window = pipe.pool_window
        if self.j > 0 and self.next is not None and pipe.pool_cell_window == "auto":
            idle = all(h.sent_to is not None for h in self.held.values())
            cap = self.settings.window_cap
            window = routing.cell_window(window, cap, len(self.held), idle, self._next_starves())
        self.stats.window_peak = max(self.stats.window_peak, window)
        return window

    def _next_starves(self) -> bool:
        """Whether a live cell of the next stage holds nothing, as this cell knows it (both auto
        windows grow only then)."""
        return any(self.book.queue(c) == 0 for c in self._live_downs())

    def _measured(self, seconds: float) -> None:
        self.sec_per_mb = _ema(self.sec_per_mb, seconds)

    def stream_window(self) -> int:
        """Stage 0: the microbatches its stream keeps in flight (pipeline.pool_stream_window)."""
        want, floor = self.settings.pipeline.pool_stream_window, self.settings.pipeline.pool_window
        if want == "window":
            return floor
        if want == "auto":
            cap = self.settings.window_cap
            target = routing.stream_window(self.round_trip_s, self.sec_per_mb, floor, cap)
            self.window = routing.next_window(self.window, target, self._next_starves())
            return self.window
        return want

    # ---- the loops ---------------------------------------------------------------------------
    def run_pools(self, on_step: object = None) -> PoolStats:
        """Train until this cell's work is done, by its routing's loop (seeded: one microbatch
        at a time along the path its name draws; else by load); then drain."""
        if self.route.seeded:
            run_seeded(self, on_step)
        else:
            self._run_by_load(on_step)
        self.finish()
        return self.stats

    def _run_by_load(self, on_step: object) -> None:
        """Stage 0 until its stream issued run.steps microbatches and got them back (or gave
        them up), a later stage until every upstream cell said FIN and it holds nothing; then
        FIN downstream."""
        seen = self.transport.wait_arrival(-1, 0.0)  # the count so far
        while True:
            t0 = time.perf_counter()
            # backwards first (1F1B's order): each frees a slot here and upstream, then one
            # new forward, so a cell never piles up forwards while gradients wait
            did = self._take_answers(on_step)
            did |= self._issue(on_step) if self.j == 0 else self._take_work(on_step)
            self._members()
            self._expire()
            if self._done():
                break
            if not did:  # asleep until a message is filed (or a timeout to look at)
                holding, t_wait = bool(self.held), time.perf_counter()
                seen = self.transport.wait_arrival(seen, IDLE_S)
                waited = time.perf_counter() - t_wait
                if holding:
                    self.stats.blocked_s += waited
                else:
                    self.stats.starved_s += waited
                if self.emu:
                    self.emu.waited(t0)
        for d in self.downs:
            self._control(d, "pool/f/0")

    def capacity_tps(self) -> float:
        """Tokens a second this cell could compute if always fed (its heartbeat's `tps` in a
        pool: a stage's capacity is its cells' sum; 0 until measured)."""
        return self.settings.tokens_per_microbatch / self.sec_per_mb if self.sec_per_mb else 0.0

    def _members(self) -> None:
        """At most every MEMBERS_S: neighbours without a live claim are down (routed around,
        and an upstream one gone past elastic.pool_timeout_s owes no FIN); back when they are."""
        now = time.monotonic()
        if self.live is None or now - self._members_at < MEMBERS_S:
            return
        self._members_at = now
        live = self.live()
        if live is None:
            return
        for cell in (*self.ups, *self.downs):
            if cell in live:
                if self.down_since.pop(cell, None) is not None:
                    self.down_until.pop(cell, None)
            else:
                self.down_until[cell] = now + DOWN_S
                self.down_since.setdefault(cell, now)

    def _done(self) -> bool:
        if self.held:
            return False
        if self.j == 0:
            return self.next_index >= self.settings.steps
        return all(u in self.fins or self._gone(u) for u in self.ups)

    def _gone(self, cell: str) -> bool:
        """It left the pool (no FIN to wait for): cut off for longer than elastic.pool_timeout_s,
        or, once the run is ending (another upstream cell said FIN), silent that long (a cell
        that died after its last send: its link can wait for a next life that never comes)."""
        now, limit = time.monotonic(), self.settings.elastic.pool_timeout_s
        since = self.down_since.get(cell)
        if since is not None and now - since > limit:
            return True
        return bool(self.fins) and now - self.heard.get(cell, self._started) > limit

    def _issue(self, on_step: object) -> bool:
        """Stage 0: start the stream's next microbatch while the window has room."""
        if self.next_index >= self.settings.steps or len(self.held) >= self.stream_window():
            return False
        if self._waits_for_own():
            return False
        b = self.next_index
        self.next_index += 1
        tokens = self._fake_tokens if self.emu else self._batch_of(self.i, b)[0]
        held = Held(self.i, b, tokens, self.cell.step, None)
        self._forward_held(held, on_step)
        return True

    def _waits_for_own(self) -> bool:
        """Replica affinity at a stream: while its own replica's next cell is full as this
        stream knows it but not clearly slower (routing.stays), the stream waits for it, as a
        fixed chain does, rather than send the microbatch across (which would fill the other
        replica's cell and push its stream across in turn). Only while one of ours is there:
        its gradient brings the cell's load up to date."""
        pipe = self.settings.pipeline
        if pipe.pool_affinity <= 0 or self.next is None:
            return False
        own, live = cell_name(1, self.i), self._live_downs()
        if (
            own not in live
            or not self.book.mine.get(own)
            or self.book.queue(own) < self.book.window_of(own, pipe.pool_window)
        ):
            return False
        rates = [self.book.rate.get(c) for c in live]
        return routing.stays(rates, live.index(own), pipe.pool_affinity)

    def _take_work(self, on_step: object) -> bool:
        """Stage j > 0: one activation, from the upstream cells in turn (each loop starts one
        further on, so none is served first every time); FINs from all of them."""
        did = False
        n = len(self.ups)
        self._turn = (self._turn + 1) % max(1, n)
        for k in range(n):
            up = self.ups[(self._turn + k) % n]
            msg = self._poll(up, "pool/a/", self._expect_act)
            if msg is not None:
                self.heard[up] = time.monotonic()
                self._on_activation(up, msg, on_step)
                did = True
                break
        for up in self.ups:
            if up not in self.fins and self._poll(up, "pool/f/", self._expect_ctl) is not None:
                self.fins.add(up)
                did = True
        return did

    def _on_activation(self, up: str, msg: Message, on_step: object) -> None:
        parsed = parse_tag(msg.name)
        if parsed is None or parsed[0] != "a" or parsed[1] >= self.m:
            self.transport.stats.add_reject("bad_tag")
            return
        _, stream, b, _, _, _ = parsed
        if (stream, b) in self.held:
            self.transport.stats.add_reject("duplicate")
            return
        if len(self.held) >= self._window_now():
            self.stats.refused += 1
            self._control(up, self._load_tag("r", stream, b, up))
            return
        x = msg.tensor().to(self.device)
        if not self.emu and (
            sentinel.is_void(x) or self._screened(up, "activation", x, stream, b) != "use"
        ):
            self.stats.voided += 1
            self._send_void(up, self._load_tag("g", stream, b, up), Kind.GRADIENT)
            return
        self._forward_held(Held(stream, b, x, self.cell.step, up), on_step)

    def _forward_held(self, h: Held, on_step: object) -> None:
        """Forward h on the newest weights; the last stage goes on to its backward at once."""
        self.held[(h.stream, h.index)] = h
        self.stats.held_peak = max(self.stats.held_peak, len(self.held))
        self._track_stash([h.inputs for h in self.held.values()])
        if self.next is None:
            self._backward_held(h, None, on_step)
            return
        t0 = time.perf_counter()
        h.out = self._activation(h)
        self._fwd_s = time.perf_counter() - t0
        self._route(h)

    def _activation(self, h: Held) -> codecs.Encoded:
        """h's forward on its stashed version, as it leaves for the next stage (encoded)."""
        if self.emu:
            enc = self._emulated(self.t_f, self._fake_act)
            assert enc is not None
            return enc
        return self._forward_out(h.version, h.inputs, h.stream, h.index)

    def _live_downs(self, exclude: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
        now = time.monotonic()
        return [d for d in self.downs if d not in exclude and self.down_until.get(d, 0) <= now]

    def _route(self, h: Held, exclude: set[str] = frozenset()) -> bool:  # type: ignore[assignment]
        """Send h's activation to a downstream cell drawn by load; False when none is live."""
        live = self._live_downs(exclude)
        if not live:
            return False
        pipe = self.settings.pipeline
        first, second = self.route.draws(lambda *_: self.rng.random())
        # replica affinity: the cell of the microbatch's own replica (its stream's) is kept
        # while it has room unless it is clearly slower than the best other (routing.stays)
        own = cell_name(self.j + 1, h.stream)
        to = self.book.choose(live, first, pipe.pool_window, second, own, pipe.pool_affinity)
        assert h.out is not None
        self._send(to, f"pool/a/{h.stream}/{h.index}", Kind.ACTIVATION, h.out)
        self.book.sent(to)
        h.sent_to, h.sent_at = to, time.monotonic()
        self.stats.routed[to] += 1
        self.stats.cross_replica += to != cell_name(self.j + 1, self.i)
        return True

    def _take_answers(self, on_step: object) -> bool:
        """Gradients and refusals from the downstream cells (none at the last stage), and the
        load reports of this replica's next cell (_report_room)."""
        did = False
        own = cell_name(self.j + 1, self.i)
        if self.next is not None and own in self.downs:
            while (msg := self._poll(own, "pool/l/", self._expect_ctl)) is not None:
                parsed = parse_tag(msg.name)
                if parsed is None or parsed[0] != "l":
                    self.transport.stats.add_reject("bad_tag")
                    continue
                self.book.report(own, parsed[4], parsed[3], parsed[5])
        # only a cell holding one of ours answers (each answer frees what we hold there)
        waiting = {h.sent_to for h in self.held.values() if h.sent_to is not None}
        for d in [d for d in self.downs if d in waiting]:
            msg = self._poll(d, "pool/g/", self._expect_grad)
            if msg is not None:
                did = True
                self._on_gradient(d, msg, on_step)
            ref = self._poll(d, "pool/r/", self._expect_ctl)
            if ref is not None:
                did = True
                self._on_refusal(d, ref)
        return did

    def _answer_for(self, d: str, msg: Message, kind: str) -> Held | None:
        parsed = parse_tag(msg.name)
        if parsed is None or parsed[0] != kind:
            self.transport.stats.add_reject("bad_tag")
            return None
        _, stream, b, others, rate, window = parsed
        h = self.held.get((stream, b))
        if h is None or h.sent_to != d:  # voided or routed elsewhere meanwhile: a late answer
            self.transport.stats.add_reject("late")
            return None
        self.book.back(d)
        self.book.report(d, rate, others, window)
        return h

    def _on_refusal(self, d: str, msg: Message) -> None:
        h = self._answer_for(d, msg, "r")
        if h is None:
            return
        self.stats.rerouted += 1
        if not self._route(h, exclude={d}):
            self._route(h)  # the only live cell: it may have room by now

    def _on_gradient(self, d: str, msg: Message, on_step: object) -> None:
        h = self._answer_for(d, msg, "g")
        if h is None:
            return
        self.round_trip_s = _ema(self.round_trip_s, time.monotonic() - h.sent_at)
        g = msg.tensor().to(self.device)
        if not self.emu and sentinel.is_void(g):
            self._void(h)
            return
        self._backward_held(h, g, on_step)

    def _backward_held(self, h: Held, grad_out: torch.Tensor | None, on_step: object) -> None:
        """Recompute h's forward on its stashed version, backprop, send dL/d(input) back along
        its path, and step the live weights (one update per microbatch, as async does)."""
        self.held.pop((h.stream, h.index), None)
        self.stats.microbatches += 1
        self.stats.staleness[self.cell.step - h.version] += 1
        tag = None if h.sender is None else self._load_tag("g", h.stream, h.index, h.sender)
        t0 = time.perf_counter()
        grads: list[torch.Tensor] | None = None
        if self.emu:  # no math: the device is busy for the op, a real-shaped tensor goes back
            t = self.t_b + (self.t_f if self.next is None else 0.0)
            enc = self._emulated(t, self._fake_grad if h.sender else None)
        else:
            step, enc = self._backward_of(h.version, h.inputs, h.stream, h.index, grad_out, 1)
            grads = step.weights
            if step.loss is not None:
                self.stats.loss = step.loss
        if h.sender is not None and tag is not None and enc is not None:
            self._send(h.sender, tag, Kind.GRADIENT, enc)
        self._report_room(h)
        self._measured(time.perf_counter() - t0 + (0.0 if self.next is None else self._fwd_s))
        # a state download snapshots between updates, never inside one; a stop signal waits
        # until the update (optimizer, rounds, new version) is whole
        with self.lock, self.critical():
            self.cell.progress = h.index  # the schedules by the data's position (Cell)
            self._update(grads)
            self._push_version()
        if callable(on_step):
            on_step(self)

    def _report_room(self, h: Held) -> None:
        """With affinity, tell the cell of this cell's replica upstream that h's slot is free
        when it did not send h: it hears this cell's load only with its own microbatches'
        gradients, a round trip apart, and a stream waits for its own cell while it knows it
        full (10% dead: half that wait was spent with room there, docs/pools.md)."""
        if self.j == 0 or self.settings.pipeline.pool_affinity <= 0:
            return
        own_up = cell_name(self.j - 1, self.i)
        if (
            h.sender == own_up
            or own_up not in self.ups
            or self.down_until.get(own_up, 0) > time.monotonic()
        ):
            return
        self._control(own_up, self._load_tag("l", h.stream, h.index, own_up))

    def _push_version(self) -> None:
        """The new live version, keeping the versions the held microbatches read."""
        pinned = {h.version for h in self.held.values()}
        self.cell.push_pinned_version(pinned, shared=self.emu is not None)

    def _void(self, h: Held) -> None:
        """Give h up: no gradient from it here, nor upstream (a void marker goes back)."""
        self.held.pop((h.stream, h.index), None)
        self.stats.voided += 1
        if h.sender is not None:
            self._send_void(
                h.sender, self._load_tag("g", h.stream, h.index, h.sender), Kind.GRADIENT
            )

    def _expire(self) -> None:
        """Microbatches whose cell was cut off or that are overdue go to another live cell, or
        are voided when there is none."""
        now = time.monotonic()
        limit = self.settings.elastic.pool_timeout_s
        for h in list(self.held.values()):
            if h.sent_to is None:
                if h.out is not None and self._route(h):  # waiting for a live cell
                    self.stats.rerouted += 1
                elif h.out is not None and now - h.sent_at > limit:
                    self._void(h)
                continue
            lost = self.down_until.get(h.sent_to, 0) > now
            if not lost and now - h.sent_at <= limit:
                continue
            self.book.back(h.sent_to)
            old, h.sent_to = h.sent_to, None
            if self._route(h, exclude={old}):
                self.stats.rerouted += 1
            elif not lost or not self._live_downs():
                self._void(h)

    def _poll(self, frm: str, prefix: str, expect: Expect) -> Message | None:
        """What waits from frm under prefix now, or None; a cut-off peer is marked down."""
        if self.down_until.get(frm, 0) > time.monotonic():
            return None
        try:
            msg = self.transport.recv_prefix(frm, prefix, expect, 0.0)
        except PeerTimeout:
            msg = None
        except PeerLost:
            now = time.monotonic()
            self.down_until[frm] = now + DOWN_S
            self.down_since.setdefault(frm, now)
            return None
        self.down_since.pop(frm, None)
        return msg

    def _control(self, to: str, tag: str) -> None:
        self._send(to, tag, Kind.CONTROL, self._ctl)


def _ema(prev: float | None, x: float) -> float:
    return x if prev is None else (1 - RATE_EMA) * prev + RATE_EMA * x
