"""A CFG step's two passes as one pass over packed sequences (`library.moss_image.cfg_packing`): attention within
each part, the same latents as two passes (bit for bit on the CPU, eager and compiled, bf16-free fp32 and ConvRot
INT8), the codes of the packed attention output written in place, and the cases where packing does not apply."""

from __future__ import annotations

import collections

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from library.moss_image import cfg_packing
from library.moss_image.cfg_packing import set_cfg_packing
from library.moss_image.dit import MossImageBlock, MossImageConfig
from library.moss_image.loaders import load_moss_image_model
from library.moss_image.rope import RopeTables
from library.runtime.attention import Attention
from library.runtime.fused_compiled import compiled_kernels
from library.sampling.sampler import sample

CFG = MossImageConfig(hidden_size=256, num_heads=2, head_dim=128, ffn_hidden=512)


@pytest.fixture
def packing():
    """Restores the packing setting after a test that changes it."""
    previous = set_cfg_packing(True)
    yield set_cfg_packing
    set_cfg_packing(previous)


def test_packed_sequences_attend_each_within_itself():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 11, 2, 16, generator=g) for _ in range(3))
    attention = Attention()
    packed = attention(q, k, v, (7, 4))
    alone = torch.cat([attention(q[:, :7], k[:, :7], v[:, :7], None), attention(q[:, 7:], k[:, 7:], v[:, 7:], None)],
                      dim=1)
    assert torch.equal(packed, alone)
    assert not torch.allclose(packed, attention(q, k, v, None))  # not the attention over the whole sequence
    with pytest.raises(ValueError, match="do not add up"):
        attention(q, k, v, (7, 5))


def _tiny_inputs(dit, cond_tokens: int = 7, uncond_tokens: int = 3):
    g = torch.Generator().manual_seed(0)
    dim = dit.config.text_dim
    return (torch.randn(1, 128, 4, 6, generator=g), torch.randn(1, cond_tokens, dim, generator=g),
            torch.randn(1, uncond_tokens, dim, generator=g))


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "convrot_int8"])
def test_the_packed_pass_gives_the_latents_of_two_passes(tiny_snapshot, packing, packed_passes, int8):
    """The sampler's CFG steps as one packed pass each (the unconditional part skipping its layer) give the two
    passes' latents bit for bit on the CPU."""
    dit = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32, convrot_int8=int8).eval()
    noise, cond, uncond = _tiny_inputs(dit)
    two = None
    for on in (False, True):
        packing(on)
        out = sample(dit, noise, cond, None, uncond, None, steps=3, uncond_skip_layers="1")
        two = out if two is None else two
    assert packed_passes["n"] == 3
    assert torch.equal(out, two)


def test_packing_applies_only_to_unpadded_guided_passes(tiny_snapshot, packing, packed_passes):
    dit = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32).eval()
    noise, cond, uncond = _tiny_inputs(dit)
    sample(dit, noise, cond, None, uncond, None, steps=2, guidance_scale=1.0)  # one pass a step: nothing to pack
    mask = torch.ones(1, 3, dtype=torch.bool)
    mask[0, 2] = False  # a padded negative prompt: its attention needs the mask
    sample(dit, noise, cond, None, uncond, mask, steps=2)
    assert packed_passes["n"] == 0
    sample(dit, noise, cond, None, uncond, None, steps=2)
    assert packed_passes["n"] == 2
    prepared = [dit.prepare_text(e, None, (4, 6)) for e in (cond, uncond)]
    assert dit.pack_texts(prepared).segments == (7 + 24, 3 + 24)
    assert dit.pack_texts([prepared[0], dit.prepare_text(uncond, None, (4, 4))]) is None  # another latent size
    packing(False)
    assert dit.pack_texts(prepared) is None


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "convrot_int8"])
def test_compiled_regions_give_the_same_latents_packed(tiny_snapshot, packing, int8):
    """The DiT's compiled regions (aot_eager, the compiled kernels' torch forms on the CPU): packed passes give the
    two passes' latents; ConvRot INT8 with q, k and v stacked, the inference codes path and the packed attention
    output's codes written in place."""
    dit = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32, convrot_int8=int8).eval()
    if int8:
        assert dit.stack_qkv_weights() == len(dit.layers)
    noise, cond, uncond = _tiny_inputs(dit)
    torch._dynamo.reset()
    try:
        with compiled_kernels(cpu=True):
            dit.compile_regions(backend="aot_eager", fullgraph=True)
            outs = []
            for on in (False, True):
                packing(on)
                with torch.inference_mode():
                    outs.append(sample(dit, noise, cond, None, uncond, None, steps=2, uncond_skip_layers="1"))
    finally:
        torch._dynamo.reset()
    assert torch.equal(outs[0], outs[1])


