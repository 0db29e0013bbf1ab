"""What `join` and `status` tell people: multiaddr syntax, unverified claims, session names,
whom a replica waits for, and the lines a join prints for its cell's events."""

import time

import pytest
from click.testing import CliRunner
from fakes import FakeDirectory

import mesh.runtime.session as session_mod
from cli.events import EventLines, event_line
from cli.join import JoinError, open_scout
from cli.main import main
from cli.reach import EXAMPLE_MADDR, maddr_problem
from cli.status import age_label, key_error, key_state, read_status, session_label
from comms.errors import PeerTimeout
from comms.p2p.auth import Auth
from mesh.config import load_config
from mesh.runtime.registry import CLAIMING, CellRecord, Registry, RunRecord
from mesh.runtime.session import DhtCoordinator, waiting_for

ID = "12D3KooWLmVKHJP3ztkbN8zXcZfBDMfZ9Go9tJ2ZeFmGyZ3M6fr5"
QM = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


# ---- multiaddr syntax ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "maddr",
    [
        EXAMPLE_MADDR,
        f"/ip4/127.0.0.1/tcp/31337/p2p/{ID}",
        f"/ip6/::1/tcp/4001/p2p/{QM}",
        f"/dns4/boot.example.org/tcp/31337/p2p/{QM}",
        f"/ip4/1.2.3.4/udp/4001/quic-v1/p2p/{ID}",
        f"/ip4/1.2.3.4/tcp/4001/p2p/{QM}/p2p-circuit/p2p/{ID}",
    ],
)
def test_well_formed_multiaddrs_pass(maddr):
    assert maddr_problem(maddr) is None


@pytest.mark.parametrize(
    ("maddr", "why"),
    [
        ("127.0.0.1:31337", "HOST:PORT is not a multiaddr"),
        ("localhost:31337", "HOST:PORT is not a multiaddr"),
        ("/ip4/127.0.0.1/tcp/31337", "no /p2p/PEER_ID part"),
        (f"/ip4/127.0.0.1/tcp/70000/p2p/{ID}", "port must be a number from 1 to 65535"),
        (f"/ip4/127.0.0.1/tcp/0/p2p/{ID}", "port must be a number from 1 to 65535"),
        (f"/ip4/127.0.0.1/tcp/http/p2p/{ID}", "port must be a number"),
        (f"/ip4/300.0.0.1/tcp/31337/p2p/{ID}", "not an IPv4 address"),
        (f"/ip4/127.0.0.1/31337/p2p/{ID}", "expected /tcp/PORT or /udp/PORT"),
        (f"/tcp/31337/ip4/127.0.0.1/p2p/{ID}", "expected /ip4, /ip6"),
        ("/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...", "not a peer ID"),  # the README's
        (f"/ip4/127.0.0.1/tcp/31337/p2p/{ID}/tcp", "must end with /p2p/PEER_ID"),
    ],
)
def test_malformed_multiaddrs_say_what_is_wrong(maddr, why):
    assert why in maddr_problem(maddr)


def test_a_malformed_multiaddr_is_refused_before_any_daemon_with_the_right_form():
    with pytest.raises(JoinError, match="e.g. /ip4/203.0.113.5/tcp/31337/p2p/"):
        open_scout([EXAMPLE_MADDR, "127.0.0.1:31337"], "run")
    runner = CliRunner()
    for command in ("join", "status"):
        res = runner.invoke(main, [command, "--initial-peers", "/ip4/127.0.0.1/tcp/31337"])
        assert res.exit_code == 2, res.output
        assert "no /p2p/PEER_ID part" in res.output and EXAMPLE_MADDR in res.output


# ---- status: the key, unverified claims, sessions -----------------------------------------
def _run_with_a_claim(key: str | None):
    """A DHT holding a 2x1 run keyed `key`, s0r0 claimed by a member, s1r0 by nobody."""
    cfg = load_config([], ["grid.stages=2", "grid.replicas=1", "model.n_layers=2"])
    d = FakeDirectory()
    auth = Auth.of(key, cfg.fingerprint())
    Registry(d, auth, 60.0).put_run(RunRecord(cfg.fingerprint(), cfg.to_toml(), auth.key_check))
    member = Registry(d.joined("[owner:member]"), auth, 60.0)
    now = time.time()
    member.beat(CellRecord("s0r0", "peer0", 7, now, 0, 12, 3.0, now, member.token("peer0")))
    return d, cfg


def _stored_run(key):
    """The run record of a run keyed `key`, as a reader gets it back from the DHT."""
    d, auth = FakeDirectory(), Auth.of(key, "fp")
    Registry(d, auth, 60.0).put_run(RunRecord("fp", "", auth.key_check))
    return Registry(d, None, 60.0).run()


