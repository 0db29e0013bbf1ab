"""The pipeline sentinel's pure parts (mesh/algo/sentinel.py) and the pipeline_poison config
(mesh/algo/pipeline_poison.py)."""

import math
from collections import deque

import helpers
import pytest
import torch

from mesh.algo import sentinel
from mesh.algo.pipeline_poison import PipelinePoison, parse_pipeline_poison, poisoned
from mesh.algo.sentinel import (
    FLOORS,
    Sentinel,
    SentinelSpec,
    TokenTable,
    is_void,
    token_keys,
    trend_steps,
)
from mesh.algo.sentinel_state import load_sentinel_state, sentinel_state
from mesh.config import ConfigError, load_config

D = 32
V = 12  # token ids of the synthetic streams


def honest_stream(n: int, kind: str = "activation", drift: float = 0.0, seed: int = 0):
    """Boundary-like (tensor, token ids) pairs: each token id has its own direction, which an
    activation follows closely (cosine ~0.95, as a residual stream carries its token) and a
    gradient loosely (~0.8, with heavy-ish norm jitter, as a loss's pull towards the target);
    the norm drifts by `drift` per message."""
    gen = torch.Generator().manual_seed(seed)
    directions = torch.randn(V, D, generator=gen)
    spread = 0.3 if kind == "activation" else 0.8
    for k in range(n):
        ids = torch.randint(0, V, (2, 16), generator=gen)  # 32 tokens, as the tiny model's
        x = directions[ids] + spread * torch.randn(2, 16, D, generator=gen)
        jitter = (
            1.0 if kind == "activation" else math.exp(0.3 * float(torch.randn(1, generator=gen)))
        )
        yield x * math.exp(drift * k) * jitter, ids


def verdicts(stream, kind="activation", poison=None, onset=10**9, spec=None):
    s = Sentinel(spec or SentinelSpec())
    out = [
        s.check("s0r1", kind, x if k < onset else poisoned(x, poison, k), ids)
        for k, (x, ids) in enumerate(stream)
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
    s, out = verdicts([(x * 1000 if k % 2 else x, i) for k, (x, i) in enumerate(stream)], spec=spec)
    assert all(out) and s.dropped == 0
    assert s.streams[("s0r1", "activation")].accepted == 8


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("scale:100", "activation"),
        ("scale:0.01", "activation"),
        ("flip", "activation"),
        ("random", "activation"),
        ("flip", "gradient"),
        ("random", "gradient"),
    ],
)
def test_garbage_after_the_warm_up_is_dropped_and_its_sender_flagged(mode, kind):
    (poison,) = parse_pipeline_poison([f"s0r0={mode}"], 1, 1).values()
    s, out = verdicts(honest_stream(200, kind), kind, poison, onset=64)
    assert all(out[:64])
    assert not any(out[64:]), f"{out[64:].count(True)} garbage messages accepted"
    assert s.flagged() == ["s0r1"]
    assert s.summary()[f"s0r1/{kind}"] == {"seen": 200, "dropped": 136, "flagged": 1}


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("scale:3", "activation"),
        ("scale:0.33", "activation"),
        ("scale:100", "gradient"),
        ("scale:0.01", "gradient"),
    ],
)
def test_a_scale_near_the_bound_is_dropped_and_flagged_until_followed(mode, kind):
    """A steady scaled stream within reach of the bound (x3 against an activation's floor; x100
    against these synthetic gradients, which jitter 0.3 in log norm per message) is dropped and
    its sender flagged; after FOLLOW_AFTER drops in a row the level follows it by FOLLOW_RATE
    a message (an honest stream would look the same), so it may be let in later."""
    (poison,) = parse_pipeline_poison([f"s0r0={mode}"], 1, 1).values()
    s, out = verdicts(honest_stream(200, kind), kind, poison, onset=64)
    assert all(out[:64]) and not any(out[64 : 64 + sentinel.FOLLOW_AFTER])
    assert s.flagged() == ["s0r1"]


def test_dropped_messages_do_not_drag_the_statistics():
    """An attacker that jumps is dropped for as long as it lasts (its messages move the level
    by FOLLOW_RATE each at most), and after it stops, its honest messages are accepted at the
    old level."""
    stream = list(honest_stream(300))
    s = Sentinel(SentinelSpec())
    got = []
    for k, (x, ids) in enumerate(stream):
        factor = 1.0 if k < 64 or k >= 200 else 50.0  # a jump the bound must refuse
        got.append(s.check("s0r1", "activation", x * factor, ids))
    stats = s.streams[("s0r1", "activation")]
    assert not any(got[64:200])
    assert all(got[200:])  # statistics stayed honest: the honest level is accepted again
    assert stats.accepted == 64 + 100
    level = math.log(float(stream[-1][0].square().mean().sqrt()))
    assert abs(stats.mean["log_rms"] - level) < 0.5


