"""The LoRA weights' gradients in the eager nodes (`library.lora.eager_node._weight_grad`): one addmm writing fp32 on
CUDA, the product scaled and cast elsewhere; the rank-wide scaled products as one addmm."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from library.lora import eager_node
from networks.lora_generic import LoRAModule
from tests.test_eager_fusion import _OpNames as _Ops  # counts the aten operators that run under it


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_scaled_product_is_one_addmm_that_ignores_its_addend():
    """alpha * a @ b without a multiply: beta 0 leaves the (uninitialised) addend unread, NaNs included."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 8, generator=g).bfloat16()
    b = torch.randn(8, 24, generator=g).bfloat16()
    with _Ops() as ops:
        got = eager_node._scaled_product(a, b, 0.3)
    assert set(ops.names) == {"addmm", "new_empty"}, ops.names
    assert got.dtype == torch.bfloat16 and got.shape == (40, 24)
    assert _rel(got, 0.3 * (a.double() @ b.double())) < 1e-2
    nan = torch.full((), float("nan"), dtype=torch.bfloat16)
    assert torch.equal(torch.addmm(nan, a, b, beta=0, alpha=0.3), got)


def test_weight_grad_on_the_cpu_is_the_scaled_product_cast():
    """The CPU's addmm writes no fp32 from bf16 operands: the product in bf16, scaled and cast, as before."""
    assert not eager_node._fp32_addmm_works(torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    a = torch.randn(16, 64, generator=g).bfloat16()
    b = torch.randn(64, 12, generator=g).bfloat16()
    got = eager_node._weight_grad(a, b, 0.7, torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.mm(a, b).mul_(0.7).float())
    assert torch.equal(eager_node._weight_grad(a, b, 1.0, torch.bfloat16), torch.mm(a, b))


def test_the_switch_returns_the_previous_setting():
    assert eager_node.fp32_grads()
    assert eager_node.set_lora_fp32_grads(False) is True
    try:
        assert not eager_node.fp32_grads()
    finally:
        assert eager_node.set_lora_fp32_grads(True) is False


def _three_loras(device: torch.device) -> list[tuple[nn.Linear, LoRAModule]]:
    """Three bf16 Linears of one input (q, k, v) with fp32 LoRAs whose up-projections are not zero."""
    torch.manual_seed(3)
    out = []
    for i, (n, rank) in enumerate(((96, 8), (64, 4), (64, 4))):
        base = nn.Linear(128, n, bias=False).to(device, torch.bfloat16).requires_grad_(False)
        module = LoRAModule(f"lora_unet_{i}", str(i), base, multiplier=0.8, lora_dim=rank, alpha=3.0).to(device)
        with torch.no_grad():
            module.lora_up.weight.normal_(0, 0.2)
        module.apply_to()
        out.append((base, module))
    return out


def _grads(linears, x: torch.Tensor, gy: list[torch.Tensor], backward_mode=None) -> list[torch.Tensor]:
    """The LoRA weights' gradients of one group step (one `LoRAGroup` node) under bf16 autocast; the backward under
    `backward_mode` where one is given."""
    for _, m in linears:
        m.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        parts = eager_node.lora_group_parts([b for b, _ in linears], x)
        assert parts is not None
        ys = eager_node.lora_group(x, parts)
    with backward_mode if backward_mode is not None else contextlib.nullcontext():
        torch.autograd.backward(ys, gy)
    return [t for _, m in linears for t in (m.lora_down.weight.grad, m.lora_up.weight.grad)]


def _reference(linears, x: torch.Tensor, gy: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same gradients in float64 from the operators."""
    out = []
    x64 = x.double()
    for (base, m), g in zip(linears, gy):
        down = m.lora_down.weight.detach().double().requires_grad_(True)
        up = m.lora_up.weight.detach().double().requires_grad_(True)
        y = (x64 @ down.t()) @ up.t() * (m.scale * m.multiplier)
        y.backward(g.double())
        out += [down.grad, up.grad]
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_group_writes_fp32_gradients_with_no_cast_or_multiply():
    """On CUDA the group's weight gradients come from addmm in fp32 (no `_to_copy` or `mul` in the backward), as
    close to float64 as the bf16 products were, or closer (they are no longer rounded to bf16)."""
    dev = torch.device("cuda")
    assert eager_node._fp32_addmm_works(dev), "this torch's CUDA addmm takes no out_dtype"
    linears = _three_loras(dev)
    g = torch.Generator(device=dev).manual_seed(4)
    x = torch.randn(300, 128, device=dev, generator=g).bfloat16()
    gy = [torch.randn(300, b.out_features, device=dev, generator=g).bfloat16() for b, _ in linears]
    ref = _reference(linears, x, gy)
    ops = _Ops()
    got = _grads(linears, x, gy, backward_mode=ops)
    assert ops.names["addmm"] >= 6, ops.names  # each weight's gradient, and the bases' input gradients added in
    assert not {"_to_copy", "mul", "mul_"} & set(ops.names), ops.names
    previous = eager_node.set_lora_fp32_grads(False)
    try:
        old = _grads(linears, x, gy)
    finally:
        eager_node.set_lora_fp32_grads(previous)
    for new, before, exact in zip(got, old, ref):
        assert new.dtype == torch.float32 and new.shape == exact.shape
        assert _rel(new, exact) <= max(_rel(before, exact), 1e-3), (_rel(new, exact), _rel(before, exact))
