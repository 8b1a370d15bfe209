"""Host data onto the training device without making the host wait for the device.

A plain ``tensor.to("cuda")`` from ordinary (pageable) host memory copies synchronously: the
host waits until every kernel queued before it has run, so a copy between a micro-batch's
forward and backward pass stalls the launch of the backward. :func:`to_device` copies through
pinned memory with a non-blocking copy on CUDA (the copy is queued like a kernel; torch's
pinned-memory allocator keeps the buffer until the copy has run), and a non-blocking move on
any other device (none at all on the host itself).
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(value: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``value`` (a host array or tensor, any shape and dtype) as a tensor on ``device``,
    queued without a host synchronisation on CUDA."""
    tensor = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device, non_blocking=True)
