"""Host time of an eager, fully checkpointed training step per DiT block: bf16 against ConvRot INT8, torch's reentrant
checkpoint against its non-reentrant form, the forward (main thread) apart from the backward (recomputation and
gradients, which autograd runs on a thread of its own for CUDA tensors).

    python -m bench.eager_host --out eager_host.json              # on a CUDA GPU: full-width blocks, 320 tokens
    python -m bench.eager_host --device cpu --layers 2 --width 256 --out cpu.json   # a smoke run

With few tokens most kernels take a few microseconds, less than their launch, so the time from a phase's start to
the end of its GPU work is mostly host time: what the full-size step (docs/benchmarks.md) spends on the host per
block, which is all it spends where the GPU waits for the host. The blocks are the product's (a rank-16 LoRA from
networks.lora_generic on every block Linear, bf16 autocast, the eager forms of the element-wise code), each
checkpointed with `full` as the trainer does (`library.runtime.checkpointing.EAGER_FULL` picks the form);
INT8 configurations with "_unplanned" run without the int8 Linears' launch plans (`library.quant.linear_plan`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bench.convrot_int8 import _Blocks
from library.moss_image.dit import MossImageConfig
from library.quant import linear_plan
from library.runtime import checkpointing, fused_ops

CONFIGS: dict[str, dict[str, bool]] = {
    "bf16": {"int8": False, "reentrant": True, "plans": True},
    "bf16_nonreentrant": {"int8": False, "reentrant": False, "plans": True},
    "int8": {"int8": True, "reentrant": True, "plans": True},
    "int8_nonreentrant": {"int8": True, "reentrant": False, "plans": True},
    "int8_unplanned": {"int8": True, "reentrant": True, "plans": False},
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _phase_ms(fn: Callable[[], Any], device: str) -> float:
    """Wall time of `fn` and its GPU work, from an idle GPU."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1000


def _forward_into(blocks: _Blocks, x: torch.Tensor, out: list[torch.Tensor]) -> None:
    out.append(blocks.forward(x))


@contextlib.contextmanager
def _configured(name: str, cfg: MossImageConfig, seq: int, device: str) -> Iterator[_Blocks]:
    """The blocks of configuration `name`, each fully checkpointed, with its checkpoint form and launch plans set
    while inside (the trainer's switches put back after)."""
    opts = CONFIGS[name]
    blocks = _Blocks(cfg, seq, device, int8=opts["int8"])
    for blk in blocks.dit.layers:
        blk.checkpointing = "full"
    saved = checkpointing.EAGER_FULL["reentrant"], linear_plan._STATE["enabled"]
    checkpointing.EAGER_FULL["reentrant"] = opts["reentrant"]
    linear_plan.set_linear_plans(opts["plans"])
    try:
        yield blocks
    finally:
        checkpointing.EAGER_FULL["reentrant"], plans = saved
        linear_plan.set_linear_plans(plans)


def measure(name: str, cfg: MossImageConfig, seq: int, device: str, iters: int, warmup: int) -> dict[str, Any]:
    opts = CONFIGS[name]
    fwd, bwd = [], []
    with _configured(name, cfg, seq, device) as blocks:
        for i in range(warmup + iters):
            x = blocks.x.detach().requires_grad_(True)  # as under checkpointing: the block input requires grad
            out: list[torch.Tensor] = []
            f = _phase_ms(functools.partial(_forward_into, blocks, x, out), device)
            b = _phase_ms(functools.partial(out[0].backward, blocks.gy), device)
            blocks.net.zero_grad(set_to_none=True)
            if i >= warmup:
                fwd.append(f)
                bwd.append(b)
    n = len(blocks.dit.layers)
    per_block = {"forward_us": statistics.median(fwd) * 1000 / n, "backward_us": statistics.median(bwd) * 1000 / n}
    per_block["step_us"] = per_block["forward_us"] + per_block["backward_us"]
    return {"config": name, **opts, "layers": n, "tokens": seq,
            **{k: round(v, 1) for k, v in per_block.items()},
            "forward_ms": [round(v, 3) for v in fwd], "backward_ms": [round(v, 3) for v in bwd]}


def _evaluate_name(name: str) -> str | None:
    """The autograd node of an ``autograd::engine::evaluate_function: Node`` event, else None."""
    prefix = "autograd::engine::evaluate_function: "
    return name[len(prefix):] if name.startswith(prefix) else None


