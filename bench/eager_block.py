"""The eager block's element-wise code, plain against fused forms and the fused Triton kernels, in one process: what
a training step's eager DiT blocks launch, move and keep, and how long they take.

    python -m bench.eager_block --out eager_block.json                       # on a CUDA GPU (full width, 4352 tokens)
    python -m bench.eager_block --device cpu --fake --layers 1 --out cpu.json    # the counts, on a CPU, in seconds

`library.moss_image.dit` writes its RMSNorms, RoPE, modulation and gated residuals in two forms, and
`networks.lora_generic` its LoRA sum: the plain one (the formulas as written, which a compiled region keeps and
inductor fuses) and an eager one (the same math in fewer, narrower kernels; `library.runtime.eager_fusion`).
`set_eager_fusion` picks one. On CUDA the eager form also takes Triton kernels for the norm + modulation, the q/k
norm + RoPE and the SwiGLU (`library.runtime.fused_ops`; `set_fused_kernels` turns them off). The forms run here
are "plain", "fused" (the eager forms, kernels off) and "kernels" (the eager forms with the kernels: what the trainer
runs on CUDA). With `--fake` the kernels' launches are stand-ins that allocate their results, so the counts of the
kernels form are the full-width ones without a GPU (a CPU run without `--fake` leaves that form out unless Triton's
interpreter is on). This script runs the forms on the same full-width blocks (the product's modules, a rank-16 LoRA
from networks.lora_generic on every block Linear, fp32 LoRA weights under bf16 autocast, as in the trainer), for
each `--checkpointing` mode (none, full, selective) and optionally ConvRot INT8 (`--int8`):

- ``ops``: the aten operators of one forward + backward, by kind (matrix product, attention, data-free view, other
  = element-wise and copies), with the bytes the "other" operators read and write (their tensor arguments and
  results): on a GPU those are memory-bound kernels, so bytes and launches are their cost. The fused Triton kernels
  are no aten operators: ``ops.kernels`` counts their launches and the bytes of their tensor arguments and results.
- ``saved_bytes_per_block_token``: what autograd keeps for backward per block and token without checkpointing (distinct
  storages, parameters excluded): the planner's activation figure.
- ``train_ms``: one forward + backward, median of `--iters` after warm-up (CUDA events on the GPU).
- the relative difference of the output, the input gradient and the LoRA gradients of the fused form (and of the
  kernels form) against the plain one (the same weights and inputs).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.convrot_int8 import _Blocks, relerr, time_ms
from library.lora import eager_node
from library.moss_image.dit import MossImageConfig
from library.runtime import eager_fusion, fused_ops
from library.runtime.checkpointing import ATTENTION_OPS

MATMUL_OPS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul", "linear", "_int_mm", "_scaled_mm"}
# operators that move no data (a view, an alias, an allocation without a fill) as they reach the dispatcher
VIEW_OPS = {"view", "_unsafe_view", "_reshape_alias", "expand", "unbind", "select", "slice", "t", "transpose", "permute",
            "as_strided", "unsqueeze", "squeeze", "view_as_complex", "view_as_real", "detach", "alias", "split",
            "split_with_sizes", "lift_fresh", "_conj", "conj", "resolve_conj", "resolve_neg", "empty", "empty_like",
            "empty_strided", "new_empty", "new_empty_strided"}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched inside it by kind, with the bytes the data-moving ones read and write."""

    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.other_ops: collections.Counter[str] = collections.Counter()
        self.other_bytes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not _tensors(out):  # a query (device, size, ...): no kernel
            return out
        if func in ATTENTION_OPS or "attention" in name:
            kind = "attention"
        elif name in MATMUL_OPS:
            kind = "matmul"
        elif name in VIEW_OPS:
            kind = "view"
        else:
            kind = "other"
            self.other_ops[name] += 1
        self.count[kind] += 1
        moved = sum(t.numel() * t.element_size() for t in _tensors((args, kwargs)) + _tensors(out))
        self.bytes[kind] += moved
        if kind == "other":
            self.other_bytes[name] += moved
        return out