def test_an_honest_level_change_is_caught_up_with_not_locked_out():
    """A sender whose norms step out of the bound and stay there (what an honest stream looks
    like to statistics that stopped learning while it drifted) is dropped at first, then let
    in again once the level followed it: no honest sender is dropped for good."""
    bound = SentinelSpec().z_max * FLOORS["activation"]["log_rms"][1]
    factor = math.exp(1.2 * bound)  # a fifth of the bound beyond it
    s = Sentinel(SentinelSpec())
    got = [
        s.check("s0r1", "activation", x * (factor if k >= 64 else 1.0), ids)
        for k, (x, ids) in enumerate(honest_stream(300))
    ]
    assert not any(got[64:66])  # beyond the bound: dropped
    back = got.index(True, 64)
    # the gap beyond the bound closes by FOLLOW_RATE a message
    assert back - 64 <= sentinel.FOLLOW_AFTER + 0.2 * bound / sentinel.FOLLOW_RATE + 8
    assert got[back:].count(False) <= 3 and all(got[-150:])  # at the edge a while, then in


def test_a_stream_that_drifts_on_while_dropped_is_caught_up_with():
    """Out of the bound and drifting further (0.003 a message): follow's step covers the run's
    own drift, so the gap still closes by FOLLOW_RATE a message (without it: by 0.002)."""
    bound = SentinelSpec().z_max * FLOORS["activation"]["log_rms"][1]
    s = Sentinel(SentinelSpec())
    got = [
        s.check("s0r1", "activation", x * math.exp(1.1 * bound + 0.003 * (k - 64)), ids)
        if k >= 64
        else s.check("s0r1", "activation", x, ids)
        for k, (x, ids) in enumerate(honest_stream(300))
    ]
    assert not any(got[64:66])
    back = got.index(True, 64)
    gap = 0.1 * bound + 0.003 * sentinel.FOLLOW_AFTER  # beyond the bound when follow starts
    assert back - 64 <= sentinel.FOLLOW_AFTER + gap / sentinel.FOLLOW_RATE + 8
    assert got[back:].count(False) <= 3 and all(got[-100:])


def test_follow_steps_slowly_towards_a_jump_and_faster_near_the_bound():
    """Beyond FOLLOW_Z x z_max scales a dropped message moves a level a tenth of FOLLOW_RATE:
    a jump (a scaled stream) stays out long; nearer, FOLLOW_RATE."""
    s = Sentinel(SentinelSpec())
    stream = list(honest_stream(65))
    for x, ids in stream[:64]:
        assert s.check("s0r1", "activation", x, ids)
    stats = s.streams[("s0r1", "activation")]
    x, ids = stream[64]
    for factor, step in ((100.0, sentinel.FOLLOW_RATE / 10), (1.6, sentinel.FOLLOW_RATE)):
        msg = sentinel.features(factor * x, ids, stats.table, "activation")
        before = stats.mean["log_rms"]
        counts = stats.table.counts.clone()
        sentinel.follow(stats, msg, "activation", 8.0)
        assert stats.mean["log_rms"] == pytest.approx(before + step)
        assert int((stats.table.counts - counts).sum()) == len(ids.unique())


@pytest.mark.parametrize("mode", ["flip", "random"])
def test_a_flip_or_noise_never_moves_the_statistics_however_long_it_lasts(mode):
    """While a flipped or noisy stream is dropped, its norms (which are honest: a flip keeps
    them, noise has the same RMS) move nothing, and its directions keep it out for good, even
    while the sender's honest norms drift."""
    (poison,) = parse_pipeline_poison([f"s0r0={mode}"], 1, 1).values()
    for kind in ("activation", "gradient"):
        s, out = verdicts(honest_stream(600, kind, drift=0.002), kind, poison, onset=64)
        assert all(out[:64]) and not any(out[64:]), out[64:].count(True)


