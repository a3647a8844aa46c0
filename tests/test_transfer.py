"""Host-to-device copies (library.runtime.transfer): the values arrive, in the asked dtype, and on CUDA a pageable
host tensor is copied from page-locked memory without a host sync."""
import pytest
import torch

from library.runtime.transfer import to_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_to_device_keeps_the_values_and_converts_after_the_copy():
    host = torch.randn(3, 5, dtype=torch.bfloat16)
    same = to_device(host, "cpu")
    assert same.dtype == torch.bfloat16 and torch.equal(same, host)
    wide = to_device(host, torch.device("cpu"), torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, host.float())


@cuda
def test_a_pageable_batch_reaches_the_gpu_without_waiting_for_the_queue():
    """A copy from pageable memory would wait for the queued products (about 0.1 s); the pinned one returns while
    they run: the host's time in the call is far below the queue's."""
    import time

    host = torch.randn(4, 1 << 20)  # 16 MiB: far above what the driver stages without waiting for the stream
    assert not host.is_pinned()
    busy = torch.randn(8192, 8192, device="cuda")
    to_device(torch.randn(4, 1 << 20), "cuda")  # the host allocator's first block, outside the measured call
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # full fp32 products: a queue long enough whatever a test set
    try:
        start.record()
        for _ in range(6):
            busy = busy @ busy / 8192
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.cuda.set_sync_debug_mode("error")  # no synchronising torch call either
    try:
        t0 = time.perf_counter()
        moved = to_device(host, "cuda", torch.bfloat16)
        host_ms = (time.perf_counter() - t0) * 1000
    finally:
        torch.cuda.set_sync_debug_mode("default")
    end.record()
    torch.cuda.synchronize()
    assert host_ms < start.elapsed_time(end) / 2, (host_ms, start.elapsed_time(end))
    assert moved.dtype == torch.bfloat16 and moved.device.type == "cuda"
    assert torch.equal(moved.cpu(), host.to(torch.bfloat16))
