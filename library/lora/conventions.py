"""The LoRA file conventions, written once: prefixes, module names, the alpha rule, key splitting, q/k/v, PEFT names.

Every part that reads or writes a LoRA file imports these facts from here: the network modules (`networks/`), the
load-time merge (`library.lora.merge`), the converter (`library.lora.convert`) and the identity of the text-encoder
part of `--base_weights` (`library.text_encoder.base_weights`).

sd-scripts naming (what the trainer writes; ComfyUI loads it directly):

- a module is named `<prefix>_<module path with "." as "_">`: `lora_unet_layers_3_proj_q` for the DiT's
  `layers.3.proj.q`, `lora_te_layers_3_self_attn_q_proj` for the Qwen3.5 text encoder (sd-scripts' single
  text-encoder naming, no index after `lora_te`);
- its tensors are `<name>.lora_down.weight` (rank x in), `<name>.lora_up.weight` (out x rank) and `<name>.alpha`;
- a LoHa module (`networks.loha`, LyCORIS' key names) has `<name>.hada_w1_a` (out x rank), `.hada_w1_b` (rank x in),
  `.hada_w2_a`, `.hada_w2_b` and `.alpha`; a LoKr module (`networks.lokr`) has `<name>.lokr_w1` or
  `.lokr_w1_a` / `.lokr_w1_b`, `<name>.lokr_w2` or `.lokr_w2_a` / `.lokr_w2_b`, and `.alpha`
  (`library.lora.weights` has the math of each). ComfyUI and LyCORIS read all three.

The alpha rule: a module's scale is alpha / rank, and an alpha that is missing or 0 means alpha = rank (scale 1), as
sd-scripts, LyCORIS and ComfyUI read it. (A LoKr module whose two factors are both full matrices has no rank: its
scale is 1.)

PEFT naming (diffusers / ComfyUI): `diffusion_model.<path>` (ComfyUI) or `transformer.<path>` (diffusers) for the DiT,
`text_encoder.<path>` for the text encoder, with `.lora_A.weight` (= lora_down), `.lora_B.weight` (= lora_up) and an
optional `.alpha`.

q / k / v: the trainer's modules are separate `proj.q`, `proj.k`, `proj.v`; ComfyUI's single-file DiT fuses them into
`proj.qkv` (rows q | k | v). A LoRA made for the fused module splits exactly into the three: they share lora_down and
alpha, and lora_up is cut into three row blocks (a LoHa likewise: hada_w1_a and hada_w2_a are cut, the rest shared).
A LoKr of a fused module does not split into three LoKr modules. The other way, `fuse_qkv` writes the three as one
`..._proj_qkv` module (the key ComfyUI's generic LoRA loader gives its fused Linear) that merges to the same weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from library.errors import UserError

LORA_PREFIX_UNET = "lora_unet"  # the DiT (sd-scripts calls the denoiser "unet")
LORA_PREFIX_TEXT_ENCODER = "lora_te"  # the Qwen3.5 text encoder
LORA_PREFIXES = (LORA_PREFIX_UNET, LORA_PREFIX_TEXT_ENCODER)

LORA_DOWN = "lora_down.weight"
LORA_UP = "lora_up.weight"
ALPHA = "alpha"
LORA_SUFFIXES = (LORA_DOWN, LORA_UP, ALPHA)
LOHA_TENSORS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOKR_TENSORS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
MODULE_SUFFIXES = (*LORA_SUFFIXES, *LOHA_TENSORS, *LOKR_TENSORS)

# the algorithms a module file can hold: its tensors (without alpha) and the name users know it by
ALGORITHM_TENSORS = {"lora": (LORA_DOWN, LORA_UP), "loha": LOHA_TENSORS, "lokr": LOKR_TENSORS}
ALGORITHM_LABELS = {"lora": "LoRA", "loha": "LoHa", "lokr": "LoKr"}

PEFT_DIT_PREFIXES = {"comfyui": "diffusion_model.", "diffusers": "transformer."}
PEFT_TEXT_ENCODER_PREFIX = "text_encoder."
PEFT_SUFFIXES = {".lora_A.weight": LORA_DOWN, ".lora_B.weight": LORA_UP, ".alpha": ALPHA}

# the keys of a text-encoder module in either naming (sd-scripts, PEFT)
TEXT_ENCODER_KEY_PREFIXES = (LORA_PREFIX_TEXT_ENCODER + "_", PEFT_TEXT_ENCODER_PREFIX)

FUSED_QKV = "qkv"
QKV_PARTS = ("q", "k", "v")

ModuleKey = tuple[str, str]  # (prefix, module name after the prefix), e.g. ("lora_unet", "layers_0_proj_q")


def prefix_for(is_unet: bool) -> str:
    """`lora_unet` for a DiT module, `lora_te` for a text-encoder module."""
    return LORA_PREFIX_UNET if is_unet else LORA_PREFIX_TEXT_ENCODER


def lora_name_for(prefix: str, module_path: str) -> str:
    """`("lora_unet", "layers.3.proj.q")` -> `"lora_unet_layers_3_proj_q"`."""
    return f"{prefix}_{module_path}".replace(".", "_")


def lora_name_for_weight(prefix: str, model_key: str) -> str | None:
    """`("lora_unet", "layers.3.proj.q.weight")` -> `"lora_unet_layers_3_proj_q"`; None for a key that is no weight."""
    if not model_key.endswith(".weight"):
        return None
    return lora_name_for(prefix, model_key[: -len(".weight")])


def effective_alpha(alpha: torch.Tensor | float | None, rank: int) -> float:
    """The alpha a module means: its own, or the rank when it is missing or 0."""
    if isinstance(alpha, torch.Tensor):
        alpha = float(alpha.detach().float().item())
    return float(rank) if alpha is None or alpha == 0 else float(alpha)


def alpha_scale(alpha: torch.Tensor | float | None, rank: int) -> float:
    """alpha / rank with the rule above."""
    return effective_alpha(alpha, rank) / rank


def is_sd_scripts_state_dict(sd: Mapping[str, torch.Tensor]) -> bool:
    """True when every key is an sd-scripts LoRA key (`lora_unet_...` / `lora_te_...`)."""
    return all(k.startswith(tuple(p + "_" for p in LORA_PREFIXES)) for k in sd)


def split_sd_key(key: str) -> tuple[str, str, str]:
    """`lora_unet_layers_0_proj_q.lora_down.weight` -> ("lora_unet", "layers_0_proj_q", "lora_down.weight")."""
    name, _, suffix = key.partition(".")
    for prefix in LORA_PREFIXES:
        if name.startswith(prefix + "_") and suffix in MODULE_SUFFIXES:
            return prefix, name[len(prefix) + 1 :], suffix
    raise UserError(
        f"LoRA key '{key}' is not an sd-scripts LoRA key (lora_unet_/lora_te_ + .lora_down.weight / .lora_up.weight /"
        " .alpha), not LoHa (.hada_w1_a ...) and not LoKr (.lokr_w1 ...): other adapters (LoCon convolutions, Tucker,"
        " DoRA, OFT, IA3 ...) are not supported."
    )


def module_algorithm(parts: Mapping[str, object], name: str, source: str | None = None) -> str:
    """"lora", "loha" or "lokr" for the tensors of one module (suffix -> tensor); a mixed or incomplete module is a
    UserError naming it."""
    of = f" of the LoRA {source}" if source else ""
    found = [a for a, tensors in ALGORITHM_TENSORS.items() if any(t in parts for t in tensors)]
    if len(found) != 1:
        what = " and ".join(ALGORITHM_LABELS[a] for a in found) if found else "only an alpha"
        raise UserError(f"LoRA module '{name}'{of} has {what} tensors: the file is damaged or not a LoRA file.")
    algorithm = found[0]
    if algorithm == "lora":
        complete = LORA_DOWN in parts and LORA_UP in parts
        needed = "lora_down or lora_up"
    elif algorithm == "loha":
        complete = all(t in parts for t in LOHA_TENSORS)
        needed = "one of hada_w1_a / hada_w1_b / hada_w2_a / hada_w2_b"
    else:
        complete = all("lokr_" + w in parts or all(f"lokr_{w}_{ab}" in parts for ab in "ab") for w in ("w1", "w2"))
        needed = "lokr_w1 (or lokr_w1_a and _b) or lokr_w2 (or lokr_w2_a and _b)"
    if not complete:
        raise UserError(f"LoRA module '{name}'{of} lacks {needed}: the file is incomplete.")
    return algorithm


def group_modules(
    sd: Mapping[str, torch.Tensor], source: str | None = None
) -> dict[ModuleKey, dict[str, torch.Tensor]]:
    """sd-scripts keys grouped by module: {(prefix, name): {suffix: tensor}}; an incomplete module is a UserError."""
    groups: dict[ModuleKey, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        prefix, name, suffix = split_sd_key(key)
        groups.setdefault((prefix, name), {})[suffix] = value
    for (prefix, name), parts in groups.items():
        module_algorithm(parts, f"{prefix}_{name}", source)
    return groups


def split_peft_key(key: str) -> tuple[str, str, str]:
    """`diffusion_model.layers.0.proj.q.lora_A.weight` -> ("lora_unet", "layers.0.proj.q", "lora_down.weight")."""
    for peft_suffix, sd_suffix in PEFT_SUFFIXES.items():
        if not key.endswith(peft_suffix):
            continue
        head = key[: -len(peft_suffix)]
        for peft_prefix, sd_prefix in (
            *((p, LORA_PREFIX_UNET) for p in PEFT_DIT_PREFIXES.values()),
            (PEFT_TEXT_ENCODER_PREFIX, LORA_PREFIX_TEXT_ENCODER),
        ):
            if head.startswith(peft_prefix) and len(head) > len(peft_prefix):
                return sd_prefix, head[len(peft_prefix) :], sd_suffix
    raise UserError(
        f"LoRA key '{key}' is neither sd-scripts (lora_unet_/lora_te_) nor PEFT (diffusion_model./transformer./"
        "text_encoder. + .lora_A.weight / .lora_B.weight / .alpha): this file is not a MOSS-Image LoRA this tool knows."
    )


# per algorithm: the tensors cut into row blocks when a fused q/k/v module is split (the others are shared)
_QKV_ROW_TENSORS = {"lora": (LORA_UP,), "loha": ("hada_w1_a", "hada_w2_a")}


def split_fused_qkv(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """sd-scripts keys with any `..._proj_qkv` DiT module split into `_proj_q`, `_proj_k`, `_proj_v` (same math)."""
    out = dict(sd)
    names = {k.partition(".")[0] for k in sd}
    fused = sorted(n for n in names if n.startswith(LORA_PREFIX_UNET + "_") and n.endswith("_proj_" + FUSED_QKV))
    for name in fused:
        parts = {k.partition(".")[2]: out.pop(k) for k in [k for k in out if k.partition(".")[0] == name]}
        algorithm = module_algorithm(parts, name)
        if algorithm not in _QKV_ROW_TENSORS:
            raise UserError(
                f"LoRA module '{name}' is a {ALGORITHM_LABELS[algorithm]} of a fused q/k/v module, which does not split"
                " into q / k / v modules: train it for the separate proj.q / proj.k / proj.v modules instead."
            )
        rows = _QKV_ROW_TENSORS[algorithm]
        if any(parts[r].shape[0] % len(QKV_PARTS) for r in rows):
            raise UserError(
                f"LoRA module '{name}' has {parts[rows[0]].shape[0]} output rows, not a multiple of 3: it is not a"
                " fused q/k/v."
            )
        stem = name[: -len(FUSED_QKV)]
        for i, part in enumerate(QKV_PARTS):
            for suffix, tensor in parts.items():
                piece = tensor.chunk(len(QKV_PARTS), dim=0)[i] if suffix in rows else tensor
                out[f"{stem}{part}.{suffix}"] = piece.clone()
    return out


# per algorithm: the tensors that become block-diagonal when q / k / v are fused (the others are stacked by rank)
_QKV_BLOCK_TENSORS = {"lora": (LORA_UP,), "loha": ("hada_w1_a", "hada_w2_a")}
_QKV_STACKED_TENSORS = {"lora": (LORA_DOWN,), "loha": ("hada_w1_b", "hada_w2_b")}
_QKV_SCALED_TENSOR = {"lora": LORA_UP, "loha": "hada_w1_a"}  # where a ratio of scales is folded in


def _rank_of(algorithm: str, parts: Mapping[str, torch.Tensor]) -> int:
    return int(parts[_QKV_STACKED_TENSORS[algorithm][0]].shape[0])


def fuse_qkv(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """sd-scripts keys with the `..._proj_q`, `_proj_k`, `_proj_v` DiT modules of each block fused into one
    `..._proj_qkv` module (rows q | k | v, ComfyUI's fused Linear), merging to exactly the same weights.

    With ranks r_q, r_k, r_v and scales s_i = alpha_i / r_i, the fused module has rank R = r_q + r_k + r_v: its
    lora_down is the three downs stacked (R x in), its lora_up block-diagonal (3 out x R), so row block i of
    up @ down is up_i @ down_i. Its alpha is s_q * R (scale s_q); a part whose scale differs gets s_i / s_q folded into
    its up block (written in fp32 then). A missing part (excluded by a pattern) is a block of zero rows. LoHa modules
    fuse the same way (w1_a, w2_a block-diagonal, w1_b, w2_b stacked); LoKr modules do not fuse and are refused.
    The inverse is `split_fused_qkv` (it gives rank-R parts that merge to the same weights)."""
    out = dict(sd)
    stems: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key in sd:
        name, _, suffix = key.partition(".")
        if not name.startswith(LORA_PREFIX_UNET + "_"):
            continue
        stem, _, part = name.rpartition("_proj_")
        if stem and part in QKV_PARTS:
            stems.setdefault(stem + "_proj_", {}).setdefault(part, {})[suffix] = out.pop(key)
    for stem, modules in sorted(stems.items()):
        fused = _fuse_parts(stem, modules)
        out.update({f"{stem}{FUSED_QKV}.{suffix}": t for suffix, t in fused.items()})
    return out


def _fuse_parts(stem: str, modules: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    algorithms = {part: module_algorithm(parts, stem + part) for part, parts in modules.items()}
    kinds = set(algorithms.values())
    if len(kinds) != 1 or next(iter(kinds)) not in _QKV_BLOCK_TENSORS:
        labels = " / ".join(sorted({ALGORITHM_LABELS[a] for a in kinds}))
        raise UserError(
            f"LoRA modules '{stem}q/k/v' are {labels}: only LoRA or LoHa q / k / v modules of one kind fuse into one"
            " qkv module; keep the separate q / k / v modules (target comfyui or sd-scripts)."
        )
    algorithm = next(iter(kinds))
    present = [p for p in QKV_PARTS if p in modules]
    blocks, stacked = _QKV_BLOCK_TENSORS[algorithm], _QKV_STACKED_TENSORS[algorithm]
    outs = {int(modules[p][blocks[0]].shape[0]) for p in present}
    ins = {int(modules[p][stacked[0]].shape[1]) for p in present}
    if len(outs) != 1 or len(ins) != 1:
        raise UserError(
            f"LoRA modules '{stem}q/k/v' have different shapes: they are not the q / k / v of one attention."
        )
    rows = outs.pop()
    ranks = {p: _rank_of(algorithm, modules[p]) for p in present}
    total = sum(ranks.values())
    scales = {p: effective_alpha(modules[p].get(ALPHA), ranks[p]) / ranks[p] for p in present}
    reference = scales[present[0]]
    folded = any(scales[p] != reference for p in present)
    dtypes = {t.dtype for p in present for k, t in modules[p].items() if k != ALPHA}
    dtype = torch.float32 if folded or len(dtypes) != 1 else dtypes.pop()
    fused: dict[str, torch.Tensor] = {}
    for name in stacked:
        fused[name] = torch.cat([modules[p][name].to(dtype) for p in present], dim=0)
    for name in blocks:
        block = torch.zeros(rows * len(QKV_PARTS), total, dtype=dtype)
        column = 0
        for p in present:
            row = QKV_PARTS.index(p) * rows
            piece = modules[p][name]
            if folded and name == _QKV_SCALED_TENSOR[algorithm]:
                piece = piece.to(torch.float32) * (scales[p] / reference)
            block[row : row + rows, column : column + ranks[p]] = piece.to(dtype)
            column += ranks[p]
        fused[name] = block
    fused[ALPHA] = torch.tensor(reference * total, dtype=torch.float32)
    return fused
