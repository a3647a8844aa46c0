"""networks.loha / networks.lokr and their math (library.lora.weights): LyCORIS key names and shapes, the same module
selection as networks.lora_generic, forward = merge, save / load, network_args, and the merge of their files."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from library.errors import UserError
from library.lora import weights as lw
from library.lora.conventions import split_fused_qkv
from library.lora.convert import to_peft
from library.lora.merge import LoraMergePlan, merge_into_module
from networks import loha, lokr, lora_generic
from tests.moss_lora_fakes import MossImage, quantize_blocks, tiny_qwen35

MODULES = {"loha": loha, "lokr": lokr}


def dit(seed: int = 0) -> MossImage:
    torch.manual_seed(seed)
    return MossImage()


def randomize(network: nn.Module, seed: int = 1, std: float = 0.3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def reference_delta(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """dW as ComfyUI / LyCORIS read the file, written out here independently of library.lora.weights."""
    t = {k.partition(".")[2]: v.double() for k, v in sd.items() if k.partition(".")[0] == name}
    if "hada_w1_a" in t:
        rank = t["hada_w1_b"].shape[0]
        return (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"]) * (float(t["alpha"]) / rank)
    rank = None
    w1 = t.get("lokr_w1")
    if w1 is None:
        w1, rank = t["lokr_w1_a"] @ t["lokr_w1_b"], t["lokr_w1_b"].shape[0]
    w2 = t.get("lokr_w2")
    if w2 is None:
        w2, rank = t["lokr_w2_a"] @ t["lokr_w2_b"], t["lokr_w2_b"].shape[0]
    return torch.kron(w1, w2) * (1.0 if rank is None else float(t["alpha"]) / rank)


# ----------------------------------------------------------------------------------------------------------------------
# math


def test_factorization_matches_the_lycoris_rule():
    cases = {(3072, -1): (48, 64), (16384, -1): (128, 128), (360, -1): (18, 20), (360, 8): (8, 45),
             (360, 16): (15, 24), (127, -1): (1, 127), (4096, 4): (4, 1024), (48, -1): (6, 8), (24, 128): (4, 6)}
    assert {k: lw.factorization(*k) for k in cases} == cases


def test_hadamard_product_gradients_and_kron_linear():
    gen = torch.Generator().manual_seed(0)
    factors = [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True)
               for s in ((5, 2), (2, 4), (5, 2), (2, 4))]
    assert torch.autograd.gradcheck(lw.hadamard_product, factors)
    w1, w2 = torch.randn(3, 2, generator=gen), torch.randn(4, 5, generator=gen)
    x = torch.randn(2, 7, 10, generator=gen)
    torch.testing.assert_close(lw.kron_linear(x, w1, w2), x @ torch.kron(w1, w2).T)
    a, b = torch.randn(4, 2, generator=gen), torch.randn(2, 5, generator=gen)
    torch.testing.assert_close(lw.kron_linear(x, w1, (a, b)), x @ torch.kron(w1, a @ b).T)


# ----------------------------------------------------------------------------------------------------------------------
# selection and keys


@pytest.mark.parametrize("algo", ["loha", "lokr"])
def test_same_selection_as_lora_generic(algo):
    te = tiny_qwen35()
    kwargs = {"train_text_embedder": "true", "exclude_patterns": r"['layers\.1\..*']",
              "include_patterns": "['.*in_proj_a']", "network_reg_dims": ".*ffn_down=0,.*proj\\.q=3"}
    ref = lora_generic.create_network(1.0, 2, 1.0, None, [te], dit(), **kwargs)
    net = MODULES[algo].create_network(1.0, 2, 1.0, None, te, dit(), **kwargs)
    dims = {m.lora_name: m.lora_dim for m in net.unet_loras + net.text_encoder_loras}
    assert dims == {m.lora_name: m.lora_dim for m in ref.unet_loras + ref.text_encoder_loras}
    assert "lora_te_layers_0_linear_attn_in_proj_a" in dims and "lora_te_layers_0_linear_attn_in_proj_b" not in dims
    assert dims["lora_unet_layers_0_proj_q"] == 3 and not any("ffn_down" in n for n in dims)


def test_loha_keys_shapes_and_start_at_zero():
    model = dit()
    x, text = torch.randn(2, 5, 8), torch.randn(2, 3, 12)
    base = model(x, text)
    net = loha.create_network(1.0, 3, 1.5, None, None, model)
    sd = net.state_dict()
    name = "lora_unet_layers_0_proj_ffn_up_gate"  # 16 -> 48
    assert {k: tuple(v.shape) for k, v in sd.items() if k.startswith(name + ".")} == {
        f"{name}.hada_w1_a": (48, 3), f"{name}.hada_w1_b": (3, 16), f"{name}.hada_w2_a": (48, 3),
        f"{name}.hada_w2_b": (3, 16), f"{name}.alpha": ()}
    assert float(sd[f"{name}.alpha"]) == 1.5 and len(sd) == 18 * 5
    net.apply_to(None, model, False, True)
    assert torch.equal(model(x, text), base)


@pytest.mark.parametrize(
    "args, expected",
    [
        ({}, {"lokr_w1": (6, 4), "lokr_w2_a": (8, 1), "lokr_w2_b": (1, 4)}),  # 48 = 6 x 8, 16 = 4 x 4
        ({"factor": "2"}, {"lokr_w1": (2, 2), "lokr_w2_a": (24, 1), "lokr_w2_b": (1, 8)}),
        ({"factor": "2", "decompose_both": "true"}, {"lokr_w1": (2, 2), "lokr_w2_a": (24, 1), "lokr_w2_b": (1, 8)}),
        ({"factor": "8", "decompose_both": "true"},  # 48 = 6 x 8, 16 = 2 x 8
         {"lokr_w1_a": (6, 1), "lokr_w1_b": (1, 2), "lokr_w2_a": (8, 1), "lokr_w2_b": (1, 8)}),
        ({"full_matrix": "true"}, {"lokr_w1": (6, 4), "lokr_w2": (8, 4)}),
    ],
)
def test_lokr_layouts(args, expected):
    net = lokr.create_network(1.0, 1, 0.5, None, None, dit(), **args)
    name = "lora_unet_layers_0_proj_ffn_up_gate"
    shapes = {k.partition(".")[2]: tuple(v.shape) for k, v in net.state_dict().items() if k.startswith(name + ".")}
    alpha = shapes.pop("alpha")
    assert shapes == expected and alpha == ()
    module = getattr(net, name)
    if "lokr_w2" in expected:  # no rank: alpha stored as the rank, scale 1
        assert float(module.alpha) == 1 and module.scale == 1.0
    else:
        assert float(module.alpha) == 0.5 and module.scale == 0.5


def test_lokr_warns_when_w2_becomes_a_full_matrix(caplog):
    with caplog.at_level(logging.WARNING, logger="networks.lokr"):
        lokr.create_network(1.0, 4, 1.0, None, None, dit())
    assert "w2 is a full matrix" in caplog.text and "18 modules" in caplog.text


# ----------------------------------------------------------------------------------------------------------------------
# forward = the file's dW = merge


LAYOUTS = [("loha", {}), ("lokr", {}), ("lokr", {"factor": "2", "decompose_both": "true"}),
           ("lokr", {"factor": "8", "decompose_both": "true"}), ("lokr", {"full_matrix": "true"})]


@pytest.mark.parametrize("algo, args", LAYOUTS)
def test_forward_delta_equals_file_delta_and_merge(algo, args):
    model = dit()
    net = MODULES[algo].create_network(0.7, 2, 1.5, None, None, model, **args)
    randomize(net)
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    net.apply_to(None, model, False, True)
    for module in net.unet_loras:
        ref = reference_delta(sd, module.lora_name).float()
        torch.testing.assert_close(module.weight_delta(), ref, atol=1e-5, rtol=1e-5)
        h = torch.randn(3, module.in_dim, dtype=torch.float32)
        expected = h @ (module.org_module.weight.detach() + 0.7 * ref).T
        if module.org_module.bias is not None:
            expected = expected + module.org_module.bias.detach()
        torch.testing.assert_close(module.org_module(h), expected, atol=1e-5, rtol=1e-5)
    x, text = torch.randn(2, 4, 8), torch.randn(2, 2, 12)
    with torch.no_grad():
        applied = model(x, text)
    target = dit()
    plan = LoraMergePlan([(sd, 0.7)], "lora_unet")
    assert merge_into_module(target, plan) == 18 and plan.finish() == []
    with torch.no_grad():
        torch.testing.assert_close(target(x, text), applied, atol=1e-5, rtol=1e-5)
    inferred = dit()
    inf, weights = MODULES[algo].create_network_from_weights(0.7, None, None, None, inferred, weights_sd=sd,
                                                             for_inference=True)
    inf.merge_to(None, inferred, weights)
    with torch.no_grad():
        torch.testing.assert_close(inferred(x, text), applied, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("algo, args", LAYOUTS)
def test_save_and_load_back(tmp_path, algo, args):
    te = tiny_qwen35()
    model = dit()
    net = MODULES[algo].create_network(1.0, 2, 2.0, None, te, model, train_text_embedder="true", **args)
    net.apply_to(te, model, True, True)
    randomize(net, std=0.2)
    path = tmp_path / f"{algo}.safetensors"
    net.save_weights(path, torch.bfloat16, {"ss_network_module": f"networks.{algo}"})
    from library.files.safetensors_io import load_safetensors, read_metadata

    sd = load_safetensors(path)
    assert set(sd) == set(net.state_dict()) and all(v.dtype == torch.bfloat16 for v in sd.values())
    assert read_metadata(path)["ss_network_module"] == f"networks.{algo}"
    model2 = dit()
    net2, _ = MODULES[algo].create_network_from_weights(1.0, str(path), None, tiny_qwen35(), model2)
    assert {k: v.shape for k, v in net2.state_dict().items()} == {k: v.shape for k, v in sd.items()}
    net2.apply_to(None, model2, True, True)
    net2.load_weights(path)
    loaded = {m.lora_name: m for m in net2.unet_loras + net2.text_encoder_loras}
    assert set(loaded) == {m.lora_name for m in net.unet_loras + net.text_encoder_loras}
    for a in net.unet_loras + net.text_encoder_loras:
        b = loaded[a.lora_name]
        assert a.scale == b.scale and a.lora_dim == b.lora_dim
        torch.testing.assert_close(b.weight_delta(), reference_delta(sd, a.lora_name).float(), atol=1e-5, rtol=1e-5)
    # training continues from the file: --network_weights into a freshly made network of the same options
    fresh = MODULES[algo].create_network(1.0, 2, 2.0, None, None, dit(), train_text_embedder="true", **args)
    fresh.load_weights(path)
    first = fresh.unet_loras[0]
    torch.testing.assert_close(first.weight_delta(), reference_delta(sd, first.lora_name).float(), atol=1e-5,
                               rtol=1e-5)


def test_training_moves_only_the_module_weights_and_lowers_loss():
    for algo, mod in MODULES.items():
        model = dit()
        model.requires_grad_(False)
        base = {k: v.clone() for k, v in model.state_dict().items()}
        net = mod.create_network(1.0, 2, 2.0, None, None, model, rank_dropout="0.1", module_dropout="0.1",
                                 dropout="0.05")
        net.apply_to(None, model, False, True)
        net.prepare_grad_etc(None, model)
        net.on_epoch_start(None, model)
        params, _ = net.prepare_optimizer_params_with_multiple_te_lrs(None, None, 1e-2)
        opt = torch.optim.Adam(params)
        torch.manual_seed(3)
        x, text, target = torch.randn(4, 5, 8), torch.randn(4, 3, 12), torch.randn(4, 5, 8)
        losses = []
        for _ in range(40):
            loss = (model(x, text) - target).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0] * 0.95, algo
        assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items()), algo


def test_int8_base_is_wrapped_and_refused_by_merge():
    model = dit()
    quantize_blocks(model)
    net = lokr.create_network(1.0, 2, 1.0, None, None, model)
    net.apply_to(None, model, False, True)
    randomize(net)
    q = model.layers[0].proj.q
    h = torch.randn(2, 16)
    module = net.lora_unet_layers_0_proj_q
    torch.testing.assert_close(q(h), h @ (q.weight.float() * q.weight_scale).T + h @ module.weight_delta().T)
    with pytest.raises(UserError, match="--convrot_int8"):
        merge_into_module(model, LoraMergePlan([(net.state_dict(), 1.0)], "lora_unet"))


# ----------------------------------------------------------------------------------------------------------------------
# optimizer groups, max norm


def test_loraplus_groups_follow_sd_scripts():
    for algo, plus in (("loha", {"hada_w2_a"}), ("lokr", {"lokr_w1"})):
        net = MODULES[algo].create_network(1.0, 2, 1.0, None, None, dit(), loraplus_lr_ratio="4")
        groups, descs = net.prepare_optimizer_params_with_multiple_te_lrs(None, 1e-4, 1e-3)
        assert descs == ["unet", "unet plus"] and groups[1]["lr"] == pytest.approx(4e-4)
        plus_ids = {id(p) for p in groups[1]["params"]}
        names = {n.rpartition(".")[2] for n, p in net.named_parameters() if id(p) in plus_ids}
        assert names == plus, algo


@pytest.mark.parametrize("algo", ["loha", "lokr"])
def test_max_norm_regularization(algo):
    net = MODULES[algo].create_network(1.0, 2, 2.0, None, None, dit())
    randomize(net)
    before = [float(m.weight_delta().norm()) for m in net.unet_loras]
    limit = sorted(before)[len(before) // 2]
    scaled, _, max_norm = net.apply_max_norm_regularization(limit, "cpu")
    assert scaled == sum(n > limit for n in before) and max_norm == pytest.approx(limit, rel=1e-4)
    assert all(float(m.weight_delta().norm()) <= limit * (1 + 1e-4) for m in net.unet_loras)


# ----------------------------------------------------------------------------------------------------------------------
# network_args and wrong files


@pytest.mark.parametrize(
    "algo, kwargs, message",
    [
        ("loha", {"conv_dim": "4"}, "'conv_dim' does not apply to networks.loha: .* no convolution layers"),
        ("lokr", {"use_tucker": "true"}, "'use_tucker' does not apply to networks.lokr"),
        ("lokr", {"dora_wd": "true"}, "LyCORIS option .* --network_module lycoris.kohya"),
        ("lokr", {"unbalanced_factorization": "true"}, "LyCORIS option that networks.lokr does not implement"),
        ("loha", {"algo": "lokr"}, "another algorithm than networks.loha"),
        ("lokr", {"factor": "0"}, "factor=0 is not a factor"),
        ("lokr", {"factor": "x"}, "not an integer"),
        ("loha", {"factor": "4"}, "Unknown --network_args key.*'factor'.*networks.loha"),
        ("lokr", {"full_matrix": "maybe"}, "not a boolean"),
        ("loha", {"dropout": "0.2"}, "--network_dropout 0.1 and --network_args dropout=0.2 disagree"),
    ],
)
def test_network_args(algo, kwargs, message):
    with pytest.raises(UserError, match=message):
        MODULES[algo].create_network(1.0, 2, 1.0, None, None, dit(), neuron_dropout=0.1, **kwargs)


def test_algo_of_the_module_and_lycoris_dropout_name_are_accepted():
    net = lokr.create_network(1.0, 2, 1.0, None, None, dit(), algo="lokr", dropout="0.1")
    assert all(m.dropout == 0.1 for m in net.unet_loras)
    assert lora_generic.create_network(1.0, 2, 1.0, None, None, dit(), algo="lora").unet_loras


def test_conv_dim_refused_by_lora_generic_with_the_accepted_keys():
    with pytest.raises(UserError, match="'conv_dim' does not apply .* accepted keys are .*exclude_patterns"):
        lora_generic.create_network(1.0, 4, 1.0, None, None, dit(), conv_dim="4")


def test_files_of_another_algorithm_are_named(tmp_path):
    lora_path = tmp_path / "lora.safetensors"
    lora_generic.create_network(1.0, 2, 1.0, None, None, dit()).save_weights(lora_path, None, None)
    with pytest.raises(UserError, match="holds LoRA modules, but --network_module networks.loha trains LoHa: use"
                                        " --network_module networks.lora_generic"):
        loha.create_network(1.0, 2, 1.0, None, None, dit()).load_weights(lora_path)
    loha_sd = loha.create_network(1.0, 2, 1.0, None, None, dit()).state_dict()
    with pytest.raises(UserError, match="holds LoHa modules.*networks.lokr trains LoKr.*use --network_module"
                                        " networks.loha"):
        lokr.create_network_from_weights(1.0, "x.safetensors", None, None, dit(), weights_sd=loha_sd)
    with pytest.raises(UserError, match="is not an sd-scripts LoRA key but a LoHa one.*ComfyUI and LyCORIS read"):
        to_peft(loha_sd)


def test_mixed_file_merges_every_module():
    model = dit()
    a = loha.create_network(1.0, 2, 1.0, None, None, model, exclude_patterns="['.*ffn.*']")
    b = lokr.create_network(1.0, 2, 1.0, None, None, model, include_patterns="['.*ffn.*']",
                            exclude_patterns="['.*']")
    randomize(a, 1)
    randomize(b, 2)
    mixed = {**a.state_dict(), **b.state_dict()}
    plan = LoraMergePlan([(mixed, 1.0)], "lora_unet")
    w = model.layers[2].proj.ffn_down.weight.detach()
    expected = w + reference_delta(mixed, "lora_unet_layers_2_proj_ffn_down").float()
    torch.testing.assert_close(plan.merge("layers.2.proj.ffn_down.weight", w), expected, atol=1e-5, rtol=1e-5)
    assert len(plan) == 18


def test_fused_qkv_loha_splits_exactly_and_lokr_is_refused():
    gen = torch.Generator().manual_seed(0)
    fused = {f"lora_unet_layers_1_proj_qkv.{k}": torch.randn(s, generator=gen)
             for k, s in (("hada_w1_a", (48, 2)), ("hada_w1_b", (2, 16)), ("hada_w2_a", (48, 2)), ("hada_w2_b", (2, 16)))}
    fused["lora_unet_layers_1_proj_qkv.alpha"] = torch.tensor(1.0)
    split = split_fused_qkv(fused)
    parts = [reference_delta(split, f"lora_unet_layers_1_proj_{p}") for p in "qkv"]
    torch.testing.assert_close(torch.cat(parts), reference_delta(fused, "lora_unet_layers_1_proj_qkv"))
    with pytest.raises(UserError, match="LoKr of a fused q/k/v module, which does not split"):
        split_fused_qkv({"lora_unet_layers_1_proj_qkv.lokr_w1": torch.zeros(3, 4),
                         "lora_unet_layers_1_proj_qkv.lokr_w2": torch.zeros(16, 4)})


def test_damaged_module_tensors_are_refused():
    sd = loha.create_network(1.0, 2, 1.0, None, None, dit()).state_dict()
    sd["lora_unet_layers_0_proj_q.hada_w2_b"] = torch.zeros(3, 16)
    with pytest.raises(UserError, match="do not fit together"):
        LoraMergePlan([(sd, 1.0)], "lora_unet").merge("layers.0.proj.q.weight", torch.zeros(16, 16))
    sd = lokr.create_network(1.0, 2, 1.0, None, None, dit()).state_dict()
    with pytest.raises(UserError, match="LoKr for 'layers.0.proj.q.weight' makes a change of shape"):
        LoraMergePlan([(sd, 1.0)], "lora_unet").merge("layers.0.proj.q.weight", torch.zeros(16, 8))


# ----------------------------------------------------------------------------------------------------------------------
# the LyCORIS package itself (optional test dependency: pip install lycoris-lora)


@pytest.mark.parametrize("algo, args", LAYOUTS)
def test_lycoris_reads_our_files_and_we_read_its_files(algo, args):
    lycoris_kohya = pytest.importorskip("lycoris.kohya")
    model, theirs_model = dit(), dit()
    net = MODULES[algo].create_network(0.8, 1, 0.5, None, None, model, **args)
    randomize(net)
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    net.apply_to(None, model, False, True)
    theirs, _ = lycoris_kohya.create_network_from_weights(0.8, None, None, None, theirs_model, weights_sd=sd)
    theirs.apply_to(None, theirs_model, False, True)
    assert len(theirs.unet_loras) == 18
    x, text = torch.randn(2, 4, 8), torch.randn(2, 2, 12)
    with torch.no_grad():
        torch.testing.assert_close(theirs_model(x, text), model(x, text), atol=1e-5, rtol=1e-5)

    # a file LyCORIS trained (its own network over the same blocks) merges here as LyCORIS applies it
    cls = lycoris_kohya.LycorisNetworkKohya
    saved = cls.UNET_TARGET_REPLACE_MODULE, cls.UNET_TARGET_REPLACE_NAME
    cls.UNET_TARGET_REPLACE_MODULE, cls.UNET_TARGET_REPLACE_NAME = ["MossImageBlock"], []
    try:
        source = dit()
        lyco = cls(None, source, multiplier=1.0, lora_dim=2, alpha=1.0, network_module=algo, **{
            k: v == "true" if v in ("true", "false") else int(v) for k, v in args.items()})
    finally:
        cls.UNET_TARGET_REPLACE_MODULE, cls.UNET_TARGET_REPLACE_NAME = saved
    lyco.apply_to(None, source, False, True)  # LyCORIS registers its modules here
    randomize(lyco, 3)
    lyco_sd = {k: v.clone() for k, v in lyco.state_dict().items()}
    merged = dit()
    plan = LoraMergePlan([(lyco_sd, 1.0)], "lora_unet")
    assert merge_into_module(merged, plan) > 0 and plan.finish() == []
    with torch.no_grad():
        torch.testing.assert_close(merged(x, text), source(x, text), atol=1e-5, rtol=1e-5)
