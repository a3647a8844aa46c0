"""GPU memory of a MOSS-Image run, phase by phase, from the model sizes (`library.planning.sizes`) and the workload.

Weights, LoRA tensors and optimizer states are exact byte counts. Activations come from what autograd keeps per
block of the DiT, counted from its forward (`library.moss_image.dit.MossImageBlock`) per token of the sequence
(image tokens + text tokens), for W = hidden width, F = FFN width, H = heads, r = LoRA rank, e = bytes of an
activation (2 under bf16/fp16 autocast, 4 without):

    kept per block and token = 4 n W          the inputs of the 4 RMSNorms (norm1, norm2, q_norm, k_norm), n bytes each
                             + 6 e W          the q/k/v LoRA input, q, k, v, the attention output, the FFN LoRA input
                             + 4 e F          the up/gate output (2F, kept whole by SiLU's view), SiLU(gate), the product
                                          (3 e F with the fused SwiGLU kernel, which recomputes SiLU(gate))
                             + 4 H            the attention's log-sum-exp (fp32)
                             + 6 e r          the LoRA down outputs

n is 4 where the norms keep fp32 copies of their inputs: the plain forms of `library.runtime.eager_fusion`, which
compiled blocks keep (and torch's CPU rms_norm, a composite, in any form). The eager forms on CUDA keep the bf16
input of one `_fused_rms_norm` kernel: n = e (`Workload.eager_forms`). At 1024 x 1024 (4096 image + 256 text tokens)
that is 0.615 GiB per block with n = 4 and 0.517 GiB with n = 2. The fused Triton kernels of eager CUDA runs
(`library.runtime.fused_ops`, `Workload.fused_kernels`) keep the same tensors but SiLU(gate): 0.450 GiB. The H200
rows "no checkpointing" of docs/benchmarks.md are met within 1 %: the training-step table's run A (plain forms,
36.29 GiB allocated), the fifth run's eager step (32.08 GiB; its plain-forms twin in the same run 36.27 GiB) and the
twelfth run's with the kernels (29.21 GiB; 32.08 without them in the same run). The checkpointing modes keep:
- none: all of it, for every block;
- full (`--gradient_checkpointing`): each block's input (e W per token), plus one block's full set while it is
  recomputed in backward;
- selective (`--checkpointing_policy selective`): full, plus the outputs the policy saves per block
  (`SELECTIVE_SAVED_WIDTHS`: the attention output and the FFN down-projection output, each e W per token, the
  log-sum-exp and the LoRA down outputs; with ConvRot INT8 the down-projection is a custom op and is recomputed);
- full or selective with `--checkpointing_skip_blocks S`: the last S blocks keep their full set instead; backward
  starts with those S sets alive, which then outgrow the one recomputed block (S >= 1 replaces it);
- unsloth / cpu_offload: the block inputs go to host memory; a measured share of them stays on the GPU
  (`OFFLOAD_GPU_SHARE`).
On top: a backward workspace (`BACKWARD_WORKSPACE_WIDE_TENSORS` tensors as wide as the FFN up-projection output), the
final layer's fp32 LayerNorm input (4 W per image token), and the text refiner blocks at the text tokens.

Every named constant below says which row of docs/benchmarks.md calibrates it; tests/test_planning_model.py checks
the predictions against every row of those tables (within 10 %).
"""

from __future__ import annotations

from dataclasses import dataclass

from library.planning.sizes import GIB, DitSizes, EncoderSizes, LoraShapes, VaeSizes

