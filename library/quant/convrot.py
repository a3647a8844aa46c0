"""ConvRot INT8 modules, streaming conversion and ComfyUI ``int8_tensorwise`` file handling.

- `ConvRotInt8Linear` (a drop-in `nn.Linear` subclass) holds the frozen base: `weight` int8 [N, K] and
  `weight_scale` fp32 [N, 1] as buffers, `group_size`, an optional frozen `bias`. Its forward runs the int8 linear
  (`library.quant.convrot_ops`: registered ``torch.library`` ops under ``torch.compile``, so a block compiles to one
  graph; a lean autograd.Function in eager mode) whose backward returns only grad_x (and grad_bias if someone made
  the bias trainable), so a LoRA added around it (``y = base(x) + lora(x)``) receives the unrotated input and exact
  gradients.
  The output dtype is the input dtype; under autocast the input is cast to the autocast dtype first. An integer input
  is refused (activations must never be cast to the int8 weight dtype). ``module.to(dtype)`` / ``.half()`` keep
  the int8 weights and the fp32 scales as they are.
- `ConvRotInt8Embedding` (an `nn.Embedding` subclass): rows gathered, dequantised and rotated back, in the compute
  dtype (which follows ``.to(dtype)``).
- `convert_model_to_convrot_int8` quantises selected layers in place, one layer at a time.
- ComfyUI files: per layer ``P.weight`` int8 + ``P.weight_scale`` fp32 + ``P.comfy_quant`` (U8 JSON), or the
  file-level ``_quantization_metadata``. `prepare_model_for_comfy_int8` swaps the named layers for empty int8 modules
  whose ``load_state_dict`` accepts those tensors (scale [N, 1], [N], [1] or []); `check_quantization_format` refuses
  what we cannot run (W4A8, GPTQ/AWQ, float8, nvfp4, ..., int8 weights without a marker) with a `UserError`.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from library.errors import UserError
from library.quant import convrot_kernels as kernels
from library.quant import convrot_ops as ops
from library.quant.linear_plan import LinearPlans

logger = logging.getLogger(__name__)

COMFY_INT8_FORMAT = "int8_tensorwise"
COMFY_QUANT_SUFFIX = ".comfy_quant"
COMFY_ATTENTION_CONFIG_SUFFIX = ".comfy_attention.config"
QUANTIZATION_METADATA_KEY = "_quantization_metadata"
EMBEDDING_ROW_CHUNK = 16384

_W4A8_KEY_SUFFIXES = (".weight_s_rel", ".weight_s_channel", ".weight_codebook", ".weight_correction")
_GPTQ_KEY_SUFFIXES = (".qweight", ".qzeros", ".g_idx", ".scales", ".weight_packed", ".weight_zero_point")
_FP8_LEGACY_KEYS = ("scaled_fp8",)
_FP8_LEGACY_SUFFIXES = (".scale_weight", ".scale_input", ".input_scale")
_KNOWN_OTHER_FORMATS = {
    "float8_e4m3fn": "fp8 (float8_e4m3fn)",
    "float8_e5m2": "fp8 (float8_e5m2)",
    "nvfp4": "NVFP4",
    "mxfp8": "MXFP8",
    "convrot_w4a4": "ConvRot W4A4",
    "awq_w4a16": "AWQ W4A16",
    "asym_w4a8_int8": "W4A8 (asym_w4a8_int8, Lloyd-Max codebook)",
}
_WHAT_TO_DO = (
    "use the bf16 weights (optionally with --convrot_int8 / --convrot_int8_text_encoder) or a ComfyUI"
    " *_int8_convrot.safetensors file"
)


# --------------------------------------------------------------------------------------------------------------------
# Markers
# --------------------------------------------------------------------------------------------------------------------
def comfy_quant_spec(group_size: int) -> dict[str, Any]:
    """The ComfyUI marker dict for one int8 layer (group_size 0: plain row-wise int8, no rotation)."""
    spec: dict[str, Any] = {"format": COMFY_INT8_FORMAT}
    if group_size:
        spec["convrot"] = True
        spec["convrot_groupsize"] = int(group_size)
    return spec


def comfy_quant_tensor(spec: Mapping[str, Any]) -> torch.Tensor:
    """Encode a marker as ComfyUI does: UTF-8 JSON (json.dumps default separators) in a uint8 tensor."""
    return torch.tensor(list(json.dumps(dict(spec)).encode("utf-8")), dtype=torch.uint8)


def parse_comfy_quant(
    value: torch.Tensor | bytes | str | Mapping[str, Any], where: str = "a .comfy_quant marker"
) -> dict:
    """Decode a marker (uint8 tensor, bytes, JSON text or dict) into a dict."""
    if isinstance(value, Mapping):
        return dict(value)
    try:
        if isinstance(value, torch.Tensor):
            value = bytes(value.detach().cpu().to(torch.uint8).reshape(-1).tolist())
        if isinstance(value, bytes):
            value = value.decode("utf-8")
        spec = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError) as e:
        raise UserError(f"Could not read {where}: it is not UTF-8 JSON ({e}); the file is damaged or not a ComfyUI"
                        " quantized checkpoint.") from e
    if not isinstance(spec, dict):
        raise UserError(f"{where} holds {type(spec).__name__}, not a JSON object: the file is not a ComfyUI quantized"
                        " checkpoint.")
    return spec


def _spec_param(spec: Mapping[str, Any], name: str, default: Any) -> Any:
    if name in spec:
        return spec[name]
    params = spec.get("params")
    if isinstance(params, Mapping) and name in params:
        return params[name]
    return default


def spec_group_size(spec: Mapping[str, Any], where: str = "a layer") -> int:
    """Rotation group size of an int8_tensorwise marker: 0 without convrot, else convrot_groupsize (default 256)."""
    if not _spec_param(spec, "convrot", False):
        return 0
    try:
        g = int(_spec_param(spec, "convrot_groupsize", kernels.DEFAULT_GROUP_SIZE))
    except (TypeError, ValueError) as e:
        raise UserError(f"The ConvRot group size of {where} is not an integer ({spec}): the file is damaged.") from e
    if not kernels.is_valid_group_size(g):
        raise UserError(
            f"The ConvRot group size {g} of {where} is not a power of 4: it is not a comfy-kitchen ConvRot file (a"
            " Sylvester-Hadamard QuaRot file, e.g. ComfyUI-INT8-Fast, is not interchangeable); use the bf16 weights."
        )
    return g


def _format_name(fmt: str) -> str:
    return _KNOWN_OTHER_FORMATS.get(fmt, repr(fmt))


def read_comfy_quant_specs(source: Any, metadata: Mapping[str, str] | None = None) -> dict[str, dict]:
    """Layer prefix -> marker dict, from the per-layer ``.comfy_quant`` tensors and the file-level
    ``_quantization_metadata`` (``{"format_version": ..., "layers": {name: {...}}}``)."""
    specs: dict[str, dict] = {}
    meta = metadata if metadata is not None else getattr(source, "metadata", None)
    if isinstance(meta, Mapping) and QUANTIZATION_METADATA_KEY in meta:
        raw = meta[QUANTIZATION_METADATA_KEY]
        try:
            layers = (json.loads(raw) if isinstance(raw, str) else raw).get("layers", {})
        except (json.JSONDecodeError, AttributeError) as e:
            raise UserError(f"The file's '{QUANTIZATION_METADATA_KEY}' metadata is not valid JSON ({e}): the file is"
                            " damaged.") from e
        for name, spec in layers.items():
            specs[name] = parse_comfy_quant(spec, where=f"the quantization metadata of '{name}'")
    for key in _keys(source):
        if key.endswith(COMFY_QUANT_SUFFIX):
            name = key[: -len(COMFY_QUANT_SUFFIX)]
            specs[name] = parse_comfy_quant(_get_tensor(source, key), where=f"'{key}'")
    return specs


# --------------------------------------------------------------------------------------------------------------------
# Detection and refusal of formats we cannot run
# --------------------------------------------------------------------------------------------------------------------
def _keys(source: Any) -> list[str]:
    return list(source.keys())


def _get_tensor(source: Any, key: str) -> torch.Tensor:
    return source.get_tensor(key) if hasattr(source, "get_tensor") else source[key]


def _dtype_of(source: Any, key: str) -> torch.dtype:
    if hasattr(source, "dtype") and callable(source.dtype):
        return source.dtype(key)
    return source[key].dtype


def is_comfy_quantized_state_dict(keys: Iterable[str], metadata: Mapping[str, str] | None = None) -> bool:
    """True when the keys (or the file metadata) carry ComfyUI quantization markers."""
    if metadata is not None and QUANTIZATION_METADATA_KEY in metadata:
        return True
    return any(k.endswith(COMFY_QUANT_SUFFIX) for k in keys)


def comfy_key_filter(key: str) -> bool:
    """Key filter for loaders: False for ComfyUI's attention preference tensors (``.comfy_attention.config``)."""
    return not key.endswith(COMFY_ATTENTION_CONFIG_SUFFIX)


