"""A plain PyTorch reference of the DiT block stack's LoRA training step: the yardstick for the trainer's own step.

    python -m bench.plain_reference --out plain.json [--configs none,selective,full] [--steps 20 --warmup 3]
    python -m bench.plain_reference --tiny --out tiny.json      # small shapes, CPU, fp32, eager backend: seconds

What an engineer would write without this project (only the sizes come from `MossImageConfig()`): the blocks'
math (adaLN-modulated pre-norm RMSNorm, q/k RMSNorm, RoPE, SDPA, SwiGLU) with LoRA rank 16 on their six Linears,
over 256 text + 4,096 image tokens (1024x1024), batch 1; a step is forward, MSE loss, backward, fused AdamW. Each
block is `torch.compile`d with its checkpointing inside (CONFIGS). Timed like bench/checkpointing.py: CUDA events at
the step boundaries, median over `--steps` after `--warmup`, peak memory over the measured steps, one process per
configuration (`--tiny`: this process).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from library.moss_image.dit import MossImageConfig

# none | full (non-reentrant torch.utils.checkpoint) | selective (save the mm/addmm and attention outputs, recompute
# the rest) | selective_attn (save the attention outputs only)
CONFIGS = ("none", "selective", "full", "selective_attn")
REFERENCE = "full"
GIB = 2**30

_SDPA_NAMES = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
SDPA_OPS = frozenset(getattr(torch.ops.aten, n).default for n in _SDPA_NAMES if hasattr(torch.ops.aten, n))
MATMUL_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


class Shape(NamedTuple):
    """The stack, the sequence, the LoRA rank, where it runs, how many steps."""
    cfg: MossImageConfig
    grid: int  # latent patches per side
    text_tokens: int
    rank: int
    device: str
    dtype: torch.dtype
    backend: str
    steps: int
    warmup: int


def make_shape(tiny: bool, layers: int, steps: int | None, warmup: int | None) -> Shape:
    """The full blocks at 1024x1024 on CUDA in bf16 (20 steps after 3), or 2 tiny fp32 CPU blocks (3 after 1)."""
    if not tiny:
        return Shape(MossImageConfig(num_layers=layers), 64, 256, 16, "cuda", torch.bfloat16, "inductor", steps or 20,
                     3 if warmup is None else warmup)
    cfg = MossImageConfig(hidden_size=64, num_layers=2, num_heads=4, head_dim=16, ffn_hidden=128, rope_axes_dims=(4, 6, 6))
    return Shape(cfg, 4, 8, 4, "cpu", torch.float32, "eager", steps or 3, 1 if warmup is None else warmup)


class LoRALinear(nn.Module):
    """A frozen base Linear plus scale * up(down(x)) with trainable fp32 down/up (computed in bf16 under autocast)."""

    def __init__(self, d_in: int, d_out: int, rank: int, dtype: torch.dtype, alpha: float | None = None):
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False).to(dtype).requires_grad_(False)
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.up.weight, std=1e-3)  # small, not zero: every LoRA weight gets a gradient
        self.scale = (alpha or rank) / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x)) * self.scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the interleaved pairs of x [B, S, H, D] by the angles of cos/sin [S, D/2] (in fp32)."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, None], sin[:, None]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2).to(x.dtype)


def rope_tables(shape: Shape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, head_dim/2]: text token i at (i, 0, 0), image token (r, c) at (text_tokens, r, c)."""
    t, g = shape.text_tokens, shape.grid
    text = torch.stack([torch.arange(t), *torch.zeros(2, t, dtype=torch.long)], -1)
    rows, cols = torch.meshgrid(torch.arange(g), torch.arange(g), indexing="ij")
    image = torch.stack([torch.full((g * g,), t), rows.flatten(), cols.flatten()], -1)
    pos, theta = torch.cat([text, image]).double(), shape.cfg.rope_theta
    angles = [pos[:, axis, None] * theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
              for axis, dim in enumerate(shape.cfg.rope_axes_dims)]
    ang = torch.cat(angles, -1).float().to(device)
    return ang.cos(), ang.sin()


def _policy(keep: frozenset[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


CONTEXTS = {name: functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, keep))
            for name, keep in (("selective", MATMUL_OPS | SDPA_OPS), ("selective_attn", SDPA_OPS))}