# --- activations of the DiT (see the module docstring) -----------------------------------------------------------
NORM_INPUTS = 4  # RMSNorm inputs kept per block (see the module docstring for their width)
WIDTH_ACTIVATIONS = 6
FFN_ACTIVATIONS = 4
FFN_ACTIVATIONS_FUSED = 3  # the fused SwiGLU kernel keeps its input and recomputes SiLU(gate) in backward
LORA_TARGETS_PER_BLOCK = 6
# saved per block by --checkpointing_policy selective, in e*W tensors per token: the attention output and the FFN
# down-projection output (the narrowing product; recomputed under ConvRot INT8, whose Linear is a custom op)
SELECTIVE_SAVED_WIDTHS = {"bf16": 2, "int8": 1}
# torch.compile keeps this share of the eager activations (fused RMSNorm/RoPE/modulation recompute their inputs):
# e2e run A "no checkpointing, --compile" (bf16: 28.58 GiB allocated at 4096 + 90 tokens)
COMPILED_ACTIVATION_SHARE = 0.734
# backward workspace, in tensors of [tokens, 2F] (the FFN up-projection output): e2e run A "gc (bf16_gc)" (11.87 GiB)
BACKWARD_WORKSPACE_WIDE_TENSORS = 2.0
# share of the block inputs that stays on the GPU with --unsloth_offload_checkpointing: e2e run A "+ unsloth
# offload" (INT8: 7.07 GiB); the training-step run A "--unsloth_offload_checkpointing" (bf16: 11.55 GiB) gives the
# same share. --cpu_offload_checkpointing was not measured and is taken as the same.
OFFLOAD_GPU_SHARE = 0.574

# --- the text encoder --------------------------------------------------------------------------------------------
# encoding one caption without gradients: a fixed part (measured at the 87-92-token captions of the caching table:
# bf16 14.85 GiB allocated, ConvRot INT8 file 7.69 GiB) plus the widest tensors of one decoder layer per token
TE_ENCODE_FIXED_BYTES = {"none": int(0.059 * GIB), "quantised": int(0.279 * GIB)}
TE_MEASURED_TOKENS = 90
# training a text-encoder LoRA: what the step adds beyond the encoder's LoRA tensors, measured with both encoders
# (e2e run A "DiT + TE LoRA" rows: INT8 17.02 GiB, bf16 28.80 GiB; the same 1.49 GiB in both, not investigated),
# per parameter of the 7.94B-parameter encoder (taken to scale with the encoder's size)
TE_TRAINING_WORKSPACE_PER_PARAM = 1.49 * GIB / 7.937e9

# --- the VAE (fp32) ------------------------------------------------------------------------------------------------
# encoding: bytes per pixel per channel of the first level, e2e caching table `cache_latents.py` (3.37 GiB allocated
# at 1024 x 1024 with the 128-channel FLUX.2 VAE)
VAE_ENCODE_BYTES_PER_PIXEL_PER_CHANNEL = 24.45
# decoding: not measured on the GPU; taken as the encoder's figure (the decoder mirrors its widths)
VAE_DECODE_BYTES_PER_PIXEL_PER_CHANNEL = VAE_ENCODE_BYTES_PER_PIXEL_PER_CHANNEL

# the checkpointing modes that --checkpointing_skip_blocks applies to (the offloaded ones move every block's input)
SKIP_BLOCK_MODES = ("full", "selective")

# --- the allocator: reserved = allocated + slack ---------------------------------------------------------------------
# fitted on the e2e run A rows (reserved - allocated: 0.57 GiB for bf16 gc, 1.62 GiB for no checkpointing + compile)
ALLOCATOR_SLACK_BYTES = int(0.486 * GIB)
ALLOCATOR_SLACK_SHARE = 0.0454  # of the activations
INT8_DIT_SLACK_BYTES = int(0.30 * GIB)  # ConvRot INT8 DiT in training: e2e run A INT8 rows (0.75-0.87 GiB slack)
EXPANDABLE_SLACK_BYTES = int(0.32 * GIB)  # --cuda_expandable_segments: e2e run C (0.37-0.42 GiB slack)

