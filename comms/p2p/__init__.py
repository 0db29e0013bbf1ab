"""The hivemind transport: libp2p streams (transport, stream, mailbox), DHT names and records
(dht, auth), group means (mean).

Kept light: comms.p2p.auth is stdlib only and must import without hivemind.
"""
