"""Pipeline poisoning: what a stage receives across a boundary, judged against its sender's past.

A stage that sends finite garbage (activations or gradients scaled, sign-flipped, or noise)
passes every wire check. Each receiving stage keeps, per sender and message kind, running
statistics of four cheap features of every tensor it receives (Sentinel-style, Pluralis,
arXiv 2603.03592: running statistics of what crosses a boundary, no recomputation; the
features are our own). Three of them are keyed by the microbatch's token ids, which the
receiver knows (every stage reads the same microbatch from the corpus): the input tokens for an
activation, the targets for a gradient (`token_keys`), through a `TokenTable` per stream.

- `log_rms`: log of the root-mean-square value (a scaled tensor moves it by log(factor));
- `log_norm`: the mean over tokens of each token's log norm, less what this microbatch's token
  mix is expected to add (each id's running offset from its messages' mean): the mix and a few
  spiking tokens no longer count, so it is ~3x tighter than log_rms on honest streams;
- `align`: the mean over tokens of the cosine between a token's vector and the running mean
  direction of its id's vectors, as a log. A residual stream carries its token; the loss pulls
  the hidden state towards the target's output embedding, and that pull survives back through
  the later stages. An activation's rows are centred first (the message's mean row taken out):
  a residual stream also carries a direction common to all its tokens, which moves as training
  goes and would otherwise swing every token's cosine at once; what is left is the token's own.
  A sign flip turns the cosine negative, noise of the same RMS to ~0: far below any honest
  message. Only a fall is judged (more aligned than usual is what honest looks like);
- `coherence`: the mean over the tokens whose id occurs more than once in the message of the
  cosine between the token's vector and its message-mates of the same id, as a log: the same
  signal without the table (noise falls to ~0 however the table stands; a flip keeps it).

Per message: one pass over the tensor, a projection of each token's vector to SKETCH_DIM
coordinates when it is wider (a fixed random matrix: cosines survive), and a lookup of its B x T
rows; a table holds vocab x SKETCH_DIM floats per sender and kind. Each feature's expected value
is a level and a trend (Holt's linear smoothing: EMAs with MEAN_TIME_CONSTANT and
SLOPE_TIME_CONSTANT messages, running means before that), so an honest drift (norms that shrink
or grow as training goes) is predicted rather than flagged; its scale is 1.25 x the mean
absolute miss of that prediction over the last SCALE_WINDOW accepted messages (~ one standard
deviation for normal data; an honest spike widens it for a while), with a floor per feature and
side so a steady stream does not make the bound hair-trigger. A message's z-score per feature
is |x - predicted| / scale.

Verdicts: the first `warmup` messages of a sender are learned and accepted (the engine makes it
cover the learning-rate warm-up, `warmup_messages`: the streams move fastest while the rate
ramps up); after that, a message with any z-score above `z_max` is dropped. An accepted message
is learned with its miss clipped at LEARN_CLIP scales (`learn`). A dropped one is not learned,
so an attacker cannot drag the statistics; but once FOLLOW_AFTER messages of a sender in a row
were dropped, each further dropped one whose directions are its sender's (align and coherence
within the bound: not a flip, not noise) has its tokens' rows learned and moves the levels of
log_rms and log_norm towards it by a bounded step plus the dropped run's own drift (`follow`).
An honest stream the statistics lost (one that drifted on while its messages were dropped) is
caught up with and let in again, so no honest sender is locked out for good; a flipped or
noisy stream never moves them; a steady scaled one moves them slowly (a jump: a tenth of the
step), so it stays dropped for long. The
trend is carried on damped while a sender is dropped (`trend_steps`). A sender is flagged once
`flag_drops` of its last `flag_window` verdicts were drops (and stays flagged). A sender
hostile from its first message defines its own baseline: detection needs an honest warm-up, as
Sentinel's does.

An all-zero tensor is the pipeline's "void" marker: the sender's stage dropped that microbatch
(see `is_void`); it is passed on, never judged and never learned.

Tensors in, verdicts and counts out; the engines keep one `Sentinel` per receiving cell.
mesh/bench/sentinel_replay.py measures it on replays of real boundary tensors.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

FEATURES = ("log_rms", "log_norm", "align", "coherence")
# messages: the memory of the EMAs (each a running mean until this many were seen). The mean
# forgets fast, so it lags little behind an honest drift (the lag of an EMA under a steady drift
# is the drift per message x (time constant - 1)); the scale remembers longer, so one honest
# spike does not widen the bound for long
MEAN_TIME_CONSTANT = 8
SLOPE_TIME_CONSTANT = 16
SCALE_WINDOW = 32
# floors of the scale, per message kind and feature, below and above the prediction: a miss
# under z_max x floor is never a drop. Set from the honest extremes in replays of real boundary
# tensors, with margin: the default demo (4x2, 8 blocks of d = 64, 512 tokens a microbatch,
# six seeds, 1x and 2x replicas) and mesh/bench/sentinel_replay.py's runs (tiny models with 32
# tokens a microbatch have the noisiest streams):
# - activations: norms follow the weights, which move slowly once the learning-rate warm-up is
#   over, but they jump when it peaks: 0.12 (at z_max 8: factors under 2.6x pass however
#   steady the stream; the demo's honest activations jumped up to 2.3x over the prediction in
#   the 15 messages after its learning-rate warm-up);
# - gradients: a gradient's norm follows its microbatch's loss, which spikes up and never falls
#   far. log_rms: 0.2 below (5x), 0.75 above (400x; a few tokens of an honest microbatch
#   spiked it 67x); log_norm: 0.12 below (2.6x; honest at most 1.8x), 0.45 above (37x; the
#   demo's honest loss spikes just after the learning-rate warm-up moved it 20x);
# - align: 0.35 below lets an honest message be up to 16x less aligned than predicted (the
#   worst seen: 7x, in a loss spike); coherence: 0.2 (5x). Noise is ~10x (32 tokens) to 1000x
#   (the clamp, ALIGN_MIN) less aligned, a flip clamped. Never judged above (inf).
INF = math.inf
FLOORS = {
    "activation": {
        "log_rms": (0.12, 0.12),
        "log_norm": (0.12, 0.12),
        "align": (0.35, INF),
        "coherence": (0.2, INF),
    },
    "gradient": {
        "log_rms": (0.2, 0.75),
        "log_norm": (0.12, 0.45),
        "align": (0.35, INF),
        "coherence": (0.2, INF),
    },
}
# per kind: whether a message's rows are centred (its mean row taken out) before their
# directions are judged (see align)
CENTRED = {"activation": True, "gradient": False}
MAD_TO_STD = 1.25  # the mean absolute deviation of a normal variable is 0.8 sigma
LEARN_CLIP = 2.0  # scales: an accepted message's miss is learned clipped at this (see learn)
SKETCH_DIM = 64  # coordinates a token table keeps per token id
TABLE_TIME_CONSTANT = 32  # a token id's row: a running mean of its first 32 messages, then EMA
ALIGN_MIN = 0.001  # alignment is clamped here before its log (a cosine <= 0 has no log)
DIRECTIONS = ("align", "coherence")  # the features a flip or noise moves; the others: norms
# a sender dropped this many times in a row is being lost track of (an honest stream drifts on
# while its statistics stand still) or attacked: from then on, each dropped message whose
# directions are its sender's moves the levels of log_rms and log_norm towards it (see follow)
FOLLOW_AFTER = 32
# log units per message: how far follow moves such a level: FOLLOW_RATE while the miss is within
# FOLLOW_Z x z_max scales (an honest stream that drifted out of the bound: it is kept at the
# bound's edge and let in again once it drifts slower than this beyond its trend), a tenth of
# it further out (a jump, as a scaled stream makes: x4 on an activation at its floor takes
# ~450 messages to be let in; an honest jump is still caught up with, slowly)
FOLLOW_RATE = 0.005
FOLLOW_Z = 1.25


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


def token_keys(kind: str, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The token ids a message's rows are keyed by: the microbatch's input tokens for an
    activation, its targets (the next tokens) for a gradient."""
    return targets if kind == "gradient" else inputs


