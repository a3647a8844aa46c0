"""The memory model of library/planning: sizes against the models themselves, activations against what autograd
keeps (tiny DiT on the CPU), and every prediction against the H200 figures of docs/benchmarks.md."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from library.moss_image.dit import MossImage, MossImageConfig
from library.moss_image.tiny_snapshot import TINY_DIT_CONFIG
from library.planning import memory_model as M
from library.planning import sizes as S
from library.quant import convrot as cr
from networks import lora_generic

GIB = 2**30


def _bytes(model: nn.Module, float_bytes: int = 2) -> int:
    """Bytes of a model as it runs: int8 codes 1, ConvRot scales fp32, every other float tensor `float_bytes`."""
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.dtype == torch.int8:
            total += t.numel()
        elif name.endswith("weight_scale"):
            total += 4 * t.numel()
        else:
            total += float_bytes * t.numel()
    return total


# ---------------------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("config", [MossImageConfig(), TINY_DIT_CONFIG], ids=["full", "tiny"])
def test_dit_sizes_match_the_model_on_meta(config):
    d = S.dit_sizes(config)
    with torch.device("meta"):
        model = MossImage(config)
    assert d.total_params == sum(p.numel() for p in model.parameters())
    assert d.block_params == sum(p.numel() for p in model.layers[0].parameters())
    assert d.int8.codes == config.block_linear_weights  # the 252 block Linears (6 per block)
    assert d.weight_bytes("bf16", 2) == 2 * d.total_params
    # the ConvRot INT8 model as the pre-quantised loader builds it, on meta: every buffer and parameter counted
    names = [n for n, m in model.named_modules() if n and cr.dit_convrot_filter(n) and type(m) is nn.Linear]
    assert len(names) == 6 * config.num_layers
    cr.prepare_model_for_comfy_int8(model, {n: cr.ComfyInt8LayerSpec(0) for n in names}, compute_dtype=torch.bfloat16)
    assert d.weight_bytes("int8", 2) == _bytes(model)
    assert d.block_bytes("int8", 2) == _bytes(model.layers[0])


def test_full_dit_sizes_are_the_documented_ones():
    d = S.dit_sizes(MossImageConfig())
    assert d.total_params == 5_083_020_416  # docs/benchmarks.md "Full-size snapshot": 5.083B bf16 parameters
    assert abs(d.weight_bytes("int8", 2) - 5.415e9) < 1e6  # the ComfyUI INT8 DiT file, 5.415 GB
    assert d.block_bytes("bf16", 2) / 2**20 == pytest.approx(216, abs=0.5)  # training-step table: one block 216 MiB
    assert d.lora.params(16) == 42 * 16 * (4 * (3072 + 3072) + (3072 + 16384) + (8192 + 3072))


def test_dit_sizes_from_the_tiny_snapshot_and_its_int8_file(tiny_snapshot):
    from library.moss_image.loaders import load_moss_image_model

    for path, int8 in ((tiny_snapshot / "transformer", False),
                       (tiny_snapshot / "moss_image_base_int8_convrot.safetensors", True)):
        d, prequantised = S.read_dit(path)
        assert prequantised is int8
        assert (d.config.hidden_size, d.config.num_layers) == (TINY_DIT_CONFIG.hidden_size, TINY_DIT_CONFIG.num_layers)
        model = load_moss_image_model("cpu", path, dtype=torch.bfloat16)
        assert _bytes(model) == d.weight_bytes("int8" if int8 else "bf16", 2)


def test_lora_count_is_what_lora_generic_creates():
    with torch.device("meta"):
        dit = MossImage(TINY_DIT_CONFIG)
    net = lora_generic.create_network(1.0, 8, 8, None, [None], dit)
    created = sum(p.numel() for n, p in net.named_parameters() if "lora_unet" in n)
    assert created == S.dit_sizes(TINY_DIT_CONFIG).lora.params(8)


def test_text_encoder_sizes_and_lora_count(tiny_snapshot):
    from transformers import Qwen3_5TextModel

    te, prequantised = S.read_text_encoder(tiny_snapshot / "text_encoder")
    assert not prequantised
    assert S.read_text_encoder(tiny_snapshot / "text_encoder_int8" / "qwen3.5_9b_int8_convrot.safetensors")[1]
    from library.text_encoder.qwen35 import load_text_config, open_text_encoder_source

    source, checkpoint = open_text_encoder_source(tiny_snapshot / "text_encoder")
    source.close()
    model = Qwen3_5TextModel(load_text_config(checkpoint)).to(torch.bfloat16)
    assert te.weight_bytes("none") == _bytes(model)
    net = lora_generic.create_network(1.0, 4, 4, None, [model], None)
    created = sum(p.numel() for n, p in net.named_parameters() if "lora_te" in n)
    assert created == te.lora.params(4)
    names = [n for n, m in model.named_modules()
             if n and cr.text_encoder_convrot_filter(n) and type(m) in (nn.Linear, nn.Embedding)]
    cr.prepare_model_for_comfy_int8(model, {n: cr.ComfyInt8LayerSpec(0) for n in names}, compute_dtype=torch.bfloat16)
    assert te.weight_bytes("convrot_int8") == _bytes(model)


def test_full_text_encoder_sizes():
    te, _ = S.read_text_encoder(None)
    assert te.total_params == pytest.approx(7.937e9, rel=1e-4)  # docs/benchmarks.md "Full-size snapshot": text 7.937B
    assert te.weight_bytes("convrot_int8") / GIB == pytest.approx(7.40, abs=0.01)  # the INT8 file: 7.40 GiB
    assert te.weight_bytes("none") / GIB == pytest.approx(14.78, abs=0.01)


def test_vae_sizes(tiny_snapshot):
    full = S.read_vae(None)
    assert full.weight_bytes == pytest.approx(0.336e9, rel=0.01)  # 84.0M fp32 parameters (docs/benchmarks.md)
    tiny = S.read_vae(tiny_snapshot / "flux2-vae.safetensors")
    assert tiny.base_width == 32 and tiny.weight_bytes < full.weight_bytes / 10


def test_optimizer_states():
    lora = S.dit_sizes(MossImageConfig()).lora
    p = lora.params(16)
    assert M.optimizer_state_bytes("AdamW", lora, 16, 4) == 8 * p
    assert M.optimizer_state_bytes("AdamW8bit", lora, 16, 4) == 2 * p
    assert M.optimizer_state_bytes("bitsandbytes.optim.AdamW8bit", lora, 16, 4) == 2 * p
    assert M.optimizer_state_bytes("Lion", lora, 16, 2) == 2 * p
    assert M.optimizer_state_bytes("SGD", lora, 16, 4) == 0
    assert 0 < M.optimizer_state_bytes("Adafactor", lora, 16, 4) < 0.05 * 8 * p  # factored: rows + columns
    assert M.lora_training_bytes("AdamW", lora, 16, 4) == 16 * p


# ----------------------------------------------------------------------------------- activations on the tiny DiT
def _kept_by_autograd(num_layers: int, side: int, text_tokens: int, rank: int = 4) -> int:
    """Bytes of the distinct storages autograd keeps for a training forward of the tiny DiT with a LoRA (fp32, CPU),
    weights left out, as the memory model counts activations."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY_DIT_CONFIG, num_layers=num_layers)
    model = MossImage(cfg).requires_grad_(False)
    net = lora_generic.create_network(1.0, rank, rank, None, [None], model)
    net.apply_to([None], model, False, True)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *net.parameters()]}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(1, cfg.in_channels, side, side, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, torch.tensor([500.0]), torch.randn(1, text_tokens, cfg.text_dim))
    return sum(kept.values())


