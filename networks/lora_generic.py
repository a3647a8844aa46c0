"""Generic LoRA network module for MOSS-Image (`--network_module networks.lora_generic`).

The module follows the sd-scripts network-module contract (`create_network`, `create_network_from_weights` and the
network object's methods that `NetworkTrainer` calls). Targets are found from the model itself:

- DiT (`MossImage`): every Linear-like module inside a `MossImageBlock` (`layers.<i>.proj.{q,k,v,o,ffn_up_gate,
  ffn_down}`); with `train_text_embedder=True` (alias `train_llm_adapter=True`) also every Linear-like module inside
  `MossImageTextEmbedder` (`text_embedder.proj`, `text_embedder.blocks.<i>.proj.*`). Nothing else (patch embedder,
  time embedding, modulation, norms, final layer) is a target.
- Text encoder (Qwen3.5): Linear-like modules inside `Qwen3_5Attention`, `Qwen3_5GatedDeltaNet` and `Qwen3_5MLP`, with
  `.*in_proj_[ab]` excluded by default.

"Linear-like" means `nn.Linear` or any module that reports integer `in_features` / `out_features` (the ConvRot INT8
Linear replacement included). The LoRA wraps the module's forward and never touches its weights.

Keys of the saved file: `lora_unet_<module path with "." as "_">.{lora_down.weight, lora_up.weight, alpha}` for the
DiT and `lora_te_<...>` for the text encoder (sd-scripts single text-encoder naming; ComfyUI loads these directly).
"""

from __future__ import annotations

import ast
import logging
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from library.errors import UserError
from library.files.model_spec import add_hashes, stringify
from library.files.safetensors_io import load_safetensors, save_file_atomic
from library.lora.conventions import (
    ALPHA,
    LORA_DOWN,
    LORA_PREFIX_TEXT_ENCODER,
    LORA_PREFIX_UNET,
    LORA_UP,
    effective_alpha,
    lora_name_for,
    prefix_for,
)
from library.lora.convert import to_sd_scripts
from library.lora.merge import merged_weight, reject_quantized_weight
from library.moss_image.lora_targets import (
    DIT_BLOCK_CLASSES,
    DIT_TEXT_EMBEDDER_CLASSES,
    TEXT_ENCODER_DEFAULT_EXCLUDE,
    TEXT_ENCODER_TARGET_CLASSES,
)

logger = logging.getLogger(__name__)

DEFAULT_NETWORK_DIM = 4
DEFAULT_NETWORK_ALPHA = 1.0

# Every key --network_args may carry, with a one-line meaning (used in the error for an unknown key).
ACCEPTED_NETWORK_ARGS: dict[str, str] = {
    "train_text_embedder": "bool, also train the DiT text embedder (text_embedder.proj and its refiner blocks)",
    "train_llm_adapter": "bool, alias of train_text_embedder (Anima naming)",
    "exclude_patterns": "Python list of regexes (re.fullmatch on module names) to exclude",
    "include_patterns": "Python list of regexes that override the exclusion",
    "network_reg_dims": "'regex=rank,...' per-module ranks",
    "network_reg_lrs": "'regex=lr,...' per-module learning rates",
    "rank_dropout": "float in [0, 1)",
    "module_dropout": "float in [0, 1)",
    "loraplus_lr_ratio": "float > 0, LoRA+ ratio for lora_up",
    "loraplus_unet_lr_ratio": "float > 0, LoRA+ ratio for the DiT only",
    "loraplus_text_encoder_lr_ratio": "float > 0, LoRA+ ratio for the text encoder only",
    "verbose": "bool, log every LoRA module with its rank and alpha",
}
# Keys that choose modules or ranks; they have no effect when the modules come from a weights file.
_SELECTION_ARGS = (
    "train_text_embedder", "train_llm_adapter", "exclude_patterns", "include_patterns", "network_reg_dims"
)


# ----------------------------------------------------------------------------------------------------------------------
# network_args parsing (values arrive as strings from --network_args "k=v", or as Python values from code)


def _check_network_args(kwargs: Mapping[str, Any]) -> None:
    unknown = sorted(k for k in kwargs if k not in ACCEPTED_NETWORK_ARGS)
    if unknown:
        raise UserError(
            f"Unknown --network_args key(s) {', '.join(repr(k) for k in unknown)} for networks.lora_generic:"
            f" the accepted keys are {', '.join(ACCEPTED_NETWORK_ARGS)}."
        )