def sketch_matrix(width: int) -> torch.Tensor | None:
    """The fixed projection of a token's vector to SKETCH_DIM coordinates (None: narrow enough
    to keep as it is). The same for every sender and run: nothing to agree on."""
    if width <= SKETCH_DIM:
        return None
    gen = torch.Generator().manual_seed(0x5E17)
    return torch.randn(width, SKETCH_DIM, generator=gen) / math.sqrt(SKETCH_DIM)


@dataclass
class TokenTable:
    """Per token id: the running mean direction of the (unit, sketched) vectors seen for it,
    and the running mean of their log norm's offset from their message's mean log norm."""

    rows: torch.Tensor  # (ids, coordinates); grows to the largest id seen
    offsets: torch.Tensor  # (ids,)
    counts: torch.Tensor  # (ids,) messages that carried each id
    sketch: torch.Tensor | None

    @classmethod
    def empty(cls, width: int, device: torch.device) -> TokenTable:
        """A table on the device the messages arrive on (no copy of them to the host)."""
        sketch = sketch_matrix(width)
        dims = width if sketch is None else SKETCH_DIM
        zeros = torch.zeros(0, device=device)
        sketch = None if sketch is None else sketch.to(device)
        return cls(torch.zeros(0, dims, device=device), zeros, zeros.clone(), sketch)

    def units(self, flat: torch.Tensor) -> torch.Tensor:
        """Each row of a (tokens, width) tensor sketched and scaled to unit length."""
        v = flat if self.sketch is None else flat @ self.sketch
        return v / v.norm(dim=1, keepdim=True).clamp_min(1e-30)

    def known(self, ids: torch.Tensor) -> torch.Tensor:
        """Which ids have a row learned from at least one message."""
        out = torch.zeros_like(ids, dtype=torch.bool)
        inside = ids < self.counts.shape[0]
        out[inside] = self.counts[ids[inside]] > 0
        return out

    def alignment(self, units: torch.Tensor, ids: torch.Tensor) -> float:
        """Mean over the tokens of known ids of the cosine between the token's unit vector and
        its id's row; NaN when no id is known."""
        known = self.known(ids)
        if not bool(known.any()):
            return math.nan
        rows = self.rows[ids[known]]
        cos = (units[known] * rows).sum(1) / rows.norm(dim=1).clamp_min(1e-30)
        return float(cos.mean())

    def mix_offset(self, ids: torch.Tensor) -> float:
        """How far above the usual mean log norm this message's token mix is expected to be
        (unknown ids: 0)."""
        known = self.known(ids)
        return float(self.offsets[ids[known]].sum()) / max(1, ids.numel())

    def learn(self, units: torch.Tensor, ids: torch.Tensor, log_norms: torch.Tensor) -> None:
        """Move each id's row and offset towards this message's mean for that id."""
        have, need = self.rows.shape[0], int(ids.max()) + 1
        if need > have:  # doubling: a handful of copies over a run, whatever the vocabulary
            grow = max(need, 2 * have) - have
            self.rows = torch.cat([self.rows, self.rows.new_zeros(grow, self.rows.shape[1])])
            self.offsets = torch.cat([self.offsets, self.offsets.new_zeros(grow)])
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow)])
        present, inverse, per_id = torch.unique(ids, return_inverse=True, return_counts=True)
        self.counts[present] += 1
        rate = 1.0 / self.counts[present].clamp(max=TABLE_TIME_CONSTANT)
        # per-id sums (index_put_: index_add_ on the CPU waits on its thread pool for ~60 ms
        # a call on a busy box, even for 16 rows)
        sums = units.new_zeros(len(present), units.shape[1])
        mean_units = sums.index_put_((inverse,), units, accumulate=True)
        old = self.rows[present]
        self.rows[present] = old + rate[:, None] * (mean_units / per_id[:, None] - old)
        rel = log_norms - log_norms.mean()
        mean_rel = rel.new_zeros(len(present)).index_put_((inverse,), rel, accumulate=True) / per_id
        old_offset = self.offsets[present]
        self.offsets[present] = old_offset + rate * (mean_rel - old_offset)


