"""Relative step time of the memory options, from the speeds measured on one H200 (docs/benchmarks.md).

Training: 1.00 is the bf16 DiT with `--gradient_checkpointing` and no block swap, eager or compiled as the run is
(the planner never changes `--compile`). A candidate's time is

    checkpointing factor x DiT precision factor x (1 + per-block swap cost x blocks swapped) + text encoder in the step

With `--checkpointing_skip_blocks S` the checkpointing factor moves linearly from its mode's figure towards "none"
by S / blocks (each skipped block saves its recomputation). Measured compiled only: the fifth H200 run's bf16 full
checkpointing at S = 20 (306.9 ms against 303.8 predicted); INT8 selective 295.3-344.4 ms at S = 13 over three runs,
301 ms at S = 16 and 20 and 316 ms at S = 26 (the gain stops near 16), against 310.1-323.6 ms at S = 0. The planner
chooses S itself up to `PLANNED_SKIP_MAX`.

The figures compare rows of one run (one machine, one session), as the benchmark notes ask, except those marked as
estimates: eager INT8 with the selective policy, compiled INT8 inference (see INT8_DENOISE_FACTOR), and the offload
modes under --compile.

Inference: 1.00 is the bf16 DiT's denoising without block swap. Block swap streams S + 2 blocks per forward at the
measured host-to-device rate, behind the compute of one forward; what does not hide adds up.
"""

from __future__ import annotations

from library.planning.memory_model import SKIP_BLOCK_MODES, InferenceWorkload, Setup, Workload
from library.planning.sizes import DitSizes

# eager, with the eager forms of library.runtime.eager_fusion, the fused Triton kernels of library.runtime.fused_ops
# and the one-node LoRA of library.lora.eager_node: bench.checkpointing, fourteenth H200 run (2026-12-04, call 1,
# the batch from pinned memory): no checkpointing 246.3 ms, gc 356.0 ms (twelfth run: 257.0 and 356.0 ms; fifth run,
# before the kernels and the node: 314.7 and 426.4 ms); the offload modes from the training-step table, run A (plain
# forms: gc 564.6 ms, unsloth offload 666.5 ms)
EAGER_CHECKPOINTING = {"none": 0.692, "full": 1.0, "unsloth": 1.181, "cpu_offload": 1.181}
# --compile: bench.checkpointing, fourteenth H200 run (2026-12-04, call 2, the kernels as ops in compiled blocks): no
# checkpointing 250.8 ms, gc 338.7 ms (third run: 261.7 and 347.5 ms); the offload modes were not measured compiled
# (eager ratio)
COMPILED_CHECKPOINTING = {"none": 0.740, "full": 1.0, "unsloth": 1.181, "cpu_offload": 1.181}
# --checkpointing_policy selective against full, (--compile, DiT precision) -> factor. bf16: bench.checkpointing in
# one H200 run (docs/benchmarks.md, 2026-12-01): compiled 332.7 vs 352.3 ms; eager, fifth run (one call): 832.9 vs
# 426.4 ms (eager selective checkpointing is slower than full, and the trainer warns). INT8 eager: --vram_budget 12
# on the H200 (1.05 s per step against 534 ms for INT8 gc in e2e run A: different runs, so an estimate; 1.99 then,
# against INT8 full checkpointing's factor 1.306 of the time, kept at the same bf16-relative time since). INT8
# compiled: bench.checkpointing, fourth run (2026-12-01, one call): selective 323.6 vs full 353.1 ms.
SELECTIVE_FACTOR = {(True, "bf16"): 0.944, (False, "bf16"): 1.953, (True, "int8"): 0.916, (False, "int8"): 2.556}
# ConvRot INT8 DiT against bf16, gc, bench.checkpointing, each pair in one call. The planner plans for cards whose
# GPU, not the host, bounds the step (8-24 GB cards are slower than an H200, their int8 tensor cores 2x+ their bf16
# ones), so the eager factor is the GPU-bound one. Eager, twelfth run (2026-12-03, call 3, the one-node LoRA): INT8
# 333.2 and 346.2 ms in two processes (median 339.7) against bf16's 356.0 ms, both GPU-bound. (Call 1, before the
# node: INT8 432.4 ms, host-bound, against 373.2; eleventh run: 436.1 against 428.6 ms.)
# The fourteenth run (2026-12-04, call 1) had INT8 at 327.0 against 356.0 ms on the medians, 299.5 against 313.7 ms
# of GPU busy time (0.955: the factor holds). Compiled, fourteenth run (call 3, the kernels as ops and the LoRA
# scaled on its rank side): 318.4 vs 341.4 ms. (Fourth run: 334.5 vs 339.1 ms; seventh run: 332.3-355.2 against
# 344.7 ms.)
INT8_FACTOR = {False: 0.954, True: 0.933}
# --checkpointing_skip_blocks as the planner may choose it, per checkpointing mode: at most the values where the
# measured step still followed the line above (bench.checkpointing, fifth H200 run, one call: bf16 gc + compile,
# skip 20, 306.9 ms against 303.8 predicted from the 344.4 ms without; INT8 selective + compile: 301.3 ms at skip
# 16 and 301.2 at 20, 316.2 at 26, so the gain stops near 16)
PLANNED_SKIP_MAX = {"full": 20, "selective": 16}
# --block_swap_h2d_only, per swapped block: e2e run A INT8 rows, gc 534 ms, swap 20 551 ms, swap 36 607 ms
# (least squares through zero; the bf16 rows of the training-step table hide the copies entirely)
SWAP_H2D_PER_BLOCK = 0.0033
# the text encoder in every step, e2e run A "DiT + TE LoRA" rows: bf16 959 ms vs 539 ms gc, INT8 1225 vs 534 ms
TE_LORA_STEP = {"none": 0.779, "convrot_int8": 1.294}
# a frozen text encoder in every step (no --cache_text_encoder_outputs): forward only, estimated as a third
TE_FROZEN_SHARE = 1 / 3

