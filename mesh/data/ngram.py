"""Reference points in the data: the validation split's unigram and bigram cross-entropy, with
counts from the training split. A model's validation loss means little until it sits well below
the bigram's (a model between the two has learned little beyond token frequencies), so `data
prepare` records both in the manifest and the reports print them beside the loss.

Smoothing (SMOOTHING, recorded with the numbers):
- unigram: add-one, p(b) = (c(b) + 1) / (N + V), so every id of the vocabulary has mass;
- bigram: interpolated absolute discounting with the add-one unigram as its backoff,
  p(b | a) = max(c(a, b) - D, 0) / c(a) + D * n(a) / c(a) * p(b), D = 0.75 and n(a) the number
  of distinct ids seen after a; a context never seen in training (c(a) = 0) is p(b).
Both are proper distributions over the vocabulary, so an unseen pair or id costs a finite loss.

Counts are taken over at most MAX_COUNT_TOKENS training tokens (the first ones; recorded), and
the cross-entropy over at most MAX_EVAL_TOKENS validation tokens, so a large dataset costs a few
seconds; pairs do not cross the arrays' ends (a shard's, a text's). Pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

DISCOUNT = 0.75
SMOOTHING = (
    "unigram add-one; bigram interpolated absolute discounting (D = 0.75) with the add-one "
    "unigram as backoff; counts from the train split"
)
MAX_COUNT_TOKENS = 1 << 26
MAX_EVAL_TOKENS = 1 << 24
DENSE_PAIRS = 1 << 20  # V * V up to this: pair counts by bincount, else by sorting pair codes


def _take(parts: Sequence[np.ndarray], limit: int) -> list[np.ndarray]:
    """The first `limit` tokens of the parts, as int64 arrays (pairs stay inside each)."""
    out, left = [], limit
    for p in parts:
        if left <= 0:
            break
        out.append(np.asarray(p[:left], dtype=np.int64))
        left -= len(out[-1])
    return out


class BigramCounts:
    """Unigram and bigram counts of token arrays over a vocabulary of V ids."""

    def __init__(self, parts: Sequence[np.ndarray], vocab_size: int) -> None:
        v = self.vocab = int(vocab_size)
        self.unigram = np.zeros(v, dtype=np.int64)  # c(b)
        self.context = np.zeros(v, dtype=np.int64)  # c(a): pairs starting at a
        codes = []
        for p in parts:
            self.unigram += np.bincount(p, minlength=v)
            if len(p) > 1:
                self.context += np.bincount(p[:-1], minlength=v)
                codes.append(p[:-1] * v + p[1:])
        self.tokens = int(self.unigram.sum())
        pair_codes = np.concatenate(codes) if codes else np.zeros(0, dtype=np.int64)
        if v * v <= DENSE_PAIRS:
            dense = np.bincount(pair_codes, minlength=v * v)
            self.codes = np.flatnonzero(dense)
            self.counts = dense[self.codes]
        else:
            self.codes, self.counts = np.unique(pair_codes, return_counts=True)
        self.followers = np.bincount(self.codes // v, minlength=v)  # n(a)

    def unigram_prob(self, b: np.ndarray) -> np.ndarray:
        return (self.unigram[b] + 1.0) / (self.tokens + self.vocab)

    def pair_count(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        want = a * self.vocab + b
        at = np.minimum(np.searchsorted(self.codes, want), max(len(self.codes) - 1, 0))
        if not len(self.codes):
            return np.zeros(len(want), dtype=np.int64)
        return np.where(self.codes[at] == want, self.counts[at], 0)

    def bigram_prob(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        ctx = self.context[a].astype(np.float64)
        seen = ctx > 0
        safe = np.where(seen, ctx, 1.0)
        kept = np.maximum(self.pair_count(a, b) - DISCOUNT, 0.0) / safe
        backoff = DISCOUNT * self.followers[a] / safe
        uni = self.unigram_prob(b)
        return np.where(seen, kept + backoff * uni, uni)


def cross_entropy(counts: BigramCounts, parts: Sequence[np.ndarray]) -> tuple[float, float, int]:
    """(unigram, bigram) cross-entropy in nats per token over the parts, and the tokens
    predicted: the unigram predicts every token, the bigram every token after a part's first
    (its first token is predicted by the unigram, so both average over the same tokens)."""
    uni_sum, bi_sum, n = 0.0, 0.0, 0
    for p in parts:
        if not len(p):
            continue
        uni = -np.log(counts.unigram_prob(p))
        uni_sum += float(uni.sum())
        bi_sum += float(uni[0]) + float(-np.log(counts.bigram_prob(p[:-1], p[1:])).sum())
        n += len(p)
    if n == 0:
        return math.nan, math.nan, 0
    return uni_sum / n, bi_sum / n, n


def ngram_reference(
    train: Sequence[np.ndarray],
    val: Sequence[np.ndarray],
    vocab_size: int,
    val_bytes_per_token: float,
) -> dict[str, Any]:
    """The validation split's unigram and bigram cross-entropy with counts from `train`: in
    nats per token and in bits per byte of text (what the manifest and the reports carry)."""
    counts = BigramCounts(_take(train, MAX_COUNT_TOKENS), vocab_size)
    uni, bi, n = cross_entropy(counts, _take(val, MAX_EVAL_TOKENS))
    as_bpb = lambda nats: nats / (math.log(2) * val_bytes_per_token)  # noqa: E731
    return {
        "smoothing": SMOOTHING,
        "train_tokens_counted": counts.tokens,
        "val_tokens": n,
        "unigram": {"nats_per_token": round(uni, 6), "bits_per_byte": round(as_bpb(uni), 6)},
        "bigram": {"nats_per_token": round(bi, 6), "bits_per_byte": round(as_bpb(bi), 6)},
    }


def well_formed(entry: Any) -> bool:
    """Whether a manifest's ngram_ce entry holds the numbers the reports read."""
    if not isinstance(entry, dict):
        return False
    for key in ("unigram", "bigram"):
        sub = entry.get(key)
        if not isinstance(sub, dict):
            return False
        for unit in ("nats_per_token", "bits_per_byte"):
            x = sub.get(unit)
            if not isinstance(x, int | float) or isinstance(x, bool) or not math.isfinite(x):
                return False
    return True


