"""Run membership: who may talk to us. An HMAC token over (context, PeerID) in every DHT record.

Role: with a run key, a peer's name record (and its cell claims) carry
`token = HMAC-SHA256(key, context | peer_id | signer)`, where context is the run's config
fingerprint and signer the owner marker (hivemind RSA public key) that signs the record. A
receiver accepts a stream only if the sender's record carries the token for the stream's
libp2p-authenticated PeerID, so a peer without the key, or with another config, cannot send
activations, gradients or averaging payloads: its streams are refused and counted. libp2p already
encrypts and authenticates the PeerID (Noise); this adds no cipher, only a keyed check of
membership. A copied token is useless: it names the PeerID it was made for (only the holder of
that PeerID's private key can open streams as it) and the signer of the record it came in (only
the holder of that RSA key can store a record under it, comms.p2p.dht.owner_marker).

Without a run key the token is still over the context with an empty key: it then proves nothing
about membership, but keeps peers of another config out (wrong fingerprint -> refused).

Records: every run record a peer relies on (the run's config, cell claims, replica sessions;
mesh/runtime/registry.py) is sealed with `seal`: an "exp" (the writer's wall clock + the
record's lifetime) and a "sig" = HMAC-SHA256 over the DHT key, the subkey and the canonical
JSON of the value with its exp, under a secret derived from (run key, fingerprint). `unseal`
gives the value back only when its sig is right and its exp (+ CLOCK_SKEW_S) has not passed: a
peer without the key cannot write a record the run reads, nor stretch an old one's life.
`key_check` (published in the config record) is bound to the fingerprint too, so it tells a
joiner whether its key is the run's without revealing the key or the record secret.

Where: a keyed run's records live under DHT keys named after the key (`records_space`: an HMAC
of the run key, so only its holders can name them). A peer without the key cannot write where
members read (no flood of junk subkeys, no plain value that blocks their stores, no config
record stored first); members still read only what unseals. A copy of the config record also
lives at the run id's public key, so a joiner without the key hears that the run needs one.

imports: stdlib only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import dataclass
from typing import Any

# a record is read up to this long after the exp its writer set (peers' wall clocks differ)
CLOCK_SKEW_S = 60.0


def canonical_bytes(value: Any) -> bytes:
    """The bytes a record's signature covers: JSON with sorted keys (the same on both ends
    whatever order MSGPack gave the dict back in). TypeError/ValueError for what JSON cannot
    hold (bytes from a peer's MSGPack)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def signer_of(subkey: str, prefix: str) -> str | None:
    """The owner marker after `prefix` in a DHT record's subkey ("" when unsigned); None when
    the subkey is not `prefix` + marker (a record filed under another name than it carries)."""
    if not subkey.startswith(prefix):
        return None
    rest = subkey[len(prefix) :]
    return rest if rest == "" or (rest.startswith("[owner:") and rest.endswith("]")) else None


def records_space(key: bytes) -> str:
    """The prefix of a run's record keys in the DHT: "" without a run key, else a name only
    holders of the key can make ("k" + 16 hex of an HMAC of the key, and a dot)."""
    if not key:
        return ""
    return "k" + hmac.new(key, b"meshtrain-records-space", hashlib.sha256).hexdigest()[:16] + "."


@dataclass(frozen=True)
class Auth:
    key: bytes  # the run key (b"" when the run has none)
    context: str  # the run's config fingerprint

    @classmethod
    def of(cls, run_key: str | None, context: str) -> Auth:
        return cls((run_key or "").encode(), context)

    @property
    def space(self) -> str:
        """Where this run's records live (records_space)."""
        return records_space(self.key)

    def token(self, peer_id: str, signer: str) -> str:
        msg = f"{self.context}|{peer_id}|{signer}".encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()

    def valid(self, peer_id: str, signer: str, token: object) -> bool:
        return isinstance(token, str) and hmac.compare_digest(token, self.token(peer_id, signer))

    @property
    def key_check(self) -> str:
        """Published with the run's config: a joiner learns whether its key is the run's key
        (and can say so clearly) without the key itself being revealed. Bound to the
        fingerprint: a check copied from one run's record does not fit another config."""
        msg = b"meshtrain-key-check|" + self.context.encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()[:16]

    def _record_secret(self) -> bytes:
        msg = b"meshtrain-records|" + self.context.encode()
        return hmac.new(self.key, msg, hashlib.sha256).digest()

    def record_sig(self, key: str, subkey: str, body: dict[str, Any]) -> str:
        """The signature of a record (body: its value with "exp", without "sig")."""
        msg = b"\0".join([key.encode(), subkey.encode(), canonical_bytes(body)])
        return hmac.new(self._record_secret(), msg, hashlib.sha256).hexdigest()

    def seal(self, key: str, subkey: str, value: dict[str, Any], exp: float) -> dict[str, Any]:
        """value with "exp" and "sig" added: what is stored under key/subkey."""
        body = {**value, "exp": exp}
        return {**body, "sig": self.record_sig(key, subkey, body)}

    def unseal(self, key: str, subkey: str, value: object, now: float) -> dict[str, Any] | None:
        """The record's value (with its exp, without its sig) when it is sealed with this Auth
        for key/subkey and not past its exp; None otherwise (unsigned, forged, another key or
        config, replayed past its life)."""
        if not isinstance(value, dict) or not isinstance(value.get("sig"), str):
            return None
        body = {k: v for k, v in value.items() if k != "sig"}
        exp = body.get("exp")
        if not isinstance(exp, int | float) or isinstance(exp, bool) or not math.isfinite(exp):
            return None
        if now > exp + CLOCK_SKEW_S:
            return None
        try:
            want = self.record_sig(key, subkey, body)
        except (TypeError, ValueError):  # a value JSON cannot hold: not one we wrote
            return None
        return body if hmac.compare_digest(value["sig"], want) else None
