"""Averaging the LoRA gradients across processes (the network is not wrapped in DDP: its layers live inside the
frozen models)."""

from __future__ import annotations

import torch

GRAD_BUCKET_BYTES = 64 * 1024 * 1024


def all_reduce_mean_bucketed(grads: list[torch.Tensor], world_size: int, bucket_bytes: int = GRAD_BUCKET_BYTES) -> int:
    """Average `grads` across the processes in place, in as few collectives as possible: tensors of one dtype and
    device are flattened into buckets of about `bucket_bytes` (one all-reduce each instead of one per LoRA tensor,
    about 500 for the DiT LoRA). Every process must pass the same tensors in the same order. Returns the number of
    collectives."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.dtype, g.device), []).append(g)
    calls = 0
    for tensors in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for i, g in enumerate(tensors):
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= bucket_bytes or i == len(tensors) - 1:
                flat = _flatten_dense_tensors(bucket)
                dist.all_reduce(flat)
                flat.div_(world_size)
                for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    dst.copy_(src)
                calls += 1
                bucket, size = [], 0
    return calls
