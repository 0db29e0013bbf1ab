"""The pure parts of `meshtrain bench soak` and `bench scale` (mesh/bench/soak_report.py,
scale_report.py, soak.plan): growth, slopes, loss windows, the targets, the tables."""

from mesh.bench import scale_report, soak_report
from mesh.bench.soak import plan


def test_plan_kills_about_every_ten_minutes_and_at_least_once():
    hour = plan(60, quick=False)
    assert hour["kills"] == 6 and hour["kill_every_s"] == 3600 / 7
    assert hour["sample_s"] == 30 and hour["warmup_s"] == 300  # minute 5 of 60
    quick = plan(3, quick=True)
    assert quick["kills"] == 1 and quick["kill_every_s"] == 90 and quick["sample_s"] == 5


def test_growth_is_median_of_last_three_minus_first_three():
    assert soak_report.growth([100, 300, 101, 102, 150, 160, 155]) == 155 - 101
    assert soak_report.growth([1, 2, 3]) is None  # too few samples to say


def test_slope_per_hour_of_a_line_and_of_a_flat_series():
    ts = [0, 600, 1200, 1800]
    assert soak_report.slope_per_hour(ts, [10, 20, 30, 40]) == 60.0
    assert soak_report.slope_per_hour(ts, [5, 5, 5, 5]) == 0.0


def _sample(t, peer, cell, rss, threads=20, fds=90, loss=None, n=0, age=None):
    return {
        "kind": "sample",
        "t_s": t,
        "peer": peer,
        "cell": cell,
        "age_s": t if age is None else age,
        "rss_mb": rss,
        "pss_mb": rss / 2,
        "rss_mb_p2pd": 80,
        "fds": fds,
        "threads": threads,
        "asyncio_tasks": 10,
        "mailbox_pending": 0,
        "sockets": 2,
        "loss_mean": loss,
        "loss_n": n,
        "rounds_applied": 9,
        "rounds_partial": 0,
        "rounds_failed": 1,
    }


def _meta(duration_s=600.0):
    plan_ = {
        "duration_s": duration_s,
        "kills": 1,
        "kill_every_s": 300,
        "sample_s": 30,
        "warmup_s": 50,
    }
    left = {"orphan_processes": [], "orphan_p2pd": 0, "socket_files_left": []}
    return {
        "command": "meshtrain bench soak --minutes 10",
        "plan": plan_,
        "completed": True,
        "error": None,
        "leftovers": left,
    }


def test_summary_measures_growth_after_warmup_and_judges_the_targets():
    samples = []
    for k in range(20):
        t = 30.0 * k
        # p0 leaks 10 MB a sample (but its first, pre-warm-up samples are much lower)
        samples.append(_sample(t, "p0", "s0r0", (100 if t < 50 else 500) + 10 * k))
        samples.append(_sample(t, "p1", "s1r0", 400, loss=5 - k * 0.2, n=10))
    samples.append(
        {
            "kind": "kill",
            "t_s": 300,
            "peer": "p2",
            "cell": "s0r1",
            "helpers_exit_s": 2.0,
            "helpers_outlived": [],
            "sockets_left": [],
        }
    )
    s = soak_report.summarize(samples, _meta())
    # p0: from its first samples at >= 50 s (k = 2, 3, 4) to its last three (k = 17, 18, 19)
    assert s["rss_growth_mb"]["p0"] == (500 + 180) - (500 + 30)
    assert s["rss_growth_mb"]["p1"] == 0
    assert s["rss_growth_mb_max"] == 150
    assert s["checks"]["rss_growth_under_100mb"] is False
    assert s["checks"]["threads_flat"] and s["checks"]["fds_flat"]
    assert s["checks"]["loss_falling"] and s["checks"]["no_orphan_after_run"]
    assert s["rounds"] == {"applied": 18, "partial": 0, "failed": 2}
    assert s["rounds_complete_share"] == 0.9
    assert s["all_targets_met"] is False
    table = soak_report.to_markdown(s)
    assert "| p0 " in table and "MISSED" in table and "rss_growth_under_100mb" in table


def test_loss_windows_weight_by_updates_and_take_only_the_last_stage():
    samples = [
        _sample(10, "p1", "s1r0", 1, loss=4.0, n=1),
        _sample(20, "p1", "s1r0", 1, loss=2.0, n=3),
        _sample(20, "p0", "s0r0", 1, loss=9.0, n=5),
        _sample(590, "p1", "s1r0", 1, loss=1.0, n=2),
    ]
    w = soak_report.loss_windows(samples, 600.0)
    assert len(w) == soak_report.WINDOWS
    assert w[0]["train_loss"] == (4.0 + 3 * 2.0) / 4 and w[0]["updates"] == 4
    assert w[-1]["train_loss"] == 1.0 and w[1]["train_loss"] is None


def test_leftovers_and_a_thread_pileup_fail_their_targets():
    samples = [_sample(30.0 * k, "p0", "s0r0", 400, threads=20 + 3 * k) for k in range(10)]
    meta = _meta()
    meta["leftovers"] = {
        "orphan_processes": ["123 (p2pd)"],
        "orphan_p2pd": 1,
        "socket_files_left": [],
    }
    s = soak_report.summarize(samples, meta)
    assert not s["checks"]["threads_flat"] and not s["checks"]["no_orphan_after_run"]