def test_coherence_is_the_cosine_with_same_id_message_mates():
    units = torch.tensor([[1.0, 0], [0.6, 0.8], [0, 1.0], [1.0, 0]])
    ids = torch.tensor([3, 3, 5, 7])
    # id 3's two tokens see each other (cosine 0.6); ids 5 and 7 occur once: left out
    assert sentinel.coherence(units, ids) == pytest.approx(0.6)
    assert math.isnan(sentinel.coherence(units[2:], ids[2:]))
    noisy = torch.tensor([[1.0, 0], [0, 1.0], [1.0, 0], [-1.0, 0]])
    assert sentinel.coherence(noisy, torch.tensor([1, 1, 2, 2])) == pytest.approx(-0.5)


def test_the_warm_up_covers_the_learning_rate_warm_up():
    assert sentinel.warmup_messages(32, 100, 1) == 100
    assert sentinel.warmup_messages(32, 10, 4) == 40
    assert sentinel.warmup_messages(32, 2, 1) == 32


def test_flag_needs_repeated_drops_within_the_window():
    spec = SentinelSpec(flag_drops=3, flag_window=32)
    stream = list(honest_stream(200))
    s = Sentinel(spec)
    for k, (x, ids) in enumerate(stream):  # one garbage message every 40: never 3 within 32
        s.check("s0r1", "activation", x * 100 if k >= 64 and k % 40 == 0 else x, ids)
    assert s.dropped == 3 and s.flagged() == []  # messages 80, 120, 160


def test_senders_and_kinds_are_kept_apart():
    s = Sentinel(SentinelSpec(warmup=4))
    for x, ids in honest_stream(40):
        assert s.check("a", "activation", x, ids)
        assert s.check("b", "activation", x * 1000, ids)  # b's own level: normal for b
        assert s.check("a", "gradient", -x, ids)  # a's gradients: their own directions
    assert s.flagged() == []
    with pytest.raises(ValueError, match="kind must be one of"):
        s.check("a", "weights", torch.ones(2, D), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="3 token ids for 2 rows"):
        s.check("a", "activation", torch.ones(2, D), torch.zeros(3, dtype=torch.long))


def test_a_token_table_learns_each_ids_direction_and_offset():
    table = TokenTable.empty(4, torch.device("cpu"))
    x = torch.tensor([[3.0, 0, 0, 0], [0, 1.0, 0, 0], [6.0, 0, 0, 0]])
    ids = torch.tensor([5, 2, 5])
    units = table.units(x)
    assert math.isnan(table.alignment(units, ids))  # nothing learned yet
    log_norms = x.norm(dim=1).log()
    table.learn(units, ids, log_norms)
    assert table.rows.shape[0] >= 6  # grown to the largest id
    torch.testing.assert_close(table.rows[5], torch.tensor([1.0, 0, 0, 0]))
    assert table.alignment(units, ids) == pytest.approx(1.0)
    assert table.alignment(-units, ids) == pytest.approx(-1.0)
    # id 5's vectors are 3 and 6 long, id 2's 1: their offsets from the message's mean log norm
    mean = float(log_norms.mean())
    assert float(table.offsets[5]) == pytest.approx((math.log(3) + math.log(6)) / 2 - mean)
    assert float(table.offsets[2]) == pytest.approx(-mean)
    # an unknown id counts as no offset and is left out of the alignment
    assert table.mix_offset(torch.tensor([2, 9])) == pytest.approx(-mean / 2)
    other = table.units(torch.tensor([[0, 0, 1.0, 0], [1.0, 0, 0, 0]]))
    assert table.alignment(other, torch.tensor([9, 5])) == pytest.approx(1.0)


def test_a_wide_vector_is_sketched_and_keeps_its_cosines():
    width = 4 * sentinel.SKETCH_DIM
    table = TokenTable.empty(width, torch.device("cpu"))
    assert table.rows.shape[1] == sentinel.SKETCH_DIM
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, width, generator=gen)
    ua, ub = table.units(torch.stack([a, b]))
    exact = float(torch.nn.functional.cosine_similarity(a, b, 0))
    assert abs(float(ua @ ub) - exact) < 0.3  # ~1/sqrt(SKETCH_DIM) per pair
    assert float(ua @ table.units(-a[None])[0]) == pytest.approx(-1.0)


