"""Pipeline schedules as pure data: delays, weight versions, per-stage action lists, timing.

Role: the one place that says what a stage worker (mesh/runtime/stage.py) executes and which weight
version the one-process simulator (mesh/engine/sim.py) uses, so the two engines cannot disagree.
`execute` runs the action lists of all stages against each other and derives the versions from
them; the tests tie that to `version_for`. The timing formulas at the bottom are the predictions
of the throughput benchmark: a flushed pipeline's bubble, an asynchronous one at its slowest
stage, and the microbatches in flight a stage needs to cover its round trip.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mesh.choices import SCHEDULES

_SYNC = ("gpipe", "1f1b")


def validate_schedule(schedule: str, num_stages: int, num_microbatches: int) -> None:
    """Raise ValueError, naming the config key and the fix, if the combination cannot run."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"pipeline.schedule = {schedule!r} is unknown; use one of {', '.join(SCHEDULES)}"
        )
    if num_stages < 1:
        raise ValueError(f"the grid needs at least 1 pipeline stage, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(
            f"pipeline.microbatches = {num_microbatches}; set pipeline.microbatches >= 1"
        )
    if schedule == "2bw" and num_microbatches < num_stages:
        # Two weight versions suffice only if every microbatch's backward happens before the
        # next-but-one update, i.e. the warm-up P-1-j fits in one batch: M >= P.
        raise ValueError(
            f"pipeline.schedule = '2bw' needs pipeline.microbatches >= grid.stages "
            f"({num_stages}), got {num_microbatches}: set pipeline.microbatches = {num_stages} "
            f"or more, or use pipeline.schedule = 'async'"
        )


def _check_stage(stage: int, num_stages: int) -> None:
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")


def validate_window(schedule: str, num_stages: int, window: Sequence[int] | None) -> None:
    """`window[j]`: extra warm-up forwards of stage j on top of the P-1-j of 1F1B (microbatches
    in flight that cover a slow link's round trip).

    Only the async schedule takes one (2bw's two versions and the flushed schedules have no
    room for more in flight). The warm-ups P-1-j+window[j] must not increase with j, or stage
    j+1 would wait for a forward that stage j only runs after its own blocked backward.
    """
    if window is None:
        return
    w = list(window)
    if schedule != "async" and any(w):
        raise ValueError(
            f"pipeline.window needs pipeline.schedule = 'async' (got {schedule!r}); "
            "set pipeline.window = 'none'"
        )
    if len(w) != num_stages or any(x < 0 for x in w):
        raise ValueError(
            f"pipeline.window = {w}: need {num_stages} extra warm-up counts >= 0 (one per stage)"
        )
    for j in range(num_stages - 1):
        if w[j + 1] > w[j] + 1:
            raise ValueError(
                f"pipeline.window = {w}: stage {j + 1} may take at most one more extra warm-up "
                f"than stage {j} (warm-ups P-1-j+window[j] must not increase), or the pipeline "
                "deadlocks"
            )


def _extra(window: Sequence[int] | None, stage: int) -> int:
    return 0 if window is None else int(window[stage])


def stage_delay(
    schedule: str, stage: int, num_stages: int, window: Sequence[int] | None = None
) -> int:
    """Gradient delay delta_j in optimizer steps of this stage: 0 for gpipe and 1f1b (flushed),
    1 for 2bw, P-1-j for async; an in-flight window adds its extra warm-up forwards (async
    only)."""
    validate_schedule(schedule, num_stages, max(1, num_stages))
    _check_stage(stage, num_stages)
    validate_window(schedule, num_stages, window)
    if schedule == "async":
        # W_j warm-up backward+steps between F_b and B_b
        return num_stages - 1 - stage + _extra(window, stage)
    return 1 if schedule == "2bw" else 0


def versions_kept(
    schedule: str, stage: int, num_stages: int, window: Sequence[int] | None = None
) -> int:
    """Weight versions stage j holds at once, the live one included: its gradient delay + 1
    (1 for gpipe and 1f1b)."""
    validate_schedule(schedule, num_stages, max(1, num_stages))
    _check_stage(stage, num_stages)
    if schedule == "async":
        # delta_j + 1: the P-j (+ window) in-flight microbatches' versions
        return stage_delay(schedule, stage, num_stages, window) + 1
    return 2 if schedule == "2bw" else 1