def _scale_meta(t_all=120.0, window=None):
    return {
        "command": "meshtrain bench scale",
        "grid": "8x4",
        "peers": 32,
        "window_s": 120.0,
        "completed": True,
        "error": None,
        "time_to_all_training_s": t_all,
        "not_training": [],
        "join_to_training_s": {"p00": 10.0, "p01": 30.0},
        "status": {"runs_s": [5.0, 6.0, 7.0], "median_s": 6.0, "cells_listed": [32] * 3},
        "dht_per_peer_per_min": {
            "p00": {
                "stores": 60,
                "store_bytes": 6000,
                "gets": 60,
                "get_records": 600,
                "get_bytes": 60000,
            },
            "p01": {
                "stores": 62,
                "store_bytes": 6200,
                "gets": 58,
                "get_records": 580,
                "get_bytes": 58000,
            },
        },
        "rounds_window": window or {"applied": 96, "partial": 3, "failed": 1},
        "rounds_whole_run": {"applied": 100, "partial": 5, "failed": 5},
        "cell_threads": [14, 16],
        "torch_threads": [1],
        "resources": {},
        "leftovers": {"orphan_processes": [], "socket_files_left": []},
    }


def test_scale_summary_counts_dht_per_peer_and_judges_the_targets():
    s = scale_report.summarize(_scale_meta())
    assert s["dht_records_per_peer_per_min"]["median"] == (660 + 642) / 2
    assert s["dht_bytes_per_peer_per_min"]["max"] == 66000
    assert s["rounds_complete_share"] == 0.96 and s["status_latency_s"] == 6.0
    assert s["all_targets_met"] is True
    slow = scale_report.summarize(
        _scale_meta(t_all=None, window={"applied": 9, "partial": 1, "failed": 0})
    )
    assert not slow["checks"]["all_training_within_180_s"]
    assert not slow["checks"]["rounds_complete_95pct"] and slow["all_targets_met"] is False
    table = scale_report.to_markdown(slow)
    row = next(ln for ln in table.splitlines() if ln.startswith("| time to all training"))
    assert row.split("|")[2].strip() == "n/a" and "MISSED" in table


def test_rounds_share_with_no_round_is_unknown_not_complete():
    assert scale_report.share({"applied": 0, "partial": 0, "failed": 0}) is None
    assert scale_report.share(None) is None


def test_scale_table_counts_joins_that_started_over_by_themselves():
    s = scale_report.summarize({**_scale_meta(), "join_self_restarts": {"p06": 2, "p09": 1}})
    row = next(
        ln
        for ln in scale_report.to_markdown(s).splitlines()
        if ln.startswith("| joins that started over")
    )
    assert row.split("|")[2].strip() == "3" and "p06" in row


def test_a_socket_named_after_a_reused_pid_is_ours_only_once_no_one_holds_it(tmp_path):
    """Pids wrap at 32768: a file hivemind-PID-* that another process (here, this test) has
    bound under a pid our grid once saw is not our leftover; once unbound, it is, unless it is
    older than our process of that pid (an earlier process's leftover)."""
    import os
    import socket
    import time

    from mesh.bench.grid import LocalGrid

    grid = LocalGrid(tmp_path)
    pid = os.getpid()
    grid.seen[pid] = "python3"  # as if a process of the grid had had our pid
    path = f"/tmp/hivemind-{pid}-p2pd-reusedpid.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(1)
        assert path not in grid.own_socket_files()
        sock.close()
        assert path in grid.own_socket_files()  # its owner is gone: a leftover
        grid.started_s[pid] = time.time() + 3600  # our process of that pid came after it
        assert path not in grid.own_socket_files()
        grid.started_s[pid] = time.time() - 60  # it came after our process: ours
        assert path in grid.own_socket_files()
    finally:
        sock.close()
        os.unlink(path)


def test_a_join_that_lost_its_first_claim_is_read_from_the_cell_it_holds_now(tmp_path):
    """A join whose claim lost a race (or that moved) has a file for each cell it held: the
    soak's reader and the harness follow the one appended to last, not the first by name."""
    import json
    import os

    from mesh.bench.soak import Tail
    from mesh.testing.local_peers import cell_of, step

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    lost, held = metrics / "0-1.jsonl", metrics / "1-1.jsonl"
    lost.write_text(json.dumps({"event": "started", "step": 0}) + "\n")
    held.write_text("".join(json.dumps({"step": s, "loss": 2.0}) + "\n" for s in (1, 2, 3)))
    os.utime(lost, ns=(1_000_000_000, 1_000_000_000))  # written first
    tail = Tail(tmp_path)
    assert tail.read()["cell"] == "s1r1" and tail.read()["step"] == 3
    assert cell_of(tmp_path) == (1, 1) and step(tmp_path) == 3
    with held.open("a") as f:
        f.write(json.dumps({"step": 4, "loss": 2.0}) + "\n")
    assert tail.read()["step"] == 4  # the same cell's tail: only what was appended
