"""The fused kernels as registered ops inside compiled blocks (`library.runtime.fused_compiled`): the ops' torch
implementations against autograd of the plain forms, their fake implementations, and a block compiled with
fullgraph=True that calls them, against the plain eager block."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from library.moss_image.dit import MossImageBlock, MossImageConfig
from library.moss_image.rope import RopeTables, apply_rope
from library.runtime.attention import Attention
from library.runtime.eager_fusion import plain_forms
from library.runtime.fused_compiled import compiled_kernel, compiled_kernels, set_compiled_kernels

OPS = torch.ops.moss_image
CFG = MossImageConfig(hidden_size=256, num_heads=2, head_dim=128, ffn_hidden=512)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _check(op, grad_op, ref_fn, x, rest, grad_rest=(), out_shape=None):
    """op(x, *rest) and grad_op(g, x, *grad_rest) against ref_fn and its autograd in float64 (the ops compute in
    fp32)."""
    g = torch.randn(out_shape or x.shape, dtype=torch.float64)
    xr = x.detach().clone().requires_grad_(True)
    ref = ref_fn(xr)
    ref.backward(g)
    torch.testing.assert_close(op(x, *rest), ref.detach(), rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(grad_op(g, x, *grad_rest), xr.grad, rtol=2e-5, atol=2e-6)


def test_the_ops_torch_math_is_the_plain_forms_forward_and_backward():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 10, 3, 8, generator=gen, dtype=torch.float64)
    w = 1 + 0.1 * torch.randn(8, generator=gen, dtype=torch.float64)
    ang = torch.rand(1, 10, 4, generator=gen, dtype=torch.float64) * 6
    cos, sin = ang.cos().float(), ang.sin().float()
    _check(OPS.fused_norm_rope, OPS.fused_norm_rope_backward,
           lambda t: apply_rope(_rms(t, w, 1e-6), cos.double(), sin.double()),
           x, (w, cos, sin, 1e-6), (w, cos, sin, 1e-6))
    h = torch.randn(2, 10, 16, generator=gen, dtype=torch.float64)
    hw = 1 + 0.1 * torch.randn(16, generator=gen, dtype=torch.float64)
    shift, scale = torch.randn(2, 2, 16, generator=gen, dtype=torch.float64).unbind(1)
    _check(OPS.fused_norm_modulate, OPS.fused_norm_modulate_backward,
           lambda t: _rms(t, hw, 1e-6) * (1 + scale[:, None]) + shift[:, None],
           h, (hw, shift, scale, 1e-6), (hw, scale, 1e-6))
    u = torch.randn(3, 5, 12, generator=gen, dtype=torch.float64)

    def swiglu(t: torch.Tensor) -> torch.Tensor:
        value, gate = t.chunk(2, dim=-1)
        return F.silu(gate) * value

    _check(OPS.fused_swiglu, OPS.fused_swiglu_backward, swiglu, u, (), (), out_shape=(3, 5, 6))
    strided = torch.randn(5, 24, generator=gen, dtype=torch.float64)[:, ::2]  # any layout in, contiguous out
    assert OPS.fused_swiglu(strided).is_contiguous()
    torch.testing.assert_close(OPS.fused_swiglu(strided), swiglu(strided))


def test_the_ops_fake_implementations_give_the_shapes_and_dtypes():
    x = torch.randn(2, 6, 3, 8, dtype=torch.bfloat16)
    cos = sin = torch.ones(1, 6, 4)
    h = torch.randn(2, 6, 16, dtype=torch.bfloat16)
    mod = torch.zeros(2, 16, dtype=torch.bfloat16)
    u = torch.randn(2, 6, 12, dtype=torch.bfloat16)
    for op, args in ((OPS.fused_norm_rope, (x, torch.ones(8), cos, sin, 1e-6)),
                     (OPS.fused_norm_rope_backward, (x, x, torch.ones(8), cos, sin, 1e-6)),
                     (OPS.fused_norm_modulate, (h, torch.ones(16), mod, mod, 1e-6)),
                     (OPS.fused_norm_modulate_backward, (h, h, torch.ones(16), mod, 1e-6)),
                     (OPS.fused_swiglu, (u,)), (OPS.fused_swiglu_backward, (u[..., :6], u))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_blocks_call_the_ops_only_while_being_compiled():
    from library.runtime.fused_compiled import _SETTINGS

    assert _SETTINGS["swiglu_codes"] and _SETTINGS["inference_codes"] and not _SETTINGS["inference_epilogues"]
    x = torch.randn(2, 4)
    with compiled_kernels(cpu=True):
        assert not compiled_kernel("swiglu", x)  # not tracing: the eager kernels' business
    with pytest.raises(ValueError, match="unknown compiled-kernel settings"):
        set_compiled_kernels(norm=True)


def _block() -> MossImageBlock:
    torch.manual_seed(0)
    blk = MossImageBlock(CFG, True, Attention())
    with torch.no_grad():
        blk.scale_shift_table.normal_(0, 0.2)
        for norm in (blk.norm1, blk.norm2, blk.q_norm, blk.k_norm):
            norm.weight.normal_(1, 0.1)
    blk.requires_grad_(False)
    for lin in blk.proj.children():  # something to train besides the input: the Linears' weights
        lin.weight.requires_grad_(True)
    return blk


def _step(blk, x0, mod, cos, sin, gy):
    blk.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    y = blk(x, cos, sin, None, mod)
    y.backward(gy)
    return y.detach(), x.grad, {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in blk.named_parameters()
                                if p.grad is not None}


@pytest.mark.parametrize(("backend", "policy"), [("record", None), ("record", "full"), ("record", "selective"),
                                                 ("inductor", None), ("inductor", "selective")])
def test_a_compiled_block_calls_the_kernel_ops_in_one_graph_and_matches_the_plain_block(backend, policy):
    """fullgraph=True, with the block's own checkpointing inside the compiled region (none, full, selective): the
    ops in the forward graph and their gradient ops in the backward graph (recomputed there under checkpointing),
    and the plain eager block's output and gradients."""
    blk = _block()
    g = torch.Generator().manual_seed(1)
    cos, sin = RopeTables(CFG.rope_axes_dims, CFG.rope_theta).cos_sin([5], 8, 6, 6, torch.device("cpu"))
    x = torch.randn(1, 44, CFG.hidden_size, generator=g)
    mod = torch.randn(1, 6, CFG.hidden_size, generator=g) * 0.3
    gy = torch.randn(1, 44, CFG.hidden_size, generator=g)
    with plain_forms():
        ref = _step(blk, x, mod, cos, sin, gy)
    blk.checkpointing = policy
    targets: dict[str, list[str]] = {"forward": [], "backward": []}

    def recorder(graph: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
            targets[graph].extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            return make_boxed_func(gm.forward)
        return compiler

    record = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))

    torch._dynamo.reset()
    try:
        with compiled_kernels(cpu=True, norm_modulate=True):
            compiled = torch.compile(blk, backend=record if backend == "record" else "inductor", fullgraph=True)
            got = _step(compiled, x, mod, cos, sin, gy)
    finally:
        torch._dynamo.reset()
    if backend == "record":
        # the aten graphs: each kernel once per use forward, its gradient op backward, and under checkpointing the
        # kernels again in the backward graph (recomputed: the policies keep products and attention, not these)
        ops = {"fused_norm_modulate": 2, "fused_norm_rope": 2, "fused_swiglu": 1}
        forward = collections.Counter(t for t in targets["forward"] if t.startswith("moss_image."))
        backward = collections.Counter(t for t in targets["backward"] if t.startswith("moss_image."))
        assert forward == {f"moss_image.{op}.default": n for op, n in ops.items()}, targets["forward"]
        assert backward == {**{f"moss_image.{op}_backward.default": n for op, n in ops.items()},
                            **({f"moss_image.{op}.default": n for op, n in ops.items()} if policy else {})}
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == ref[2].keys()
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], rtol=1e-4, atol=1e-5)


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", [None, "selective"])
def test_cuda_compiled_block_with_the_kernels_is_as_close_to_fp32_as_the_eager_kernels(policy):
    """On CUDA, bf16: the block compiled by inductor with the three kernels as ops (the Triton kernels run inside the
    compiled graph) against an fp32 run of the plain forms, as close as the eager block with the same kernels."""
    from library.runtime import fused_ops

    dev = torch.device("cuda")
    assert fused_ops.prepare(dev)
    blk = _block().to(dev, torch.bfloat16)
    ref_blk = _block().to(dev)
    g = torch.Generator().manual_seed(1)
    cos, sin = RopeTables(CFG.rope_axes_dims, CFG.rope_theta).cos_sin([5], 8, 6, 6, dev)
    x = torch.randn(1, 44, CFG.hidden_size, generator=g).to(dev)
    mod = (torch.randn(1, 6, CFG.hidden_size, generator=g) * 0.3).to(dev)
    gy = torch.randn(1, 44, CFG.hidden_size, generator=g).to(dev)
    with plain_forms():
        ref = _step(ref_blk, x, mod, cos, sin, gy)
    bf = (x.bfloat16(), mod.bfloat16(), cos, sin, gy.bfloat16())
    eager = _step(blk, *bf)
    blk.checkpointing = policy
    torch._dynamo.reset()
    try:
        with compiled_kernels(norm_modulate=True):
            got = _step(torch.compile(blk, fullgraph=True), *bf)
    finally:
        torch._dynamo.reset()
    for i in (0, 1):
        assert _relerr(got[i], ref[i]) < 1.5 * _relerr(eager[i], ref[i]) + 1e-3
    for name in ref[2]:
        assert _relerr(got[2][name], ref[2][name]) < 1.5 * _relerr(eager[2][name], ref[2][name]) + 1e-3