def test_activation_model_scales_with_tokens_and_blocks():
    """What each block keeps per token (the difference between 8 and 4 blocks, at two sequence lengths) is the
    model's per-block figure, and the totals without checkpointing match the model's step activations."""
    text = 8
    dit4 = S.dit_sizes(dataclasses.replace(TINY_DIT_CONFIG, num_layers=4))
    per_token = M.block_kept_bytes_per_token(dit4, e=4, rank=4)
    for side in (8, 16):
        tokens = side * side + text
        measured = (_kept_by_autograd(8, side, text) - _kept_by_autograd(4, side, text)) / 4 / tokens
        assert measured == pytest.approx(per_token, rel=0.03), (side, measured, per_token)
    w = M.Workload(image_tokens=256, text_tokens=text, float_bytes=4, lora_rank=4, fused_kernels=False)  # a CPU run
    predicted = M.step_activation_bytes(dit4, w, M.Setup(checkpointing="none"))
    workspace = M.BACKWARD_WORKSPACE_WIDE_TENSORS * 2 * dit4.config.ffn_hidden * 4 * w.tokens  # not a kept tensor
    assert predicted - workspace == pytest.approx(_kept_by_autograd(4, 16, text), rel=0.05)


# -------------------------------------------------------------------------- the H200 figures of docs/benchmarks.md
def _w(**kw) -> M.Workload:
    """1024 x 1024, batch 1, LoRA 16, AdamW, latents and TE outputs cached; the e2e captions are 87-92 tokens. These
    rows were measured before the eager forms of library.runtime.eager_fusion: their eager steps ran the plain ones."""
    base = {"image_tokens": 4096, "text_tokens": 90, "lora_rank": 16, "eager_forms": False, "fused_kernels": False}
    return M.Workload(**{**base, **kw})


