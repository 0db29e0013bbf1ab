"""`meshtrain status`: the grid as the DHT sees it, and whether this user can verify it.

A claim counts only with a membership token made with the run key (mesh/runtime/registry.py).
A keyed run's claims live in its key's space (comms.p2p.auth.records_space): without the key (or
with another one) status cannot read them, shows none and no free cell, and says which key is
missing. Claims it can read but not verify (a run whose record is forged) are shown marked
unverified, never as free cells (a cell is free only when nobody claims it). A read that gets
no answer (or a reply trimmed by a flood, comms.p2p.bounds) fails the status: it is never taken
for free cells. Records that do not unseal with the given key are counted by kind
(`bad_signatures`: config, claim, session). Sessions are named by their start time, not by the
raw wall-clock-ms epoch the leaders write.

imports: cli.join, mesh (config, registry), comms.p2p.auth, stdlib.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from cli.run_record import KEY_HINT, JoinError, config_of, key_verdict
from comms.p2p.auth import Auth
from mesh.algo.topology import Grid, stage_of
from mesh.config import Config, ConfigError
from mesh.runtime.dashboard.rundir import tokens_per_step
from mesh.runtime.registry import (
    CellRecord,
    Registry,
    RunRecord,
    free_cells,
    pick_run,
    running,
)

if TYPE_CHECKING:
    from comms.transport import Directory

READ_TIMEOUT_S = 5.0  # a status that waits a little longer beats one that misreads the grid
# a cell the first read finds free is read again this much later before it is called free: a
# claim's store may not have reached the nodes the first read asked (16 joins 1 s apart once
# showed 7 held cells as free)
FREE_REREAD_S = 1.0

KEY_OK, KEY_MISSING, KEY_WRONG, KEY_UNKNOWN = "ok", "missing", "wrong", "unknown"
KEY_UNSIGNED = "unsigned"


def key_state(rec: RunRecord | None, run_key: str | None) -> str:
    """ok: the record is sealed with the key (or neither has one); missing: the run has a key
    and none was given; wrong: another key; unsigned: the record is not sealed with the key it
    claims (forged); unknown: no run record to check it against (cli.join.key_verdict)."""
    return KEY_UNKNOWN if rec is None else key_verdict(rec, run_key)


def age_label(seconds: float) -> str:
    """A duration for people: 42 s, 3 min 05 s, 2 h 07 min."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def session_label(epoch_ms: int, now_s: float) -> str:
    """A replica session by its start (the epoch is the leader's wall clock in ms)."""
    if epoch_ms <= 0:
        return "none yet"
    start_s = epoch_ms / 1000
    clock = time.strftime("%H:%M:%S", time.localtime(start_s))
    return f"{clock} ({age_label(now_s - start_s)} ago)"


