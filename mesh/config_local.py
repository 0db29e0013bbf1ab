"""The config's local sections: what each peer sets for itself (how it connects, recovers,
emulates compute, is attacked in a test, guards its pipeline, saves and reports). None of them is
part of the run's fingerprint: peers of one run may differ in all of them.

`mesh.config` composes them with the shared sections (mesh/config_sections.py). MOVED_KEYS maps
the keys of the single [runtime] table these came from, so an old run's config.toml still loads.
Imports: pydantic only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mesh import choices
from mesh.config_sections import _Section


class TransportConfig(_Section):
    """How this peer talks: the backend, its address, its waits, and the shape of its links."""

    backend: Literal[choices.BACKENDS] = Field(
        "torch", description="torch.distributed (gloo) in a cluster, hivemind over a WAN"
    )
    host: str = Field("127.0.0.1", description="address peers bind (simulate: loopback)")
    dht_mode: Literal["server", "client"] = Field(
        "server",
        description="hivemind: client = use the DHT without serving it (still dialed directly); "
        "for a large grid's peers beside a few `meshtrain dht` servers (results/scale)",
    )
    relay_time_limit_s: float = Field(
        1800.0,
        gt=0,
        description="hivemind, a peer others can dial: how long it relays one connection of a "
        "peer behind NAT (join --client-mode) before it resets it and the two sides redial "
        "(p2pd's -relayTimeLimit)",
    )
    relay_data_limit_mib: float = Field(
        4096.0,
        gt=0,
        description="hivemind, a peer others can dial: what it relays on one connection, each "
        "way, before it resets it and the two sides redial (p2pd's -relayDataLimit)",
    )
    recv_timeout_s: float = Field(
        60.0, gt=0, description="deadline of a pipeline receive (activations, gradients)"
    )
    start_timeout_s: float = Field(
        60.0,
        gt=0,
        description="deadline of this peer's transport start (the DHT's bootstrap, the torch "
        "rendezvous) and of its waits that name none",
    )
    round_timeout_s: float = Field(10.0, gt=0, description="deadline of an averaging round")
    link: Literal[choices.LINKS] = Field(
        "none",
        description="profile of every link, pipeline and averaging (comms.throttle.PROFILES: "
        "datacenter 10 Gbit/0.1 ms, wan100 100 Mbit/20 ms, wan10 10 Mbit/100 ms one-way)",
    )
    link_bandwidth_mbps: float | None = Field(
        None, gt=0, description="overrides the link profile's bandwidth (Mbit/s per direction)"
    )
    link_latency_ms: float | None = Field(
        None, ge=0, description="overrides the link profile's one-way latency (ms)"
    )
    link_shared: Literal["none", "pipeline", "all"] = Field(
        "none",
        description="a cell's outgoing links that share one uplink of the profile's bandwidth "
        "(latency stays per link): none; pipeline (activations on, gradients back); all (and "
        "the averaging rounds)",
    )


class ElasticConfig(_Section):
    """How a grid recovers a lost peer: restarts (torch), rejoins and heartbeats (hivemind),
    state downloads."""

    rejoin_timeout_s: float = Field(
        120.0,
        gt=0,
        description="hivemind: how long a cell waits for a lost neighbour of its replica to be "
        "replaced (restart or join) before it gives up",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="simulate on torch: how many times a replica starts again from its newest "
        "common step after a cell died, the others training on; past that the grid stops, "
        "saved and resumable (hivemind: elastic.rejoin_timeout_s)",
    )
    heartbeat_s: float = Field(
        1.0, gt=0, description="hivemind: claim heartbeat period; a claim lives 4 periods"
    )
    max_lag_steps: int = Field(
        20,
        ge=0,
        description="hivemind: a cell this many updates behind the most advanced live peer of "
        "its stage reloads that peer's state before it trains (a joiner always does)",
    )
    state_timeout_s: float = Field(
        60.0, gt=0, description="deadline of each answer a donor sends in a state download"
    )
    pool_timeout_s: float = Field(
        30.0,
        gt=0,
        description="pools: a microbatch whose gradient has not come back this long after it "
        "left is voided and counted (its cell died or froze); nothing waits longer",
    )
    rebalance: bool = Field(
        False,
        description="pools: a cell of a stage whose pool has held at least rebalance_ratio x the "
        "capacity of the thinnest stage for rebalance_after_s moves to the thinnest stage, "
        "downloading its state as a joiner does (SWARM's rebalancing)",
    )
    rebalance_ratio: float = Field(
        2.0, gt=1, description="pools: capacity ratio to the thinnest stage that moves a cell"
    )
    rebalance_after_s: float = Field(
        30.0, gt=0, description="pools: how long a stage must stay that far above before a move"
    )


class EmulationConfig(_Section):
    """Compute stood in by sleeps of the real shapes' timing (systems benchmarks), and
    per-cell slowdowns."""

    compute: Literal["real", "emulated"] = Field(
        "real",
        description="emulated: no model math; forward/backward sleep forward_ms/backward_ms x "
        "slowdown while real payloads of the real shapes cross the links (systems benchmarks)",
    )
    forward_ms: float = Field(
        10.0, gt=0, description="emulated: forward time per microbatch per stage at slowdown 1"
    )
    backward_ms: float = Field(
        20.0, gt=0, description="emulated: backward time per microbatch per stage at slowdown 1"
    )
    slowdowns: list[str] = Field(
        [],
        description='per-cell compute factors, e.g. ["s2r0=2.0"] (stage 2 of replica 0 twice '
        "as slow); unlisted cells 1.0. Real compute: each forward/backward then waits "
        "(factor-1) x its own time",
    )
    min_compute_ms: float = Field(
        0.0,
        ge=0,
        description="real compute: each forward and each backward takes at least this long "
        "(the cell waits out the rest, as on a device with that step time; after slowdowns); "
        "0: as fast as it runs. Paces tiny test models, whose messages would otherwise take "
        "the CPU",
    )
    deaths: list[str] = Field(
        [],
        description="the simulator (pools and fixed): cells dead for a span of updates, e.g. "
        '["s2r1@100-300"] (dead from update 100, back at 300, its state then taken from a live '
        'peer of its stage; "s2r1@100": for good). simulate on torch / hivemind: only "sJrI@0" '
        "(the cell is never started; other spans are refused); train and join: refused",
    )


class FaultsConfig(_Section):
    """Emulated hostile peers, for tests and benchmarks (docs/faults-and-trust.md)."""

    poison: list[str] = Field(
        [],
        description="emulated hostile peers (tests, benchmarks): per-cell factors its averaging "
        'payloads are multiplied by before they are sent, e.g. ["s0r3=-1000"]; such a cell '
        "takes no averages itself",
    )
    pipeline_poison: list[str] = Field(
        [],
        description="emulated hostile stages (tests, benchmarks): what a cell does to what it "
        'sends across a boundary, "sJrI=MODE[@STEP]", MODE scale:F, flip or random (same RMS), '
        "from update STEP (default: twice the sentinel's warm-up; mesh/algo/pipeline_poison.py)",
    )


class SentinelConfig(_Section):
    """The pipeline sentinel: each stage's statistics of what each neighbour sends it
    (mesh/algo/sentinel.py)."""

    enabled: bool = Field(
        True,
        description="each stage keeps running statistics of what each neighbour sends it "
        "(norms, each token's direction against its token id's) and drops a microbatch far "
        "outside them (rejects 'poison'; skipped along its replica's pipeline)",
    )
    warmup: int = Field(
        32,
        ge=1,
        description="messages of each sender learned before any verdict (at least "
        "the learning-rate warm-up: optim.warmup_steps x microbatches per update)",
    )
    z: float = Field(
        8.0,
        gt=0,
        description="drop a message whose feature is this many scales (~standard "
        "deviations of its recent honest values) from the predicted one",
    )
    flag_drops: int = Field(
        3,
        ge=1,
        description="a sender with this many drops among its last 32 messages is "
        "flagged (status, dashboard)",
    )


class CheckpointConfig(_Section):
    """When a cell saves (mesh/runtime/checkpoint.py)."""

    every: int = Field(
        50, ge=0, description="save each cell every N updates (and on a clean stop); 0: only then"
    )


class MetricsConfig(_Section):
    """Where a cell's metrics rows also go besides the JSONL record."""

    tensorboard: bool = Field(
        False,
        description="also write each cell's metrics rows as TensorBoard event files, "
        "DIR/tensorboard/s<stage>r<replica>/ (the JSONL rows stay the record)",
    )
    prometheus_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="serve each cell's metrics for Prometheus on transport.host, port "
        "prometheus_port + replica x stages + stage (one port per cell of the grid)",
    )