def _w5(**kw) -> M.Workload:
    """The fifth H200 run's bench.checkpointing rows: 256 text tokens, the eager forms on unless a row says not (the
    fused Triton kernels of library.runtime.fused_ops came later)."""
    return _w(**{"text_tokens": 256, "eager_forms": True, **kw})


def _w12(**kw) -> M.Workload:
    """The twelfth H200 run's rows: as the fifth's, with the fused kernels on unless a row says not."""
    return _w5(**{"fused_kernels": True, **kw})


TE_LORA = {"cache_text_encoder_outputs": False, "train_text_encoder": True}
# (docs/benchmarks.md table and row, workload, setup, phase, torch allocated GiB, torch reserved GiB)
H200_ROWS = [
    ("e2e training run A: gc (bf16_gc)", _w(), M.Setup("bf16", "full"), "training", 11.87, 12.44),
    ("e2e training run A: gc (int8_gc)", _w(), M.Setup("int8", "full", te_variant="convrot_int8"), "training", 7.45, 8.32),
    ("e2e training run A: + swap 20 (h2d-only), INT8", _w(), M.Setup("int8", "full", 20), "training", 5.34, 6.12),
    ("e2e training run A: + swap 36 (h2d-only), INT8", _w(), M.Setup("int8", "full", 36), "training", 3.65, 4.40),
    ("e2e training run A: + unsloth offload, INT8", _w(), M.Setup("int8", "unsloth"), "training", 7.07, 7.94),
    ("e2e training run A: swap 20 (h2d-only), bf16 / INT8", _w(), M.Setup("bf16", "full", 20), "training", 7.65, 8.22),
    ("e2e training run A: DiT + TE LoRA, INT8 / INT8", _w(**TE_LORA),
     M.Setup("int8", "full", te_variant="convrot_int8"), "training", 17.02, 17.91),
    ("e2e training run A: DiT + TE LoRA, bf16 / bf16", _w(**TE_LORA), M.Setup("bf16", "full"), "training", 28.80, 29.28),
    ("e2e training run A: no checkpointing, --compile", _w(compile=True), M.Setup("bf16", "none"), "training",
     28.58, 30.20),
    ("e2e training run A: gc, --compile, bf16", _w(compile=True), M.Setup("bf16", "full"), "training", 11.78, 12.39),
    ("e2e training run A: gc, --compile, INT8", _w(compile=True), M.Setup("int8", "full"), "training", 7.33, 8.34),
    ("e2e training run A: swap 20 (h2d-only), --compile", _w(compile=True), M.Setup("bf16", "full", 20), "training",
     7.50, 8.06),
    ("e2e training run C: gc, bf16, expandable segments", _w(expandable_segments=True), M.Setup("bf16", "full"),
     "training", 11.86, 12.23),
    ("e2e training run C: gc, INT8 file, expandable segments", _w(expandable_segments=True), M.Setup("int8", "full"),
     "training", 7.45, 7.86),
    ("e2e training run C: + swap 20, expandable segments", _w(expandable_segments=True), M.Setup("int8", "full", 20),
     "training", 5.33, 5.75),
    ("e2e training run C: + swap 36, expandable segments", _w(expandable_segments=True), M.Setup("int8", "full", 36),
     "training", 3.64, 4.05),
    # training-step table (bench/train_step.py: 256 text tokens; JSON in docs/bench_results/train_step_h200_run*.json)
    ("training step run A: --gradient_checkpointing", _w(text_tokens=256), M.Setup("bf16", "full"), "training",
     11.95, 12.49),
    ("training step run A: no checkpointing", _w(text_tokens=256), M.Setup("bf16", "none"), "training", 36.29, 37.97),
    ("training step run A: --unsloth_offload_checkpointing", _w(text_tokens=256), M.Setup("bf16", "unsloth"),
     "training", 11.55, 12.14),
    ("training step run A: + --blocks_to_swap 20", _w(text_tokens=256), M.Setup("bf16", "full", 20), "training",
     7.73, 8.27),
    ("training step: + --blocks_to_swap 36 --block_swap_h2d_only", _w(text_tokens=256), M.Setup("bf16", "full", 36),
     "training", None, 4.9),
    ("training step run C: no checkpointing, --compile", _w(text_tokens=256, compile=True), M.Setup("bf16", "none"),
     "training", None, 30.5),
    ("training step run C: swap 20 h2d-only --compile", _w(text_tokens=256, compile=True), M.Setup("bf16", "full", 20),
     "training", None, 8.2),
    # bench.checkpointing, fourth H200 run (256 text tokens; JSON in docs/bench_results/h200_2026-12-01d/)
    ("checkpointing: INT8 selective + compile", _w(text_tokens=256, compile=True), M.Setup("int8", "selective"),
     "training", 8.46, 9.59),
    ("checkpointing: INT8 selective + compile, skip 10", _w(text_tokens=256, compile=True),
     M.Setup("int8", "selective", skip_blocks=10), "training", 12.07, 13.15),
    ("checkpointing: INT8 selective + compile, skip 13", _w(text_tokens=256, compile=True),
     M.Setup("int8", "selective", skip_blocks=13), "training", 13.29, 14.34),
    ("checkpointing: INT8 selective + compile, skip 16", _w(text_tokens=256, compile=True),
     M.Setup("int8", "selective", skip_blocks=16), "training", 14.50, 15.62),
    ("checkpointing: INT8 gc + compile", _w(text_tokens=256, compile=True), M.Setup("int8", "full"), "training",
     7.57, 8.44),
    ("checkpointing: INT8 no checkpointing + compile", _w(text_tokens=256, compile=True), M.Setup("int8", "none"),
     "training", 24.99, 26.12),
    # bench.checkpointing, fifth H200 run (JSON in docs/bench_results/h200_2026-12-01e/): the eager forms and their
    # plain twins in one run; the --checkpointing_skip_blocks curve. Its `_expandable` configurations did not have
    # expandable segments: the bench's set-up never applied --cuda_expandable_segments (found in the seventh run), so
    # those rows are the plain allocator's
    ("fifth run: no checkpointing, eager", _w5(), M.Setup("bf16", "none"), "training", 32.08, 32.32),
    ("fifth run: no checkpointing, eager, plain forms", _w5(eager_forms=False), M.Setup("bf16", "none"), "training",
     36.27, 37.25),
    ("fifth run: gc, eager", _w5(), M.Setup("bf16", "full"), "training", 11.66, 12.24),
    ("fifth run: gc, eager, plain forms", _w5(eager_forms=False), M.Setup("bf16", "full"), "training", 11.81, 12.35),
    ("fifth run: INT8 gc, eager", _w5(), M.Setup("int8", "full"), "training", 7.27, 8.11),
    ("fifth run: INT8 gc, eager, plain forms", _w5(eager_forms=False), M.Setup("int8", "full"), "training", 7.40, 8.08),
    ("fifth run: selective, eager", _w5(), M.Setup("bf16", "selective"), "training", 13.75, 14.57),
    ("fifth run: gc + compile", _w5(compile=True), M.Setup("bf16", "full"), "training", 12.00, 12.71),
    ("fifth run: INT8 selective + compile, skip 13", _w5(compile=True), M.Setup("int8", "selective", skip_blocks=13),
     "training", 13.29, 14.36),
    ("fifth run: INT8 selective + compile, skip 16", _w5(compile=True),
     M.Setup("int8", "selective", skip_blocks=16), "training", 14.51, 15.54),
    ("fifth run: INT8 selective + compile, skip 20", _w5(compile=True),
     M.Setup("int8", "selective", skip_blocks=20), "training", 16.12, 17.15),
    ("fifth run: INT8 selective + compile, skip 26", _w5(compile=True),
     M.Setup("int8", "selective", skip_blocks=26), "training", 18.55, 19.57),
    ("fifth run: gc + compile, skip 20", _w5(compile=True),
     M.Setup("bf16", "full", skip_blocks=20), "training", 19.98, 20.73),
    # sixth run (docs/benchmarks.md): compiled full checkpointing with every operator tagged, INT8 with a few blocks
    # swapped (h2d-only) for the <= 9 GiB row
    ("sixth run: INT8 gc + compile", _w5(compile=True), M.Setup("int8", "full"), "training", 7.57, 8.46),
    ("sixth run: gc + compile", _w5(compile=True), M.Setup("bf16", "full"), "training", 12.00, 12.71),
    ("sixth run: INT8 selective + compile, swap 4", _w5(compile=True), M.Setup("int8", "selective", 4), "training",
     8.04, 9.26),
    ("sixth run: INT8 selective + compile, swap 4 (plain allocator, as above)", _w5(compile=True),
     M.Setup("int8", "selective", 4), "training", 8.04, 9.14),
    ("sixth run: INT8 selective + compile, swap 6", _w5(compile=True), M.Setup("int8", "selective", 6), "training",
     7.83, 9.04),
    ("sixth run: INT8 selective + compile, swap 8", _w5(compile=True), M.Setup("int8", "selective", 8), "training",
     7.62, 8.72),
    ("sixth run: INT8 selective + compile (plain allocator, as above)", _w5(compile=True),
     M.Setup("int8", "selective"), "training", 8.46, 9.69),
    # seventh run (docs/bench_results/h200_2026-12-02b/), under a memory cap (bench.checkpointing --memory_cap_gib),
    # with expandable segments in effect: the trainer's flag, or PYTORCH_CUDA_ALLOC_CONF set before the process
    ("seventh run: INT8 selective + compile, expandable, 9 GiB cap", _w5(compile=True, expandable_segments=True),
     M.Setup("int8", "selective"), "training", 8.46, 8.73),
    ("seventh run: INT8 selective + compile, swap 4, expandable, 9 GiB cap",
     _w5(compile=True, expandable_segments=True), M.Setup("int8", "selective", 4), "training", 8.04, 8.30),
    ("seventh run: INT8 selective + compile, skip 18, expandable, 16 GiB cap",
     _w5(compile=True, expandable_segments=True), M.Setup("int8", "selective", skip_blocks=18), "training",
     15.24, 15.43),
    # twelfth run (docs/bench_results/h200_2026-12-03c/): eager steps with the fused Triton kernels and without
    # them (bench.checkpointing's *_no_kernels), in one call
    ("twelfth run: no checkpointing, eager", _w12(), M.Setup("bf16", "none"), "training", 29.21, 30.08),
    ("twelfth run: no checkpointing, eager, no kernels", _w12(fused_kernels=False), M.Setup("bf16", "none"),
     "training", 32.08, 32.32),
    ("twelfth run: gc, eager", _w12(), M.Setup("bf16", "full"), "training", 11.61, 12.15),
    ("twelfth run: gc, eager, no kernels", _w12(fused_kernels=False), M.Setup("bf16", "full"), "training",
     11.68, 12.26),
    ("twelfth run: INT8 gc, eager", _w12(), M.Setup("int8", "full"), "training", 7.23, 8.16),
    ("twelfth run: INT8 gc, eager, no kernels", _w12(fused_kernels=False), M.Setup("int8", "full"), "training",
     7.30, 8.04),
    # twelfth run, call 4: with the one-node LoRA (library.lora.eager_node) too
    ("twelfth run, call 4: INT8 no checkpointing, eager", _w12(), M.Setup("int8", "none"), "training", 24.88, 26.10),
    ("twelfth run, call 4: no checkpointing, eager", _w12(), M.Setup("bf16", "none"), "training", 29.22, 30.08),
    ("twelfth run, call 4: gc, eager", _w12(), M.Setup("bf16", "full"), "training", 11.64, 12.16),
    ("twelfth run, call 4: INT8 gc, eager", _w12(), M.Setup("int8", "full"), "training", 7.29, 8.20),
    # caching table (16 images of 1024 x 1024)
    ("caching: cache_latents.py", _w(), M.Setup(), "caching latents", 3.37, 3.90),
    ("caching: cache_text_encoder_outputs.py, bf16", _w(), M.Setup(), "caching text-encoder outputs", 14.85, 14.86),
    ("caching: cache_text_encoder_outputs.py, ConvRot INT8 file", _w(), M.Setup(te_variant="convrot_int8"),
     "caching text-encoder outputs", 7.69, 7.95),
]


