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

imports: stdlib only.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass


def signer_of(subkey: str, prefix: str) -> str | None:
    """The owner marker after `prefix` in a DHT record's subkey ("" when unsigned); None when
    the subkey is not `prefix` + marker (a record filed under another name than it carries)."""
    if not subkey.startswith(prefix):
        return None
    rest = subkey[len(prefix) :]
    return rest if rest == "" or (rest.startswith("[owner:") and rest.endswith("]")) else None


@dataclass(frozen=True)
class Auth:
    key: bytes  # the run key (b"" when the run has none)
    context: str  # the run's config fingerprint

    @classmethod
    def of(cls, run_key: str | None, context: str) -> Auth:
        return cls((run_key or "").encode(), context)

    def token(self, peer_id: str, signer: str) -> str:
        msg = f"{self.context}|{peer_id}|{signer}".encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()

    def valid(self, peer_id: str, signer: str, token: object) -> bool:
        return isinstance(token, str) and hmac.compare_digest(token, self.token(peer_id, signer))

    @property
    def key_check(self) -> str:
        """Published with the run's config: a joiner learns whether its key is the run's key
        (and can say so clearly) without the key itself being revealed."""
        return hmac.new(self.key, b"meshtrain-key-check", hashlib.sha256).hexdigest()[:16]
