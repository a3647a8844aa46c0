"""Plain q, k and v stacked (`library.runtime.dense_stack`, `set_compiled_kernels(dense_stacked_qkv=True)`): views of
one buffer with the same outputs and state dict, dropped when broken, and one product for the three in compiled
blocks, for inference and in the LoRA group of a training step, with the outputs and gradients of three products."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

from library.moss_image.loaders import load_moss_image_model
from library.moss_image.rope import RopeTables
from library.runtime.dense_stack import dense_stack_intact, dense_stackable, stack_dense_linears
from library.runtime.fused_compiled import compiled_kernels
from tests.int8_lora import dit_with_lora


def _linears(n: int = 3, width: int = 16) -> list[nn.Linear]:
    torch.manual_seed(0)
    linears = [nn.Linear(width, width, bias=False) for _ in range(n)]
    for m in linears:
        m.requires_grad_(False)
    return linears


def test_stacked_linears_are_views_of_one_buffer_with_the_same_outputs():
    linears = _linears()
    x = torch.randn(5, 16)
    before = [m(x) for m in linears]
    state = [dict(m.state_dict()) for m in linears]
    weight = stack_dense_linears(linears)
    assert weight is not None and weight.shape == (48, 16)
    assert all(m.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() for m in linears)
    assert all(isinstance(m.weight, nn.Parameter) and not m.weight.requires_grad for m in linears)
    assert all(torch.equal(m(x), b) for m, b in zip(linears, before))
    assert [m.state_dict().keys() for m in linears] == [s.keys() for s in state]
    assert all(torch.equal(m.weight, s["weight"]) for m, s in zip(linears, state))
    torch.testing.assert_close(torch.cat(before, dim=-1), x @ weight.t())
    assert dense_stack_intact(weight, linears)
    linears[1].weight = nn.Parameter(linears[1].weight.clone(), requires_grad=False)  # a replaced weight
    assert not dense_stack_intact(weight, linears)


@pytest.mark.parametrize("case", ["bias", "trainable", "dtype", "one"])
def test_only_frozen_plain_linears_of_one_width_and_dtype_stack(case):
    linears = _linears(1 if case == "one" else 3)
    if case == "bias":
        linears[0] = nn.Linear(16, 16)
        linears[0].requires_grad_(False)
    elif case == "trainable":
        linears[2].weight.requires_grad_(True)
    elif case == "dtype":
        linears[1].to(torch.float64)
    assert not dense_stackable(linears) and stack_dense_linears(linears) is None


def _dit(snapshot, lora: bool):
    if lora:
        return dit_with_lora(snapshot, convrot_int8=False)
    dit = load_moss_image_model("cpu", snapshot, dtype=torch.float32)
    dit.requires_grad_(False)
    return dit, None


def _block_step(dit, grad: bool):
    """One forward (and with `grad` a backward) of the first main block compiled with fullgraph=True (aot graphs run
    as recorded): output, input gradient, the LoRA gradients, and the [rows, in] weights of the forward's products."""
    blk, cfg = dit.layers[0], dit.config
    g = torch.Generator().manual_seed(3)
    cos, sin = RopeTables(cfg.rope_axes_dims, cfg.rope_theta).cos_sin([5], 8, 4, 4, torch.device("cpu"))
    x = torch.randn(1, 24, cfg.hidden_size, generator=g).requires_grad_(grad)
    mod = torch.randn(1, 6, cfg.hidden_size, generator=g) * 0.3
    weights: list[tuple[int, ...]] = []

    def forward(gm: torch.fx.GraphModule, _inputs: list) -> object:
        for n in gm.graph.nodes:
            if n.op == "call_function" and str(n.target) in ("aten.mm.default", "aten.t.default"):
                val = n.args[0].meta.get("val") if str(n.target) == "aten.t.default" else None
                if val is not None and val.dim() == 2:
                    weights.append(tuple(val.shape))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    try:
        fn = torch.compile(blk, backend=aot_autograd(fw_compiler=forward,
                                                     bw_compiler=lambda gm, _: make_boxed_func(gm.forward)),
                           fullgraph=True)
        with torch.set_grad_enabled(grad):
            out = fn(x, cos, sin, None, mod)
            if grad:
                out.square().sum().backward()
    finally:
        torch._dynamo.reset()
    return out.detach(), x.grad, weights


def test_compiled_inference_blocks_run_one_product_for_stacked_q_k_and_v(tiny_snapshot):
    dit, _ = _dit(tiny_snapshot, lora=False)
    width = dit.config.hidden_size
    three, _, three_w = _block_step(dit, grad=False)
    assert dit.stack_qkv_weights() == 0  # off by default
    with compiled_kernels(dense_stacked_qkv=True):
        assert dit.stack_qkv_weights() == len(dit.layers)
    one, _, one_w = _block_step(dit, grad=False)
    assert (3 * width, width) in one_w and (3 * width, width) not in three_w
    assert one_w.count((width, width)) == three_w.count((width, width)) - 3
    torch.testing.assert_close(one, three, rtol=1e-5, atol=1e-6)
    with compiled_kernels(inference_stacked_qkv=False):
        assert (3 * width, width) not in _block_step(dit, grad=False)[2]


def test_a_compiled_training_step_takes_the_lora_groups_base_products_as_one(tiny_snapshot):
    dit, net = _dit(tiny_snapshot, lora=True)
    width = dit.config.hidden_size
    three = _block_step(dit, grad=True)
    grads3 = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    net.zero_grad(set_to_none=True)
    with compiled_kernels(dense_stacked_qkv=True):
        assert dit.stack_qkv_weights() == len(dit.layers)
    one = _block_step(dit, grad=True)
    grads1 = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    assert (3 * width, width) in one[2] and (3 * width, width) not in three[2]
    torch.testing.assert_close(one[0], three[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one[1], three[1], rtol=1e-5, atol=1e-6)
    assert len(grads1) == len(grads3) > 0
    for a, b in zip(grads1, grads3):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_moved_dit_drops_its_dense_stacks(tiny_snapshot):
    dit, _ = _dit(tiny_snapshot, lora=False)
    with compiled_kernels(dense_stacked_qkv=True):
        assert dit.stack_qkv_weights() == len(dit.layers)
    assert all(b.proj.dense_qkv_stack() is not None and b.proj.qkv_stack() is None for b in dit.layers)
    dit.to(torch.float64)
    assert all(b.proj.dense_qkv_stack() is None for b in dit.layers)
