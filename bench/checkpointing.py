"""The trainer's own training step per checkpointing configuration: median step time and peak reserved memory.

    python -m bench.make_full_snapshot /tmp/full --what dit
    python -m bench.checkpointing --snapshot /tmp/full --out checkpointing.json [--configs a,b] [--steps 20]
    python -m bench.checkpointing --tiny --out tiny.json        # the tiny snapshot on the CPU, in seconds

Run from the repository root. Each configuration is a set of trainer options (CONFIGS) parsed by the trainer's own
parser and set up by `MossImageNetworkTrainer` the way `train()` does it (DiT load with block swap, LoRA network,
gradient checkpointing and its policy, optimizer with fused AdamW on CUDA, device placement and --compile); the
steps are the trainer's `_run_epoch` over one cached batch (1024x1024 latents, 256 text tokens, batch 1, LoRA rank
16, --mixed_precision bf16): forward, backward, clipping, optimizer and scheduler steps, the loss read one step
later, GC at step boundaries. A CUDA event at every step boundary (no host sync) gives each step's time including
any GPU idle between steps; the median is over `--steps` steps after `--warmup` steps (compiling happens in the
warm-up). The host's counters at the same boundaries (`host_columns`) say, per step, whether the GPU waited for the
host (`gpu_lag_ms`) and what the host's CPUs did meanwhile (CPU time, the hypervisor's steal time, preemptions).
`max_memory_reserved` is read over the measured steps and over the whole process (with the load). Three more steps
run with CUDA's sync debug mode to count the host syncs per step and name their Python lines (`host_sync_sites`).
`--block_memory` adds one step that records the allocated memory each main block's forward adds (what the block
keeps for backward, and its output): a checkpointed full-size block keeps about its 25.5 MiB output.
`--memory_cap_gib G` lets each configuration's process reserve at most G GiB (a card of that size): the step must fit,
and `num_alloc_retries` counts the times the allocator had to free its cache to do so.
Every configuration sees the same inputs, noise and initial LoRA, so the losses must agree (`max_rel_loss_diff`
against `gc_full_compile`, bf16 rounding aside). Each configuration runs in a process of its own (clean memory
statistics); `--tiny` runs them in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

import moss_image_train_network as trainer_script
from bench.gpu_profile import kernel_profile
from bench.host_profile import host_profile
from library.lora import eager_node
from library.quant import int8_gemm_kernels
from library.runtime import fused_compiled, fused_ops, transfer
from library.runtime.collector import StepGarbageCollector
from library.runtime.eager_fusion import plain_forms
from library.training import lr_schedulers, nonfinite
from library.training.network_trainer import RunState
from library.training.run_options import RunOptions

try:  # the main thread's CPU time and preemptions (Unix)
    import resource
except ImportError:  # pragma: no cover
    resource = None  # type: ignore[assignment]

logger = logging.getLogger("bench.checkpointing")

GC = ["--gradient_checkpointing"]
SELECTIVE = [*GC, "--checkpointing_policy", "selective"]
SWAP20_H2D = ["--blocks_to_swap", "20", "--block_swap_h2d_only"]
CONFIGS: dict[str, list[str]] = {
    "no_gc_compile": ["--compile"],
    "no_gc_compile_max_autotune": ["--compile", "--compile_mode", "max-autotune-no-cudagraphs"],
    "gc_full_compile_int8": [*GC, "--compile", "--convrot_int8"],
    "no_gc_compile_int8": ["--compile", "--convrot_int8"],
    "gc_full_eager_int8": [*GC, "--convrot_int8"],
    "gc_selective_compile_int8": [*SELECTIVE, "--compile", "--convrot_int8"],
    "gc_selective_compile_int8_skip10": [*SELECTIVE, "--checkpointing_skip_blocks", "10", "--compile", "--convrot_int8"],
    "gc_selective_compile_int8_skip13": [*SELECTIVE, "--checkpointing_skip_blocks", "13", "--compile", "--convrot_int8"],
    "gc_selective_compile_int8_skip16": [*SELECTIVE, "--checkpointing_skip_blocks", "16", "--compile", "--convrot_int8"],
    "gc_selective_compile_int8_skip16_expandable": [*SELECTIVE, "--checkpointing_skip_blocks", "16", "--compile",
                                                    "--convrot_int8", "--cuda_expandable_segments"],
    "gc_selective_compile_max_autotune": [*SELECTIVE, "--compile", "--compile_mode", "max-autotune-no-cudagraphs"],
    "gc_full_compile": [*GC, "--compile"],
    "gc_selective_compile": [*SELECTIVE, "--compile"],
    "gc_full_eager": GC,
    "gc_selective_eager": SELECTIVE,
    "swap20_h2d_full_compile": [*SWAP20_H2D, *GC, "--compile"],
    "swap20_h2d_selective_compile": [*SWAP20_H2D, *SELECTIVE, "--compile"],
}
# the curve of --checkpointing_skip_blocks beyond the measured 10 / 13 / 16 (the planner's speed model assumes each
# skipped block saves its recomputation; the fourth run's 16 was slower and unsteady): INT8 selective and bf16 full,
# each also with expandable segments (the allocator question)
for _n in (14, 18, 20, 26, 32):
    CONFIGS[f"gc_selective_compile_int8_skip{_n}"] = [*SELECTIVE, "--checkpointing_skip_blocks", str(_n), "--compile",
                                                      "--convrot_int8"]
    CONFIGS[f"gc_selective_compile_int8_skip{_n}_expandable"] = [*CONFIGS[f"gc_selective_compile_int8_skip{_n}"],
                                                                 "--cuda_expandable_segments"]
for _n in (10, 20):
    CONFIGS[f"gc_full_compile_skip{_n}"] = [*GC, "--checkpointing_skip_blocks", str(_n), "--compile"]
    CONFIGS[f"gc_full_compile_skip{_n}_expandable"] = [*CONFIGS[f"gc_full_compile_skip{_n}"],
                                                       "--cuda_expandable_segments"]
# the ≤ 9 GiB question: INT8 selective + compile (310 ms at 9.6 GiB) with a few blocks swapped (about 0.12 GiB of int8
# weights each), and INT8 full checkpointing + compile with the same
for _n in (4, 6, 8):
    CONFIGS[f"swap{_n}_h2d_selective_compile_int8"] = ["--blocks_to_swap", str(_n), "--block_swap_h2d_only",
                                                       *SELECTIVE, "--compile", "--convrot_int8"]
    CONFIGS[f"swap{_n}_h2d_selective_compile_int8_expandable"] = [*CONFIGS[f"swap{_n}_h2d_selective_compile_int8"],
                                                                  "--cuda_expandable_segments"]
CONFIGS["gc_selective_compile_int8_expandable"] = [*SELECTIVE, "--compile", "--convrot_int8",
                                                   "--cuda_expandable_segments"]
CONFIGS["swap8_h2d_full_compile_int8"] = ["--blocks_to_swap", "8", "--block_swap_h2d_only", *GC, "--compile",
                                          "--convrot_int8"]
# eager without checkpointing: the activation figure of the memory model (library.planning.memory_model), and its
# ConvRot INT8 twin (where eager INT8 loses against bf16 without a recompute in the way)
CONFIGS["no_gc_eager"] = []
CONFIGS["no_gc_eager_int8"] = ["--convrot_int8"]
# bench-only: the same trainer flags with the plain forms of the element-wise code in eager mode
# (library.runtime.eager_fusion), the step as it was before the eager forms, for a ratio measured in one run
PLAIN_FORMS_SUFFIX = "_plain_forms"
for _name in ("no_gc_eager", "gc_full_eager", "gc_full_eager_int8", "gc_selective_eager"):
    CONFIGS[_name + PLAIN_FORMS_SUFFIX] = CONFIGS[_name]
# bench-only: full checkpointing inside compiled blocks as torch's plain checkpoint tags it (dynamo tags the traced body;
# library.runtime.checkpointing.COMPILED_FULL), and with AOTAutograd's older RNG functionalisation (the trainer's
# setting until its host draws got their own generator, library.training.host_random). `_graphsafe_rng`, the
# sixth run's name for the graph-safe one, is the trainer's default now: those names run the plain configuration.
PLAIN_FULL_TAGS = "_plain_full_tags"
GRAPHSAFE_RNG = "_graphsafe_rng"
OLDER_RNG = "_older_rng"
for _name in ("gc_full_compile_int8", "gc_full_compile", "swap8_h2d_full_compile_int8"):
    for _variant in (PLAIN_FULL_TAGS, GRAPHSAFE_RNG, OLDER_RNG, PLAIN_FULL_TAGS + GRAPHSAFE_RNG):
        CONFIGS.setdefault(_name + _variant, CONFIGS[_name])
# bench-only: the ConvRot INT8 configurations with the previous default activation quantiser ("rows") instead of
# "quarters" (library.quant.convrot_quant_kernels), for the ratio of the two in one run
ROWS_QUANTISER = "_rows_quantiser"
for _name in ("gc_full_compile_int8", "gc_selective_compile_int8", "gc_selective_compile_int8_skip16",
              "gc_full_eager_int8", "no_gc_compile_int8"):
    CONFIGS[_name + ROWS_QUANTISER] = CONFIGS[_name]
# bench-only: the eager ConvRot INT8 configurations without the int8 Linears' launch plans (library.quant.linear_plan),
# every call through the regular path, for the ratio of the two in one run
UNPLANNED = "_unplanned"
for _name in ("gc_full_eager_int8", "no_gc_eager_int8"):
    CONFIGS[_name + UNPLANNED] = CONFIGS[_name]
# bench-only: eager full checkpointing in torch's non-reentrant form (the trainer's form until the reentrant one,
# library.runtime.checkpointing.EAGER_FULL), for the ratio of the two in one run
NONREENTRANT = "_nonreentrant"
for _name in ("gc_full_eager", "gc_full_eager_int8"):
    CONFIGS[_name + NONREENTRANT] = CONFIGS[_name]
# bench-only: the eager configurations without the fused Triton kernels of the element-wise code
# (library.runtime.fused_ops: the eager forms of library.runtime.eager_fusion only), for the ratio of the two in one run
NO_KERNELS = "_no_kernels"
for _name in ("no_gc_eager", "no_gc_eager_int8", "gc_full_eager", "gc_full_eager_int8", "gc_selective_eager"):
    CONFIGS[_name + NO_KERNELS] = CONFIGS[_name]
# bench-only: the eager configurations with each LoRA delta as separate operators instead of one autograd node
# (library.lora.eager_node.set_lora_one_node), for the ratio of the two in one run
LORA_OPS = "_lora_ops"
for _name in ("no_gc_eager", "gc_full_eager", "gc_full_eager_int8"):
    CONFIGS[_name + LORA_OPS] = CONFIGS[_name]
# bench-only: the one-node LoRA adding into new tensors (a device copy of the addend each) instead of in place
# (library.lora.eager_node.set_lora_in_place), for the ratio of the two in one run
LORA_COPIES = "_lora_copies"
for _name in ("no_gc_eager", "no_gc_eager_int8", "gc_full_eager", "gc_full_eager_int8"):
    CONFIGS[_name + LORA_COPIES] = CONFIGS[_name]
# bench-only: a block's q, k and v LoRA-wrapped Linears as one node each instead of one LoRAGroup node, and in
# compiled blocks as three LoRAs instead of one down-projection (library.lora.compiled_group), both switched by
# library.lora.eager_node.set_lora_grouped, for the ratio of the two in one run
LORA_UNGROUPED = "_lora_ungrouped"
for _name in ("no_gc_eager", "no_gc_eager_int8", "gc_full_eager", "gc_full_eager_int8", "no_gc_compile",
              "gc_full_compile", "gc_full_compile_int8", "gc_selective_compile_int8_skip16"):
    CONFIGS[_name + LORA_UNGROUPED] = CONFIGS[_name]
# bench-only: the batch copied to the GPU from pageable host memory instead of pinned memory
# (library.runtime.transfer.set_pinned_transfers), for the ratio of the two in one run
PAGEABLE = "_pageable"
for _name in ("no_gc_eager", "no_gc_compile", "gc_full_eager", "gc_full_compile"):
    CONFIGS[_name + PAGEABLE] = CONFIGS[_name]
# bench-only: compiled blocks without the fused kernels as ops (inductor's kernels for all the element-wise code, the
# form before library.runtime.fused_compiled), and with the norm + modulation kernel too (off by default)
COMPILED_PLAIN = "_compiled_plain"
COMPILED_ALL = "_compiled_all"
for _name in ("no_gc_compile", "no_gc_compile_int8", "gc_full_compile", "gc_full_compile_int8", "gc_selective_compile",
              "gc_selective_compile_int8", "gc_selective_compile_int8_skip16"):
    CONFIGS[_name + COMPILED_PLAIN] = CONFIGS[_name]
    CONFIGS[_name + COMPILED_ALL] = CONFIGS[_name]
# bench-only: the plain LoRA (what compiled blocks trace) scaling its output instead of its rank activations
# (library.lora.eager_node.set_scale_on_ranks), for the ratio of the two in one run
SCALE_ON_OUTPUT = "_scale_on_output"
for _name in ("no_gc_compile", "gc_full_compile", "gc_full_compile_int8"):
    CONFIGS[_name + SCALE_ON_OUTPUT] = CONFIGS[_name]
# bench-only: the eager LoRA nodes taking their weights' gradients as bf16 products, scaled and cast, instead of one
# addmm writing fp32 (library.lora.eager_node.set_lora_fp32_grads), for the ratio of the two in one run
BF16_GRADS = "_bf16_grads"
for _name in ("no_gc_eager", "no_gc_eager_int8", "gc_full_eager", "gc_full_eager_int8"):
    CONFIGS[_name + BF16_GRADS] = CONFIGS[_name]
# bench-only: the eager gated residual as torch's addcmul instead of the fused kernel
# (library.runtime.fused_ops.fused_gated_residual), for the ratio of the two in one run
TORCH_RESIDUAL = "_torch_residual"
for _name in ("no_gc_eager", "no_gc_eager_int8", "gc_full_eager", "gc_full_eager_int8"):
    CONFIGS[_name + TORCH_RESIDUAL] = CONFIGS[_name]
# bench-only: the ConvRot INT8 blocks' norm + modulation and SwiGLU without the int8 codes of their outputs (each
# int8 Linear's input quantised by the activation quantiser, library.runtime.fused_ops.set_fused_quant), for the
# ratio in one run
SEPARATE_QUANTISER = "_separate_quantiser"
for _name in ("no_gc_eager_int8", "gc_full_eager_int8"):
    CONFIGS[_name + SEPARATE_QUANTISER] = CONFIGS[_name]
# bench-only: compiled INT8 blocks without SwiGLU writing ffn_down's codes (the inductor pass of
# library.runtime.fused_compiled turned off: SwiGLU, then the quantiser), for the ratio in one run
NO_COMPILED_CODES = "_no_compiled_codes"
for _name in ("gc_full_compile_int8", "no_gc_compile_int8"):
    CONFIGS[_name + NO_COMPILED_CODES] = CONFIGS[_name]
# bench-only: ConvRot INT8 q, k and v as three base products, not stacked into one
# (set_compiled_kernels(training_stacked_qkv=False); on by default, and the trainer stacks for --compile without
# checkpointing only), for the ratio in one run
THREE_QKV = "_three_qkv"
CONFIGS["no_gc_compile_int8" + THREE_QKV] = CONFIGS["no_gc_compile_int8"]
REFERENCE = "gc_full_compile"
REPO = Path(__file__).resolve().parent.parent
GIB = 2**30




class Shape(SimpleNamespace):
    """image (square, pixels), text tokens, LoRA rank, device, --mixed_precision, compile backend, steps."""


FULL = Shape(image=1024, text_tokens=256, rank=16, device="cuda", precision="bf16", backend="inductor", steps=20,
             warmup=3, profile=False, host_profile=False, block_memory=False, memory_cap_gib=None)
# fp32 on the CPU (bf16 matmuls there are slow) and dynamo without code generation: a smoke run in seconds
TINY = Shape(image=64, text_tokens=8, rank=4, device="cpu", precision="no", backend="eager", steps=3, warmup=1,
             profile=False, host_profile=False, block_memory=False, memory_cap_gib=None)


class _OneBucket:
    """What the step asks of the dataset group: the step counter, and (for --compile) the buckets."""

    def __init__(self, image: int):
        self.image = image

    def set_current_step(self, step: int) -> None:
        pass

    def image_infos(self) -> list[Any]:
        return [SimpleNamespace(bucket_reso=(self.image, self.image))]


class _Progress:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass


def trainer_args(snapshot: Path, flags: list[str], shape: Shape, out_dir: Path, total_steps: int
                 ) -> argparse.Namespace:
    argv = ["--pretrained_model_name_or_path", str(snapshot), "--output_dir", str(out_dir),
            "--network_module", "networks.lora_generic", "--network_dim", str(shape.rank),
            "--network_alpha", str(shape.rank), "--network_train_unet_only", "--cache_text_encoder_outputs",
            "--mixed_precision", shape.precision, "--seed", "0", "--max_train_steps", str(total_steps),
            "--compile_backend", shape.backend, *flags]
    return trainer_script.setup_parser().parse_args(argv)


def build(snapshot: Path, flags: list[str], shape: Shape, out_dir: Path, total_steps: int
          ) -> tuple[Any, RunState, dict[str, Any]]:
    """The trainer, its run state after `train()`'s set-up, and one cached batch (the trainer's batch layout)."""
    args = trainer_args(snapshot, flags, shape, out_dir, total_steps)
    trainer = trainer_script.MossImageNetworkTrainer()
    trainer.resolve_args(args)  # train()'s order: implications, checks, derived options, accelerator, models
    trainer.verify_args(args)
    trainer._check_swap_and_int8_args(args)
    run = RunState(args, RunOptions.from_args(args, False))
    run.accelerator = trainer._prepare_accelerator(args, run.options.log_with)
    trainer._start_host_random(run)
    run.train_group, run.text_encoders, run.max_train_steps = _OneBucket(shape.image), [None], total_steps
    run.unet, run.text_encoders = trainer.load_unet_lazily(args, run.weight_dtype, run.accelerator, run.text_encoders)
    trainer._create_network(run)
    if args.gradient_checkpointing:
        trainer.enable_gradient_checkpointing(run)
    trainer._optimizer_and_scheduler(run)
    run.lr_scheduler = lr_schedulers.get_scheduler(run.options.scheduler, run.optimizer, 1, total_steps)
    trainer._place_models(run)
    run.optimizer, run.lr_scheduler = run.accelerator.prepare(run.optimizer, run.lr_scheduler)
    trainer._install_fused_backward_pass(run)
    gen = torch.Generator().manual_seed(1)
    channels = run.unet.config.in_channels
    trainer.bn_running_mean = torch.randn(channels, generator=gen) * 0.3
    trainer.bn_running_var = torch.rand(channels, generator=gen) * 1.5 + 0.5
    side = shape.image // 8
    embeds = (torch.randn(shape.text_tokens, run.unet.config.text_dim, generator=gen) * 0.5).to(torch.bfloat16)
    batch = {"latents": torch.randn(1, channels // 4, side, side, generator=gen),
             "text_encoder_outputs": [(embeds, torch.ones(shape.text_tokens, dtype=torch.bool))],
             "captions": ["a benchmark caption"], "loss_weights": torch.ones(1)}
    return trainer, run, batch


class HostSample(NamedTuple):
    """The host's counters at a step boundary."""

    clock: float  # perf_counter seconds
    tma_encodes: int  # TMA descriptors the int8 GEMMs encoded so far
    thread_cpu: float  # CPU seconds of this (the main) thread
    involuntary_switches: int  # times the OS took the CPU from this thread
    device_allocs: int  # cudaMalloc calls of the caching allocator so far
    process_cpu: float = 0.0  # CPU seconds of the process (autograd runs a CUDA backward on a thread of its own)
    steal: float = 0.0  # seconds the hypervisor ran other guests on this machine's CPUs (all CPUs, /proc/stat)