OPTIMIZER_STATES = {  # optimizer states per LoRA parameter, in units of the parameter's bytes; None: bytes per value
    "adamw": 2, "adam": 2, "radam": 2, "nadam": 2, "adamax": 2, "adamwschedulefree": 2, "radamschedulefree": 2,
    "pagedadamw": 2, "pagedadamw32bit": 2, "lion": 1, "sgd": 0, "sgdschedulefree": 1, "rmsprop": 1, "adagrad": 1,
    "prodigy": 4, "dadaptation": 3, "dadaptadampreprint": 3, "dadaptadam": 3, "dadaptadan": 4, "dadaptadanip": 4,
    "dadaptlion": 2, "dadaptadagrad": 3, "dadaptsgd": 2,
}
OPTIMIZER_8BIT_BYTES = {  # bitsandbytes 8-bit optimizers: bytes of state per parameter
    "adamw8bit": 2, "pagedadamw8bit": 2, "lion8bit": 1, "pagedlion8bit": 1, "sgdnesterov8bit": 1,
    "ademamix8bit": 3, "pagedademamix8bit": 3,
}
DEFAULT_OPTIMIZER_STATES = 2  # an optimizer not listed: taken as Adam-like
BNB_TE_VARIANTS = ("bnb_int8", "bnb_nf4")  # quantised on their GPU when read, never moved (text_encoder.loading)


# ---------------------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Workload:
    """What a training run puts through the models (its largest bucket), independent of the memory options."""

    image_tokens: int  # per sample: (width / 16) * (height / 16) of the largest bucket
    text_tokens: int  # per sample, padded length
    batch_size: int = 1
    float_bytes: int = 2  # the DiT's weights and activations: 2 with bf16/fp16 mixed precision, 4 without
    lora_rank: int = 4
    lora_bytes: int = 4  # fp32 LoRA weights (2 with --full_bf16 / --full_fp16)
    optimizer: str = "AdamW"
    compile: bool = False
    expandable_segments: bool = False
    cache_latents: bool = True
    vae_batch_size: int = 1
    cache_text_encoder_outputs: bool = True
    train_text_encoder: bool = False
    highvram: bool = False
    lowram: bool = False
    sample_images: bool = False
    # the trainer reads the text encoder at startup (before the latents are cached) unless its outputs are cached to
    # disk, it is not trained and no sample prompt is encoded; a bitsandbytes encoder read then is on the GPU already
    te_read_at_start: bool = True
    # the eager forms of library.runtime.eager_fusion (the default); False models their plain forms, which
    # bench.checkpointing's *_plain_forms configurations run and the H200 rows measured before them had
    eager_forms: bool = True
    # the fused Triton kernels of library.runtime.fused_ops (eager CUDA runs with the eager forms; the default);
    # False models bench.checkpointing's *_no_kernels configurations and the H200 rows measured before them
    fused_kernels: bool = True

    @property
    def tokens(self) -> int:
        return self.image_tokens + self.text_tokens

    @property
    def pixels(self) -> int:
        return self.image_tokens * 256

    @property
    def text_encoder_in_step(self) -> bool:
        return self.train_text_encoder or not self.cache_text_encoder_outputs


@dataclass(frozen=True)
class Setup:
    """The memory options of one candidate."""

    dit: str = "bf16"  # bf16 (the run's float dtype) | int8 (ConvRot)
    checkpointing: str = "full"  # none | selective | full | unsloth | cpu_offload
    blocks_to_swap: int = 0
    te_variant: str = "none"  # none | convrot_int8 | bnb_int8 | bnb_nf4
    te_on_gpu: bool = True
    skip_blocks: int = 0  # --checkpointing_skip_blocks: the last blocks left out of full/selective checkpointing


@dataclass(frozen=True)
class Phase:
    name: str
    allocated: int
    activations: int  # the part of `allocated` that is not weights or LoRA/optimizer state (for the slack)
    int8_training: bool = False

    def reserved(self, expandable: bool) -> int:
        # measured with the allocator setting in effect: e2e run C (eager) and the seventh H200 run (compiled INT8,
        # 0.19-0.27 GiB slack); the fifth and sixth runs' "expandable" rows never had it (tests/test_planning_model.py)
        if expandable:
            return self.allocated + EXPANDABLE_SLACK_BYTES + int(ALLOCATOR_SLACK_SHARE * self.activations)
        slack = ALLOCATOR_SLACK_BYTES + int(ALLOCATOR_SLACK_SHARE * self.activations)
        return self.allocated + slack + (INT8_DIT_SLACK_BYTES if self.int8_training else 0)


