"""Which cell a join claims: free cells in grid order, its own checkpointed cells first."""

import pytest
from fakes import FakeDirectory

import cli.join as join
from mesh.config import load_config
from mesh.runtime.registry import CellRecord, Registry


@pytest.fixture(autouse=True)
def no_settle(monkeypatch):
    monkeypatch.setattr(join, "CLAIM_SETTLE_S", 0.0)  # no concurrent claimer in these tests


def grid():
    return load_config([], ["grid.stages=2", "grid.replicas=2", "model.n_layers=2"])


def test_free_cells_in_grid_order_then_a_full_grid_is_a_clear_error():
    d = FakeDirectory()
    cfg = grid()
    claims = []
    for k in range(4):
        reg = Registry(d.joined(f"[owner:{k}]"), None, 60.0)
        claims.append(join.claim_cell(reg, cfg, f"peer{k}", None)[:2])
    assert claims == [(0, 0), (1, 0), (0, 1), (1, 1)]
    with pytest.raises(join.JoinError, match="no free cell"):
        join.claim_cell(Registry(d.joined("[owner:late]"), None, 60.0), cfg, "late", None)


def test_a_peer_takes_back_the_cell_it_has_checkpoints_of(tmp_path):
    cfg = grid()
    ckpt = tmp_path / "checkpoints"
    for cell, step in [("1-1", 40), ("0-1", 30)]:
        (ckpt / cell).mkdir(parents=True)
        (ckpt / cell / f"step-{step:08d}.pt").write_bytes(b"")
    assert join.saved_cells(cfg, tmp_path, "run") == [(1, 1), (0, 1)]
    d = FakeDirectory()
    other = Registry(d.joined("[owner:o]"), None, 60.0)
    other.beat(CellRecord("s1r1", "o", 5, 1.0, 0, 9, 0.0, 1.0, None))  # taken: the next one
    reg = Registry(d, None, 60.0)
    got = join.claim_cell(reg, cfg, "me", None, join.saved_cells(cfg, tmp_path, "run"))
    assert got[:2] == (0, 1)
    # --stage limits the preference to that stage
    reg2 = Registry(d.joined("[owner:s]"), None, 60.0)
    assert join.claim_cell(reg2, cfg, "s", 1, [(0, 1)])[:2] == (1, 0)


def test_a_placeholder_is_handed_over_only_to_a_running_claim_of_another_peer():
    from cli.claim_keeper import handed_over
    from mesh.runtime.registry import CLAIMING

    placeholder = CellRecord("s0r0", "scout", CLAIMING, 10.0, 0, 0, 0.0, 10.0, None)
    cell = CellRecord("s0r0", "cell", 7, 10.0 - 1e-3, 0, 0, 0.0, 11.0, None)
    rival = CellRecord("s0r0", "rival", CLAIMING, 9.0, 0, 0, 0.0, 11.0, None)
    assert not handed_over(None, placeholder)  # the DHT did not answer
    assert not handed_over({}, placeholder)
    assert not handed_over({"s0r0": placeholder}, placeholder)
    assert not handed_over({"s0r0": rival}, placeholder)  # another join's placeholder: not up
    assert not handed_over({"s1r0": cell}, placeholder)
    assert handed_over({"s0r0": cell}, placeholder)


def test_a_claim_that_loses_to_an_earlier_one_says_so_and_takes_the_next_cell(capsys):
    """A rival's earlier claim of s0r0 reaches the DHT after ours (a loaded DHT's late store):
    our claim is withdrawn, one line says why, and the next free cell is taken."""

    class LateRival(FakeDirectory):
        def joined(self, marker):
            return LateRival(marker, self.data)

        def dht_store(self, key, subkey, value, ttl_s, timeout_s=None):
            stored = super().dht_store(key, subkey, value, ttl_s, timeout_s)
            if subkey.startswith("s0r0/me") and value is not None and not rival:
                reg = Registry(self.joined("[owner:rival]"), None, 60.0)
                token = reg.token("rival")
                rival.append(CellRecord("s0r0", "rival", 0, 1.0, 0, -1, 0.0, 1.0, token))
                reg.beat(rival[0], 60.0)  # claimed at t = 1, long before us
            return stored

    rival: list[CellRecord] = []
    d = LateRival()
    got = join.claim_cell(Registry(d.joined("[owner:me]"), None, 60.0), grid(), "me", None)
    assert got[:2] == (1, 0)
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["s0r0: claimed earlier by another join; trying the next free cell"]
