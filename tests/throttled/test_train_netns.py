"""`meshtrain train` on two "machines": two network namespaces joined by a veth, each seeing
only its own address and the other's (10.77.0.1, 10.77.0.2), a torchrun launch in each. The
nodes find each other through torchrun's c10d rendezvous on the first, each cell announces the
address its route to the store takes (no --host), and the 2x2 grid trains to its last step,
averaging across the veth. Root only; skipped cleanly otherwise."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import helpers
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from train_nodes import Node, final_step, lives, sets, updates  # noqa: E402

from comms.netns import ADDR_A, ADDR_B, netns_pair, unavailable  # noqa: E402

pytestmark = [pytest.mark.throttled, pytest.mark.integration, pytest.mark.slow]
RUN_S = 300


@pytest.mark.timeout(2 * RUN_S)
def test_two_nodes_in_network_namespaces_train_a_grid(tmp_path, text_file):
    why = unavailable()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    keys = [
        *helpers.TINY,
        f"data.path='{text_file}'",
        "run.steps=20",
        "transport.recv_timeout_s=60",
        "transport.round_timeout_s=60",
    ]
    nodes = (
        Node(0, ADDR_A, tmp_path / "n0", tmp_path / "n0.log"),
        Node(1, ADDR_B, tmp_path / "n1", tmp_path / "n1.log"),
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with netns_pair() as pair:
        try:
            for node, ns in zip(nodes, (pair.a, pair.b)):
                node.start(
                    f"{ADDR_A}:29400",
                    ["--grid", "2x2", *sets(*keys)],
                    env,
                    host=False,
                    prefix=pair.cmd(ns),
                )
            codes = [node.wait(RUN_S) for node in nodes]
        finally:
            for node in nodes:
                node.kill()
    logs = [node.log.read_text() for node in nodes]
    assert codes == [0, 0], logs
    applied = 0
    for (node, addr), text in zip(zip(nodes, (ADDR_A, ADDR_B)), logs):
        i = node.index
        for j in range(2):  # each cell found its own machine's address, and trained to the end
            assert f"cell s{j}r{i} on {addr}," in text, text
            assert f"cell s{j}r{i}: trained to step 20 of 20" in text, text
            (life,) = lives(node.rows(j, i))
            assert updates(life) == list(range(1, 21)) and final_step(life) == 20
            last = [r for r in life if "rounds_applied" in r][-1]
            assert last["bytes_sent"]["average"] > 0, last  # its round frames crossed the veth
            applied += last["rounds_applied"]
    # rounds completed across the veth (how many of a 20-update run's depends on the load)
    assert applied > 0