def microbatches_per_update(schedule: str, num_microbatches: int) -> int:
    """Microbatches whose gradients one optimizer step of a stage consumes."""
    validate_schedule(schedule, 1, num_microbatches)
    return 1 if schedule == "async" else num_microbatches


def version_for(
    schedule: str, stage: int, num_stages: int, update: int, window: Sequence[int] | None = None
) -> int:
    """Weight version (updates already applied) used by the F and B of update `update`'s data.

    Microbatch b at stage k uses w_k^(b - delta_k), clamped at 0 in the fill;
    with an in-flight window delta_k grows by window[k].
    """
    delay = stage_delay(schedule, stage, num_stages, window)
    if update < 0:
        raise ValueError(f"update must be >= 0, got {update}")
    return max(0, update - delay)


class Op(enum.Enum):
    """What a stage worker does. Sends are non-blocking (queued); receives block."""

    RECV_ACT = "recv_act"  # wait for the activation of `microbatch` from stage j-1
    FORWARD = "forward"  # forward with the schedule's read version; stash it if kept > 1
    SEND_ACT = "send_act"  # queue the output for stage j+1
    RECV_GRAD = "recv_grad"  # wait for dL/d(output) of `microbatch` from stage j+1
    BACKWARD = "backward"  # recompute on the stashed version, backprop, accumulate grads
    SEND_GRAD = "send_grad"  # queue dL/d(input) for stage j-1
    FLUSH = "flush"  # sync schedules: nothing in flight here; blocking grad all-reduce goes here
    STEP = "step"  # optimizer step on the live weights (a new version); zero the grads


@dataclass(frozen=True)
class Action:
    """One worker action. For STEP and FLUSH, `microbatch` holds the update index."""

    op: Op
    microbatch: int


def _one_f_one_b(mbs: Sequence[int], warmup: int) -> Iterator[tuple[bool, int]]:
    """(is_forward, mb): `warmup` forwards, then 1F1B steady state, then the drain."""
    w = min(warmup, len(mbs))
    for b in mbs[:w]:
        yield True, b
    for i in range(len(mbs) - w):
        yield True, mbs[w + i]
        yield False, mbs[i]
    for b in mbs[len(mbs) - w :]:
        yield False, b


def actions(*args: Any, **kwargs: Any) -> list[Action]:
    """iter_actions(...) as a list (tests, the discrete-event executor)."""
    return list(iter_actions(*args, **kwargs))


def iter_actions(
    schedule: str,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    num_updates: int,
    window: Sequence[int] | None = None,
) -> Iterator[Action]:
    """The actions stage `stage` executes for `num_updates` updates, one at a time (a worker's
    session may run a whole run's updates: hundreds of thousands of actions, a second to build
    as a list at every session start); arguments are checked here, before the first action.

    Microbatches are numbered globally: update u consumes u*mpu .. (u+1)*mpu - 1 with
    mpu = microbatches_per_update(schedule, M). gpipe: all F then all B, FLUSH, STEP per batch.
    1f1b: warm-up P-1-j forwards, 1F1B, cooldown, FLUSH, STEP per batch. async: one 1F1B stream
    over all microbatches, STEP after every B (PipeDream + stashing). 2bw: the same stream,
    STEP after every M-th B. `window` (async only): window[j] extra warm-up forwards.
    """
    validate_schedule(schedule, num_stages, num_microbatches)
    _check_stage(stage, num_stages)
    validate_window(schedule, num_stages, window)
    if num_updates < 0:
        raise ValueError(f"num_updates must be >= 0, got {num_updates}")
    return _actions(schedule, stage, num_stages, num_microbatches, num_updates, window)