# inference, e2e (run C bf16, run B INT8): denoising 50 steps with CFG = 100 forwards of 4096 + 90 tokens. INT8
# compiled: bench.infer_oneshot, fourth run (2026-12-01, two calls), denoised the second image in 7.31 s against
# 8.34 s, but quantising the DiT at load cost about 16 s more than reading bf16 (78.7 against 50.8 s to the first
# PNG); the planner does not weigh load time, so the two are taken as equal here (bf16 then wins the tie)
DENOISE_S = {False: 13.65, True: 8.63}  # bf16, eager / --compile
INT8_DENOISE_FACTOR = {False: 15.79 / 13.65, True: 1.0}
DENOISE_FORWARDS = 100
DENOISE_TOKENS = 4096 + 90
H2D_BYTES_PER_S = 55e9  # training-step table: host-to-device copies from the pinned arena at 55 GB/s
RING_SLOTS = 2


def training_step_factor(setup: Setup, w: Workload, num_blocks: int) -> float:
    table = COMPILED_CHECKPOINTING if w.compile else EAGER_CHECKPOINTING
    if setup.checkpointing == "selective":
        factor = SELECTIVE_FACTOR[(w.compile, setup.dit)]
    else:
        factor = table[setup.checkpointing]
    if setup.skip_blocks and setup.checkpointing in SKIP_BLOCK_MODES:
        factor -= (factor - table["none"]) * min(setup.skip_blocks, num_blocks) / num_blocks
    if setup.dit == "int8":
        factor *= INT8_FACTOR[w.compile]
    factor *= 1 + SWAP_H2D_PER_BLOCK * setup.blocks_to_swap
    if w.text_encoder_in_step:
        te = TE_LORA_STEP["convrot_int8" if setup.te_variant != "none" else "none"]
        factor += te if w.train_text_encoder else te * TE_FROZEN_SHARE
    return factor


def inference_factor(dit: DitSizes, setup: Setup, w: InferenceWorkload, float_bytes: int) -> float:
    """Denoising time relative to the bf16 DiT without block swap."""
    factor = INT8_DENOISE_FACTOR[w.compile] if setup.dit == "int8" else 1.0
    if setup.blocks_to_swap:
        forward_s = DENOISE_S[w.compile] / DENOISE_FORWARDS * factor * w.tokens / DENOISE_TOKENS
        copy_s = (setup.blocks_to_swap + RING_SLOTS) * dit.block_bytes(setup.dit, float_bytes) / H2D_BYTES_PER_S
        factor *= max(1.0, copy_s / forward_s)
    return factor
