"""Int8 Linears stacked into one weight (`library.quant.int8_stack`) and the DiT's stacked q, k and v
(`MossImage.stack_qkv_weights`): views of one buffer, the same outputs and state dict, and a stack dropped as soon as
its members stop reading from it (moved, replaced, block swap)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from library.moss_image.loaders import load_moss_image_model
from library.quant.convrot import ConvRotInt8Linear
from library.quant.int8_stack import stack_int8_linears, stack_intact, stackable
from tests.int8_lora import dit_with_lora


def _int8(n: int, k: int = 64, seed: int = 0, bias: bool = False) -> ConvRotInt8Linear:
    torch.manual_seed(seed)
    return ConvRotInt8Linear.from_linear(nn.Linear(k, n, bias=bias), group_size=16)


def test_stacked_linears_are_views_of_one_buffer_with_the_same_outputs():
    linears = [_int8(32, seed=0), _int8(48, seed=1), _int8(32, seed=2)]
    x = torch.randn(3, 64)
    before = [m(x) for m in linears]
    codes = [m.weight.clone() for m in linears]
    weight, scale = stack_int8_linears(linears)
    assert weight.shape == (112, 64) and scale.shape == (112, 1)
    for m, c in zip(linears, codes):
        assert m.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        assert torch.equal(m.weight, c)
    assert torch.equal(weight, torch.cat(codes))
    assert all(torch.equal(m(x), b) for m, b in zip(linears, before))
    assert stack_intact(weight, scale, linears)
    assert not stack_intact(weight, scale, linears[::-1])  # the order is part of the stack
    assert not stack_intact(weight, scale, linears[:2])  # so is every member


def test_a_replaced_weight_breaks_the_stack():
    linears = [_int8(32, seed=s) for s in range(3)]
    weight, scale = stack_int8_linears(linears)
    linears[1].weight = linears[1].weight.clone()
    assert not stack_intact(weight, scale, linears)
    linears = [_int8(32, seed=s) for s in range(3)]
    weight, scale = stack_int8_linears(linears)
    linears[2].weight_scale.data = linears[2].weight_scale.clone()  # as block swap replaces tensors
    assert not stack_intact(weight, scale, linears)


@pytest.mark.parametrize("case", ["float", "bias", "widths", "groups", "one"])
def test_only_plain_int8_linears_of_one_input_stack(case):
    linears: list[nn.Module] = [_int8(32, seed=s) for s in range(3)]
    if case == "float":
        linears[0] = nn.Linear(64, 32, bias=False)
    elif case == "bias":
        linears[1] = _int8(32, bias=True)
    elif case == "widths":
        linears[2] = _int8(32, k=128)
    elif case == "groups":
        torch.manual_seed(3)
        linears[2] = ConvRotInt8Linear.from_linear(nn.Linear(64, 32, bias=False), group_size=64)
    else:
        linears = linears[:1]
    kept = [m.weight for m in linears]
    assert not stackable(linears) and stack_int8_linears(linears) is None
    assert all(m.weight is w for m, w in zip(linears, kept))


def test_the_dit_stacks_q_k_and_v_and_drops_stacks_it_no_longer_reads(tiny_snapshot, caplog):
    dit = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32, convrot_int8=True).eval()
    state = {k: v.clone() for k, v in dit.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(1, dit.config.in_channels, 4, 4, generator=g)
    text = torch.randn(1, 8, dit.config.text_dim, generator=g)
    t = torch.tensor([500.0])
    with torch.no_grad():
        ref = dit(latent, t, text)
        assert dit.stack_qkv_weights() == len(dit.layers)
        assert dit.state_dict().keys() == state.keys()
        assert all(torch.equal(v, state[k]) for k, v in dit.state_dict().items())
        assert torch.equal(dit(latent, t, text), ref)  # eager: the three Linears read their views
        dit.layers[3].proj.k.weight = dit.layers[3].proj.k.weight.clone()
        caplog.set_level(logging.WARNING, logger="library.moss_image.projections")
        assert torch.equal(dit(latent, t, text), ref)
        assert "dropping the stack" in caplog.text
        assert dit.layers[3].proj.qkv_stack() is None and dit.layers[2].proj.qkv_stack() is not None
        dit.to("cpu")  # moving the model drops every stack
        assert all(block.proj.qkv_stack() is None for block in dit.layers)
        assert torch.equal(dit(latent, t, text), ref) and not dit._qkv_stacked


def test_a_bf16_dit_stacks_nothing(tiny_snapshot):
    dit = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32)
    assert dit.stack_qkv_weights() == 0 and not dit._qkv_stacked


def _lora_step(dit, net, compiled: bool):
    """One forward + backward of the DiT's first main block (compiled with aot_eager and fullgraph=True, or the eager
    plain forms that a compiled block computes): output, input gradient and LoRA gradients."""
    from library.moss_image.rope import RopeTables
    from library.runtime.eager_fusion import plain_forms

    blk = dit.layers[0]
    g = torch.Generator().manual_seed(3)
    cfg = dit.config
    cos, sin = RopeTables(cfg.rope_axes_dims, cfg.rope_theta).cos_sin([5], 8, 4, 4, torch.device("cpu"))
    x = torch.randn(1, 24, cfg.hidden_size, generator=g).requires_grad_(True)
    mod = torch.randn(1, 6, cfg.hidden_size, generator=g) * 0.3
    torch._dynamo.reset()
    try:
        with plain_forms():
            fn = torch.compile(blk, backend="aot_eager", fullgraph=True) if compiled else blk
            out = fn(x, cos, sin, None, mod)
            out.square().sum().backward()
    finally:
        torch._dynamo.reset()
    grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    net.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("compiled", [False, True], ids=["plain_forms", "compiled"])
def test_training_with_stacked_q_k_and_v_gives_the_lora_gradients_of_three_products(tiny_snapshot, compiled,
                                                                                     stacked_forward_calls):
    """`training_stacked_qkv` on (the default): the LoRA group's base products of stacked q, k and v as one, with the
    same output, input gradient and LoRA gradients as three products (to float tolerance: the input gradient's three
    sums are one product's now); off, or without a stack, three products."""
    from library.runtime.fused_compiled import compiled_kernels

    calls = stacked_forward_calls
    dit, net = dit_with_lora(tiny_snapshot)
    with compiled_kernels(training_stacked_qkv=True):
        three = _lora_step(dit, net, compiled)  # no stack yet
    assert dit.stack_qkv_weights() == len(dit.layers)
    with compiled_kernels(training_stacked_qkv=False):
        assert torch.equal(_lora_step(dit, net, compiled)[0], three[0]) and calls["n"] == 0  # the setting off
    with compiled_kernels(training_stacked_qkv=True):
        one = _lora_step(dit, net, compiled)
    assert calls["n"] == 1
    assert torch.equal(one[0], three[0])
    torch.testing.assert_close(one[1], three[1], rtol=1e-5, atol=1e-6)
    assert len(one[2]) == len(three[2]) > 0
    for a, b in zip(one[2], three[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("checkpointing", [None, "full", "selective"])
def test_a_checkpointed_compiled_block_takes_the_stacked_product_too(tiny_snapshot, checkpointing):
    """`training_stacked_qkv` inside a compiled block's checkpoint (`--gradient_checkpointing --compile`): the traced
    forward has one int8 product over the stacked [3W, W] weight where it had q, k and v's three, checkpointed or
    not, with the LoRA group in front of it."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from library.moss_image.rope import RopeTables
    from library.runtime.fused_compiled import compiled_kernels

    dit, _net = dit_with_lora(tiny_snapshot)
    assert dit.stack_qkv_weights() == len(dit.layers)
    blk, cfg = dit.layers[0], dit.config
    blk.checkpointing = checkpointing
    width = cfg.hidden_size
    cos, sin = RopeTables(cfg.rope_axes_dims, cfg.rope_theta).cos_sin([5], 8, 4, 4, torch.device("cpu"))
    x = torch.randn(1, 24, width).requires_grad_(True)
    mod = torch.randn(1, 6, width) * 0.3

    def weight_rows(on: bool) -> list[int]:
        rows: list[int] = []

        def forward(gm: torch.fx.GraphModule, _inputs: list) -> object:
            rows.extend(n.args[3].meta["val"].shape[0] for n in gm.graph.nodes
                        if n.op == "call_function" and "convrot_int8_linear.default" in str(n.target))
            return make_boxed_func(gm.forward)

        backend = aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, _inputs: make_boxed_func(gm.forward))
        torch._dynamo.reset()
        try:
            with compiled_kernels(training_stacked_qkv=on):
                torch.compile(blk, backend=backend, fullgraph=True)(x, cos, sin, None, mod).sum().backward()
        finally:
            torch._dynamo.reset()
        return sorted(rows)

    three = weight_rows(False)
    assert three.count(width) == 5 and 3 * width not in three  # q, k, v, o and ffn_down
    one = weight_rows(True)
    assert one.count(3 * width) == 1 and one.count(width) == 2  # the stack, o and ffn_down
    assert len(one) == len(three) - 2