def _actions(
    schedule: str, j: int, P: int, M: int, num_updates: int, window: Sequence[int] | None
) -> Iterator[Action]:
    mpu = microbatches_per_update(schedule, M)
    # microbatches in flight below this stage, plus the window's extra
    warmup = P - 1 - j + _extra(window, j)

    def emit(is_forward: bool, b: int) -> Iterator[Action]:
        if is_forward:
            if j > 0:
                yield Action(Op.RECV_ACT, b)
            yield Action(Op.FORWARD, b)
            if j < P - 1:
                yield Action(Op.SEND_ACT, b)
        else:
            if j < P - 1:
                yield Action(Op.RECV_GRAD, b)
            yield Action(Op.BACKWARD, b)
            if j > 0:
                yield Action(Op.SEND_GRAD, b)

    if schedule in _SYNC:
        for u in range(num_updates):
            mbs = range(u * mpu, (u + 1) * mpu)
            if schedule == "gpipe":
                seq = [(True, b) for b in mbs] + [(False, b) for b in mbs]
            else:
                seq = list(_one_f_one_b(mbs, warmup))
            for is_forward, b in seq:
                yield from emit(is_forward, b)
            yield Action(Op.FLUSH, u)
            yield Action(Op.STEP, u)
        return
    for is_forward, b in _one_f_one_b(range(num_updates * mpu), warmup):
        yield from emit(is_forward, b)
        if not is_forward and (b + 1) % mpu == 0:  # backwards run in order: B_b is the (b+1)-th
            yield Action(Op.STEP, b // mpu)


@dataclass(frozen=True)
class Trace:
    """What `execute` observed. Versions are keyed by (stage, microbatch)."""

    order: list[tuple[int, Action]]  # global execution order: (stage, action)
    forward_version: dict[tuple[int, int], int]
    backward_version: dict[tuple[int, int], int]
    steps: list[int]  # STEPs executed per stage
    max_versions_held: list[int]  # distinct versions alive at once (live + stashes) per stage
    max_in_flight: list[int]  # microbatches forwarded but not yet backwarded, per stage


def _read_version(schedule: str, live: int, update: int) -> int:
    if schedule == "2bw":
        # 2BW double buffer: the forwards of batch u read the buffer made by step u-2 (version
        # u-1), even where step u-1 has already made version u (short warm-up stages).
        return max(0, update - 1)
    return live  # the forward uses the newest weights


def _fail(msg: str) -> None:
    raise RuntimeError(f"schedule invariant broken: {msg}")


def execute(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    num_updates: int,
    programs: list[list[Action]] | None = None,
    window: Sequence[int] | None = None,
) -> Trace:
    """Run every stage's action list in a dependency-respecting order (a RECV runs only after
    its matching SEND) and check the invariants a real worker relies on; RuntimeError if one
    breaks or the stages deadlock. Versions follow from the local orders only: live version =
    STEPs done; a BACKWARD recomputes on the version its FORWARD read, which must still be held.
    `programs` replaces the generated lists (tests feed broken ones to the checker); `window`
    is passed to `actions` and bounds the versions held.
    """
    P = num_stages
    progs = programs or [
        actions(schedule, j, P, num_microbatches, num_updates, window) for j in range(P)
    ]
    if len(progs) != P:
        raise ValueError(f"need one program per stage ({P}), got {len(progs)}")
    mpu = microbatches_per_update(schedule, num_microbatches)
    kept = [versions_kept(schedule, j, P, window) for j in range(P)]
    pc, live, queue = [0] * P, [0] * P, {}
    got: list[set[tuple[Op, int]]] = [set() for _ in range(P)]
    in_flight: list[dict[int, int]] = [{} for _ in range(P)]  # mb -> version it read
    fwd, bwd, order = {}, {}, []
    held, most = [1] * P, [0] * P
    while any(pc[j] < len(progs[j]) for j in range(P)):
        progressed = False
        for j in range(P):  # round robin, one action per stage per sweep, like real peers
            if pc[j] == len(progs[j]):
                continue
            a, b = progs[j][pc[j]], progs[j][pc[j]].microbatch
            if a.op in (Op.RECV_ACT, Op.RECV_GRAD):
                if queue.get((a.op, j, b), 0) == 0:
                    continue  # blocked until the matching SEND has happened
                queue[(a.op, j, b)] -= 1
                got[j].add((a.op, b))
            elif a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                done = (j, b) in (fwd if a.op is Op.SEND_ACT else bwd)
                dst = j + 1 if a.op is Op.SEND_ACT else j - 1
                if not done or not 0 <= dst < P:
                    _fail(f"stage {j} sends {a} before computing it or to no stage")
                key = (Op.RECV_ACT if a.op is Op.SEND_ACT else Op.RECV_GRAD, dst, b)
                queue[key] = queue.get(key, 0) + 1
            elif a.op is Op.FORWARD:
                if (j, b) in fwd or (j > 0 and (Op.RECV_ACT, b) not in got[j]):
                    _fail(f"stage {j} forwards microbatch {b} twice or without its input")
                v = _read_version(schedule, live[j], b // mpu)
                if not 0 <= live[j] - v < kept[j]:
                    _fail(f"stage {j} needs version {v} for mb {b} but holds only {kept[j]}")
                fwd[(j, b)] = in_flight[j][b] = v
            elif a.op is Op.BACKWARD:
                if (j, b) not in fwd or (j, b) in bwd:
                    _fail(f"stage {j} backwards microbatch {b} before its forward or twice")
                if j < P - 1 and (Op.RECV_GRAD, b) not in got[j]:
                    _fail(f"stage {j} backwards microbatch {b} without its output gradient")
                v = in_flight[j].pop(b)  # weight stashing: the same version as the forward
                if not 0 <= live[j] - v < kept[j]:
                    _fail(f"stage {j} dropped version {v} before the backward of mb {b}")
                bwd[(j, b)] = v
            elif a.op is Op.FLUSH:
                if in_flight[j]:
                    _fail(f"stage {j} flushes with microbatches {sorted(in_flight[j])} in flight")
            else:  # STEP: it must consume exactly the gradients of update `b`
                n_bwd = sum(1 for (s, _) in bwd if s == j)
                if b != live[j] or n_bwd != (b + 1) * mpu:
                    _fail(f"stage {j} step {b} after {live[j]} steps and {n_bwd} backwards")
                live[j] += 1
            held[j] = max(held[j], len(set(in_flight[j].values()) | {live[j]}))
            most[j] = max(most[j], len(in_flight[j]))
            order.append((j, a))
            pc[j] += 1
            progressed = True
        if not progressed:
            waiting = {j: progs[j][pc[j]] for j in range(P) if pc[j] < len(progs[j])}
            raise RuntimeError(f"deadlock in {schedule}: stages wait on {waiting}")
    if any(queue.values()):
        _fail(f"sends without a receive: {[k for k, n in queue.items() if n]}")
    total = num_updates * mpu
    if len(fwd) != P * total or len(bwd) != P * total or live != [num_updates] * P:
        _fail(f"not every microbatch ran on every stage, or steps {live} != {num_updates}")
    if any(h > k for h, k in zip(held, kept)):
        _fail(f"versions held {held} exceed versions_kept {kept}")
    return Trace(order, fwd, bwd, live, held, most)


def simulate_versions(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    num_updates: int,
    window: Sequence[int] | None = None,
) -> dict[tuple[int, int], int]:
    """Version each stage's FORWARD of each microbatch read, from `execute` (which also checks
    that every BACKWARD used the same, still-held version)."""
    trace = execute(schedule, num_stages, num_microbatches, num_updates, window=window)
    if trace.forward_version != trace.backward_version:
        _fail("a backward used a different version than its forward")
    return trace.forward_version


# ---- timing formulas: what the throughput benchmark predicts ----


def stage_time_s(compute_s: float, payload_bytes: int, bandwidth_bytes_s: float | None) -> float:
    """Per-microbatch time of a stage whose sends overlap compute: max(compute, link time)."""
    if bandwidth_bytes_s is None:
        return compute_s
    if bandwidth_bytes_s <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s or None, got {bandwidth_bytes_s}")
    return max(compute_s, payload_bytes / bandwidth_bytes_s)


def ideal_tokens_per_s(tokens_per_microbatch: int, stage_times_s: list[list[float]]) -> float:
    """Fixed pipelines: tokens * sum_r 1 / max_s t_{s,r}; [replica][stage]."""
    return tokens_per_microbatch * sum(1.0 / max(row) for row in stage_times_s)


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a flushed pipeline with uniform stages: (P-1)/(M+P-1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def predicted_sync_step_s(
    num_stages: int,
    num_microbatches: int,
    t_f_s: list[float],
    t_b_s: list[float],
    allreduce_s: float,
    link_latency_s: float = 0.0,
    transfer_s: float = 0.0,
) -> float:
    """Wall time of one flushed step (gpipe; 1f1b has the same makespan) of one replica.

    Each phase is a flow shop of M identical jobs through the stages, with every link hop as an
    extra server of service time `transfer_s` plus a pure delay `link_latency_s`:
      phase(t) = sum_j t_j + (P-1)(latency + transfer) + (M-1) max(max_j t_j, transfer)
      step = phase(t_f) + phase(t_b) + allreduce_s      (the all-reduce blocks after the flush)
    Uniform stages, no link: (M+P-1)(t_f+t_b); heterogeneous: sum t + (M-1) t_max.
    For a grid, take the max over replicas (they meet in the all-reduce).
    """
    P, M = num_stages, num_microbatches
    if len(t_f_s) != P or len(t_b_s) != P or M < 1:
        raise ValueError(f"need {P} forward and backward times and M >= 1")
    hop = transfer_s if P > 1 else 0.0

    def phase(times: list[float]) -> float:
        return sum(times) + (P - 1) * (link_latency_s + hop) + (M - 1) * max(max(times), hop)

    return phase(t_f_s) + phase(t_b_s) + allreduce_s


def inflight_window(
    stage_times_s: list[float],
    stage: int,
    link_latency_s: float = 0.0,
    transfer_s: float = 0.0,
    period_s: float | None = None,
) -> int:
    """Microbatches stage j must keep in flight so the round trip never starves it:
    max(P-j, ceil(rtt_j / period)), rtt_j = sum_{s>=j} t_s + 2 (P-1-j)(latency + transfer),
    period = max t unless given (a link-bound pipeline: max(max t, transfer))."""
    P = len(stage_times_s)
    _check_stage(stage, P)
    rtt = sum(stage_times_s[stage:]) + 2 * (P - 1 - stage) * (link_latency_s + transfer_s)
    period = max(stage_times_s) if period_s is None else period_s
    return max(P - stage, math.ceil(rtt / period - 1e-9))


def extra_warmups(
    stage_times_s: list[float],
    link_latency_s: float = 0.0,
    transfer_s: float = 0.0,
    period_s: float | None = None,
) -> list[int]:
    """The `window` argument of `actions`: inflight_window - (P-j) extra forwards per stage
    (never increasing with j, so `validate_window` accepts it)."""
    P = len(stage_times_s)
    return [
        inflight_window(stage_times_s, j, link_latency_s, transfer_s, period_s) - (P - j)
        for j in range(P)
    ]


def predicted_async_tokens_per_s(
    tokens_per_microbatch: int,
    stage_times_s: list[list[float]],
    link_latency_s: float = 0.0,
    transfer_s: float = 0.0,
    in_flight: list[int] | None = None,
) -> float:
    """Steady-state tokens/s of the async grid ([replica][stage] per-microbatch stage times).

    No flush, so each replica runs at 1 / its slowest stage, unless a window of
    in_flight[j] microbatches cannot cover stage j's round trip (Little's law): rate_r =
    min(1 / max_j t, min_j in_flight[j] / rtt_j). in_flight=None means the runtime sizes the
    window from the measured round trip (`inflight_window`), so only the slowest stage binds.
    """
    total = 0.0
    for row in stage_times_s:
        rate = 1.0 / max(row)
        for j, w in enumerate(in_flight or []):
            rtt = sum(row[j:]) + 2 * (len(row) - 1 - j) * (link_latency_s + transfer_s)
            rate = min(rate, w / rtt)
        total += rate
    return tokens_per_microbatch * total