def test_key_states():
    rec = _stored_run("k")
    assert key_state(rec, "k") == "ok"
    assert key_state(rec, None) == key_state(rec, "") == "missing"
    assert key_state(rec, "other") == "wrong"
    assert key_state(_stored_run(None), None) == "ok"
    assert key_state(RunRecord("fp", "", Auth.of(None, "fp").key_check), None) == "unsigned"
    assert key_state(None, "k") == "unknown"
    assert key_error("ok") is None and key_error("unknown") is None
    assert "MESHTRAIN_RUN_KEY" in key_error("missing") and "--run-key" in key_error("wrong")
    assert "not signed by the run key" in key_error("unsigned")


@pytest.mark.parametrize(("given", "state"), [(None, "missing"), ("another", "wrong")])
def test_status_without_the_key_reads_no_claims_and_no_free_cell(given, state):
    d, _ = _run_with_a_claim("the key")
    rows = read_status(d, given)
    assert rows["run_key"] == state and rows["grid"] == "2x1"
    # the claims live in the key's space: not readable, and never taken for free cells
    assert rows["cells"] == [] and rows["free"] == [] and rows["claims_readable"] is False
    assert "readable only with its key" in key_error(state)


def test_status_of_an_open_run_without_a_key_reads_its_claims():
    d, _ = _run_with_a_claim(None)
    rows = read_status(d, None)
    assert rows["run_key"] == "ok" and rows["free"] == ["s1r0"]
    assert [(c["cell"], c["verified"], c["step"]) for c in rows["cells"]] == [("s0r0", True, 12)]


def test_status_with_the_key_verifies_claims_and_ignores_forged_ones():
    d, cfg = _run_with_a_claim("the key")
    forger = Registry(d.joined("[owner:forger]"), Auth.of("guess", "x"), 60.0)
    # an outsider that learned the DHT key the run's claims live under (a node on their path)
    forger.space = Auth.of("the key", cfg.fingerprint()).space
    now = time.time()
    forger.beat(CellRecord("s1r0", "mallory", 5, now, 0, 0, 0.0, now, forger.token("mallory")))
    rows = read_status(d, "the key")
    assert rows["run_key"] == "ok"
    assert [(c["cell"], c["verified"]) for c in rows["cells"]] == [("s0r0", True)]
    assert rows["free"] == ["s1r0"] and rows["rejected_claims"] == 1
    assert rows["bad_signatures"] == {"claim": 1}


def test_status_says_when_the_dht_does_not_answer():
    d, _ = _run_with_a_claim(None)
    d.answer = False
    with pytest.raises(JoinError, match="did not answer"):
        read_status(d, None)


def test_sessions_are_named_by_their_start():
    start = time.mktime((2026, 1, 2, 13, 4, 5, 0, 0, -1))
    assert session_label(int(start * 1000), start + 65) == "13:04:05 (1 min 05 s ago)"
    assert session_label(0, start) == "none yet"
    assert age_label(42.7) == "42 s" and age_label(3 * 3600 + 7 * 60) == "3 h 07 min"


# ---- whom a replica waits for ---------------------------------------------------------------
def _coordinator(d, cell, leader, events, wait_s=60.0):
    reg = Registry(d.joined(f"[owner:{cell}-{len(d.data)}]"), None, 60.0)  # no background beats
    c = DhtCoordinator(
        reg,
        cell=cell,
        peer=f"peer-{cell}",
        replica_cells=["s0r0", "s1r0"],
        leader=leader,
        replica=0,
        steps=100,
        mpu=1,
        wait_s=wait_s,
    )
    c.on_event = lambda name, **fields: events.append((name, fields))
    return c


def test_waiting_for_names_free_and_starting_cells_but_never_the_asker():
    placeholder = CellRecord("s1r0", "scout", CLAIMING, 1.0, 0, -1, 0.0, 1.0, None)
    cells = ["s0r0", "s1r0", "s2r0"]
    assert waiting_for(cells, {"s1r0": placeholder}, "s0r0") == {"s1r0": "joining", "s2r0": "free"}
    assert waiting_for(cells, {}, "s2r0") == {"s0r0": "free", "s1r0": "free"}


def test_a_lone_cell_says_whom_it_waits_for_once(monkeypatch):
    monkeypatch.setattr(session_mod, "REPORT_EVERY_S", 0.0)
    events = []
    lead = _coordinator(FakeDirectory(), "s0r0", True, events, wait_s=0.6)
    with pytest.raises(PeerTimeout):
        lead.next_session(lambda: 0)
    assert events == [("waiting", {"replica": 0, "waiting_for": {"s1r0": "free"}})]