@dataclass(frozen=True)
class Estimate:
    phases: tuple[Phase, ...]
    expandable: bool = False

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda p: p.reserved(self.expandable))

    @property
    def reserved(self) -> int:
        """The predicted peak of torch's reserved memory (`torch.cuda.max_memory_reserved`)."""
        return self.peak_phase.reserved(self.expandable)

    @property
    def allocated(self) -> int:
        return max(p.allocated for p in self.phases)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)


# ------------------------------------------------------------------------------------------------ LoRA and optimizer
def optimizer_state_bytes(optimizer: str, lora: LoraShapes, rank: int, param_bytes: int) -> int:
    """Bytes of the optimizer's state for the LoRA of `rank` on `lora`'s Linears."""
    key = optimizer.lower().rsplit(".", 1)[-1]
    params = lora.params(rank)
    if key in OPTIMIZER_8BIT_BYTES:
        return params * OPTIMIZER_8BIT_BYTES[key]
    if key == "adafactor":  # factored second moment (rows + columns, fp32), no first moment by default
        return lora.factored_second_moment(rank) * 4
    return params * param_bytes * OPTIMIZER_STATES.get(key, DEFAULT_OPTIMIZER_STATES)


def lora_training_bytes(optimizer: str, lora: LoraShapes, rank: int, param_bytes: int) -> int:
    """LoRA weights + gradients + optimizer states."""
    return 2 * lora.params(rank) * param_bytes + optimizer_state_bytes(optimizer, lora, rank, param_bytes)


# -------------------------------------------------------------------------------------------------------- activations
def block_kept_bytes_per_token(dit: DitSizes, e: int, rank: int, norm_bytes: int = 4,
                               fused_swiglu: bool = False) -> int:
    """Bytes autograd keeps per token for one main block without checkpointing (eager), see the module docstring;
    `norm_bytes` is the width of the RMSNorm inputs kept (4: fp32 copies, the plain forms); `fused_swiglu` where the
    SwiGLU kernel runs (it keeps no SiLU(gate))."""
    c = dit.config
    w, f = c.hidden_size, c.ffn_hidden
    ffn = FFN_ACTIVATIONS_FUSED if fused_swiglu else FFN_ACTIVATIONS
    return (NORM_INPUTS * norm_bytes * w + WIDTH_ACTIVATIONS * e * w + ffn * e * f + 4 * c.num_heads
            + LORA_TARGETS_PER_BLOCK * e * rank)


def selective_kept_bytes_per_token(dit: DitSizes, precision: str, e: int, rank: int) -> int:
    c = dit.config
    return SELECTIVE_SAVED_WIDTHS[precision] * e * c.hidden_size + 4 * c.num_heads + LORA_TARGETS_PER_BLOCK * e * rank


