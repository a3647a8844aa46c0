"""What the LoRA-family networks train in MOSS-Image: the module classes they look for, and the names those modules have.

The networks (`networks.lora_generic`, `networks.loha`, `networks.lokr`) find their targets in the model itself, by
class: every Linear-like module inside a DiT block, inside the text embedder on request, inside the Qwen3.5 attention,
linear-attention and MLP modules of the text encoder. The converter to the PEFT naming needs the dotted module path
back from an underscored LoRA name (`proj_ffn_up_gate` is ambiguous), so the same targets are also listed here by
name: `DIT_MODULE_PATHS` and `TEXT_ENCODER_MODULE_PATHS` (a test checks that both forms select the same modules of
the real models).
"""

from __future__ import annotations

DIT_BLOCK_CLASSES = ("MossImageBlock",)
DIT_TEXT_EMBEDDER_CLASSES = ("MossImageTextEmbedder",)
TEXT_ENCODER_TARGET_CLASSES = ("Qwen3_5Attention", "Qwen3_5GatedDeltaNet", "Qwen3_5MLP")
TEXT_ENCODER_DEFAULT_EXCLUDE = (r".*in_proj_[ab]",)  # the tiny per-head gates of the linear-attention layers

# the Linear modules of a DiT block (and of a text-embedder refiner block): `<block>.proj.<name>`
BLOCK_LINEARS = ("q", "k", "v", "o", "ffn_up_gate", "ffn_down")
BLOCK_LINEAR_PATTERN = "(" + "|".join(BLOCK_LINEARS) + ")"

# (regex on the underscored name after the prefix, dotted template)
DIT_MODULE_PATHS: tuple[tuple[str, str], ...] = (
    (rf"layers_(\d+)_proj_{BLOCK_LINEAR_PATTERN}", r"layers.\1.proj.\2"),
    (r"text_embedder_proj", "text_embedder.proj"),
    (rf"text_embedder_blocks_(\d+)_proj_{BLOCK_LINEAR_PATTERN}", r"text_embedder.blocks.\1.proj.\2"),
)
TEXT_ENCODER_MODULE_PATHS: tuple[tuple[str, str], ...] = (
    (r"layers_(\d+)_self_attn_(q|k|v|o)_proj", r"layers.\1.self_attn.\2_proj"),
    (r"layers_(\d+)_linear_attn_(in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj)", r"layers.\1.linear_attn.\2"),
    (r"layers_(\d+)_mlp_(gate|up|down)_proj", r"layers.\1.mlp.\2_proj"),
)
