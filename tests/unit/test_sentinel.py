"""The pipeline sentinel's pure parts (mesh/algo/sentinel.py) and the pipeline_poison config."""

import math

import pytest
import torch

from mesh.algo.sentinel import (
    PipelinePoison,
    Sentinel,
    SentinelSpec,
    is_void,
    parse_pipeline_poison,
    poisoned,
)
from mesh.config import ConfigError, load_config

D = 16


def honest_stream(n: int, kind: str = "activation", drift: float = 0.0, seed: int = 0):
    """Boundary-like tensors: a shared mean direction plus token noise (activations) or noise
    alone with heavy-ish norm jitter (gradients); the norm drifts by `drift` per message."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(D, generator=gen)
    for k in range(n):
        noise = torch.randn(2, 8, D, generator=gen)
        x = direction + 0.5 * noise if kind == "activation" else noise
        jitter = (
            1.0 if kind == "activation" else math.exp(0.3 * float(torch.randn(1, generator=gen)))
        )
        yield x * math.exp(drift * k) * jitter


def verdicts(stream, kind="activation", poison=None, onset=10**9, spec=None):
    s = Sentinel(spec or SentinelSpec())
    out = [
        s.check("s0r1", kind, x if k < onset else poisoned(x, poison, k))
        for k, x in enumerate(stream)
    ]
    return s, out


@pytest.mark.parametrize("kind", ["activation", "gradient"])
def test_a_clean_stream_drops_and_flags_nothing(kind):
    s, out = verdicts(honest_stream(300, kind), kind)
    assert all(out)
    assert s.dropped == 0 and s.flagged() == []


@pytest.mark.parametrize("drift", [0.01, -0.01])
def test_a_steady_honest_drift_is_predicted_not_dropped(drift):
    # the norm grows (or shrinks) 20x over the stream: far beyond the bound from its start
    s, out = verdicts(honest_stream(300, drift=drift))
    assert math.exp(abs(drift) * 300) > 20
    assert all(out), out.index(False)


def test_the_warm_up_accepts_anything_and_learns_it():
    spec = SentinelSpec(warmup=8)
    stream = list(honest_stream(8))
    s, out = verdicts([x * 1000 if k % 2 else x for k, x in enumerate(stream)], spec=spec)
    assert all(out) and s.dropped == 0
    assert s.streams[("s0r1", "activation")].accepted == 8


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("scale:100", "activation"),
        ("scale:0.01", "activation"),
        ("scale:10", "activation"),
        ("flip", "activation"),
        ("random", "activation"),
        ("scale:100", "gradient"),
        ("scale:0.01", "gradient"),
    ],
)
def test_garbage_after_the_warm_up_is_dropped_and_its_sender_flagged(mode, kind):
    (poison,) = parse_pipeline_poison([f"s0r0={mode}"], 1, 1).values()
    s, out = verdicts(honest_stream(200, kind), kind, poison, onset=64)
    assert all(out[:64])
    assert not any(out[64:]), f"{out[64:].count(True)} garbage messages accepted"
    assert s.flagged() == ["s0r1"]
    assert s.summary()[f"s0r1/{kind}"] == {"seen": 200, "dropped": 136, "flagged": 1}


def test_dropped_messages_do_not_drag_the_statistics():
    """An attacker that creeps up in small steps is still dropped once past the bound, and
    after it stops, its honest messages are accepted at the old level."""
    stream = list(honest_stream(300))
    s = Sentinel(SentinelSpec())
    got = []
    for k, x in enumerate(stream):
        factor = 1.0 if k < 64 or k >= 200 else 50.0  # a jump the bound must refuse
        got.append(s.check("s0r1", "activation", x * factor))
    stats = s.streams[("s0r1", "activation")]
    assert not any(got[64:200])
    assert all(got[200:])  # statistics stayed honest: the honest level is accepted again
    assert stats.accepted == 64 + 100
    assert abs(stats.mean["log_rms"] - math.log(float(stream[-1].square().mean().sqrt()))) < 0.5


def test_flag_needs_repeated_drops_within_the_window():
    spec = SentinelSpec(flag_drops=3, flag_window=32)
    stream = list(honest_stream(200))
    s = Sentinel(spec)
    for k, x in enumerate(stream):  # one garbage message every 40: never 3 within 32
        s.check("s0r1", "activation", x * 100 if k >= 64 and k % 40 == 0 else x)
    assert s.dropped == 3 and s.flagged() == []  # messages 80, 120, 160


def test_senders_and_kinds_are_kept_apart():
    s = Sentinel(SentinelSpec(warmup=4))
    for x in honest_stream(40):
        assert s.check("a", "activation", x)
        assert s.check("b", "activation", x * 1000)  # b's own level: normal for b
    assert s.flagged() == []
    with pytest.raises(ValueError, match="kind must be one of"):
        s.check("a", "weights", torch.ones(2, D))


def test_void_is_an_all_zero_tensor():
    assert is_void(torch.zeros(2, 3, D))
    assert not is_void(torch.zeros(2, 3, D).index_fill_(2, torch.tensor([5]), 1e-30))


def test_poisoned_modes():
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(poisoned(x, PipelinePoison("scale", 3.0), 0), x * 3)
    torch.testing.assert_close(poisoned(x, PipelinePoison("flip"), 0), -x)
    r = poisoned(x, PipelinePoison("random"), 7)
    assert torch.equal(r, poisoned(x, PipelinePoison("random"), 7))  # seeded
    assert float(r.square().mean().sqrt()) == pytest.approx(float(x.square().mean().sqrt()))
    assert abs(float(torch.nn.functional.cosine_similarity(r.reshape(-1), x.reshape(-1), 0))) < 0.3


def test_parse_pipeline_poison():
    got = parse_pipeline_poison(["s0r1=scale:100", "s1r0=flip@5", "s1r1=random"], 2, 2)
    assert got == {
        (0, 1): PipelinePoison("scale", 100.0, None),
        (1, 0): PipelinePoison("flip", 1.0, 5),
        (1, 1): PipelinePoison("random", 1.0, None),
    }
    for bad in ["s0r1=scale", "s0r1=scale:x", "s0r1=flip:2", "s0r1=melt", "s0r1=flip@-1", "x=flip"]:
        with pytest.raises(ValueError, match="expected 'sJrI=MODE"):
            parse_pipeline_poison([bad], 2, 2)
    with pytest.raises(ValueError, match="not in the 2x2 grid"):
        parse_pipeline_poison(["s2r0=flip"], 2, 2)
    with pytest.raises(ValueError, match="twice"):
        parse_pipeline_poison(["s0r0=flip", "s0r0=random"], 2, 2)


def test_config_refuses_a_bad_entry_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(
            [], ["grid.stages=2", "grid.replicas=2", "runtime.pipeline_poison=['s0r1=melt']"]
        )
    assert "runtime.pipeline_poison" in str(e.value) and "\n" not in str(e.value)


def test_flagged_senders_travel_in_heartbeats_and_show_in_status():
    from cli.status import stats_json, status_table
    from mesh.runtime.registry import parse_stats

    assert parse_stats({"flagged": ["s0r1"]}) == {"flagged": ["s0r1"]}
    assert parse_stats({"flagged": ["<script>"]}) is None  # only cell names are kept
    assert parse_stats({"flagged": "s0r1"}) is None
    cell = {"cell": "s1r1", "verified": True, "peer": "12D3KooWabcdefgh", "step": 3,
            "tokens_per_s": 1.0, "heartbeat_age_s": 0.5, "session": 0,
            **stats_json({"flagged": ["s0r1"]})}  # fmt: skip
    assert status_table({"cells": [cell]})[0][0] == "s1r1 (flagged s0r1)"


def test_state_round_trips_through_a_weights_only_file(tmp_path):
    """A logical run's checkpoint keeps its cells' sentinel statistics: read back, the next
    verdicts are the ones the uninterrupted sentinel gives."""
    spec = SentinelSpec(warmup=4)
    hostile = PipelinePoison("scale", 100.0)
    stream = [x if k < 45 else poisoned(x, hostile, k) for k, x in enumerate(honest_stream(60))]
    whole, restored = Sentinel(spec), Sentinel(spec)
    for x in stream[:30]:
        whole.check("s0r1", "activation", x)
    torch.save(whole.state(), tmp_path / "s.pt")
    restored.load_state(torch.load(tmp_path / "s.pt", weights_only=True))
    later = [whole.check("s0r1", "activation", x) for x in stream[30:]]
    assert [restored.check("s0r1", "activation", x) for x in stream[30:]] == later
    assert not all(later) and restored.summary() == whole.summary()
    for bad in ([{"sender": "s0r1"}], "x", [{**whole.state()[0], "kind": "weights"}]):
        with pytest.raises(ValueError, match="sentinel state"):
            restored.load_state(bad)