def test_features_see_scale_in_the_norms_and_direction_in_the_alignment():
    table = TokenTable.empty(D, torch.device("cpu"))
    x, ids = next(honest_stream(1))
    m = sentinel.features(x, ids, table, "activation")
    table.learn(m.units, m.ids, m.log_norms)
    base = sentinel.features(x, ids, table, "activation").values
    scaled = sentinel.features(3 * x, ids, table, "activation").values
    assert scaled["log_rms"] - base["log_rms"] == pytest.approx(math.log(3))
    assert scaled["log_norm"] - base["log_norm"] == pytest.approx(math.log(3))
    # each row is the mean of its id's vectors in this message: close to them, not equal
    assert scaled["align"] == pytest.approx(base["align"], abs=1e-5)
    assert base["align"] > math.log(0.9)
    flipped = sentinel.features(-x, ids, table, "activation").values
    assert flipped["align"] == pytest.approx(math.log(sentinel.ALIGN_MIN))  # clamped


def test_alignment_is_judged_only_below_its_prediction():
    stats = sentinel.SenderStats(mean={"align": -0.2}, deviations={"align": deque([0.01])})
    above = sentinel.z_scores(stats, {"align": 0.0}, "gradient")["align"]
    below = sentinel.z_scores(stats, {"align": -0.4}, "gradient")["align"]
    assert above == 0.0  # more aligned than usual: what an honest message looks like
    assert below == pytest.approx(0.2 / FLOORS["gradient"]["align"][0])


def test_a_gradient_norm_may_spike_up_further_than_it_may_fall():
    """Honest gradient norms spike up on a hard microbatch and never fall far: the floors
    differ by direction, activations' do not."""
    down, up = FLOORS["gradient"]["log_norm"]
    assert down < up
    stats = sentinel.SenderStats(mean={"log_norm": 0.0}, deviations={"log_norm": deque([0.0])})
    z_up = sentinel.z_scores(stats, {"log_norm": 1.0}, "gradient")["log_norm"]
    z_down = sentinel.z_scores(stats, {"log_norm": -1.0}, "gradient")["log_norm"]
    assert z_down / z_up == pytest.approx(up / down)


def test_a_message_let_in_near_the_bound_moves_the_statistics_a_bounded_step():
    """Learning clips each miss at LEARN_CLIP scales and keeps a misaligned message's rows out
    of the table: noise that slips in once under the bound cannot open the door to the next."""
    s = Sentinel(SentinelSpec())
    stream = list(honest_stream(80, "gradient"))
    for x, ids in stream[:79]:
        assert s.check("s0r1", "gradient", x, ids)
    stats = s.streams[("s0r1", "gradient")]
    x, ids = stream[79]
    msg = sentinel.features(x, ids, stats.table, "gradient")
    scale = sentinel.scale(stats, "align", "gradient", above=False)
    guess = sentinel.predicted(stats, "align")
    msg.values["align"] = guess - 7 * scale  # z 7: accepted at z_max 8
    rows, level = stats.table.rows.clone(), stats.mean["align"]
    sentinel.learn(stats, msg, "gradient", sentinel.LEARN_CLIP)
    step = sentinel.LEARN_CLIP * scale / sentinel.MEAN_TIME_CONSTANT
    assert stats.mean["align"] == pytest.approx(guess - step)
    assert stats.deviations["align"][-1] == pytest.approx(sentinel.LEARN_CLIP * scale)
    assert torch.equal(stats.table.rows, rows) and stats.mean["align"] < level


def test_the_trend_is_carried_on_damped_while_a_sender_is_dropped():
    assert trend_steps(0) == 1.0
    assert trend_steps(1) == pytest.approx(1 + (1 - 1 / sentinel.SLOPE_TIME_CONSTANT))
    assert trend_steps(10**6) == pytest.approx(sentinel.SLOPE_TIME_CONSTANT)


def test_token_keys_are_the_inputs_forward_and_the_targets_back():
    inputs, targets = torch.tensor([[1, 2]]), torch.tensor([[2, 3]])
    assert token_keys("activation", inputs, targets) is inputs
    assert token_keys("gradient", inputs, targets) is targets


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
            [], ["grid.stages=2", "grid.replicas=2", "faults.pipeline_poison=['s0r1=melt']"]
        )
    assert "faults.pipeline_poison" in str(e.value) and "\n" not in str(e.value)


def test_flagged_senders_travel_in_heartbeats_and_show_in_status():
    from cli.status import stats_json, status_table
    from mesh.runtime.registry import parse_stats

    assert parse_stats({"flagged": ["s0r1"]}) == {"flagged": ["s0r1"]}
    assert parse_stats({"flagged": ["<script>"]}) is None  # only cell names are kept
    assert parse_stats({"flagged": "s0r1"}) is None
    cell = {
        "cell": "s1r1",
        "verified": True,
        "peer": "12D3KooWabcdefgh",
        "step": 3,
        "tokens_per_s": 1.0,
        "heartbeat_age_s": 0.5,
        "session": 0,
        **stats_json({"flagged": ["s0r1"]}),
    }
    assert status_table({"cells": [cell]})[0][0] == "s1r1 (flagged s0r1)"


