"""The eager forms of the element-wise code (`library.runtime.eager_fusion`) against the plain forms: the same math,
rounding aside, and the plain forms inside compiled regions."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from library.lora import eager_node
from library.moss_image.dit import MossImageBlock, MossImageConfig, RMSNorm
from library.moss_image.rope import RopeTables, apply_rope
from library.runtime.attention import Attention
from library.runtime.eager_fusion import eager_fused, plain_forms, set_eager_fusion
from networks.lora_generic import LoRAModule

CFG = MossImageConfig(hidden_size=256, num_heads=2, head_dim=128, ffn_hidden=512)


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _block(dtype: torch.dtype) -> MossImageBlock:
    torch.manual_seed(0)
    blk = MossImageBlock(CFG, True, Attention()).to(dtype)
    with torch.no_grad():
        blk.scale_shift_table.normal_(0, 0.2)
        for norm in (blk.norm1, blk.norm2, blk.q_norm, blk.k_norm):
            norm.weight.normal_(1, 0.1)
    return blk


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    cos, sin = RopeTables(CFG.rope_axes_dims, CFG.rope_theta).cos_sin([5], 8, 6, 6, torch.device("cpu"))
    x = torch.randn(1, 44, CFG.hidden_size, generator=g).to(dtype)
    mod = (torch.randn(1, 6, CFG.hidden_size, generator=g) * 0.3).to(dtype)
    gy = torch.randn(1, 44, CFG.hidden_size, generator=g).to(dtype)
    return x, mod, cos, sin, gy


def _step(blk: MossImageBlock, x0, mod, cos, sin, gy):
    """Output, input gradient and the parameter gradients of one forward + backward."""
    blk.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    y = blk(x, cos, sin, None, mod)
    y.backward(gy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in blk.named_parameters() if p.grad is not None}


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [True, False])
def test_eager_mode_runs_the_eager_forms_and_the_switch_the_plain_ones(fused):
    blk, (x, mod, cos, sin, _gy) = _block(torch.float32), _inputs(torch.float32)
    base, _ = _lora()
    previous = set_eager_fusion(fused)
    try:
        with _OpNames() as block_ops:
            blk(x, cos, sin, None, mod)
        with _OpNames() as lora_ops:
            base(torch.randn(3, 32))
    finally:
        set_eager_fusion(previous)
    # modulation x2 and gated residuals x2 as addcmul; RoPE of q and k as complex products (no stack of real pairs)
    # with one rotation table for both
    assert block_ops.names["addcmul"] == (4 if fused else 0)
    assert block_ops.names["complex"] == (1 if fused else 0)
    assert block_ops.names["stack"] == (0 if fused else 2)
    # the base Linear (with its bias) is one addmm; the eager LoRA node accumulates its up-projection into that
    # output in a second one
    assert lora_ops.names["addmm"] == (2 if fused else 1)


def test_the_switch_returns_the_previous_setting():
    assert eager_fused()
    assert set_eager_fusion(False) is True
    try:
        assert not eager_fused()
        with plain_forms():
            assert not eager_fused()
        assert not eager_fused()
    finally:
        assert set_eager_fusion(True) is False


def test_fp32_block_matches_the_plain_forms():
    blk, inputs = _block(torch.float32), _inputs(torch.float32)
    with plain_forms():
        ref = _step(blk, *inputs)
    got = _step(blk, *inputs)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    assert got[2].keys() == ref[2].keys()
    for name, grad in ref[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_block_is_as_close_to_fp32_as_the_plain_forms():
    """One rounding where the plain forms round two or three times: against an fp32 run of the same weights, the
    eager forms' error is no larger (a margin of 5 % for the order of the roundings)."""
    blk, inputs = _block(torch.bfloat16), _inputs(torch.bfloat16)
    ref_blk = _block(torch.float32)
    ref_blk.load_state_dict({k: v.float() for k, v in blk.state_dict().items()})
    with plain_forms():
        ref = _step(ref_blk, *(t.float() for t in inputs))
        plain = _step(blk, *inputs)
    fused = _step(blk, *inputs)
    for i in (0, 1):
        assert relerr(fused[i], ref[i]) <= 1.05 * relerr(plain[i], ref[i]) + 1e-4
        assert relerr(fused[i], plain[i]) < 1e-2  # bf16 rounding noise


def test_rmsnorm_eager_form_keeps_the_dtype_under_autocast():
    norm = RMSNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
    x = torch.randn(3, 7, 64).bfloat16()
    with plain_forms():
        ref = norm(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = norm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=0, atol=0)  # fp32 arithmetic inside either way (CPU: same operators)


