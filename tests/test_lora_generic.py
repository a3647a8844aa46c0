"""networks.lora_generic: module selection, network_args, forward math, dropout, optimizer groups, save/load, merge."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

from library.errors import UserError
from networks import lora_generic
from networks.lora_generic import LoRAModule, create_network, create_network_from_weights
from tests.moss_lora_fakes import FakeInt8Linear, MossImage, quantize_blocks, tiny_qwen35

BLOCK_LINEARS = ("q", "k", "v", "o", "ffn_up_gate", "ffn_down")


@pytest.fixture(scope="module")
def qwen() -> nn.Module:
    torch.manual_seed(0)
    return tiny_qwen35()


def dit(seed: int = 0, **kw) -> MossImage:
    torch.manual_seed(seed)
    return MossImage(**kw)


def names(loras) -> list[str]:
    return sorted(lora.original_name for lora in loras)


def randomize(network: lora_generic.LoRANetwork, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


# ----------------------------------------------------------------------------------------------------------------------
# selection


def test_default_dit_targets_are_the_block_linears():
    model = dit()
    net = create_network(1.0, None, None, None, None, model)
    expected = sorted(f"layers.{i}.proj.{n}" for i in range(3) for n in BLOCK_LINEARS)
    assert names(net.unet_loras) == expected
    assert net.text_encoder_loras == []
    assert all(lora.lora_dim == 4 and float(lora.alpha) == 1.0 for lora in net.unet_loras)
    keys = set(net.state_dict())
    assert "lora_unet_layers_0_proj_q.lora_down.weight" in keys
    assert "lora_unet_layers_2_proj_ffn_up_gate.lora_up.weight" in keys
    assert "lora_unet_layers_1_proj_ffn_down.alpha" in keys
    assert len(keys) == 3 * len(expected)


@pytest.mark.parametrize("flag", ["train_text_embedder", "train_llm_adapter"])
def test_text_embedder_only_on_request(flag):
    model = dit()
    net = create_network(1.0, 4, 1.0, None, None, model, **{flag: "True"})
    embedder = [n for n in names(net.unet_loras) if n.startswith("text_embedder")]
    assert embedder == sorted(
        ["text_embedder.proj"] + [f"text_embedder.blocks.{b}.proj.{n}" for b in range(2) for n in BLOCK_LINEARS]
    )
    assert len(net.unet_loras) == 18 + 13
    for excluded in ("video_embedder", "t_embedder", "modulation", "final_layer"):
        assert not any(n.startswith(excluded) for n in names(net.unet_loras))


def test_text_embedder_flags_must_agree():
    with pytest.raises(UserError, match="disagree"):
        create_network(1.0, 4, 1.0, None, None, dit(), train_text_embedder="true", train_llm_adapter="false")


def test_text_encoder_default_targets(qwen):
    net = create_network(1.0, 4, 1.0, None, [qwen], None)
    assert names(net.text_encoder_loras) == sorted(
        [f"layers.0.linear_attn.{n}" for n in ("in_proj_qkv", "in_proj_z", "out_proj")]
        + [f"layers.1.self_attn.{n}_proj" for n in "qkvo"]
        + [f"layers.{i}.mlp.{n}_proj" for i in range(2) for n in ("gate", "up", "down")]
    )
    assert "lora_te_layers_1_self_attn_q_proj.lora_down.weight" in net.state_dict()


def test_include_patterns_bring_back_in_proj_ab(qwen):
    net = create_network(1.0, 4, 1.0, None, [qwen], None, include_patterns="['.*in_proj_[ab]']")
    assert {"layers.0.linear_attn.in_proj_a", "layers.0.linear_attn.in_proj_b"} <= set(names(net.text_encoder_loras))


def test_exclude_patterns_forms():
    net = create_network(1.0, 4, 1.0, None, None, dit(), exclude_patterns="['.*ffn.*']")
    assert all("ffn" not in n for n in names(net.unet_loras)) and len(net.unet_loras) == 12
    # the seed's example with "\." escapes inside the list literal
    net = create_network(1.0, 4, 1.0, None, None, dit(), exclude_patterns=r"['layers\.1\..*']")
    assert not any(n.startswith("layers.1.") for n in names(net.unet_loras)) and len(net.unet_loras) == 12
    # a bare regex is one pattern; include overrides exclude
    net = create_network(1.0, 4, 1.0, None, None, dit(), exclude_patterns=r"layers\.1\..*",
                         include_patterns=r"['layers\.1\.proj\.q']")
    assert [n for n in names(net.unet_loras) if n.startswith("layers.1.")] == ["layers.1.proj.q"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"exclude_patterns": "['.*ffn.*'"}, "not a valid Python list"),
        ({"exclude_patterns": "['(unclosed']"}, "not a valid regular expression"),
        ({"exclude_patterns": "[1, 2]"}, "not a string"),
        ({"network_reg_dims": ".*q=abc"}, "not an integer rank"),
        ({"network_reg_dims": ".*q"}, "has no '=value'"),
        ({"network_reg_lrs": ".*q=-1"}, "negative"),
        ({"rank_dropout": "1.5"}, "out of range"),
        ({"module_dropout": "x"}, "not a number"),
        ({"verbose": "maybe"}, "not a boolean"),
        ({"loraplus_lr_ratio": "0"}, "freeze"),
    ],
)
def test_bad_network_args_are_user_errors(kwargs, message):
    with pytest.raises(UserError, match=message):
        create_network(1.0, 4, 1.0, None, None, dit(), **kwargs)


def test_unknown_network_arg_lists_accepted_keys():
    with pytest.raises(UserError) as info:
        create_network(1.0, 4, 1.0, None, None, dit(), conv_dim="4")
    text = str(info.value)
    assert "'conv_dim'" in text and "exclude_patterns" in text and "loraplus_text_encoder_lr_ratio" in text


def test_bad_dims_and_dropout():
    with pytest.raises(UserError, match="network_dim"):
        create_network(1.0, 0, 1.0, None, None, dit())
    with pytest.raises(UserError, match="network_dropout"):
        create_network(1.0, 4, 1.0, None, None, dit(), neuron_dropout=1.0)


def test_reg_dims_precedence_zero_and_commas_in_regex():
    net = create_network(
        1.0, 4, 2.0, None, None, dit(),
        network_reg_dims=r"layers\.[0-9]{1,2}\.proj\.q=2,.*proj\.[kvo]=8,.*ffn_down=0,.*ffn.*=16",
    )
    dims = {lora.original_name: lora.lora_dim for lora in net.unet_loras}
    assert dims["layers.0.proj.q"] == 2 and dims["layers.2.proj.v"] == 8 and dims["layers.1.proj.ffn_up_gate"] == 16
    assert not any(n.endswith("ffn_down") for n in dims)
    assert all(float(lora.alpha) == 2.0 for lora in net.unet_loras)


def test_unmatched_patterns_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="networks.lora_generic"):
        create_network(1.0, 4, 1.0, None, None, dit(), exclude_patterns="['nothing.*']", network_reg_lrs="zzz=1e-4")
    text = caplog.text
    assert "'nothing.*' matches no module" in text and "'zzz' matches no module" in text


def test_everything_excluded_is_an_error():
    with pytest.raises(UserError, match="No LoRA module is left"):
        create_network(1.0, 4, 1.0, None, None, dit(), exclude_patterns="['.*']")


def test_not_a_moss_dit():
    with pytest.raises(UserError, match="no MossImageBlock"):
        create_network(1.0, 4, 1.0, None, None, nn.Sequential(nn.Linear(4, 4)))


# ----------------------------------------------------------------------------------------------------------------------
# forward math


def test_forward_is_base_plus_scaled_lora_and_zero_at_start():
    torch.manual_seed(0)
    model = dit()
    x, text = torch.randn(2, 5, 8), torch.randn(2, 3, 12)
    base = model(x, text)
    net = create_network(0.7, 4, 2.0, None, None, model)
    net.apply_to(None, model, False, True)
    assert torch.equal(model(x, text), base)  # lora_up starts at zero
    randomize(net)
    lora = next(m for m in net.unet_loras if m.original_name == "layers.0.proj.q")
    h = torch.randn(3, 16)
    expected = h @ lora.org_module.weight.T + 0.7 * (2.0 / 4) * (h @ lora.lora_down.weight.T @ lora.lora_up.weight.T)
    torch.testing.assert_close(lora.org_module(h), expected)
    out = model(x, text)
    assert not torch.allclose(out, base)
    net.set_multiplier(0.0)
    assert torch.equal(model(x, text), base)
    net.set_multiplier(0.7)
    net.set_enabled(False)
    assert torch.equal(model(x, text), base)
    net.set_enabled(True)
    torch.testing.assert_close(model(x, text), out)
    net.apply_to(None, model, False, True)  # idempotent: no double wrapping
    torch.testing.assert_close(model(x, text), out)


def test_alpha_zero_or_none_means_rank():
    lin = nn.Linear(6, 5, bias=False)
    assert LoRAModule("l", "l", lin, lora_dim=3, alpha=0).scale == 1.0
    assert LoRAModule("l", "l", lin, lora_dim=3, alpha=None).scale == 1.0
    assert LoRAModule("l", "l", lin, lora_dim=4, alpha=torch.tensor(2.0)).scale == 0.5


def test_bf16_base_with_fp32_lora():
    torch.manual_seed(0)
    lin = nn.Linear(8, 6, bias=False).to(torch.bfloat16)
    lora = LoRAModule("l", "l", lin, lora_dim=2, alpha=2)
    nn.init.normal_(lora.lora_up.weight)
    lora.apply_to()
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16
    ref = x.float() @ lin.weight.float().T + x.float() @ lora.lora_down.weight.T @ lora.lora_up.weight.T
    torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=0.05)


def test_dropouts_train_vs_eval():
    torch.manual_seed(0)
    lin = nn.Linear(8, 6, bias=False)
    lora = LoRAModule("l", "l", lin, lora_dim=4, alpha=4, rank_dropout=0.5)
    nn.init.normal_(lora.lora_up.weight)
    lora.apply_to()
    x = torch.randn(2, 3, 8)  # 3-D input: the rank mask broadcasts over the sequence
    lora.eval()
    ref = lin(x)
    lora.train()
    draws = torch.stack([lin(x) for _ in range(3000)])
    assert not torch.allclose(draws[0], ref)
    torch.testing.assert_close(draws.mean(0), ref, atol=0.08, rtol=0.05)  # rank dropout rescales: unbiased

    lora = LoRAModule("m", "m", nn.Linear(8, 6, bias=False), lora_dim=4, module_dropout=0.5, dropout=0.3)
    nn.init.normal_(lora.lora_up.weight)
    lora.apply_to()
    base = lora._org_forward(x)
    lora.train()
    outs = [lora.org_module(x) for _ in range(200)]
    skipped = sum(torch.equal(o, base) for o in outs)
    assert 60 < skipped < 140
    lora.eval()
    assert torch.equal(lora.org_module(x), lora.org_module(x))


def test_int8_linear_replacement_is_wrapped_not_touched():
    model = dit()
    quantize_blocks(model)
    q = model.layers[0].proj.q
    before = q.weight.clone()
    net = create_network(1.0, 4, 4.0, None, None, model)
    assert "layers.0.proj.q" in names(net.unet_loras)
    net.apply_to(None, model, False, True)
    randomize(net)
    lora = next(m for m in net.unet_loras if m.original_name == "layers.0.proj.q")
    h = torch.randn(3, 16)
    deq = q.weight.float() * q.weight_scale
    torch.testing.assert_close(q(h), h @ deq.T + h @ lora.lora_down.weight.T @ lora.lora_up.weight.T)
    out = model(torch.randn(1, 4, 8), torch.randn(1, 2, 12))
    out.square().mean().backward()
    assert lora.lora_down.weight.grad is not None and lora.lora_down.weight.grad.abs().sum() > 0
    assert torch.equal(q.weight, before) and q.weight.dtype == torch.int8


def test_training_moves_only_lora_and_lowers_loss():
    model = dit()
    for p in model.parameters():
        p.requires_grad_(False)
    base_state = copy.deepcopy(model.state_dict())
    net = create_network(1.0, 4, 4.0, None, None, model, loraplus_lr_ratio="4")
    net.apply_to(None, model, False, True)
    net.prepare_grad_etc(None, model)
    net.on_epoch_start(None, model)
    params, _ = net.prepare_optimizer_params_with_multiple_te_lrs(None, None, 1e-2)
    opt = torch.optim.Adam(params)
    torch.manual_seed(3)
    x, text, target = torch.randn(4, 5, 8), torch.randn(4, 3, 12), torch.randn(4, 5, 8)
    losses = []
    for _ in range(30):
        loss = (model(x, text) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9
    for key, value in model.state_dict().items():
        assert torch.equal(value, base_state[key]), key


def test_text_encoder_lora_runs_in_qwen(qwen):
    te = copy.deepcopy(qwen)
    ids = torch.randint(0, 512, (1, 7))
    with torch.no_grad():
        base = te(input_ids=ids).last_hidden_state
    net = create_network(1.0, 2, 2.0, None, [te], None)
    net.apply_to([te], None, True, False)
    randomize(net)
    with torch.no_grad():
        out = te(input_ids=ids).last_hidden_state
    assert out.shape == base.shape and not torch.allclose(out, base)


# ----------------------------------------------------------------------------------------------------------------------
# optimizer groups


def test_param_groups_lrs_reg_lrs_and_loraplus(qwen):
    net = create_network(
        1.0, 4, 1.0, None, [qwen], dit(), network_reg_lrs=r".*proj\.q=5e-5,.*ffn_down=0", loraplus_unet_lr_ratio="16",
    )
    net.apply_to([qwen], None, True, True)
    groups, descs = net.prepare_optimizer_params_with_multiple_te_lrs([2e-5], 1e-4, 1e-3)
    by_desc = dict(zip(descs, groups))
    assert descs == ["textencoder", "unet reg_lr_0", "unet reg_lr_0 plus", "unet", "unet plus"]
    assert by_desc["textencoder"]["lr"] == 2e-5
    assert by_desc["unet reg_lr_0"]["lr"] == 5e-5 and by_desc["unet reg_lr_0 plus"]["lr"] == pytest.approx(5e-5 * 16)
    assert by_desc["unet"]["lr"] == 1e-4 and by_desc["unet plus"]["lr"] == pytest.approx(1e-4 * 16)
    te_params = sum(p.numel() for lora in net.text_encoder_loras for p in lora.parameters())
    assert sum(p.numel() for p in by_desc["textencoder"]["params"]) == te_params
    # ffn_down (lr 0) is in no group; q is only in the reg group; up weights only in "plus" groups
    grouped = {id(p) for g in groups for p in g["params"]}
    ffn_down = [lora for lora in net.unet_loras if lora.original_name.endswith("ffn_down")]
    assert ffn_down and all(id(p) not in grouped for lora in ffn_down for p in lora.parameters())
    net.prepare_grad_etc([qwen], None)
    assert all(not p.requires_grad for lora in ffn_down for p in lora.parameters())
    trainable = {id(p) for p in net.get_trainable_params()}
    assert trainable == grouped
    q_up = {id(lora.lora_up.weight) for lora in net.unet_loras if lora.original_name.endswith("proj.q")}
    assert q_up <= {id(p) for p in by_desc["unet reg_lr_0 plus"]["params"]}


def test_param_groups_defaults_and_te_ratio(qwen):
    net = create_network(1.0, 4, 1.0, None, [qwen], dit(), loraplus_lr_ratio="4", loraplus_text_encoder_lr_ratio="2")
    groups, descs = net.prepare_optimizer_params(None, None, 1e-3)
    lrs = dict(zip(descs, (g["lr"] for g in groups)))
    assert lrs == {"textencoder": 1e-3, "textencoder plus": 2e-3, "unet": 1e-3, "unet plus": 4e-3}


def test_apply_to_drops_text_encoder_modules(qwen):
    net = create_network(1.0, 4, 1.0, None, [qwen], dit())
    net.apply_to([qwen], None, apply_text_encoder=False, apply_unet=True)
    assert net.text_encoder_loras == [] and not any(k.startswith("lora_te_") for k in net.state_dict())
    _, descs = net.prepare_optimizer_params_with_multiple_te_lrs(None, None, 1e-4)
    assert descs == ["unet"]


# ----------------------------------------------------------------------------------------------------------------------
# save / load / merge


def test_save_load_and_from_weights_roundtrip(tmp_path, qwen):
    model = dit()
    net = create_network(1.0, 4, 2.0, None, [qwen], model, train_text_embedder="true",
                         network_reg_dims=r".*ffn.*=8")
    net.apply_to([qwen], model, True, True)
    randomize(net)
    path = tmp_path / "lora.safetensors"
    net.save_weights(path, torch.bfloat16, {"ss_network_dim": 4, "modelspec.title": "t"})
    from library.files.safetensors_io import load_safetensors, read_metadata

    sd = load_safetensors(path)
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    assert set(sd) == set(net.state_dict())
    meta = read_metadata(path)
    assert meta["ss_network_dim"] == "4" and len(meta["sshs_model_hash"]) == 64 and len(meta["sshs_legacy_hash"]) == 8

    model2 = dit()
    net2, weights = create_network_from_weights(1.0, str(path), None, [copy.deepcopy(qwen)], model2)
    assert {m.lora_name: m.lora_dim for m in net2.unet_loras + net2.text_encoder_loras} == {
        m.lora_name: m.lora_dim for m in net.unet_loras + net.text_encoder_loras
    }
    assert all(float(m.alpha) == 2.0 for m in net2.unet_loras)
    net2.apply_to(None, model2, True, True)
    net2.load_weights(path)
    x, text = torch.randn(1, 4, 8), torch.randn(1, 2, 12)
    torch.testing.assert_close(model2(x, text), model(x, text), atol=2e-2, rtol=2e-2)

    fresh = create_network(1.0, 4, 2.0, None, None, dit(), network_reg_dims=r".*ffn.*=8")
    fresh.load_weights(path)  # TE/text-embedder keys in the file are reported, not fatal
    torch.testing.assert_close(
        fresh.lora_unet_layers_0_proj_q.lora_up.weight, net.lora_unet_layers_0_proj_q.lora_up.weight.bfloat16().float()
    )


def test_load_weights_rank_mismatch_and_bad_files(tmp_path):
    net = create_network(1.0, 4, 1.0, None, None, dit())
    path = tmp_path / "r8.safetensors"
    create_network(1.0, 8, 1.0, None, None, dit()).save_weights(path, None, None)
    with pytest.raises(UserError, match="--dim_from_weights"):
        net.load_weights(path)
    with pytest.raises(UserError, match="only .safetensors"):
        net.save_weights(tmp_path / "x.pt", None, None)
    with pytest.raises(UserError, match="does not exist"):
        net.load_weights(tmp_path / "missing.safetensors")


def test_loaded_alpha_updates_scale(tmp_path):
    net = create_network(1.0, 4, 8.0, None, None, dit())
    path = tmp_path / "a.safetensors"
    net.save_weights(path, None, None)
    other = create_network(1.0, 4, 1.0, None, None, dit())
    other.load_weights(path)
    assert all(m.scale == 2.0 for m in other.unet_loras)


def test_from_weights_reports_unknown_modules(tmp_path, caplog):
    net = create_network(1.0, 4, 1.0, None, None, dit())
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    sd["lora_unet_layers_7_proj_q.lora_down.weight"] = torch.zeros(4, 16)
    sd["lora_unet_layers_7_proj_q.lora_up.weight"] = torch.zeros(16, 4)
    with caplog.at_level(logging.WARNING, logger="networks.lora_generic"):
        net2, _ = create_network_from_weights(1.0, None, None, None, dit(), weights_sd=sd, for_inference=True)
    assert len(net2.unet_loras) == 18 and "1 LoRA modules" in caplog.text and "layers_7" in caplog.text
    with pytest.raises(UserError, match="matches no module"):
        create_network_from_weights(1.0, "x", None, None, nn.Sequential(nn.Linear(2, 2)), weights_sd=sd)


def test_merge_to_equals_applied_lora():
    model = dit()
    net = create_network(0.8, 4, 2.0, None, None, model)
    randomize(net)
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    net.apply_to(None, model, False, True)
    x, text = torch.randn(2, 4, 8), torch.randn(2, 2, 12)
    expected = model(x, text)
    target = dit()
    inf, weights = create_network_from_weights(0.8, None, None, None, target, weights_sd=sd, for_inference=True)
    inf.merge_to(None, target, weights)
    torch.testing.assert_close(target(x, text), expected, atol=1e-5, rtol=1e-5)
    quantized = dit()
    quantize_blocks(quantized)
    inf_q, _ = create_network_from_weights(1.0, None, None, None, quantized, weights_sd=sd, for_inference=True)
    with pytest.raises(UserError, match="--convrot_int8"):
        inf_q.merge_to(None, quantized, sd)


def test_max_norm_regularization():
    net = create_network(1.0, 4, 4.0, None, None, dit())
    randomize(net)
    norms_before = [float(m.delta_weight().norm()) for m in net.unet_loras]
    limit = sorted(norms_before)[len(norms_before) // 2]
    scaled, mean_norm, max_norm = net.apply_max_norm_regularization(limit, "cpu")
    assert scaled == sum(n > limit for n in norms_before)
    assert max_norm == pytest.approx(limit, rel=1e-5)
    assert all(float(m.delta_weight().norm()) <= limit * (1 + 1e-5) for m in net.unet_loras)
    assert mean_norm <= max_norm


def test_peft_named_weights_are_accepted():
    from networks.convert_moss_image_lora import to_peft

    net = create_network(1.0, 4, 2.0, None, None, dit())
    randomize(net)
    peft = to_peft(net.state_dict(), "comfyui")
    net2, weights = create_network_from_weights(1.0, None, None, None, dit(), weights_sd=peft)
    assert len(net2.unet_loras) == 18 and all(k.startswith("lora_unet_") for k in weights)
    net2.load_state_dict(weights)
    for a, b in zip(net.unet_loras, net2.unet_loras):
        torch.testing.assert_close(b.delta_weight(), a.delta_weight())


class WrappingLinear(nn.Module):
    """A Linear replacement that keeps the original Linear as a child."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.inner = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_wrapped_linear_gets_one_lora():
    model = dit()
    model.layers[0].proj.q = WrappingLinear(model.layers[0].proj.q)
    net = create_network(1.0, 4, 1.0, None, None, model)
    assert "layers.0.proj.q" in names(net.unet_loras) and "layers.0.proj.q.inner" not in names(net.unet_loras)
    assert len(net.unet_loras) == 18


