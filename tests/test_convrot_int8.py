"""ConvRot INT8 on the CPU: bit-exactness against comfy-kitchen's eager backend (the oracle), the modules, the
ComfyUI file layout in both directions, autograd for a frozen base under a LoRA, and the error messages."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from library.errors import UserError
from library.quant import convrot as U
from library.quant import convrot_kernels as K

ck = pytest.importorskip("comfy_kitchen")
from comfy_kitchen.tensor.base import QuantizedTensor
from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
from comfy_kitchen.tensor.int8_utils import _build_hadamard

OPS = torch.ops.comfy_kitchen
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(autouse=True)
def _eager_oracle():
    torch.manual_seed(0)
    with ck.registry.use_backend("eager"):
        yield


def _weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    w = torch.randn(n, k) * 0.05
    w[3, 17] = 0.9  # an outlier row
    return w.to(dtype)


def _oracle_layer(w: torch.Tensor, g: int) -> QuantizedTensor:
    q, params = TensorWiseINT8Layout.quantize(w, is_weight=True, per_channel=True, convrot=True, convrot_groupsize=g)
    return QuantizedTensor(q, "TensorWiseINT8Layout", params)


# ----------------------------------------------------------------------------------------------------------------
# Rotation and quantisation
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("g", [4, 16, 64, 256])
def test_hadamard_equals_oracle_and_is_orthogonal(g):
    h = K.hadamard(g)
    assert torch.equal(h, _build_hadamard(g))
    assert torch.equal(h, h.t())
    torch.testing.assert_close(h @ h, torch.eye(g), atol=1e-6, rtol=0)


@pytest.mark.parametrize("g", [0, 2, 3, 8, 32, 128, 512])
def test_hadamard_rejects_non_powers_of_4(g):
    with pytest.raises(ValueError, match="power of 4"):
        K.hadamard(g)


def test_group_must_divide_features():
    with pytest.raises(ValueError, match="does not divide"):
        K.quantize_convrot_weight(torch.randn(8, 250), 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("g", [256, 64])
def test_weight_quantisation_is_bit_exact(dtype, g):
    w = _weight(96, 768, dtype)
    q_ref, s_ref = OPS.quantize_int8_convrot_weight(w, g)
    q, s = K.quantize_convrot_weight(w, g, recipe="eager")
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (96, 1)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    # the fp32 recipe is the oracle applied to the fp32 weights
    q32_ref, s32_ref = OPS.quantize_int8_convrot_weight(w.float(), g)
    q32, s32 = K.quantize_convrot_weight(w, g, recipe="fp32")
    assert torch.equal(q32, q32_ref) and torch.equal(s32, s32_ref)
    # the layout class gives the same codes
    q_l, params = TensorWiseINT8Layout.quantize(w, is_weight=True, per_channel=True, convrot=True, convrot_groupsize=g)
    assert torch.equal(q, q_l) and torch.equal(s, params.scale)


def test_row_chunked_quantisation_is_identical():
    w = _weight(100, 256, torch.bfloat16)
    for recipe in K.WEIGHT_RECIPES:
        q1, s1 = K.quantize_convrot_weight(w, 64, recipe)
        q2, s2 = K.quantize_convrot_weight(w, 64, recipe, row_chunk=7)
        assert torch.equal(q1, q2) and torch.equal(s1, s2)


def test_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="recipe"):
        K.quantize_convrot_weight(torch.randn(4, 16), 16, recipe="fp64")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantisation_is_bit_exact(dtype):
    q, s = K.quantize_convrot_weight(_weight(64, 512, torch.bfloat16), 256)
    ref = OPS.dequantize_int8_convrot_weight_dtype(q, s, 256, DTYPE_CODE[dtype])
    out = K.dequantize_weight(q, s, 256, dtype)
    assert out.dtype == dtype and torch.equal(out, ref)
    assert torch.equal(K.dequantize_weight(q, s, 256), OPS.dequantize_int8_convrot_weight(q, s, 256))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_is_bit_exact(x_dtype, with_bias):
    w = _weight(80, 768, torch.bfloat16)
    qt = _oracle_layer(w, 256)
    q, s = qt._qdata, qt._params.scale
    x = (torch.randn(2, 5, 768) * 3).to(x_dtype)
    bias = torch.randn(80).to(torch.bfloat16) if with_bias else None
    ref = ck.int8_linear(x, q, s, bias, x_dtype, convrot=True, convrot_groupsize=256)
    out = K.int8_linear(x, q, s, bias, 256)
    assert out.dtype == x_dtype and out.shape == (2, 5, 80)
    assert torch.equal(out, ref)
    assert torch.equal(out, nn.functional.linear(x, qt, bias))


def test_int8_mm_is_exact_for_awkward_shapes():
    for m, k, n in [(1, 5, 3), (7, 24, 9), (33, 100, 17)]:
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8)
        b = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        assert torch.equal(K.int8_mm(a, b).long(), a.long() @ b.long().t())


def test_embedding_lookup_is_bit_exact():
    table = nn.Embedding(300, 512).to(torch.bfloat16)
    emb = U.ConvRotInt8Embedding.from_embedding(table, 256, row_chunk=64)
    q_ref, s_ref = OPS.quantize_int8_convrot_weight(table.weight.detach().float(), 256)
    assert torch.equal(emb.weight, q_ref) and torch.equal(emb.weight_scale, s_ref)
    idx = torch.tensor([[0, 5, 299], [17, 17, 42]])
    ref = OPS.dequantize_int8_embedding(emb.weight, emb.weight_scale, idx, 256, DTYPE_CODE[torch.bfloat16])
    out = emb(idx)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 512)
    assert torch.equal(out, ref)
    full = OPS.dequantize_int8_convrot_weight_dtype(emb.weight, emb.weight_scale, 256, 2)
    assert torch.equal(out, full[idx])


# ----------------------------------------------------------------------------------------------------------------
# Modules, autograd, dtype handling
# ----------------------------------------------------------------------------------------------------------------
class _Lora(nn.Module):
    def __init__(self, base: nn.Module, k: int, n: int, rank: int = 4):
        super().__init__()
        self.base = base
        self.down = nn.Linear(k, rank, bias=False)
        self.up = nn.Linear(rank, n, bias=False)
        nn.init.normal_(self.up.weight, std=0.1)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def test_lora_gradients_are_exact_and_grad_x_is_right():
    lin = nn.Linear(512, 96)
    base = U.ConvRotInt8Linear.from_linear(lin, 256)
    ref_base = nn.Linear(512, 96)
    ref_base.weight.data = base.dequantized_weight(torch.float32)
    ref_base.bias.data = base.bias.detach().clone()
    ref_base.requires_grad_(False)
    model, ref = _Lora(base, 512, 96), _Lora(ref_base, 512, 96)
    ref.down.load_state_dict(model.down.state_dict())
    ref.up.load_state_dict(model.up.state_dict())
    x = torch.randn(3, 7, 512)
    c = torch.randn(3, 7, 96)  # a linear loss: the upstream gradient does not depend on the base's output
    xs = []
    for m in (model, ref):
        xi = x.clone().requires_grad_(True)
        (m(xi) * c).sum().backward()
        xs.append(xi)
    assert torch.equal(model.down.weight.grad, ref.down.weight.grad)
    assert torch.equal(model.up.weight.grad, ref.up.weight.grad)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6)
    assert not any(p.requires_grad for p in base.parameters())
    assert base.weight.grad is None and base.bias.grad is None

    # int8 backward: quantised, but close
    base.bwd = "int8"
    xi = x.clone().requires_grad_(True)
    (model(xi) * c).sum().backward()
    err = (xi.grad - xs[1].grad).norm() / xs[1].grad.norm()
    assert err < 2e-2


def test_trainable_bias_gets_its_gradient():
    base = U.ConvRotInt8Linear.from_linear(nn.Linear(64, 8), 64)
    base.bias.requires_grad_(True)
    y = base(torch.randn(5, 64))
    y.sum().backward()
    torch.testing.assert_close(base.bias.grad, torch.full((8,), 5.0))


def test_output_dtype_follows_input_and_autocast():
    base = U.ConvRotInt8Linear.from_linear(nn.Linear(256, 16).to(torch.bfloat16), 256)
    assert base(torch.randn(2, 256)).dtype == torch.float32
    assert base(torch.randn(2, 256, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert base(torch.randn(2, 256)).dtype == torch.bfloat16


def test_autocast_changes_only_the_input_dtype():
    """Under autocast the layer casts its input and then runs its own numerics: the exact int8 sums and the fp32
    rotations must not be turned into bf16 matmuls by the enclosing autocast (forward, backward, full precision)."""
    base = U.ConvRotInt8Linear.from_linear(nn.Linear(512, 48), 256)
    x = torch.randn(3, 512) * 2
    expected = base(x.to(torch.bfloat16))
    xi = x.to(torch.bfloat16).requires_grad_(True)
    base(xi).float().pow(2).sum().backward()
    xa = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = base(xa)
        y.float().pow(2).sum().backward()
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
    torch.testing.assert_close(xa.grad, xi.grad.float(), rtol=0, atol=0)
    base.full_precision = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w = base.dequantized_weight(torch.float32)
    assert torch.equal(w, K.dequantize_weight(base.weight, base.weight_scale, 256))


def test_to_dtype_keeps_int8_weights_and_fp32_scales():
    model = nn.Sequential(nn.Linear(256, 32), nn.Embedding(10, 256))
    U.convert_model_to_convrot_int8(model, lambda n: True, group_size=256)
    lin, emb = model[0], model[1]
    scale_before, codes_before = lin.weight_scale.clone(), lin.weight.clone()
    model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)  # init code is harmless
    assert torch.equal(lin.weight, codes_before)
    for convert in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.float16)):
        convert(model)
        assert lin.weight.dtype == torch.int8 and emb.weight.dtype == torch.int8
        assert lin.weight_scale.dtype == torch.float32 and emb.weight_scale.dtype == torch.float32
        assert torch.equal(lin.weight_scale, scale_before)
    assert lin.bias.dtype == torch.float16
    assert emb.compute_dtype == torch.float16 and emb(torch.tensor([1, 2])).dtype == torch.float16
    model.float()
    assert emb.compute_dtype == torch.float32 and lin.weight_scale.dtype == torch.float32


def test_regression_seed004_activations_never_cast_to_int8():
    """Seed 004: a block cast its activations to `proj.q.weight.dtype`, which is int8 under ConvRot, and rounded
    them to integers. The int8 layer now refuses an integer input; the fixed pattern (the norm weight's dtype) works."""

    class Block(nn.Module):
        def __init__(self, buggy: bool):
            super().__init__()
            self.buggy = buggy
            self.norm = nn.RMSNorm(256)
            self.q = nn.Linear(256, 32)

        def forward(self, x):
            dtype = self.q.weight.dtype if self.buggy else self.norm.weight.dtype
            return self.q(self.norm(x).to(dtype))

    x = torch.randn(4, 256) * 0.3
    fixed, ref = Block(False), Block(False)
    ref.load_state_dict(fixed.state_dict())
    U.convert_model_to_convrot_int8(fixed, lambda n: n == "q", group_size=256)
    buggy = Block(True)
    buggy.load_state_dict(fixed.state_dict(), strict=False)
    buggy.q = fixed.q
    with pytest.raises(TypeError, match="never be cast"):
        buggy(x)
    y, y_ref = fixed(x), ref(x)
    assert y.dtype == torch.float32
    assert ((y - y_ref).norm() / y_ref.norm()) < 0.02


def test_full_precision_layer_dequantises():
    lin = U.ConvRotInt8Linear.from_linear(nn.Linear(256, 8), 64)
    lin.full_precision = True
    x = torch.randn(3, 256)
    torch.testing.assert_close(lin(x), nn.functional.linear(x, lin.dequantized_weight(), lin.bias))


def test_invalid_backward_mode_is_a_user_error():
    with pytest.raises(UserError, match="convrot_int8_bwd"):
        U.convert_model_to_convrot_int8(nn.Sequential(nn.Linear(64, 4)), lambda n: True, 64, bwd="fp8")


# ----------------------------------------------------------------------------------------------------------------
# Conversion and scopes
# ----------------------------------------------------------------------------------------------------------------
class _TinyDiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.x_embedder = nn.Linear(256, 256)
        block = lambda: nn.ModuleDict(
            {"proj": nn.ModuleDict({n: nn.Linear(256, 256) for n in ("q", "k", "v", "o")}),
             "ffn_up_gate": nn.Linear(256, 512), "ffn_down": nn.Linear(256, 256), "odd": nn.Linear(100, 256)}
        )
        self.layers = nn.ModuleList([block(), block()])
        self.final_layer = nn.Linear(256, 64)


def test_convert_streams_layer_by_layer_and_respects_the_filter():
    model = _TinyDiT().to(torch.bfloat16)
    ref = _TinyDiT().to(torch.bfloat16)
    ref.load_state_dict(model.state_dict())
    old = model.layers[0]["proj"]["q"]
    filt = lambda n: U.dit_convrot_filter(n) or n.endswith(".odd")
    count = U.convert_model_to_convrot_int8(model, filt, calc_device="cpu", group_size=64)
    assert count == 2 * 6
    assert old.weight is None  # the float weight was dropped
    assert isinstance(model.layers[1]["ffn_down"], U.ConvRotInt8Linear)
    assert type(model.layers[0]["odd"]) is nn.Linear  # 100 is not a multiple of 64
    assert type(model.final_layer) is nn.Linear and type(model.x_embedder) is nn.Linear
    assert U.is_convrot_int8_model(model) and not U.is_convrot_int8_model(ref)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y, y_ref = model.layers[0]["ffn_up_gate"](x).float(), ref.layers[0]["ffn_up_gate"](x).float()
    assert ((y - y_ref).norm() / y_ref.norm()) < 0.02


def test_dit_filter():
    yes = ["layers.0.proj.q", "layers.41.proj.o", "layers.3.proj.ffn_up_gate", "layers.3.ffn_down",
           "layers.2.proj.qkv", "model.diffusion_model.layers.7.proj.k"]
    no = ["text_embedder.blocks.0.proj.q", "text_embedder.proj", "final_layer.linear", "modulation",
          "layers.0.norm1", "t_embedder.mlp.0", "x_embedder", "layers.0.proj", "refiner.layers.0.proj.q"]
    assert all(U.dit_convrot_filter(n) for n in yes)
    assert not any(U.dit_convrot_filter(n) for n in no)


def test_text_encoder_filter():
    yes = ["layers.0.self_attn.q_proj", "layers.3.self_attn.o_proj", "layers.0.linear_attn.in_proj_qkv",
           "layers.0.linear_attn.in_proj_z", "layers.0.linear_attn.out_proj", "layers.31.mlp.down_proj",
           "model.language_model.layers.5.mlp.gate_proj", "embed_tokens", "model.language_model.embed_tokens"]
    no = ["layers.0.linear_attn.in_proj_a", "layers.0.linear_attn.in_proj_b", "lm_head", "norm",
          "model.visual.blocks.0.attn.qkv", "visual.blocks.0.mlp.linear_fc1", "mtp.layers.0.mlp.up_proj",
          "layers.0.input_layernorm", "layers.0.linear_attn.conv1d"]
    assert all(U.text_encoder_convrot_filter(n) for n in yes)
    assert not any(U.text_encoder_convrot_filter(n) for n in no)


# ----------------------------------------------------------------------------------------------------------------
# ComfyUI files, both directions
# ----------------------------------------------------------------------------------------------------------------
def _save_load(tmp_path, tensors, metadata=None):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    from library.files.safetensors_io import read_metadata

    return load_file(str(path)), read_metadata(path)


def test_marker_is_the_comfyui_json():
    marker = U.comfy_quant_tensor(U.comfy_quant_spec(256))
    text = bytes(marker.tolist()).decode()
    assert text == '{"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}' and len(text) == 72


def test_our_files_load_through_comfy_kitchen(tmp_path):
    model = nn.Sequential(nn.Linear(512, 48)).to(torch.bfloat16)
    U.convert_model_to_convrot_int8(model, lambda n: True, group_size=256, recipe="eager")
    sd, _ = _save_load(tmp_path, model.state_dict())
    assert set(sd) == {"0.weight", "0.weight_scale", "0.comfy_quant", "0.bias"}
    spec = json.loads(bytes(sd["0.comfy_quant"].tolist()))
    params = TensorWiseINT8Layout.Params(
        scale=sd["0.weight_scale"], orig_dtype=torch.bfloat16, orig_shape=(48, 512),
        convrot=spec["convrot"], convrot_groupsize=spec["convrot_groupsize"],
    )
    qt = QuantizedTensor(sd["0.weight"], "TensorWiseINT8Layout", params)
    x = torch.randn(6, 512, dtype=torch.bfloat16)
    assert torch.equal(nn.functional.linear(x, qt, sd["0.bias"]), model(x))
    assert torch.equal(qt.dequantize(), model[0].dequantized_weight(torch.bfloat16))


class _Attn(nn.Module):
    def __init__(self, k: int = 512, n: int = 64):
        super().__init__()
        self.proj = nn.ModuleDict({name: nn.Linear(k, n) for name in ("q", "k", "v", "o")})
        self.norm = nn.RMSNorm(k)


def _comfy_layer(prefix: str, w: torch.Tensor, g: int, out: dict) -> QuantizedTensor:
    qt = _oracle_layer(w, g)
    out.update(qt.state_dict(prefix + ".weight"))
    out[prefix + ".comfy_quant"] = torch.tensor(
        list(json.dumps({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": g}).encode()),
        dtype=torch.uint8,
    )
    return qt


def test_comfy_files_load_in_ours_with_fused_qkv(tmp_path):
    w = {n: _weight(64, 512, torch.bfloat16) for n in ("q", "k", "v", "o")}
    b = {n: torch.randn(64).to(torch.bfloat16) for n in w}
    tensors: dict[str, torch.Tensor] = {"blk.norm.weight": torch.ones(512, dtype=torch.bfloat16)}
    qkv = _comfy_layer("blk.proj.qkv", torch.cat([w["q"], w["k"], w["v"]]), 256, tensors)
    tensors["blk.proj.qkv.bias"] = torch.cat([b["q"], b["k"], b["v"]])
    qo = _comfy_layer("blk.proj.o", w["o"], 64, tensors)
    tensors["blk.proj.o.weight_scale"] = tensors["blk.proj.o.weight_scale"].reshape(-1)  # [N] is accepted too
    tensors["blk.proj.o.bias"] = b["o"]
    attention_pref = list(b'{"attention": "comfy_kitchen_int8"}')
    tensors["blk.comfy_attention.config"] = torch.tensor(attention_pref, dtype=torch.uint8)
    sd, _ = _save_load(tmp_path, tensors)
    assert U.is_comfy_quantized_state_dict(sd.keys())

    assert U.split_fused_int8_qkv_state_dict(sd) == 1
    model = nn.ModuleDict({"blk": _Attn()}).to(torch.bfloat16)
    assert U.load_comfy_int8_state_dict(model, sd) == 4
    x = torch.randn(5, 512, dtype=torch.bfloat16)
    ref_qkv = nn.functional.linear(x, qkv, tensors["blk.proj.qkv.bias"])
    ours = torch.cat([model["blk"].proj[n](x) for n in ("q", "k", "v")], dim=-1)
    assert torch.equal(ours, ref_qkv)  # rows are independent: the split layers are the fused one
    assert torch.equal(model["blk"].proj["o"](x), nn.functional.linear(x, qo, b["o"]))
    assert model["blk"].proj["o"].group_size == 64 and model["blk"].proj["q"].group_size == 256


def test_file_level_quantization_metadata(tmp_path):
    tensors: dict[str, torch.Tensor] = {}
    qt = _comfy_layer("0", _weight(32, 256, torch.bfloat16), 256, tensors)
    del tensors["0.comfy_quant"]
    tensors["0.weight_scale"] = tensors["0.weight_scale"][:1].reshape(())  # a tensor-wise scale
    meta = {"_quantization_metadata": json.dumps(
        {"format_version": "1.0", "layers": {"0": {"format": "int8_tensorwise", "params": {"convrot": True}}}})}
    sd, read_meta = _save_load(tmp_path, tensors, meta)
    assert U.is_comfy_quantized_state_dict(sd.keys(), read_meta)
    model = nn.Sequential(nn.Linear(256, 32, bias=False)).to(torch.bfloat16)
    assert U.load_comfy_int8_state_dict(model, sd, read_meta) == 1
    assert model[0].group_size == 256 and model[0].weight_scale.shape == (32, 1)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    scalar = qt._params.scale[:1].reshape(())
    ref = ck.int8_linear(x, qt._qdata, scalar, None, torch.bfloat16, convrot=True, convrot_groupsize=256)
    assert torch.equal(model(x), ref)


@pytest.mark.parametrize("shape", [(24, 1), (24,), (1,), ()])
def test_all_scale_shapes_load(shape):
    q, s = K.quantize_convrot_weight(_weight(24, 256, torch.float32), 256)
    s = s if shape in ((24, 1), (24,)) else s[:1]
    mod = U.ConvRotInt8Linear(256, 24, bias=False, group_size=256)
    mod.load_state_dict({"weight": q, "weight_scale": s.reshape(shape)})
    assert mod.weight_scale.shape == (24, 1) and mod.weight_scale.dtype == torch.float32
    x = torch.randn(2, 256)
    assert torch.equal(mod(x), K.int8_linear_eager(x, q, s.reshape(shape), None, 256))


def test_split_fused_qkv_equals_separate_quantisation():
    parts = [_weight(n, 256, torch.bfloat16) for n in (32, 16, 16)]
    q, s = K.quantize_convrot_weight(torch.cat(parts), 256)
    for (qi, si), w in zip(U.split_fused_int8_qkv(q, s, (32, 16, 16)), parts):
        q_ref, s_ref = K.quantize_convrot_weight(w, 256)
        assert torch.equal(qi, q_ref) and torch.equal(si, s_ref)
    with pytest.raises(UserError, match="expected 60"):
        U.split_fused_int8_qkv(q, s, (32, 16, 12))


# ----------------------------------------------------------------------------------------------------------------
# Formats we refuse
# ----------------------------------------------------------------------------------------------------------------
def _marker(spec: dict) -> torch.Tensor:
    return U.comfy_quant_tensor(spec)


@pytest.mark.parametrize(
    "tensors, needle",
    [
        ({"a.weight": torch.zeros(4, 2, dtype=torch.int8), "a.comfy_quant": _marker({"format": "asym_w4a8_int8"})},
         "W4A8"),
        ({"a.weight": torch.zeros(4, 2, dtype=torch.int8), "a.weight_s_rel": torch.zeros(4, 1)}, "W4A8"),
        ({"a.weight_codebook": torch.zeros(16)}, "W4A8"),
        ({"a.qweight": torch.zeros(4, 2, dtype=torch.int32), "a.qzeros": torch.zeros(1, dtype=torch.int32)}, "GPTQ"),
        ({"a.g_idx": torch.zeros(4, dtype=torch.int32)}, "GPTQ"),
        ({"a.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
          "a.comfy_quant": _marker({"format": "float8_e4m3fn"})}, "fp8"),
        ({"a.weight": torch.zeros(4, 2, dtype=torch.uint8), "a.comfy_quant": _marker({"format": "nvfp4"})}, "NVFP4"),
        ({"a.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}, "float8"),
        ({"scaled_fp8": torch.zeros(1), "a.weight": torch.zeros(4, 4)}, "scaled-fp8"),
        ({"a.weight": torch.zeros(4, 4, dtype=torch.int8), "a.weight_scale": torch.ones(4, 1)},
         "without a quantization marker"),
        ({"a.weight": torch.zeros(4, 8, dtype=torch.int8),
          "a.comfy_quant": _marker({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 128})},
         "not a power of 4"),
    ],
)
def test_unsupported_formats_are_user_errors(tensors, needle):
    with pytest.raises(UserError, match=needle) as info:
        U.check_quantization_format(tensors, what="'x.safetensors'")
    message = str(info.value)
    assert "'x.safetensors'" in message or "x.safetensors" in message
    assert "bf16" in message  # every message says what to do


def test_plain_and_int8_files_pass_the_check():
    U.check_quantization_format({"a.weight": torch.zeros(4, 4, dtype=torch.bfloat16)})
    tensors = {"a.weight": torch.zeros(4, 256, dtype=torch.int8), "a.weight_scale": torch.ones(4, 1),
               "a.comfy_quant": _marker(U.comfy_quant_spec(256)), "b.weight": torch.zeros(4, 4)}
    U.check_quantization_format(tensors)
    assert U.is_comfy_quantized_state_dict(tensors) and not U.is_comfy_quantized_state_dict(["a.weight"])
    assert U.comfy_int8_layer_specs(tensors) == {"a": U.ComfyInt8LayerSpec(256, False)}


def test_damaged_marker_is_a_user_error():
    with pytest.raises(UserError, match="not UTF-8 JSON"):
        U.parse_comfy_quant(torch.tensor([0xFF, 0x00], dtype=torch.uint8), where="'a.comfy_quant'")
