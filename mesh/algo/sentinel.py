"""Pipeline poisoning: what a stage receives across a boundary, judged against its sender's past.

A stage that sends finite garbage (activations or gradients scaled, sign-flipped, or noise)
passes every wire check. Each receiving stage keeps, per sender and message kind, running
statistics of two cheap features of every tensor it receives (Sentinel-style, Pluralis,
arXiv 2603.03592; our own statistics):

- `log_rms`: log of the root-mean-square value (a scaled tensor moves it by log(factor));
- `mean_cos`: cosine between the tensor's mean over tokens (a d-vector) and the running mean of
  those vectors (a sign flip turns it to about -1, noise to about 0). A residual stream has a
  strong common direction, so this separates honest activations from flipped or random ones;
  a gradient's token mean has none to speak of, so for gradients the feature's spread is wide
  and only the scale is judged in practice.

Both are one pass over the tensor plus O(d). Each feature's expected value is a level and a
trend (Holt's linear smoothing: EMAs with MEAN_TIME_CONSTANT and SLOPE_TIME_CONSTANT messages,
running means before that), so an honest drift (norms that shrink or grow as training goes) is
predicted rather than flagged; its scale is 1.25 x the mean absolute miss of that prediction
over the last SCALE_WINDOW accepted messages (~ one standard deviation for normal data; an
honest spike widens it for a while), with a floor per feature so a very steady stream does not
make the bound hair-trigger. A message's z-score per feature is |x - predicted| / scale.

Verdicts: the first `warmup` messages of a sender are learned and accepted; after that, a
message with any z-score above `z_max` is dropped. Dropped messages never update the
statistics, so an attacker cannot drag them. A sender is flagged once `flag_drops` of its last
`flag_window` verdicts were drops (and stays flagged). A sender hostile from its first message
defines its own baseline: detection needs an honest warm-up, as Sentinel's does.

An all-zero tensor is the pipeline's "void" marker: the sender's stage dropped that microbatch
(see `is_void`); it is passed on, never judged and never learned.

Tensors in, verdicts and counts out; the engines keep one `Sentinel` per receiving cell.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

FEATURES = ("log_rms", "mean_cos")
# messages: the memory of the EMAs (each a running mean until this many were seen). The mean
# forgets fast, so it lags little behind an honest drift (the lag of an EMA under a steady drift
# is the drift per message x (time constant - 1)); the scale remembers longer, so one honest
# spike does not widen the bound for long
MEAN_TIME_CONSTANT = 8
SLOPE_TIME_CONSTANT = 16
SCALE_WINDOW = 32
# floors of the scale, per message kind and feature: a jump below z_max x floor is never a drop.
# An activation's norm follows the weights, which move slowly (log_rms 0.1 at z_max 8: factors
# under ~2.2x pass however steady the stream); a gradient's follows its microbatch's loss, which
# jumps (honest spikes of 7x between microbatches in the tiny model's runs): factors under ~16x
FLOORS = {
    "activation": {"log_rms": 0.1, "mean_cos": 0.02},
    "gradient": {"log_rms": 0.35, "mean_cos": 0.02},
}
MAD_TO_STD = 1.25  # the mean absolute deviation of a normal variable is 0.8 sigma


@dataclass(frozen=True)
class SentinelSpec:
    warmup: int = 32  # messages of each sender learned before any verdict
    z_max: float = 8.0  # a message with a feature this many scales from its mean is dropped
    flag_drops: int = 3  # drops among a sender's last flag_window verdicts that flag it
    flag_window: int = 32

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.z_max <= 0 or self.flag_drops < 1:
            raise ValueError(f"sentinel: warmup >= 1, z_max > 0, flag_drops >= 1: {self}")
        if self.flag_window < self.flag_drops:
            raise ValueError(f"sentinel: flag_window must be >= flag_drops: {self}")


def is_void(x: torch.Tensor) -> bool:
    """The void marker: an all-zero tensor (an honest boundary tensor never is one)."""
    return not bool(x.any())


def features(
    x: torch.Tensor, reference: torch.Tensor | None
) -> tuple[dict[str, float], torch.Tensor]:
    """The message's features and its token-mean vector (over every dim but the last). With no
    reference direction yet, mean_cos is NaN (the first message defines the direction)."""
    flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
    rms = float(flat.square().mean().sqrt())
    token_mean = flat.mean(dim=0)
    if reference is None:
        cos = math.nan
    else:
        denom = float(token_mean.norm() * reference.norm())
        cos = float(token_mean @ reference) / denom if denom > 0 else 0.0
    return {"log_rms": math.log(max(rms, 1e-30)), "mean_cos": cos}, token_mean


@dataclass
class SenderStats:
    """The running statistics of one (sender, kind) stream, and its verdict counts."""

    seen: int = 0  # messages judged or learned (void ones are not counted)
    accepted: int = 0
    dropped: int = 0
    flagged: bool = False
    mean: dict[str, float] = field(default_factory=dict)
    slope: dict[str, float] = field(default_factory=dict)  # the level's trend per message
    # |x - predicted| of the last SCALE_WINDOW accepted messages, per feature
    deviations: dict[str, deque[float]] = field(default_factory=dict)
    direction: torch.Tensor | None = None  # running token-mean vector
    recent: deque[bool] = field(default_factory=deque)  # last verdicts, True = dropped


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    z: dict[str, float]  # per feature; empty during the warm-up
    warmup: bool = False


def predicted(stats: SenderStats, name: str) -> float:
    """The feature's expected value for the next message: the level plus the trend."""
    return stats.mean[name] + stats.slope.get(name, 0.0)


