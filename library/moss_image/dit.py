"""The MOSS-Image DiT: a single-stream transformer over [refined text tokens ; image tokens].

Reconstructed from the published facts (see docs/architecture.md): 42 blocks of width 3072 with per-block
`proj.{q,k,v,o,ffn_up_gate,ffn_down}` (252 Linears, 4,756,340,736 weights), shared adaLN modulation, a text embedder
(RMSNorm + projection 4096 -> 3072 + 2 refiner blocks), 3-axis RoPE and a modulated final layer.
Every choice is a field of `MossImageConfig`, so a checkpoint that differs is met by the config, not the code.

Dtype rule: activations follow the dtype of the model's float weights (`MossImage.dtype`, read from a weight that is
never quantised); a block Linear may hold int8 weights (ConvRot), so its weight dtype is never used for casting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.lora.compiled_group import plain_group, plain_group_parts
from library.lora.eager_node import lora_group, lora_group_parts
from library.moss_image.cfg_packing import PackedText, pack_texts, packed_forward
from library.moss_image.projections import BlockProjections
from library.moss_image.rope import RopeTables, apply_rope
from library.quant.convrot_ops import QuantizedRows, linear_from_codes
from library.quant.int8_stack import stacked_forward
from library.runtime.attention import Attention, Segments
from library.runtime.checkpointing import CHECKPOINTING_POLICIES, DEFAULT_CHECKPOINTING_POLICY, checkpointed
from library.runtime.eager_fusion import eager_fused
from library.runtime.fused_compiled import (
    codes_inference_applies,
    compiled_codes_on,
    compiled_kernel,
    epilogues_inference_apply,
    norm_modulate_applies,
    norm_rope_applies,
    norm_rope_shape_applies,
    op_linear_gated_residual,
    op_linear_norm_rope,
    op_norm_modulate,
    op_norm_modulate_codes,
    op_norm_rope,
    op_residual_norm_modulate_codes,
    op_swiglu,
    op_swiglu_codes,
    quantized_rows,
    quantized_segments,
    residual_codes_inference_applies,
    stacked_qkv_inference_applies,
    stacked_qkv_training_on,
    swiglu_applies,
)
from library.runtime.fused_ops import (
    fused_gated_residual,
    fused_norm_modulate,
    fused_norm_modulate_quant,
    fused_norm_rope,
    fused_swiglu,
    fused_swiglu_quant,
    gated_residual_usable,
    norm_modulate_quant_usable,
    norm_modulate_usable,
    norm_rope_usable,
    prepare_fused_quant,
    swiglu_quant_usable,
    swiglu_usable,
)
from library.runtime.fused_ops import prepare as prepare_fused_kernels

logger = logging.getLogger(__name__)


@dataclass
class MossImageConfig:
    """Architecture of the DiT; the defaults are the full 5B model."""

    hidden_size: int = 3072
    num_layers: int = 42
    num_heads: int = 24
    head_dim: int = 128
    ffn_hidden: int = 8192
    in_channels: int = 128
    text_dim: int = 4096
    num_refiner_layers: int = 2
    timestep_embed_dim: int = 256
    timestep_max_period: float = 10000.0
    rope_axes_dims: tuple[int, int, int] = (32, 48, 48)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.rope_axes_dims = tuple(int(d) for d in self.rope_axes_dims)  # type: ignore[assignment]
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(f"num_heads * head_dim ({self.num_heads} * {self.head_dim}) != hidden_size {self.hidden_size}")
        if sum(self.rope_axes_dims) != self.head_dim or any(d % 2 for d in self.rope_axes_dims):
            raise ValueError(f"rope_axes_dims {self.rope_axes_dims} must be even and sum to head_dim {self.head_dim}")

    # config.json keys of other spellings that mean our fields
    _ALIASES = {
        "num_attention_heads": "num_heads",
        "attention_head_dim": "head_dim",
        "intermediate_size": "ffn_hidden",
        "num_hidden_layers": "num_layers",
        "text_hidden_size": "text_dim",
        "caption_channels": "text_dim",
        "axes_dims_rope": "rope_axes_dims",
        "axes_dims": "rope_axes_dims",
        "theta": "rope_theta",
        "eps": "norm_eps",
    }

    def updated(self, overrides: Mapping[str, Any]) -> "MossImageConfig":
        """A copy with the fields named in `overrides` (e.g. a diffusers config.json) replaced; other keys are kept in
        `extra` and logged at debug level."""
        names = {f.name for f in dataclasses.fields(self)} - {"extra"}
        values = dataclasses.asdict(self)
        extra = dict(self.extra)
        for key, value in overrides.items():
            name = self._ALIASES.get(key, key)
            if name in names:
                values[name] = type(values[name])(value) if not isinstance(values[name], tuple) else tuple(value)
            else:
                extra[key] = value
        if extra:
            logger.debug("config keys not used by the model: %s", sorted(extra))
        values["extra"] = extra
        return MossImageConfig(**values)

    @property
    def block_linear_weights(self) -> int:
        """Weights in the Linears of the main blocks (the ConvRot INT8 scope)."""
        h, f = self.hidden_size, self.ffn_hidden
        return self.num_layers * (4 * h * h + 3 * h * f)


def default_rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Split a head into (text, row, column) RoPE axes of 1/4, 3/8, 3/8 (= (32, 48, 48) for 128), all even."""
    a = (head_dim // 4) // 2 * 2
    b = ((head_dim - a) // 2) // 2 * 2
    return a, b, head_dim - a - b


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 arithmetic either way: torch's rms_norm upcasts a bf16/fp16 input inside (one kernel on CUDA, which
        # keeps the bf16 input for backward instead of an fp32 copy); the plain form upcasts first. Autocast would
        # upcast the input before the op (its float32 list), so it is suspended around the call.
        if eager_fused() and self.weight.dtype == x.dtype:
            if not torch.is_autocast_enabled(x.device.type):
                return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
            with torch.autocast(x.device.type, enabled=False):
                return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        y = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return y.to(x.dtype)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float) -> torch.Tensor:
    """Sinusoidal embedding [cos | sin] of timesteps on the 0..1000 scale (sigma * 1000), computed in fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, cfg: MossImageConfig):
        super().__init__()
        self.cfg = cfg
        self.linear_1 = nn.Linear(cfg.timestep_embed_dim, cfg.hidden_size)
        self.linear_2 = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        emb = timestep_embedding(t, self.cfg.timestep_embed_dim, self.cfg.timestep_max_period).to(dtype)
        return self.linear_2(F.silu(self.linear_1(emb)))


def _plain_norm(module: nn.Module) -> bool:
    """Whether calling `module` runs `RMSNorm.forward` and nothing else (not a replacement or subclass of the norm,
    no replaced forward, no hooks): what a fused kernel may stand in for."""
    return (type(module) is RMSNorm and "forward" not in module.__dict__ and not module._forward_hooks
            and not module._forward_pre_hooks and not nn.modules.module._global_forward_hooks
            and not nn.modules.module._global_forward_pre_hooks)


def norm_rope(norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(norm(x), cos, sin) for the q/k of a block; in eager CUDA runs one Triton kernel each way
    (`library.runtime.fused_ops`), where the eager forms take four, and a compiled CUDA block the same kernels as
    ops (`library.runtime.fused_compiled`). A norm whose call does more than its forward
    (a hook, a wrapped forward) is called as it is."""
    if _plain_norm(norm):
        if eager_fused() and norm_rope_usable(x, norm.weight, cos, sin):
            return fused_norm_rope(x, norm.weight, cos, sin, norm.eps)
        if compiled_kernel("norm_rope", x) and norm_rope_applies(x, norm.weight, cos, sin):
            return op_norm_rope(x, norm.weight, cos, sin, norm.eps)
    return apply_rope(norm(x), cos, sin)


def swiglu(u: torch.Tensor, consumer: nn.Module | None = None) -> torch.Tensor | QuantizedRows:
    """silu(gate) * value of the FFN's up/gate output u = [value | gate]; in eager CUDA runs one Triton kernel each
    way (`library.runtime.fused_ops`), and a compiled CUDA block the same kernels as ops
    (`library.runtime.fused_compiled`). Where `consumer` (the Linear that reads the result) is a ConvRot INT8 Linear,
    the eager kernel also writes the int8 codes of the result's rows for it (`fused_swiglu_quant`), and a block
    compiled without gradients gives it those codes alone (`QuantizedRows`, see `_codes_group`)."""
    if eager_fused():
        group = _int8_group((consumer,)) if consumer is not None else None
        if group is not None and swiglu_quant_usable(u, group):
            return fused_swiglu_quant(u, group)
        if swiglu_usable(u):
            return fused_swiglu(u)
    group = _codes_group((consumer,), u) if consumer is not None else None
    if group is not None and swiglu_applies(u):
        return op_swiglu_codes(u, group)
    if compiled_kernel("swiglu", u) and swiglu_applies(u):
        return op_swiglu(u)
    value, gate = u.chunk(2, dim=-1)
    return F.silu(gate) * value


def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation h * (1 + scale) + shift, with shift/scale [B, W] broadcast over the tokens of h [B, S, W]."""
    if eager_fused():
        return torch.addcmul(shift[:, None], h, 1 + scale[:, None])
    return h * (1 + scale[:, None]) + shift[:, None]


def _int8_group(consumers: Sequence[nn.Module]) -> int | None:
    """The ConvRot rotation group that every one of `consumers` (the Linears that read a block input) takes its
    quantised input in from the activation cache, or None where one of them takes none (`eager_activation_group`)."""
    groups = {getattr(m, "eager_activation_group", lambda: None)() for m in consumers}
    return groups.pop() if len(groups) == 1 else None


def _codes_group(consumers: Sequence[nn.Module], x: torch.Tensor) -> int | None:
    """The ConvRot rotation group in which every one of `consumers` takes x as its codes alone, in a block being
    compiled without gradients (`fused_compiled.codes_inference_applies`, `ConvRotInt8Linear.codes_group`); None
    elsewhere."""
    if not codes_inference_applies(x):
        return None
    groups = {getattr(m, "codes_group", lambda: None)() for m in consumers}
    return groups.pop() if len(groups) == 1 else None


def project(linear: nn.Module, h: torch.Tensor | QuantizedRows) -> torch.Tensor:
    """linear(h), or for h given as its codes (`QuantizedRows`) the int8 Linear's product of them."""
    return linear.forward_codes(h) if isinstance(h, QuantizedRows) else linear(h)


def norm_modulate(norm: RMSNorm, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                  consumers: Sequence[nn.Module] = ()) -> torch.Tensor | QuantizedRows:
    """modulate(norm(x), shift, scale) for a block input; in eager CUDA runs one Triton kernel each way
    (`library.runtime.fused_ops`), where the eager forms take two or three (a compiled block leaves it to inductor
    unless `set_compiled_kernels(norm_modulate=True)`). Where every one of `consumers` (the Linears that read the
    result) is a ConvRot INT8 Linear, the kernel also writes the int8 codes of the result's rows for them
    (`fused_norm_modulate_quant`), and a block compiled without gradients gives them those codes alone
    (`QuantizedRows`, see `_codes_group`). A norm whose call does more than its forward (a hook, a wrapped forward)
    is called as it is."""
    if _plain_norm(norm):
        if eager_fused():
            group = _int8_group(consumers) if consumers else None
            if group is not None and norm_modulate_quant_usable(x, norm.weight, shift, scale, group):
                return fused_norm_modulate_quant(x, norm.weight, shift, scale, norm.eps, group)
            if norm_modulate_usable(x, norm.weight, shift, scale):
                return fused_norm_modulate(x, norm.weight, shift, scale, norm.eps)
        group = _codes_group(consumers, x) if consumers else None
        if group is not None and norm_modulate_applies(x, norm.weight, shift, scale):
            return op_norm_modulate_codes(x, norm.weight, shift, scale, norm.eps, group)
        if compiled_kernel("norm_modulate", x) and norm_modulate_applies(x, norm.weight, shift, scale):
            return op_norm_modulate(x, norm.weight, shift, scale, norm.eps)
    return modulate(norm(x), shift, scale)


def gated_project(linear: nn.Module, inp: torch.Tensor | QuantizedRows, x: torch.Tensor,
                  gate: torch.Tensor) -> torch.Tensor:
    """gated_residual(x, gate, linear(inp)); in a block compiled without gradients, where `linear` is a ConvRot INT8
    Linear without bias that takes its input as codes (`_codes_group`) and `inference_epilogues` is on (off by
    default), the product and the residual are one kernel (`fused_compiled.op_linear_gated_residual`)."""
    fused = getattr(linear, "bias", None) is None and epilogues_inference_apply()
    group = _codes_group((linear,), x) if fused else None
    if (group is not None and x.dim() == 3 and gate.shape == (x.shape[0], x.shape[-1])
            and gate.dtype == x.dtype and inp.dtype == x.dtype):
        rows = inp if isinstance(inp, QuantizedRows) else quantized_rows(inp, group)
        return op_linear_gated_residual(linear, rows, x, gate)
    return gated_residual(x, gate, project(linear, inp))


def gated_project_norm_modulate(linear: nn.Module, inp: torch.Tensor | QuantizedRows, x: torch.Tensor,
                                gate: torch.Tensor, norm: RMSNorm, shift: torch.Tensor, scale: torch.Tensor,
                                consumers: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | QuantizedRows]:
    """(x', norm_modulate(norm, x', shift, scale, consumers)) for x' = gated_project(linear, inp, x, gate): the
    attention branch's residual and the FFN's input. In a block compiled without gradients whose `consumers` take
    their input as codes, the residual and the codes are one op (`fused_compiled.op_residual_norm_modulate_codes`),
    so x' is written once and not read back."""
    group = _codes_group(consumers, x) if _plain_norm(norm) else None
    if (group is not None and residual_codes_inference_applies(x, gate)
            and norm_modulate_applies(x, norm.weight, shift, scale)):
        y = project(linear, inp)
        if y.shape == x.shape and y.dtype == x.dtype:
            return op_residual_norm_modulate_codes(x, gate, y, norm.weight, shift, scale, norm.eps, group)
        x = gated_residual(x, gate, y)
    else:
        x = gated_project(linear, inp, x, gate)
    return x, norm_modulate(norm, x, shift, scale, consumers)


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + gate * y, with gate [B, W] broadcast over the tokens; in eager CUDA runs one Triton kernel each way
    (`library.runtime.fused_ops`), where torch's broadcasting addcmul is about half as fast."""
    if eager_fused():
        if gated_residual_usable(x, gate, y):
            return fused_gated_residual(x, gate, y)
        return torch.addcmul(x, gate[:, None], y)
    return x + gate[:, None] * y


class MossImageBlock(nn.Module):
    """Pre-norm attention + SwiGLU block; adaLN-modulated in the main stack, plain in the text refiner."""

    def __init__(self, cfg: MossImageConfig, modulated: bool, attention: Attention):
        super().__init__()
        self.cfg = cfg
        self.modulated = modulated
        self.attention = attention
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.proj = BlockProjections(cfg)
        if modulated:
            self.scale_shift_table = nn.Parameter(torch.zeros(6, cfg.hidden_size))
        # "full" | "selective": checkpointed inside forward, so that a compiled block compiles its checkpoint (set by
        # MossImage.enable_gradient_checkpointing; None: not checkpointed here)
        self.checkpointing: str | None = None

    def _qkv(self, h: torch.Tensor | QuantizedRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of h: one autograd node for the three where each is a LoRA-wrapped Linear that runs as one
        (`library.lora.eager_node.LoRAGroup`, eager mode), their LoRA down-projections as one product in a compiled
        block and in the plain forms (`library.lora.compiled_group`), else the three Linears (of h's codes where the
        norm gave those)."""
        linears = (self.proj.q, self.proj.k, self.proj.v)
        if isinstance(h, QuantizedRows):
            return project(linears[0], h), project(linears[1], h), project(linears[2], h)
        if eager_fused():
            parts = lora_group_parts(linears, h)
            if parts is not None:
                q, k, v = lora_group(h, parts)
                return q, k, v
        else:  # compiled, or the plain forms in eager mode (what a compiled block computes)
            plain = plain_group_parts(linears, h)
            if plain is not None:
                q, k, v = plain_group(h, plain, self._stacked_bases(plain, h))
                return q, k, v
        return self.proj.q(h), self.proj.k(h), self.proj.v(h)

    def _stacked_bases(self, parts: Sequence[Any], h: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The base products of q, k and v's LoRA group as one product over their stacked ConvRot INT8 weight
        (`int8_stack.stacked_forward`), where `training_stacked_qkv` is on, they are stacked and each part's base is
        its Linear's own forward; None: each part runs its base."""
        stack = self.proj.qkv_stack()
        if stack is None or not stacked_qkv_training_on():
            return None
        linears = (self.proj.q, self.proj.k, self.proj.v)
        if any(part.own_base is not linear for part, linear in zip(parts, linears)):
            return None
        return stacked_forward(h, *stack, linears[0], self.proj.stack_plans).chunk(3, dim=-1)

    def _attention(self, h: torch.Tensor | QuantizedRows, cos: torch.Tensor, sin: torch.Tensor,
                   key_mask: torch.Tensor | Segments | None) -> torch.Tensor | QuantizedRows:
        """The attention branch up to `o` (its input, [B, S, W], or its codes: `_attend`)."""
        if isinstance(h, QuantizedRows):
            shape = (*h.lead_shape[:2], self.cfg.num_heads, self.cfg.head_dim)
            stack = self.proj.qkv_stack()
            if stack is not None and stacked_qkv_inference_applies():  # one product for the three
                q, k, v = (t.view(shape) for t in linear_from_codes(h, *stack, None).chunk(3, dim=-1))
                q = norm_rope(self.q_norm, q, cos, sin)
                k = norm_rope(self.k_norm, k, cos, sin)
                return self._attend(q, k, v, key_mask)
            q = self._head_codes(self.proj.q, self.q_norm, h, cos, sin, shape)
            k = self._head_codes(self.proj.k, self.k_norm, h, cos, sin, shape)
            v = project(self.proj.v, h).view(shape)
        else:
            q, k, v = self._qkv(h)
            shape = (*q.shape[:2], self.cfg.num_heads, self.cfg.head_dim)
            q = norm_rope(self.q_norm, q.view(shape), cos, sin)
            k = norm_rope(self.k_norm, k.view(shape), cos, sin)
            v = v.view(shape)
        return self._attend(q, k, v, key_mask)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | Segments | None
                ) -> torch.Tensor | QuantizedRows:
        """Attention of [B, S, H, D] q, k and v as [B, S, W]; of packed sequences (`Segments`) in a block compiled
        without gradients whose `o` takes its input as codes, those codes, each sequence's written in place (no
        concatenation of the outputs)."""
        if isinstance(key_mask, tuple) and q.shape[0] == 1:
            group = _codes_group((self.proj.o,), q)
            if group is not None:
                outs = self.attention.segment_outputs(q, k, v, key_mask)
                return quantized_segments([o.flatten(2) for o in outs], group)
        return self.attention(q, k, v, key_mask).flatten(2)

    @staticmethod
    def _head_codes(linear: nn.Module, norm: RMSNorm, h: QuantizedRows, cos: torch.Tensor, sin: torch.Tensor,
                    shape: tuple) -> torch.Tensor:
        """norm_rope(norm, linear(h)) for q or k given h's codes: one kernel for the product, the head norm and RoPE
        (`fused_compiled.op_linear_norm_rope`) where `inference_epilogues` is on (off by default), the norm is plain
        and the Linear has no bias."""
        if (epilogues_inference_apply() and _plain_norm(norm) and getattr(linear, "bias", None) is None
                and len(h.lead_shape) == 2
                and norm_rope_shape_applies(shape, h.dtype, norm.weight, cos, sin)):
            return op_linear_norm_rope(linear, h, norm.weight, cos, sin, norm.eps)
        return norm_rope(norm, project(linear, h).view(shape), cos, sin)

    def _attn(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_mask: torch.Tensor | Segments | None
              ) -> torch.Tensor:
        return project(self.proj.o, self._attention(h, cos, sin, key_mask))

    def _ffn(self, h: torch.Tensor | QuantizedRows) -> torch.Tensor:
        return project(self.proj.ffn_down, swiglu(project(self.proj.ffn_up_gate, h), self.proj.ffn_down))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_mask: torch.Tensor | Segments | None,
        mod: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # only a block that takes part in backward is checkpointed (a compiled graph with nothing to differentiate
        # must not carry recompute tags); the trainer makes the noisy latents require grad under checkpointing
        if self.checkpointing is not None and torch.is_grad_enabled() and x.requires_grad:
            return checkpointed(self._forward, self.checkpointing, x, cos, sin, key_mask, mod)
        return self._forward(x, cos, sin, key_mask, mod)

    def _forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_mask: torch.Tensor | Segments | None,
        mod: torch.Tensor | None,
    ) -> torch.Tensor:
        if not self.modulated:
            x = x + self._attn(self.norm1(x), cos, sin, key_mask)
            return x + self._ffn(self.norm2(x))
        assert mod is not None
        shift1, scale1, gate1, shift2, scale2, gate2 = (mod + self.scale_shift_table.to(mod.dtype)[None]).unbind(1)
        proj = self.proj
        h = norm_modulate(self.norm1, x, shift1, scale1, (proj.q, proj.k, proj.v))
        x, h = gated_project_norm_modulate(proj.o, self._attention(h, cos, sin, key_mask), x, gate1, self.norm2,
                                           shift2, scale2, (proj.ffn_up_gate,))
        return gated_project(proj.ffn_down, swiglu(project(proj.ffn_up_gate, h), proj.ffn_down), x, gate2)