class RuntimeConfig(_Section):
    """The cell process itself: where it computes, at which precision, and its memory."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where a cell computes: auto = cuda when present, else cpu"
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="compute of a stage's forward and backward: bf16 autocasts them (CPU and "
        "CUDA); weights, optimizer states, drift and averaging stay fp32 masters, and what "
        "crosses a link follows the codecs",
    )
    malloc_arenas: int = Field(
        2,
        ge=0,
        description="glibc malloc arenas of a cell process (MALLOC_ARENA_MAX; 0: glibc's 8 per "
        "core): short-lived round and link threads otherwise each keep an arena of freed, "
        "fragmented memory, and a long run's RSS grows (mesh/runtime/memory.py)",
    )
    trim_every_s: float = Field(
        60.0,
        ge=0,
        description="hand the heap's free pages back to the OS (malloc_trim) this often "
        "(checked after each update), and after every broken session; 0: never",
    )


LOCAL_SECTIONS: dict[str, type[_Section]] = {
    "transport": TransportConfig,
    "elastic": ElasticConfig,
    "emulation": EmulationConfig,
    "faults": FaultsConfig,
    "sentinel": SentinelConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "runtime": RuntimeConfig,
}
# the dotted keys of the local sections start so
LOCAL_PREFIXES = tuple(f"{section}." for section in LOCAL_SECTIONS)
# the keys of the one [runtime] table these sections came from -> where each lives now (one
# old key set three separate waits); an old config.toml or --set still works, with a notice
MOVED_KEYS: dict[str, tuple[str, ...]] = {
    "runtime.backend": ("transport.backend",),
    "runtime.host": ("transport.host",),
    "runtime.dht_mode": ("transport.dht_mode",),
    "runtime.timeout_s": (
        "transport.recv_timeout_s",
        "transport.start_timeout_s",
        "elastic.state_timeout_s",
    ),
    "runtime.round_timeout_s": ("transport.round_timeout_s",),
    "runtime.link": ("transport.link",),
    "runtime.link_bandwidth_mbps": ("transport.link_bandwidth_mbps",),
    "runtime.link_latency_ms": ("transport.link_latency_ms",),
    "runtime.link_shared": ("transport.link_shared",),
    "runtime.rejoin_timeout_s": ("elastic.rejoin_timeout_s",),
    "runtime.max_restarts": ("elastic.max_restarts",),
    "runtime.heartbeat_s": ("elastic.heartbeat_s",),
    "runtime.max_lag_steps": ("elastic.max_lag_steps",),
    "runtime.compute": ("emulation.compute",),
    "runtime.forward_ms": ("emulation.forward_ms",),
    "runtime.backward_ms": ("emulation.backward_ms",),
    "runtime.slowdowns": ("emulation.slowdowns",),
    "runtime.poison": ("faults.poison",),
    "runtime.pipeline_poison": ("faults.pipeline_poison",),
    "runtime.sentinel": ("sentinel.enabled",),
    "runtime.sentinel_warmup": ("sentinel.warmup",),
    "runtime.sentinel_z": ("sentinel.z",),
    "runtime.sentinel_flag_drops": ("sentinel.flag_drops",),
    "runtime.checkpoint_every": ("checkpoint.every",),
    "runtime.tensorboard": ("metrics.tensorboard",),
    "runtime.prometheus_port": ("metrics.prometheus_port",),
}