def test_a_neighbour_that_lost_its_partner_says_it_waits_and_for_whom():
    d = FakeDirectory()
    events = []
    lead = _coordinator(d, "s0r0", True, [])
    follow = _coordinator(d, "s1r0", False, events)
    s = lead.next_session(lambda: 0)
    assert follow.next_session(lambda: 0) == s
    assert events == [("session", {"replica": 0, "epoch": s.epoch, "members": ["s0r0", "s1r0"]})]
    events.clear()
    follow._watch()
    assert events == []  # everyone is there
    lead.reg.release("s0r0", lead.peer)  # the leader is gone (its claim expired)
    follow._watch()
    assert events == []  # one read may miss a claim: not yet
    follow._watch()
    assert events == [("waiting", {"replica": 0, "waiting_for": {"s0r0": "free"}})]
    follow._watch()
    assert len(events) == 1  # said once


# ---- the lines a join prints ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("row", "line"),
    [
        (
            {"event": "waiting", "step": 0, "replica": 0, "waiting_for": {"s1r0": "free"}},
            "waiting for s1r0 (free) to start replica 0",
        ),
        (
            {"event": "waiting", "replica": 1, "waiting_for": {"s2r1": "joining", "s0r1": "free"}},
            "waiting for s0r1 (free), s2r1 (joining) to start replica 1",
        ),
        (
            {"event": "resumed", "step": 40, "from": "checkpoint", "checkpoint": "c/step.pt"},
            "resumed from my checkpoint at step 40 (c/step.pt)",
        ),
        (
            {"event": "state_loaded", "step": 90, "from_cell": "s1r1", "from_peer": ID},
            "loaded state from s1r1 (peer 12D3KooWLmVK...6fr5) at step 90",
        ),
        ({"event": "state_loaded", "step": 9}, "loaded state from a live peer at step 9"),
        (
            {"event": "session", "step": 7, "replica": 0, "members": ["s0r0", "s1r0"]},
            "replica 0 formed (s0r0, s1r0): training from step 7",
        ),
        (
            {"event": "session_broken", "step": 398},
            "replica 0 stopped at step 398: a neighbour left or was replaced",
        ),
        (
            {"event": "saved", "step": 5, "checkpoint": "b/step.pt", "released": True},
            "checkpoint saved to b/step.pt, released s1r0",
        ),
        ({"event": "stopped", "step": 5, "rejects": {}}, None),
    ],
)
def test_event_lines(row, line):
    assert event_line(row, "s1r0") == line


def test_a_release_that_failed_is_not_claimed():
    line = event_line({"event": "saved", "checkpoint": "x.pt", "released": False}, "s1r0")
    assert line.startswith("checkpoint saved to x.pt;") and "could not release s1r0" in line


def test_events_of_an_earlier_run_in_the_same_directory_are_not_said_again():
    old = [{"event": "saved", "checkpoint": "old.pt", "released": True}, {"step": 3, "loss": 1}]
    lines = EventLines(old, "s0r0")
    said = []
    new = {"event": "resumed", "step": 3, "checkpoint": "old.pt"}
    lines.say_new([*old, new], said.append)
    lines.say_new([*old, new], said.append)
    assert said == ["resumed from my checkpoint at step 3 (old.pt)"]


def test_an_empty_answer_of_a_busy_dht_is_read_again_before_there_is_no_run():
    from cli.join import read_run_record

    class EmptyOnce(FakeDirectory):
        def __init__(self):
            super().__init__()
            self.gets = 0

        def dht_get(self, key, timeout_s=None):
            self.gets += 1
            return None if self.gets == 1 else super().dht_get(key, timeout_s)

    d = EmptyOnce()
    cfg = load_config()
    check = Auth.of(None, cfg.fingerprint()).key_check
    Registry(d, None, 1.0).put_run(RunRecord(cfg.fingerprint(), cfg.to_toml(), check))
    rec = read_run_record(Registry(d, None, 1.0), reads=3)
    assert rec is not None and rec.fingerprint == cfg.fingerprint() and d.gets == 2
    nothing = FakeDirectory()
    assert read_run_record(Registry(nothing, None, 1.0), reads=2) is None