def op_profile(name: str, cfg: MossImageConfig, seq: int, device: str, iters: int, top: int = 25) -> dict[str, Any]:
    """Where the host time of `iters` steps goes, per block (torch.profiler, CPU events only): the operators by
    self time, and the autograd nodes by total time (the backward thread's work, recomputation included, appears
    under the nodes; a Python node's total holds its Python code). The profiler adds a microsecond or two per
    event, so read shares rather than absolute times."""
    from torch.profiler import ProfilerActivity, profile

    with _configured(name, cfg, seq, device) as blocks:
        for _ in range(3):
            blocks.train_step()
            blocks.net.zero_grad(set_to_none=True)
        _sync(device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(iters):
                blocks.train_step()
                blocks.net.zero_grad(set_to_none=True)
            _sync(device)
    per = iters * len(blocks.dit.layers)
    ops: dict[str, list[float]] = {}
    nodes: dict[str, list[float]] = {}
    for ev in prof.events():
        node = _evaluate_name(ev.name)
        if node is not None:
            entry = nodes.setdefault(node, [0.0, 0.0])
            entry[0] += ev.cpu_time_total
            entry[1] += 1
        entry = ops.setdefault(ev.name, [0.0, 0.0])
        entry[0] += ev.self_cpu_time_total
        entry[1] += 1

    def table(d: dict[str, list[float]]) -> list[dict[str, Any]]:
        rows = sorted(d.items(), key=lambda kv: -kv[1][0])[:top]
        return [{"name": k, "us_per_block": round(v[0] / per, 1), "calls_per_block": round(v[1] / per, 2)}
                for k, v in rows]

    return {"config": name, "iters": iters, "layers": len(blocks.dit.layers), "tokens": seq,
            "self_us_per_block": round(sum(v[0] for v in ops.values()) / per, 1),
            "events_per_block": round(sum(v[1] for v in ops.values()) / per, 1),
            "ops_by_self_time": table(ops), "autograd_nodes_by_total_time": table(nodes)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="host time per DiT block of an eager checkpointed training step")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=8, help="full-width blocks (default 8)")
    p.add_argument("--width", type=int, default=3072, help="hidden size (default: the DiT's 3072)")
    p.add_argument("--tokens", type=int, default=320, help="sequence length (few: the GPU work stays under the host's)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--ops", type=int, default=0, metavar="N",
                   help="also profile N steps per configuration (torch.profiler): the host time by operator and by "
                        "autograd node")
    p.add_argument("--out", type=Path, default=Path("eager_host.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    names = [n.strip() for n in ns.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"unknown configurations {unknown}: choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("bench.eager_host needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    if ns.width % 128:
        print("--width must be a multiple of 128 (the DiT's head size)", file=sys.stderr)
        return 2
    cfg = MossImageConfig(hidden_size=ns.width, num_layers=ns.layers, num_heads=ns.width // 128,
                          ffn_hidden=ns.width * 8 // 3)
    fused_ops.prepare(ns.device)  # as MossImage.prepare_text does before a step: the fused kernels where they run
    results = [measure(n, cfg, ns.tokens, ns.device, ns.iters, ns.warmup) for n in names]
    payload = {"command": " ".join(["python", "-m", "bench.eager_host", *(argv or sys.argv[1:])]),
               "device": torch.cuda.get_device_name() if ns.device == "cuda" else "cpu", "torch": torch.__version__,
               "results": results}
    if ns.ops:
        payload["op_profiles"] = [op_profile(n, cfg, ns.tokens, ns.device, ns.ops) for n in names]
    tmp = ns.out.with_name(f".{ns.out.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(ns.out)
    for r in results:
        print(f"{r['config']:<20} forward {r['forward_us']:>8.1f} us/block  backward {r['backward_us']:>8.1f} us/block"
              f"  step {r['step_us']:>8.1f} us/block")
    for prof in payload.get("op_profiles", []):
        print(f"{prof['config']}: {prof['events_per_block']} events, {prof['self_us_per_block']} us per block; "
              "autograd nodes by total time: " + ", ".join(
                  f"{r['name']} {r['us_per_block']}" for r in prof["autograd_nodes_by_total_time"][:8]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
