"""The bucketed gradient averaging of the trainer (`all_reduce_mean_bucketed`) on two gloo processes."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from library.training.grad_reduce import all_reduce_mean_bucketed


def _grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    shapes = [(16, 8), (3,), (8, 32), (5, 5), (64,)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    return [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, dtypes)]


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        grads = _grads(rank)
        calls = all_reduce_mean_bucketed(grads, 2, bucket_bytes=600)  # small buckets: several per dtype
        out[rank] = ([t.clone() for t in grads], calls)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bucketed_all_reduce_averages_every_tensor_in_few_calls():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
        results = dict(out)
    expected = [((a.float() + b.float()) / 2) for a, b in zip(_grads(0), _grads(1))]
    for rank in (0, 1):
        grads, calls = results[rank]
        assert 2 <= calls < len(expected)  # fp32 and bf16 buckets, fewer calls than tensors
        for got, want, orig in zip(grads, expected, _grads(0)):
            assert got.dtype == orig.dtype and got.shape == orig.shape
            torch.testing.assert_close(got.float(), want.to(orig.dtype).float(), rtol=1e-2 if orig.dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))

