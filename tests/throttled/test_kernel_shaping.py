"""Cross-check of the in-app bandwidth model against kernel shaping (tbf on a veth pair between two
network namespaces this test creates and deletes). Root only; skipped cleanly otherwise."""

from __future__ import annotations

import pytest

from comms.netns import measure_mbps, netns_pair, set_rate, unavailable

RATE_MBIT = 40.0
NBYTES = 4 << 20  # 0.84 s at 40 Mbit/s

# a rate measured against the kernel's: another test's load beside it would be in the figure
pytestmark = [pytest.mark.throttled, pytest.mark.alone, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def pair():
    why = unavailable()
    if why:
        pytest.skip(f"kernel shaping unavailable: {why}")
    with netns_pair() as p:  # torn down even when the test fails
        yield p


def test_app_shaper_matches_kernel_tbf(pair) -> None:
    set_rate(pair, None)
    raw = measure_mbps(pair, NBYTES)  # the unshaped veth is far faster than the target
    set_rate(pair, RATE_MBIT)
    kernel = measure_mbps(pair, NBYTES)
    set_rate(pair, None)
    app = measure_mbps(pair, NBYTES, app_mbps=RATE_MBIT)
    assert raw > 5 * RATE_MBIT, raw
    # tbf counts IP/TCP headers too (goodput ~95% of the rate); the app shapes payload bytes
    assert kernel == pytest.approx(RATE_MBIT, rel=0.10), kernel
    assert app == pytest.approx(RATE_MBIT, rel=0.10), app
    assert app == pytest.approx(kernel, rel=0.10), (app, kernel)
