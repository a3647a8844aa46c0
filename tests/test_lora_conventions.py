"""library.lora.conventions and library.moss_image.lora_targets: the names, the alpha rule, and the two forms of the
MOSS-Image target list (classes for the networks, names for the converter) selecting the same modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from library.errors import UserError
from library.lora import conventions as conv
from library.lora.convert import dotted_module_path
from networks.lora_generic import create_network
from tests.moss_lora_fakes import tiny_qwen35

REPO = Path(__file__).resolve().parent.parent


def test_names_and_key_splitting():
    assert conv.lora_name_for("lora_unet", "layers.3.proj.ffn_up_gate") == "lora_unet_layers_3_proj_ffn_up_gate"
    assert conv.lora_name_for_weight("lora_te", "layers.1.mlp.up_proj.weight") == "lora_te_layers_1_mlp_up_proj"
    assert conv.lora_name_for_weight("lora_unet", "layers.1.norm1.bias") is None
    assert conv.prefix_for(True) == "lora_unet" and conv.prefix_for(False) == "lora_te"
    assert conv.split_sd_key("lora_te_layers_0_mlp_up_proj.alpha") == ("lora_te", "layers_0_mlp_up_proj", "alpha")
    assert conv.split_peft_key("transformer.layers.2.proj.o.lora_B.weight") == (
        "lora_unet", "layers.2.proj.o", "lora_up.weight")
    with pytest.raises(UserError, match="not an sd-scripts LoRA key"):
        conv.split_sd_key("model.layers.0.weight")
    assert all(p.startswith(conv.TEXT_ENCODER_KEY_PREFIXES) for p in ("lora_te_x.alpha", "text_encoder.x.alpha"))


@pytest.mark.parametrize("alpha, rank, expected", [(None, 4, 1.0), (0, 4, 1.0), (2.0, 4, 0.5),
                                                   (torch.tensor(8.0, dtype=torch.bfloat16), 4, 2.0)])
def test_alpha_rule(alpha, rank, expected):
    assert conv.alpha_scale(alpha, rank) == expected
    assert conv.effective_alpha(alpha, rank) == expected * rank


def test_group_modules_reports_incomplete_modules():
    sd = {"lora_unet_a.lora_down.weight": torch.zeros(2, 4), "lora_unet_a.lora_up.weight": torch.zeros(4, 2),
          "lora_unet_b.lora_up.weight": torch.zeros(4, 2)}
    with pytest.raises(UserError, match="'lora_unet_b' of the LoRA x.safetensors lacks lora_down"):
        conv.group_modules(sd, "x.safetensors")


def test_target_classes_and_name_table_select_the_same_modules():
    from library.moss_image.dit import MossImage
    from library.moss_image.tiny_snapshot import TINY_DIT_CONFIG

    torch.manual_seed(0)
    net = create_network(1.0, 2, 1.0, None, [tiny_qwen35()], MossImage(TINY_DIT_CONFIG),
                         train_text_embedder="true", include_patterns="['.*in_proj_[ab]']")
    loras = net.unet_loras + net.text_encoder_loras
    assert len(net.unet_loras) > 0 and len(net.text_encoder_loras) == 15
    for lora in loras:
        prefix = "lora_unet" if lora in net.unet_loras else "lora_te"
        underscored = lora.lora_name[len(prefix) + 1:]
        assert dotted_module_path(prefix, underscored) == lora.original_name


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_library_never_imports_networks():
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "library").rglob("*.py")
                 if any(n == "networks" or n.startswith("networks.") for n in _imports(p))]
    assert offenders == []
