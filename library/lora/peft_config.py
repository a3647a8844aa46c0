"""PEFT / diffusers LoRA files as they come: where the tensors and the adapter config are, and the alpha of each module.

A PEFT LoRA keeps its scale outside the tensors, in the adapter config (`peft.LoraConfig`): `r` and `lora_alpha` for
every module, `rank_pattern` / `alpha_pattern` for the modules that differ (a pattern matches a module path when the
path ends with it after a "."), `use_rslora` for the rank-stabilised scale lora_alpha / sqrt(r) instead of
lora_alpha / r, and `target_modules`. The config is found in, by precedence:

1. an `adapter_config.json` given explicitly (the converter's `--adapter_config`);
2. the file's own safetensors metadata `lora_adapter_metadata` (what diffusers writes: the config as JSON; a pipeline
   file nests one config per model under its prefix, `transformer.r`, `text_encoder.lora_alpha`, ...);
3. an `adapter_config.json` beside the file (what `PeftModel.save_pretrained` writes).

The sd-scripts naming has one alpha per module with the scale alpha / rank (`library.lora.conventions`), so the config
becomes a kohya alpha per module: alpha = lora_alpha, or lora_alpha * sqrt(r) for rsLoRA (the same scale, up to the
float32 rounding of the alpha).

Inputs accepted (`resolve_lora_input`): a `.safetensors` file, or a `save_pretrained` folder holding
`adapter_model.safetensors` (and usually `adapter_config.json`). Pickle files (`adapter_model.bin`) are refused.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from library.errors import UserError

logger = logging.getLogger(__name__)

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAMES = ("adapter_model.bin", "pytorch_lora_weights.bin")
METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY

# the config that applies to every module of a file, and the model prefixes of a diffusers pipeline file
ALL_MODULES = ""
DIT_SCOPES = ("transformer", "unet")
TEXT_ENCODER_SCOPE = "text_encoder"
_CONFIG_FIELDS = ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "target_modules")


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of a `peft.LoraConfig` that decide each module's rank and scale."""

    source: str  # where it was read, for messages
    r: int | None = None
    lora_alpha: float | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str | None = None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str) -> AdapterConfig:
        """Read the fields from a config dict (other LoraConfig fields are ignored); a wrong type is a UserError."""
        try:
            r = None if values.get("r") is None else int(values["r"])
            lora_alpha = None if values.get("lora_alpha") is None else float(values["lora_alpha"])
            rank_pattern = {str(k): int(v) for k, v in (values.get("rank_pattern") or {}).items()}
            alpha_pattern = {str(k): float(v) for k, v in (values.get("alpha_pattern") or {}).items()}
        except (TypeError, ValueError, AttributeError) as e:
            raise UserError(
                f"The LoRA adapter config {source} has a value of the wrong type in r / lora_alpha / rank_pattern /"
                f" alpha_pattern ({e}): it is not a PEFT LoraConfig; fix it or leave it out."
            ) from e
        targets = values.get("target_modules")
        if isinstance(targets, (list, tuple, set)):
            targets = tuple(str(t) for t in targets)
        elif targets is not None and not isinstance(targets, str):
            targets = None
        if r is None and lora_alpha is None:
            raise UserError(
                f"The LoRA adapter config {source} has neither r nor lora_alpha: it is not a PEFT LoraConfig."
            )
        return cls(source, r, lora_alpha, rank_pattern, alpha_pattern, bool(values.get("use_rslora", False)), targets)

    def rank_for(self, path: str) -> int | None:
        """The rank the config gives the module `path` (None when it gives none)."""
        key = _pattern_for(self.rank_pattern, path)
        return self.rank_pattern[key] if key is not None else self.r

    def targets(self, path: str) -> bool:
        """Whether `target_modules` selects `path` (True when it names nothing checkable, e.g. "all-linear")."""
        t = self.target_modules
        if t is None or t == "all-linear":
            return True
        if isinstance(t, str):
            return re.fullmatch(t, path) is not None
        return any(path == name or path.endswith("." + name) for name in t)

    def kohya_alpha(self, path: str, rank: int) -> float:
        """The sd-scripts alpha (scale = alpha / rank) that gives module `path` of `rank` the scale PEFT gives it."""
        expected = self.rank_for(path)
        if expected is not None and expected != rank:
            raise UserError(
                f"The LoRA adapter config {self.source} gives module '{path}' rank {expected}, but its lora_A has"
                f" {rank} rows: the config does not belong to this file; give the right adapter_config.json."
            )
        key = _pattern_for(self.alpha_pattern, path)
        alpha = self.alpha_pattern[key] if key is not None else self.lora_alpha
        if alpha is None:  # PEFT's default lora_alpha is 8, but a config without it is not one PEFT wrote
            raise UserError(
                f"The LoRA adapter config {self.source} has no lora_alpha for module '{path}': add lora_alpha to it."
            )
        return alpha * math.sqrt(rank) if self.use_rslora else alpha


