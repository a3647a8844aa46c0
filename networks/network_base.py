"""What the LoRA-family network modules share: module selection, the wrapped-module base, the network object.

`networks.lora_generic`, `networks.loha` and `networks.lokr` differ only in the math of one module (an
`AdapterModule` subclass) and in a few `--network_args` of their own; everything else is here, written once:

- Selection (the MOSS-Image target list of `library.moss_image.lora_targets`): every Linear-like module inside a
  DiT block; with `train_text_embedder=True` (alias `train_llm_adapter`) also inside the text embedder; in the
  Qwen3.5 text encoder, inside its attention, linear-attention and MLP modules, `.*in_proj_[ab]` excluded by default.
  Then `exclude_patterns` / `include_patterns` (re.fullmatch on module names), `network_reg_dims` (per-module rank,
  0 leaves the module out). "Linear-like" means `nn.Linear` or any module that reports integer `in_features` /
  `out_features` (the ConvRot INT8 Linear replacement included).
- The module: y = org(x) + multiplier * delta(x); it wraps the original forward and never touches its weights.
  Module dropout skips a module for a step; rank dropout and dropout act on the module's own path.
- The network (`AdapterNetwork`): the sd-scripts network contract the trainer calls (apply_to, optimizer parameter
  groups with `network_reg_lrs` and LoRA+, save / load, max-norm regularisation, merge_to); its state_dict is the
  file, with the key names of `library.lora.conventions`.
- `build_network` / `build_network_from_weights`: the bodies of `create_network` / `create_network_from_weights`
  of the three modules.
"""

from __future__ import annotations

import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from library.errors import UserError
from library.files.model_spec import add_hashes, stringify
from library.files.safetensors_io import load_safetensors, save_file_atomic
from library.lora.conventions import (
    ALGORITHM_LABELS,
    ALPHA,
    LORA_PREFIX_TEXT_ENCODER,
    LORA_PREFIX_UNET,
    MODULE_SUFFIXES,
    effective_alpha,
    group_modules,
    lora_name_for,
    module_algorithm,
    prefix_for,
)
from library.lora.convert import to_sd_scripts
from library.lora.eager_node import ADAPTER_ATTR
from library.lora.merge import merged_modules, reject_quantized_weight
from library.moss_image.lora_targets import (
    DIT_BLOCK_CLASSES,
    DIT_TEXT_EMBEDDER_CLASSES,
    TEXT_ENCODER_DEFAULT_EXCLUDE,
    TEXT_ENCODER_TARGET_CLASSES,
)
from networks.network_args import (
    COMMON_NETWORK_ARGS,
    DEFAULT_NETWORK_ALPHA,
    DEFAULT_NETWORK_DIM,
    SELECTION_ARGS,
    NetworkOptions,
    check_network_args,
    resolve_dropout,
)

logger = logging.getLogger(__name__)

# the network module that trains each algorithm (for messages about a file of another kind)
NETWORK_MODULES = {"lora": "networks.lora_generic", "loha": "networks.loha", "lokr": "networks.lokr"}


# ----------------------------------------------------------------------------------------------------------------------
# module selection


def is_linear_like(module: nn.Module) -> bool:
    """nn.Linear, or a replacement (ConvRot INT8 Linear, ...) that reports integer in_features / out_features."""
    if isinstance(module, AdapterModule):
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


def dit_candidates(
    unet: nn.Module, train_text_embedder: bool, module_name: str = "networks.lora_generic"
) -> dict[str, nn.Module]:
    """Default targets of the MOSS-Image DiT, by module name."""
    embedder = _linear_modules_under(unet, DIT_TEXT_EMBEDDER_CLASSES)
    blocks = {k: v for k, v in _linear_modules_under(unet, DIT_BLOCK_CLASSES).items() if k not in embedder}
    if not blocks and not embedder:
        raise UserError(
            f"{module_name} found no MossImageBlock in the DiT (class {type(unet).__name__}): this network"
            " module supports the MOSS-Image DiT; check --pretrained_model_name_or_path and --network_module."
        )
    if train_text_embedder:
        if not embedder:
            logger.warning("train_text_embedder=True but the DiT has no MossImageTextEmbedder: no text embedder modules")
        return {**blocks, **embedder}
    return blocks


