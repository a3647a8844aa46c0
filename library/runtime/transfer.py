"""Host-to-device copies that keep the host ahead of the GPU.

A CUDA copy from pageable host memory is staged by the driver through page-locked memory and waits for the stream
to reach it: a training step that copies its batch that way loses the host's lead over the GPU (tens of ms of
queued work) at every step, and the GPU then idles while the host queues the next forward. A copy from page-locked
memory is asynchronous. `to_device` pins a host tensor first (a host memcpy into a block of torch's caching host
allocator, which is reused once the copy that read it has run) and copies it without blocking.
"""
from __future__ import annotations

import torch

__all__ = ["set_pinned_transfers", "to_device"]

_PINNED = True


def set_pinned_transfers(enabled: bool) -> bool:
    """Pin host tensors before copying them (the default), or copy them from where they are (pageable memory: what
    the step did before; `bench/checkpointing.py` measures both in one process). Returns the previous setting."""
    global _PINNED
    previous, _PINNED = _PINNED, bool(enabled)
    return previous


def to_device(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` on `device` (and in `dtype` when given), queued without a host sync. A host tensor bound for a CUDA
    device is pinned first; the dtype conversion runs on the device, after the copy, so the copy reads the pinned
    memory itself (a conversion on the host would make a new pageable tensor)."""
    device = torch.device(device)
    if _PINNED and device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    moved = tensor.to(device, non_blocking=True)
    return moved if dtype is None else moved.to(dtype)
