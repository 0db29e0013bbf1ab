"""The names comms offers, in one light module (no torch) that the config reads its choices from.

imports: stdlib only.
"""

from __future__ import annotations

# comms/codecs.py: the casts first (a tensor's own dtype on the wire), then the blockwise codecs
# (a new one goes last: a frame names its codec by its index here)
CAST_CODECS: tuple[str, ...] = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2")
CODECS: tuple[str, ...] = (*CAST_CODECS, "int8_blockwise", "int4_hadamard")
# comms/build.py: torch.distributed (gloo/NCCL) and hivemind (libp2p over a DHT)
BACKENDS: tuple[str, ...] = ("torch", "hivemind")
# comms/throttle.py PROFILES: the emulated link presets ("none": unshaped)
LINK_PRESETS: tuple[str, ...] = ("datacenter", "wan100", "wan10")
