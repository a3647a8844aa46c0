"""`--network_args` of the LoRA-family network modules (`networks.lora_generic`, `networks.loha`, `networks.lokr`).

Values arrive as strings from `--network_args "k=v"`, or as Python values from code. The keys shared by the three
modules (module selection, per-module ranks and learning rates, dropouts, LoRA+) are parsed here into
`NetworkOptions`; each module adds its own keys (LoKr: `factor`, ...). Keys that cannot apply are refused with a
sentence that says why: convolution options (`conv_dim`, `use_tucker`, ...: these models have Linear layers only),
LyCORIS options the modules do not implement, an `algo=` other than the module's own.
"""

from __future__ import annotations

import ast
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from library.errors import UserError

DEFAULT_NETWORK_DIM = 4
DEFAULT_NETWORK_ALPHA = 1.0

# Every key --network_args may carry for all three modules, with a one-line meaning (used in the error for an
# unknown key).
COMMON_NETWORK_ARGS: dict[str, str] = {
    "train_text_embedder": "bool, also train the DiT text embedder (text_embedder.proj and its refiner blocks)",
    "train_llm_adapter": "bool, alias of train_text_embedder (Anima naming)",
    "exclude_patterns": "Python list of regexes (re.fullmatch on module names) to exclude",
    "include_patterns": "Python list of regexes that override the exclusion",
    "network_reg_dims": "'regex=rank,...' per-module ranks",
    "network_reg_lrs": "'regex=lr,...' per-module learning rates",
    "dropout": "float in [0, 1), the same as --network_dropout (the name LyCORIS reads it under)",
    "rank_dropout": "float in [0, 1)",
    "module_dropout": "float in [0, 1)",
    "loraplus_lr_ratio": "float > 0, LoRA+ ratio for lora_up",
    "loraplus_unet_lr_ratio": "float > 0, LoRA+ ratio for the DiT only",
    "loraplus_text_encoder_lr_ratio": "float > 0, LoRA+ ratio for the text encoder only",
    "verbose": "bool, log every module with its rank and alpha",
    "algo": "the module's own algorithm name (as lycoris.kohya writes it), accepted and without effect",
}
# Keys that choose modules or ranks; they have no effect when the modules come from a weights file.
SELECTION_ARGS = ("train_text_embedder", "train_llm_adapter", "exclude_patterns", "include_patterns", "network_reg_dims")

CONVOLUTION_ARGS = (
    "conv_dim", "conv_alpha", "conv_block_dims", "conv_block_alphas", "use_tucker", "use_cp", "use_conv_cp",
    "disable_conv_cp",
)
LYCORIS_ONLY_ARGS = (
    "preset", "dora_wd", "wd_on_output", "use_scalar", "rs_lora", "bypass_mode", "train_norm", "rank_dropout_scale",
    "constraint", "rescaled", "block_size", "unbalanced_factorization",
)


def check_network_args(
    kwargs: Mapping[str, Any], module_name: str, accepted: Mapping[str, str], algorithms: Sequence[str]
) -> None:
    """UserError for a key `module_name` cannot honour: convolution options, LyCORIS-only options, another `algo`,
    unknown keys (the message lists the accepted keys)."""
    listing = ", ".join(accepted)
    for key in kwargs:
        if key in CONVOLUTION_ARGS:
            raise UserError(
                f"--network_args '{key}' does not apply to {module_name}: the MOSS-Image DiT and the Qwen3.5 text"
                f" encoder have no convolution layers, only Linear ones; remove it (the accepted keys are {listing})."
            )
        if key in LYCORIS_ONLY_ARGS:
            raise UserError(
                f"--network_args '{key}' is a LyCORIS option that {module_name} does not implement: use"
                " --network_module lycoris.kohya for it, or remove it."
            )
    algo = kwargs.get("algo")
    if algo is not None and str(algo).strip().lower() not in algorithms:
        raise UserError(
            f"--network_args algo={algo} asks for another algorithm than {module_name} ({', '.join(algorithms)}):"
            " use networks.lora_generic, networks.loha or networks.lokr, or --network_module lycoris.kohya."
        )
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown:
        raise UserError(
            f"Unknown --network_args key(s) {', '.join(repr(k) for k in unknown)} for {module_name}:"
            f" the accepted keys are {listing}."
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


def parse_int(name: str, value: Any) -> int:
    """An integer (`8`, `-1`); anything else is a UserError naming the option."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if math.isnan(number) or number != int(number):
        raise UserError(f"--network_args {name}={value!r} is not an integer: write e.g. {name}=8.")
    return int(number)


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
    """The shared --network_args, parsed and validated (a module's own keys are parsed by the module)."""

    train_text_embedder: bool = False
    exclude_patterns: list[str] = field(default_factory=list)
    include_patterns: list[str] = field(default_factory=list)
    reg_dims: dict[str, int] = field(default_factory=dict)
    reg_lrs: dict[str, float] = field(default_factory=dict)
    dropout: float | None = None
    rank_dropout: float | None = None
    module_dropout: float | None = None
    loraplus_lr_ratio: float | None = None
    loraplus_unet_lr_ratio: float | None = None
    loraplus_text_encoder_lr_ratio: float | None = None
    verbose: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> NetworkOptions:
        """The shared keys of `kwargs` (checked with `check_network_args` first)."""
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
        opts.dropout = parse_float("dropout", kwargs.get("dropout"), 0.0, 1.0)
        opts.rank_dropout = parse_float("rank_dropout", kwargs.get("rank_dropout"), 0.0, 1.0)
        opts.module_dropout = parse_float("module_dropout", kwargs.get("module_dropout"), 0.0, 1.0)
        for name in ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"):
            ratio = parse_float(name, kwargs.get(name), 0.0)
            if ratio == 0.0:
                raise UserError(f"--network_args {name}=0 would freeze lora_up: give a ratio > 0 (e.g. 16).")
            setattr(opts, name, ratio)
        opts.verbose = parse_bool("verbose", kwargs.get("verbose", False))
        return opts


def resolve_dropout(neuron_dropout: Any, from_args: float | None) -> float | None:
    """--network_dropout and `dropout=` of --network_args are one value: either, or both when they agree."""
    dropout = parse_float("--network_dropout", neuron_dropout, 0.0, 1.0)
    if dropout is not None and from_args is not None and dropout != from_args:
        raise UserError(
            f"--network_dropout {dropout} and --network_args dropout={from_args} disagree: give only one of them."
        )
    return dropout if dropout is not None else from_args