def text_encoder_candidates(text_encoder: nn.Module) -> dict[str, nn.Module]:
    """Default targets of the Qwen3.5 text encoder (before the default `.*in_proj_[ab]` exclusion)."""
    found = _linear_modules_under(text_encoder, TEXT_ENCODER_TARGET_CLASSES)
    if not found:
        logger.warning(
            "the text encoder (class %s) has none of %s: no text encoder modules",
            type(text_encoder).__name__,
            ", ".join(TEXT_ENCODER_TARGET_CLASSES),
        )
    return found


def single_text_encoder(text_encoders: Any, module_name: str = "networks.lora_generic") -> nn.Module | None:
    """The one text encoder among what the trainer passes (a module, a list with None for a freed one, or None)."""
    if text_encoders is None:
        return None
    if isinstance(text_encoders, nn.Module):
        return text_encoders
    present = [te for te in text_encoders if te is not None]
    if len(present) > 1:
        raise ValueError(f"{module_name} supports one text encoder, got {len(present)}")
    return present[0] if present else None


def _warn_unused_patterns(kind: str, patterns: Iterable[str], names: Sequence[str]) -> None:
    for pattern in patterns:
        if not any(re.fullmatch(pattern, n) for n in names):
            example = names[0] if names else "layers.0.proj.q"
            logger.warning(
                "%s pattern %r matches no module (patterns use re.fullmatch on names like %r)", kind, pattern, example
            )


# ----------------------------------------------------------------------------------------------------------------------
# the wrapped module