# ------------------------------------------------------------------------------------------------ SwiGLU + INT8 codes
def _swiglu_then_quantize(u: torch.Tensor, group_size: int = 16) -> tuple[torch.Tensor, ...]:
    """What a compiled ConvRot INT8 block computes for ffn_down's input: SwiGLU, its rows quantised, and the product
    read by something else too (the LoRA's down-projection)."""
    from library.quant.convrot_ops import QUANTIZE

    y = OPS.fused_swiglu(u)
    q, s = QUANTIZE(y.reshape(-1, y.shape[-1]), group_size)
    return y * 2, q, s


def test_the_swiglu_codes_op_gives_the_two_ops_bits():
    u = torch.randn(2, 5, 2 * 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    fused = OPS.fused_swiglu_quant(u, 16)
    y, q, s = _swiglu_then_quantize(u)
    assert torch.equal(fused[0] * 2, y) and torch.equal(fused[1], q) and torch.equal(fused[2], s)
    torch.library.opcheck(OPS.fused_swiglu_quant, (u, 16), test_utils=("test_schema", "test_faketensor"))


def test_the_pass_puts_the_swiglu_codes_op_in_place_of_swiglu_and_its_quantisation():
    from torch.fx.experimental.proxy_tensor import make_fx

    from library.quant.convrot_ops import QUANTIZE
    from library.runtime.fused_compiled import SWIGLU_QUANT, fuse_quantize_into_producers

    u = torch.randn(2, 5, 2 * 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    gm = make_fx(lambda t: _swiglu_then_quantize(t), tracing_mode="fake")(u)
    assert fuse_quantize_into_producers(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert SWIGLU_QUANT in targets and QUANTIZE not in targets and OPS.fused_swiglu.default not in targets
    assert all(torch.equal(a, b) for a, b in zip(gm(u), _swiglu_then_quantize(u)))
    # another group than the one produced, or rows that are not the product's: nothing to fuse
    other = make_fx(lambda t: QUANTIZE(OPS.fused_swiglu(t).transpose(0, 1).reshape(-1, 64), 16),
                    tracing_mode="fake")(u)
    assert fuse_quantize_into_producers(other.graph) == 0


def test_an_inductor_graph_runs_swiglu_and_the_quantisation_as_one_op(monkeypatch):
    """Compiled with inductor (the product's pass installed as `compile_blocks` installs it, on by default), SwiGLU
    and the quantisation of its rows for an int8 Linear run as one op, and the output is the same; with the pass off
    (`set_compiled_kernels(swiglu_codes=False)`) or the codes off (`set_fused_quant(False)`) they stay two."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    from library.quant import convrot_kernels as K
    from library.quant import convrot_ops as ops
    from library.runtime import fused_compiled, fused_ops

    try:
        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - inductor raises various errors for a missing compiler
        pytest.skip(f"inductor on the CPU needs a C++ compiler ({e})")
    calls = collections.Counter()
    original = fused_compiled._quantized_rows
    monkeypatch.setattr(fused_compiled, "_quantized_rows",
                        lambda y, g: calls.update(["fused"]) or original(y, g))
    torch.manual_seed(0)
    q, s = K.quantize_convrot_weight(torch.randn(24, 64), 16)

    def ffn_down(u):
        return ops.linear(OPS.fused_swiglu(u), q, s, None, 16, "bf16")

    u = torch.randn(3, 7, 128)
    with torch.no_grad():
        ref = ffn_down(u)
        for on, pass_on in ((True, True), (False, True), (True, False)):
            torch._dynamo.reset()
            previous = fused_ops.set_fused_quant(on)
            previous_pass = set_compiled_kernels(swiglu_codes=pass_on)
            try:
                with torch._inductor.config.patch(post_grad_custom_pre_pass=None, compile_threads=1,
                                                  fx_graph_cache=False):
                    ops.enable_inductor_quantize_dedupe()
                    fused_compiled.enable_inductor_producer_codes()
                    compiled = torch.compile(ffn_down, backend="inductor", fullgraph=True)
                    calls.clear()
                    out = compiled(u)
            finally:
                fused_ops.set_fused_quant(previous)
                set_compiled_kernels(**previous_pass)
            assert calls["fused"] == (1 if on and pass_on else 0), (on, pass_on, calls)
            assert torch.equal(out, ref)


# ------------------------------------------------------------------------------------------------------------------
# Compiled inference blocks: the int8 Linears' inputs as codes alone
# ------------------------------------------------------------------------------------------------------------------
def _int8_block() -> MossImageBlock:
    from library.quant.convrot import convert_model_to_convrot_int8

    blk = _block()
    convert_model_to_convrot_int8(blk, lambda name: name.startswith("proj."), group_size=64)
    blk.requires_grad_(False)
    return blk.to(torch.bfloat16)


def _inference_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    cos, sin = RopeTables(CFG.rope_axes_dims, CFG.rope_theta).cos_sin([5], 8, 6, 6, torch.device("cpu"))
    x = torch.randn(1, 44, CFG.hidden_size, generator=g).bfloat16()
    mod = (torch.randn(1, 6, CFG.hidden_size, generator=g) * 0.3).bfloat16()
    return x, cos, sin, mod


def _recorded_forward(blk: MossImageBlock, grad: bool = False, **settings: bool
                      ) -> tuple[torch.Tensor, collections.Counter]:
    """The block compiled with fullgraph=True (aot graphs recorded, run as they are) under no_grad (or with x
    requiring grad): its output and the moss_image ops of its forward graph."""
    x, cos, sin, mod = _inference_inputs()
    targets: list[str] = []

    def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    try:
        with compiled_kernels(cpu=True, **settings), torch.set_grad_enabled(grad):
            compiled = torch.compile(blk, backend=aot_autograd(fw_compiler=compiler), fullgraph=True)
            out = compiled(x.requires_grad_(grad), cos, sin, None, mod)
    finally:
        torch._dynamo.reset()
    return out.detach(), collections.Counter(t.removeprefix("moss_image.").removesuffix(".default")
                                             for t in targets if t.startswith("moss_image."))


def test_a_block_compiled_without_gradients_gives_its_int8_linears_their_inputs_as_codes():
    """Both norms and SwiGLU write only the codes of their outputs for the int8 Linears that read them (q, k and v
    share one), so no quantiser runs but the attention output's; q and k come with their head norm and RoPE, o and
    ffn_down with the gated residual (one op each); and the output is the same bits as with the outputs written and
    quantised and the steps after the products on their own (the same torch math on the CPU)."""
    blk = _int8_block()
    out, ops = _recorded_forward(blk, norm_modulate=True, inference_epilogues=True)
    assert ops == {"fused_norm_modulate_codes": 2, "fused_swiglu_codes": 1, "convrot_int8_linear_codes": 2,
                   "convrot_int8_linear_norm_rope": 2, "convrot_int8_linear_gated_residual": 2,
                   "convrot_int8_quantize": 1}, ops
    ref, ref_ops = _recorded_forward(blk, norm_modulate=True, inference_epilogues=True, inference_codes=False)
    # one quantisation per Linear here (inductor's pass, not run by this backend, keeps one for q, k and v)
    assert ref_ops["convrot_int8_quantize"] == 6 and "fused_swiglu_codes" not in ref_ops, ref_ops
    assert torch.equal(out, ref)
    with torch.no_grad():
        eager = blk(*_inference_inputs()[:3], None, _inference_inputs()[3])
    assert _relerr(out, eager) < 2e-2  # the eager forms round the norm twice; the int8 codes amplify that


def test_codes_alone_only_without_gradients_and_for_plain_int8_linears():
    """A graph traced with gradients (training) keeps the outputs; a Linear whose forward was replaced (a LoRA) or
    hooked reads its input itself, so its producer writes it (the other consumers' producers still write codes)."""
    blk = _int8_block()
    _, ops = _recorded_forward(blk, grad=True)
    assert not {"fused_norm_modulate_codes", "fused_swiglu_codes", "convrot_int8_linear_codes"} & set(ops), ops
    original = blk.proj.k.forward
    blk.proj.k.forward = lambda x: original(x)  # what a LoRA's apply_to does
    _, ops = _recorded_forward(blk, inference_epilogues=True)
    assert ops["fused_norm_modulate_codes"] == 1 and ops["fused_swiglu_codes"] == 1, ops  # the FFN's two
    # q, k and v read the norm's output (k as its LoRA would); o and ffn_down still add their residual
    assert ops["convrot_int8_linear"] == 3 and ops["convrot_int8_linear_codes"] == 1, ops
    assert ops["convrot_int8_linear_gated_residual"] == 2 and "convrot_int8_linear_norm_rope" not in ops, ops
    del blk.proj.k.forward
    handle = blk.proj.ffn_down.register_forward_pre_hook(lambda m, args: None)
    _, ops = _recorded_forward(blk, inference_epilogues=True)
    assert ops["fused_norm_modulate_codes"] == 2 and "fused_swiglu_codes" not in ops, ops
    assert ops["convrot_int8_linear_gated_residual"] == 1 and ops["convrot_int8_linear"] == 1, ops  # o; ffn_down
    handle.remove()
    _, ops = _recorded_forward(blk, inference_codes=False)
    assert "fused_norm_modulate_codes" not in ops and "convrot_int8_linear_codes" not in ops, ops


def test_the_codes_ops_give_the_producer_and_quantiser_bits():
    from library.quant import convrot_kernels as K
    from library.quant.convrot_ops import LINEAR, LINEAR_CODES, QUANTIZE

    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 128, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(128, generator=g)).bfloat16()
    shift, scale = (torch.randn(2, 2, 128, generator=g) * 0.3).bfloat16().unbind(1)
    u = torch.randn(2, 5, 2 * 128, generator=g).bfloat16()
    y = OPS.fused_norm_modulate(x, w, shift, scale, 1e-6)
    q, s = OPS.fused_norm_modulate_codes(x, w, shift, scale, 1e-6, 64)
    q_ref, s_ref = QUANTIZE(y.reshape(-1, 128), 64)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    q2, s2 = OPS.fused_swiglu_codes(u, 64)
    q2_ref, s2_ref = QUANTIZE(OPS.fused_swiglu(u).reshape(-1, 128), 64)
    assert torch.equal(q2, q2_ref) and torch.equal(s2, s2_ref)
    r, gate1 = torch.randn(2, 5, 128, generator=g).bfloat16(), torch.randn(2, 128, generator=g).bfloat16()
    h, q3, s3 = OPS.fused_residual_norm_modulate_codes(x, gate1, r, w, shift, scale, 1e-6, 64)
    assert torch.equal(h, x + gate1[:, None] * r)
    q3_ref, s3_ref = OPS.fused_norm_modulate_codes(h, w, shift, scale, 1e-6, 64)
    assert torch.equal(q3, q3_ref) and torch.equal(s3, s3_ref)
    wq, ws = K.quantize_convrot_weight(torch.randn(24, 128, generator=g), 64)
    bias = torch.randn(24, generator=g).bfloat16()
    out = LINEAR_CODES(q, s, wq, ws, bias, torch.bfloat16)
    assert out.shape == (10, 24) and out.dtype == torch.bfloat16
    assert torch.equal(out.view(2, 5, 24), LINEAR(y, q, s, wq, ws, bias, 64, "bf16"))
    # the products with the step after them: the gated residual, the head norm + RoPE
    residual, gate = torch.randn(2, 5, 24, generator=g).bfloat16(), torch.randn(2, 24, generator=g).bfloat16()
    plain = LINEAR(y, q, s, wq, ws, None, 64, "bf16")
    got = OPS.convrot_int8_linear_gated_residual(q, s, wq, ws, residual, gate)
    assert torch.equal(got, residual + gate[:, None] * plain)
    hw = (1 + 0.1 * torch.randn(8, generator=g)).bfloat16()
    cos, sin = RopeTables((4, 2, 2), 10000.0).cos_sin([2], 5, 1, 3, torch.device("cpu"))
    cos, sin = cos[:, :5], sin[:, :5]
    got = OPS.convrot_int8_linear_norm_rope(q, s, wq, ws, hw, cos, sin, 1e-6, 5, torch.bfloat16)
    assert got.shape == (2, 5, 3, 8)
    assert torch.equal(got, OPS.fused_norm_rope(plain.view(2, 5, 3, 8), hw, cos, sin, 1e-6))
    for op, args in ((OPS.fused_norm_modulate_codes, (x, w, shift, scale, 1e-6, 64)),
                     (OPS.fused_residual_norm_modulate_codes, (x, gate1, r, w, shift, scale, 1e-6, 64)),
                     (OPS.fused_swiglu_codes, (u, 64)), (LINEAR_CODES, (q, s, wq, ws, bias, torch.bfloat16)),
                     (OPS.convrot_int8_linear_gated_residual, (q, s, wq, ws, residual, gate)),
                     (OPS.convrot_int8_linear_norm_rope, (q, s, wq, ws, hw, cos, sin, 1e-6, 5, torch.bfloat16))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_stacked_q_k_and_v_are_one_product_of_the_same_bits():
    """With q, k and v stacked (`BlockProjections.stack_qkv`), a block compiled without gradients runs one int8
    product for the three (three with `inference_stacked_qkv` off, or `inference_epilogues` on), to the same bits;
    the stack costs no memory (q, k and v are its views) and leaves the state dict as it was."""
    blk = _int8_block()
    state = {k: v.clone() for k, v in blk.state_dict().items()}
    three, three_ops = _recorded_forward(blk, norm_modulate=True)
    assert blk.proj.stack_qkv() and blk.proj.check_qkv_stack()
    assert blk.proj.q.weight.untyped_storage().data_ptr() == blk.proj.qkv_weight.untyped_storage().data_ptr()
    assert blk.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in blk.state_dict().items())
    one, ops = _recorded_forward(blk, norm_modulate=True)
    assert ops["convrot_int8_linear_codes"] == three_ops["convrot_int8_linear_codes"] - 2, (ops, three_ops)
    assert torch.equal(one, three)
    _, off = _recorded_forward(blk, norm_modulate=True, inference_stacked_qkv=False)
    assert off == three_ops
    out, epi = _recorded_forward(blk, norm_modulate=True, inference_epilogues=True)
    assert epi["convrot_int8_linear_norm_rope"] == 2 and torch.equal(out, one)


def test_by_default_the_products_are_written_and_their_steps_run_after_them():
    """`inference_epilogues` off (the default): the inputs stay codes, the products are written and the steps run
    after them, to the same bits."""
    blk = _int8_block()
    out, ops = _recorded_forward(blk, norm_modulate=True)
    assert ops == {"fused_norm_modulate_codes": 1, "fused_residual_norm_modulate_codes": 1, "fused_swiglu_codes": 1,
                   "convrot_int8_linear_codes": 5, "fused_norm_rope": 2, "convrot_int8_quantize": 1,
                   "convrot_int8_linear": 1}, ops
    assert torch.equal(out, _recorded_forward(blk, norm_modulate=True, inference_epilogues=True)[0])


def test_the_attention_residual_and_the_ffn_input_codes_are_one_op_of_the_same_bits():
    """The attention branch's gated residual and the second norm's codes: one op by default, two with
    `inference_residual_codes` off, to the same bits; the residual stays separate where the FFN's Linear reads
    more than codes (a hook)."""
    blk = _int8_block()
    out, ops = _recorded_forward(blk, norm_modulate=True)
    two, two_ops = _recorded_forward(blk, norm_modulate=True, inference_residual_codes=False)
    assert ops["fused_residual_norm_modulate_codes"] == 1 and ops["fused_norm_modulate_codes"] == 1, ops
    assert "fused_residual_norm_modulate_codes" not in two_ops and two_ops["fused_norm_modulate_codes"] == 2
    assert torch.equal(out, two)
    handle = blk.proj.ffn_up_gate.register_forward_hook(lambda *args: None)
    try:
        _, hooked = _recorded_forward(blk, norm_modulate=True)
    finally:
        handle.remove()
    assert "fused_residual_norm_modulate_codes" not in hooked and hooked["fused_norm_modulate_codes"] == 1, hooked
