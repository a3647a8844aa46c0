"""q, k and v's LoRA as one down-projection in a compiled block (`library.lora.compiled_group`): one product for the
three in the traced graph, the same outputs and gradients as the three LoRA-wrapped Linears to float rounding, and
the Linears again where the group does not apply."""

from __future__ import annotations

import collections

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from library.lora import eager_node
from library.moss_image.dit import MossImageBlock, MossImageConfig
from library.moss_image.rope import RopeTables
from library.runtime.attention import Attention
from library.runtime.eager_fusion import plain_forms
from networks.lora_generic import LoRAModule

CFG = MossImageConfig(hidden_size=256, num_heads=2, head_dim=128, ffn_hidden=512)


def _block_with_lora(dropout: float | None = None) -> tuple[MossImageBlock, list[LoRAModule]]:
    torch.manual_seed(0)
    blk = MossImageBlock(CFG, True, Attention())
    with torch.no_grad():
        blk.scale_shift_table.normal_(0, 0.2)
    blk.requires_grad_(False)
    torch.manual_seed(4)
    modules = [LoRAModule(f"lora_{n}", n, lin, lora_dim=4, alpha=4.0, dropout=dropout)
               for n, lin in blk.proj.named_children()]
    for module in modules:
        with torch.no_grad():
            module.lora_up.weight.normal_(0, 0.1)
        module.apply_to()
    return blk, modules


def _step(blk, modules, grouped: bool):
    """Output, input gradient and LoRA weight gradients of the compiled block, and the products in its graphs."""
    g = torch.Generator().manual_seed(1)
    cos, sin = RopeTables(CFG.rope_axes_dims, CFG.rope_theta).cos_sin([5], 8, 6, 6, torch.device("cpu"))
    x = torch.randn(1, 44, CFG.hidden_size, generator=g).requires_grad_(True)
    mod = torch.randn(1, 6, CFG.hidden_size, generator=g) * 0.3
    gy = torch.randn(1, 44, CFG.hidden_size, generator=g)
    products: dict[str, collections.Counter] = {"forward": collections.Counter(), "backward": collections.Counter()}

    def recorder(graph: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
            products[graph].update(str(n.target) for n in gm.graph.nodes if "mm" in str(n.target))
            return make_boxed_func(gm.forward)
        return compiler

    previous = eager_node.set_lora_grouped(grouped)
    torch._dynamo.reset()
    try:
        backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
        compiled = torch.compile(blk, fullgraph=True, backend=backend)
        y = compiled(x, cos, sin, None, mod)
        y.backward(gy)
    finally:
        torch._dynamo.reset()
        eager_node.set_lora_grouped(previous)
    grads = {m.lora_name: (m.lora_down.weight.grad.clone(), m.lora_up.weight.grad.clone()) for m in modules}
    for m in modules:
        m.lora_down.weight.grad = m.lora_up.weight.grad = None
    return y.detach(), x.grad, grads, products


def _products(counter: collections.Counter) -> int:
    products = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
    return sum(n for name, n in counter.items() if name in products)


def test_the_compiled_group_takes_one_down_projection_and_matches_the_three_linears():
    blk, modules = _block_with_lora()
    y0, gx0, grads0, products0 = _step(blk, modules, grouped=False)
    y1, gx1, grads1, products1 = _step(blk, modules, grouped=True)
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx1, gx0, rtol=1e-4, atol=1e-5)
    for name, (down, up) in grads0.items():
        torch.testing.assert_close(grads1[name][0], down, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grads1[name][1], up, rtol=1e-4, atol=1e-5)
    # forward: q, k and v's three down-projections become one; backward: their input-gradient products and their
    # weight-gradient products become one each
    assert _products(products1["forward"]) == _products(products0["forward"]) - 2, (products0, products1)
    assert _products(products1["backward"]) == _products(products0["backward"]) - 4, (products0, products1)


@pytest.mark.parametrize("case", ["applies", "dropout", "multiplier_zero"])
def test_the_linears_run_as_they_are_where_the_group_does_not_apply(case):
    """The traced q/k/v concatenates the down weights where the group applies, and nowhere else."""
    blk, modules = _block_with_lora(dropout=0.5 if case == "dropout" else None)
    if case == "multiplier_zero":
        modules[0].multiplier = 0.0
    blk.train()
    x = torch.randn(1, 10, CFG.hidden_size)
    seen: list[object] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(blk._qkv, backend=backend, fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    concatenated = [t for t in seen if "method cat " in t]
    assert bool(concatenated) == (case == "applies"), seen


def _full_width_muls(blk, tokens: int) -> int:
    """Multiplications over whole activations (at least tokens x hidden elements) in the compiled block's backward
    graph."""
    g = torch.Generator().manual_seed(1)
    cos, sin = RopeTables(CFG.rope_axes_dims, CFG.rope_theta).cos_sin([4], 4, 5, 8, torch.device("cpu"))
    x = torch.randn(1, tokens, CFG.hidden_size, generator=g).requires_grad_(True)
    mod = torch.randn(1, 6, CFG.hidden_size, generator=g) * 0.3
    count = 0

    def backward(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        nonlocal count
        for n in gm.graph.nodes:
            val = n.meta.get("val")
            if str(n.target) == "aten.mul.Tensor" and isinstance(val, torch.Tensor):
                count += val.numel() >= tokens * CFG.hidden_size
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    try:
        compiled = torch.compile(blk, fullgraph=True, backend=aot_autograd(
            fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward))
        compiled(x, cos, sin, None, mod).sum().backward()
    finally:
        torch._dynamo.reset()
    return count


@pytest.mark.parametrize("grouped", [True, False])
def test_the_lora_adds_no_full_width_multiplication_to_the_compiled_backward(grouped):
    """The LoRA scale multiplies the rank activations (`LoRAModule.delta_output`), so its backward scales rank-wide
    gradients: the block's backward graph has as many full-width multiplications with the LoRA as without it."""
    torch.manual_seed(0)
    plain = MossImageBlock(CFG, True, Attention())
    plain.requires_grad_(False)
    blk, _ = _block_with_lora()
    previous = eager_node.set_lora_grouped(grouped)
    try:
        without = _full_width_muls(plain, 44)
        assert _full_width_muls(blk, 44) == without > 0
        on_output = eager_node.set_scale_on_ranks(False)  # the earlier form: one more per LoRA Linear at least
        try:
            assert _full_width_muls(blk, 44) >= without + (4 if grouped else 6)
        finally:
            eager_node.set_scale_on_ranks(on_output)
    finally:
        eager_node.set_lora_grouped(previous)


def test_the_adapter_is_found_from_the_linear_without_joining_its_state():
    """The group finds each Linear's adapter by the attribute that `apply_to` sets (no bound-method introspection in
    traced code), which is neither a submodule nor state; a second adapter applied over the first is the one found,
    and its base (the first adapter's forward) is not the Linear's own."""
    blk, modules = _block_with_lora()
    q = blk.proj.q
    assert eager_node.adapter_of(q) is modules[0]
    assert eager_node.ADAPTER_ATTR not in dict(q.named_modules()) and all("lora" not in k for k in q.state_dict())
    x = torch.randn(1, 4, CFG.hidden_size)
    second = LoRAModule("lora_q2", "q", q, lora_dim=2, alpha=2.0)
    second.apply_to()
    assert eager_node.adapter_of(q) is second and not second.org_forward_is_own
    with plain_forms():  # the parts a compiled block takes
        assert modules[0].plain_part(x).own_base is q
        assert second.plain_part(x).own_base is None
