import tomllib
from pathlib import Path
from typing import get_args

import pytest

from mesh.config import ConfigError, DPConfig, config_from_dict, load_config, with_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_roundtrip_through_toml(tmp_path):
    cfg = load_config()
    path = tmp_path / "resolved.toml"
    path.write_text(cfg.to_toml())
    assert load_config([path]) == cfg
    assert load_config([path]).fingerprint() == cfg.fingerprint()


def test_every_shipped_config_loads():
    files = sorted((ROOT / "configs").glob("**/*.toml"))
    assert files, "configs/ holds at least the default demo"
    for f in files:
        load_config([f])


def test_files_then_overrides_precedence(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("[grid]\nstages = 2\nreplicas = 3\n")
    b.write_text("[grid]\nstages = 4\n")
    cfg = load_config([a, b], ["grid.replicas=5", "optim.lr=3e-4", "dp.codec=bf16"])
    assert (cfg.grid.stages, cfg.grid.replicas) == (4, 5)
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.dp.codec == "bf16"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["grid.stage=4"], "grid.stage: unknown key"),
        (["grid.stage=4"], "did you mean grid.stages"),
        (["grid.stages=x"], "grid.stages"),
        (["dp.fraction=0"], "dp.fraction"),
        (["dp.fraction=1.5"], "dp.fraction"),
        (["grid.stages=9"], "grid.stages (9) > model.n_layers (8)"),
        (["model.n_heads=5"], "model.n_heads"),
        (["pipeline.schedule=2bw", "pipeline.microbatches=2"], "pipeline.microbatches"),
        (["pipeline.schedule=zigzag"], "pipeline.schedule"),
        (["dp.mode=grad_allreduce"], "dp.mode"),
        (["noequals"], "expected key=value"),
    ],
)
def test_user_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config([], overrides)
    assert needle in str(e.value)


def test_unknown_key_in_file_names_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[optim]\nlearning_rate = 1.0\n")
    with pytest.raises(ConfigError, match=r"optim.learning_rate: unknown key \(from .*bad.toml\)"):
        load_config([f])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config([tmp_path / "nope.toml"])
    f = tmp_path / "broken.toml"
    f.write_text("[grid\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config([f])


def test_fingerprint_ignores_local_settings_only():
    cfg = load_config()
    assert with_overrides(cfg, {"run.threads": 2}).fingerprint() == cfg.fingerprint()
    assert with_overrides(cfg, {"dp.tau": 7}).fingerprint() != cfg.fingerprint()


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises its own ValidationError
        cfg.grid.stages = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("optim.learning_rate", "optim.lr"),  # a synonym, not the nearest spelling
        ("model.hidden_size", "model.d_model"),
        ("run.max_steps", "run.steps"),
        ("lr", "optim.lr"),  # the leaf alone: the one section that has it
        ("dp.tua", "dp.tau"),  # no synonym: the closest spelling
    ],
)
def test_unknown_key_suggests_what_was_meant(typo, meant):
    with pytest.raises(ConfigError, match=f"did you mean {meant}\\?"):
        load_config([], [f"{typo}=1"])


def test_fingerprints_of_configs_that_predate_later_keys_are_pinned():
    """A key added to a section must not change the fingerprint of the runs and checkpoints of
    configs that never set it (LATER_KEYS): the default config hashed this way before any of
    them. The hash includes torch's minor version, which CI pins."""
    import torch

    if not torch.__version__.startswith("2.13."):
        pytest.skip("pinned for torch 2.13, the version CI installs")
    # payload_error_feedback's default changed to on: off, it hashes away (HASHED_AWAY_AT);
    # index_map came with a new default: the old map, permutation, hashes away
    # the depth rule off: from its P = 4 rule on, the default 4-stage grid trains other numbers
    before = {
        "dp.payload_error_feedback": False,
        "dp.index_map": "permutation",
        "optim.depth_rule": "off",
    }
    old = with_overrides(load_config([]), before)
    assert old.fingerprint() == "05fa7fa63e712496"
    cfg = with_overrides(old, {"dp.lambda_clock": "steps", "dp.lambda_hold_arrivals": 50})
    assert cfg.fingerprint() == "05fa7fa63e712496"
    assert with_overrides(cfg, {"dp.lambda_clock": "arrivals"}).fingerprint() != cfg.fingerprint()
    fed = with_overrides(cfg, {"dp.payload_error_feedback": True})
    assert fed.fingerprint() != cfg.fingerprint()  # a run with it is another run (not reused)
    keyed = with_overrides(fed, {"dp.index_map": "keyed"})
    unruled = with_overrides(load_config([]), {"optim.depth_rule": "off"})
    assert unruled.fingerprint() == keyed.fingerprint()  # the default now, the rule off
    assert load_config([]).fingerprint() != keyed.fingerprint()  # with it: another run
    # a lossless codec: the feedback changes no number, so the fp32 runs keep their hash
    fp32 = with_overrides(old, {"dp.codec": "fp32"})
    assert with_overrides(fp32, {"dp.payload_error_feedback": True}).fingerprint() == (
        fp32.fingerprint()
    )