def status_rows(
    registry: Registry | None,
    cfg: Config | None,
    key: str = KEY_OK,
    now: float | None = None,
    reread_s: float | None = None,
) -> dict[str, Any]:
    """The grid as the DHT sees it: one row per claimed cell, and the free cells (claimed by
    nobody). With key != ok the registry has no Auth: every row is marked unverified. No
    registry: the claims cannot be read (a keyed run, without its key): no rows, no free cell.
    reread_s: cells the read finds free are read again that much later (confirmed_owners);
    None: one read (a dashboard's next poll reads again anyway)."""
    now = time.time() if now is None else now
    if registry is None:
        owned: dict[str, CellRecord] | None = {}
    elif cfg is None:
        owned = registry.probe_owners()
    else:
        owned = registry.owners(range(cfg.grid.replicas))
        if owned is not None and reread_s is not None:
            owned = confirmed_owners(registry, cfg, owned, reread_s)
    if owned is None:
        raise JoinError("the DHT did not answer (the grid cannot be read); try again")
    verified = key == KEY_OK
    cells = [
        {
            "cell": name,
            "peer": rec.peer,
            "verified": verified,
            "step": rec.step,
            "tokens_per_s": round(rec.tps, 1),
            "heartbeat_age_s": round(now - rec.t, 1),
            "session": rec.epoch,
            "session_age_s": round(now - rec.epoch / 1000, 1) if rec.epoch > 0 else None,
            "since": rec.since,  # claim time (wall clock)
            "running": running(rec),  # False: a join's placeholder claim, its cell not up yet
            "signer": rec.signer,  # the claim's owner marker (what a withdrawal is checked by)
            **stats_json(rec.stats),
        }
        for name, rec in sorted(owned.items())
    ]
    grid, data = None, None
    free: list[str] = []
    if cfg is not None:
        P, m = cfg.grid.stages, cfg.grid.replicas
        grid = f"{P}x{m}"
        data = {"path": cfg.data.path, "digest": cfg.data.digest}
        if registry is not None:
            free = free_cells(Grid(P, m).names(), owned)
    pools = pool_rows(owned, P) if cfg is not None and cfg.pipeline.pooled else None
    withdrawn = {} if registry is None else registry.withdrawn
    return {
        "pools": pools,
        "run_key": key,
        "grid": grid,
        "data": data,
        "cells": cells,
        "free": free,
        # free cells whose last owner withdrew its claim lately (a clean stop), by signer; a
        # free cell not here expired (its peer vanished) or was never held
        "released": {c: sorted(withdrawn[c]) for c in free if c in withdrawn},
        "claims_readable": registry is not None,
        "rejected_claims": 0 if registry is None else registry.rejected,
        # records that did not unseal with the run's key, by kind (config, claim, session)
        "bad_signatures": {} if registry is None else dict(registry.bad_signatures),
    }


def confirmed_owners(
    registry: Registry, cfg: Config, owned: dict[str, CellRecord], reread_s: float
) -> dict[str, CellRecord]:
    """owned, and the claims a second read reread_s later finds for cells the first found
    free: a cell is free only when both reads find nobody holding it. A second read that gets
    no answer leaves the first as it was. The records it refuses are the first read's again:
    they are counted once."""
    if not free_cells(Grid(cfg.grid.stages, cfg.grid.replicas).names(), owned):
        return owned
    time.sleep(reread_s)
    counted = registry.rejected, registry.bad_signatures.copy()
    again = registry.owners(range(cfg.grid.replicas))
    registry.rejected, registry.bad_signatures = counted
    return owned if again is None else {**again, **owned}


def pool_rows(owned: dict[str, CellRecord], stages: int) -> list[dict[str, Any]]:
    """Each stage's pool as the claims show it: its running cells, their summed capacity (a
    pooled cell's heartbeat `tps` is what it could compute) and the share of the microbatches
    its cells sent on that went to another replica's cell."""
    out = []
    for j in range(stages):
        recs = [r for c, r in owned.items() if running(r) and stage_of(c) == j]
        routed = sum((r.stats or {}).get("routed", 0) for r in recs)
        cross = sum((r.stats or {}).get("cross", 0) for r in recs)
        out.append(
            {
                "stage": j,
                "cells": len(recs),
                "capacity_tps": round(sum(r.tps for r in recs), 1),
                "cross_replica_share": round(cross / routed, 3) if routed else None,
            }
        )
    return out


def stats_json(stats: dict[str, Any] | None) -> dict[str, Any]:
    """A heartbeat's counters (claim_stats.parse_stats) as status --json shows them; a peer of an
    older version sends none: null."""
    stats = stats or {}
    rounds = stats.get("rounds")
    return {
        "rounds": dict(zip(("applied", "partial", "failed"), rounds)) if rounds else None,
        "rejects": stats.get("rejects"),
        # heartbeats of this cell the DHT did not take: a persistent failure expires its claim
        "beat_errors": stats.get("beat_errors", 0),
        # neighbours whose pipeline tensors this cell's sentinel flagged (sentinel.enabled)
        "flagged": stats.get("flagged", []),
        "loss": stats.get("loss"),
        "bytes_sent": stats.get("bytes"),
        # reached through a relay (join --client-mode: behind NAT; docs/wan.md)
        "relayed": bool(stats.get("relayed")),
    }


