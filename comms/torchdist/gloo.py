"""The gloo process group TorchTransport's point-to-point links run on.

imports: torch only.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

FOREVER = timedelta(days=30)  # waits that must not time out: a timed-out gloo op kills the pair


def gloo_group(store: dist.Store, rank: int, size: int, host: str, timeout: timedelta = FOREVER):
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)