def test_rope_as_one_complex_product_matches_the_real_pairs():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, 3, 16, generator=g)
    angles = torch.randn(2, 9, 8, generator=g) * 3
    cos, sin = angles.cos(), angles.sin()
    with plain_forms():
        ref = apply_rope(x, cos, sin)
    torch.testing.assert_close(apply_rope(x, cos, sin), ref, rtol=1e-6, atol=1e-6)
    assert apply_rope(x.bfloat16(), cos, sin).dtype == torch.bfloat16


def test_the_blocks_of_a_forward_share_one_rotation_table():
    cos, sin = torch.rand(1, 6, 4), torch.rand(1, 6, 4)
    x = torch.randn(1, 6, 2, 8)
    with _OpNames() as ops:
        for _ in range(3):
            apply_rope(x, cos, sin)
    assert ops.names["complex"] == 1
    cos2 = cos.clone()
    with _OpNames() as ops:
        apply_rope(x, cos2, sin)  # another tensor: a new table
        cos2.mul_(0.5)  # changed in place: a new table, and the right one
        got = apply_rope(x, cos2, sin)
    assert ops.names["complex"] == 2
    with plain_forms():
        torch.testing.assert_close(got, apply_rope(x, cos2, sin), rtol=1e-6, atol=1e-6)


def test_inference_tensors_get_their_own_table():
    with torch.inference_mode():
        cos, sin = torch.rand(1, 6, 4), torch.rand(1, 6, 4)
        x = torch.randn(1, 6, 2, 8)
        got = apply_rope(x, cos, sin)
        with plain_forms():
            torch.testing.assert_close(got, apply_rope(x, cos, sin), rtol=1e-6, atol=1e-6)


