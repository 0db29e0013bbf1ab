"""Exceptions raised by comms (codecs, wire framing, transports).

Role: one small hierarchy so callers can catch "anything comms refused" with `CommsError`
while the specific classes still behave like the builtins they refine (ValueError).
imports: stdlib only (no torch, no mesh, no cli).
"""

from __future__ import annotations


class CommsError(Exception):
    """Base class of every error raised by the comms package."""


class CodecError(CommsError, ValueError):
    """A tensor could not be encoded or decoded (non-finite values, unknown codec, bad sizes)."""


class NotFiniteError(CodecError):
    """NaN or Inf in a tensor to encode, in decoded values, or in received scales."""


class WireError(CommsError, ValueError):
    """A message could not be framed on the sending side (bad name, kind, step, Encoded)."""


class WireReject(CommsError):
    """A received message was refused; raised by `comms.wire.unpack_or_raise`.

    `reason` is the same short stable code as `comms.wire.Reject.reason` (e.g. "bad_magic"),
    so counters and logs can group by it.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class PeerTimeout(CommsError, TimeoutError):
    """A peer did not deliver (or accept) a message before the deadline; it may still be alive."""


class StartTimeout(PeerTimeout):
    """This peer's own transport did not start before its deadline (a loaded machine): no
    neighbour's doing, so no reason to wait for one; the message names the setting to raise."""


class PeerLost(CommsError):
    """The link to a peer is gone: it died, closed its transport, or was cut off as broken."""