def host_sample(device: torch.device) -> HostSample:
    usage = resource.getrusage(resource.RUSAGE_THREAD) if hasattr(resource, "RUSAGE_THREAD") else None  # Linux
    allocs = int(torch.cuda.memory_stats().get("num_device_alloc", 0)) if device.type == "cuda" else 0
    return HostSample(time.perf_counter(), int8_gemm_kernels.tma_encodes(), time.thread_time(),
                      usage.ru_nivcsw if usage else 0, allocs, time.process_time(), _steal_s())


def _steal_s() -> float:
    """The `steal` column of /proc/stat's first line (all CPUs), in seconds; 0 where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


def host_columns(host: list[HostSample], step_ms: list[float], cuda: bool) -> dict[str, list[float]]:
    """Per step: the host's time from one boundary to the next, the main thread's and the process's CPU time in it
    (a CUDA backward runs on autograd's own thread), the OS's preemptions of the main thread, the time the hypervisor
    gave to other guests (all CPUs), the allocator's cudaMalloc calls, the TMA encodes; and at each boundary after the
    first, how far the GPU trails the host (`gpu_lag_ms`: the GPU's time to the boundary's event, from the first
    boundary, less the host's; the first boundary follows a sync, so its event runs at once). A lag near 0 means the
    GPU waited for the host there; a lag of tens of ms means the host was ahead. CUDA only: on the CPU the steps
    are host times."""
    pairs = list(itertools.pairwise(host))
    gpu = list(itertools.accumulate(step_ms))
    columns = {
        "host_step_ms": [round((b.clock - a.clock) * 1000, 1) for a, b in pairs],
        "host_cpu_ms": [round((b.thread_cpu - a.thread_cpu) * 1000, 1) for a, b in pairs],
        "process_cpu_ms": [round((b.process_cpu - a.process_cpu) * 1000, 1) for a, b in pairs],
        "steal_ms": [round((b.steal - a.steal) * 1000, 1) for a, b in pairs],
        "involuntary_switches_per_step": [b.involuntary_switches - a.involuntary_switches for a, b in pairs],
        "device_allocs_per_step": [b.device_allocs - a.device_allocs for a, b in pairs],
        "tma_encodes_per_step": [b.tma_encodes - a.tma_encodes for a, b in pairs],
    }
    if cuda:
        columns["gpu_lag_ms"] = [round(g - (h.clock - host[0].clock) * 1000, 1) for g, h in zip(gpu, host[1:])]
    return columns


def _marks(batch: dict[str, Any], n: int, device: torch.device, marks: list[Any],
           host: list[HostSample] | None = None) -> Any:
    """`n` times the batch; a mark (CUDA event, or the host clock on the CPU) at every step boundary, and in `host`
    the host's counters (HostSample)."""
    for _ in range(n + 1):
        if host is not None:
            host.append(host_sample(device))
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(event)
        else:
            marks.append(time.perf_counter())
        if len(marks) > n:
            return
        yield batch


def _step_ms(marks: list[Any], device: torch.device) -> list[float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    return [(b - a) * 1000 for a, b in itertools.pairwise(marks)]


def _sync_debug(batch: dict[str, Any], steps: int) -> Any:
    """`steps` times the batch with CUDA's sync debug mode on while the steps run (not for the loss read after the
    last one)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(steps):
            yield batch
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _syncs_per_step(trainer: Any, run: RunState, batch: dict[str, Any], steps: int, loop: tuple[Any, Any]
                    ) -> tuple[float | None, dict[str, int]]:
    """Host syncs per step as CUDA's sync debug mode reports them, and where (the Python line that called the
    synchronising operation, with its count); (None, {}) on the CPU."""
    if not torch.cuda.is_available():
        return None, {}
    caught: list[str] = []

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        # the sync debug mode's own reset at the end of `_sync_debug` reports once: not the step's
        if "synchroniz" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]  # without this function's frame
        if not any(f.name == "_sync_debug" for f in stack):
            caught.append(_call_chain(filename, lineno, stack))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        trainer._run_epoch(run, _sync_debug(batch, steps), _Progress(), *loop)
        torch.cuda.synchronize()
    sites: dict[str, int] = {}
    for site in caught:
        sites[site] = sites.get(site, 0) + 1
    return len(caught) / steps, sites


def _short(filename: str) -> str:
    return os.path.relpath(filename, REPO) if filename.startswith(str(REPO)) else filename


def _call_chain(filename: str, lineno: int, stack: list[traceback.FrameSummary], depth: int = 6) -> str:
    """The warned line and the project's frames that led to it (innermost first), e.g. to find which call of ours
    ends in a synchronising torch function."""
    frames = [f for f in stack if f.filename.startswith(str(REPO))]
    chain = [f"{_short(filename)}:{lineno}"] + [f"{_short(f.filename)}:{f.lineno}" for f in reversed(frames)]
    return " <- ".join(dict.fromkeys(chain[: depth + 1]))


def block_memory(dit: Any, step: Callable[[], None]) -> list[float]:
    """The allocated CUDA memory (MiB) that each main block's forward adds in one `step`: what stays alive for its
    backward (a checkpointed block keeps its input and what its policy saves). Read in the eager block loop around
    `MossImage._run_block` (a host counter: no sync)."""
    grown: list[float] = []
    run_block = dit._run_block
    main = set(dit.layers)

    def measured(block: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
        before = torch.cuda.memory_allocated()
        out = run_block(block, x, *args)
        if block in main:
            grown.append(round((torch.cuda.memory_allocated() - before) / 2**20, 1))
        return out

    dit._run_block = measured
    try:
        step()
    finally:
        del dit._run_block  # the class's method again
    return grown


@contextlib.contextmanager
def bench_variant(name: str) -> Any:
    """What a bench-only configuration name changes while it runs (restored afterwards, for --tiny's configurations in
    one process): the plain forms, dynamo's own checkpoint tags, the older RNG functionalisation, the previous
    activation quantiser, the int8 Linears without their launch plans, eager full checkpointing's non-reentrant form,
    the fused kernels off, the LoRA as operators, adding into new tensors or without the q/k/v group, the weight
    gradients as bf16 products, the gated residual as addcmul, the INT8 blocks' inputs quantised apart."""
    from unittest import mock

    import torch._functorch.config as functorch_config

    from library.quant import convrot_kernels, linear_plan
    from library.runtime import checkpointing

    saved = checkpointing.COMPILED_FULL["per_operator_tags"]
    saved_reentrant = checkpointing.EAGER_FULL["reentrant"]
    saved_quantiser = convrot_kernels._TUNING["quantiser"]
    if name.endswith(ROWS_QUANTISER):
        convrot_kernels.set_quantiser("rows")
    if name.endswith(UNPLANNED):
        linear_plan.set_linear_plans(False)
    if name.endswith(NONREENTRANT):
        checkpointing.EAGER_FULL["reentrant"] = False
    saved_kernels = fused_ops.set_fused_kernels(not name.endswith(NO_KERNELS))
    saved_fused_quant = fused_ops.set_fused_quant(not name.endswith(SEPARATE_QUANTISER))
    saved_lora = eager_node.set_lora_one_node(not name.endswith(LORA_OPS))
    saved_in_place = eager_node.set_lora_in_place(not name.endswith(LORA_COPIES))
    saved_grouped = eager_node.set_lora_grouped(not name.endswith(LORA_UNGROUPED))
    saved_pinned = transfer.set_pinned_transfers(not name.endswith(PAGEABLE))
    saved_scale = eager_node.set_scale_on_ranks(not name.endswith(SCALE_ON_OUTPUT))
    saved_fp32_grads = eager_node.set_lora_fp32_grads(not name.endswith(BF16_GRADS))
    saved_compiled = fused_compiled.set_compiled_kernels(
        **({"norm_rope": False, "swiglu": False} if name.endswith(COMPILED_PLAIN) else {}),
        **({"norm_modulate": True} if name.endswith(COMPILED_ALL) else {}),
        **({"swiglu_codes": False} if name.endswith(NO_COMPILED_CODES) else {}),
        **({"training_stacked_qkv": False} if name.endswith(THREE_QKV) else {}))
    if PLAIN_FULL_TAGS in name:
        checkpointing.COMPILED_FULL["per_operator_tags"] = False
    older_rng = OLDER_RNG in name and hasattr(functorch_config, "graphsafe_rng_functionalization")
    torch_residual = (mock.patch("library.moss_image.dit.gated_residual_usable", lambda *_: False)
                      if name.endswith(TORCH_RESIDUAL) else contextlib.nullcontext())
    try:
        with (functorch_config.patch(graphsafe_rng_functionalization=False) if older_rng else contextlib.nullcontext(),
              plain_forms() if name.endswith(PLAIN_FORMS_SUFFIX) else contextlib.nullcontext(), torch_residual):
            yield
    finally:
        checkpointing.COMPILED_FULL["per_operator_tags"] = saved
        checkpointing.EAGER_FULL["reentrant"] = saved_reentrant
        fused_ops.set_fused_kernels(saved_kernels)
        fused_ops.set_fused_quant(saved_fused_quant)
        eager_node.set_lora_one_node(saved_lora)
        eager_node.set_lora_in_place(saved_in_place)
        eager_node.set_lora_grouped(saved_grouped)
        transfer.set_pinned_transfers(saved_pinned)
        eager_node.set_scale_on_ranks(saved_scale)
        eager_node.set_lora_fp32_grads(saved_fp32_grads)
        fused_compiled.set_compiled_kernels(**saved_compiled)
        convrot_kernels.set_quantiser(saved_quantiser)
        linear_plan.set_linear_plans(True)


def run_config(name: str, snapshot: Path, shape: Shape) -> dict[str, Any]:
    flags = CONFIGS[name]
    device = torch.device(shape.device)
    if "--blocks_to_swap" in flags and device.type != "cuda":
        return {"config": name, "flags": flags, "ok": False, "skipped": "block swap needs a CUDA device"}
    torch.manual_seed(0)
    if "--cuda_expandable_segments" in flags:  # before the cap below starts CUDA, as the trainer sets it before loading
        from library.runtime.compile import enable_expandable_segments

        enable_expandable_segments()
    cap = cap_memory(shape.memory_cap_gib, device)
    total = shape.warmup + shape.steps + 3
    with tempfile.TemporaryDirectory() as out, bench_variant(name):
        t0 = time.perf_counter()
        trainer, run, batch = build(snapshot, flags, shape, Path(out), total + 1)
        setup_s = time.perf_counter() - t0
        run.train_dataloader = [batch] * shape.steps  # its length is the loss-average window
        with StepGarbageCollector() as collector:
            loop = (collector, nonfinite.NonFiniteLossGuard(run.args.max_nan_loss_steps))
            warm: list[Any] = []
            t0 = time.perf_counter()
            trainer._run_epoch(run, _marks(batch, shape.warmup, device, warm), _Progress(), *loop)
            warmup_s = time.perf_counter() - t0
            with_load = torch.cuda.max_memory_reserved() if device.type == "cuda" else 0
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            marks: list[Any] = []
            host_marks: list[HostSample] = []
            t0 = time.perf_counter()
            trainer._run_epoch(run, _marks(batch, shape.steps, device, marks, host_marks), _Progress(), *loop)
            times = _step_ms(marks, device)
            wall_s = time.perf_counter() - t0
            peak = (torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()) if device.type == "cuda" \
                else (0, 0)
            syncs, sync_sites = _syncs_per_step(trainer, run, batch, 3, loop)
            losses = list(run.loss_history)  # the profiled steps below train on: their losses are not compared
            profile = None
            if shape.profile and device.type == "cuda":
                profile = kernel_profile(lambda: trainer._run_epoch(run, iter([batch]), _Progress(), *loop), steps=3,
                                         top=40)
            grown = None
            if shape.block_memory and device.type == "cuda":
                grown = block_memory(run.unet, lambda: trainer._run_epoch(run, iter([batch]), _Progress(), *loop))
            host = None
            if shape.host_profile:
                host = host_profile(lambda: trainer._run_epoch(run, iter([batch]), _Progress(), *loop), steps=3)
    result: dict[str, Any] = {
        "config": name, "flags": flags, "ok": True, "steps": shape.steps, "warmup": shape.warmup,
        "step_ms_median": round(statistics.median(times), 1), "step_ms": [round(t, 1) for t in times],
        **host_columns(host_marks, times, device.type == "cuda"),
        "wall_ms_per_step": round(wall_s * 1000 / shape.steps, 1),
        "peak_reserved_gib": round(peak[0] / GIB, 2), "peak_allocated_gib": round(peak[1] / GIB, 2),
        "peak_reserved_with_load_gib": round(max(with_load, peak[0]) / GIB, 2),
        "host_syncs_per_step": syncs, "host_sync_sites": sync_sites, **({"profile": profile} if profile else {}),
        **({"host_profile": host} if host else {}), **({"block_memory_mib": grown} if grown else {}),
        "setup_s": round(setup_s, 1), "warmup_s": round(warmup_s, 1), **cap, **allocator_retries(device),
        "checkpointing": run.unet.checkpoint_mode, "policy": run.unet.checkpoint_policy,
        "losses": losses,
    }
    if "--compile" in flags:
        from torch._dynamo.utils import counters

        result["dynamo_stats"] = {k: int(v) for k, v in counters["stats"].items()}
    return result


def cap_memory(gib: float | None, device: torch.device) -> dict[str, Any]:
    """--memory_cap_gib: the caching allocator of this process may reserve at most `gib` GiB, as on a card of that
    size (less its driver memory), so the step must fit: at the cap the allocator frees its cached blocks and
    retries before it gives up (`num_alloc_retries` counts those), and reserved memory above the cap is not there to
    be measured."""
    if gib is None or device.type != "cuda":
        return {}
    index = torch.cuda.current_device() if device.index is None else device.index
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GIB / total), index)
    return {"memory_cap_gib": gib}