def test_lora_under_autocast_keeps_an_output_of_another_dtype():
    """A base whose output is not in the autocast dtype (fp32 here) keeps it: the plain form, not addmm's bf16."""
    _, module = _lora()
    out, x = torch.randn(3, 48), torch.randn(3, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = module.add_delta(out, x)
        with plain_forms():
            ref = module.add_delta(out, x)
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def _lora(dropout: float | None = None, dtype: torch.dtype = torch.float32) -> tuple[nn.Linear, LoRAModule]:
    torch.manual_seed(3)
    base = nn.Linear(32, 48, bias=True).to(dtype).requires_grad_(False)
    module = LoRAModule("lora_unet_x", "x", base, multiplier=0.7, lora_dim=4, alpha=8.0, dropout=dropout)
    with torch.no_grad():
        module.lora_up.weight.normal_(0, 0.3)
    module.apply_to()
    return base, module


def _lora_step(base: nn.Linear, module: LoRAModule, x0: torch.Tensor, autocast: bool = False):
    module.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = base(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad, module.lora_down.weight.grad, module.lora_up.weight.grad


def test_lora_addmm_matches_the_plain_form():
    base, module = _lora()
    x = torch.randn(2, 5, 32)
    with plain_forms():
        ref = _lora_step(base, module, x)
    got = _lora_step(base, module, x)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_lora_addmm_under_autocast_with_fp32_lora_weights():
    """The trainer's case: a bf16 base, fp32 LoRA tensors, bf16 autocast; addmm takes its operands in bf16."""
    base, module = _lora()
    base.to(torch.bfloat16)
    x = torch.randn(2, 5, 32).bfloat16()
    with plain_forms():
        ref = _lora_step(base, module, x, autocast=True)
    got = _lora_step(base, module, x, autocast=True)
    assert got[0].dtype == torch.bfloat16
    for a, b in zip(got, ref):
        assert relerr(a, b) < 1e-2


def _node_and_operators(base: nn.Module, module: LoRAModule, x: torch.Tensor, autocast: bool) -> tuple:
    """`_lora_step` with the one-node LoRA (the default), then with the LoRA as separate operators."""
    got = _lora_step(base, module, x, autocast=autocast)
    previous = eager_node.set_lora_one_node(False)
    try:
        return got, _lora_step(base, module, x, autocast=autocast)
    finally:
        eager_node.set_lora_one_node(previous)


def _graph_nodes(t: torch.Tensor) -> list[str]:
    """The names of the autograd nodes behind `t` (each once)."""
    seen, todo, names = set(), [t.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("whole", [True, False], ids=["linear_node", "delta_node"])
def test_the_lora_node_matches_the_lora_operators(autocast, whole):
    """One autograd node instead of the casts, transposes, products and views: the same numbers, in fp32 to float
    rounding and under bf16 autocast to bf16 rounding. Around a frozen Linear the node runs the base product too
    (`LoRALinear`); around a base with something to train it adds the delta to the base's output (`LoRAAddmm`)."""
    base, module = _lora()
    base.weight.requires_grad_(not whole)
    x = torch.randn(2, 5, 32)
    if autocast:
        base.to(torch.bfloat16)
        x = x.bfloat16()
    got, ref = _node_and_operators(base, module, x, autocast=autocast)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype
        assert relerr(a, b) < (1e-2 if autocast else 1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        nodes = _graph_nodes(base(x.clone().requires_grad_(True)))
    if whole:
        assert sorted(nodes) == ["AccumulateGrad"] * 3 + ["LoRALinearBackward"], nodes
    else:
        assert nodes.count("LoRAAddmmBackward") == 1
        assert nodes.count("AddmmBackward0") == 1, nodes  # the base Linear's (with its bias)
        assert not {"MmBackward0", "ToCopyBackward0"} & set(nodes), nodes


def _int8_lora(bias: bool) -> tuple[nn.Module, LoRAModule]:
    """A ConvRot INT8 Linear (256 -> 48, bf16) with a rank-4 LoRA whose up-projection is not zero."""
    from library.quant.convrot import ConvRotInt8Linear

    torch.manual_seed(5)
    base = ConvRotInt8Linear.from_linear(nn.Linear(256, 48, bias=bias).bfloat16(), 64)
    module = LoRAModule("lora_unet_x", "x", base, multiplier=0.7, lora_dim=4, alpha=8.0)
    with torch.no_grad():
        module.lora_up.weight.normal_(0, 0.3)
    module.apply_to()
    return base, module


def test_the_lora_node_around_a_convrot_int8_linear():
    """Around a ConvRot INT8 Linear the node runs the int8 product and its backward (the eager numerics on the CPU)
    and takes the LoRA's input gradient as the backward product's addend: the module's node plus the LoRA
    operators' values, to bf16 rounding."""
    base, module = _int8_lora(bias=True)
    x = torch.randn(2, 5, 256).bfloat16()
    got, ref = _node_and_operators(base, module, x, autocast=True)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and relerr(a, b) < 1e-2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nodes = _graph_nodes(base(x.clone().requires_grad_(True)))
    assert sorted(nodes) == ["AccumulateGrad"] * 3 + ["LoRALinearBackward"], nodes


def _copies(fn) -> int:
    """How many aten::copy_ calls `fn` makes (torch's addmm into a new tensor copies its addend first)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")


@pytest.mark.parametrize("kind", ["dense", "int8"])
def test_the_lora_node_adds_in_place_without_copies_and_with_the_same_bits(kind):
    """`LoRALinear` adds the up-projection into the product's output and the base's input gradient into the LoRA's,
    in place: no copy of either (two per Linear and step otherwise, twelve per block), and the same bits as the
    sums into new tensors (`set_lora_in_place(False)`)."""
    if kind == "dense":
        base, module = _lora()
        base.bias = None
        x = torch.randn(2, 5, 32)
    else:
        base, module = _int8_lora(bias=False)
        x = torch.randn(2, 5, 256).bfloat16()
    autocast = kind == "int8"
    step = lambda: _lora_step(base, module, x, autocast=autocast)
    copies_in_place = _copies(step)
    got = step()
    previous = eager_node.set_lora_in_place(False)
    try:
        copies_new = _copies(step)
        ref = step()
    finally:
        eager_node.set_lora_in_place(previous)
    assert eager_node.in_place()
    # the forward's copy, and the dense backward's (the int8 backward's regular path, which the CPU takes, sums with
    # an add, in place or not; its replayed path on CUDA takes addmm: tests/test_convrot_int8_triton.py)
    assert copies_new - copies_in_place == (2 if kind == "dense" else 1), (copies_new, copies_in_place)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_the_lora_node_keeps_a_product_output_that_selective_checkpointing_saves():
    """Under selective checkpointing the forward adds into a new tensor: the policy may keep the product's output
    for the recomputation (a narrowing product, K >= 2N), which an add in place would change; the gradients are
    those of no checkpointing."""
    from library.runtime.checkpointing import checkpointed

    torch.manual_seed(4)
    base = nn.Linear(64, 16, bias=False).requires_grad_(False)  # K = 4 N: the policy keeps its output
    module = LoRAModule("lora_unet_x", "x", base, multiplier=1.0, lora_dim=4, alpha=4.0)
    with torch.no_grad():
        module.lora_up.weight.normal_(0, 0.3)
    module.apply_to()
    x0 = torch.randn(3, 7, 64)

    def grads(checkpointed_run: bool) -> list[torch.Tensor]:
        module.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        fn = lambda t: base(t).square()
        y = checkpointed(fn, "selective", x) if checkpointed_run else fn(x)
        y.sum().backward()
        return [x.grad, module.lora_down.weight.grad, module.lora_up.weight.grad]

    reference = grads(False)
    for a, b in zip(grads(True), reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the guard is what keeps them: added in place, the kept output would carry the LoRA twice when recomputed
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager_node, "_no_dispatch_mode", lambda: True)
        assert any(not torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(grads(True), reference))


def test_the_lora_node_gradients_by_finite_differences():
    out = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    down = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: eager_node.LoRAAddmm.apply(*t, 0.35), (out, x, down, up))
    base = nn.Linear(5, 6, bias=False).to(torch.float64).requires_grad_(False)
    assert torch.autograd.gradcheck(
        lambda x, d, u: eager_node.LoRALinear.apply(x, d, u, 0.35, base, eager_node.DenseProduct, base.weight),
        (x, down, up))
    # only the inputs that need a gradient get one (a frozen down-projection, an input without grad)
    y = eager_node.LoRAAddmm.apply(out.detach(), x.detach(), down.detach(), up, 0.35)
    y.sum().backward()
    assert up.grad is not None


def test_lora_with_dropout_in_training_takes_the_plain_form():
    base, module = _lora(dropout=0.5)
    module.train()
    x = torch.randn(4, 32)
    torch.manual_seed(9)
    with plain_forms():
        ref = base(x)
    torch.manual_seed(9)
    torch.testing.assert_close(base(x), ref, rtol=0, atol=0)


@pytest.mark.parametrize("with_lora", [False, True])
def test_compiled_regions_keep_the_plain_forms(with_lora):
    """Dynamo traces the plain forms: no addcmul, complex tensor or LoRA addmm in the captured graph, and the compiled
    block computes exactly what the plain eager forms compute (q, k and v's LoRA ungrouped: the compiled group of
    `library.lora.compiled_group` is the same math in other products, tested in tests/test_lora_compiled_group.py)."""
    previous = eager_node.set_lora_grouped(False)
    try:
        _compiled_plain_forms(with_lora)
    finally:
        eager_node.set_lora_grouped(previous)


def _compiled_plain_forms(with_lora: bool) -> None:
    blk, inputs = _block(torch.float32), _inputs(torch.float32)
    if with_lora:
        torch.manual_seed(4)
        blk.requires_grad_(False)
        modules = [LoRAModule(f"lora_{n}", n, lin, lora_dim=4, alpha=4.0) for n, lin in blk.proj.named_children()]
        for module in modules:
            with torch.no_grad():
                module.lora_up.weight.normal_(0, 0.1)
            module.apply_to()
    targets: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    with plain_forms():
        ref = _step(blk, *inputs)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(blk, backend=backend, fullgraph=True)
        got = _step(compiled, *inputs)
    finally:
        torch._dynamo.reset()
    assert targets
    assert not [t for t in targets if "addcmul" in t or "complex" in t or "addmm" in t]
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_block_under_autocast_fused_norm_and_fp32_closeness():
    """On CUDA the eager RMSNorm is one `_fused_rms_norm` kernel on the bf16 activation (autocast would upcast it),
    and the block under bf16 autocast is as close to an fp32 run as the plain forms (the trainer's setting)."""
    dev = torch.device("cuda")
    blk = _block(torch.bfloat16).to(dev)
    ref_blk = _block(torch.float32).to(dev)
    ref_blk.load_state_dict({k: v.float() for k, v in blk.state_dict().items()})
    inputs = [t.to(dev) for t in _inputs(torch.bfloat16)]
    with plain_forms():
        ref = _step(ref_blk, *(t.float() for t in inputs))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with plain_forms():
            plain = _step(blk, *inputs)
        with _OpNames() as ops:
            fused = _step(blk, *inputs)
    assert ops.names["_fused_rms_norm"] >= 4 and ops.names["_fused_rms_norm_backward"] >= 4, ops.names
    for i in (0, 1):
        assert relerr(fused[i], ref[i]) <= 1.05 * relerr(plain[i], ref[i]) + 1e-4
        assert relerr(fused[i], plain[i]) < 1e-2


def _three_loras(dtype: torch.dtype = torch.float32, ranks=(4, 8, 2), int8: bool = False):
    """Three frozen Linears of one input (as a block's q, k, v), each with its own LoRA: other ranks, multipliers."""
    from library.quant.convrot import ConvRotInt8Linear

    torch.manual_seed(6)
    linears = []
    for i, rank in enumerate(ranks):
        base = nn.Linear(256 if int8 else 32, 48 - 8 * i, bias=False).to(dtype).requires_grad_(False)
        if int8:
            base = ConvRotInt8Linear.from_linear(base, 64)
        module = LoRAModule(f"lora_unet_x{i}", f"x{i}", base, multiplier=0.5 + 0.25 * i, lora_dim=rank, alpha=4.0)
        with torch.no_grad():
            module.lora_up.weight.normal_(0, 0.3)
        module.apply_to()
        linears.append((base, module))
    return linears


def _group_step(linears, x0: torch.Tensor, autocast: bool, group: bool):
    """The three outputs and the gradients of x and of every LoRA weight, through `lora_group` or one call each."""
    for _, module in linears:
        module.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        bases = [b for b, _ in linears]
        parts = eager_node.lora_group_parts(bases, x) if group else None
        assert (parts is not None) == group
        ys = eager_node.lora_group(x, parts) if group else tuple(b(x) for b in bases)
    sum(((i + 1) * y.float()).square().sum() for i, y in enumerate(ys)).backward()
    grads = [t for _, m in linears for t in (m.lora_down.weight.grad, m.lora_up.weight.grad)]
    return [*(y.detach() for y in ys), x.grad, *grads], ys[0]


@pytest.mark.parametrize("autocast", [False, True])
def test_the_lora_group_matches_a_node_per_linear(autocast):
    """q, k and v as one node (`LoRAGroup`: one down-projection product, one LoRA input-gradient product into which
    the bases' are added) against a `LoRALinear` each, and against the operators: to float rounding in fp32, to bf16
    rounding under autocast; ranks and multipliers differ per Linear."""
    linears = _three_loras(torch.bfloat16 if autocast else torch.float32)
    x = torch.randn(2, 5, 32)
    if autocast:
        x = x.bfloat16()
    got, y = _group_step(linears, x, autocast, group=True)
    assert _graph_nodes(y).count("LoRAGroupBackward") == 1
    per_linear, _ = _group_step(linears, x, autocast, group=False)
    previous = eager_node.set_lora_one_node(False)
    try:
        operators, _ = _group_step(linears, x, autocast, group=False)
    finally:
        eager_node.set_lora_one_node(previous)
    for ref in (per_linear, operators):
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert relerr(a, b) < (1e-2 if autocast else 1e-6)


def test_the_lora_group_around_convrot_int8_linears():
    linears = _three_loras(torch.bfloat16, int8=True)
    x = torch.randn(2, 5, 256).bfloat16()
    got, _ = _group_step(linears, x, True, group=True)
    ref, _ = _group_step(linears, x, True, group=False)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and relerr(a, b) < 1e-2


def test_the_lora_group_gradients_by_finite_differences():
    torch.manual_seed(8)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    parts, tensors = [], []
    for out_features, rank in ((5, 2), (4, 3)):
        base = nn.Linear(6, out_features, bias=False).double().requires_grad_(False)
        down = torch.randn(rank, 6, dtype=torch.float64, requires_grad=True)
        up = torch.randn(out_features, rank, dtype=torch.float64, requires_grad=True)
        parts.append(eager_node.NodePart(down, up, 0.7, base, eager_node.DenseProduct, (base.weight,)))
        tensors += [down, up]

    def fn(x, *weights):
        rebuilt = [eager_node.NodePart(weights[2 * i], weights[2 * i + 1], p.alpha, p.org, p.product, p.base)
                   for i, p in enumerate(parts)]
        return eager_node.lora_group(x, rebuilt)

    assert torch.autograd.gradcheck(fn, (x, *tensors))


def test_the_lora_group_needs_every_linear_to_offer_its_part():
    """Without a LoRA on one of the Linears (a pattern that leaves v out, say), or with the grouping switched off,
    the block calls the Linears one by one."""
    linears = _three_loras()
    bases = [b for b, _ in linears]
    x = torch.randn(2, 5, 32)
    assert eager_node.lora_group_parts(bases, x) is not None
    assert eager_node.lora_group_parts([*bases[:2], nn.Linear(32, 32)], x) is None
    previous = eager_node.set_lora_grouped(False)
    try:
        assert eager_node.lora_group_parts(bases, x) is None
    finally:
        eager_node.set_lora_grouped(previous)
    with plain_forms():  # the plain forms (as under torch.compile): no one-node LoRA, so no group
        assert eager_node.lora_group_parts(bases, x) is None
