"""A LoRA merge at load is computed in fp32 and rounded once, to the dtype the model is loaded in, whatever the
checkpoint's dtype (library.lora.merge, the loaders' tensor hook); the plan's merge device."""

from __future__ import annotations

import pytest
import torch

from library.files.safetensors_io import hooked_tensor, load_dtype_for_hook, save_file_atomic
from library.lora.merge import DeviceRoundTrip, LoraMergePlan, load_lora_files, merged_modules
from library.lora.weights import delta_weight
from library.moss_image.dit import MossImage
from library.moss_image.loaders import load_moss_image_model
from library.moss_image.tiny_snapshot import TINY_DIT_CONFIG, tiny_dit_state_dict
from networks import loha, lokr, lora_generic

MULTIPLIERS = (1.0, 0.7, -0.5)


def _randomize(net: torch.nn.Module, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny DiT as a bf16 and an fp32 checkpoint, and three adapter files: a LoRA, a LoHa and a LoKr (bf16)."""
    root = tmp_path_factory.mktemp("precision")
    sd = tiny_dit_state_dict(0)
    paths = {"bf16": root / "dit_bf16.safetensors", "fp32": root / "dit_fp32.safetensors"}
    save_file_atomic({k: v.to(torch.bfloat16) for k, v in sd.items()}, paths["bf16"])
    save_file_atomic({k: v.float() for k, v in sd.items()}, paths["fp32"])
    model = MossImage(TINY_DIT_CONFIG)
    nets = [lora_generic.create_network(1.0, 4, 2.0, None, None, model),
            loha.create_network(1.0, 2, 1.0, None, None, model, exclude_patterns="['.*ffn.*']"),
            lokr.create_network(1.0, 2, 1.0, None, None, model)]
    adapters = []
    for i, net in enumerate(nets):
        _randomize(net, i + 1, 0.05)
        path = root / f"adapter{i}.safetensors"
        save_file_atomic({k: v.to(torch.bfloat16) if v.dim() else v for k, v in net.state_dict().items()}, path)
        adapters.append(path)
    return paths, adapters


def _plan(adapters, count: int) -> LoraMergePlan:
    return LoraMergePlan(load_lora_files(adapters[:count], list(MULTIPLIERS[:count])), "lora_unet")


def _fp32_reference(plan: LoraMergePlan, key: str, weight: torch.Tensor) -> torch.Tensor:
    """The merge of the plan's modules for `key` into the weight in fp32, never rounded."""
    name = plan.lora_name(key)
    modules = [(m.parts, m.multiplier) for m in plan._modules[name]]
    exact = merged_modules(weight.float(), modules, key)
    assert exact.dtype == torch.float32
    formula = weight.float() + sum(m * delta_weight(parts) for parts, m in modules)  # the same math, term by term
    torch.testing.assert_close(exact, formula, atol=1e-6, rtol=1e-6)
    return exact


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize(("checkpoint", "dtype"), [("bf16", torch.bfloat16), ("bf16", torch.float32),
                                                   ("fp32", torch.float32), ("fp32", torch.bfloat16)])
def test_loader_merge_is_the_fp32_merge_rounded_once(files, checkpoint, dtype, count):
    paths, adapters = files
    plan = _plan(adapters, count)
    model = load_moss_image_model("cpu", paths[checkpoint], dtype=dtype, tensor_hook=plan.merge)
    assert plan.finish() == []
    base = load_moss_image_model("cpu", paths[checkpoint], dtype=None)  # the checkpoint's own values
    merged = 0
    rounded_twice_differs = False
    for key, weight in model.state_dict().items():
        original = base.state_dict()[key]
        assert weight.dtype == dtype
        if not plan.targets(key):
            assert torch.equal(weight, original.to(dtype)), key
            continue
        merged += 1
        exact = _fp32_reference(plan, key, original)
        assert torch.equal(weight, exact.to(dtype)), key  # one rounding, bit for bit
        if checkpoint == "bf16" and dtype == torch.float32:  # the old merge rounded to the file's bf16 first
            rounded_twice_differs |= not torch.equal(weight, exact.to(torch.bfloat16).float())
    assert merged == len(plan)
    if checkpoint == "bf16" and dtype == torch.float32:
        assert rounded_twice_differs


def test_plan_merge_rounds_to_the_given_dtype(files):
    _, adapters = files
    plan = _plan(adapters, 3)
    key = "layers.1.proj.ffn_down.weight"  # LoRA and LoKr (the LoHa skips the FFN)
    weight = torch.randn(TINY_DIT_CONFIG.hidden_size, TINY_DIT_CONFIG.ffn_hidden).to(torch.bfloat16)
    exact = _fp32_reference(plan, key, weight)
    assert torch.equal(plan.merge(key, weight.float(), dtype=torch.bfloat16), exact.bfloat16())
    assert torch.equal(plan.merge(key, weight.float()), exact)
    assert torch.equal(plan.merge(key, weight), exact.bfloat16())
    untouched = torch.randn(3, 3)
    assert plan.merge("not_a_lora_target.weight", untouched) is untouched
    assert plan.merge("not_a_lora_target.weight", untouched, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_hook_dtype_holds_both_the_file_and_the_model_dtype():
    assert load_dtype_for_hook(torch.bfloat16, torch.float32) == torch.float32
    assert load_dtype_for_hook(torch.bfloat16, torch.bfloat16) == torch.bfloat16
    assert load_dtype_for_hook(torch.float32, torch.bfloat16) == torch.float32
    assert load_dtype_for_hook(torch.float16, torch.bfloat16) == torch.float32
    assert load_dtype_for_hook(torch.float16, None) == torch.float16
    seen = []
    out = hooked_tensor("k", torch.ones(2, dtype=torch.float16), torch.bfloat16,
                        lambda k, t: seen.append(t.dtype) or t + 1)
    assert seen == [torch.float32] and out.dtype == torch.bfloat16
    assert torch.equal(out, torch.full((2,), 2.0).bfloat16())
    ints = torch.arange(3, dtype=torch.int8)
    assert hooked_tensor("k", ints, torch.bfloat16, None) is ints  # only floats are cast


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_plan_on_cuda_without_cuda_merges_on_the_cpu(files):
    _, adapters = files
    plan = LoraMergePlan(load_lora_files(adapters[:1]), "lora_unet", device="cuda")
    assert plan.device is None
    key = "layers.0.proj.q.weight"
    weight = torch.randn(TINY_DIT_CONFIG.hidden_size, TINY_DIT_CONFIG.hidden_size)
    assert torch.equal(plan.merge(key, weight), _plan(adapters, 1).merge(key, weight))
    assert LoraMergePlan(load_lora_files(adapters[:1]), "lora_unet", device="cpu").device is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_merge_of_a_cpu_weight_comes_back_to_the_cpu(files):
    _, adapters = files
    plan = LoraMergePlan(load_lora_files(adapters, list(MULTIPLIERS)), "lora_unet", device="cuda")
    key = "layers.0.proj.q.weight"
    weight = torch.randn(TINY_DIT_CONFIG.hidden_size, TINY_DIT_CONFIG.hidden_size).to(torch.bfloat16)
    merged = plan.merge(key, weight, dtype=torch.float32)
    assert merged.device.type == "cpu" and merged.dtype == torch.float32
    torch.testing.assert_close(merged, _fp32_reference(plan, key, weight), atol=1e-6, rtol=1e-6)
    assert plan.times.round_trips == 1 and plan.times.merges == 1  # through the pinned buffers, by blocks of rows


@pytest.mark.parametrize("buffer_bytes", [64, 4096, 1 << 20])  # smaller than a row (the buffers grow), a few, one
def test_round_trip_by_blocks_of_rows_is_the_whole_tensor_merge(files, buffer_bytes):
    """The blocks-of-rows merge of a CPU weight (here with the CPU as its device: plain buffers, no events) equals
    the whole-tensor fp32 merge for LoRA, LoHa and LoKr, in any block size, and leaves the weight as it was."""
    _, adapters = files
    plan = _plan(adapters, 3)
    hidden, ffn = TINY_DIT_CONFIG.hidden_size, TINY_DIT_CONFIG.ffn_hidden
    round_trip = DeviceRoundTrip(torch.device("cpu"), buffer_bytes=buffer_bytes)
    g = torch.Generator().manual_seed(3)
    cases = [("layers.0.proj.q.weight", (hidden, hidden)), ("layers.1.proj.ffn_down.weight", (hidden, ffn))]
    for key, shape in cases:  # q: LoRA + LoHa + LoKr; ffn_down: LoRA + LoKr
        modules = [(m.parts, m.multiplier) for m in plan._modules[plan.lora_name(key)]]
        weight = torch.randn(shape, generator=g).to(torch.bfloat16)
        before = weight.clone()
        exact = _fp32_reference(plan, key, weight)
        merged = merged_modules(weight, modules, key, torch.float32, round_trip)
        assert merged.dtype == torch.float32 and merged.shape == weight.shape
        torch.testing.assert_close(merged, exact, atol=1e-6, rtol=1e-6)
        rounded = merged_modules(weight, modules, key, torch.bfloat16, round_trip)
        assert rounded.dtype == torch.bfloat16
        torch.testing.assert_close(rounded, exact.bfloat16(), atol=0, rtol=2**-7)  # one rounding: at most 1 ulp
        assert torch.equal(weight, before)
    assert round_trip.times.round_trips == 2 * len(cases)
    assert round_trip.times.copy_in_s > 0 and round_trip.times.copy_out_s > 0
