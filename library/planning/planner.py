"""Choose the fastest memory options that fit a VRAM budget, and say why.

The candidates vary what the planner may change (`Choices`: the options the user did not give explicitly, and what
the checkpoint files fix): the DiT precision (bf16 or ConvRot INT8), the checkpointing mode (none / selective / full /
offloaded), the number of swapped blocks (H2D-only; the smallest number that fits for each mode that can swap), the
blocks left out of checkpointing (for full/selective candidates that fit unswapped: a twin with the most that fits,
`Choices.skip_max` at most), and the text encoder's variant and place. A candidate fits when its predicted peak
(torch's reserved memory, the largest phase) plus the CUDA context and a safety margin is within the budget
(`Overheads`). Of those that fit, the fastest
by the relative step time wins; within `STEP_TIE` of it, bf16 and then fewer swapped blocks are preferred (exact
weights, less host memory). A bf16 candidate within `INT8_TIE` of a faster ConvRot INT8 one is preferred too: the
exact weights are worth that much, and the measured INT8 / bf16 ratio moves by about that much between runs.

When the text encoder is used only to cache its outputs, it has a phase of its own before the DiT is read: its
placement is chosen first, the first of bf16 on the GPU, ConvRot INT8 on the GPU, nf4 on the GPU (bitsandbytes) and
the CPU that fits. A different encoder variant re-makes text-encoder caches made by another one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from library.errors import UserError
from library.planning.memory_model import (
    SKIP_BLOCK_MODES,
    Estimate,
    InferenceWorkload,
    Setup,
    Workload,
    inference_estimate,
    training_estimate,
)
from library.planning.sizes import GIB, DitSizes, EncoderSizes, VaeSizes
from library.planning.speed_model import inference_factor, training_step_factor

# The CUDA context and what the CUDA libraries hold outside torch's allocator: about 0.4 GiB on consumer cards,
# 1.3 GiB on the H200 (e2e run A: the driver's figure minus torch's reserved peak, every row)
CUDA_CONTEXT_GIB = 0.75
NCCL_BUFFERS_GIB = 0.9  # per GPU with several processes: e2e DDP table, driver startup peak 11.67 vs 10.76 GiB
SAFETY_MARGIN_SHARE = 0.05  # of the predicted peak (the model is within 4 % of every measured row)
SAFETY_MARGIN_MIN_GIB = 0.25
STEP_TIE = 0.02  # candidates this close to the fastest count as equally fast
INT8_TIE = 0.05  # a bf16 candidate this close to a faster INT8 one counts as equally fast (eager INT8: 1.03-1.07x)

CHECKPOINTING_LABELS = {
    "none": "no checkpointing",
    "selective": "selective checkpointing",
    "full": "gradient checkpointing",
    "unsloth": "unsloth offload",
    "cpu_offload": "CPU offload",
}
TE_LABELS = {"none": "bf16", "convrot_int8": "ConvRot INT8", "bnb_int8": "int8 (bitsandbytes)",
             "bnb_nf4": "nf4 (bitsandbytes)"}
SWAPPABLE = ("full", "selective")  # block swap in training needs recomputation in backward


@dataclass(frozen=True)
class Overheads:
    """What the budget must hold beyond torch's reserved peak."""

    context_bytes: int = int(CUDA_CONTEXT_GIB * GIB)
    margin_share: float = SAFETY_MARGIN_SHARE
    margin_min_bytes: int = int(SAFETY_MARGIN_MIN_GIB * GIB)

    @classmethod
    def for_processes(cls, processes: int) -> Overheads:
        extra = int(NCCL_BUFFERS_GIB * GIB) if processes > 1 else 0
        return cls(context_bytes=int(CUDA_CONTEXT_GIB * GIB) + extra)

    def needs(self, reserved: int) -> int:
        return reserved + self.context_bytes + max(self.margin_min_bytes, int(self.margin_share * reserved))