def test_index_map_hashes_away_at_the_old_map_and_where_it_picks_nothing():
    """dp.index_map = permutation is the map every run used before the key: such a config keeps
    its fingerprint (and its checkpoints), while keyed, the new default, averages other
    coordinates and so is another run. Where no partition round picks coordinates, the map
    changes no number and no fingerprint."""
    from mesh.algo.sparse import INDEX_MAPS

    assert get_args(DPConfig.model_fields["index_map"].annotation) == INDEX_MAPS
    old = with_overrides(load_config([]), {"dp.index_map": "permutation"})
    assert load_config([]).fingerprint() != old.fingerprint()  # the default, keyed: another run
    for overrides in (
        {"dp.selector": "bernoulli"},
        {"dp.fraction": 1.0},
        {"dp.mode": "grad_allreduce", "pipeline.schedule": "gpipe"},
        {"dp.mode": "none"},
        {"grid.replicas": 1},
    ):
        before = with_overrides(old, overrides)
        assert with_overrides(before, {"dp.index_map": "keyed"}).fingerprint() == (
            before.fingerprint()
        ), overrides
    with pytest.raises(ConfigError, match="dp.index_map"):
        load_config([], ["dp.index_map=shuffled"])


def test_model_keys_added_later_keep_old_fingerprints_at_their_defaults():
    cfg = load_config([])
    spelled = with_overrides(cfg, {"model.arch": "gpt", "model.rope_theta": 10000.0})
    assert spelled.fingerprint() == cfg.fingerprint()
    assert with_overrides(cfg, {"runtime.precision": "bf16"}).fingerprint() == cfg.fingerprint()
    llama = with_overrides(cfg, {"model.arch": "llama"})
    assert llama.fingerprint() != cfg.fingerprint()
    assert with_overrides(llama, {"model.rope_theta": 5e5}).fingerprint() != llama.fingerprint()


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.n_kv_heads=2"], "model.n_kv_heads only applies to model.arch = 'llama'"),
        (["model.arch='llama'", "model.n_kv_heads=3"], "not divisible by model.n_kv_heads"),
        (["model.arch='llama'", "model.d_model=36", "model.n_heads=4"], "odd"),
        (["model.arch='gpt2'"], "model.arch"),
        (["runtime.precision='fp16'"], "runtime.precision"),
    ],
)
def test_model_family_mistakes_name_the_key(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config([], overrides)


def test_removed_mean_path_key_says_so_and_old_run_configs_still_load(tmp_path):
    """runtime.mean_path is gone (issue 16): asking for the averager path is a one-line error
    naming the key; "direct", which every run's config.toml of that time spells out, loads."""
    with pytest.raises(ConfigError, match=r"^runtime\.mean_path = 'averager': removed .*delete"):
        load_config([], ['runtime.mean_path="averager"'])
    stored = tmp_path / "config.toml"  # as a run of that time wrote it
    stored.write_text(
        load_config().to_toml().replace("[runtime]\n", '[runtime]\nmean_path = "direct"\n')
    )
    assert 'mean_path = "direct"' in stored.read_text()
    assert load_config([stored]) == load_config()
    assert "mean_path" not in load_config().to_toml()


# a run's config.toml as the single [runtime] table wrote it (every key of that table)
OLD_RUNTIME_TABLE = """
[runtime]
backend = "hivemind"
timeout_s = 45.0
round_timeout_s = 12.0
host = "127.0.0.2"
dht_mode = "client"
device = "cpu"
rejoin_timeout_s = 90.0
max_restarts = 2
heartbeat_s = 0.5
max_lag_steps = 7
poison = ["s0r1=-1000"]
pipeline_poison = ["s1r0=flip@3"]
sentinel = false
sentinel_warmup = 16
sentinel_z = 6.0
sentinel_flag_drops = 4
checkpoint_every = 9
compute = "emulated"
forward_ms = 3.0
backward_ms = 6.0
slowdowns = ["s1r1=2.0"]
link = "wan100"
link_bandwidth_mbps = 50.0
link_latency_ms = 30.0
link_shared = "pipeline"
precision = "bf16"
malloc_arenas = 1
trim_every_s = 30.0
tensorboard = true
prometheus_port = 9100
"""
NEW_SECTIONS = [
    "transport.backend='hivemind'",
    "transport.recv_timeout_s=45",
    "transport.start_timeout_s=45",
    "elastic.state_timeout_s=45",
    "transport.round_timeout_s=12",
    "transport.host='127.0.0.2'",
    "transport.dht_mode='client'",
    "runtime.device='cpu'",
    "elastic.rejoin_timeout_s=90",
    "elastic.max_restarts=2",
    "elastic.heartbeat_s=0.5",
    "elastic.max_lag_steps=7",
    "faults.poison=['s0r1=-1000']",
    "faults.pipeline_poison=['s1r0=flip@3']",
    "sentinel.enabled=false",
    "sentinel.warmup=16",
    "sentinel.z=6.0",
    "sentinel.flag_drops=4",
    "checkpoint.every=9",
    "emulation.compute='emulated'",
    "emulation.forward_ms=3.0",
    "emulation.backward_ms=6.0",
    "emulation.slowdowns=['s1r1=2.0']",
    "transport.link='wan100'",
    "transport.link_bandwidth_mbps=50.0",
    "transport.link_latency_ms=30.0",
    "transport.link_shared='pipeline'",
    "runtime.precision='bf16'",
    "runtime.malloc_arenas=1",
    "runtime.trim_every_s=30.0",
    "metrics.tensorboard=true",
    "metrics.prometheus_port=9100",
]


def test_an_old_runtime_table_loads_into_the_new_sections_with_a_notice(tmp_path, capfd):
    """The keys of the one [runtime] table moved to sections by concern: an old run's
    config.toml (and an older peer's config tree) loads with every value in its new place, one
    line a moved key on stderr, and the same fingerprint: the local sections, as [runtime]
    was, stay out of it."""
    import mesh.config_keys as keys

    keys._NOTICED.clear()
    grid = ["grid.stages=2", "grid.replicas=2"]
    stored = tmp_path / "config.toml"
    stored.write_text(OLD_RUNTIME_TABLE)
    old = load_config([stored], grid)
    new = load_config([], [*grid, *NEW_SECTIONS])
    assert old == new
    assert old.fingerprint() == new.fingerprint() == load_config([], grid).fingerprint()
    notices = capfd.readouterr().err.splitlines()
    assert len(notices) == 26, notices  # one per moved key; device and the memory keys stayed
    timeout = [n for n in notices if "config key runtime.timeout_s is now " in n]
    assert "transport.recv_timeout_s and transport.start_timeout_s and elastic.state" in timeout[0]
    assert all(line.endswith("it still works") for line in notices)
    assert load_config([stored], grid) == old and not capfd.readouterr().err  # once a process
    # a tree an older peer sent (the DHT's run config), and a new key given beside its old one
    tree = tomllib.loads(OLD_RUNTIME_TABLE)
    assert config_from_dict({"grid": {"stages": 2, "replicas": 2}, **tree}) == new
    both = load_config([], ["runtime.sentinel_z=3", "sentinel.z=5"])
    assert both.sentinel.z == 5  # later wins, as for any key
    written = new.to_toml()  # in the new layout: no key of the old table is written again
    assert "\n[transport]\n" in written and "\ntimeout_s =" not in written


def test_the_dht_mode_reaches_a_hivemind_cells_transport():
    from comms.build import HivemindOptions, TorchOptions
    from mesh.runtime.wiring import backend_options

    hive = ["transport.backend=hivemind"]
    opts = backend_options(load_config([], hive), 0, 0, None)
    assert isinstance(opts, HivemindOptions) and opts.dht_client is False
    client = load_config([], [*hive, "transport.dht_mode=client"])
    assert backend_options(client, 0, 0, None).dht_client is True
    # torch: no DHT at all, the cell's links
    assert isinstance(backend_options(load_config([], []), 0, 0, None), TorchOptions)
    with pytest.raises(ConfigError, match="transport.dht_mode"):
        load_config([], [*hive, "transport.dht_mode=relay"])


def test_subset_block_hashes_away_at_one_and_needs_the_keyed_partition():
    from mesh.config import load_config

    base = load_config([], [])
    assert base.state_fingerprint() == load_config([], ["dp.subset_block=1"]).state_fingerprint()
    assert base.state_fingerprint() != load_config([], ["dp.subset_block=64"]).state_fingerprint()
    with pytest.raises(ConfigError, match="dp.subset_block"):
        load_config([], ["dp.subset_block=64", "dp.index_map='permutation'"])


def test_every_named_choice_is_defined_once_and_the_config_offers_it():
    """mesh/choices.py is where a choice is added: the implementing tables hold exactly its
    names, and the config's fields accept exactly them."""
    from comms import codecs, throttle
    from comms.build import BACKENDS
    from mesh import choices
    from mesh.algo import schedule, sparse
    from mesh.model.build import FAMILIES

    assert set(throttle.PROFILES) == set(choices.LINKS) - {"none"}
    assert set(FAMILIES) == set(choices.ARCHS)
    assert set(codecs.CODECS) == {*choices.DP_CODECS, *choices.PIPELINE_CODECS}
    assert "int4_hadamard" not in choices.DP_CODECS and BACKENDS == choices.BACKENDS
    assert schedule.SCHEDULES is choices.SCHEDULES and sparse.SELECTORS is choices.SELECTORS
    for name in choices.OPTIMIZERS:
        load_config([], [f"optim.name={name!r}"])
    with pytest.raises(ConfigError, match="optim.name"):
        load_config([], ["optim.name='sgd'"])
    fields = {
        "pipeline.schedule": choices.SCHEDULES,
        "pipeline.codec": choices.PIPELINE_CODECS,
        "pipeline.boundary": choices.BOUNDARIES,
        "dp.codec": choices.DP_CODECS,
        "dp.correction": choices.CORRECTIONS,
        "dp.aggregate": choices.AGGREGATES,
        "transport.backend": choices.BACKENDS,
        "transport.link": choices.LINKS,
    }
    for key, names in fields.items():
        section, field = key.split(".")
        model = type(getattr(load_config([], []), section))
        assert model.model_json_schema()["properties"][field]["enum"] == list(names), key


def test_a_resume_may_change_every_local_section_and_no_training_key(tmp_path):
    """`simulate --resume` takes the local sections (how the peer connects, saves, guards):
    they never change the math so far; a training key is refused, named. An old run's
    config.toml (one [runtime] table) resumes as well."""
    from cli.preflight import resume_config

    run = tmp_path / "run"
    (run / "checkpoints" / "0-0").mkdir(parents=True)
    (run / "checkpoints" / "0-0" / "step-00000004.pt").write_bytes(b"")
    # as `simulate` writes it: the schedules' horizon resolved
    (run / "config.toml").write_text(load_config([], ["run.schedule_steps=300"]).to_toml())
    local = [
        "transport.recv_timeout_s=5",
        "sentinel.z=3",
        "checkpoint.every=2",
        "elastic.max_restarts=0",
        "emulation.slowdowns=['s1r0=2']",
        "metrics.tensorboard=true",
        "faults.poison=['s0r0=-1']",
        "runtime.precision='bf16'",
    ]
    stored, new = resume_config(run, [], local)
    assert (new.sentinel.z, new.checkpoint.every) == (3, 2)
    assert new.state_fingerprint() == stored.state_fingerprint()
    with pytest.raises(ConfigError, match=r"run: dp\.tau would change the math"):
        resume_config(run, [], [*local, "dp.tau=3"])
    grid = "[grid]\nstages = 2\nreplicas = 2\n[run]\nschedule_steps = 300\n"
    (run / "config.toml").write_text(OLD_RUNTIME_TABLE + grid)
    stored, new = resume_config(run, [], ["sentinel.z=3"])
    assert (stored.sentinel.z, new.sentinel.z, new.transport.backend) == (6.0, 3.0, "hivemind")


def test_pool_affinity_is_on_by_default_keeps_fingerprints_and_refuses_a_ratio_below_one():
    """Pools keep a microbatch on its replica's cells by default (1.5). Off, every hop by load,
    was the behaviour before the key, so it hashes away: a pools run from then resumes with its
    fingerprint. Fixed wiring and seeded pools never read the key, so their hash is the same
    at any value (the pinned fingerprints above stay)."""
    pools = load_config([], ["pipeline.routing='pools'"])
    assert pools.pipeline.pool_affinity == 1.5
    off = with_overrides(pools, {"pipeline.pool_affinity": 0.0})
    assert off.fingerprint() != pools.fingerprint()  # other routing: another run
    assert with_overrides(pools, {"pipeline.pool_affinity": 1.5}).fingerprint() == (
        pools.fingerprint()
    )  # a config that wrote 1.5 before it was the default is the same run
    on = with_overrides(pools, {"pipeline.pool_affinity": 2.0})
    assert on.fingerprint() != pools.fingerprint()
    for other in ({"pipeline.routing": "fixed"}, {"pipeline.pool_choice": "seeded"}):
        cfg = with_overrides(pools, other)
        assert with_overrides(cfg, {"pipeline.pool_affinity": 0.0}).fingerprint() == (
            cfg.fingerprint()
        ), other
    with pytest.raises(ConfigError, match="pool_affinity"):
        load_config([], ["pipeline.routing='pools'", "pipeline.pool_affinity=0.5"])
