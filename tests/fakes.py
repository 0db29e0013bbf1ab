"""Stand-ins for unit tests of pure logic (the real things run in tests/integration)."""


class FakeDirectory:
    """A dict standing in for the DHT (the real one is exercised in tests/integration). Each
    instance is one process with its own owner marker; `joined(other)` shares other's records.
    Like hivemind's RSASignatureValidator, it refuses a store under another process's marker."""

    def __init__(self, marker="[owner:test]", data=None):
        self.data = {} if data is None else data
        self.answer = True
        self.owner_marker = marker
        self.reads: dict[str, int] = {}  # key -> reads through this instance

    def joined(self, marker):
        return FakeDirectory(marker, self.data)

    def dht_store(self, key, subkey, value, ttl_s, timeout_s=None):
        if "[owner:" in subkey and not subkey.endswith(self.owner_marker):
            return False
        self.data.setdefault(key, {})[subkey] = value
        return True

    def dht_get(self, key, timeout_s=None):
        self.reads[key] = self.reads.get(key, 0) + 1
        if not self.answer:
            return None
        return {k: v for k, v in self.data.get(key, {}).items() if v is not None}

    def dht_get_many(self, keys, timeout_s=None, withdrawn=False):
        out = []
        for key in keys:
            found = self.dht_get(key, timeout_s)  # counts the read (None: no answer)
            if found is not None and withdrawn:  # with the withdrawn subkeys (value None)
                found = dict(self.data.get(key, {}))
            out.append(found)
        return out
