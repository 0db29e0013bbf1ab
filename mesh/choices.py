"""The choices of every named option, once: the modules that implement them import their tuple
from here, and the config's fields are Literal[...] of the same tuple, so a new schedule, codec or
correction is added in one place (light: no torch, the CLI's config parsing imports it).

imports: comms.names only.
"""

from __future__ import annotations

from comms.names import BACKENDS, CAST_CODECS, CODECS, LINK_PRESETS

ARCHS = ("gpt", "llama")  # mesh/model/build.py FAMILIES
SCHEDULES = ("gpipe", "1f1b", "async", "2bw")  # mesh/algo/schedule.py
BOUNDARIES = ("full", "subspace", "learned")  # mesh/algo/boundary.py
ROUTINGS = ("fixed", "pools")  # mesh/algo/routing.py
POOL_CHOICES = ("load", "delay", "seeded")  # mesh/algo/routing.py
OPTIMIZERS = ("nadamw", "adamw", "muon", "rotated_adam")  # mesh/algo/optim.py
DP_MODES = ("none", "grad_allreduce", "param_avg")
CORRECTIONS = ("ema", "delta", "replace")  # mesh/algo/sparse.py
LAMBDA_CLOCKS = ("steps", "arrivals")  # mesh/algo/sparse.py lambda's schedule
SELECTORS = ("partition", "bernoulli")  # mesh/algo/sparse.py
INDEX_MAPS = ("keyed", "permutation")  # mesh/algo/sparse.py
AGGREGATES = ("mean", "trimmed_mean", "median")  # mesh/algo/robust.py

# a boundary's activations and gradients: the casts and 4 bits with a Hadamard rotation
PIPELINE_CODECS = (*CAST_CODECS, "int4_hadamard")
# averaging payloads: the casts and int8 blockwise. Not 4 bits: a round's payload is the weights
# themselves, whose 4-bit rounding (~12% of a block's norm) no study has measured the cost of
DP_CODECS = tuple(c for c in CODECS if c != "int4_hadamard")
NOISE_CODECS = ("none", *CAST_CODECS[1:])  # dp.noise_codec: a codec's error without its bytes
LINKS = ("none", *LINK_PRESETS)

__all__ = [
    "AGGREGATES",
    "ARCHS",
    "BACKENDS",
    "BOUNDARIES",
    "CORRECTIONS",
    "DP_CODECS",
    "DP_MODES",
    "INDEX_MAPS",
    "LAMBDA_CLOCKS",
    "LINKS",
    "NOISE_CODECS",
    "OPTIMIZERS",
    "PIPELINE_CODECS",
    "POOL_CHOICES",
    "ROUTINGS",
    "SCHEDULES",
    "SELECTORS",
]

# pipeline.pool_stream_window = "auto" keeps at most this many times pool_window in flight
STREAM_WINDOW_CAP = 4
