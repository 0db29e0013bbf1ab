"""Signed run records: the seal (comms.p2p.auth), the registry's checks, join's one-line
refusals, heartbeat failures counted (the real DHT's round trip: tests/integration/
test_p2p_limits.py), and a keyed run's records in its key's space: what an outsider's records
cost (nothing followed, nothing squatted, each counted; the real DHT and join grid: tests/
integration/test_outsider_flood.py)."""

import logging
import time

import pytest
from fakes import FakeDirectory

from cli.run_record import JoinError, config_of_record, key_verdict, other_key_run
from cli.status import read_status, status_rows
from comms.p2p.auth import CLOCK_SKEW_S, Auth
from mesh.config import load_config
from mesh.runtime.registry import (
    CellRecord,
    Registry,
    RunRecord,
    SessionRecord,
    cell_value,
    session_value,
)
from mesh.runtime.session import DhtCoordinator


def test_key_check_is_bound_to_the_fingerprint_and_the_key():
    checks = {Auth.of(k, fp).key_check for k in ("k", "other", None) for fp in ("fpA", "fpB")}
    assert len(checks) == 6


def test_a_seal_covers_key_subkey_value_and_life():
    auth, now = Auth.of("k", "fp"), time.time()
    sealed = auth.seal("config", "run", {"v": 1, "toml": "x"}, now + 60)
    assert auth.unseal("config", "run", sealed, now) == {"v": 1, "toml": "x", "exp": now + 60}
    # the same dict in another order (as MSGPack may hand it back) still unseals
    assert auth.unseal("config", "run", dict(reversed(sealed.items())), now) is not None
    assert auth.unseal("config", "other", sealed, now) is None
    assert auth.unseal("session.r0", "run", sealed, now) is None
    assert auth.unseal("config", "run", {**sealed, "toml": "y"}, now) is None
    assert auth.unseal("config", "run", {**sealed, "exp": now + 9999}, now) is None  # stretched
    assert Auth.of("other", "fp").unseal("config", "run", sealed, now) is None
    assert Auth.of("k", "fp2").unseal("config", "run", sealed, now) is None
    assert auth.unseal("config", "run", sealed, now + 61 + CLOCK_SKEW_S) is None  # replayed late
    assert auth.unseal("config", "run", {"v": 1, "toml": "x"}, now) is None  # unsigned
    assert auth.unseal("config", "run", {**sealed, "blob": b"\x00"}, now) is None
    assert auth.unseal("config", "run", [1, 2], now) is None


def _cfg():
    return load_config([], ["grid.stages=2", "grid.replicas=1", "model.n_layers=2"])


def test_the_registry_reads_only_records_sealed_with_the_run_key():
    d, cfg = FakeDirectory("[owner:lead]"), _cfg()
    auth = Auth.of("the key", cfg.fingerprint())
    lead = Registry(d, auth, 60.0)
    now = time.time()
    lead.beat(CellRecord("s0r0", "L", 3, now, 0, 5, 1.0, now, lead.token("L")))
    s = SessionRecord(7, 0, 10, {"s0r0": 3})
    assert lead.put_session(0, s)
    reader = Registry(d.joined("[owner:reader]"), auth, 60.0)
    assert list(reader.owners([0])) == ["s0r0"] and reader.session(0, "s0r0") == s
    # an outsider rewrites the values under the members' own subkeys (its DHT node stored
    # them unchecked): a claim with the right membership token, a session that stops the replica
    claim = cell_value(CellRecord("s0r0", "L", 3, now, 0, 99, 1.0, now, lead.token("L")))
    d.data[lead.space + "cells.r0"]["s0r0/L[owner:lead]"] = claim
    stop = session_value(SessionRecord(9, 0, 0, {}, True))
    d.data[lead.space + "session.r0"]["leader[owner:lead]"] = stop
    assert reader.owners([0]) == {} and reader.rejected == 1
    assert reader.session(0, "s0r0") is None
    # sealed with a guessed key: refused as well
    guess = Auth.of("guess", cfg.fingerprint())
    forged = guess.seal("cells.r0", "s0r0/L[owner:lead]", claim, now + 60)
    d.data[lead.space + "cells.r0"]["s0r0/L[owner:lead]"] = forged
    assert reader.owners([0]) == {}
    assert reader.bad_signatures == {"claim": 3, "session": 1}  # session() reads the claims too