def parse_bool(name: str, value: Any) -> bool:
    """`true/false/1/0/yes/no/on/off` (any case) or a bool; anything else is a UserError naming the option."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off", "none", ""):
        return False
    raise UserError(f"--network_args {name}={value!r} is not a boolean: write {name}=True or {name}=False.")


def parse_float(name: str, value: Any, low: float | None = None, high: float | None = None) -> float | None:
    """A float (or None when the value is None/"None"), checked against [low, high)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    option = name if name.startswith("--") else f"--network_args {name}"
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{option}={value!r} is not a number: write e.g. {name}=0.1.") from None
    if (low is not None and result < low) or (high is not None and result >= high) or math.isnan(result):
        bounds = f"[{low}, {high})" if high is not None else f">= {low}"
        raise UserError(f"{option}={value!r} is out of range: it must be {bounds}.")
    return result


def _compile_pattern(option: str, pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise UserError(f"--network_args {option}: {pattern!r} is not a valid regular expression ({e}).") from None


def parse_pattern_list(name: str, value: Any) -> list[str]:
    """A Python list literal of regexes (`['.*ffn.*', 'layers\\.0\\..*']`), one quoted string, or one bare regex."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        items = list(value)
    else:
        text = str(value).strip()
        try:
            with warnings.catch_warnings():  # "\." in a literal is an invalid escape warning; the text is kept as is
                warnings.simplefilter("ignore")
                parsed = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            if text.startswith("["):
                raise UserError(
                    f"--network_args {name}={text} is not a valid Python list of strings: write e.g."
                    f" \"{name}=['.*ffn.*']\"."
                ) from None
            parsed = text  # one bare regex
        items = parsed if isinstance(parsed, (list, tuple)) else [parsed]
    result = []
    for item in items:
        if not isinstance(item, str):
            raise UserError(f"--network_args {name}: {item!r} is not a string; every pattern must be a quoted regex.")
        _compile_pattern(name, item)
        result.append(item)
    return result


def parse_regex_values(name: str, value: Any, as_int: bool) -> dict[str, float | int]:
    """`"regex=value,regex=value"` -> ordered dict. A comma inside a regex (`.{1,3}`) is kept with its regex."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        items = list(value.items())
    else:
        items = []
        pending = ""
        for piece in str(value).split(","):
            pending = piece if not pending else f"{pending},{piece}"
            if "=" in piece:
                pattern, _, raw = pending.rpartition("=")
                items.append((pattern.strip(), raw.strip()))
                pending = ""
        if pending.strip():
            raise UserError(
                f"--network_args {name}: {pending!r} has no '=value'; the format is 'regex=value,regex=value'."
            )
    result: dict[str, float | int] = {}
    for pattern, raw in items:
        if not pattern:
            raise UserError(f"--network_args {name}: an entry has an empty regex; the format is 'regex=value,...'.")
        _compile_pattern(name, pattern)
        try:
            number = int(raw) if as_int else float(raw)
        except (TypeError, ValueError):
            kind = "an integer rank" if as_int else "a learning rate"
            raise UserError(f"--network_args {name}: {raw!r} for {pattern!r} is not {kind}.") from None
        if number < 0:
            raise UserError(f"--network_args {name}: {number} for {pattern!r} is negative.")
        result[pattern] = number
    return result


@dataclass
class NetworkOptions:
    """Everything --network_args can set, parsed and validated."""

    train_text_embedder: bool = False
    exclude_patterns: list[str] = field(default_factory=list)
    include_patterns: list[str] = field(default_factory=list)
    reg_dims: dict[str, int] = field(default_factory=dict)
    reg_lrs: dict[str, float] = field(default_factory=dict)
    rank_dropout: float | None = None
    module_dropout: float | None = None
    loraplus_lr_ratio: float | None = None
    loraplus_unet_lr_ratio: float | None = None
    loraplus_text_encoder_lr_ratio: float | None = None
    verbose: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "NetworkOptions":
        _check_network_args(kwargs)
        opts = cls()
        flags = [parse_bool(k, kwargs[k]) for k in ("train_text_embedder", "train_llm_adapter") if k in kwargs]
        if len(set(flags)) > 1:
            raise UserError(
                "--network_args train_text_embedder and train_llm_adapter (its alias) disagree: give only one of them."
            )
        opts.train_text_embedder = bool(flags and flags[0])
        opts.exclude_patterns = parse_pattern_list("exclude_patterns", kwargs.get("exclude_patterns"))
        opts.include_patterns = parse_pattern_list("include_patterns", kwargs.get("include_patterns"))
        reg_dims = parse_regex_values("network_reg_dims", kwargs.get("network_reg_dims"), True)
        reg_lrs = parse_regex_values("network_reg_lrs", kwargs.get("network_reg_lrs"), False)
        opts.reg_dims = {k: int(v) for k, v in reg_dims.items()}
        opts.reg_lrs = {k: float(v) for k, v in reg_lrs.items()}
        opts.rank_dropout = parse_float("rank_dropout", kwargs.get("rank_dropout"), 0.0, 1.0)
        opts.module_dropout = parse_float("module_dropout", kwargs.get("module_dropout"), 0.0, 1.0)
        for name in ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"):
            ratio = parse_float(name, kwargs.get(name), 0.0)
            if ratio == 0.0:
                raise UserError(f"--network_args {name}=0 would freeze lora_up: give a ratio > 0 (e.g. 16).")
            setattr(opts, name, ratio)
        opts.verbose = parse_bool("verbose", kwargs.get("verbose", False))
        return opts


# ----------------------------------------------------------------------------------------------------------------------
# module discovery


def is_linear_like(module: nn.Module) -> bool:
    """nn.Linear, or a replacement (ConvRot INT8 Linear, ...) that reports integer in_features / out_features."""
    if isinstance(module, LoRAModule):
        return False
    if isinstance(module, nn.Linear):
        return True
    in_features, out_features = getattr(module, "in_features", None), getattr(module, "out_features", None)
    return isinstance(in_features, int) and isinstance(out_features, int)


def _linear_modules_under(root: nn.Module, class_names: Sequence[str]) -> dict[str, nn.Module]:
    """Linear-like modules that have an ancestor whose class name is in `class_names`. A Linear-like module inside
    another one (a replacement that keeps the original Linear as a child) is not a second target."""
    owners = [name for name, m in root.named_modules() if type(m).__name__ in class_names]
    found: dict[str, nn.Module] = {}
    for name, module in root.named_modules():
        if not name or not is_linear_like(module):
            continue
        if any(owner == "" or name.startswith(owner + ".") for owner in owners):
            found[name] = module
    return {n: m for n, m in found.items() if not any(n.startswith(other + ".") for other in found)}


def dit_candidates(unet: nn.Module, train_text_embedder: bool) -> dict[str, nn.Module]:
    """Default LoRA targets of the MOSS-Image DiT, by module name."""
    embedder = _linear_modules_under(unet, DIT_TEXT_EMBEDDER_CLASSES)
    blocks = {k: v for k, v in _linear_modules_under(unet, DIT_BLOCK_CLASSES).items() if k not in embedder}
    if not blocks and not embedder:
        raise UserError(
            f"networks.lora_generic found no MossImageBlock in the DiT (class {type(unet).__name__}): this network"
            " module supports the MOSS-Image DiT; check --pretrained_model_name_or_path and --network_module."
        )
    if train_text_embedder:
        if not embedder:
            logger.warning("train_text_embedder=True but the DiT has no MossImageTextEmbedder: no text embedder LoRA")
        return {**blocks, **embedder}
    return blocks


def text_encoder_candidates(text_encoder: nn.Module) -> dict[str, nn.Module]:
    """Default LoRA targets of the Qwen3.5 text encoder (before the default `.*in_proj_[ab]` exclusion)."""
    found = _linear_modules_under(text_encoder, TEXT_ENCODER_TARGET_CLASSES)
    if not found:
        logger.warning(
            "the text encoder (class %s) has none of %s: no text encoder LoRA modules",
            type(text_encoder).__name__,
            ", ".join(TEXT_ENCODER_TARGET_CLASSES),
        )
    return found


def _single_text_encoder(text_encoders: Any) -> nn.Module | None:
    if text_encoders is None:
        return None
    if isinstance(text_encoders, nn.Module):
        return text_encoders
    present = [te for te in text_encoders if te is not None]
    if len(present) > 1:
        raise ValueError(f"networks.lora_generic supports one text encoder, got {len(present)}")
    return present[0] if present else None


# ----------------------------------------------------------------------------------------------------------------------
# the LoRA module


class LoRAModule(nn.Module):
    """y = org(x) + multiplier * (alpha / rank) * up(down(x)); wraps the original forward, never touches its weights."""

    def __init__(
        self,
        lora_name: str,
        original_name: str,
        org_module: nn.Module,
        multiplier: float = 1.0,
        lora_dim: int = DEFAULT_NETWORK_DIM,
        alpha: float | torch.Tensor | None = DEFAULT_NETWORK_ALPHA,
        dropout: float | None = None,
        rank_dropout: float | None = None,
        module_dropout: float | None = None,
    ):
        super().__init__()
        self.lora_name = lora_name
        self.original_name = original_name
        self.lora_dim = int(lora_dim)
        in_dim, out_dim = int(org_module.in_features), int(org_module.out_features)
        self.lora_down = nn.Linear(in_dim, self.lora_dim, bias=False)
        self.lora_up = nn.Linear(self.lora_dim, out_dim, bias=False)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)
        alpha = effective_alpha(alpha, self.lora_dim)
        self.register_buffer("alpha", torch.tensor(alpha, dtype=torch.float32))
        self.scale = alpha / self.lora_dim
        self.multiplier = float(multiplier)
        self.dropout = dropout
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout
        self.enabled = True
        self._org_module = [org_module]  # a list keeps it out of this module's children and state_dict
        self._org_forward = None

    @property
    def org_module(self) -> nn.Module:
        return self._org_module[0]

    @property
    def applied(self) -> bool:
        return self._org_forward is not None

    def apply_to(self) -> None:
        """Route the original module's forward through this LoRA (idempotent)."""
        if self.applied:
            return
        self._org_forward = self.org_module.forward
        self.org_module.forward = self.forward

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001 - torch signature
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.scale = float(self.alpha.float().item()) / self.lora_dim

    def _lora_input(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.lora_down.weight
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(weight.dtype)
        return x

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self._org_forward(x, *args, **kwargs)
        if not self.enabled or self.multiplier == 0:
            return out
        if self.training and self.module_dropout and torch.rand(()) < self.module_dropout:
            return out
        lx = self.lora_down(self._lora_input(x))
        if self.training and self.dropout:
            lx = nn.functional.dropout(lx, p=self.dropout)
        scale = self.scale
        if self.training and self.rank_dropout and lx.dim() >= 2:
            keep = torch.rand(lx.shape[0], self.lora_dim, device=lx.device) > self.rank_dropout
            keep = keep.to(lx.dtype).view(lx.shape[0], *([1] * (lx.dim() - 2)), self.lora_dim)
            lx = lx * keep
            scale = scale / (1.0 - self.rank_dropout)
        lx = self.lora_up(lx)
        return out + (lx * (self.multiplier * scale)).to(out.dtype)

    def delta_weight(self) -> torch.Tensor:
        """multiplier * scale * up @ down in fp32 (the weight change this module stands for), detached."""
        up = self.lora_up.weight.detach().float()
        down = self.lora_down.weight.detach().float()
        return (up @ down) * (self.multiplier * self.scale)


# ----------------------------------------------------------------------------------------------------------------------
# the network


def _warn_unused_patterns(kind: str, patterns: Iterable[str], names: Sequence[str]) -> None:
    for pattern in patterns:
        if not any(re.fullmatch(pattern, n) for n in names):
            example = names[0] if names else "layers.0.proj.q"
            logger.warning(
                "%s pattern %r matches no module (patterns use re.fullmatch on names like %r)", kind, pattern, example
            )


class LoRANetwork(nn.Module):
    """The set of LoRA modules of one run; its state_dict is the LoRA file."""

    def __init__(self, multiplier: float = 1.0, options: NetworkOptions | None = None, dropout: float | None = None):
        super().__init__()
        self.multiplier = float(multiplier)
        self.options = options or NetworkOptions()
        self.dropout = dropout
        self.text_encoder_loras: list[LoRAModule] = []
        self.unet_loras: list[LoRAModule] = []
        self._frozen: list[nn.Parameter] = []  # parameters of groups whose lr is 0: not trained, no gradients

    # -- building

    def add_lora(self, lora: LoRAModule, is_unet: bool) -> None:
        if hasattr(self, lora.lora_name):
            raise ValueError(f"duplicate LoRA name {lora.lora_name} (two module paths map to the same key)")
        self.add_module(lora.lora_name, lora)
        (self.unet_loras if is_unet else self.text_encoder_loras).append(lora)

    def _make_lora(
        self, prefix: str, name: str, module: nn.Module, dim: int, alpha: float | torch.Tensor | None
    ) -> LoRAModule:
        opts = self.options
        return LoRAModule(
            lora_name_for(prefix, name),
            name,
            module,
            multiplier=self.multiplier,
            lora_dim=dim,
            alpha=alpha,
            dropout=self.dropout,
            rank_dropout=opts.rank_dropout,
            module_dropout=opts.module_dropout,
        )

    def build_from_candidates(
        self,
        candidates: Mapping[str, nn.Module],
        is_unet: bool,
        default_dim: int,
        alpha: float,
        default_excludes: Sequence[str] = (),
    ) -> None:
        """Create LoRA modules for the candidates that survive the exclude/include filters, with regex ranks."""
        opts = self.options
        prefix = prefix_for(is_unet)
        excludes = [re.compile(p) for p in (*default_excludes, *opts.exclude_patterns)]
        includes = [re.compile(p) for p in opts.include_patterns]
        for name, module in candidates.items():
            if any(p.fullmatch(name) for p in excludes) and not any(p.fullmatch(name) for p in includes):
                if opts.verbose:
                    logger.info("exclude: %s", name)
                continue
            dim = next((d for pattern, d in opts.reg_dims.items() if re.fullmatch(pattern, name)), default_dim)
            if dim == 0:
                if opts.verbose:
                    logger.info("rank 0 from network_reg_dims, skipped: %s", name)
                continue
            self.add_lora(self._make_lora(prefix, name, module, dim, alpha), is_unet)

    def log_summary(self) -> None:
        logger.info(
            "LoRA network: %d DiT modules, %d text encoder modules", len(self.unet_loras), len(self.text_encoder_loras)
        )
        if self.options.verbose:
            for lora in self.text_encoder_loras + self.unet_loras:
                logger.info("  %-70s rank %d, alpha %g", lora.lora_name, lora.lora_dim, float(lora.alpha))

    # -- the sd-scripts contract

    def apply_to(
        self,
        text_encoders: Any = None,
        unet: nn.Module | None = None,
        apply_text_encoder: bool = True,
        apply_unet: bool = True,
    ) -> None:
        """Hook the LoRA modules into the models; groups not applied are dropped from the network (and the file)."""
        if not apply_text_encoder:
            self._drop(self.text_encoder_loras)
            self.text_encoder_loras = []
        if not apply_unet:
            self._drop(self.unet_loras)
            self.unet_loras = []
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.apply_to()
        logger.info(
            "LoRA applied: %d DiT modules, %d text encoder modules", len(self.unet_loras), len(self.text_encoder_loras)
        )

    def _drop(self, loras: Sequence[LoRAModule]) -> None:
        for lora in loras:
            if lora.applied:
                raise ValueError(f"{lora.lora_name} is already applied and cannot be dropped")
            delattr(self, lora.lora_name)

    def set_multiplier(self, multiplier: float) -> None:
        self.multiplier = float(multiplier)
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.multiplier = self.multiplier

    def set_enabled(self, enabled: bool) -> None:
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.enabled = bool(enabled)

    def is_mergeable(self) -> bool:
        return True

    def set_loraplus_lr_ratio(
        self, loraplus_lr_ratio: float | None, unet_ratio: float | None, text_encoder_ratio: float | None
    ) -> None:
        self.options.loraplus_lr_ratio = loraplus_lr_ratio
        self.options.loraplus_unet_lr_ratio = unet_ratio
        self.options.loraplus_text_encoder_lr_ratio = text_encoder_ratio

    def _loraplus_ratio(self, is_unet: bool) -> float | None:
        specific = self.options.loraplus_unet_lr_ratio if is_unet else self.options.loraplus_text_encoder_lr_ratio
        return specific if specific is not None else self.options.loraplus_lr_ratio

    def load_weights(self, file: str | os.PathLike) -> Any:
        """Load a LoRA file (continue training); missing/unexpected modules are logged, a rank mismatch is an error."""
        weights_sd = normalize_lora_state_dict(load_safetensors(file))
        own = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        unexpected = sorted(k for k in weights_sd if k not in own)
        for key, value in weights_sd.items():
            if key in own:
                expected = own[key]
                if tuple(value.shape) != expected:
                    raise UserError(
                        f"--network_weights '{file}': '{key}' has shape {tuple(value.shape)} but the network expects"
                        f" {expected}; use --dim_from_weights to take the ranks from the file."
                    )
        info = self.load_state_dict(weights_sd, strict=False)
        if unexpected:
            logger.warning(
                "%d keys of '%s' match no LoRA module of this network (e.g. %s)", len(unexpected), file, unexpected[:3]
            )
        if info.missing_keys:
            logger.warning(
                "%d LoRA keys are not in '%s' and keep their initial values (e.g. %s)",
                len(info.missing_keys),
                file,
                info.missing_keys[:3],
            )
        logger.info("loaded LoRA weights from %s", file)
        return info

    def prepare_optimizer_params_with_multiple_te_lrs(
        self, text_encoder_lr: float | Sequence[float] | None, unet_lr: float | None, default_lr: float | None
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Optimizer parameter groups and their descriptions (for `lr/<description>` logs).

        Groups: per `network_reg_lrs` regex (first match wins; 'reg_lr_<i>'), then the rest; each split in two
        with LoRA+ (lora_up gets lr * ratio, description '... plus'). A group whose lr is 0 or None is left out:
        its parameters are frozen (requires_grad False, also after prepare_grad_etc).
        """
        te_lr = _single_lr(text_encoder_lr, default_lr)
        u_lr = unet_lr if unet_lr is not None else default_lr
        self._frozen = []
        params: list[dict[str, Any]] = []
        descriptions: list[str] = []
        for loras, lr, ratio, label in (
            (self.text_encoder_loras, te_lr, self._loraplus_ratio(False), "textencoder"),
            (self.unet_loras, u_lr, self._loraplus_ratio(True), "unet"),
        ):
            if not loras:
                continue
            groups = self._param_groups(loras, lr, ratio)
            for desc, group in groups:
                params.append(group)
                descriptions.append(f"{label} {desc}".strip())
        self.prepare_grad_etc()
        return params, descriptions

    def prepare_optimizer_params(
        self, text_encoder_lr: float | Sequence[float] | None, unet_lr: float | None, default_lr: float | None
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Same as prepare_optimizer_params_with_multiple_te_lrs (older name of the contract)."""
        return self.prepare_optimizer_params_with_multiple_te_lrs(text_encoder_lr, unet_lr, default_lr)

    def _param_groups(
        self, loras: Sequence[LoRAModule], lr: float | None, ratio: float | None
    ) -> list[tuple[str, dict[str, Any]]]:
        reg = list(self.options.reg_lrs.items())
        buckets: dict[tuple[int, bool], list[nn.Parameter]] = {}
        for lora in loras:
            index = next((i for i, (pattern, _) in enumerate(reg) if re.fullmatch(pattern, lora.original_name)), -1)
            if index >= 0 and self.options.verbose:
                logger.info("%s: lr %g from network_reg_lrs %r", lora.original_name, reg[index][1], reg[index][0])
            for pname, param in lora.named_parameters():
                plus = ratio is not None and pname.startswith("lora_up")
                buckets.setdefault((index, plus), []).append(param)
        groups = []
        for (index, plus), plist in sorted(buckets.items(), key=lambda kv: (kv[0][0] < 0, kv[0][0], kv[0][1])):
            base = reg[index][1] if index >= 0 else lr
            group_lr = None if base is None else (base * ratio if plus else base)
            desc = (f"reg_lr_{index}" if index >= 0 else "") + (" plus" if plus else "")
            if not group_lr:
                logger.info("LoRA parameter group '%s' has lr %s: not trained", desc.strip() or "default", group_lr)
                self._frozen.extend(plist)
                continue
            groups.append((desc.strip(), {"params": plist, "lr": group_lr}))
        return groups

    def enable_gradient_checkpointing(self) -> None:
        """Nothing to do: the LoRA branch runs inside the model's checkpointed blocks and is recomputed with them."""
        logger.debug("LoRA modules are recomputed with the model's checkpointed blocks")

    def prepare_grad_etc(self, text_encoder: Any = None, unet: Any = None) -> None:
        self.requires_grad_(True)
        for param in self._frozen:
            param.requires_grad_(False)

    def on_epoch_start(self, text_encoder: Any = None, unet: Any = None) -> None:
        self.train()

    def get_trainable_params(self) -> Iterable[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def save_weights(
        self, file: str | os.PathLike, dtype: torch.dtype | None, metadata: Mapping[str, Any] | None
    ) -> None:
        """Write the LoRA as .safetensors atomically; with metadata, the sshs_* hashes are added first."""
        if os.path.splitext(str(file))[1].lower() != ".safetensors":
            raise UserError(
                f"Cannot save the LoRA as '{file}': only .safetensors is written; use --save_model_as safetensors."
            )
        state_dict = {k: v.detach().to("cpu", dtype=dtype if dtype is not None else v.dtype).contiguous()
                      for k, v in self.state_dict().items()}
        meta = stringify(metadata) if metadata else {}
        if meta:
            add_hashes(state_dict, meta)
        save_file_atomic(state_dict, file, meta or None)
        logger.info("saved LoRA (%d tensors) to %s", len(state_dict), file)

    def apply_max_norm_regularization(
        self, max_norm_value: float, device: torch.device | str
    ) -> tuple[int, float, float]:
        """Scale down every module whose update norm |scale * up @ down| exceeds max_norm_value (--scale_weight_norms).

        Returns (number of modules scaled, mean norm after scaling, max norm after scaling).
        """
        scaled = 0
        norms = []
        with torch.no_grad():
            for lora in self.text_encoder_loras + self.unet_loras:
                up = lora.lora_up.weight.to(device, torch.float32)
                down = lora.lora_down.weight.to(device, torch.float32)
                norm = ((up @ down) * lora.scale).norm()
                ratio = 1.0
                if norm > max_norm_value:
                    ratio = float(max_norm_value / norm)
                    factor = math.sqrt(ratio)
                    lora.lora_up.weight.mul_(factor)
                    lora.lora_down.weight.mul_(factor)
                    scaled += 1
                norms.append(float(norm) * ratio)
        if not norms:
            return 0, 0.0, 0.0
        return scaled, sum(norms) / len(norms), max(norms)

    def merge_to(
        self,
        text_encoders: Any,
        unet: nn.Module | None,
        weights_sd: Mapping[str, torch.Tensor],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Merge `weights_sd` into the base weights of the modules this network was built on (inference)."""
        weights_sd = normalize_lora_state_dict(weights_sd)
        merged = 0
        for lora in self.text_encoder_loras + self.unet_loras:
            down = weights_sd.get(f"{lora.lora_name}.{LORA_DOWN}")
            up = weights_sd.get(f"{lora.lora_name}.{LORA_UP}")
            if down is None or up is None:
                continue
            alpha = weights_sd.get(f"{lora.lora_name}.{ALPHA}")
            weight = lora.org_module.weight
            prefix = prefix_for(lora.lora_name.startswith(LORA_PREFIX_UNET + "_"))
            reject_quantized_weight(lora.original_name + ".weight", weight, prefix)
            target = weight.data.to(device) if device is not None else weight.data
            new = merged_weight(target, [(down, up, alpha, lora.multiplier)])
            weight.data = new.to(dtype) if dtype is not None else new
            merged += 1
        logger.info("merged %d LoRA modules into the base weights", merged)


def _single_lr(value: float | Sequence[float] | None, default: float | None) -> float | None:
    if value is None:
        return default
    if isinstance(value, (int, float)):
        return float(value)
    values = list(value)
    if not values:
        return default
    if len(values) > 1:
        logger.warning(
            "--text_encoder_lr has %d values; MOSS-Image has one text encoder, using %g", len(values), values[0]
        )
    return float(values[0])


def normalize_lora_state_dict(weights_sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our sd-scripts keys (diffusers / ComfyUI PEFT keys converted to them, fused qkv modules split)."""
    return to_sd_scripts(weights_sd)


# ----------------------------------------------------------------------------------------------------------------------
# entry points of the network-module contract


def create_network(
    multiplier: float,
    network_dim: int | None,
    network_alpha: float | None,
    vae: Any,
    text_encoders: Any,
    unet: nn.Module | None,
    neuron_dropout: float | None = None,
    **kwargs: Any,
) -> LoRANetwork:
    """The LoRA network for training (`--network_dim`, `--network_alpha`, `--network_dropout`, `--network_args`)."""
    options = NetworkOptions.from_kwargs(kwargs)
    dim = DEFAULT_NETWORK_DIM if network_dim is None else int(network_dim)
    if dim <= 0:
        raise UserError(f"--network_dim {network_dim} is not a positive rank: give e.g. --network_dim 16.")
    alpha = DEFAULT_NETWORK_ALPHA if network_alpha is None else float(network_alpha)
    dropout = None
    if neuron_dropout is not None:
        dropout = parse_float("--network_dropout", neuron_dropout, 0.0, 1.0)
    logger.info(
        "create LoRA network: rank %d, alpha %g, dropout %s, rank dropout %s, module dropout %s",
        dim, alpha, dropout, options.rank_dropout, options.module_dropout,
    )
    network = LoRANetwork(multiplier, options, dropout)
    names: list[str] = []
    text_encoder = _single_text_encoder(text_encoders)
    if text_encoder is not None:
        te_candidates = text_encoder_candidates(text_encoder)
        names += list(te_candidates)
        network.build_from_candidates(te_candidates, False, dim, alpha, TEXT_ENCODER_DEFAULT_EXCLUDE)
    if unet is not None:
        unet_candidates = dit_candidates(unet, options.train_text_embedder)
        names += list(unet_candidates)
        network.build_from_candidates(unet_candidates, True, dim, alpha)
    _warn_unused_patterns("exclude_patterns", options.exclude_patterns, names)
    _warn_unused_patterns("include_patterns", options.include_patterns, names)
    _warn_unused_patterns("network_reg_dims", options.reg_dims, names)
    _warn_unused_patterns("network_reg_lrs", options.reg_lrs, names)
    if names and not network.unet_loras and not network.text_encoder_loras:
        raise UserError(
            "No LoRA module is left after exclude_patterns / network_reg_dims (rank 0): loosen the patterns in"
            " --network_args."
        )
    if options.train_text_embedder:
        logger.info("text embedder LoRA enabled (train_text_embedder)")
    network.log_summary()
    return network


def _weights_modules(weights_sd: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    dims: dict[str, int] = {}
    alphas: dict[str, torch.Tensor] = {}
    for key, value in weights_sd.items():
        name, _, suffix = key.partition(".")
        if suffix == LORA_DOWN:
            dims[name] = int(value.shape[0])
        elif suffix == ALPHA:
            alphas[name] = value
    return dims, alphas


def create_network_from_weights(
    multiplier: float,
    file: str | os.PathLike | None,
    vae: Any,
    text_encoders: Any,
    unet: nn.Module | None,
    weights_sd: Mapping[str, torch.Tensor] | None = None,
    for_inference: bool = False,
    **kwargs: Any,
) -> tuple[LoRANetwork, dict[str, torch.Tensor]]:
    """Build the network whose modules and ranks are those of a LoRA file (`--dim_from_weights`, inference)."""
    options = NetworkOptions.from_kwargs(kwargs)
    ignored = [k for k in _SELECTION_ARGS if k in kwargs]
    if ignored:
        logger.warning(
            "--network_args %s ignored: the modules and ranks come from the weights file", ", ".join(ignored)
        )
    if weights_sd is None:
        if file is None:
            raise ValueError("create_network_from_weights needs a file or weights_sd")
        weights_sd = load_safetensors(file)
    weights_sd = normalize_lora_state_dict(weights_sd)
    dims, alphas = _weights_modules(weights_sd)
    if for_inference:
        options.rank_dropout = options.module_dropout = None
    network = LoRANetwork(multiplier, options, None)
    available: dict[str, tuple[str, nn.Module, bool]] = {}
    text_encoder = _single_text_encoder(text_encoders)
    if text_encoder is not None:
        for name, module in text_encoder.named_modules():
            if name and is_linear_like(module):
                available[lora_name_for(LORA_PREFIX_TEXT_ENCODER, name)] = (name, module, False)
    if unet is not None:
        for name, module in unet.named_modules():
            if name and is_linear_like(module):
                available[lora_name_for(LORA_PREFIX_UNET, name)] = (name, module, True)
    unmatched = []
    for lora_name, dim in dims.items():
        if lora_name not in available:
            unmatched.append(lora_name)
            continue
        name, module, is_unet = available[lora_name]
        prefix = prefix_for(is_unet)
        network.add_lora(network._make_lora(prefix, name, module, dim, alphas.get(lora_name)), is_unet)
    _report_unmatched(file, unmatched, text_encoder is not None, unet is not None)
    if dims and not network.unet_loras and not network.text_encoder_loras:
        raise UserError(
            f"The LoRA '{file}' matches no module of the given model(s) (e.g. {sorted(dims)[:3]}):"
            " it is not a MOSS-Image LoRA, or it was trained for the other model (DiT vs text encoder)."
        )
    network.log_summary()
    return network, dict(weights_sd)


def _report_unmatched(file: Any, unmatched: list[str], have_te: bool, have_unet: bool) -> None:
    skipped_te = [n for n in unmatched if n.startswith(LORA_PREFIX_TEXT_ENCODER + "_") and not have_te]
    skipped_unet = [n for n in unmatched if n.startswith(LORA_PREFIX_UNET + "_") and not have_unet]
    if skipped_te:
        logger.info("%d text encoder LoRA modules of '%s' are not used (no text encoder given)", len(skipped_te), file)
    if skipped_unet:
        logger.info("%d DiT LoRA modules of '%s' are not used (no DiT given)", len(skipped_unet), file)
    real = sorted(set(unmatched) - set(skipped_te) - set(skipped_unet))
    if real:
        logger.warning("%d LoRA modules of '%s' match no module of the model (e.g. %s)", len(real), file, real[:5])