def _int8_block() -> MossImageBlock:
    from library.quant.convrot import convert_model_to_convrot_int8

    torch.manual_seed(0)
    blk = MossImageBlock(CFG, True, Attention())
    with torch.no_grad():
        blk.scale_shift_table.normal_(0, 0.2)
    convert_model_to_convrot_int8(blk, lambda name: name.startswith("proj."), group_size=64)
    blk.requires_grad_(False)
    blk.proj.stack_qkv()
    return blk.to(torch.bfloat16)


def _compiled_block(blk: MossImageBlock, *args: object) -> tuple[torch.Tensor, collections.Counter]:
    """The block compiled with fullgraph=True under inference mode (aot graphs run as recorded): its output and the
    moss_image ops of its graph."""
    ops: collections.Counter = collections.Counter()

    def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        ops.update(str(n.target).removeprefix("moss_image.").removesuffix(".default") for n in gm.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("moss_image."))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    try:
        with compiled_kernels(cpu=True), torch.inference_mode():
            out = torch.compile(blk, backend=aot_autograd(fw_compiler=compiler), fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()
    return out, ops


def test_a_packed_int8_block_writes_the_attention_codes_in_place():
    """A compiled ConvRot INT8 block over two packed sequences: `o`'s input codes come from one
    `convrot_int8_quantize_segments` (each part's attention output quantised into the one buffer, nothing
    concatenated) and the output is the two blocks' outputs, bit for bit."""
    blk = _int8_block()
    g = torch.Generator().manual_seed(2)
    rope = RopeTables(CFG.rope_axes_dims, CFG.rope_theta)
    tables = [rope.cos_sin([n], n, 4, 6, torch.device("cpu")) for n in (5, 3)]
    xs = [torch.randn(1, n + 24, CFG.hidden_size, generator=g).bfloat16() for n in (5, 3)]
    mod = (torch.randn(1, 6, CFG.hidden_size, generator=g) * 0.3).bfloat16()
    alone = [_compiled_block(blk, x, cos, sin, None, mod)[0] for x, (cos, sin) in zip(xs, tables)]
    cos = torch.cat([t[0] for t in tables], dim=1)
    sin = torch.cat([t[1] for t in tables], dim=1)
    packed, ops = _compiled_block(blk, torch.cat(xs, dim=1), cos, sin, (29, 27), mod)
    assert ops["convrot_int8_quantize_segments"] == 1 and "convrot_int8_quantize" not in ops, ops
    assert torch.equal(packed, torch.cat(alone, dim=1))


def test_the_packed_forward_checks_its_inputs(tiny_snapshot):
    dit = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32).eval()
    noise, cond, uncond = _tiny_inputs(dit)
    packed = dit.pack_texts([dit.prepare_text(e, None, (4, 6)) for e in (cond, uncond)])
    t = torch.full((1,), 500.0)
    with torch.no_grad():
        with pytest.raises(ValueError, match="prepared for latents"):
            dit.forward_packed(noise[..., :4], t, packed, ((), ()))
        with pytest.raises(ValueError, match="skip lists"):
            dit.forward_packed(noise, t, packed, ((),))
        v_cond, v_uncond = dit.forward_packed(noise, t, packed, ((), ()))
        assert torch.equal(v_cond, dit(noise, t, cond))
        assert torch.equal(v_uncond, dit(noise, t, uncond))
    assert cfg_packing.cfg_packing_on()