def allocator_retries(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats()
    return {"num_alloc_retries": int(stats.get("num_alloc_retries", 0)), "num_ooms": int(stats.get("num_ooms", 0))}


def compare(results: list[dict[str, Any]]) -> None:
    """max relative loss difference of each configuration against the reference (same inputs and RNG)."""
    ref = next((r for r in results if r.get("config") == REFERENCE and r.get("ok")), None)
    for r in results:
        if ref is not None and r.get("ok") and r is not ref:
            pairs = list(zip(r["losses"], ref["losses"]))
            r["max_rel_loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)


def run_child(cmd: list[str], timeout_s: float) -> tuple[dict[str, Any] | None, str]:
    """Run `cmd` from the repository root: the JSON of its last ``RESULT <json>`` line, or None and why not (its
    time limit, or the end of its stderr)."""
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout_s} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return None, proc.stderr.replace(f"{REPO}/", "")[-2000:]  # the repository's files by their own paths
    return json.loads(lines[-1][len("RESULT "):]), ""


def _child(name: str, ns: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.checkpointing", "--single", name, "--snapshot", str(ns.snapshot),
           "--steps", str(ns.steps), "--warmup", str(ns.warmup), *(["--profile"] if ns.profile else []),
           *(["--host_profile"] if ns.host_profile else []),
           *(["--block_memory"] if ns.block_memory else []),
           *(["--memory_cap_gib", str(ns.memory_cap_gib)] if ns.memory_cap_gib is not None else [])]
    t0 = time.perf_counter()
    result, error = run_child(cmd, ns.timeout_s)
    if result is None:
        return {"config": name, "flags": CONFIGS[name], "ok": False, "error": error}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def _write(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def table(results: list[dict[str, Any]]) -> str:
    rows = [f"{'config':<30} {'step_ms':>8} {'reserved_GiB':>13} {'alloc_GiB':>10} {'syncs/step':>10} {'dloss':>8}"]
    for r in results:
        if not r.get("ok"):
            rows.append(f"{r['config']:<30} {r.get('skipped') or 'FAILED: ' + r.get('error', '')[-160:]!s}")
            continue
        syncs = "-" if r["host_syncs_per_step"] is None else f"{r['host_syncs_per_step']:.1f}"
        rows.append(f"{r['config']:<30} {r['step_ms_median']:>8} {r['peak_reserved_gib']:>13} "
                    f"{r['peak_allocated_gib']:>10} {syncs:>10} {r.get('max_rel_loss_diff', 0):>8.1e}")
    return "\n".join(rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="MOSS-Image training step per checkpointing configuration")
    p.add_argument("--snapshot", type=Path, default=None, help="snapshot folder (bench/make_full_snapshot.py)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes on the CPU, in this process (a smoke run); the tiny snapshot unless --snapshot")
    p.add_argument("--configs", default=None, help=f"comma-separated, of {', '.join(CONFIGS)} (default: all)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per configuration (default 20; tiny 3)")
    p.add_argument("--warmup", type=int, default=None, help="steps before measuring (default 3; tiny 1)")
    p.add_argument("--out", type=Path, default=Path("checkpointing.json"), help="JSON results")
    p.add_argument("--timeout_s", type=float, default=480, help="limit per configuration (its own process)")
    p.add_argument("--profile", action="store_true",
                   help="also record 3 steps with torch.profiler: GPU time per kernel category, top kernels, idle time")
    p.add_argument("--host_profile", action="store_true",
                   help="also run 3 steps under cProfile: the Python functions with the most own and total time")
    p.add_argument("--block_memory", action="store_true",
                   help="also record, for one step, the allocated memory each main block's forward adds (MiB)")
    p.add_argument("--memory_cap_gib", type=float, default=None,
                   help="let each configuration's process reserve at most this much GPU memory (a card of that size)")
    p.add_argument("--single", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ns = parse(argv)
    shape = Shape(**vars(TINY if ns.tiny else FULL))
    shape.steps = ns.steps or shape.steps
    shape.warmup = ns.warmup if ns.warmup is not None else shape.warmup
    shape.profile = ns.profile
    shape.host_profile = ns.host_profile
    shape.block_memory = ns.block_memory
    shape.memory_cap_gib = ns.memory_cap_gib
    ns.steps, ns.warmup = shape.steps, shape.warmup
    names = [n.strip() for n in (ns.configs or ",".join(CONFIGS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"unknown configurations {unknown}: choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if ns.memory_cap_gib is not None and (ns.tiny or ns.memory_cap_gib <= 0):
        print("--memory_cap_gib caps a CUDA GPU's memory: give a size above 0, and not with --tiny", file=sys.stderr)
        return 2
    if not ns.tiny and not torch.cuda.is_available():
        print("bench.checkpointing needs a CUDA GPU (or --tiny for the CPU smoke run)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        if ns.tiny:
            from library.moss_image.tiny_snapshot import build_tiny_snapshot

            torch.set_num_threads(1)  # tiny shapes: more threads only wait for each other
            ns.snapshot = ns.snapshot or build_tiny_snapshot(Path(tmp) / "moss-image-tiny")
        elif ns.snapshot is None:
            print("give --snapshot (bench/make_full_snapshot.py writes one) or --tiny", file=sys.stderr)
            return 2
        if ns.single:
            print("RESULT " + json.dumps(run_config(ns.single, ns.snapshot, shape)), flush=True)
            return 0
        payload: dict[str, Any] = {
            "command": " ".join([Path(sys.executable).name, "-m", "bench.checkpointing", *(argv or sys.argv[1:])]),
            "device": torch.cuda.get_device_name() if shape.device == "cuda" else "cpu", "torch": torch.__version__,
            "image": shape.image, "text_tokens": shape.text_tokens, "lora_rank": shape.rank, "batch": 1,
            "results": [],
        }
        for name in names:
            if ns.tiny:
                from accelerate.state import AcceleratorState

                AcceleratorState._reset_state(reset_partial_state=True)
                torch._dynamo.reset()
                result = run_config(name, ns.snapshot, shape)
            else:
                result = _child(name, ns)
            payload["results"].append(result)
            compare(payload["results"])
            _write(ns.out, payload)
            print(table([result]).splitlines()[-1], flush=True)
    print(table(payload["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