def read_run(reader: Registry, run_key: str | None) -> RunRecord | None:
    """The run's record as status sees it: with a key, the first sealed with it in the key's
    space, else (for its key state) pick_run at the public `config`. With a key, every record
    of either place that does not unseal with it is counted in reader.bad_signatures."""
    public = reader.run_records("")
    own = reader.sealed_runs(run_key) if run_key else []
    if public is None or own is None:
        raise JoinError("the DHT did not answer (the run's record cannot be read); try again")
    if run_key:
        reader.forged_runs(sum(not r.signed_by(run_key) for r in public))
    return next(iter(own), None) or pick_run(public, run_key)


def read_status(
    directory: Directory, run_key: str | None, reread_s: float | None = FREE_REREAD_S
) -> dict[str, Any]:
    """The run's record, the key's state and the grid, read through a DHT client (reread_s:
    status_rows')."""
    # a Registry's reads wait 2 x heartbeat_s
    reader = Registry(directory, None, READ_TIMEOUT_S / 2, run_key=run_key)
    rec = read_run(reader, run_key)
    cfg = None
    if rec is not None:
        try:
            cfg = config_of(rec)
        except ConfigError:  # a record this version cannot read: the claims still can be
            cfg = None
    key = key_state(rec, run_key)
    registry: Registry | None = reader  # claims in our key's space, unverified
    if key == KEY_OK:
        registry = Registry(directory, Auth.of(run_key, rec.fingerprint), READ_TIMEOUT_S / 2)
    elif key in (KEY_MISSING, KEY_WRONG):  # a keyed run, not ours to read
        registry = None
    rows = status_rows(registry, cfg, key, reread_s=reread_s)
    if registry is not reader:  # with the config records' count
        for kind, n in reader.bad_signatures.items():
            rows["bad_signatures"][kind] = rows["bad_signatures"].get(kind, 0) + n
    rows["run"] = None if rec is None else {"fingerprint": rec.fingerprint}
    if cfg is not None:
        rows["run"].update(heartbeat_s=cfg.elastic.heartbeat_s, steps=cfg.run.steps)
        rows["tokens_per_step"] = tokens_per_step(cfg)  # per replica: the loss curves' x
    return rows


def key_error(key: str) -> str | None:
    """The line that explains a key state other than ok (None: nothing to explain)."""
    unverified = "claims cannot be verified: any above are marked unverified, not free"
    unreadable = "its claims are readable only with its key (none shown, none taken as free)"
    if key == KEY_MISSING:
        return f"this run has a run key and none was given ({KEY_HINT}): " + unreadable
    if key == KEY_WRONG:
        return f"the run key does not match this run's ({KEY_HINT}): " + unreadable
    if key == KEY_UNSIGNED:
        return "the run's config record is not signed by the run key (forged): " + unverified
    return None


def status_table(rows: dict[str, Any], now: float | None = None) -> list[list[str]]:
    now = time.time() if now is None else now
    return [
        [
            (c["cell"] if c["verified"] else f"{c['cell']} (unverified)")
            + (" (relayed)" if c.get("relayed") else "")
            + (f" (flagged {', '.join(c['flagged'])})" if c.get("flagged") else ""),
            c["peer"][:12] + "...",
            str(c["step"]),
            f"{c['tokens_per_s']:,.0f}",
            f"{c['heartbeat_age_s']:.1f} s ago"
            + (f" ({c['beat_errors']} failed)" if c.get("beat_errors") else ""),
            session_label(c["session"], now),
        ]
        for c in rows["cells"]
    ]


def data_label(data: dict[str, Any] | None) -> str:
    """The run's data for the status line: a prepared dataset by its digest (what every peer
    must hold), a text by its path."""
    if data is None:
        return "unknown"
    if data.get("digest"):
        return f"dataset {data['digest'][:16]} ({data['path']})"
    return f"text {data['path']}" if data.get("path") else "the default corpus"


STATUS_HEADERS = ["cell", "peer", "step", "tokens/s", "heartbeat", "session since"]
