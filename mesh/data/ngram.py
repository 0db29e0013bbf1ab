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
seconds; pairs do not cross the arrays' ends (a shard's, a text's). Counted CHUNK_TOKENS at a
time, so memory stays bounded whatever the data's size. Pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
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
CHUNK_TOKENS = 1 << 22  # counted at a time: 32 MiB as int64


def _windows(parts: Sequence[np.ndarray], limit: int) -> Iterator[tuple[np.ndarray, int]]:
    """The first `limit` tokens of the parts, CHUNK_TOKENS at a time as int64 (memory stays
    bounded whatever the data's size): (window, fresh). A window after a part's first starts
    with the previous one's last token, so that the pair across the cut is counted once, and
    `fresh` (0 or 1) is where the window's own tokens start."""
    left = limit
    for p in parts:
        n = min(len(p), left)
        left -= n
        for start in range(0, n, CHUNK_TOKENS):
            lo = max(start - 1, 0)
            yield np.asarray(p[lo : min(start + CHUNK_TOKENS, n)], dtype=np.int64), start - lo
        if left <= 0:
            break


class BigramCounts:
    """Unigram and bigram counts of the first `limit` tokens of token arrays over a vocabulary
    of V ids, counted a window at a time."""

    def __init__(
        self, parts: Sequence[np.ndarray], vocab_size: int, limit: int = MAX_COUNT_TOKENS
    ) -> None:
        v = self.vocab = int(vocab_size)
        self.unigram = np.zeros(v, dtype=np.int64)  # c(b)
        self.context = np.zeros(v, dtype=np.int64)  # c(a): pairs starting at a
        dense = np.zeros(v * v, dtype=np.int64) if v * v <= DENSE_PAIRS else None
        self.codes = np.zeros(0, dtype=np.int64)  # sorted pair codes a * V + b, and their counts
        self.counts = np.zeros(0, dtype=np.int64)
        for window, fresh in _windows(parts, limit):
            self.unigram += np.bincount(window[fresh:], minlength=v)
            if len(window) < 2:
                continue
            self.context += np.bincount(window[:-1], minlength=v)
            pair_codes = window[:-1] * v + window[1:]
            if dense is not None:
                dense += np.bincount(pair_codes, minlength=v * v)
            else:
                self._merge(*np.unique(pair_codes, return_counts=True))
        if dense is not None:
            self.codes = np.flatnonzero(dense)
            self.counts = dense[self.codes]
        self.tokens = int(self.unigram.sum())
        self.followers = np.bincount(self.codes // v, minlength=v)  # n(a)

    def _merge(self, codes: np.ndarray, counts: np.ndarray) -> None:
        both, at = np.unique(np.concatenate([self.codes, codes]), return_inverse=True)
        merged = np.zeros(len(both), dtype=np.int64)
        np.add.at(merged, at, np.concatenate([self.counts, counts]))
        self.codes, self.counts = both, merged

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


def cross_entropy(
    counts: BigramCounts, parts: Sequence[np.ndarray], limit: int = MAX_EVAL_TOKENS
) -> tuple[float, float, int]:
    """(unigram, bigram) cross-entropy in nats per token over the first `limit` tokens of the
    parts, and the tokens predicted: the unigram predicts every token, the bigram every token
    after a part's first (its first token is predicted by the unigram, so both average over the
    same tokens)."""
    uni_sum, bi_sum, n = 0.0, 0.0, 0
    for window, fresh in _windows(parts, limit):
        if len(window) <= fresh:
            continue
        uni = -np.log(counts.unigram_prob(window[fresh:]))
        uni_sum += float(uni.sum())
        if fresh == 0:  # a part's first token: no context
            bi_sum += float(uni[0])
        bi_sum += float(-np.log(counts.bigram_prob(window[:-1], window[1:])).sum())
        n += len(window) - fresh
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
    counts = BigramCounts(train, vocab_size, MAX_COUNT_TOKENS)
    uni, bi, n = cross_entropy(counts, val)
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