def check_quantization_format(
    source: Any, metadata: Mapping[str, str] | None = None, what: str = "the model file"
) -> None:
    """Raise UserError unless every quantized layer of `source` is ComfyUI int8_tensorwise (with or without convrot).

    `source`: a state dict or a lazy reader with keys() / get_tensor() (/ dtype()), e.g. safetensors_utils.TensorSource.
    Refused, each with the format named: W4A8 (asym_w4a8_int8 markers or .weight_s_rel/.weight_codebook/... keys),
    GPTQ/AWQ/compressed-tensors keys, other ComfyUI formats (float8, nvfp4, mxfp8, convrot_w4a4, awq_w4a16), legacy
    scaled-fp8 files, float8 weights, and int8 weights without a marker.
    """
    keys = _keys(source)
    for key in keys:
        if key.endswith(_W4A8_KEY_SUFFIXES):
            raise UserError(
                f"{what} is a W4A8 (asym_w4a8_int8) checkpoint (key '{key}'), which is not supported: {_WHAT_TO_DO}."
            )
        if key.endswith(_GPTQ_KEY_SUFFIXES):
            raise UserError(
                f"{what} looks like a GPTQ/AWQ-style packed checkpoint (key '{key}'), which is not supported:"
                f" {_WHAT_TO_DO}."
            )
        if key in _FP8_LEGACY_KEYS or key.endswith(_FP8_LEGACY_SUFFIXES):
            raise UserError(
                f"{what} is a scaled-fp8 checkpoint (key '{key}'); fp8 weights are not supported for this model"
                f" (--fp8_base is unsupported): {_WHAT_TO_DO}."
            )
    specs = read_comfy_quant_specs(source, metadata)
    for name, spec in specs.items():
        fmt = spec.get("format")
        if fmt != COMFY_INT8_FORMAT:
            raise UserError(
                f"Layer '{name}' of {what} is quantized as {_format_name(str(fmt))}, which is not supported (only"
                f" ComfyUI int8_tensorwise / ConvRot INT8 is): {_WHAT_TO_DO}."
            )
        if _spec_param(spec, "num_experts", None) is not None:
            raise UserError(f"Layer '{name}' of {what} is an int8 mixture-of-experts bank, which this model does not"
                            f" have: {_WHAT_TO_DO}.")
        spec_group_size(spec, where=f"layer '{name}' of {what}")
    for key in keys:
        if not key.endswith(".weight"):
            continue
        dtype = _dtype_of(source, key)
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise UserError(
                f"{what} holds float8 weights ('{key}' is {dtype}); fp8 checkpoints are not supported for this model"
                f" (--fp8_base is unsupported): {_WHAT_TO_DO}."
            )
        if dtype in (torch.int8, torch.uint8) and key[: -len(".weight")] not in specs:
            raise UserError(
                f"{what} holds {dtype} weights without a quantization marker ('{key}' has no"
                f" '{key[:-len('.weight')]}{COMFY_QUANT_SUFFIX}'): the format is unknown; {_WHAT_TO_DO}."
            )