@dataclass(frozen=True)
class Choices:
    """What the planner may vary; a single value is fixed (given explicitly, or by the checkpoint file)."""

    dit: tuple[str, ...] = ("bf16", "int8")
    dit_int8_source: str = "at load"  # "at load" (--convrot_int8) or "file" (a pre-quantised checkpoint)
    checkpointing: tuple[str, ...] = ("none", "selective", "full", "unsloth")
    blocks_to_swap: int | None = None  # None: planned
    max_blocks_to_swap: int = 40
    te: tuple[tuple[str, bool], ...] = (("none", True),)  # (variant, on the GPU) in order of preference
    te_planned: bool = True  # False: decided at load time (--te_quant auto), assumed to fit
    te_int8_source: str = "at load"
    fixed: tuple[str, ...] = ()  # the explicit options, for the messages
    skip_blocks: int = 0  # --checkpointing_skip_blocks as given: full/selective candidates only
    # --checkpointing_skip_blocks planned (not given, and the script has it): per checkpointing mode, the most blocks
    # a candidate may leave out (speed_model.PLANNED_SKIP_MAX); empty: not planned
    skip_max: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    setup: Setup
    estimate: Estimate
    step: float
    needs: int

    @property
    def reserved(self) -> int:
        return self.estimate.reserved

    def fits(self, budget: int) -> bool:
        return self.needs <= budget


@dataclass(frozen=True)
class Plan:
    kind: str  # training | inference
    budget: int
    header: str
    candidates: tuple[Candidate, ...]
    chosen: Candidate
    te_line: str
    reason: str
    options: tuple[str, ...] = field(default=())  # the planned options as command-line words
    choices: Choices = field(default_factory=Choices)
    te_in_rows: bool = False  # the text encoder's option is part of each candidate (it shares a phase with the DiT)

    def label(self, c: Candidate) -> str:
        return candidate_label(c.setup, self.choices, self.kind, self.te_in_rows)

    def lines(self) -> list[str]:
        """The printed plan: header, one row per candidate, the text-encoder line, the choice and why."""
        unit = "step" if self.kind == "training" else "denoise"
        width = max([len(self.label(c)) for c in self.candidates] + [9])
        out = [self.header, f"  {'candidate':<{width}}  {'peak GiB':>8}  {'phase':<28}  {'needs GiB':>9}  {unit:>7}"]
        for c in self.candidates:
            mark = "<- chosen" if c is self.chosen else ("fits" if c.fits(self.budget) else "too large")
            out.append(f"  {self.label(c):<{width}}  {c.reserved / GIB:8.2f}  {c.estimate.peak_phase.name:<28}"
                       f"  {c.needs / GIB:9.2f}  {c.step:6.2f}x  {mark}")
        out.append(f"  {self.te_line}")
        out.append(f"chosen: {self.label(self.chosen)}: {self.reason}")
        out.append("planned options: " + (" ".join(self.options) if self.options else "(none to change)"))
        return out

    def to_dict(self) -> dict:
        def row(c: Candidate) -> dict:
            return {"candidate": self.label(c), "dit": c.setup.dit, "checkpointing": c.setup.checkpointing,
                    "blocks_to_swap": c.setup.blocks_to_swap, "skip_blocks": c.setup.skip_blocks,
                    "te_variant": c.setup.te_variant,
                    "te_on_gpu": c.setup.te_on_gpu, "predicted_reserved_gib": round(c.reserved / GIB, 3),
                    "predicted_allocated_gib": round(c.estimate.allocated / GIB, 3),
                    "peak_phase": c.estimate.peak_phase.name, "needs_gib": round(c.needs / GIB, 3),
                    "relative_time": round(c.step, 3), "fits": c.fits(self.budget)}

        return {"kind": self.kind, "budget_gib": self.budget / GIB, "header": self.header,
                "candidates": [row(c) for c in self.candidates], "chosen": row(self.chosen),
                "text_encoder": self.te_line, "reason": self.reason, "options": list(self.options)}


def gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def te_label(variant: str, on_gpu: bool, source: str = "at load") -> str:
    name = TE_LABELS[variant]
    if variant == "convrot_int8":
        name += " (pre-quantised file)" if source == "file" else " (quantised at load)"
    return f"{name} on the {'GPU' if on_gpu else 'CPU'}"


def candidate_label(setup: Setup, choices: Choices, kind: str, with_te: bool = False) -> str:
    dit = "bf16" if setup.dit == "bf16" else f"INT8 ({choices.dit_int8_source})"
    parts = [dit]
    if kind == "training":
        parts.append(CHECKPOINTING_LABELS[setup.checkpointing])
        if setup.skip_blocks:
            blocks = "block" if setup.skip_blocks == 1 else f"{setup.skip_blocks} blocks"
            parts.append(f"last {blocks} not checkpointed")
    if setup.blocks_to_swap:
        parts.append(f"swap {setup.blocks_to_swap}" + (" (h2d)" if kind == "training" else ""))
    if with_te:
        parts.append("TE " + te_label(setup.te_variant, setup.te_on_gpu, choices.te_int8_source))
    return ", ".join(parts)


def _fixed_clause(choices: Choices) -> str:
    return f" with the options given ({', '.join(choices.fixed)})" if choices.fixed else ""


def _cannot_fit(budget: int, smallest: Candidate, choices: Choices, kind: str) -> UserError:
    need = math.ceil(smallest.needs / GIB * 10) / 10
    label = candidate_label(smallest.setup, choices, kind)
    te = te_label(smallest.setup.te_variant, smallest.setup.te_on_gpu, choices.te_int8_source)
    lower = "a lower resolution or batch size" if kind == "training" else "a smaller image"
    return UserError(
        f"--vram_budget {budget / GIB:g} GiB is too small for this run{_fixed_clause(choices)}: the smallest plan"
        f" ({label}, text encoder {te}) needs {need:g} GiB at its {smallest.estimate.peak_phase.name} peak, so give"
        f" --vram_budget {need:g} or more, or use {lower}.")


def _pick(fitting: list[Candidate], choices: Choices) -> tuple[Candidate, str]:
    fastest = min(fitting, key=lambda c: c.step)

    def tie(c: Candidate) -> float:
        return INT8_TIE if c.setup.dit == "bf16" and fastest.setup.dit != "bf16" else STEP_TIE

    near = [c for c in fitting if c.step <= fastest.step * (1 + tie(c))]

    def preference(c: Candidate) -> tuple:
        te = (c.setup.te_variant, c.setup.te_on_gpu)
        te_rank = choices.te.index(te) if te in choices.te else len(choices.te)
        return c.setup.dit != "bf16", te_rank, c.setup.blocks_to_swap, c.step, c.needs

    chosen = min(near, key=preference)
    why = f"the fastest of the {len(fitting)} candidates that fit {{budget}}"
    if chosen is not fastest:
        why += (f" (within {tie(chosen):.0%} of the fastest: bf16 weights, the preferred text encoder, fewer swapped"
                 " blocks)")
    return chosen, why


def _faster_note(chosen: Candidate, candidates: list[Candidate], label: Callable[[Candidate], str],
                 budget: int) -> str:
    faster = [c for c in candidates if c.step < chosen.step * (1 - STEP_TIE)]
    if not faster:
        return ""
    best = min(faster, key=lambda c: c.step)
    if best.fits(budget):  # passed over for exact weights (INT8_TIE)
        return (f"; {label(best)} ({best.step:.2f}x) fits too and is a little faster, with ConvRot INT8 weights"
                " (give --convrot_int8 to take it)")
    return f"; faster would be {label(best)} ({best.step:.2f}x), which needs {gib(best.needs)} GiB"


def _largest_skip(make: Callable[[int], Candidate], budget: int, hi: int) -> Candidate | None:
    """The candidate with the most blocks left out of checkpointing in [1, hi] that fits, or None (the peak grows
    with each block left out, so the last that fits is found by bisection)."""
    if hi < 1 or not make(1).fits(budget):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if make(mid).fits(budget):
            lo = mid
        else:
            hi = mid - 1
    return make(lo)


