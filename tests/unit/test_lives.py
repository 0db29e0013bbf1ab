"""A cell's lives in its metrics file (mesh/runtime/lives.py): rows of replayed steps left out
on read, counters summed over every life."""

from __future__ import annotations

from mesh.runtime.lives import cell_totals, life_start, split_lives, without_replayed


def _update(step, **counters):
    return {"step": step, "time_s": 0.1 * step, **counters}


def _life(start, end, sent_per_step=10, rounds_per_step=1, final=False, stopped=False):
    """One process of a cell: its `started` event at `start`, an update row per step to `end`
    (counters from the process's start), then its final row or its `stopped` event."""
    rows = [{"event": "started", "step": start, "pid": 100 + start}]
    for k, step in enumerate(range(start + 1, end + 1), 1):
        rows.append(
            _update(
                step,
                bytes_sent={"activation": k * sent_per_step},
                rounds_applied=k * rounds_per_step,
                rounds_started=k * rounds_per_step,
                rejects={"late": k},
                microbatches=4 * k,
            )
        )
    n = end - start
    if final:
        sent = {"activation": n * sent_per_step + 3}  # sends drained after the last row
        rows.append({"final": True, "step": end, "bytes_sent": sent, "rejects": {"late": n}})
    if stopped:
        sent = {"activation": n * sent_per_step + 5}
        rejects = {"late": n, "stale": 2}
        rows.append({"event": "stopped", "step": end, "bytes_sent": sent, "rejects": rejects})
    return rows


def test_a_resumed_life_supersedes_the_steps_it_replays():
    """Life 1 trained to 17 and was stopped; life 2 resumed from its checkpoint at 10 and went
    to 25: steps 11..17 have one row each, life 2's; life 1's rows up to 10 stay."""
    rows = _life(0, 17, stopped=True) + _life(10, 25, final=True)
    kept = without_replayed(rows)
    steps = [r["step"] for r in kept if "event" not in r and not r.get("final")]
    assert steps == list(range(1, 26))
    assert [r["pid"] for r in kept if r.get("event") == "started"] == [100, 110]
    assert [r for r in kept if r.get("event") == "stopped"], "events stay"
    rows_11 = [r for r in kept if r.get("step") == 11 and "event" not in r]
    assert rows_11 == [rows[-16]], "the later life's row"


def test_a_third_life_from_further_back_supersedes_both():
    rows = _life(0, 20) + _life(15, 30) + _life(5, 12, final=True)
    steps = [r["step"] for r in without_replayed(rows) if "event" not in r and not r.get("final")]
    assert steps == list(range(1, 13))
    assert [life_start(x) for x in split_lives(rows)] == [0, 15, 5]


def test_rows_without_lives_marks_are_one_life():
    rows = [_update(s) for s in range(3, 8)]
    assert len(split_lives(rows)) == 1 and life_start(rows) == 2
    assert without_replayed(rows) == rows


def test_totals_sum_every_life_from_its_last_counters():
    """Bytes and rejects from each life's end (final row, else its stopped event, else its
    last update row), rounds and microbatches from its last update row, updates counted as
    rows: a replayed step's bytes count each time they were sent."""
    rows = _life(0, 17, stopped=True) + _life(10, 25) + _life(25, 30, final=True)
    t = cell_totals(rows)
    assert t["lives"] == 3
    assert t["steps"] == 17 + 15 + 5
    assert t["bytes_sent"] == {"activation": (170 + 5) + 150 + (50 + 3)}
    assert t["rejects"] == {"late": 17 + 15 + 5, "stale": 2}
    assert t["rounds_applied"] == t["rounds_started"] == 17 + 15 + 5
    assert t["microbatches"] == 4 * (17 + 15 + 5)


def test_a_life_that_never_stepped_counts_its_stop():
    rows = (
        _life(0, 8)
        + [{"event": "started", "step": 8}]
        + [{"event": "stopped", "step": 8, "bytes_sent": {}, "rejects": {"unauthorized": 4}}]
    )
    t = cell_totals(rows)
    assert t["lives"] == 2 and t["steps"] == 8 and t["rejects"] == {"late": 8, "unauthorized": 4}