def _storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (its C++ object: also defined for fake tensors, which have no data)."""
    return t.untyped_storage()._cdata


def count_ops(blocks: _Blocks) -> dict:
    with OpCounter() as counter:
        blocks.train_step()
    blocks.lora_grads()
    return {"count": dict(counter.count), "bytes": dict(counter.bytes),
            "other_ops": dict(counter.other_ops.most_common()),
            "other_gb_by_op": {k: round(v / 1e9, 3) for k, v in counter.other_bytes.most_common()}}


def saved_bytes(blocks: _Blocks) -> int:
    """Bytes autograd keeps for backward over one forward (distinct storages; parameters and buffers excluded: the
    ConvRot INT8 weights and scales are buffers, saved by reference). Under a FakeTensorMode a view of a weight (its
    transpose, saved by a Linear) carries a storage of its own: its base names the weight."""
    held = [*blocks.dit.parameters(), *blocks.dit.buffers(), *blocks.net.parameters(), *blocks.net.buffers()]
    params = {_storage_key(p) for p in held}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        base = t._base
        if key not in params and (base is None or _storage_key(base) not in params):
            storages[key] = t.untyped_storage().nbytes()
        return t

    x = blocks.x.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = blocks.forward(x)
    y.backward(blocks.gy)
    blocks.lora_grads()
    return sum(storages.values())


FORMS = ("plain", "fused", "kernels")


def _set_form(form: str) -> None:
    eager_fusion.set_eager_fusion(form != "plain")
    fused_ops.set_fused_kernels(form == "kernels")


KERNEL_LAUNCHES = ("norm_rope_forward", "norm_rope_backward", "swiglu_forward", "swiglu_backward",
                   "norm_modulate_forward", "norm_modulate_backward", "gated_residual_forward",
                   "gated_residual_backward")


def _kernel_result(name: str, args: tuple) -> torch.Tensor:
    """An uncomputed tensor of the shape and dtype the launch `name` returns (the stand-ins' result)."""
    like = args[0] if name.endswith("_forward") or name == "gated_residual_backward" else args[1]
    shape = (*like.shape[:-1], like.shape[-1] // 2) if name == "swiglu_forward" else like.shape
    return torch.empty(shape, dtype=like.dtype, device=like.device)


@contextlib.contextmanager
def kernel_tally(stand_in: bool, device: str) -> Any:
    """Counts the fused kernels' launches and the bytes of their tensor arguments and results while inside. With
    `stand_in` each launch is replaced by an allocation of its result and CPU tensors take the kernels (their check
    skipped), so that fake tensors count the kernels form without a GPU (nothing is computed)."""
    module = fused_ops._kernels()
    if module is None:
        raise RuntimeError("the kernels form needs triton installed")
    if not stand_in and not fused_ops.prepare(device):  # the check first: its launches are not the step's
        raise RuntimeError(f"the fused kernels do not run on {device} (see the warning above)")
    tally = {"launches": 0, "bytes": 0}
    real = {name: getattr(module, name) for name in KERNEL_LAUNCHES}

    def counted(name: str) -> Any:
        def call(*args: Any) -> torch.Tensor:
            out = _kernel_result(name, args) if stand_in else real[name](*args)
            tally["launches"] += 1
            tally["bytes"] += sum(t.numel() * t.element_size() for t in [*_tensors(args), out])
            return out

        return call

    interpret, prepare = fused_ops._INTERPRET, fused_ops.prepare
    try:
        for name in KERNEL_LAUNCHES:
            setattr(module, name, counted(name))
        if stand_in:
            fused_ops._INTERPRET, fused_ops.prepare = True, lambda device: True
        yield tally
    finally:
        for name, fn in real.items():
            setattr(module, name, fn)
        fused_ops._INTERPRET, fused_ops.prepare = interpret, prepare


def forms_for(device: str, fake: bool) -> tuple[str, ...]:
    """The forms a run can take: the kernels form where they run (CUDA, Triton's interpreter) or stand in (fake)."""
    runs_kernels = fake or device == "cuda" or fused_ops._INTERPRET
    return FORMS if runs_kernels and fused_ops._kernels() is not None else FORMS[:2]


def run_form(blocks: _Blocks, form: str, checkpointing: str, iters: int, device: str, fake: bool) -> dict:
    _set_form(form)
    for blk in blocks.dit.layers:
        blk.checkpointing = None if checkpointing == "none" else checkpointing
    # new cos/sin tensors, as each training step builds them: the counted step makes its own RoPE rotation table
    blocks.cos, blocks.sin = blocks.cos.clone(), blocks.sin.clone()
    tally = kernel_tally(fake, device) if form == "kernels" else contextlib.nullcontext(None)
    with tally as kernels, _fake(fake):
        r: dict[str, Any] = {"ops": count_ops(blocks)}
        if kernels is not None:
            r["ops"]["kernels"] = dict(kernels)  # the counted step's launches (not those of the saved-bytes run)
        if checkpointing == "none":
            r["saved_bytes_per_block_token"] = saved_bytes(blocks) / (len(blocks.dit.layers) * blocks.x.shape[1])
    if not fake:
        r["train_ms"] = time_ms(blocks.train_step, device, iters, warmup=2)
        blocks.lora_grads()
    return r


def _fake(enabled: bool) -> Any:
    """FakeTensorMode (shapes and dtypes, no data, no arithmetic) or nothing."""
    if not enabled:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def compare(blocks: _Blocks, forms: tuple[str, ...]) -> dict:
    """Output, input gradient and LoRA gradients of the fused forms (and of the kernels, where in `forms`) against
    the plain forms (one step each)."""
    results = []
    for form in forms:
        _set_form(form)
        for blk in blocks.dit.layers:
            blk.checkpointing = None
        x = blocks.x.detach().requires_grad_(True)
        y = blocks.forward(x)
        y.backward(blocks.gy)
        results.append((y.detach(), x.grad.detach(), blocks.lora_grads()))
    (y0, gx0, g0), *others = results
    out = {}
    for form, (y1, gx1, g1) in zip(forms[1:], others):
        tag = "" if form == "fused" else f"{form}_"
        out.update({f"{tag}out_rel_diff": relerr(y1, y0), f"{tag}input_grad_rel_diff": relerr(gx1, gx0),
                    f"{tag}lora_grad_rel_diff_max": max(relerr(a, b) for a, b in zip(g1, g0))})
    return out


def summarise(forms: dict[str, dict]) -> dict:
    plain, fused = forms["plain"], forms["fused"]
    r = {"other_ops_plain": plain["ops"]["count"].get("other", 0), "other_ops_fused": fused["ops"]["count"].get("other", 0),
         "other_gb_plain": plain["ops"]["bytes"].get("other", 0) / 1e9,
         "other_gb_fused": fused["ops"]["bytes"].get("other", 0) / 1e9}
    if "train_ms" in plain:
        r["train_ms_plain"], r["train_ms_fused"] = plain["train_ms"]["median_ms"], fused["train_ms"]["median_ms"]
        r["plain_over_fused"] = r["train_ms_plain"] / r["train_ms_fused"]
    kernels = forms.get("kernels")
    if kernels is not None:
        r["other_ops_kernels"] = kernels["ops"]["count"].get("other", 0)
        r["other_gb_kernels"] = kernels["ops"]["bytes"].get("other", 0) / 1e9
        r["kernel_launches"] = kernels["ops"]["kernels"]["launches"]
        r["kernel_gb"] = kernels["ops"]["kernels"]["bytes"] / 1e9
        if "train_ms" in kernels:
            r["train_ms_kernels"] = kernels["train_ms"]["median_ms"]
            r["fused_over_kernels"] = r["train_ms_fused"] / r["train_ms_kernels"]
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=4352, help="sequence length (1024x1024: 4096 image + 256 text)")
    p.add_argument("--layers", type=int, default=2, help="full-width blocks")
    p.add_argument("--iters", type=int, default=20, help="timed steps per form and mode (median)")
    p.add_argument("--checkpointing", default="none,full,selective")
    p.add_argument("--int8", action="store_true", help="also the ConvRot INT8 blocks")
    p.add_argument("--fake", action="store_true", help="count operators and saved bytes on fake tensors (no data, no "
                   "timing, no comparison): the full-width figures on a machine too slow to run them")
    p.add_argument("--lora_ungrouped", action="store_true",
                   help="q, k and v's LoRA as one node each, not one LoRAGroup (library.lora.eager_node)")
    p.add_argument("--out", required=True, help="JSON file for the results (also printed)")
    args = p.parse_args(argv)
    cfg = dataclasses.replace(MossImageConfig(), num_layers=args.layers, num_refiner_layers=0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
                           "torch": torch.__version__, "tokens": args.tokens, "layers": args.layers,
                           "fake": args.fake, "lora_grouped": not args.lora_ungrouped, "runs": {}}
    previous = (eager_fusion.set_eager_fusion(True), fused_ops.set_fused_kernels(True),
                eager_node.set_lora_grouped(not args.lora_ungrouped))
    forms_run = forms_for(args.device, args.fake)
    try:
        for precision in ("bf16", "int8") if args.int8 else ("bf16",):
            blocks = _Blocks(cfg, args.tokens, args.device, int8=precision == "int8")
            if not args.fake:
                out["runs"][f"{precision}_compare"] = compare(blocks, forms_run)
            for mode in [m for m in args.checkpointing.split(",") if m]:
                forms = {name: run_form(blocks, name, mode, args.iters, args.device, args.fake) for name in forms_run}
                out["runs"][f"{precision}_{mode}"] = {**forms, "summary": summarise(forms)}
                print(f"{precision} {mode}: {out['runs'][f'{precision}_{mode}']['summary']}", file=sys.stderr)
            del blocks
    finally:
        eager_fusion.set_eager_fusion(previous[0])
        fused_ops.set_fused_kernels(previous[1])
        eager_node.set_lora_grouped(previous[2])
    text = json.dumps(out, indent=1)
    path = Path(args.out)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a complete file or none
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