def test_fake_int8_is_linear_like():
    assert lora_generic.is_linear_like(FakeInt8Linear(nn.Linear(4, 3)))
    assert not lora_generic.is_linear_like(nn.LayerNorm(4))
    assert not lora_generic.is_linear_like(nn.Conv1d(2, 2, 3))
    assert math.isclose(LoRAModule("a", "a", FakeInt8Linear(nn.Linear(4, 3)), lora_dim=2, alpha=1).scale, 0.5)


# ----------------------------------------------------------------------------------------------------------------------
# the real DiT class (tiny config)


def test_real_moss_image_dit_targets_and_forward():
    from library.moss_image.dit import MossImage as RealMossImage
    from library.moss_image.tiny_snapshot import TINY_DIT_CONFIG

    torch.manual_seed(0)
    model = RealMossImage(TINY_DIT_CONFIG).eval()
    layers = TINY_DIT_CONFIG.num_layers
    net = create_network(1.0, 4, 1.0, None, None, model)
    assert len(net.unet_loras) == 6 * layers
    assert names(net.unet_loras) == sorted(f"layers.{i}.proj.{n}" for i in range(layers) for n in BLOCK_LINEARS)
    with_embedder = create_network(1.0, 4, 1.0, None, None, model, train_text_embedder="true")
    refiners = TINY_DIT_CONFIG.num_refiner_layers
    assert len(with_embedder.unet_loras) == 6 * layers + 1 + 6 * refiners
    x, t, text = torch.randn(1, 128, 2, 2), torch.tensor([500.0]), torch.randn(1, 3, TINY_DIT_CONFIG.text_dim)
    with torch.no_grad():
        base = model(x, t, text)
        net.apply_to(None, model, False, True)
        randomize(net)
        out = model(x, t, text)
    assert out.shape == base.shape and not torch.allclose(out, base)


def test_networks_lora_is_lora_generic(caplog):
    from networks import lora

    with caplog.at_level(logging.INFO, logger="networks.lora"):
        net = lora.create_network(1.0, 4, 1.0, None, None, dit())
    assert isinstance(net, lora_generic.LoRANetwork) and len(net.unet_loras) == 18
    assert "networks.lora is networks.lora_generic" in caplog.text
    again, _ = lora.create_network_from_weights(1.0, None, None, None, dit(), weights_sd=net.state_dict())
    assert {m.lora_name for m in again.unet_loras} == {m.lora_name for m in net.unet_loras}