def _smallest_swap(make: Callable[[int], Candidate], budget: int, lo: int, hi: int) -> Candidate:
    """The candidate with the fewest swapped blocks in [lo, hi] that fits, else the one at `hi` (the peak falls as
    blocks are swapped, so the first that fits is found by bisection)."""
    top = make(hi)
    if not top.fits(budget):
        return top
    while lo < hi:
        mid = (lo + hi) // 2
        if make(mid).fits(budget):
            hi = mid
        else:
            lo = mid + 1
    return make(hi)


# ---------------------------------------------------------------------------------------------------------- training
def _choose_te_for_caching(w: Workload, choices: Choices, evaluate: Callable[[Setup], Estimate],
                           overheads: Overheads, budget: int) -> tuple[tuple[str, bool], str]:
    """The first text-encoder option that fits its caching phase (and the latent caching before it, when the
    encoder is on the GPU then: --lowram, or a bitsandbytes encoder read at startup), and the plan's text-encoder
    line."""
    int8 = choices.te_int8_source
    if not choices.te_planned:
        return choices.te[0], "text encoder: --te_quant auto chooses at load time from the free memory (not planned)"
    needs: list[tuple[tuple[str, bool], int]] = []
    for variant, on_gpu in choices.te:
        est = evaluate(Setup(te_variant=variant, te_on_gpu=on_gpu))
        phase = [p for p in est.phases if p.name == "caching text-encoder outputs"]
        need = overheads.needs(phase[0].reserved(w.expandable_segments)) if phase else 0
        latents = [p for p in est.phases if p.name == "caching latents"]
        if phase and latents and latents[0].allocated > phase[0].allocated:  # the encoder waits on the GPU
            need = max(need, overheads.needs(latents[0].reserved(w.expandable_segments)))
        needs.append(((variant, on_gpu), need))
        if need <= budget:
            skipped = "; ".join(f"{te_label(v, g, int8)} needs {gib(n)} GiB" for (v, g), n in needs[:-1])
            where = f"{gib(need)} GiB in its caching phase" if phase else "no GPU memory"
            line = f"text encoder (caching its outputs): {te_label(variant, on_gpu, int8)}, {where}"
            return (variant, on_gpu), line + (f" ({skipped})" if skipped else "")
    best = min(needs, key=lambda x: x[1])
    return best[0], f"text encoder (caching its outputs): nothing fits; {te_label(*best[0], int8)} needs {gib(best[1])} GiB"


def plan_training(dit: DitSizes, te: EncoderSizes, vae: VaeSizes, w: Workload, choices: Choices, budget: int,
                  overheads: Overheads, header: str) -> Plan:
    def evaluate(setup: Setup) -> Estimate:
        return training_estimate(dit, te, vae, w, setup)

    def candidate(setup: Setup) -> Candidate:
        est = evaluate(setup)
        return Candidate(setup, est, training_step_factor(setup, w, dit.num_layers), overheads.needs(est.reserved))

    if w.text_encoder_in_step:
        te_options = list(choices.te)
        te_line = "text encoder: in every step, " + ", ".join(te_label(v, g, choices.te_int8_source)
                                                              for v, g in te_options)
    else:
        pick, te_line = _choose_te_for_caching(w, choices, evaluate, overheads, budget)
        te_options = [pick]
    rows: list[Candidate] = []
    for variant, on_gpu in te_options:
        for precision in choices.dit:
            for mode in choices.checkpointing:
                if choices.skip_blocks and mode not in SKIP_BLOCK_MODES:
                    continue

                def make(s: int, precision: str = precision, mode: str = mode, variant: str = variant,
                         on_gpu: bool = on_gpu, skip: int = choices.skip_blocks) -> Candidate:
                    return candidate(Setup(precision, mode, s, variant, on_gpu, skip))

                if choices.blocks_to_swap is not None:
                    if choices.blocks_to_swap and mode not in SWAPPABLE:
                        continue
                    rows.append(make(choices.blocks_to_swap))
                elif mode in SWAPPABLE:
                    rows.append(_smallest_swap(make, budget, 0, choices.max_blocks_to_swap))
                else:
                    rows.append(make(0))
                base = rows[-1]
                if mode in choices.skip_max and base.setup.blocks_to_swap == 0 and base.fits(budget):
                    # memory to spare: leave the last blocks out of checkpointing (each saves its recomputation)
                    skipped = _largest_skip(lambda k, m=make: m(0, skip=k), budget,
                                            min(choices.skip_max[mode], dit.num_layers))
                    if skipped is not None:
                        rows.append(skipped)
    return _finish("training", rows, choices, budget, header, te_line, len(te_options) > 1)


