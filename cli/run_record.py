"""Which run a joiner follows: the run's config record in the DHT, read again while the DHT
answers empty, checked against the run key (sealed with it, unsigned, missing or wrong) and
against a local --config, and the config it gives (cli/join.py; `status` reads the same)."""

from __future__ import annotations

from pathlib import Path

import click

from mesh.config import (
    LOCAL_PREFIXES,
    LOCAL_SECTIONS,
    Config,
    ConfigError,
    load_config,
    with_overrides,
)
from mesh.runtime.registry import Registry, RunRecord, pick_run, read_again


class JoinError(ConfigError):
    """A join that cannot go on (unreachable DHT, no run, mismatched run, full grid): exit 2."""


def config_of(rec: RunRecord, sets: list[str] = ()) -> Config:
    """The run's config from its DHT record (TOML), with --set overrides on top."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.toml"
        path.write_text(rec.toml)
        return load_config([path], list(sets))


def read_run_record(registry: Registry, reads: int, run_key: str | None = None) -> RunRecord | None:
    """The run's record (Registry.run: with a key, only one sealed with it), read again (a
    second apart) while the DHT answers empty, up to `reads` times: one empty answer from a
    busy DHT would otherwise tell a joiner that there is no run, or let a joiner with --config
    start a second one."""
    return read_again(lambda: registry.run(run_key), reads)


def other_key_run(registry: Registry, run_key: str, starting: bool) -> None:
    """A joiner with a key found no run sealed with it: if the run id's public record says
    its run has another key, a joiner without --config is told the key does not match (exit
    2); one with --config starts its run beside it (its records are apart, in its key's
    space: a record an outsider stored first never stops an owner), and is told so."""
    public = pick_run(registry.runs(), run_key)
    if public is None or key_verdict(public, run_key) != "wrong":
        return  # none, or unsigned (a peer without any key wrote it): not a run to mention
    if not starting:
        raise JoinError(KEY_PROBLEMS["wrong"])
    click.echo(
        f"note: this run id also names a run with another key; this run starts beside it "
        f"(check {KEY_HINT} if you meant to join that one)",
        err=True,
    )


def run_config(
    registry: Registry, local: Config | None, sets: list[str], run_key: str | None
) -> Config:
    """The run's config: the DHT's record, checked against a local --config if one is given.
    With no run yet, the local config starts one."""
    return config_of_record(registry.run(run_key), local, sets, run_key)


KEY_HINT = "--run-key or MESHTRAIN_RUN_KEY"
OPEN_RUN_WARNING = (
    "warning: this run has no run key: anyone who reaches its DHT can join it, download its "
    f"state and average into it (start a run with {KEY_HINT} to keep outsiders out)"
)


def key_verdict(rec: RunRecord, run_key: str | None) -> str:
    """How the run's record stands with run_key: "ok" (sealed with it), "unsigned" (not sealed
    with it, yet claiming it: written by a peer without the key), "missing" (the run has a key,
    none was given) or "wrong" (another key). The seal (registry.RunRecord.signed_by) decides;
    the published key check only tells the three failures apart."""
    from comms.p2p.auth import Auth

    if rec.signed_by(run_key):
        return "ok"
    sealed = isinstance((rec.raw or {}).get("sig"), str)
    if not sealed or Auth.of(run_key, rec.fingerprint).key_check == rec.key_check:
        return "unsigned"
    return "wrong" if run_key else "missing"


KEY_PROBLEMS = {
    "unsigned": "the run's config record is not signed by the run key: refused (a peer without "
    "the key wrote it); check that --initial-peers reach the run you mean",
    "missing": f"this run needs a key ({KEY_HINT}): ask the run's owner for it",
    "wrong": f"the run key does not match this run's ({KEY_HINT}): ask the run's owner for it",
}


def run_key_problem(rec: RunRecord, run_key: str | None) -> str | None:
    """Why this peer cannot follow the run's record with run_key (None: it can)."""
    return KEY_PROBLEMS.get(key_verdict(rec, run_key))


def config_of_record(
    rec: RunRecord | None, local: Config | None, sets: list[str], run_key: str | None
) -> Config:
    """run_config on a record already read (None: no run yet). A record not sealed with our
    run key is refused first (run_key_problem). A local dataset that is not the run's is
    refused naming what differs (the record carries the run's data identity)."""
    from cli.preflight import check_data

    if rec is None:
        if local is None:
            raise JoinError("no run found in the DHT: the first peer passes --config to start one")
        return local
    problem = run_key_problem(rec, run_key)
    if problem is not None:
        raise JoinError(problem)
    try:
        theirs = config_of(rec, sets)
    except ConfigError as e:
        raise JoinError(f"the run's config with your --set: {e}") from None
    if theirs.fingerprint() != rec.fingerprint:
        raise JoinError(
            f"the run's config record does not match its fingerprint {rec.fingerprint}; "
            "a --set of a training key changes it: set only keys of the local sections ("
            f"{', '.join(LOCAL_SECTIONS)}) when joining"
        )
    if local is not None and local.fingerprint() != rec.fingerprint:
        from cli.preflight import changed_keys

        changed = [k for k in changed_keys(local, theirs) if not k.startswith(LOCAL_PREFIXES)]
        if "data.digest" in changed:  # the data's own check says what differs
            check_data(with_overrides(theirs, {"data.path": local.data.path}), run_data=rec.data)
        raise JoinError(
            f"config fingerprint {local.fingerprint()} differs from the run's {rec.fingerprint} "
            f"({', '.join(changed) or 'settings'}): drop --config (the run's own config is "
            "used) or use the run's exact settings"
        )
    return theirs