# The rule every study is read by: its reference arm must end at least 15% below the data's
# bigram cross-entropy (loss / bigram <= RULE_RATIO); a study above it measured a model that
# has learned little beyond token frequencies, and says so.
RULE_RATIO = 0.85
EARLY = "early-training regime"


def to_bigram(val_loss: float | None, entry: dict[str, Any] | None) -> float | None:
    """A validation loss (nats per token) as a share of the data's bigram cross-entropy."""
    if val_loss is None or entry is None or not math.isfinite(val_loss):
        return None
    return round(val_loss / entry["bigram"]["nats_per_token"], 4)


def regime(ratio: float | None) -> str:
    """What a reference's ratio to the bigram says of the study (the rule, RULE_RATIO)."""
    if ratio is None:
        return "n/a"
    return "passes the rule" if ratio <= RULE_RATIO else EARLY


def beside_loss(val_loss: float | None, entry: dict[str, Any] | None) -> dict[str, Any]:
    """The fields a report carries beside a validation loss: the data's unigram and bigram
    cross-entropy (nats per token, bits per byte) and the loss's ratio to the bigram's."""
    if entry is None:
        return {}
    return {
        "data_unigram_ce": entry["unigram"]["nats_per_token"],
        "data_bigram_ce": entry["bigram"]["nats_per_token"],
        "data_unigram_bpb": entry["unigram"]["bits_per_byte"],
        "data_bigram_bpb": entry["bigram"]["bits_per_byte"],
        "val_loss_to_bigram": to_bigram(val_loss, entry),
    }


def reference_line(entry: dict[str, Any] | None, unit: str = "nats/token") -> str:
    """`unigram 3.32, bigram 2.49 nats/token (4.79, 3.60 bits/byte)`: one line for a table."""
    if entry is None:
        return "the data's unigram and bigram cross-entropy: n/a"
    u, b = entry["unigram"], entry["bigram"]
    return (
        f"the data's validation cross-entropy, counts from its train split: unigram "
        f"{u['nats_per_token']:.3f}, bigram {b['nats_per_token']:.3f} {unit} "
        f"({u['bits_per_byte']:.3f}, {b['bits_per_byte']:.3f} bits/byte)"
    )
