"""A relaying peer's p2pd serves the relay service with its configured limits on its first
start: p2pd runs two services on one protocol and the one registered last answers
(comms/p2p/relay_service.py). With two Go processors a start lost that race a third to a half
of the time here, and on all 24 starts of one relay in a CI run."""

from __future__ import annotations

import asyncio
import os

from hivemind.p2p import P2P

from comms.p2p.relay import RelayLimits, p2pd_options
from comms.p2p.relay_service import DEFAULT_LIMIT, RELAY_P2PD_ENV, start_serving

# One Go processor loses the race about 1 start in 60 here (2 in about 120), two lost a third
# to a half: 12 checked starts taking at most 2 restarts passes about 1 run in 1,000 wrongly
# failed with the fix and 1 in 12 wrongly passed without it (at a third)
STARTS = 12
RESTARTS = 2


def test_a_relays_p2pd_serves_its_configured_limits_on_the_first_start():
    limits = RelayLimits(8, 1 << 18)
    kwargs, flags = p2pd_options(False, [], limits)
    kwargs.pop("relay_service")
    make_args = P2P.__dict__["_make_process_args"]

    def with_flags(*args, **kw):
        return make_args.__func__(*args, **{**kw, **flags})

    async def starts() -> list[list[tuple[int, int] | None]]:
        out = []
        for _ in range(STARTS):
            p2p, answers = await start_serving(
                P2P.create, (8, 1 << 18), 3, host_maddrs=["/ip4/127.0.0.1/tcp/0"], **kwargs
            )
            out.append(answers)
            await p2p.shutdown()
        return out

    env_before = {k: os.environ.get(k) for k in RELAY_P2PD_ENV}
    P2P._make_process_args = staticmethod(with_flags)
    try:
        answers = asyncio.run(starts())
    finally:
        P2P._make_process_args = make_args
    # every start ends with the configured service, and nearly every first answer is its
    assert [run[-1] for run in answers] == [(8, 1 << 18)] * STARTS, answers
    restarts = sum(len(run) - 1 for run in answers)
    assert restarts <= RESTARTS, answers
    assert {a for run in answers for a in run[:-1]} <= {DEFAULT_LIMIT, None}, answers
    # the environment is the test's again (only p2pd's start saw GOMAXPROCS=1)
    assert {k: os.environ.get(k) for k in RELAY_P2PD_ENV} == env_before