def _pattern_for(patterns: Mapping[str, object], path: str) -> str | None:
    """The first pattern that `path` ends with after a "." (or equals), as PEFT matches rank_pattern / alpha_pattern."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", path):
            return pattern
    return None


def parse_config_json(text: str, source: str) -> dict[str, AdapterConfig]:
    """The configs in a JSON text, by scope: {"": config} for a plain LoraConfig, {"transformer": ..., "text_encoder":
    ...} for a diffusers pipeline file's nested form."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"The LoRA adapter config {source} is not valid JSON ({e}): fix it or leave it out.") from e
    if not isinstance(values, dict):
        raise UserError(f"The LoRA adapter config {source} is not a JSON object: it is not a PEFT LoraConfig.")
    if any(k in values for k in ("r", "lora_alpha")):
        return {ALL_MODULES: AdapterConfig.from_dict(values, source)}
    scoped: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        scope, _, name = key.rpartition(".")
        if scope and name in _CONFIG_FIELDS:
            scoped.setdefault(scope, {})[name] = value
    if not scoped:
        raise UserError(f"The LoRA adapter config {source} has neither r nor lora_alpha: it is not a PEFT LoraConfig.")
    return {scope: AdapterConfig.from_dict(v, f"{source} ({scope})") for scope, v in scoped.items()}


def resolve_lora_input(path: str | os.PathLike) -> Path:
    """The LoRA weights file for `path`: the file itself, or `adapter_model.safetensors` of a save_pretrained folder."""
    p = Path(path)
    if p.is_dir():
        weights = p / ADAPTER_WEIGHTS_NAME
        if weights.is_file():
            return weights
        pickles = [n for n in PICKLE_WEIGHTS_NAMES if (p / n).is_file()]
        if pickles:
            raise UserError(
                f"The folder '{p}' holds '{pickles[0]}', a pickle file: only safetensors are read; save the adapter"
                " again with safe_serialization=True (PEFT's default) or convert it to safetensors."
            )
        raise UserError(f"The folder '{p}' has no {ADAPTER_WEIGHTS_NAME}: give a LoRA .safetensors file or a PEFT"
                        " save_pretrained folder.")
    if p.suffix in (".bin", ".pt", ".pth", ".ckpt") and p.is_file():
        raise UserError(
            f"The LoRA file '{p}' is a pickle file: only safetensors are read; save the adapter again with"
            " safe_serialization=True or convert it to safetensors."
        )
    return p


def find_adapter_configs(
    weights: Path, metadata: Mapping[str, str], explicit: str | os.PathLike | None = None
) -> dict[str, AdapterConfig]:
    """The adapter configs of a LoRA file, by scope: an explicit adapter_config.json, else the file's own
    `lora_adapter_metadata`, else the `adapter_config.json` beside it; {} when there is none."""
    if explicit is not None:
        e = Path(explicit)
        if not e.is_file():
            raise UserError(f"The adapter config '{e}' does not exist: check the path.")
        return parse_config_json(e.read_text(encoding="utf-8"), f"'{e}'")
    raw = metadata.get(METADATA_KEY)
    if raw:
        return parse_config_json(raw, f"in the metadata of '{weights}' ({METADATA_KEY})")
    beside = weights.parent / ADAPTER_CONFIG_NAME
    if beside.is_file():
        return parse_config_json(beside.read_text(encoding="utf-8"), f"'{beside}'")
    return {}


def config_for(configs: Mapping[str, AdapterConfig], is_dit: bool) -> AdapterConfig | None:
    """The config that covers a DiT (or text-encoder) module: the file-wide one, else its model's scope."""
    if ALL_MODULES in configs:
        return configs[ALL_MODULES]
    for scope in DIT_SCOPES if is_dit else (TEXT_ENCODER_SCOPE,):
        if scope in configs:
            return configs[scope]
    return None