@pytest.mark.parametrize("width", [D, 100])  # 100: the table keeps sketched rows
def test_state_round_trips_through_a_weights_only_file(tmp_path, width):
    """A logical run's checkpoint keeps its cells' sentinel statistics: read back, the next
    verdicts are the ones the uninterrupted sentinel gives."""
    spec = SentinelSpec(warmup=4)
    hostile = PipelinePoison("scale", 100.0)
    pad = torch.randn(width - D) if width > D else None
    stream = [
        (x if pad is None else torch.cat([x, pad.expand(*x.shape[:-1], -1)], -1), ids)
        for x, ids in honest_stream(60)
    ]
    stream = [(x if k < 45 else poisoned(x, hostile, k), i) for k, (x, i) in enumerate(stream)]
    whole, restored = Sentinel(spec), Sentinel(spec)
    for x, ids in stream[:30]:
        whole.check("s0r1", "activation", x, ids)
    torch.save(sentinel_state(whole), tmp_path / "s.pt")
    load_sentinel_state(restored, torch.load(tmp_path / "s.pt", weights_only=True))
    later = [whole.check("s0r1", "activation", x, ids) for x, ids in stream[30:]]
    assert [restored.check("s0r1", "activation", x, ids) for x, ids in stream[30:]] == later
    assert not all(later) and restored.summary() == whole.summary()
    good = sentinel_state(whole)[0]
    table = good["table"]
    for bad in (
        [{"sender": "s0r1"}],
        "x",
        [{**good, "kind": "weights"}],
        [{**good, "seen": True}],
        [{**good, "table": {**table, "width": 3}}],  # rows of another width
        [{**good, "table": {**table, "rows": table["rows"] * float("nan")}}],
    ):
        with pytest.raises(ValueError, match="sentinel state"):
            load_sentinel_state(restored, bad)
    assert restored.summary() == whole.summary()  # a refused state changed nothing


# ---- replays of real boundary tensors (mesh/bench/sentinel_replay.py) ------------------------
@pytest.fixture(scope="module")
def recorded(text_file):
    """Every activation and gradient crossing the boundary of a tiny 2-stage pipeline (the
    simulator, 160 updates: a microbatch each), as its receiver judged it."""
    from mesh.bench.sentinel_replay import record

    cfg = load_config(
        [],
        [
            *helpers.TINY,
            "model.d_model=32",
            "model.n_layers=4",
            "grid.stages=2",
            "grid.replicas=1",
            "run.steps=160",
            "run.eval_every=1000",
            f"data.path='{text_file}'",
        ],
    )
    streams, dropped_in_run = record(cfg)
    assert dropped_in_run == 0
    return {
        "activation": streams[("s1r0", "s0r0", "activation")],
        "gradient": streams[("s0r0", "s1r0", "gradient")],
    }


@pytest.mark.parametrize("kind", ["activation", "gradient"])
def test_a_real_clean_run_drops_nothing(recorded, kind):
    from mesh.bench.sentinel_replay import replay

    assert len(recorded[kind]) == 160
    assert all(replay(recorded[kind], kind))


ONSET = 64  # the default onset of faults.pipeline_poison: twice the warm-up


@pytest.mark.parametrize(
    ("kind", "mode"),
    [
        ("activation", "flip"),
        ("activation", "random"),
        ("activation", "scale:4"),
        ("activation", "scale:0.25"),
        ("activation", "scale:100"),
        ("gradient", "flip"),
        ("gradient", "random"),
        ("gradient", "scale:100"),
        ("gradient", "scale:0.01"),
    ],
)
def test_real_garbage_is_dropped_from_its_onset_on(recorded, kind, mode):
    """Each attack on the real run's messages from ONSET on: every one of them is dropped.
    (Not caught on these tiny streams: scale factors within the honest spread of the early
    updates; results/sentinel/table.md has the rates.)"""
    from mesh.bench.sentinel_replay import replay

    got = replay(recorded[kind], kind, mode, ONSET)
    assert all(got[:ONSET])
    assert not any(got[ONSET:]), f"{got[ONSET:].count(True)} of {len(got) - ONSET} accepted"
