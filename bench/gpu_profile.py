"""GPU kernel profile of a callable: time per kernel category, the busiest kernels, and the GPU's idle time.

    from bench.gpu_profile import kernel_profile
    report = kernel_profile(step, steps=3)      # milliseconds per call

`torch.profiler` records the CUDA kernels of `steps` calls (after one unrecorded call). The kernels' intervals give
the busy time (their union: overlapping streams count once) and the idle time inside the recorded span; each kernel
name falls into the first category whose keys it contains (`CATEGORIES`, case-insensitive). `idle_by_gap` splits the
idle time by the length of each gap (`GAP_BOUNDS_US`): the short ones are the GPU's own time between queued kernels,
which fewer kernels (or CUDA graphs) would remove; the long ones are waits on the host.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("int8_gemm", ("_int8_gemm",)),
    ("int8_quantise", ("_rot_quant",)),
    ("int8_dequantise_rotate", ("_scale_rotate",)),
    ("int8_upcast_grad_gemm", ("_grad_input_upcast",)),
    # cuDNN's convolutions and their layout transforms (the VAE), before "attention", whose "cudnn" key they hold
    ("convolution", ("implicit_gemm", "nchwtonhwc", "nhwctonchw", "convolution")),
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("bf16_gemm", ("gemm", "cutlass", "sm90", "nvjet", "xmma", "cublas", "matmul", "splitk")),
    ("inductor_fused", ("triton_",)),  # before "copy": inductor names its kernels after the ops they fuse (_to_copy)
    # the project's element-wise kernels (library.runtime.fused_kernels), before "reduction" (their names hold "norm")
    ("fused_elementwise", ("_norm_modulate", "_norm_rope", "_swiglu", "_gated_residual")),
    ("copy", ("copy", "memcpy", "cat", "fill", "memset")),
    ("reduction", ("reduce", "norm", "red_")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
]


# upper bounds (us) of the gap classes of `idle_by_gap`: between queued kernels, short stalls, waits on the host
GAP_BOUNDS_US: tuple[float, ...] = (5.0, 50.0, 500.0)


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(key.lower() in low for key in keys)), "other")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def kernel_profile(fn: Callable[[], Any], steps: int = 3, top: int = 25) -> dict[str, Any]:
    """GPU time of `fn` per kernel category, its `top` kernels, busy and idle time: milliseconds per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range]
    if not kernels:
        return {"steps": steps, "kernels": 0}
    by_cat: collections.Counter = collections.Counter()
    by_name: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    intervals = []
    for e in kernels:
        start, stop = e.time_range.start, e.time_range.end
        intervals.append((start, stop))
        by_cat[category(e.name)] += stop - start
        by_name[e.name] += stop - start
        calls[e.name] += 1
    span = max(b for _, b in intervals) - min(a for a, _ in intervals)
    busy = _union_us(intervals)
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    gaps = _largest_gaps(ordered, top=12)
    per = 1e3 * steps
    return {
        "steps": steps,
        "kernels_per_call": round(len(kernels) / steps, 1),
        "span_ms": round(span / per, 2),
        "busy_ms": round(busy / per, 2),
        "idle_ms": round((span - busy) / per, 2),
        "idle_by_gap": _idle_by_gap(ordered, steps),
        "categories_ms": {c: round(us / per, 2) for c, us in by_cat.most_common()},
        "top_kernels": [{"name": n[:160], "ms": round(us / per, 3), "calls": calls[n] // steps}
                        for n, us in by_name.most_common(top)],
        "largest_gaps": gaps,
        "host_threads": _host_threads(prof.events(), steps),
    }


_NODE = "autograd::engine::evaluate_function: "


def _host_threads(events: Any, steps: int, threads: int = 3, top: int = 15) -> list[dict[str, Any]]:
    """Per host thread that ran torch operators (the main thread, autograd's CUDA thread, which runs the backward),
    the busiest `threads` first: the time covered by its outermost recorded operators, and its `top` operators by
    own CPU time and autograd nodes by total CPU time, in ms per call. The profiler's own cost inflates every
    operator, so the shares matter more than the figures."""
    by_thread: dict[int, list[Any]] = collections.defaultdict(list)
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.time_range:
            by_thread[e.thread].append(e)
    per = 1e3 * steps
    rows = []
    for thread, evs in by_thread.items():
        outer = [(e.time_range.start, e.time_range.end) for e in evs if e.cpu_parent is None]
        own: collections.Counter = collections.Counter()
        nodes: collections.Counter = collections.Counter()
        calls: collections.Counter = collections.Counter()
        for e in evs:
            own[e.name] += e.self_cpu_time_total
            calls[e.name] += 1
            if e.name.startswith(_NODE):
                nodes[e.name[len(_NODE):]] += e.cpu_time_total
        rows.append({
            "thread": thread,
            "covered_ms": round(_union_us(outer) / per, 2),
            "operators_per_call": round(len(evs) / steps, 1),
            "top_own_ms": [{"name": n[:120], "ms": round(us / per, 3), "calls": calls[n] // steps}
                           for n, us in own.most_common(top)],
            "top_nodes_ms": [{"name": n[:120], "ms": round(us / per, 3), "calls": calls[_NODE + n] // steps}
                             for n, us in nodes.most_common(top)],
        })
    rows.sort(key=lambda r: r["covered_ms"], reverse=True)
    return rows[:threads]


def _gaps_us(kernels: list[Any]) -> list[tuple[float, str, str]]:
    """Every stretch with no kernel running between the first kernel's start and the last one's end (kernels in order
    of start): its length and the kernels on each side."""
    gaps = []
    end, last = kernels[0].time_range.end, kernels[0].name
    for e in kernels[1:]:
        if e.time_range.start > end:
            gaps.append((e.time_range.start - end, last, e.name))
        if e.time_range.end > end:
            end, last = e.time_range.end, e.name
    return gaps


def _idle_by_gap(kernels: list[Any], steps: int) -> list[dict[str, Any]]:
    """The idle time per call and the number of gaps per call in each class of gap length (`GAP_BOUNDS_US`; the last
    class is everything longer)."""
    bounds = (*GAP_BOUNDS_US, float("inf"))
    total, count = [0.0] * len(bounds), [0] * len(bounds)
    for us, _, _ in _gaps_us(kernels):
        k = next(i for i, b in enumerate(bounds) if us <= b)
        total[k] += us
        count[k] += 1
    names = [f"<= {b:g} us" for b in GAP_BOUNDS_US] + [f"> {GAP_BOUNDS_US[-1]:g} us"]
    return [{"gaps": name, "idle_ms": round(t / (1e3 * steps), 3), "count": round(c / steps, 1)}
            for name, t, c in zip(names, total, count)]


def _largest_gaps(kernels: list[Any], top: int) -> list[dict[str, Any]]:
    """The `top` longest stretches with no kernel running (over all recorded calls), with the kernels on each side:
    where the GPU waits for the host."""
    gaps = sorted(_gaps_us(kernels), reverse=True)
    return [{"us": round(us, 1), "after": a[:100], "before": b[:100]} for us, a, b in gaps[:top]]
