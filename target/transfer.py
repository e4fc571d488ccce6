"""Host-to-device copies that do not wait for the device.

``.to("cuda", non_blocking=True)`` from pageable host memory is a synchronous copy (PyTorch's documentation:
``non_blocking`` only has effect from pinned memory), ordered after the work already queued on the stream: a
step's small index copies (a batch's fields, a tree's slots, KV moves) then hold the host until the GPU has
caught up, and the host cannot prepare the next launch while the current one runs. From page-locked memory
the copy is asynchronous; PyTorch's caching host allocator keeps the pinned block alive until the copy has
run, and reuses it after.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor the caller will not change) on ``device``: through pinned memory on CUDA, without
    waiting for the stream's queued work; as is on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