def step_activation_bytes(dit: DitSizes, w: Workload, setup: Setup) -> int:
    """What one training step of the DiT keeps on the GPU beyond weights and LoRA state, at its peak."""
    e = w.float_bytes
    hidden = dit.config.hidden_size
    n, b = dit.num_layers, w.batch_size
    # compiled blocks keep the plain forms' tensors (COMPILED_ACTIVATION_SHARE of them); eager ones on CUDA keep the
    # RMSNorm inputs at the activation width where the eager forms are on
    eager_forms = w.eager_forms and not w.compile
    norm_bytes = e if eager_forms else 4
    block = block_kept_bytes_per_token(dit, e, w.lora_rank, norm_bytes, fused_swiglu=eager_forms and w.fused_kernels)
    share = COMPILED_ACTIVATION_SHARE if w.compile else 1.0
    inputs = e * hidden  # a checkpointed block's input, per token
    workspace = BACKWARD_WORKSPACE_WIDE_TENSORS * 2 * dit.config.ffn_hidden * e
    refiners = dit.config.num_refiner_layers
    if setup.checkpointing == "none":
        per_token_main = n * block * share
        text = refiners * block * share * w.text_tokens
    else:
        kept = inputs
        if setup.checkpointing == "selective":
            kept += selective_kept_bytes_per_token(dit, setup.dit, e, w.lora_rank)
        elif setup.checkpointing in ("unsloth", "cpu_offload"):
            kept = inputs * OFFLOAD_GPU_SHARE
        skip = min(setup.skip_blocks, n) if setup.checkpointing in SKIP_BLOCK_MODES else 0
        per_token_main = (n - skip) * kept + max(skip, 1) * block * share
        text = refiners * inputs * w.text_tokens
    final = 4 * hidden * w.image_tokens
    return int(b * (per_token_main * w.tokens + workspace * w.tokens + text + final))


def inference_transient_bytes(dit: DitSizes, tokens: int, e: int) -> int:
    """The live tensors of one block's forward without gradients (the widest point is the FFN: the residual and
    its normalised copy, the up/gate output, SiLU(gate) and the product) over `tokens` rows: a CFG step's two passes
    run packed into one (`library.moss_image.cfg_packing`), so a guided pass has both texts' and twice the image's
    (`cfg_pass_tokens`). Not measured on its own."""
    c = dit.config
    return tokens * (2 * e * c.hidden_size + 4 * e * c.ffn_hidden)


def cfg_pass_tokens(tokens: int, guided: bool = True) -> int:
    """Rows of one sampling pass for a sequence of `tokens` (image + text): with CFG the prompt's and the negative
    prompt's passes packed into one, the negative prompt counted at the prompt's length (at most)."""
    return 2 * tokens if guided else tokens


def te_encode_bytes(te: EncoderSizes, variant: str, tokens: int) -> int:
    """Encoding one caption of `tokens` tokens without gradients, beyond the weights."""
    fixed = TE_ENCODE_FIXED_BYTES["none" if variant == "none" else "quantised"]
    per_token = 3 * 2 * te.intermediate + 8 * te.hidden  # MLP gate, up and product (bf16); residual + fp32 norm
    return fixed + per_token * max(tokens - TE_MEASURED_TOKENS, 0)


def vae_encode_bytes(vae: VaeSizes, pixels: int, batch: int) -> int:
    return int(VAE_ENCODE_BYTES_PER_PIXEL_PER_CHANNEL * vae.base_width * pixels * batch)


def vae_decode_bytes(vae: VaeSizes, pixels: int) -> int:
    return int(VAE_DECODE_BYTES_PER_PIXEL_PER_CHANNEL * vae.base_width * pixels)


# -------------------------------------------------------------------------------------------------------- phases
def dit_resident_bytes(dit: DitSizes, setup: Setup, float_bytes: int) -> int:
    """The DiT's weights on the GPU: all but the swapped blocks (the ring slots are among the N - S blocks kept)."""
    return (dit.weight_bytes(setup.dit, float_bytes)
            - setup.blocks_to_swap * dit.block_bytes(setup.dit, float_bytes))


def _te_weights_on_gpu(te: EncoderSizes, setup: Setup) -> int:
    return te.weight_bytes(setup.te_variant) if setup.te_on_gpu else 0