def z_scores(stats: SenderStats, values: dict[str, float], kind: str) -> dict[str, float]:
    out = {}
    for name in FEATURES:
        if name not in stats.mean:
            continue
        devs = stats.deviations.get(name, ())
        mad = sum(devs) / len(devs) if devs else 0.0
        scale = max(MAD_TO_STD * mad, FLOORS[kind][name])
        out[name] = abs(values[name] - predicted(stats, name)) / scale
    return out


def learn(stats: SenderStats, values: dict[str, float], token_mean: torch.Tensor) -> None:
    """Fold an accepted message into the statistics: its deviations join the scale's window,
    then the mean moves (a running mean at first, then an EMA)."""
    n = stats.accepted + 1
    rate = 1.0 / min(n, MEAN_TIME_CONSTANT)
    for name in FEATURES:
        x = values[name]
        if math.isnan(x):  # mean_cos of the first message: no direction to compare with yet
            continue
        if name not in stats.mean:
            stats.mean[name] = x
            stats.deviations[name] = deque(maxlen=SCALE_WINDOW)
            continue
        guess = predicted(stats, name)
        stats.deviations[name].append(abs(x - guess))
        level = stats.mean[name]
        stats.mean[name] = guess + rate * (x - guess)
        slope = stats.slope.get(name, 0.0)
        slope_rate = 1.0 / min(n - 1, SLOPE_TIME_CONSTANT)
        stats.slope[name] = slope + slope_rate * (stats.mean[name] - level - slope)
    if stats.direction is None:
        stats.direction = token_mean.clone()
    else:
        stats.direction.mul_(1 - rate).add_(token_mean, alpha=rate)
    stats.accepted = n


def judge(stats: SenderStats, spec: SentinelSpec, x: torch.Tensor, kind: str) -> Verdict:
    """The verdict on one received (non-void) tensor of `kind` (activation or gradient);
    updates `stats` (learned only if accepted, counts and the flag either way)."""
    values, token_mean = features(x, stats.direction)
    stats.seen += 1
    if stats.accepted < spec.warmup:
        learn(stats, values, token_mean)
        return Verdict(True, {}, warmup=True)
    z = z_scores(stats, values, kind)
    drop = not all(math.isfinite(v) and v <= spec.z_max for v in z.values())
    stats.recent.append(drop)
    while len(stats.recent) > spec.flag_window:
        stats.recent.popleft()
    if drop:
        stats.dropped += 1
        stats.flagged = stats.flagged or sum(stats.recent) >= spec.flag_drops
    else:
        learn(stats, values, token_mean)
    return Verdict(not drop, z)


@dataclass
class Sentinel:
    """One receiving cell's book: a SenderStats per (sender, kind)."""

    spec: SentinelSpec
    streams: dict[tuple[str, str], SenderStats] = field(default_factory=dict)

    def check(self, sender: str, kind: str, x: torch.Tensor) -> bool:
        """True: use the tensor; False: drop this microbatch (counted). kind: a key of
        FLOORS (activation, gradient)."""
        if kind not in FLOORS:
            raise ValueError(f"sentinel: kind must be one of {sorted(FLOORS)}, got {kind!r}")
        stats = self.streams.setdefault((sender, kind), SenderStats())
        return judge(stats, self.spec, x, kind).accepted

    @property
    def dropped(self) -> int:
        return sum(s.dropped for s in self.streams.values())

    def flagged(self) -> list[str]:
        """The senders flagged on any kind, sorted."""
        return sorted({sender for (sender, _), s in self.streams.items() if s.flagged})

    def summary(self) -> dict[str, dict[str, int]]:
        """Per 'sender/kind': messages seen and dropped, and whether flagged (metrics rows)."""
        return {
            f"{sender}/{kind}": {"seen": s.seen, "dropped": s.dropped, "flagged": int(s.flagged)}
            for (sender, kind), s in sorted(self.streams.items())
        }

    def state(self) -> list[dict[str, object]]:
        """Every stream's statistics as plain values and tensors (what torch.load(...,
        weights_only=True) reads back): a simulator's checkpoint keeps them, so a resumed run
        judges the next tensor as the uninterrupted run would."""
        return [
            {"sender": sender, "kind": kind, "seen": s.seen, "accepted": s.accepted,
             "dropped": s.dropped, "flagged": s.flagged, "mean": dict(s.mean),
             "slope": dict(s.slope), "deviations": {k: list(d) for k, d in s.deviations.items()},
             "direction": s.direction, "recent": list(s.recent)}
            for (sender, kind), s in sorted(self.streams.items())
        ]  # fmt: skip

    def load_state(self, state: object) -> None:
        """Replace the streams with `state` (from state()); ValueError, nothing changed, when
        it is not of that form."""
        streams = {}
        for entry in state if isinstance(state, list) else [None]:
            stats = _stats_of(entry)
            if stats is None or not isinstance(entry, dict) or entry["kind"] not in FLOORS:
                raise ValueError("sentinel state: not a list of stream statistics")
            streams[(entry["sender"], entry["kind"])] = stats
        self.streams = streams


