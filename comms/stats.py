"""A transport's byte, message, reject and round counters (comms.transport.Transport.stats).

imports: comms only.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from comms.wire import Kind


@dataclass
class TransportStats:
    """Byte and message counters, per peer and message kind; thread-safe via `lock`."""

    bytes_sent: Counter[tuple[str, str]] = field(default_factory=Counter)  # (peer, kind)
    bytes_received: Counter[tuple[str, str]] = field(default_factory=Counter)
    messages_sent: Counter[tuple[str, str]] = field(default_factory=Counter)
    rejects: Counter[str] = field(default_factory=Counter)  # by reason
    rounds: Counter[str] = field(default_factory=Counter)  # by MeanStatus
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_sent(self, peer: str, kind: Kind | str, nbytes: int) -> None:
        k = kind.name.lower() if isinstance(kind, Kind) else kind
        with self.lock:
            self.bytes_sent[(peer, k)] += nbytes
            self.messages_sent[(peer, k)] += 1

    def add_received(self, peer: str, kind: Kind | str, nbytes: int) -> None:
        k = kind.name.lower() if isinstance(kind, Kind) else kind
        with self.lock:
            self.bytes_received[(peer, k)] += nbytes

    def add_reject(self, reason: str) -> None:
        with self.lock:
            self.rejects[reason] += 1

    def sent_by_kind(self) -> dict[str, int]:
        with self.lock:
            out: Counter[str] = Counter()
            for (_, kind), n in self.bytes_sent.items():
                out[kind] += n
            return dict(out)