class AdapterModule(nn.Module, ABC):
    """y = org(x) + multiplier * delta(x), with delta from the module's own tensors; never touches org's weights."""

    PLUS_PARAMS: ClassVar[tuple[str, ...]] = ()  # parameter names LoRA+ trains at lr * ratio (name prefixes)

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
        self.in_dim, self.out_dim = int(org_module.in_features), int(org_module.out_features)
        self.register_buffer("alpha", torch.tensor(effective_alpha(alpha, self.lora_dim), dtype=torch.float32))
        self.scale = self._scale()
        self.multiplier = float(multiplier)
        self.dropout = dropout
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout
        self.enabled = True
        self._org_module = [org_module]  # a list keeps it out of this module's children and state_dict
        self._org_forward = None
        self.org_forward_is_own = False  # set by apply_to: the replaced forward was the module's own

    def _scale(self) -> float:
        """alpha / rank (the alpha rule of library.lora.conventions)."""
        return float(self.alpha.float().item()) / self.lora_dim

    @property
    def org_module(self) -> nn.Module:
        return self._org_module[0]

    @property
    def applied(self) -> bool:
        return self._org_forward is not None

    def apply_to(self) -> None:
        """Route the original module's forward through this module (idempotent). The original module also keeps a
        plain reference to this adapter (`ADAPTER_ATTR`, outside its submodules and state dict), and whether the
        forward it replaced was the module's own is noted here: code that torch.compile traces asks those, since
        some torch versions trace no `__self__` or `__func__` of a bound method (library.lora.eager_node)."""
        if self.applied:
            return
        org = self.org_module
        self._org_forward = org.forward
        self.org_forward_is_own = getattr(self._org_forward, "__func__", None) is type(org).forward
        org.forward = self.forward
        object.__setattr__(org, ADAPTER_ATTR, self)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.scale = self._scale()

    def _adapter_input(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x in the dtype of the module's tensors, unless autocast chooses the matmul dtype."""
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(weight.dtype)
        return x

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self._org_forward(x, *args, **kwargs)
        if not self.enabled or self.multiplier == 0:
            return out
        # on torch's global CPU generator, which checkpointing saves and restores, so that a recomputed forward makes
        # the same decision as the first one (a generator of the trainer's own would not be restored)
        if self.training and self.module_dropout and torch.rand(()) < self.module_dropout:
            return out
        return self.add_delta(out, x)

    def add_delta(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + multiplier * delta(x), in out's dtype."""
        return out + (self.delta_output(x) * self.multiplier).to(out.dtype)

    def drop_output(self, delta: torch.Tensor) -> torch.Tensor:
        """Training-time dropouts on the module's output change: rank dropout drops output features of each sample
        (rows of dW, rescaled so the mean is kept), dropout drops single values."""
        if self.training and self.rank_dropout and delta.dim() >= 2:
            keep = torch.rand(delta.shape[0], delta.shape[-1], device=delta.device) > self.rank_dropout
            keep = keep.to(delta.dtype).view(delta.shape[0], *([1] * (delta.dim() - 2)), delta.shape[-1])
            delta = delta * keep / (1.0 - self.rank_dropout)
        if self.training and self.dropout:
            delta = nn.functional.dropout(delta, p=self.dropout)
        return delta

    def is_plus_param(self, name: str) -> bool:
        return name.startswith(self.PLUS_PARAMS)

    @abstractmethod
    def delta_output(self, x: torch.Tensor) -> torch.Tensor:
        """scale * dW applied to x (without the multiplier), training-time dropouts included."""

    @abstractmethod
    def weight_delta(self) -> torch.Tensor:
        """scale * dW in fp32, detached, without the multiplier."""

    @abstractmethod
    def scale_weights_(self, ratio: float) -> None:
        """Multiply dW by `ratio` in place (max-norm regularisation)."""

    def delta_weight(self) -> torch.Tensor:
        """multiplier * scale * dW in fp32 (the weight change this module stands for), detached."""
        return self.weight_delta() * self.multiplier


# ----------------------------------------------------------------------------------------------------------------------
# the network


class AdapterNetwork(nn.Module):
    """The modules of one run; its state_dict is the file. Subclasses name their module class and algorithm."""

    MODULE_NAME: ClassVar[str] = "networks.lora_generic"
    ALGORITHM: ClassVar[str] = "lora"
    ALGORITHM_NAMES: ClassVar[tuple[str, ...]] = ("lora",)  # values of `algo=` that mean this network
    EXTRA_ARGS: ClassVar[dict[str, str]] = {}  # --network_args of this module beyond COMMON_NETWORK_ARGS
    LAYOUT_ARGS: ClassVar[tuple[str, ...]] = ()  # of those, the ones that choose shapes (ignored from a file)
    module_class: ClassVar[type[AdapterModule]]

    def __init__(
        self,
        multiplier: float = 1.0,
        options: NetworkOptions | None = None,
        dropout: float | None = None,
        module_kwargs: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        self.multiplier = float(multiplier)
        self.options = options or NetworkOptions()
        self.dropout = dropout
        self.module_kwargs = dict(module_kwargs or {})
        self.text_encoder_loras: list[AdapterModule] = []
        self.unet_loras: list[AdapterModule] = []
        self._frozen: list[nn.Parameter] = []  # parameters of groups whose lr is 0: not trained, no gradients

    @classmethod
    def label(cls) -> str:
        return ALGORITHM_LABELS[cls.ALGORITHM]

    @classmethod
    def accepted_args(cls) -> dict[str, str]:
        return {**COMMON_NETWORK_ARGS, **cls.EXTRA_ARGS}

    @classmethod
    def parse_module_kwargs(cls, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """This module's own --network_args (EXTRA_ARGS) as keyword arguments of its module class."""
        return {}

    # A subclass also defines `module_args_from_parts(parts) -> dict` (a classmethod): the keyword arguments
    # (lora_dim, alpha, ...) that rebuild one of its modules from the module's saved tensors.

    # -- building

    def add_lora(self, lora: AdapterModule, is_unet: bool) -> None:
        if hasattr(self, lora.lora_name):
            raise ValueError(f"duplicate module name {lora.lora_name} (two module paths map to the same key)")
        self.add_module(lora.lora_name, lora)
        (self.unet_loras if is_unet else self.text_encoder_loras).append(lora)

    def _make_lora(
        self, prefix: str, name: str, module: nn.Module, dim: int, alpha: float | torch.Tensor | None, **extra: Any
    ) -> AdapterModule:
        opts = self.options
        return self.module_class(
            lora_name_for(prefix, name),
            name,
            module,
            multiplier=self.multiplier,
            lora_dim=dim,
            alpha=alpha,
            dropout=self.dropout,
            rank_dropout=opts.rank_dropout,
            module_dropout=opts.module_dropout,
            **{**self.module_kwargs, **extra},
        )

    def build_from_candidates(
        self,
        candidates: Mapping[str, nn.Module],
        is_unet: bool,
        default_dim: int,
        alpha: float,
        default_excludes: Sequence[str] = (),
    ) -> None:
        """Create modules for the candidates that survive the exclude/include filters, with regex ranks."""
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

    def finish_build(self) -> None:
        """Called once the modules are made (LoKr reports the modules that became full matrices)."""

    def log_summary(self) -> None:
        logger.info(
            "%s network: %d DiT modules, %d text encoder modules",
            self.label(), len(self.unet_loras), len(self.text_encoder_loras),
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
        """Hook the modules into the models; groups not applied are dropped from the network (and the file)."""
        if not apply_text_encoder:
            self._drop(self.text_encoder_loras)
            self.text_encoder_loras = []
        if not apply_unet:
            self._drop(self.unet_loras)
            self.unet_loras = []
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.apply_to()
        logger.info(
            "%s applied: %d DiT modules, %d text encoder modules",
            self.label(), len(self.unet_loras), len(self.text_encoder_loras),
        )

    def _drop(self, loras: Sequence[AdapterModule]) -> None:
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
        """Load a file (continue training); missing/unexpected modules are logged, a rank mismatch is an error."""
        weights_sd = normalize_lora_state_dict(load_safetensors(file))
        check_algorithm(type(self), weights_sd, file, "--network_weights")
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
                "%d keys of '%s' match no module of this network (e.g. %s)", len(unexpected), file, unexpected[:3]
            )
        if info.missing_keys:
            logger.warning(
                "%d keys are not in '%s' and keep their initial values (e.g. %s)",
                len(info.missing_keys),
                file,
                info.missing_keys[:3],
            )
        logger.info("loaded %s weights from %s", self.label(), file)
        return info

    def prepare_optimizer_params_with_multiple_te_lrs(
        self, text_encoder_lr: float | Sequence[float] | None, unet_lr: float | None, default_lr: float | None
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Optimizer parameter groups and their descriptions (for `lr/<description>` logs).

        Groups: per `network_reg_lrs` regex (first match wins; 'reg_lr_<i>'), then the rest; each split in two
        with LoRA+ (the module's "up" parameters get lr * ratio, description '... plus'). A group whose lr is 0 or
        None is left out: its parameters are frozen (requires_grad False, also after prepare_grad_etc).
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
        self, loras: Sequence[AdapterModule], lr: float | None, ratio: float | None
    ) -> list[tuple[str, dict[str, Any]]]:
        reg = list(self.options.reg_lrs.items())
        buckets: dict[tuple[int, bool], list[nn.Parameter]] = {}
        for lora in loras:
            index = next((i for i, (pattern, _) in enumerate(reg) if re.fullmatch(pattern, lora.original_name)), -1)
            if index >= 0 and self.options.verbose:
                logger.info("%s: lr %g from network_reg_lrs %r", lora.original_name, reg[index][1], reg[index][0])
            for pname, param in lora.named_parameters():
                plus = ratio is not None and lora.is_plus_param(pname)
                buckets.setdefault((index, plus), []).append(param)
        groups = []
        for (index, plus), plist in sorted(buckets.items(), key=lambda kv: (kv[0][0] < 0, kv[0][0], kv[0][1])):
            base = reg[index][1] if index >= 0 else lr
            group_lr = None if base is None else (base * ratio if plus else base)
            desc = (f"reg_lr_{index}" if index >= 0 else "") + (" plus" if plus else "")
            if not group_lr:
                logger.info("parameter group '%s' has lr %s: not trained", desc.strip() or "default", group_lr)
                self._frozen.extend(plist)
                continue
            groups.append((desc.strip(), {"params": plist, "lr": group_lr}))
        return groups

    def enable_gradient_checkpointing(self) -> None:
        """Nothing to do: the modules run inside the model's checkpointed blocks and are recomputed with them."""
        logger.debug("network modules are recomputed with the model's checkpointed blocks")

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
        """Write the network as .safetensors atomically; with metadata, the sshs_* hashes are added first."""
        if os.path.splitext(str(file))[1].lower() != ".safetensors":
            raise UserError(
                f"Cannot save the {self.label()} as '{file}': only .safetensors is written; use --save_model_as"
                " safetensors."
            )
        state_dict = {k: v.detach().to("cpu", dtype=dtype if dtype is not None else v.dtype).contiguous()
                      for k, v in self.state_dict().items()}
        meta = stringify(metadata) if metadata else {}
        if meta:
            add_hashes(state_dict, meta)
        save_file_atomic(state_dict, file, meta or None)
        logger.info("saved %s (%d tensors) to %s", self.label(), len(state_dict), file)

    def apply_max_norm_regularization(
        self, max_norm_value: float, device: torch.device | str
    ) -> tuple[int, float, float]:
        """Scale down every module whose update norm |scale * dW| exceeds max_norm_value (--scale_weight_norms).

        Returns (number of modules scaled, mean norm after scaling, max norm after scaling).
        """
        scaled = 0
        norms = []
        with torch.no_grad():
            for lora in self.text_encoder_loras + self.unet_loras:
                norm = float(lora.weight_delta().to(device).norm())
                ratio = 1.0
                if norm > max_norm_value:
                    ratio = max_norm_value / norm
                    lora.scale_weights_(ratio)
                    scaled += 1
                norms.append(norm * ratio)
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
            parts = {s: weights_sd[f"{lora.lora_name}.{s}"] for s in MODULE_SUFFIXES
                     if f"{lora.lora_name}.{s}" in weights_sd}
            if all(s == ALPHA for s in parts):
                continue
            weight = lora.org_module.weight
            key = lora.original_name + ".weight"
            reject_quantized_weight(key, weight, prefix_for(lora.lora_name.startswith(LORA_PREFIX_UNET + "_")))
            target = weight.data.to(device) if device is not None else weight.data
            new = merged_modules(target, [(parts, lora.multiplier)], key)
            weight.data = new.to(dtype) if dtype is not None else new
            merged += 1
        logger.info("merged %d %s modules into the base weights", merged, self.label())


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


def check_algorithm(
    network_class: type[AdapterNetwork], weights_sd: Mapping[str, torch.Tensor], file: Any, option: str
) -> None:
    """UserError when a file holds modules but none of the network's algorithm (a LoRA given to networks.loha...)."""
    if not weights_sd:
        return
    found = {module_algorithm(parts, f"{p}_{n}", str(file)) for (p, n), parts in group_modules(weights_sd).items()}
    if network_class.ALGORITHM in found:
        return
    kinds = sorted(found)
    raise UserError(
        f"{option} '{file}' holds {' and '.join(ALGORITHM_LABELS[k] for k in kinds)} modules, but --network_module"
        f" {network_class.MODULE_NAME} trains {network_class.label()}: use --network_module"
        f" {' / '.join(NETWORK_MODULES[k] for k in kinds)} for this file."
    )


# ----------------------------------------------------------------------------------------------------------------------
# the bodies of create_network / create_network_from_weights


def parse_network_kwargs(network_class: type[AdapterNetwork], kwargs: Mapping[str, Any]) -> NetworkOptions:
    check_network_args(kwargs, network_class.MODULE_NAME, network_class.accepted_args(), network_class.ALGORITHM_NAMES)
    return NetworkOptions.from_kwargs(kwargs)


def build_network(
    network_class: type[AdapterNetwork],
    multiplier: float,
    network_dim: int | None,
    network_alpha: float | None,
    text_encoders: Any,
    unet: nn.Module | None,
    neuron_dropout: float | None,
    kwargs: Mapping[str, Any],
) -> AdapterNetwork:
    """A network for training (`--network_dim`, `--network_alpha`, `--network_dropout`, `--network_args`)."""
    options = parse_network_kwargs(network_class, kwargs)
    module_kwargs = network_class.parse_module_kwargs(kwargs)
    dim = DEFAULT_NETWORK_DIM if network_dim is None else int(network_dim)
    if dim <= 0:
        raise UserError(f"--network_dim {network_dim} is not a positive rank: give e.g. --network_dim 16.")
    alpha = DEFAULT_NETWORK_ALPHA if network_alpha is None else float(network_alpha)
    dropout = resolve_dropout(neuron_dropout, options.dropout)
    label = network_class.label()
    logger.info(
        "create %s network: rank %d, alpha %g, dropout %s, rank dropout %s, module dropout %s%s",
        label, dim, alpha, dropout, options.rank_dropout, options.module_dropout,
        "".join(f", {k} {v}" for k, v in module_kwargs.items()),
    )
    network = network_class(multiplier, options, dropout, module_kwargs)
    names: list[str] = []
    text_encoder = single_text_encoder(text_encoders, network_class.MODULE_NAME)
    if text_encoder is not None:
        te_candidates = text_encoder_candidates(text_encoder)
        names += list(te_candidates)
        network.build_from_candidates(te_candidates, False, dim, alpha, TEXT_ENCODER_DEFAULT_EXCLUDE)
    if unet is not None:
        unet_candidates = dit_candidates(unet, options.train_text_embedder, network_class.MODULE_NAME)
        names += list(unet_candidates)
        network.build_from_candidates(unet_candidates, True, dim, alpha)
    _warn_unused_patterns("exclude_patterns", options.exclude_patterns, names)
    _warn_unused_patterns("include_patterns", options.include_patterns, names)
    _warn_unused_patterns("network_reg_dims", options.reg_dims, names)
    _warn_unused_patterns("network_reg_lrs", options.reg_lrs, names)
    if names and not network.unet_loras and not network.text_encoder_loras:
        raise UserError(
            f"No {label} module is left after exclude_patterns / network_reg_dims (rank 0): loosen the patterns in"
            " --network_args."
        )
    if options.train_text_embedder:
        logger.info("text embedder %s enabled (train_text_embedder)", label)
    network.finish_build()
    network.log_summary()
    return network


def build_network_from_weights(
    network_class: type[AdapterNetwork],
    multiplier: float,
    file: str | os.PathLike | None,
    text_encoders: Any,
    unet: nn.Module | None,
    weights_sd: Mapping[str, torch.Tensor] | None,
    for_inference: bool,
    kwargs: Mapping[str, Any],
) -> tuple[AdapterNetwork, dict[str, torch.Tensor]]:
    """The network whose modules and ranks are those of a file (`--dim_from_weights`, inference)."""
    options = parse_network_kwargs(network_class, kwargs)
    ignored = [k for k in (*SELECTION_ARGS, *network_class.LAYOUT_ARGS) if k in kwargs]
    if ignored:
        logger.warning(
            "--network_args %s ignored: the modules and ranks come from the weights file", ", ".join(ignored)
        )
    if weights_sd is None:
        if file is None:
            raise ValueError("create_network_from_weights needs a file or weights_sd")
        weights_sd = load_safetensors(file)
    weights_sd = normalize_lora_state_dict(weights_sd)
    check_algorithm(network_class, weights_sd, file, "The weights file")
    if for_inference:
        options.rank_dropout = options.module_dropout = None
    network = network_class(multiplier, options, None)
    available: dict[str, tuple[str, nn.Module, bool]] = {}
    text_encoder = single_text_encoder(text_encoders, network_class.MODULE_NAME)
    for root, is_unet in ((text_encoder, False), (unet, True)):
        if root is None:
            continue
        for name, module in root.named_modules():
            if name and is_linear_like(module):
                available[lora_name_for(prefix_for(is_unet), name)] = (name, module, is_unet)
    groups = {f"{p}_{n}": parts for (p, n), parts in group_modules(weights_sd, str(file)).items()}
    modules = {n: parts for n, parts in groups.items() if module_algorithm(parts, n) == network_class.ALGORITHM}
    if len(modules) < len(groups):
        logger.warning("%d modules of '%s' are not %s and are not used by %s", len(groups) - len(modules), file,
                       network_class.label(), network_class.MODULE_NAME)
    unmatched = []
    for lora_name, parts in modules.items():
        if lora_name not in available:
            unmatched.append(lora_name)
            continue
        name, module, is_unet = available[lora_name]
        args = network_class.module_args_from_parts(parts)
        dim, alpha = args.pop("lora_dim"), args.pop("alpha")
        network.add_lora(network._make_lora(prefix_for(is_unet), name, module, dim, alpha, **args), is_unet)
    _report_unmatched(network_class.label(), file, unmatched, text_encoder is not None, unet is not None)
    if modules and not network.unet_loras and not network.text_encoder_loras:
        raise UserError(
            f"The {network_class.label()} '{file}' matches no module of the given model(s) (e.g. {sorted(modules)[:3]}):"
            " it is not a MOSS-Image file, or it was trained for the other model (DiT vs text encoder)."
        )
    network.log_summary()
    return network, dict(weights_sd)


def entry_points(network_class: type[AdapterNetwork]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The two functions a `--network_module` exposes, with sd-scripts' signatures, for `network_class`:
    `create_network` (training: `--network_dim`, `--network_alpha`, `--network_dropout`, `--network_args`) and
    `create_network_from_weights` (the modules and ranks of a file: `--dim_from_weights`, inference)."""

    def create_network(
        multiplier: float,
        network_dim: int | None,
        network_alpha: float | None,
        vae: Any,
        text_encoders: Any,
        unet: nn.Module | None,
        neuron_dropout: float | None = None,
        **kwargs: Any,
    ) -> AdapterNetwork:
        return build_network(network_class, multiplier, network_dim, network_alpha, text_encoders, unet,
                             neuron_dropout, kwargs)

    def create_network_from_weights(
        multiplier: float,
        file: str | os.PathLike | None,
        vae: Any,
        text_encoders: Any,
        unet: nn.Module | None,
        weights_sd: Mapping[str, torch.Tensor] | None = None,
        for_inference: bool = False,
        **kwargs: Any,
    ) -> tuple[AdapterNetwork, dict[str, torch.Tensor]]:
        return build_network_from_weights(network_class, multiplier, file, text_encoders, unet, weights_sd,
                                          for_inference, kwargs)

    label = network_class.label()
    create_network.__doc__ = f"The {label} network for training ({network_class.MODULE_NAME})."
    create_network_from_weights.__doc__ = f"The {label} network whose modules and ranks are those of a {label} file."
    for fn in (create_network, create_network_from_weights):
        fn.__module__ = network_class.__module__
        fn.__qualname__ = fn.__name__
    return create_network, create_network_from_weights


def _report_unmatched(label: str, file: Any, unmatched: list[str], have_te: bool, have_unet: bool) -> None:
    skipped_te = [n for n in unmatched if n.startswith(LORA_PREFIX_TEXT_ENCODER + "_") and not have_te]
    skipped_unet = [n for n in unmatched if n.startswith(LORA_PREFIX_UNET + "_") and not have_unet]
    if skipped_te:
        logger.info("%d text encoder %s modules of '%s' are not used (no text encoder given)", len(skipped_te), label,
                    file)
    if skipped_unet:
        logger.info("%d DiT %s modules of '%s' are not used (no DiT given)", len(skipped_unet), label, file)
    real = sorted(set(unmatched) - set(skipped_te) - set(skipped_unet))
    if real:
        logger.warning("%d %s modules of '%s' match no module of the model (e.g. %s)", len(real), label, file, real[:5])


