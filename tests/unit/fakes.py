"""Stand-ins for unit tests of pure logic (the real things run in tests/integration)."""


class FakeDirectory:
    """A dict standing in for the DHT (the real one is exercised in tests/integration)."""

    def __init__(self):
        self.data = {}
        self.answer = True

    def dht_store(self, key, subkey, value, ttl_s, timeout_s=None):
        self.data.setdefault(key, {})[subkey] = value
        return True

    owner_marker = "[owner:test]"

    def dht_get(self, key, timeout_s=None):
        if not self.answer:
            return None
        return {k: v for k, v in self.data.get(key, {}).items() if v is not None}