def _finish(kind: str, rows: list[Candidate], choices: Choices, budget: int, header: str, te_line: str,
            te_in_rows: bool) -> Plan:
    if not rows:
        raise UserError(f"The options given ({', '.join(choices.fixed)}) cannot be combined, so there is nothing to"
                        " plan: drop one of them (block swap and --checkpointing_skip_blocks need full or selective"
                        " checkpointing).")
    fitting = [c for c in rows if c.fits(budget)]
    if not fitting:
        # the least memory; among plans that need the same (another phase's peak bounds them all), the fastest
        raise _cannot_fit(budget, min(rows, key=lambda c: (math.ceil(c.needs / GIB * 10), c.step)), choices, kind)
    chosen, why = _pick(fitting, choices)
    plan = Plan(kind, budget, header, tuple(rows), chosen, te_line, "", choices=choices, te_in_rows=te_in_rows)
    reason = (f"{why.format(budget=f'{budget / GIB:g} GiB')}: predicted peak {gib(chosen.reserved)} GiB in the"
              f" {chosen.estimate.peak_phase.name} phase, {gib(chosen.needs)} GiB with the CUDA context and the"
              f" margin{_faster_note(chosen, rows, plan.label, budget)}.")
    return replace(plan, reason=reason)


# --------------------------------------------------------------------------------------------------------- inference
def plan_inference(dit: DitSizes, te: EncoderSizes, vae: VaeSizes, w: InferenceWorkload, choices: Choices,
                   budget: int, overheads: Overheads, header: str) -> Plan:
    def evaluate(setup: Setup) -> Estimate:
        return inference_estimate(dit, te, vae, w, setup)

    def candidate(setup: Setup) -> Candidate:
        est = evaluate(setup)
        return Candidate(setup, est, inference_factor(dit, setup, w, w.float_bytes), overheads.needs(est.reserved))

    if w.interactive or not choices.te_planned:
        te_options = list(choices.te)
        te_line = "text encoder: stays loaded with the DiT and the VAE" if w.interactive else \
            "text encoder: --te_quant auto chooses at load time from the free memory (not planned)"
    else:
        te_options, te_line = [], ""
        for variant, on_gpu in choices.te:  # the encoder is freed before the DiT is read: its phase is its own
            est = evaluate(Setup(te_variant=variant, te_on_gpu=on_gpu))
            need = overheads.needs(est.phase("encoding prompts").reserved(w.expandable_segments))
            te_options = [(variant, on_gpu)]
            te_line = f"text encoder (encoding the prompts): {te_label(variant, on_gpu, choices.te_int8_source)}," \
                      f" {gib(need)} GiB"
            if need <= budget:
                break
    rows: list[Candidate] = []
    for variant, on_gpu in te_options:
        for precision in choices.dit:
            def make(s: int, precision: str = precision, variant: str = variant, on_gpu: bool = on_gpu) -> Candidate:
                return candidate(Setup(precision, "none", s, variant, on_gpu))

            if choices.blocks_to_swap is not None:
                rows.append(make(choices.blocks_to_swap))
            else:
                rows.append(_smallest_swap(make, budget, 0, choices.max_blocks_to_swap))
    return _finish("inference", rows, choices, budget, header, te_line, len(te_options) > 1)
