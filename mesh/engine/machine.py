"""The memory a cell can train in on this machine: its GPUs' (as torch sees them) and its own.
`plan` checks a cell against it and a pool's `auto` stream window is bounded by it.

imports: stdlib (torch only when asked about GPUs).
"""

from __future__ import annotations

import os


def local_gpus() -> list[tuple[str, int]]:
    """(name, total memory bytes) of each GPU torch sees here; [] when it sees none."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [
        (torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
        for i in range(torch.cuda.device_count())
    ]


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def training_memory_bytes(device: str) -> float:
    """The memory a cell trains in: the smallest GPU torch sees (runtime.device auto or cuda;
    a simulated grid spreads its cells over all of them), else this machine's."""
    gpus = local_gpus() if device != "cpu" else []
    return float(min(total for _, total in gpus)) if gpus else float(host_memory_bytes())
