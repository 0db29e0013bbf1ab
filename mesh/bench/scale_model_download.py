"""The state download of `meshtrain bench scale-model`: a donor and a joiner process of one
stage on 127.0.0.1 (torch backend), the joiner's state replaced by the donor's through
mesh.runtime.state_sync; time, both ends' peak RSS over their own cell, and the result checked
bit for bit (a digest of every state tensor, computed on both ends).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import tempfile
import threading
import time
from typing import Any

import torch

DONOR, JOINER = "s0r0", "s0r1"
TIMEOUT_S = 120.0


def state_digest(cell: Any) -> str:
    """blake2b of weights, drift and every optimizer tensor and number, in key order."""
    h = hashlib.blake2b(digest_size=16)
    for t in (cell.flat, cell.drift):
        h.update(t.contiguous().view(torch.uint8).numpy())
    for key, v in sorted(cell.optimizer.state_dict().items()):
        h.update(key.encode())
        if isinstance(v, torch.Tensor):
            h.update(v.contiguous().view(torch.uint8).numpy())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def _peer(role: str, preset: str, stage: int, rz: dict[str, Any], spool: str, conn: Any) -> None:
    from comms.build import make_transport
    from mesh.bench.stage_probe import build_cell, peak_rss_bytes, reset_peak_rss, rss_bytes
    from mesh.runtime.state_sync import StateServer, download_state

    try:
        cfg, cell = build_cell(preset, stage)
        if role == "donor":  # a state no fresh cell has: a few updates' worth of change
            cell.flat.add_(1e-3)
            cell.drift.fill_(2e-4)
            cell.step = 1234
        t = make_transport("torch", role_name(role), [DONOR, JOINER], {}, rz, timeout_s=TIMEOUT_S)
        reset_peak_rss()
        base = rss_bytes()
        out: dict[str, Any] = {}
        if role == "donor":
            server = StateServer(t, cell, threading.Lock(), [JOINER], spool_dir=spool)
            from comms.wire import Expect

            t.recv(JOINER, "bench/done", Expect(), 10 * TIMEOUT_S)
            server.close()
            out["chunks_served"] = server.chunks_served
        else:
            from comms import codecs
            from comms.wire import Kind

            t0 = time.perf_counter()
            got = download_state(t, cell, [DONOR], TIMEOUT_S, staging_dir=spool)
            out["download_s"] = time.perf_counter() - t0
            out["download_ok"] = bool(got)
            out["reason"] = got.reason
            out["step"] = cell.step
            t.send(DONOR, "bench/done", Kind.CONTROL, codecs.encode(torch.zeros(1), "fp32"), 0)
        out["peak_extra_bytes"] = peak_rss_bytes() - base
        out["peak_bytes"] = peak_rss_bytes()
        out["digest"] = state_digest(cell)
        t.close()
        conn.send(("ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("error", f"{role}: {type(e).__name__}: {e}"))


def role_name(role: str) -> str:
    return DONOR if role == "donor" else JOINER


def measure_download(preset: str, stage: int) -> dict[str, Any]:
    """Both ends in their own processes; the row's download_* and *_peak_bytes fields."""
    from comms.build import local_rendezvous

    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {}
    with local_rendezvous("torch") as rz, tempfile.TemporaryDirectory(prefix="mt-spool-") as spool:
        procs, pipes = {}, {}
        for role in ("donor", "joiner"):
            parent, child = ctx.Pipe(duplex=False)
            procs[role] = ctx.Process(target=_peer, args=(role, preset, stage, rz, spool, child))
            procs[role].start()
            child.close()
            pipes[role] = parent
        for role in ("joiner", "donor"):
            if not pipes[role].poll(20 * TIMEOUT_S):
                raise RuntimeError(f"the {role} of the download did not answer")
            status, value = pipes[role].recv()
            if status != "ok":
                raise RuntimeError(value)
            results[role] = value
        for p in procs.values():
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
    donor, joiner = results["donor"], results["joiner"]
    n_state = planned_state_bytes(preset, stage)
    return {
        "download_s": joiner["download_s"],
        "download_ok": joiner["download_ok"] and joiner["digest"] == donor["digest"],
        "download_reason": joiner["reason"],
        "download_chunks": donor["chunks_served"],
        "joiner_peak_bytes": joiner["peak_bytes"],
        "donor_peak_bytes": donor["peak_bytes"],
        "joiner_extra_bytes": joiner["peak_extra_bytes"],
        "donor_extra_bytes": donor["peak_extra_bytes"],
        "joiner_vs_state": joiner["peak_bytes"] / n_state,
    }


def planned_state_bytes(preset: str, stage: int) -> int:
    """What a download carries (weights, drift, optimizer), from plan (no memory)."""
    from mesh.bench.stage_probe import bench_config
    from mesh.engine.plan import plan_cell

    plan = plan_cell(bench_config(preset), stage)
    return plan.weights_bytes + plan.drift_bytes + plan.optimizer_bytes