class MossImageTextEmbedder(nn.Module):
    """Qwen3.5 hidden states [B, T, 4096] -> DiT width, refined by blocks that attend over the text only."""

    def __init__(self, cfg: MossImageConfig, attention: Attention):
        super().__init__()
        self.norm = RMSNorm(cfg.text_dim, cfg.norm_eps)
        self.proj = nn.Linear(cfg.text_dim, cfg.hidden_size)
        self.blocks = nn.ModuleList(MossImageBlock(cfg, False, attention) for _ in range(cfg.num_refiner_layers))


class FinalLayer(nn.Module):
    def __init__(self, cfg: MossImageConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=False, eps=cfg.norm_eps)
        self.modulation = nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size)
        self.linear = nn.Linear(cfg.hidden_size, cfg.in_channels)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation(F.silu(t_emb)).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


def _run_offloaded(block: nn.Module, x: torch.Tensor, *args: Any) -> torch.Tensor:
    if not x.requires_grad and any(p.requires_grad for p in block.parameters()):
        x = x.detach().requires_grad_(True)  # connects the block's trainable (LoRA) parameters to the graph
    return _UnslothOffload.apply(block, x, *args)


class _UnslothOffload(torch.autograd.Function):
    """Keep only the block input, parked in host memory (async copy); recompute the block in backward."""

    @staticmethod
    def forward(ctx, block: nn.Module, x: torch.Tensor, *args: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.block = block
        ctx.device = x.device
        ctx.args = args
        ctx.x_requires_grad = x.requires_grad
        pin = x.device.type == "cuda"
        ctx.saved_x = x.detach().to("cpu", non_blocking=pin) if x.device.type != "cpu" else x.detach().clone()
        with torch.no_grad():
            return block(x, *args)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        x = ctx.saved_x.to(ctx.device, non_blocking=True).requires_grad_(ctx.x_requires_grad)
        args = [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in ctx.args]
        with torch.enable_grad():
            out = ctx.block(x, *args)
        # a plain backward through the recomputed block: every trainable tensor it used accumulates its gradient,
        # its own parameters and those routed into its layers from outside (the LoRA modules live in the network)
        if out.requires_grad:
            torch.autograd.backward(out, grad_out)
        arg_grads = [a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args]
        return (None, x.grad if x.requires_grad else None, *arg_grads)


@dataclass
class TextConditioning:
    """What a forward computes from the text and the latent size alone (`MossImage.prepare_text`): the refined text
    tokens, the RoPE tables of the joint sequence and the key mask. Independent of the latents and the timestep, so
    the sampler computes it once per image instead of once per pass."""

    tokens: torch.Tensor  # refined text tokens [B, T, hidden]
    cos: torch.Tensor  # RoPE of [text ; image] tokens [B, T + h*w, head_dim/2], fp32
    sin: torch.Tensor
    key_mask: torch.Tensor | None  # [B, T + h*w], True = attend; None when no text token is padding
    grid: tuple[int, int]  # (h, w) of the latents it was prepared for


def text_lengths(attn_mask: torch.Tensor | None, batch: int, t_pad: int) -> list[int]:
    """Valid text tokens per sample as host integers. A mask on the host costs no device sync; a mask on a device is
    copied to the host once (pass host masks to keep the step free of syncs)."""
    if attn_mask is None:
        return [t_pad] * batch
    host = attn_mask if attn_mask.device.type == "cpu" else attn_mask.cpu()
    return host.to(torch.bool).sum(dim=1).tolist()


class MossImage(nn.Module):
    """forward(x [B,128,H/16,W/16], timesteps [B] = sigma*1000 (fp32), prompt_embeds [B,T,4096], attn_mask [B,T]).

    A forward is `prepare_text` (text embedding, text refiner, RoPE, masks) followed by `forward_with_text` (image and
    timestep embedding, the 42 blocks, the final layer); the sampler calls the two parts itself so that the first runs
    once per image."""

    # methods compiled whole by compile_regions (besides every block)
    COMPILED_REGIONS = ("_embed_text", "_embed_image_and_time", "_final")

    def __init__(self, config: MossImageConfig | None = None, attn_mode: str = "torch", split_attn: bool = False):
        super().__init__()
        cfg = config or MossImageConfig()
        self.config = cfg
        self.attention = Attention(attn_mode, split_attn)
        self.video_embedder = nn.Linear(cfg.in_channels, cfg.hidden_size)
        self.t_embedder = TimestepEmbedder(cfg)
        self.modulation = nn.Linear(cfg.hidden_size, 6 * cfg.hidden_size)
        self.text_embedder = MossImageTextEmbedder(cfg, self.attention)
        self.layers = nn.ModuleList(MossImageBlock(cfg, True, self.attention) for _ in range(cfg.num_layers))
        self.final_layer = FinalLayer(cfg)
        self.gradient_checkpointing = False
        self.checkpoint_mode = "none"  # none | plain | cpu_offload | unsloth
        self.checkpoint_policy = DEFAULT_CHECKPOINTING_POLICY  # full | selective (plain mode)
        self._block_offloader: Any = None  # library.memory.block_swap.ModelOffloader when block swap is on
        self.rope = RopeTables(cfg.rope_axes_dims, cfg.rope_theta)
        self._compiled: dict[str, Callable[..., Any]] = {}  # COMPILED_REGIONS name -> torch.compile'd method
        self._qkv_stacked = False  # some block holds a q/k/v stack (`stack_qkv_weights`)

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def dtype(self) -> torch.dtype:
        return self.video_embedder.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.video_embedder.weight.device

    def _blocks(self) -> list[MossImageBlock]:
        """The text refiner blocks and the main blocks."""
        return [*self.text_embedder.blocks, *self.layers]

    # ------------------------------------------------------------------------------------- checkpointing switch
    def enable_gradient_checkpointing(self, cpu_offload: bool = False, unsloth_offload: bool = False,
                                      policy: str = DEFAULT_CHECKPOINTING_POLICY, skip_blocks: int = 0) -> None:
        """Recompute each block in backward. `policy` ("full" or "selective", `library.runtime.checkpointing`) says
        what a block keeps; the block checkpoints itself, so a compiled block compiles its checkpoint. `cpu_offload`
        keeps the saved block inputs in host memory; `unsloth_offload` parks each block input in host memory
        asynchronously and recomputes the block. Both keep only the block inputs (policy "full"). `skip_blocks`
        (plain mode): the last that many main blocks are not checkpointed (they keep every activation)."""
        if not 0 <= skip_blocks <= len(self.layers):
            raise ValueError(f"skip_blocks {skip_blocks} must be between 0 and the {len(self.layers)} DiT blocks")
        if skip_blocks and (cpu_offload or unsloth_offload):
            raise ValueError("skip_blocks applies to the plain checkpointing mode only")
        if cpu_offload and unsloth_offload:
            raise ValueError("cpu_offload and unsloth_offload are exclusive")
        if policy not in CHECKPOINTING_POLICIES:
            raise ValueError(f"unknown checkpointing policy {policy!r}: choose one of {CHECKPOINTING_POLICIES}")
        if policy != DEFAULT_CHECKPOINTING_POLICY and (cpu_offload or unsloth_offload):
            raise ValueError(f"checkpointing policy {policy!r} does not apply to the offloaded modes")
        self.gradient_checkpointing = True
        self.checkpoint_mode = "unsloth" if unsloth_offload else "cpu_offload" if cpu_offload else "plain"
        self.checkpoint_policy = policy
        kept = set(map(id, self.layers[len(self.layers) - skip_blocks:])) if skip_blocks else set()
        for block in self._blocks():
            block.checkpointing = policy if self.checkpoint_mode == "plain" and id(block) not in kept else None
        shown = self.checkpoint_mode if policy == DEFAULT_CHECKPOINTING_POLICY else f"{self.checkpoint_mode} ({policy})"
        if skip_blocks:
            shown += f", the last {skip_blocks} of {len(self.layers)} blocks not checkpointed"
        logger.info("DiT gradient checkpointing: %s", shown)

    def disable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = False
        self.checkpoint_mode = "none"
        self.checkpoint_policy = DEFAULT_CHECKPOINTING_POLICY
        for block in self._blocks():
            block.checkpointing = None

    def _run_block(self, block: nn.Module, x: torch.Tensor, *args: Any) -> torch.Tensor:
        """One block; the offloaded checkpointing modes wrap it here (the plain mode is inside the block)."""
        if self.checkpoint_mode in ("none", "plain") or not torch.is_grad_enabled():
            return block(x, *args)
        if self.checkpoint_mode == "unsloth":
            return _run_offloaded(block, x, *args)
        with torch.autograd.graph.save_on_cpu(pin_memory=x.device.type == "cuda"):
            return checkpointed(block, DEFAULT_CHECKPOINTING_POLICY, x, *args)

    # ------------------------------------------------------------------------------------------------ compile
    def compile_regions(self, **options: Any) -> None:
        """`torch.compile(**options)` of every block (in place: module names and state dict keys stay; the blocks
        share their compiled code) and of the embedders and the final layer (COMPILED_REGIONS). Block swap, skipped
        blocks and the offloaded checkpointing modes stay in the uncompiled block loop."""
        for block in self._blocks():
            block.compile(**options)
        for name in self.COMPILED_REGIONS:
            self._compiled[name] = torch.compile(getattr(self, name), **options)

    def _region(self, name: str) -> Callable[..., Any]:
        return self._compiled.get(name) or getattr(self, name)

    def repeated_calls(self) -> contextlib.AbstractContextManager[Any]:
        """A context for forwards that repeat earlier ones call for call (the sampler's steps after its first: the
        same shapes, dtypes, devices, weights and grad mode; only tensor values change). With compiled regions,
        dynamo then checks only the guards that tell its compiled graphs apart
        (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`), not every guard of every block call: their host
        time went from 61-73 to 30 us a block call on an H200's host, which counts where a pass is host-bound (small
        images, slow hosts; a 1024x1024 INT8 pass on the H200 no longer is). Without them (eager), nothing."""
        if not self._compiled:
            return contextlib.nullcontext()
        try:
            return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        except TypeError:  # a torch whose set_stance has no such flag: every guard, as before
            return contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------------ block swap
    def enable_block_swap(self, num_blocks: int, config: Any) -> None:
        """Swap `num_blocks` of the main blocks between host memory and the GPU (`library.memory.block_swap`); `config` is
        a `BlockSwapConfig`. The base weights must be frozen first."""
        from library.memory.block_swap import ModelOffloader

        self.unstack_qkv_weights()  # the offloader replaces the blocks' tensors
        self._block_offloader = ModelOffloader(list(self.layers), num_blocks, config, name="DiT")

    @property
    def block_offloader(self) -> Any:
        return self._block_offloader

    def move_to_device_except_swap_blocks(self, device: str | torch.device) -> None:
        """Move everything but the swapped blocks (which the offloader places) to `device`."""
        off = self._block_offloader
        if off is None:
            self.to(device)
            return
        for child in self.children():
            if child is not self.layers:
                child.to(device)
        for i, block in enumerate(self.layers):
            if i not in off.position:
                block.to(device)

    def prepare_block_swap_before_forward(self) -> None:
        """Arm the swap ring for the next forward (a no-op when it is armed or block swap is off)."""
        if self._block_offloader is not None:
            self._block_offloader.prepare_before_forward()

    # ------------------------------------------------------------------------------------------- stacked q/k/v
    def stack_qkv_weights(self) -> int:
        """Make each main block's q, k and v views of one stacked weight (`BlockProjections.stack_qkv`: ConvRot int8
        Linears only; no more memory once done), so that blocks compiled for inference run one product for the three.
        For a model in its final place: moving it, or block swap, drops the stacks. Returns how many blocks were
        stacked (0 with block swap on, or where the Linears are not int8)."""
        if self._block_offloader is not None:
            return 0
        stacked = sum(block.proj.stack_qkv() for block in self.layers)
        self._qkv_stacked = stacked > 0
        if stacked:
            logger.info("q, k and v stacked into one int8 weight in %d of %d blocks", stacked, len(self.layers))
        return stacked

    def unstack_qkv_weights(self) -> None:
        """Drop every block's q/k/v stack (the blocks compiled for inference then run three products)."""
        for block in self.layers:
            block.proj.unstack_qkv()
        self._qkv_stacked = False

    def _check_qkv_stacks(self) -> None:
        """Drop the stacks that q, k and v no longer read from (`BlockProjections.check_qkv_stack`)."""
        self._qkv_stacked = sum(block.proj.check_qkv_stack() for block in self.layers) > 0

    # ------------------------------------------------------------------------------------------------- forward
    def _embed_text(self, prompt_embeds: torch.Tensor) -> torch.Tensor:
        return self.text_embedder.proj(self.text_embedder.norm(prompt_embeds))

    def _embed_image_and_time(self, x: torch.Tensor, timesteps: torch.Tensor,
                              text_tokens: torch.Tensor | tuple[torch.Tensor, ...]
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequence [text ; image tokens], timestep embedding, shared modulation [B, 6, hidden]); for several texts
        (`cfg_packing`), the packed sequence [text_1 ; image ; text_2 ; image ...]."""
        dtype = self.dtype
        img = self.video_embedder(x.to(dtype).flatten(2).transpose(1, 2))
        t_emb = self.t_embedder(timesteps, dtype)
        mod = self.modulation(F.silu(t_emb)).unflatten(-1, (6, self.config.hidden_size))
        texts = (text_tokens,) if isinstance(text_tokens, torch.Tensor) else text_tokens
        return torch.cat([part for text in texts for part in (text, img)], dim=1), t_emb, mod

    def _final(self, seq: torch.Tensor, t_emb: torch.Tensor, t_pad: int, h: int, w: int) -> torch.Tensor:
        out = self.final_layer(seq[:, t_pad:], t_emb)
        return out.transpose(1, 2).reshape(out.shape[0], self.config.in_channels, h, w)

    def prepare_text(self, prompt_embeds: torch.Tensor, attn_mask: torch.Tensor | None, grid: tuple[int, int]
                     ) -> TextConditioning:
        """The timestep-independent part of a forward for latents of `grid` = (h, w). The padding decision and the
        text lengths are read from the mask on the host (see `text_lengths`), so no device sync happens here."""
        h, w = int(grid[0]), int(grid[1])
        device = self.device
        if self._qkv_stacked:  # once per image: the sampler's passes then run with what is checked here
            self._check_qkv_stacks()
        if eager_fused():  # the kernels' one check per device (compiled blocks call them too: fused_compiled), here
            prepare_fused_kernels(device)  # outside any checkpointed or compiled code
            # ConvRot INT8 blocks: the own check of the kernels that write codes (under inference_mode only for
            # compiled blocks that call them: the eager int8 Linears' activation cache keeps no inference tensor)
            compiled_codes = bool(self._compiled) and compiled_codes_on()
            if ((compiled_codes or not torch.is_inference_mode_enabled()) and len(self.layers)
                    and _int8_group((self.layers[0].proj.q,)) is not None):
                prepare_fused_quant(device)
        b, t_pad = prompt_embeds.shape[:2]
        lengths = text_lengths(attn_mask, b, t_pad)
        # without padding no mask reaches attention, so the fast kernels run and compiled blocks keep one graph
        padded = any(n != t_pad for n in lengths)
        text_mask = attn_mask.to(device=device, dtype=torch.bool, non_blocking=True) if padded else None
        cos, sin = self.rope.cos_sin(lengths, t_pad, h, w, device)
        txt = self._region("_embed_text")(prompt_embeds.to(device, self.dtype, non_blocking=True))
        txt_cos, txt_sin = cos[:, :t_pad], sin[:, :t_pad]
        for block in self.text_embedder.blocks:
            txt = self._run_block(block, txt, txt_cos, txt_sin, text_mask)
        key_mask = None
        if text_mask is not None:
            key_mask = torch.cat([text_mask, torch.ones(b, h * w, dtype=torch.bool, device=device)], dim=1)
        return TextConditioning(txt, cos, sin, key_mask, (h, w))

    def run_main_blocks(self, seq: torch.Tensor,
                        one_block: Callable[[int, nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`seq = one_block(i, block, seq)` for each main block in order, with block swap's waits and hand-overs
        around each (`library.memory.block_swap`)."""
        swap = self._block_offloader
        if swap is not None:
            swap.begin_forward(torch.is_grad_enabled(), self.gradient_checkpointing)
        for i, block in enumerate(self.layers):
            if swap is not None:
                swap.wait_for_block(i)
            seq = one_block(i, block, seq)
            if swap is not None:
                seq = swap.block_done(i, seq)
        return seq

    def forward_with_text(self, x: torch.Tensor, timesteps: torch.Tensor, text: TextConditioning,
                          skip_layers: Iterable[int] | None = None) -> torch.Tensor:
        """The velocity for latents `x` at `timesteps` given the prepared text (`prepare_text` for x's size)."""
        h, w = x.shape[-2:]
        if (h, w) != text.grid:
            raise ValueError(f"the text conditioning was prepared for latents {text.grid}, not {(h, w)}")
        t_pad = text.tokens.shape[1]
        seq, t_emb, mod = self._region("_embed_image_and_time")(
            x, timesteps.to(x.device, non_blocking=True), text.tokens)
        skip = set(skip_layers or ())

        def one_block(i: int, block: nn.Module, seq: torch.Tensor) -> torch.Tensor:
            return seq if i in skip else self._run_block(block, seq, text.cos, text.sin, text.key_mask, mod)

        seq = self.run_main_blocks(seq, one_block)
        return self._region("_final")(seq, t_emb, t_pad, h, w)

    def pack_texts(self, texts: Sequence[TextConditioning]) -> PackedText | None:
        """The prepared texts of one step's passes (the sampler's conditional and unconditional) as one packed pass
        (`library.moss_image.cfg_packing`), or None where packing does not apply."""
        return pack_texts(texts)

    def forward_packed(self, x: torch.Tensor, timesteps: torch.Tensor, packed: PackedText,
                       skip_layers: Sequence[Iterable[int] | None]) -> tuple[torch.Tensor, ...]:
        """The velocity for latents `x` at `timesteps` given each packed text, in one pass (`skip_layers[i]`: the
        main blocks that text i's pass skips)."""
        return packed_forward(self, x, timesteps, packed, skip_layers)

    def forward(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        prompt_embeds: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        skip_layers: Iterable[int] | None = None,
    ) -> torch.Tensor:
        return self.forward_with_text(x, timesteps, self.prepare_text(prompt_embeds, attn_mask, x.shape[-2:]),
                                      skip_layers)


def count_parameters(config: MossImageConfig) -> tuple[int, int]:
    """(total parameters, weights in the block Linears) of a model built on the meta device."""
    with torch.device("meta"):
        model = MossImage(config)
    total = sum(p.numel() for p in model.parameters())
    block_linears = sum(m.weight.numel() for blk in model.layers for m in blk.proj.children())
    return total, block_linears
