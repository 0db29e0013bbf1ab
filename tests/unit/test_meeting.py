"""comms.build's meetings and options: each backend takes its own typed meeting and options, and
says so otherwise."""

from __future__ import annotations

import pickle

import pytest

from comms.build import (
    HivemindMeeting,
    HivemindOptions,
    TorchMeeting,
    TorchOptions,
    make_transport,
)


def test_a_backend_refuses_the_other_backends_meeting_before_starting_anything():
    with pytest.raises(ValueError, match="TorchMeeting"):
        make_transport("torch", "a", ["a"], {}, HivemindMeeting())
    with pytest.raises(ValueError, match="HivemindMeeting"):
        make_transport("hivemind", "a", ["a"], {}, TorchMeeting("tcp://127.0.0.1:1"))
    with pytest.raises(ValueError, match="unknown backend"):
        make_transport("carrier-pigeon", "a", ["a"], {}, TorchMeeting("tcp://127.0.0.1:1"))
    with pytest.raises(ValueError, match="takes TorchOptions"):
        torch_meeting = TorchMeeting("tcp://127.0.0.1:1")
        make_transport("torch", "a", ["a"], {}, torch_meeting, options=HivemindOptions())
    with pytest.raises(ValueError, match="takes HivemindOptions"):
        make_transport("hivemind", "a", ["a"], {}, HivemindMeeting(), options=TorchOptions())


def test_a_meeting_crosses_to_a_cell_process_as_it_is():
    # LocalGrid hands it to each cell's process (multiprocessing pickles it between our own
    # processes; nothing from a peer is ever unpickled)
    m = HivemindMeeting(initial_peers=("/ip4/127.0.0.1/tcp/1/p2p/x",), run_id="r", relays=("y",))
    assert pickle.loads(pickle.dumps(m)) == m
    t = TorchMeeting("tcp://127.0.0.1:5", serve_store=False)
    assert pickle.loads(pickle.dumps(t)) == t