def _stats_of(entry: object) -> SenderStats | None:
    """One stream's SenderStats from its state() entry, or None when any field is malformed."""
    if not isinstance(entry, dict) or not isinstance(entry.get("sender"), str):
        return None
    counts = [entry.get(k) for k in ("seen", "accepted", "dropped")]
    floats = [entry.get("mean"), entry.get("slope")]
    devs, recent, direction = entry.get("deviations"), entry.get("recent"), entry.get("direction")
    if not (
        all(isinstance(n, int) and n >= 0 for n in counts)
        and isinstance(entry.get("flagged"), bool)
        and all(
            isinstance(d, dict)
            and all(k in FEATURES and isinstance(v, float) for k, v in d.items())
            for d in floats
        )
        and isinstance(devs, dict)
        and all(k in FEATURES and isinstance(v, list) for k, v in devs.items())
        and all(isinstance(x, float) for v in devs.values() for x in v)
        and isinstance(recent, list)
        and all(isinstance(x, bool) for x in recent)
        and (direction is None or isinstance(direction, torch.Tensor))
    ):
        return None
    seen, accepted, dropped = counts
    return SenderStats(
        seen=seen,
        accepted=accepted,
        dropped=dropped,
        flagged=entry["flagged"],
        mean=dict(entry["mean"]),
        slope=dict(entry["slope"]),
        deviations={k: deque(v, maxlen=SCALE_WINDOW) for k, v in devs.items()},
        direction=None if direction is None else direction.clone(),
        recent=deque(recent),
    )


# ---- the emulated hostile stage (runtime.pipeline_poison) -------------------------------------
POISON_MODES = ("scale", "flip", "random")


@dataclass(frozen=True)
class PipelinePoison:
    """What a hostile cell does to every tensor it sends across a pipeline boundary
    (activations forward, gradients backward) from update `start` on."""

    mode: str  # scale: times factor; flip: negated; random: noise of the same RMS
    factor: float = 1.0
    start: int | None = None  # None: the receivers' warm-up (runtime.sentinel_warmup)


def parse_pipeline_poison(
    items: list[str], stages: int, replicas: int, key: str = "runtime.pipeline_poison"
) -> dict[tuple[int, int], PipelinePoison]:
    """["sJrI=MODE[@STEP]", ...] with MODE scale:F | flip | random -> {(stage, replica): ...};
    ValueError naming the key, the entry and the form when an entry is malformed."""
    from mesh.algo.topology import Cell as Place

    form = "expected 'sJrI=MODE[@STEP]' with MODE scale:F, flip or random, e.g. 's0r1=scale:100'"
    out: dict[tuple[int, int], PipelinePoison] = {}
    for item in items:
        name, eq, rest = str(item).partition("=")
        place = Place.parse(name.strip())
        body, at, start_text = rest.strip().partition("@")
        mode, colon, arg = body.strip().partition(":")
        poison: PipelinePoison | None = None
        try:
            start = int(start_text) if at else None
            if start is not None and start < 0:
                raise ValueError
            if mode == "scale" and colon:
                factor = float(arg)
                if math.isfinite(factor):
                    poison = PipelinePoison("scale", factor, start)
            elif mode in ("flip", "random") and not colon:
                poison = PipelinePoison(mode, 1.0, start)
        except ValueError:
            poison = None
        if place is None or not eq or poison is None:
            raise ValueError(f"{key} entry {item!r}: {form}")
        j, i = place.stage, place.replica
        if not (0 <= j < stages and 0 <= i < replicas):
            raise ValueError(
                f"{key} entry {item!r}: cell {place} is not in the {stages}x{replicas} grid"
            )
        if (j, i) in out:
            raise ValueError(f"{key} lists cell {place} twice")
        out[(j, i)] = poison
    return out


def poisoned(x: torch.Tensor, poison: PipelinePoison, seed: int) -> torch.Tensor:
    """The tensor a hostile sender sends instead of x (random: seeded noise, the same RMS)."""
    if poison.mode == "scale":
        return x * poison.factor
    if poison.mode == "flip":
        return -x
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(x.shape, generator=gen).to(device=x.device, dtype=x.dtype)
    rms = x.detach().to(torch.float32).square().mean().sqrt()
    return noise * (rms / noise.to(torch.float32).square().mean().sqrt()).to(x.dtype)