def _forged_run(cfg, key_check, sealed_with=None):
    """The run's record as an outsider writes it: the run's config, a key check of its choice,
    sealed with a key of its own (or not at all)."""
    d = FakeDirectory()
    rec = RunRecord(cfg.fingerprint(), cfg.to_toml(), key_check)
    Registry(
        d, None if sealed_with is None else Auth.of(sealed_with, cfg.fingerprint()), 60.0
    ).put_run(rec)
    return Registry(d, None, 60.0).run()


def test_a_joiner_refuses_a_forged_or_unsigned_config_record_in_one_line():
    cfg = _cfg()
    real_check = Auth.of("the key", cfg.fingerprint()).key_check
    for forged in (_forged_run(cfg, real_check), _forged_run(cfg, real_check, "guess")):
        with pytest.raises(JoinError) as e:
            config_of_record(forged, None, [], "the key")
        assert "not signed by the run key" in str(e.value) and "\n" not in str(e.value)
    # a keyless joiner, handed an unsigned record that claims to be keyless: refused too
    unsigned = _forged_run(cfg, Auth.of(None, cfg.fingerprint()).key_check)
    with pytest.raises(JoinError, match="not signed by the run key"):
        config_of_record(unsigned, None, [], None)


def test_a_keyless_join_to_a_keyed_run_is_told_it_needs_a_key():
    cfg = _cfg()
    genuine = _forged_run(cfg, Auth.of("the key", cfg.fingerprint()).key_check, "the key")
    assert key_verdict(genuine, "the key") == "ok"
    assert config_of_record(genuine, None, [], "the key").fingerprint() == cfg.fingerprint()
    with pytest.raises(JoinError, match=r"this run needs a key \(--run-key"):
        config_of_record(genuine, None, [], None)
    with pytest.raises(JoinError, match="run key does not match"):
        config_of_record(genuine, None, [], "another")


class SilentDirectory(FakeDirectory):
    """A DHT that stops taking stores (answers False, or raises) until told otherwise."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.fail: str | None = None

    def dht_store(self, key, subkey, value, ttl_s, timeout_s=None):
        if self.fail == "raise":
            raise ConnectionError("p2pd went away")
        if self.fail == "refuse":
            return False
        return super().dht_store(key, subkey, value, ttl_s, timeout_s)


def test_heartbeat_failures_are_counted_logged_once_and_shown_in_status(caplog):
    d, cfg = SilentDirectory("[owner:c]"), _cfg()
    auth = Auth.of("k", cfg.fingerprint())
    reg = Registry(d, auth, 60.0)  # a long period: no background beat during the test
    coord = DhtCoordinator(
        reg,
        cell="s0r0",
        peer="P",
        replica_cells=["s0r0", "s1r0"],
        leader=True,
        replica=0,
        steps=10,
        mpu=1,
        wait_s=1.0,
    )
    try:
        with caplog.at_level(logging.WARNING, logger="mesh.runtime.session"):
            for mode in ("refuse", "raise", "refuse"):
                d.fail = mode
                coord.heartbeat()
        assert coord.beat_errors == 3
        warned = [r for r in caplog.records if "heartbeat failed" in r.getMessage()]
        assert len(warned) == 1 and "s0r0" in warned[0].getMessage()
        d.fail = None
        coord.heartbeat()  # the next beat that gets through carries the count
        rows = status_rows(Registry(d, auth, 60.0), cfg)
        assert [(c["cell"], c["beat_errors"]) for c in rows["cells"]] == [("s0r0", 3)]
    finally:
        coord._stop.set()


# ---- where a keyed run's records live, and what an outsider's records there cost ----------
def _keyed_run(cfg, key="the key"):
    """A run keyed `key` in a fake DHT: its config record and a member's claim of s0r0."""
    d = FakeDirectory("[owner:lead]")
    auth = Auth.of(key, cfg.fingerprint())
    lead = Registry(d, auth, 60.0)
    assert lead.put_run(RunRecord(cfg.fingerprint(), cfg.to_toml(), auth.key_check))
    now = time.time()
    assert lead.beat(CellRecord("s0r0", "L", 3, now, 0, 5, 1.0, now, lead.token("L")))
    return d, lead


def _unsigned_run(cfg, key="the key"):
    """The run's own config with its key check copied, unsealed: what a squatter stores."""
    check = Auth.of(key, cfg.fingerprint()).key_check
    return {"v": 1, "fingerprint": cfg.fingerprint(), "toml": cfg.to_toml(), "key_check": check}


