"""Small host-to-device transfers that never make the host wait for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, which blocks the host
until the device has finished all earlier work on the stream: one such call in the step
loop serialises host and device and undoes async scheduling. These copies go through
pinned memory (PyTorch's caching host allocator) and return at once.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