class Block(nn.Module):
    def __init__(self, cfg: MossImageConfig, rank: int, dtype: torch.dtype, checkpointing: str):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden
        self.heads, self.eps, self.checkpointing = cfg.num_heads, cfg.norm_eps, checkpointing
        self.q, self.k, self.v, self.o = (LoRALinear(h, h, rank, dtype) for _ in range(4))
        self.ffn_up_gate = LoRALinear(h, 2 * f, rank, dtype)
        self.ffn_down = LoRALinear(f, h, rank, dtype)
        # frozen weights of the norms and the adaLN table (buffers: nothing for the optimizer)
        for name, size in (("norm1", h), ("norm2", h), ("q_norm", cfg.head_dim), ("k_norm", cfg.head_dim)):
            self.register_buffer(name, (1 + 0.1 * torch.randn(size)).to(dtype))
        self.register_buffer("table", (0.1 * torch.randn(6, h)).to(dtype))

    def attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = (p(h).view(b, s, self.heads, -1) for p in (self.q, self.k, self.v))
        q = rope(rms_norm(q, self.q_norm, self.eps), cos, sin)
        k = rope(rms_norm(k, self.k_norm, self.eps), cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(out.transpose(1, 2).flatten(2))

    def body(self, x: torch.Tensor, mod: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (mod + self.table[None]).unbind(1)
        h = rms_norm(x, self.norm1, self.eps) * (1 + scale1[:, None]) + shift1[:, None]
        x = x + gate1[:, None] * self.attention(h, cos, sin)
        h = rms_norm(x, self.norm2, self.eps) * (1 + scale2[:, None]) + shift2[:, None]
        value, gate = self.ffn_up_gate(h).chunk(2, dim=-1)
        return x + gate2[:, None] * self.ffn_down(F.silu(gate) * value)

    def forward(self, x: torch.Tensor, mod: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "none":
            return self.body(x, mod, cos, sin)
        if self.checkpointing == "full":  # keep the inputs only
            return checkpoint(self.body, x, mod, cos, sin, use_reentrant=False)
        return checkpoint(self.body, x, mod, cos, sin, use_reentrant=False, context_fn=CONTEXTS[self.checkpointing])


def _mark(device: torch.device) -> Any:
    """A CUDA event recorded in the stream (no host sync), or the host clock on the CPU."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed_ms(marks: list[Any], device: torch.device) -> list[float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    return [(b - a) * 1000 for a, b in itertools.pairwise(marks)]


def run_config(name: str, shape: Shape) -> dict[str, Any]:
    """Build the stack for checkpointing `name`, run warm-up and measured steps, return the figures."""
    device, cfg = torch.device(shape.device), shape.cfg
    torch.manual_seed(0)
    blocks = [Block(cfg, shape.rank, shape.dtype, name).to(device) for _ in range(cfg.num_layers)]
    for block in blocks:
        block.compile(backend=shape.backend)
    params = [p for b in blocks for p in b.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    seq, gen = shape.text_tokens + shape.grid**2, torch.Generator().manual_seed(1)
    x = torch.randn(1, seq, cfg.hidden_size, generator=gen).to(device, shape.dtype).requires_grad_(True)
    mod = (0.1 * torch.randn(1, 6, cfg.hidden_size, generator=gen)).to(device, shape.dtype)
    target = torch.randn(1, seq, cfg.hidden_size, generator=gen).to(device)
    cos, sin = rope_tables(shape, device)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=shape.dtype != torch.float32):
            h = x
            for block in blocks:
                h = block(h, mod, cos, sin)
            loss = F.mse_loss(h.float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        x.grad = None
        return loss.detach()

    t0, cuda = time.perf_counter(), device.type == "cuda"
    losses = [step() for _ in range(shape.warmup)]  # compiling happens here
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warmup_s = time.perf_counter() - t0
    marks = [_mark(device)]
    for _ in range(shape.steps):
        losses.append(step())
        marks.append(_mark(device))
    times = _elapsed_ms(marks, device)
    free, total = torch.cuda.mem_get_info() if cuda else (0, 0)
    return {
        "config": name, "ok": True, "steps": shape.steps, "warmup": shape.warmup,
        "step_ms_median": round(statistics.median(times), 1), "step_ms": [round(t, 1) for t in times],
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2) if cuda else 0.0,
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2) if cuda else 0.0,
        "driver_used_after_gib": round((total - free) / GIB, 2),
        "warmup_s": round(warmup_s, 1), "lora_params": sum(p.numel() for p in params),
        "losses": [float(v) for v in losses],  # warm-up steps first
    }


def compare(results: list[dict[str, Any]]) -> None:
    """max relative loss difference against `full` (else the first): same inputs, init and updates, so rounding only."""
    ok = [r for r in results if r.get("ok")]
    ref = next((r for r in ok if r["config"] == REFERENCE), ok[0] if ok else None)
    for r in ok:
        if r is not ref:
            r["max_rel_loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref["losses"]))


def _child(name: str, ns: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.plain_reference", "--single", name, "--steps", str(ns.steps),
           "--warmup", str(ns.warmup), "--layers", str(ns.layers)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=ns.timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"config": name, "ok": False, "error": f"timeout after {ns.timeout_s} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"config": name, "ok": False, "error": proc.stderr[-2000:]}
    return {**json.loads(lines[-1][len("RESULT "):]), "wall_s": round(time.perf_counter() - t0, 1)}


def _row(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"{r['config']:<16} FAILED: {r.get('error', '')[-300:]}"
    return (f"{r['config']:<16} {r['step_ms_median']:>8} ms  reserved {r['peak_reserved_gib']:>6} GiB  allocated"
            f" {r['peak_allocated_gib']:>6} GiB  dloss {r.get('max_rel_loss_diff', 0):.1e}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="plain PyTorch reference of the DiT stack's LoRA training step")
    p.add_argument("--out", type=Path, default=Path("plain.json"), help="JSON results")
    p.add_argument("--configs", default="none,selective,full", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=None, help="measured steps per configuration (default 20; tiny 3)")
    p.add_argument("--warmup", type=int, default=None, help="steps before measuring (default 3; tiny 1)")
    p.add_argument("--layers", type=int, default=MossImageConfig().num_layers, help="blocks in the stack")
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU (fp32, eager backend), this process")
    p.add_argument("--timeout_s", type=float, default=300, help="limit per configuration (its own process)")
    p.add_argument("--single", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    shape = make_shape(ns.tiny, ns.layers, ns.steps, ns.warmup)
    ns.steps, ns.warmup = shape.steps, shape.warmup
    names = [n.strip() for n in ns.configs.split(",") if n.strip()]
    if not names or any(n not in CONFIGS for n in names):
        print(f"--configs {ns.configs!r}: choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if not ns.tiny and not torch.cuda.is_available():
        print("bench.plain_reference needs a CUDA GPU (or --tiny for the CPU smoke run)", file=sys.stderr)
        return 2
    if ns.tiny:
        torch.set_num_threads(1)  # tiny shapes: more threads only wait for each other
    if ns.single:
        print("RESULT " + json.dumps(run_config(ns.single, shape)), flush=True)
        return 0
    payload: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, "-m", "bench.plain_reference", *(argv or sys.argv[1:])]),
        "torch": torch.__version__, "device": torch.cuda.get_device_name() if shape.device == "cuda" else "cpu",
        **{k: getattr(shape.cfg, k) for k in ("num_layers", "hidden_size", "num_heads", "head_dim", "ffn_hidden")},
        "image_tokens": shape.grid**2, "text_tokens": shape.text_tokens, "batch": 1, "lora_rank": shape.rank,
        "dtype": str(shape.dtype).removeprefix("torch."), "backend": shape.backend, "results": [],
    }
    for name in names:
        torch._dynamo.reset()  # --tiny: a fresh compile per configuration in this process
        result = run_config(name, shape) if ns.tiny else _child(name, ns)
        payload["results"].append(result)
        compare(payload["results"])
        tmp = ns.out.with_name(f".{ns.out.name}.tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, ns.out)
        print(_row(result), flush=True)
    print("\n".join(_row(r) for r in payload["results"]))  # again, with every loss difference
    return 0 if all(r.get("ok") for r in payload["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