def training_estimate(dit: DitSizes, te: EncoderSizes, vae: VaeSizes, w: Workload, setup: Setup) -> Estimate:
    """The phases of a training run: caching latents, caching text-encoder outputs, the steps, sample images."""
    phases = []
    te_w = _te_weights_on_gpu(te, setup)
    vae_w = vae.weight_bytes
    if w.cache_latents:
        # --lowram loads the text encoder and the VAE straight to the GPU; a bitsandbytes encoder is quantised on the
        # GPU when it is read and stays there
        on_gpu_early = w.lowram or (w.te_read_at_start and setup.te_variant in BNB_TE_VARIANTS)
        extra = te_w if on_gpu_early else 0
        act = vae_encode_bytes(vae, w.pixels, w.vae_batch_size)
        phases.append(Phase("caching latents", vae_w + extra + act, act))
    if w.cache_text_encoder_outputs and setup.te_on_gpu:
        act = te_encode_bytes(te, setup.te_variant, w.text_tokens)
        extra = vae_w if (w.lowram or w.highvram) else 0
        phases.append(Phase("caching text-encoder outputs", te_w + extra + act, act))

    lora = lora_training_bytes(w.optimizer, dit.lora, w.lora_rank, w.lora_bytes)
    static = dit_resident_bytes(dit, setup, w.float_bytes) + lora
    if w.highvram or not w.cache_latents:
        static += vae_w
    if w.text_encoder_in_step:
        static += te_w
        if w.train_text_encoder:
            static += lora_training_bytes(w.optimizer, te.lora, w.lora_rank, w.lora_bytes)
    act = step_activation_bytes(dit, w, setup)
    if w.train_text_encoder:
        act += int(TE_TRAINING_WORKSPACE_PER_PARAM * te.total_params)
    elif w.text_encoder_in_step and setup.te_on_gpu:
        act = max(act, te_encode_bytes(te, setup.te_variant, w.text_tokens))
    if not w.cache_latents:
        act = max(act, vae_encode_bytes(vae, w.pixels, w.batch_size))
    phases.append(Phase("training", static + act, act, int8_training=setup.dit == "int8"))

    if w.sample_images:  # the training state stays; the VAE joins it; denoise, then decode
        extra = 0 if (w.highvram or not w.cache_latents) else vae_w
        if not w.text_encoder_in_step and not w.cache_text_encoder_outputs and setup.te_on_gpu:
            extra += te_w
        act = max(inference_transient_bytes(dit, cfg_pass_tokens(w.tokens), w.float_bytes),
                  vae_decode_bytes(vae, w.pixels))
        phases.append(Phase("sample images", static + extra + act, act))
    return Estimate(tuple(phases), w.expandable_segments)


@dataclass(frozen=True)
class InferenceWorkload:
    image_tokens: int
    text_tokens: int
    float_bytes: int = 2
    compile: bool = False
    expandable_segments: bool = False
    decode: bool = True  # --output_type images/both
    interactive: bool = False  # the three models stay loaded together
    guided: bool = True  # CFG (--guidance_scale other than 1.0): two passes a step, packed into one

    @property
    def tokens(self) -> int:
        return self.image_tokens + self.text_tokens


def inference_estimate(dit: DitSizes, te: EncoderSizes, vae: VaeSizes, w: InferenceWorkload, setup: Setup
                       ) -> Estimate:
    """The phases of `moss_image_minimal_inference.py`: encode the prompts (the encoder is then freed), denoise (the
    DiT then leaves the GPU), decode. Interactively the three stay loaded, so their weights add up."""
    te_w = _te_weights_on_gpu(te, setup)
    dit_w = dit_resident_bytes(dit, setup, w.float_bytes)
    encode = te_encode_bytes(te, setup.te_variant, w.text_tokens) if setup.te_on_gpu else 0
    denoise = inference_transient_bytes(dit, cfg_pass_tokens(w.tokens, w.guided), w.float_bytes)
    decode = vae_decode_bytes(vae, w.image_tokens * 256) if w.decode else 0
    if w.interactive:
        weights = te_w + dit_w + (vae.weight_bytes if w.decode else 0)
        act = max(encode, denoise, decode)
        return Estimate((Phase("interactive", weights + act, act),), w.expandable_segments)
    phases = [Phase("encoding prompts", te_w + encode, encode), Phase("denoising", dit_w + denoise, denoise)]
    if w.decode:
        phases.append(Phase("decoding", vae.weight_bytes + decode, decode))
    return Estimate(tuple(phases), w.expandable_segments)
