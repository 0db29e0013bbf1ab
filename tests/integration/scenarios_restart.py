"""The restart scenario of the transport suite (torch): a peer killed mid-run comes back as a
new process (a new incarnation, harness.py's "restart" fault) and forms its links with the
survivors again, while their links with each other never broke.

Every round's mean is compared with the one-process reference of the members that should have
contributed, as in scenarios.group_mean.
"""

from __future__ import annotations

import time

import torch
from harness import RESPAWN
from scenarios import ROUND_WAIT_S, digest, link_end, reference_mean, tensor

from comms import codecs
from comms.errors import PeerLost
from comms.wire import Expect, Kind


def rejoin(t, peer, victim: str, numel: int = 20_000, codec: str = "fp8_e4m3") -> dict:
    """Round 0 with everyone; the victim is killed; the survivors see its link lost, run
    rounds 1 and 2 among themselves and talk to each other; the victim starts again; messages
    go both ways between it and each survivor; round 3 with everyone."""
    members = peer.groups["g"]
    survivors = [m for m in members if m != victim]
    wait = peer.timeout_s

    def mean(round_id: int, who: list[str]) -> dict:
        def vals(m: str) -> torch.Tensor:
            return tensor(3000 + 10 * round_id + members.index(m), (numel,))

        h = t.start_mean("g", members, round_id, vals(peer.name), codec, wait)
        res = h.result(wait + 2)
        ref = reference_mean([codecs.roundtrip(vals(m), codec) for m in who])
        ok = res.mean is not None
        return {
            "status": res.status.value,
            "reason": res.reason,
            "contributors": list(res.contributors),
            "equal_ref": ok and bool(torch.equal(res.mean, ref)),
            "digest": digest(res.mean) if ok else None,
        }

    x = {m: tensor(4000 + members.index(m), (64,)) for m in members}
    enc = codecs.encode(x[peer.name], "fp32")
    out: dict = {"life": peer.life, "incarnation": t.incarnation}
    if peer.life == 1:
        out["before"] = mean(0, members)
        peer.checkpoint("before_kill")  # the victim is killed here
        out["victim_gone"] = link_end(t, victim, ROUND_WAIT_S)
        out["meanwhile"] = [mean(r, survivors) for r in (1, 2)]
        other = next(s for s in survivors if s != peer.name)
        h = t.send(other, f"mid/{peer.name}", Kind.ACTIVATION, enc, 1)
        got = t.recv(other, f"mid/{other}", Expect(), wait)
        h.wait(wait)
        out["p2p_meanwhile"] = bool(torch.equal(got.tensor(), x[other]))
        peer.checkpoint(RESPAWN)  # the victim starts again while the survivors wait here
    # from here on, the victim's second life too
    if peer.name == victim:
        sends = [t.send(s, f"back/{victim}", Kind.ACTIVATION, enc, 2) for s in survivors]
        got = {s: t.recv(s, f"back/{s}", Expect(), wait) for s in survivors}
        for h in sends:
            h.wait(wait)
        out["back_ok"] = all(torch.equal(got[s].tensor(), x[s]) for s in survivors)
    else:
        msg = _recv_once_back(t, victim, f"back/{victim}", wait)
        t.send(victim, f"back/{peer.name}", Kind.ACTIVATION, enc, 2).wait(wait)
        out["back_ok"] = bool(torch.equal(msg.tensor(), x[victim]))
    # before round 3: no peer can be done (and closed) before every other one started it
    out["links"] = {
        n: {"lives": ln.lives, "closed": ln.closed} for n, ln in t.links.by_name.items()
    }
    out["after"] = mean(3, members)
    return out


def _recv_once_back(t, frm: str, tag: str, wait_s: float):
    """recv from a peer whose link is down until its new process formed it again (a recv on
    a lost link raises PeerLost at once)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return t.recv(frm, tag, Expect(), max(0.0, deadline - time.monotonic()))
        except PeerLost:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)