def test_a_keyed_runs_records_live_where_only_key_holders_can_name_them():
    cfg = _cfg()
    d, lead = _keyed_run(cfg)
    space = lead.space
    assert space.startswith("k") and space.endswith(".") and "the key" not in space
    assert Auth.of("the key", "another fingerprint").space == space  # found before the config
    assert Auth.of("other", cfg.fingerprint()).space != space and Auth.of(None, "fp").space == ""
    assert set(d.data) == {f"{space}config", f"{space}cells.r0", "config"}  # + a public copy
    # a reader without the key (or with another) finds no claim: none to read, none to forge
    assert Registry(d.joined("[owner:x]"), None, 60.0).owners([0]) == {}
    assert (
        Registry(d.joined("[owner:x]"), Auth.of("other", cfg.fingerprint()), 60.0).owners([0]) == {}
    )
    assert list(Registry(d.joined("[owner:r]"), lead.auth, 60.0).owners([0])) == ["s0r0"]


def test_a_keyed_owner_ignores_and_counts_a_squatters_config_records():
    """An unsigned record stored first, where anyone can name it and even in the run's own
    space: the owner's join with --config reads no run and starts its own; once it stored its
    record, that is the one every key holder follows."""
    cfg = _cfg()
    d = FakeDirectory("[owner:squatter]")
    space = Auth.of("the key", cfg.fingerprint()).space
    for where in ("", space):
        assert d.dht_store(where + "config", "run", _unsigned_run(cfg), 600)
    owner = Registry(d.joined("[owner:owner]"), None, 1.0)
    assert owner.run("the key") is None and owner.bad_signatures == {"config": 1}
    local = cfg
    assert config_of_record(None, local, [], "the key") is local  # no run: --config starts one
    auth = Auth.of("the key", cfg.fingerprint())
    Registry(d.joined("[owner:owner]"), auth, 1.0).put_run(
        RunRecord(cfg.fingerprint(), cfg.to_toml(), auth.key_check)
    )
    rec = Registry(d.joined("[owner:joiner]"), None, 1.0).run("the key")
    assert rec is not None and rec.signed_by("the key") and rec.subkey == "run[owner:owner]"
    assert config_of_record(rec, None, [], "the key").fingerprint() == cfg.fingerprint()


def test_a_keyless_joiner_hears_the_run_needs_a_key_past_an_empty_key_forgery():
    cfg = _cfg()
    d, _ = _keyed_run(cfg)
    empty = Auth.of(None, "fp")  # anyone can seal with the empty key
    forged = RunRecord("fp", "x", empty.key_check)
    Registry(d.joined("[owner:forger]"), empty, 60.0).put_run(forged)
    rec = Registry(d.joined("[owner:j]"), None, 60.0).run(None)
    assert rec is not None and rec.subkey == "run[owner:lead]"
    with pytest.raises(JoinError, match=r"this run needs a key \(--run-key"):
        config_of_record(rec, None, [], None)


def test_a_joiner_with_another_key_is_told_so_and_an_owner_starts_beside_it(capsys):
    cfg = _cfg()
    d, _ = _keyed_run(cfg)
    joiner = Registry(d.joined("[owner:j]"), None, 1.0)
    assert joiner.run("another") is None  # its own space is empty
    with pytest.raises(JoinError, match="run key does not match"):
        other_key_run(joiner, "another", starting=False)
    other_key_run(joiner, "another", starting=True)  # its --config starts a run beside it
    assert "starts beside it" in capsys.readouterr().err
    squatted = FakeDirectory("[owner:s]")
    squatted.dht_store("config", "run", _unsigned_run(cfg, "another"), 600)
    other_key_run(Registry(squatted, None, 1.0), "another", starting=False)  # not a run: no word


def test_status_with_the_key_counts_every_config_record_that_does_not_unseal():
    cfg = _cfg()
    d, lead = _keyed_run(cfg)
    outsider = d.joined("[owner:o]")
    outsider.dht_store("config", "run", _unsigned_run(cfg), 600)
    outsider.dht_store(lead.space + "config", "run", _unsigned_run(cfg), 600)
    guess = Auth.of("guess", cfg.fingerprint())
    Registry(outsider, guess, 60.0).put_run(
        RunRecord(cfg.fingerprint(), cfg.to_toml(), guess.key_check)
    )  # its own space, and a copy beside the run's public one
    rows = read_status(d, "the key")
    assert rows["run_key"] == "ok" and [c["cell"] for c in rows["cells"]] == ["s0r0"]
    assert rows["bad_signatures"] == {"config": 3}
    assert read_status(d, None)["bad_signatures"] == {}  # without the key nothing is verified