# --------------------------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------------------------
def _check_bwd(bwd: str) -> str:
    if bwd not in kernels.BACKWARD_MODES:
        raise UserError(f"--convrot_int8_bwd must be one of {', '.join(kernels.BACKWARD_MODES)}, got '{bwd}'.")
    return bwd


def _input_for(x: torch.Tensor) -> torch.Tensor:
    if not x.is_floating_point():
        raise TypeError(
            f"a ConvRot int8 layer got a {x.dtype} input: activations must never be cast to the int8 weight's dtype;"
            " cast them to a norm weight's (or the model's) floating dtype instead"
        )
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return x


# --------------------------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------------------------
class Int8Product:
    """A ConvRot INT8 Linear's frozen product as an adapter's autograd node runs it (`library.lora.eager_node`): the
    same launches as the module's eager forward (its launch plans, its activation cache) and backward, with the
    adapter's input gradient as the backward product's addend. x must be in the compute dtype already."""

    @staticmethod
    def tensors(m: ConvRotInt8Linear) -> tuple[torch.Tensor, ...]:
        """What the node keeps for backward (what the module's own autograd node keeps): the codes and scales."""
        return m.weight, m.weight_scale

    @staticmethod
    def forward(m: ConvRotInt8Linear, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
                ) -> torch.Tensor:
        return ops.eager_forward(x, weight, weight_scale, m.bias, m.group_size, m._eager_plans)

    @staticmethod
    def grad_input(m: ConvRotInt8Linear, grad: torch.Tensor, accumulate: torch.Tensor, weight: torch.Tensor,
                   weight_scale: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """accumulate + the gradient of x, from the output's gradient (both 2-D, rows x features); with `in_place`,
        added into `accumulate` (the caller's own tensor)."""
        return m._eager_plans.grad_input(grad, weight, weight_scale, m.group_size, m.bwd, accumulate=accumulate,
                                         in_place=in_place)


class _Int8StateMixin:
    """Shared state handling: keep int8/fp32 buffers through .to(dtype); ComfyUI marker in the state dict."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    group_size: int

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        scale = self.weight_scale
        probe = getattr(self, "compute_dtype", None)
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        if self.weight_scale.dtype != torch.float32:
            self.weight_scale = scale.to(device=self.weight_scale.device)
        if probe is not None:
            moved = fn(torch.empty(0, dtype=probe))
            if isinstance(moved, torch.Tensor) and moved.is_floating_point():
                self.compute_dtype = moved.dtype
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        super()._save_to_state_dict(destination, prefix, keep_vars)  # type: ignore[misc]
        destination[prefix + "comfy_quant"] = comfy_quant_tensor(comfy_quant_spec(self.group_size))

    def _load_from_state_dict(  # type: ignore[override]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        own = {k: v for k, v in state_dict.items() if k.startswith(prefix)}
        marker = own.pop(prefix + "comfy_quant", None)
        if marker is not None:
            spec = parse_comfy_quant(marker, where=f"'{prefix}comfy_quant'")
            if spec.get("format") != COMFY_INT8_FORMAT:
                error_msgs.append(f"'{prefix}comfy_quant' has format {spec.get('format')!r}, expected int8_tensorwise")
            else:
                self.group_size = spec_group_size(spec, where=f"'{prefix[:-1]}'")
        key = prefix + "weight_scale"
        if key in own:
            own[key] = kernels.scale_vector(own[key], self.weight.shape[0]).reshape(-1, 1)
        wkey = prefix + "weight"
        if wkey in own and own[wkey].dtype != torch.int8:
            error_msgs.append(
                f"'{wkey}' is {own[wkey].dtype}, but '{prefix[:-1]}' is a ConvRot int8 layer that needs int8 codes"
            )
            return
        super()._load_from_state_dict(  # type: ignore[misc]
            own, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


class ConvRotInt8Linear(_Int8StateMixin, nn.Linear):
    """A frozen int8 ConvRot Linear: `weight` int8 [N, K], `weight_scale` fp32 [N, 1] (buffers), frozen `bias`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group_size: int = kernels.DEFAULT_GROUP_SIZE,
        bwd: str = "bf16",
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.bfloat16,
        full_precision: bool = False,
    ):
        nn.Module.__init__(self)
        if group_size:
            kernels.check_group_size(group_size, in_features)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.group_size = int(group_size)
        self.bwd = _check_bwd(bwd)
        self.full_precision = bool(full_precision)
        self._eager_plans = LinearPlans()  # the eager forward's launch plans (not state: a copy starts empty)
        self.register_buffer("weight", torch.zeros((out_features, in_features), dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones((out_features, 1), dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_quantized(
        cls,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
        bwd: str = "bf16",
    ) -> ConvRotInt8Linear:
        """Wrap existing int8 codes [N, K] and scales (any accepted shape) without copying the codes."""
        n, k = weight.shape
        mod = cls(k, n, bias=False, group_size=group_size, bwd=bwd, device="meta")
        mod.weight = weight
        mod.weight_scale = kernels.scale_vector(weight_scale, n).reshape(n, 1).to(weight.device)
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return mod

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group_size: int = kernels.DEFAULT_GROUP_SIZE,
        bwd: str = "bf16",
        calc_device: torch.device | str | None = None,
        recipe: str = kernels.DEFAULT_WEIGHT_RECIPE,
    ) -> ConvRotInt8Linear:
        """Quantise a float Linear (on `calc_device` if given); the result lives on the Linear's device."""
        w = linear.weight.detach()
        home = w.device
        if home.type == "meta":
            raise ValueError("cannot quantise a Linear whose weights are on the meta device (load them first)")
        if calc_device is not None:
            w = w.to(calc_device)
        q, s = kernels.quantize_convrot_weight(w, group_size, recipe)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_quantized(q.to(home), s.to(home), group_size, bias, bwd)

    def reset_parameters(self) -> None:
        """Nothing to initialise: the int8 codes are frozen data (nn.Linear's init would fail on them)."""

    def eager_activation_group(self) -> int | None:
        """The rotation group of the quantised input that this Linear's eager forward takes from the activation cache
        (`library.quant.convrot_kernels.cached_quantized_activation`): what a fused producer of its input may leave
        there (`library.runtime.fused_ops.fused_norm_modulate_quant`). None where the forward quantises no input
        that way: a full-precision layer, no rotation, torch.compile."""
        if self.full_precision or not self.group_size or torch.compiler.is_compiling():
            return None
        return self.group_size

    def codes_group(self) -> int | None:
        """The rotation group in which this Linear takes an input given as its codes alone (`forward_codes`), where
        a compiled inference block's producer writes them (`library.runtime.fused_compiled`); None where it cannot:
        a full-precision layer, no rotation, a trainable bias, or a forward that does more than the product (a LoRA
        that replaced it, a hook)."""
        if self.full_precision or not self.group_size or (self.bias is not None and self.bias.requires_grad):
            return None
        if "forward" in self.__dict__ or self._forward_hooks or self._forward_pre_hooks:
            return None
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return None
        return self.group_size

    def forward_codes(self, rows: ops.QuantizedRows) -> torch.Tensor:
        """The product of an input given as the codes and scales of its rows (no gradient; see `codes_group`)."""
        return ops.linear_from_codes(rows, self.weight, self.weight_scale, self.bias)

    def frozen_product(self) -> type[Int8Product] | None:
        """The eager int8 product for an adapter whose autograd node wraps this Linear (`library.lora.eager_node`), or
        None where the module's own forward must run: a full-precision layer, a trainable bias, torch.compile."""
        if self.full_precision or (self.bias is not None and self.bias.requires_grad) or torch.compiler.is_compiling():
            return None
        return Int8Product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _input_for(x)
        if self.full_precision:
            w = ops.dequantize(self.weight, self.weight_scale, self.group_size, x.dtype)
            b = self.bias.to(x.dtype) if self.bias is not None else None
            return nn.functional.linear(x, w, b)
        if torch.compiler.is_compiling():  # the registered ops: the Linear stays inside the compiled graph
            return ops.linear(x, self.weight, self.weight_scale, self.bias, self.group_size, self.bwd)
        return ops.linear_eager(x, self.weight, self.weight_scale, self.bias, self.group_size, self.bwd,
                                self._eager_plans)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in the original basis (a new tensor)."""
        return kernels.dequantize_weight(self.weight, self.weight_scale, self.group_size, dtype=dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None},"
            f" group_size={self.group_size}, bwd={self.bwd}"
        )


def _compiler_disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compiler.disable(fn)`, made at the first call: the decorator imports torch._dynamo (seconds), which a
    process that never runs the module (the inference script's start, `--help`) should not pay for."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call


class ConvRotInt8Embedding(_Int8StateMixin, nn.Embedding):
    """A frozen int8 token embedding in the rotated basis: lookup = gather rows, dequantise, rotate back."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group_size: int = kernels.DEFAULT_GROUP_SIZE,
        padding_idx: int | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ):
        nn.Module.__init__(self)
        if group_size:
            kernels.check_group_size(group_size, embedding_dim)
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.padding_idx = padding_idx
        self.max_norm = None
        self.norm_type = 2.0
        self.scale_grad_by_freq = False
        self.sparse = False
        self.group_size = int(group_size)
        self.compute_dtype = compute_dtype
        self.register_buffer("weight", torch.zeros((num_embeddings, embedding_dim), dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones((num_embeddings, 1), dtype=torch.float32, device=device))

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Embedding,
        group_size: int = kernels.DEFAULT_GROUP_SIZE,
        calc_device: torch.device | str | None = None,
        recipe: str = kernels.DEFAULT_WEIGHT_RECIPE,
        row_chunk: int = EMBEDDING_ROW_CHUNK,
    ) -> ConvRotInt8Embedding:
        """Quantise a float embedding table row chunk by row chunk (on `calc_device` if given)."""
        w = embedding.weight.detach()
        home = w.device
        if home.type == "meta":
            raise ValueError("cannot quantise an Embedding whose weights are on the meta device (load them first)")
        rows, dim = w.shape
        if group_size:
            kernels.check_group_size(group_size, dim)
        mod = cls(rows, dim, group_size, embedding.padding_idx, w.dtype, device="meta")
        q = torch.empty((rows, dim), dtype=torch.int8, device=home)
        s = torch.empty((rows, 1), dtype=torch.float32, device=home)
        for start in range(0, rows, row_chunk):
            part = w[start : start + row_chunk]
            if calc_device is not None:
                part = part.to(calc_device)
            q_p, s_p = kernels.quantize_convrot_weight(part, group_size, recipe)
            q[start : start + row_chunk] = q_p.to(home)
            s[start : start + row_chunk] = s_p.to(home)
        mod.weight = q
        mod.weight_scale = s
        return mod

    def reset_parameters(self) -> None:
        """Nothing to initialise: the int8 codes are frozen data (nn.Embedding's init would fail on them)."""

    @_compiler_disabled
    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return kernels.dequantize_rows(self.weight, self.weight_scale, indices, self.group_size, self.compute_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.group_size}, dtype={self.compute_dtype}"


def is_convrot_int8_model(model: nn.Module) -> bool:
    """True when any submodule is a ConvRot int8 Linear or Embedding."""
    return any(isinstance(m, (ConvRotInt8Linear, ConvRotInt8Embedding)) for m in model.modules())


# --------------------------------------------------------------------------------------------------------------------
# Streaming conversion
# --------------------------------------------------------------------------------------------------------------------
def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def convert_model_to_convrot_int8(
    model: nn.Module,
    name_filter: Callable[[str], bool],
    calc_device: torch.device | str | None = None,
    group_size: int = kernels.DEFAULT_GROUP_SIZE,
    bwd: str = "bf16",
    recipe: str = kernels.DEFAULT_WEIGHT_RECIPE,
) -> int:
    """Quantise, in place, every nn.Linear / nn.Embedding whose qualified name passes `name_filter`.

    Layer by layer: each weight is (moved to `calc_device`,) rotated and quantised, the int8 module goes back to the
    layer's device and the float weight is dropped before the next layer, so at most one extra layer is alive.
    Layers whose input width is not a multiple of `group_size` are left in their float dtype (logged).
    Returns the number of converted modules.
    """
    _check_bwd(bwd)
    kernels.check_group_size(group_size)
    names = [
        n for n, m in model.named_modules()
        if n and name_filter(n) and type(m) in (nn.Linear, nn.Embedding)
    ]
    converted = 0
    skipped: list[str] = []
    for name in names:
        module = model.get_submodule(name)
        width = module.in_features if isinstance(module, nn.Linear) else module.embedding_dim
        if width % group_size:
            skipped.append(name)
            continue
        if isinstance(module, nn.Linear):
            new: nn.Module = ConvRotInt8Linear.from_linear(module, group_size, bwd, calc_device, recipe)
        else:
            new = ConvRotInt8Embedding.from_embedding(module, group_size, calc_device, recipe)
        _set_submodule(model, name, new)
        module.weight = None  # drop the float weight now, even if something else still holds the old module
        del module
        converted += 1
    if skipped:
        logger.info("ConvRot INT8: %d layers kept in their float dtype (width not a multiple of %d): %s",
                    len(skipped), group_size, ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    logger.info("ConvRot INT8: quantised %d modules (group size %d, recipe %s, backward %s)",
                converted, group_size, recipe, bwd)
    return converted


def convrot_group_size(model: nn.Module, name_filter: Callable[[str], bool], largest: int = 256) -> int:
    """The ConvRot group size for a model: the largest power of 4 (at most `largest`, the official 256) that divides
    the input width of every layer in scope (256 for the full models; smaller for tiny test models)."""
    widths = [m.in_features if isinstance(m, nn.Linear) else m.embedding_dim
              for n, m in model.named_modules() if n and name_filter(n) and isinstance(m, (nn.Linear, nn.Embedding))]
    g = largest
    while g > 4 and any(w % g for w in widths):
        g //= 4
    return g


# --------------------------------------------------------------------------------------------------------------------
# ComfyUI pre-quantised files
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ComfyInt8LayerSpec:
    """One int8 layer of a ComfyUI file: rotation group size (0 = none) and the dequantise-only flag."""

    group_size: int
    full_precision: bool = False


def comfy_int8_layer_specs(source: Any, metadata: Mapping[str, str] | None = None, what: str = "the model file"
                           ) -> dict[str, ComfyInt8LayerSpec]:
    """Check the format (UserError if unsupported) and return layer prefix -> ComfyInt8LayerSpec."""
    check_quantization_format(source, metadata, what)
    out = {}
    for name, spec in read_comfy_quant_specs(source, metadata).items():
        out[name] = ComfyInt8LayerSpec(
            spec_group_size(spec, where=f"layer '{name}' of {what}"),
            bool(_spec_param(spec, "full_precision_matrix_mult", False)),
        )
    return out


def prepare_model_for_comfy_int8(
    model: nn.Module,
    specs: Mapping[str, ComfyInt8LayerSpec],
    bwd: str = "bf16",
    what: str = "the model file",
    compute_dtype: torch.dtype | None = None,
) -> int:
    """Swap every layer named in `specs` (an nn.Linear or nn.Embedding of `model`) for an empty int8 module of the
    same shape and device; a following ``model.load_state_dict(file_tensors)`` then fills weight, weight_scale
    (any accepted shape), bias and accepts the markers. `compute_dtype`: the dtype the model runs in (the bias and
    the embedding's output; default: the replaced layer's dtype, which is float32 for a model built on meta without
    a dtype). Returns the number of swapped layers."""
    _check_bwd(bwd)
    count = 0
    for name, spec in specs.items():
        try:
            module = model.get_submodule(name)
        except AttributeError as e:
            raise UserError(f"{what} quantizes layer '{name}', which this model does not have: the file does not"
                            " match the model.") from e
        if isinstance(module, (ConvRotInt8Linear, ConvRotInt8Embedding)):
            module.group_size = spec.group_size
            continue
        dev = module.weight.device
        if type(module) is nn.Linear:
            bias_dtype = module.bias.dtype if module.bias is not None else module.weight.dtype
            new: nn.Module = ConvRotInt8Linear(
                module.in_features, module.out_features, module.bias is not None, spec.group_size, bwd, dev,
                compute_dtype or bias_dtype, spec.full_precision,
            )
        elif type(module) is nn.Embedding:
            new = ConvRotInt8Embedding(module.num_embeddings, module.embedding_dim, spec.group_size,
                                       module.padding_idx, compute_dtype or module.weight.dtype, dev)
        else:
            raise UserError(f"{what} quantizes '{name}', which is a {type(module).__name__} (only Linear and Embedding"
                            " layers can be int8): the file does not match the model.")
        _set_submodule(model, name, new)
        count += 1
    return count


def split_fused_int8_qkv(
    weight: torch.Tensor, weight_scale: torch.Tensor, sizes: Sequence[int] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a fused int8 [sum(sizes), K] weight and its per-row (or tensor-wise) scale into pieces along the rows.

    Rows are independent in row-wise int8 (and the rotation acts along K), so each piece is exactly the layer it
    would have been unfused. Scales come back as fp32 [n_i, 1]. `sizes` defaults to three equal parts (q, k, v).
    """
    rows = weight.shape[0]
    if sizes is None:
        if rows % 3:
            raise UserError(f"A fused qkv weight has {rows} rows, which do not split into three equal parts: give the"
                            " q/k/v sizes from the model config.")
        sizes = [rows // 3] * 3
    if sum(sizes) != rows:
        raise UserError(f"A fused qkv weight has {rows} rows, expected {sum(sizes)} (= {' + '.join(map(str, sizes))}):"
                        " the checkpoint does not match the model config.")
    scale = kernels.scale_vector(weight_scale, rows).reshape(rows, 1)
    return list(zip(torch.split(weight, list(sizes), 0), torch.split(scale, list(sizes), 0)))


def split_fused_int8_qkv_state_dict(
    state_dict: MutableMapping[str, torch.Tensor],
    sizes: Sequence[int] | None = None,
    fused: str = "qkv",
    names: Sequence[str] = ("q", "k", "v"),
) -> int:
    """Rewrite every ``*.{fused}.weight`` (+ ``weight_scale``, ``comfy_quant``, ``bias``) of a state dict into
    ``*.{name}.*`` pieces in place (int8 weights with their scales; float weights split too; the marker is copied).
    Returns the number of fused layers split."""
    suffix = f".{fused}.weight"
    prefixes = [k[: -len(".weight")] for k in list(state_dict) if k.endswith(suffix) or k == suffix[1:]]
    for prefix in prefixes:
        base = prefix[: -len(fused)]
        weight = state_dict.pop(prefix + ".weight")
        scale = state_dict.pop(prefix + ".weight_scale", None)
        marker = state_dict.pop(prefix + ".comfy_quant", None)
        bias = state_dict.pop(prefix + ".bias", None)
        if scale is not None:
            pieces = split_fused_int8_qkv(weight, scale, sizes)
        else:
            part_sizes = list(sizes) if sizes is not None else [weight.shape[0] // len(names)] * len(names)
            if sum(part_sizes) != weight.shape[0]:
                raise UserError(f"'{prefix}.weight' has {weight.shape[0]} rows, expected {sum(part_sizes)}: the"
                                " checkpoint does not match the model config.")
            pieces = [(w, None) for w in torch.split(weight, part_sizes, 0)]
        row_sizes = [p[0].shape[0] for p in pieces]
        bias_parts = torch.split(bias, row_sizes, 0) if bias is not None else [None] * len(pieces)
        for name, (w, s), b in zip(names, pieces, bias_parts):
            state_dict[f"{base}{name}.weight"] = w
            if s is not None:
                state_dict[f"{base}{name}.weight_scale"] = s
            if marker is not None:
                state_dict[f"{base}{name}.comfy_quant"] = marker.clone()
            if b is not None:
                state_dict[f"{base}{name}.bias"] = b
    return len(prefixes)


def split_fused_qkv_specs(
    specs: Mapping[str, Any], fused: str = "qkv", names: Sequence[str] = ("q", "k", "v")
) -> dict[str, Any]:
    """Layer specs with each ``*.{fused}`` entry replaced by one copy per ``*.{name}``."""
    out: dict[str, Any] = {}
    for layer, spec in specs.items():
        if layer == fused or layer.endswith("." + fused):
            base = layer[: -len(fused)]
            for name in names:
                out[base + name] = spec
        else:
            out[layer] = spec
    return out


def load_comfy_int8_state_dict(
    model: nn.Module,
    state_dict: MutableMapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    bwd: str = "bf16",
    what: str = "the model file",
    strict: bool = True,
) -> int:
    """Check the format, swap the int8 layers in, and load `state_dict` (ComfyUI layout, unfused names) into `model`.
    ``.comfy_attention.config`` tensors are ignored. Returns the number of int8 layers. Mismatching keys raise
    UserError listing them."""
    for key in [k for k in state_dict if not comfy_key_filter(k)]:
        del state_dict[key]
    specs = comfy_int8_layer_specs(state_dict, metadata, what)
    prepare_model_for_comfy_int8(model, specs, bwd, what)
    result = model.load_state_dict(state_dict, strict=False)
    missing = list(result.missing_keys)
    unexpected = [k for k in result.unexpected_keys if not k.endswith(COMFY_QUANT_SUFFIX)]
    if strict and (missing or unexpected):
        raise UserError(
            f"{what} does not match the model: {len(missing)} missing keys (e.g. {missing[:3]}), {len(unexpected)}"
            f" unexpected keys (e.g. {unexpected[:3]})."
        )
    return len(specs)


# --------------------------------------------------------------------------------------------------------------------
# Scopes (which layers a model quantises), by qualified module name
# --------------------------------------------------------------------------------------------------------------------
_DIT_RE = re.compile(
    r"^(?:model\.)?(?:diffusion_model\.)?layers\.\d+\.(?:proj\.)?(?:q|k|v|o|qkv|ffn_up_gate|ffn_down)$"
)
_TE_LINEAR_RE = re.compile(
    r"(?:^|\.)layers\.\d+\.(?:self_attn\.(?:q|k|v|o)_proj|linear_attn\.(?:in_proj_qkv|in_proj_z|out_proj)"
    r"|mlp\.(?:gate|up|down)_proj)$"
)
_TE_EMBED_RE = re.compile(r"(?:^|\.)embed_tokens$")


def dit_convrot_filter(name: str) -> bool:
    """The MOSS-Image DiT scope: the Linear layers of the main blocks, ``layers.<i>.proj.{q,k,v,o}`` and the SwiGLU
    ``ffn_up_gate`` / ``ffn_down`` (with or without ``proj.``; ``qkv`` for ComfyUI's fused layout): 252 modules.
    Refiner blocks, embedders, modulation and the final layer stay in bf16."""
    return _DIT_RE.match(name) is not None


def text_encoder_convrot_filter(name: str) -> bool:
    """The Qwen3.5 text-encoder scope of the ComfyUI int8 file: attention q/k/v/o_proj, GatedDeltaNet
    in_proj_qkv / in_proj_z / out_proj, MLP gate/up/down_proj (200 Linear layers) and embed_tokens.
    GatedDeltaNet in_proj_a / in_proj_b (32 outputs) stay bf16, as in the ComfyUI file; the vision tower, the MTP
    layer and lm_head are never quantised."""
    if name.startswith(("visual.", "mtp.", "lm_head", "model.visual")) or ".visual." in name:
        return False
    return _TE_LINEAR_RE.search(name) is not None or _TE_EMBED_RE.search(name) is not None
