"""Stage construction for every model family: stage-only, on the meta device, each parameter
initialised from (run seed, its global name).

A peer allocates only its own stage: the module is created on the meta device (shapes, no
memory), given real storage once, and every parameter is drawn from its own generator seeded by
a hash of the run seed and the parameter's global name (`blocks.5.attn.q_proj.weight`). So a
peer's stage equals the same layers cut from the whole model bit for bit, without building the
others' layers, and the init does not depend on how the model is cut.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from mesh.algo.topology import partition_layers
from mesh.config import Config, ModelConfig
from mesh.model import gpt, llama
from mesh.model.boundary import BoundarySpec, init_end, init_fixed

FAMILIES: dict[str, ModuleType] = {"gpt": gpt, "llama": llama}


def family(cfg: ModelConfig) -> ModuleType:
    """The module of model.arch: its StageModule class and its init_std rule."""
    return FAMILIES[cfg.arch]


def param_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: a hash of the run seed and its global name."""
    digest = hashlib.sha256(f"meshtrain-init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def boundary_spec(cfg: Config) -> BoundarySpec:
    """pipeline.boundary's settings as the stage builders take them."""
    p = cfg.pipeline
    return BoundarySpec(p.boundary, p.boundary_rank, p.anchor_rank)


@torch.no_grad()
def init_parameters(module: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Norm gains one, biases zero, matrices N(0, family.init_std) from their own generators;
    a compressed boundary's ends and buffers by mesh.model.boundary's rules."""
    std_of = family(cfg).init_std
    init_fixed(module, seed, std_of("tok_emb.weight", cfg), param_seed)
    for name, p in module.named_parameters():
        if init_end(name, p, seed, param_seed):
            continue
        if p.ndim == 1:
            p.fill_(1.0 if name.endswith("weight") else 0.0)
            continue
        gen = torch.Generator(device=p.device).manual_seed(param_seed(seed, name))
        p.normal_(0.0, std_of(name, cfg), generator=gen)


def stage_module(
    cfg: ModelConfig,
    layers: range,
    first: bool,
    last: bool,
    device: str = "meta",
    stage: int = 0,
    boundary: BoundarySpec | None = None,
) -> nn.Module:
    """The family's stage module with parameters on `device` (meta: shapes only, no memory);
    stage j's ends of a compressed boundary with `boundary` (llama only)."""
    extra = (
        {}
        if boundary is None or not boundary.compressed
        else {"stage": stage, "boundary": boundary}
    )
    with torch.device(device):
        return family(cfg).StageModule(cfg, layers, first=first, last=last, **extra)


def stage_layers(cfg: ModelConfig, n_stages: int, stage: int) -> tuple[range, bool, bool]:
    """Stage `stage` of n: its blocks, and whether it holds the embedding / the head."""
    layers = partition_layers(cfg.n_layers, n_stages)[stage]
    return layers, stage == 0, stage == n_stages - 1


def build_stage(
    cfg: ModelConfig, n_stages: int, stage: int, seed: int, boundary: BoundarySpec | None = None
) -> nn.Module:
    """One cell's stage module, allocated alone (on the CPU) with the run's common init."""
    module = stage_module(cfg, *stage_layers(cfg, n_stages, stage), stage=stage, boundary=boundary)
    module.to_empty(device="cpu")
    init_parameters(module, cfg, seed)
    if cfg.init_from:  # a Hugging Face model's weights over the init: this stage's only
        from mesh.model.hf_import import load_stage

        load_stage(module, cfg.init_from)
    return module


def build_stages(
    cfg: ModelConfig, n_stages: int, seed: int, boundary: BoundarySpec | None = None
) -> list[nn.Module]:
    """The P stage modules of one replica."""
    return [build_stage(cfg, n_stages, j, seed, boundary) for j in range(n_stages)]


def build_cell_stage(cfg: Config, stage: int) -> nn.Module:
    """Stage `stage` of a run's grid: its model, partition, seed and boundary."""
    return build_stage(cfg.model, cfg.grid.stages, stage, cfg.run.seed, boundary_spec(cfg))


def build_cell_stages(cfg: Config) -> list[nn.Module]:
    """The P stage modules of one replica of a run."""
    return [build_cell_stage(cfg, j) for j in range(cfg.grid.stages)]


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The whole LM as one module (the one-stage reference). Same seed, same weights everywhere."""
    return build_stage(cfg, 1, 0, seed)


def split_model(model: nn.Module, cfg: ModelConfig, n_stages: int) -> list[nn.Module]:
    """Cut a whole model into n_stages stage modules with copies of its weights."""
    full = model.state_dict()
    stages = []
    for j in range(n_stages):
        stage = stage_module(cfg, *stage_layers(cfg, n_stages, j))
        own = {k: full[k] for k in stage.state_dict()}
        stage.load_state_dict(copy.deepcopy(own), strict=True, assign=True)
        stages.append(stage)
    return stages


def stage_shapes(
    cfg: ModelConfig, n_stages: int, stage: int, boundary: BoundarySpec | None = None
) -> dict[str, tuple[int, ...]]:
    """Global parameter name -> shape of one stage, in the module's order (no memory)."""
    module = stage_module(cfg, *stage_layers(cfg, n_stages, stage), stage=stage, boundary=boundary)
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


def stage_param_counts(
    cfg: ModelConfig, n_stages: int, boundary: BoundarySpec | None = None
) -> list[int]:
    """Parameters of each stage (built on the meta device: exact, instant, no memory)."""
    return [
        sum(_numel(s) for s in stage_shapes(cfg, n_stages, j, boundary).values())
        for j in range(n_stages)
    ]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats (in fp32 whatever the compute precision)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """runtime.precision's compute context: bf16 autocast (CPU or CUDA) or plain fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def stage_forward(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    precision: str,
    tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """A stage's forward with given (fp32 master) weights in the run's compute precision.

    The output is fp32 again, so what crosses a link goes through the codecs exactly as in an
    fp32 run (a bf16 codec then costs nothing extra); its gradient flows back in bf16 compute.
    `tokens`: the microbatch's token ids, which a compressed boundary's anchors read.
    """
    kwargs = {"tokens": tokens} if needs_tokens(module) else {}
    with autocast(precision, x.device):
        out = functional_call(module, params, (x,), kwargs)
    return out.float()


def needs_tokens(module: nn.Module) -> bool:
    """Whether a stage reads the microbatch's tokens besides its input (a compressed boundary
    past the first stage). Looks through a wrapper that evaluates other weights (`inner`)."""
    module = getattr(module, "inner", module)
    return getattr(module, "boundary", None) is not None and not module.first


def run_stages(modules: list[nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    """One replica's stages composed on token ids (evaluation: no codecs, the modules' own
    weights): the logits."""
    h = tokens
    for mod in modules:
        h = mod(h, tokens=tokens) if needs_tokens(mod) else mod(h)
    return h


def named_chunks(
    flat: torch.Tensor, shapes: dict[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Named views of a stage's flat parameter vector (the cell's layout: module order)."""
    offset = 0
    for name, shape in shapes.items():
        n = _numel(shape)
        yield name, flat[offset : offset + n].view(shape)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} values, the stage {offset}")