@pytest.fixture(scope="module")
def full_models():
    return S.dit_sizes(MossImageConfig()), S.read_text_encoder(None)[0], S.read_vae(None)


@pytest.mark.parametrize("row", H200_ROWS, ids=[r[0] for r in H200_ROWS])
def test_predictions_match_the_h200_figures(row, full_models):
    _, work, setup, phase, allocated, reserved = row
    est = M.training_estimate(*full_models, work, setup)
    p = est.phase(phase)
    if allocated is not None:
        assert p.allocated / GIB == pytest.approx(allocated, rel=0.10)
    assert p.reserved(work.expandable_segments) / GIB == pytest.approx(reserved, rel=0.10)


def test_inference_prediction_matches_the_h200_figure(full_models):
    """e2e inference table, run C "bf16": torch peak 14.85 GiB allocated / 14.86 reserved, the text encoder's."""
    est = M.inference_estimate(*full_models, M.InferenceWorkload(image_tokens=4096, text_tokens=90), M.Setup())
    assert est.peak_phase.name == "encoding prompts"
    assert est.allocated / GIB == pytest.approx(14.85, rel=0.10)
    assert est.reserved / GIB == pytest.approx(14.86, rel=0.10)


def test_a_guided_pass_counts_both_packed_passes(full_models):
    """With CFG the two passes of a step run packed into one: the denoising transient is that of twice the tokens;
    at --guidance_scale 1.0, one pass."""
    work = M.InferenceWorkload(image_tokens=4096, text_tokens=90)
    guided = M.inference_estimate(*full_models, work, M.Setup()).phase("denoising").activations
    single = M.inference_estimate(*full_models, M.InferenceWorkload(image_tokens=4096, text_tokens=90, guided=False),
                                  M.Setup()).phase("denoising").activations
    assert guided == 2 * single == M.inference_transient_bytes(full_models[0], 2 * work.tokens, 2)


def test_phases_follow_the_options(full_models):
    dit, te, vae = full_models
    base = M.training_estimate(dit, te, vae, _w(), M.Setup())
    assert [p.name for p in base.phases] == ["caching latents", "caching text-encoder outputs", "training"]
    on_cpu = M.training_estimate(dit, te, vae, _w(), M.Setup(te_on_gpu=False))
    assert [p.name for p in on_cpu.phases] == ["caching latents", "training"]
    sampled = M.training_estimate(dit, te, vae, _w(sample_images=True), M.Setup())
    assert sampled.phase("sample images").allocated > base.phase("training").allocated - base.phase("training").activations
    bigger = M.training_estimate(dit, te, vae, _w(batch_size=2), M.Setup())
    assert bigger.phase("training").activations == pytest.approx(2 * base.phase("training").activations, rel=1e-6)
    fp32 = M.training_estimate(dit, te, vae, _w(float_bytes=4), M.Setup())
    assert fp32.phase("training").allocated > 2 * dit.weight_bytes("bf16", 2)