@dataclass(frozen=True)
class Message:
    """What a received tensor is judged by, and what learning it would fold in."""

    values: dict[str, float]  # per feature
    ids: torch.Tensor  # (tokens,) the id of each row
    units: torch.Tensor  # (tokens, coordinates) each row sketched, unit length
    log_norms: torch.Tensor  # (tokens,)


def coherence(units: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean over the tokens whose id occurs more than once in the message of the cosine between
    the token's unit vector and the sum of the other same-id vectors; NaN when no id repeats."""
    present, inverse, per_id = torch.unique(ids, return_inverse=True, return_counts=True)
    sums = units.new_zeros(len(present), units.shape[1])
    sums.index_put_((inverse,), units, accumulate=True)
    repeated = per_id[inverse] > 1
    if not bool(repeated.any()):
        return math.nan
    others = sums[inverse[repeated]] - units[repeated]
    cos = (units[repeated] * others).sum(1) / others.norm(dim=1).clamp_min(1e-30)
    return float(cos.mean())


def _log_cos(c: float) -> float:
    return c if math.isnan(c) else math.log(max(c, ALIGN_MIN))


def features(x: torch.Tensor, tokens: torch.Tensor, table: TokenTable, kind: str) -> Message:
    """The message's features against `table`. tokens: (B, T) ids of x's (B, T, width) rows
    (token_keys)."""
    flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
    ids = tokens.detach().reshape(-1).to(device=flat.device, dtype=torch.long)
    if ids.numel() != flat.shape[0]:
        raise ValueError(f"sentinel: {ids.numel()} token ids for {flat.shape[0]} rows")
    rms = float(flat.square().mean().sqrt())
    log_norms = flat.norm(dim=1).clamp_min(1e-30).log()
    units = table.units(flat - flat.mean(0) if CENTRED[kind] else flat)
    values = {
        "log_rms": math.log(max(rms, 1e-30)),
        "log_norm": float(log_norms.mean()) - table.mix_offset(ids),
        "align": _log_cos(table.alignment(units, ids)),
        "coherence": _log_cos(coherence(units, ids)),
    }
    return Message(values, ids, units, log_norms)


@dataclass
class SenderStats:
    """The running statistics of one (sender, kind) stream, and its verdict counts."""

    seen: int = 0  # messages judged or learned (void ones are not counted)
    accepted: int = 0
    dropped: int = 0
    flagged: bool = False
    mean: dict[str, float] = field(default_factory=dict)
    slope: dict[str, float] = field(default_factory=dict)  # the level's trend per message
    learned: dict[str, int] = field(default_factory=dict)  # accepted values per feature
    # |x - predicted| of the last SCALE_WINDOW accepted messages, per feature
    deviations: dict[str, deque[float]] = field(default_factory=dict)
    table: TokenTable | None = None  # per token id: the running direction
    recent: deque[bool] = field(default_factory=deque)  # last verdicts, True = dropped
    since: int = 0  # messages dropped since the last accepted one
    # per norm feature: its value in the first message of the current run of drops
    streak: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    z: dict[str, float]  # per feature; empty during the warm-up
    warmup: bool = False


def trend_steps(since: int) -> float:
    """How many messages of trend the next message is predicted ahead: 1, and while a sender
    is dropped a damped count (Gardner's damped trend, 1 + d + d^2 + ..., d = 1 -
    1/SLOPE_TIME_CONSTANT): an honest drift goes on meanwhile, but a trend taken from a fast
    early phase would overshoot if carried on straight (at most SLOPE_TIME_CONSTANT steps)."""
    damping = 1.0 - 1.0 / SLOPE_TIME_CONSTANT
    return (1.0 - damping ** (since + 1)) / (1.0 - damping)


def predicted(stats: SenderStats, name: str) -> float:
    """The feature's expected value for the next message: the level plus the trend."""
    return stats.mean[name] + stats.slope.get(name, 0.0) * trend_steps(stats.since)


def scale(stats: SenderStats, name: str, kind: str, above: bool) -> float:
    """A feature's scale on one side of its prediction: 1.25 x its recent mean absolute miss,
    at least the floor."""
    devs = stats.deviations.get(name, ())
    mad = sum(devs) / len(devs) if devs else 0.0
    return max(MAD_TO_STD * mad, FLOORS[kind][name][above])


def z_scores(stats: SenderStats, values: dict[str, float], kind: str) -> dict[str, float]:
    out = {}
    for name in FEATURES:
        if name not in stats.mean or math.isnan(values[name]):
            continue
        miss = values[name] - predicted(stats, name)
        out[name] = abs(miss) / scale(stats, name, kind, miss > 0)
    return out


def learn(stats: SenderStats, msg: Message, kind: str, clip: float = math.inf) -> None:
    """Fold an accepted message into the statistics: its deviations join the scale's window,
    then the mean moves (a running mean at first, then an EMA), and its tokens' rows move.
    After the warm-up each miss is clipped at `clip` scales first (a Huber-like update): an
    attacked message that slipped in just under the bound moves the statistics by a bounded
    step, so the next ones are not let in more easily; its token rows are kept out of the
    table if its alignment was off by more than that. An honest shift is still followed, a
    bounded step per message."""
    z = z_scores(stats, msg.values, kind)
    misaligned = any(z.get(name, 0.0) > clip for name in DIRECTIONS)
    for name in FEATURES:
        x = msg.values[name]
        if math.isnan(x):  # align of a message none of whose ids was seen yet
            continue
        n = stats.learned.get(name, 0) + 1
        stats.learned[name] = n
        if name not in stats.mean:
            stats.mean[name] = x
            stats.deviations[name] = deque(maxlen=SCALE_WINDOW)
            continue
        guess = predicted(stats, name)
        bound = clip * scale(stats, name, kind, x > guess)
        miss = min(max(x - guess, -bound), bound)
        stats.deviations[name].append(abs(miss))
        level = stats.mean[name]
        stats.mean[name] = guess + miss / min(n, MEAN_TIME_CONSTANT)
        slope = stats.slope.get(name, 0.0)
        slope_rate = 1.0 / min(n - 1, SLOPE_TIME_CONSTANT)
        step = (stats.mean[name] - level) / trend_steps(stats.since)  # per step across a gap
        stats.slope[name] = slope + slope_rate * (step - slope)
    assert stats.table is not None
    if not misaligned:
        stats.table.learn(msg.units, msg.ids, msg.log_norms)
    stats.accepted += 1
    stats.since = 0


def follow(stats: SenderStats, msg: Message, kind: str, z_max: float) -> None:
    """Fold in what a dropped message whose directions are its sender's can safely teach (once
    FOLLOW_AFTER of them in a row were dropped): its
    tokens' rows, and a step of each norm feature's level towards it of at most FOLLOW_RATE
    (a tenth of it when the miss is beyond FOLLOW_Z x z_max scales) plus the drift per message
    of the dropped run itself away from the prediction (since its first message, `streak`):
    an honest stream that drifts on while it is dropped is caught up with at FOLLOW_RATE a
    message however fast it drifts, so an honest sender is not dropped for good; a steady scaled
    stream does not drift. The scale and the trend are left as they are (the trend goes on
    damped, see trend_steps)."""
    for name in FEATURES:
        x = msg.values[name]
        if name in DIRECTIONS or name not in stats.mean or math.isnan(x):
            continue
        miss = x - predicted(stats, name)
        near = abs(miss) <= FOLLOW_Z * z_max * scale(stats, name, kind, miss > 0)
        drift = (x - stats.streak.get(name, x)) / max(1, stats.since)
        away = max(0.0, drift if miss > 0 else -drift)
        step = (FOLLOW_RATE if near else FOLLOW_RATE / 10) + away
        stats.mean[name] += min(max(miss, -step), step)
    assert stats.table is not None
    stats.table.learn(msg.units, msg.ids, msg.log_norms)


def warmup_messages(warmup: int, lr_warmup_updates: int, per_update: int) -> int:
    """The messages of each sender learned before any verdict: at least `warmup`, and the whole
    learning-rate warm-up (`lr_warmup_updates` updates of `per_update` microbatches each): the
    streams move fastest while the rate ramps up, and a trend learned there does not last."""
    return max(warmup, lr_warmup_updates * per_update)


def judge(
    stats: SenderStats, spec: SentinelSpec, x: torch.Tensor, kind: str, tokens: torch.Tensor
) -> Verdict:
    """The verdict on one received (non-void) tensor of `kind` (activation or gradient) whose
    rows belong to `tokens` (token_keys); updates `stats` (learned only if accepted, counts
    and the flag either way)."""
    if stats.table is None:
        stats.table = TokenTable.empty(x.shape[-1], x.device)
    msg = features(x, tokens, stats.table, kind)
    stats.seen += 1
    if stats.accepted < spec.warmup:
        learn(stats, msg, kind)
        return Verdict(True, {}, warmup=True)
    z = z_scores(stats, msg.values, kind)
    drop = not all(math.isfinite(v) and v <= spec.z_max for v in z.values())
    stats.recent.append(drop)
    while len(stats.recent) > spec.flag_window:
        stats.recent.popleft()
    if drop:
        if stats.since == 0:
            stats.streak = {k: v for k, v in msg.values.items() if k not in DIRECTIONS}
        if stats.since >= FOLLOW_AFTER and all(
            z.get(name, 0.0) <= spec.z_max for name in DIRECTIONS
        ):
            follow(stats, msg, kind, spec.z_max)
        stats.dropped += 1
        stats.since += 1
        stats.flagged = stats.flagged or sum(stats.recent) >= spec.flag_drops
    else:
        learn(stats, msg, kind, LEARN_CLIP)
    return Verdict(not drop, z)


@dataclass
class Sentinel:
    """One receiving cell's book: a SenderStats per (sender, kind)."""

    spec: SentinelSpec
    streams: dict[tuple[str, str], SenderStats] = field(default_factory=dict)

    def check(self, sender: str, kind: str, x: torch.Tensor, tokens: torch.Tensor) -> bool:
        """True: use the tensor; False: drop this microbatch (counted). kind: a key of
        FLOORS (activation, gradient); tokens: the ids of x's rows (token_keys)."""
        if kind not in FLOORS:
            raise ValueError(f"sentinel: kind must be one of {sorted(FLOORS)}, got {kind!r}")
        stats = self.streams.setdefault((sender, kind), SenderStats())
        return judge(stats, self.spec, x, kind, tokens).accepted

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
