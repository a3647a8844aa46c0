"""`--compile`: torch.compile of the DiT (each block, the embedders, the text refiner and the final layer), and the
CUDA speed switches.

Each block is compiled on its own (same code, so the compiled graph is shared and compile time stays small);
gradient checkpointing happens inside the compiled blocks (`library.runtime.checkpointing`), so the compiled
backward recomputes only what the policy does not keep. Buckets (training) or image sizes (inference) of different
sizes change the sequence length: with `--compile_dynamic auto` the blocks are compiled with dynamic shapes when the
run has several of them, and the dynamo recompile limit is raised to cover them. ConvRot INT8 layers are registered
torch.library ops (`library.quant.convrot_ops`), so an int8 block compiles to one graph like a bf16 one
(`--compile_fullgraph` included). Skipped blocks (the unconditional CFG pass) and block swap live in the model's
block loop, outside the compiled blocks.

The options are shared by the trainer and the inference script (declared by
`library.options.groups.add_compile_arguments`). torch is imported inside the functions so that importing this module
stays light.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from library.errors import UserError

logger = logging.getLogger(__name__)

COMPILE_MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
# the modes that capture CUDA graphs (torch's CUDA-graph trees) and what each user gets without them
CUDA_GRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def check_compile_args(args: argparse.Namespace) -> None:
    """The compile modes that capture CUDA graphs are refused (see `CUDA_GRAPH_MODES`); `--compile_fullgraph` needs
    each block to be one graph: refused with --split_attn.

    Why no CUDA graphs: the DiT is compiled region by region (each block, the embedders, the text refiner, the final
    layer), and torch's CUDA-graph trees give a region's outputs memory that a later replay overwrites while the next
    region, the backward or a later denoising step still reads them. The trainer's step failed so on an H200
    (docs/benchmarks.md, fifteenth run), and the step is GPU-bound there anyway (the GPU runs at its power cap)."""
    if not args.compile:
        return
    mode = getattr(args, "compile_mode", "default")
    if mode in CUDA_GRAPH_MODES:
        raise UserError(f"--compile_mode {mode} captures CUDA graphs, which the DiT's per-block compile cannot use"
                        f" (a compiled region's outputs are overwritten by a later replay while they are still"
                        f" needed): use --compile_mode {CUDA_GRAPH_MODES[mode]}.")
    if not args.compile_fullgraph:
        return
    if args.split_attn:
        raise UserError("--compile_fullgraph cannot be used with --split_attn (split attention uses dynamic control"
                        " flow).")


def check_cpu_compiler(args: argparse.Namespace, device: Any) -> None:
    """inductor on the CPU builds C++ code: say so clearly when no C++ compiler is found."""
    if not args.compile or args.compile_backend != "inductor" or str(device).split(":")[0] != "cpu":
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another torch layout: inductor reports a missing compiler itself
        return
    try:
        get_cpp_compiler()
    except Exception as e:  # inductor raises various error types for a missing compiler
        raise UserError(f"--compile on the CPU with the inductor backend needs a C++ compiler, and none was found"
                        f" ({e}): install one (g++ or clang++, or set CXX), or use --compile_backend aot_eager.") from e


def apply_cuda_backend_options(args: argparse.Namespace) -> None:
    """--cuda_allow_tf32 and --cuda_cudnn_benchmark (the options of sd-scripts' and musubi-tuner's DiT scripts), set
    at the start of a run as they set them, before any model runs: TF32 matmuls and convolutions, cuDNN autotuning."""
    import torch

    if not (args.cuda_allow_tf32 or args.cuda_cudnn_benchmark):
        return
    if not torch.cuda.is_available():
        logger.info("--cuda_allow_tf32 / --cuda_cudnn_benchmark: no CUDA device, nothing to set")
        return
    if args.cuda_allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        logger.info("Enabled TF32 on CUDA")
    if args.cuda_cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
        logger.info("Enabled cuDNN benchmark")


def apply_cuda_optimizations(args: argparse.Namespace) -> None:
    """TF32 matmuls and convolutions: applied whenever CUDA is used, with or without --compile.

    cuDNN autotuning (`cudnn.benchmark`) stays off unless --cuda_cudnn_benchmark asks for it: the DiT has no
    convolution, and the VAE's convolutions run a few times per run, where the search costs more than it gains and
    takes workspaces as large as the free memory (a 1024x1024 decode peaked at 130 GiB allocated on an H200 with it
    on)."""
    import torch

    if not torch.cuda.is_available():
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


_REDUCTION_FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


@contextlib.contextmanager
def exact_fp32_matmul(device: Any = None, exact_reductions: bool = False) -> Iterator[None]:
    """fp32 matmuls in full fp32 on CUDA (no TF32, which `apply_cuda_optimizations` or --cuda_allow_tf32 turns on),
    restoring the setting afterwards; for a `device` other than CUDA nothing changes. What must not depend on the
    process's setting takes it: caching (the trainer turns TF32 on for the rest of the process, the cache tools never
    do: the same images must give the same caches in a tool, a process's first run and its later runs) and the LoRA
    merge. `exact_reductions`: bf16 / fp16 matmuls without reduced-precision reductions too (the ConvRot rotations,
    whose quantised codes must not depend on the settings)."""
    import torch

    if device is not None and torch.device(device).type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    flags = ("allow_tf32", *(_REDUCTION_FLAGS if exact_reductions else ()))
    saved = {f: getattr(matmul, f) for f in flags if hasattr(matmul, f)}
    try:
        for f in saved:
            setattr(matmul, f, False)
        yield
    finally:
        for f, value in saved.items():
            setattr(matmul, f, value)


def compile_blocks(args: argparse.Namespace, dit: Any, num_shapes: int = 1) -> None:
    """torch.compile the DiT in place (`MossImage.compile_regions`): every block, text refiner blocks included, and
    the embedders and the final layer. The blocks share one compiled code object, whose entries (main and refiner
    blocks, with and without gradients, per shape) the recompile limit must cover."""
    import torch

    from library.quant.convrot_ops import enable_inductor_quantize_dedupe  # torch and triton: loaded when compiling
    from library.runtime.fused_compiled import enable_inductor_producer_codes

    enable_inductor_quantize_dedupe()  # INT8 inference graphs: q, k and v share one quantised input
    enable_inductor_producer_codes()  # INT8 graphs: SwiGLU writes ffn_down's codes (after the dedupe)
    dynamic = {"true": True, "false": False}.get(args.compile_dynamic, None)
    if dynamic is None:
        dynamic = True if num_shapes > 1 else None
    limit = args.compile_cache_size_limit or max(16, 4 * num_shapes)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
    logger.info("torch.compile of %d blocks (+ %d text refiner blocks, the embedders and the final layer): backend=%s"
                " mode=%s dynamic=%s fullgraph=%s recompile limit=%d", len(dit.layers),
                len(dit.text_embedder.blocks), args.compile_backend, args.compile_mode, dynamic, args.compile_fullgraph,
                torch._dynamo.config.cache_size_limit)
    dit.compile_regions(backend=args.compile_backend, mode=args.compile_mode, dynamic=dynamic,
                        fullgraph=args.compile_fullgraph)


ALLOCATOR_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch's CUDA name, its newer name


def allocator_conf_set() -> tuple[str, str] | None:
    """(variable, value) of the allocator settings the environment gives, or None."""
    import os

    for name in ALLOCATOR_CONF_VARIABLES:
        if name in os.environ:
            return name, os.environ[name]
    return None


def enable_expandable_segments() -> None:
    """--cuda_expandable_segments (trainer and inference): the allocator's expandable segments (a setting the user
    made in PYTORCH_CUDA_ALLOC_CONF wins). torch reads that variable when its allocator settings are first used, which
    may have happened already: set at run time, the variable had no effect in the bench's processes on the H200. So
    the running allocator is told through torch's settings call (measured: INT8 selective + compile then fitted a
    9 GiB cap, docs/benchmarks.md), and the variable is set for child processes."""
    import os

    import torch

    conf = allocator_conf_set()
    if conf is not None:
        logger.info("--cuda_expandable_segments: %s=%s is set and wins", *conf)
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if not torch.cuda.is_available():
        return
    # torch 2.9+ has the accelerator-wide call (and deprecates the CUDA one); older ones have only the CUDA one
    setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
              or getattr(torch.cuda.memory, "_set_allocator_settings", None))
    if setter is None:
        logger.warning("--cuda_expandable_segments: this torch cannot change the allocator's settings at run time;"
                       " set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting instead")
        return
    setter("expandable_segments:True")