def test_the_progress_reads_only_what_was_appended(tmp_path):
    """`join`'s progress bar tails its metrics file: each read parses the new complete lines
    only (re-parsing the whole file every half second grew the process for the run's life),
    and the events among them are said once."""
    from mesh.runtime.metrics import RowTail

    path = tmp_path / "0-0.jsonl"
    path.write_text('{"event": "started", "step": 0, "pid": 1, "host": "h"}\n')
    tail, said = RowTail(path, path.stat().st_size), []
    lines = EventLines([{"event": "started", "step": 0}], "s0r0")
    assert tail.read() == []
    with path.open("a") as f:
        f.write('{"step": 1, "loss": 4.0}\n{"event": "session_broken", "step": 1}\n{"step": 2,')
    rows = tail.read()
    assert [r.get("step") for r in rows] == [1, 1]  # the half-written line waits
    lines.say_appended(rows, said.append)
    assert len(said) == 1 and "stopped at step 1" in said[0]
    with path.open("a") as f:
        f.write(' "loss": 3.5}\n')
    assert tail.read() == [{"step": 2, "loss": 3.5}]
    lines.say_new([{"event": "started"}, {"event": "session_broken", "step": 1}], said.append)
    assert len(said) == 1  # the whole file read at the end says nothing twice


@pytest.mark.slow
def test_a_claim_reads_a_silent_dht_again_before_it_gives_up(monkeypatch):
    import cli.join as join

    class SilentTwice(FakeDirectory):
        def dht_get(self, key, timeout_s=None):
            found = super().dht_get(key, timeout_s)  # counts the read
            return None if key == "cells.r0" and self.reads[key] <= 2 else found

    monkeypatch.setattr(join, "CLAIM_SETTLE_S", 0.0)
    cfg = load_config([], ["grid.stages=2", "grid.replicas=1"])
    d = SilentTwice()
    j, i, _ = join.claim_cell(Registry(d, None, 1.0), cfg, "me", None)
    assert (j, i) == (0, 0) and d.reads["cells.r0"] >= 3
    # a DHT that never answers: the join says so (after CLAIM_READS reads), claims nothing
    d = FakeDirectory()
    d.answer = False
    with pytest.raises(join.JoinError, match="does not answer"):
        join.claim_cell(Registry(d, None, 1.0), cfg, "me", None)
    assert d.reads["cells.r0"] == join.CLAIM_READS and "cells.r0" not in d.data


def test_a_join_that_lost_its_cell_too_often_gives_up_with_a_message(monkeypatch):
    """A join whose cell another peer holds starts over by itself (os.execv of its own command
    line) to take another free cell; after REJOINS_MAX starts it exits 2 saying so."""
    import cli.rejoin as join

    monkeypatch.setenv(join.REJOINS_ENV, str(join.REJOINS_MAX))
    code, text = join.rejoin("s1r0 is held by peer X (claimed at the same time, earlier)")
    assert code == 2 and "lost a cell" in text and "s1r0 is held by peer X" in text


def test_a_join_that_lost_its_cell_starts_its_own_command_line_over(monkeypatch, capsys):
    """Below REJOINS_MAX: the note a bench counts (REJOIN_NOTE), the count in the environment
    the new process inherits, and the same interpreter and arguments (os.execv stands in: the
    real one would replace the test process)."""
    import os
    import sys

    import cli.rejoin as join
    from mesh.runtime.session import REJOIN_NOTE

    calls = []

    def execv(path, argv):
        calls.append((path, argv))
        raise SystemExit(0)

    monkeypatch.setenv(join.REJOINS_ENV, "1")
    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(SystemExit):
        join.rejoin("s1r0 is held by peer X")
    # `python -m cli.main` and this process's arguments: what `meshtrain join ...` ran, also
    # where it was forked from a fork server (whose own command line sys.orig_argv would be)
    assert calls == [(sys.executable, [sys.executable, "-m", "cli.main", *sys.argv[1:]])]
    assert os.environ[join.REJOINS_ENV] == "2"
    assert f"s1r0 is held by peer X: {REJOIN_NOTE}" in capsys.readouterr().out


def test_a_rebalanced_join_starts_over_in_the_thinnest_stage(monkeypatch, capsys):
    """elastic.rebalance: the stage travels in the environment to the new process, where it
    overrides --stage once (the move was decided after the command line was written)."""
    import os
    import sys

    import cli.rejoin as join

    calls = []

    def execv(path, argv):
        calls.append((path, argv))
        raise SystemExit(0)

    monkeypatch.delenv(join.MOVE_ENV, raising=False)
    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(SystemExit):
        join.move_to(1)
    assert calls == [(sys.executable, [sys.executable, "-m", "cli.main", *sys.argv[1:]])]
    assert "moving to stage 1" in capsys.readouterr().out
    assert join.moved_stage(0) == 1 and join.MOVE_ENV not in os.environ
    assert join.moved_stage(0) == 0 and join.moved_stage(None) is None


def test_join_and_status_check_their_arguments_before_importing_torch():
    """A mistyped --initial-peers is told in well under a second, not after torch's import
    (seconds on a loaded box): the commands' modules import neither torch nor hivemind."""
    import subprocess
    import sys

    code = (
        "import sys, cli.join, cli.status; print(sorted({'torch', 'hivemind'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
