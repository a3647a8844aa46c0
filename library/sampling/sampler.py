"""The MOSS-Image sampler (the official pipeline's behaviour) and sample-prompt files, shared by the trainer's sample
images and moss_image_minimal_inference.py.

Sampler (the official pipeline's, as docs/architecture.md describes it):

* Grid: ``linspace(1, 0, steps + 1)``, shifted with ``s' = shift * s / (1 + (shift - 1) * s)`` (shift 5.0), every value
  but the final 0 snapped to the 1000-step training grid: ``max(round(s' * 1000), 1) / 1000``.
* Euler: ``x <- x + (s_next - s) * v(x, s * 1000)``; the last step lands on sigma 0. The timesteps given to the model
  are the grid integers ``round(s * 1000)`` as float32 (identical to ``s * 1000`` up to float rounding).
* CFG: ``v = v_uncond + scale * (v_cond - v_uncond)`` (scale 3.0); the DiT blocks in ``uncond_skip_layers`` (default
  22) are skipped in the unconditional pass only. Scale 1.0 skips the unconditional pass. Without skipped layers and
  with equal shapes, the two passes run as one batch; otherwise a model that packs texts (the MossImage DiT,
  `library.moss_image.cfg_packing`) runs them as one pass over both sequences side by side.

The model interface: ``model(x [B, 128, h, w], timesteps float32 [B], prompt_embeds [B, T, D], attn_mask [B, T],
skip_layers=None) -> velocity [B, 128, h, w]`` with ``h, w = H/16, W/16``. A model that also has
``prepare_text(prompt_embeds, attn_mask, (h, w))`` and ``forward_with_text(x, timesteps, prepared, skip_layers)`` (the
MossImage DiT) gets its timestep-independent work (text refiner, RoPE tables, masks) done once per image.

Prompt files (``--sample_prompts`` / ``--from_file``): ``.txt`` with one prompt per line and the options
``--w --h --s --l --fs --n --d`` (``#`` starts a comment line, ``\\n`` in the text is a line break), or the
``.toml`` / ``.json`` / ``.jsonl`` forms of sd-scripts with the keys ``prompt``, ``negative_prompt``, ``width``,
``height``, ``sample_steps``, ``scale``, ``flow_shift``, ``seed``. The options and keys of other models' prompt
files (``--g``, ``--ss``, ``guidance_scale``, ...) and unknown ones are ignored, as sd-scripts ignores them, and named
in one warning per file; a bad value of one of ours is an error.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tomllib
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from library.errors import UserError

logger = logging.getLogger(__name__)

NUM_TRAIN_TIMESTEPS = 1000
LATENT_CHANNELS = 128  # 32 VAE channels x 2x2 patchify
SIZE_MULTIPLE = 16  # 8x VAE x 2x2 patchify
MAX_STEPS = 1000

DEFAULT_STEPS = 50
DEFAULT_GUIDANCE_SCALE = 3.0
DEFAULT_FLOW_SHIFT = 5.0
DEFAULT_UNCOND_SKIP_LAYERS: tuple[int, ...] = (22,)
DEFAULT_SIZE = 1024

PROMPT_DEFAULTS: dict[str, Any] = {
    "negative_prompt": "",
    "width": DEFAULT_SIZE,
    "height": DEFAULT_SIZE,
    "sample_steps": DEFAULT_STEPS,
    "scale": DEFAULT_GUIDANCE_SCALE,
    "flow_shift": DEFAULT_FLOW_SHIFT,
    "seed": None,
}
PROMPT_KEYS = ("prompt", *PROMPT_DEFAULTS, "enum")

# .txt options -> prompt dict keys
_LINE_OPTIONS = {
    "w": "width",
    "h": "height",
    "s": "sample_steps",
    "l": "scale",
    "fs": "flow_shift",
    "n": "negative_prompt",
    "d": "seed",
}
# sd-scripts options that exist for other models and have no meaning for MOSS-Image: ignored with a warning
_OTHER_MODEL_OPTIONS = {
    "g": "guidance_scale",
    "ss": "sample_sampler",
    "cn": "controlnet_image",
    "ctr": "cfg_trunc_ratio",
    "rcfg": "renorm_cfg",
}
# why each is ignored, by prompt dict key
_OTHER_MODEL_REASONS = {
    "guidance_scale": "the distilled guidance of FLUX; the CFG scale of MOSS-Image is --l / scale",
    "sample_sampler": "the sampler is always the official flow-matching Euler",
    "controlnet_image": "a ControlNet input, which MOSS-Image has not",
    "cfg_trunc_ratio": "a CFG truncation of other models",
    "renorm_cfg": "a CFG renormalisation of other models",
}
# sd-scripts' names of the Euler sampler, the only one (--sample_sampler, --ss, "sample_sampler")
EULER_SAMPLER_NAMES = ("euler", "k_euler")
_LINE_OPTION_LIST = " ".join(f"--{k}" for k in _LINE_OPTIONS)

VelocityModel = Callable[..., torch.Tensor]
_WARNED: set[str] = set()  # the prompt-file warnings already logged (_warn_once)


# ----------------------------------------------------------------------------------------------------------------------
# the sampling grid


def shifted_sigma(s: float, shift: float) -> float:
    return shift * s / (1.0 + (shift - 1.0) * s)


def sampling_grid(steps: int = DEFAULT_STEPS, shift: float = DEFAULT_FLOW_SHIFT) -> list[int]:
    """The sampler's grid as integer timesteps (0..1000), ``steps + 1`` values from 1000 down to the final 0."""
    if int(steps) != steps or steps < 1:
        raise UserError(f"The number of sampling steps must be a positive integer, got {steps}.")
    if not shift > 0:
        raise UserError(f"The flow shift of the sampler must be positive, got {shift}; the default is 5.0.")
    steps = int(steps)
    grid = []
    for i in range(steps):
        s = 1.0 - i / steps  # linspace(1, 0, steps + 1) without the final 0
        grid.append(max(int(round(shifted_sigma(s, shift) * NUM_TRAIN_TIMESTEPS)), 1))
    grid.append(0)
    return grid


def sampling_sigmas(steps: int = DEFAULT_STEPS, shift: float = DEFAULT_FLOW_SHIFT) -> torch.Tensor:
    """float32 ``[steps + 1]``: the shifted sigmas snapped to the 1000-step grid, ending at 0."""
    grid = torch.tensor(sampling_grid(steps, shift), dtype=torch.float64)
    return (grid / NUM_TRAIN_TIMESTEPS).to(torch.float32)


# ----------------------------------------------------------------------------------------------------------------------
# options


def parse_uncond_skip_layers(
    value: Union[str, int, Iterable[int], None], num_layers: Optional[int] = None
) -> tuple[int, ...]:
    """``"22"`` -> (22,); ``"22,23"`` -> (22, 23); ``""`` or None -> () (no skipping). Checks the range when
    ``num_layers`` is given."""
    if value is None:
        return ()
    if isinstance(value, str):
        items: list[Any] = [v.strip() for v in value.replace(" ", ",").split(",") if v.strip()]
    elif isinstance(value, int):
        items = [value]
    else:
        items = list(value)
    layers: list[int] = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            layer = item
        elif isinstance(item, str) and re.fullmatch(r"\d+", item.strip()):
            layer = int(item)
        else:
            raise UserError(
                f"--uncond_skip_layers / --sample_uncond_skip_layers: {item!r} is not a block index; give comma-"
                "separated integers such as 22, or an empty string to skip nothing."
            )
        if layer < 0 or (num_layers is not None and layer >= num_layers):
            limit = f" (the DiT has {num_layers} blocks, 0 to {num_layers - 1})" if num_layers is not None else ""
            raise UserError(f"Uncond skip layer {layer} is out of range{limit}; give valid block indices.")
        if layer not in layers:
            layers.append(layer)
    return tuple(layers)


def check_image_size(width: int, height: int, where: str = "") -> None:
    """Raise a UserError unless both sizes are positive multiples of 16."""
    for name, value in (("width", width), ("height", height)):
        if not isinstance(value, int) or isinstance(value, bool) or value < SIZE_MULTIPLE or value % SIZE_MULTIPLE:
            near = max(SIZE_MULTIPLE, (int(value) // SIZE_MULTIPLE) * SIZE_MULTIPLE) if isinstance(value, int) else 1024
            prefix = f"{where}: " if where else ""
            raise UserError(
                f"{prefix}image {name} {value!r} is not a positive multiple of {SIZE_MULTIPLE}; use e.g. {near}."
            )


def initial_noise(
    height: int,
    width: int,
    seed: Optional[int] = None,
    batch_size: int = 1,
    device: Optional[Union[str, torch.device]] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Starting noise ``[B, 128, H/16, W/16]`` float32, drawn on the CPU so that a seed gives the same image on any
    device."""
    check_image_size(width, height)
    if generator is None:
        generator = torch.Generator(device="cpu")
        if seed is not None:
            generator.manual_seed(int(seed))
        else:
            generator.seed()
    shape = (batch_size, LATENT_CHANNELS, height // SIZE_MULTIPLE, width // SIZE_MULTIPLE)
    noise = torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)
    return noise.to(device) if device is not None else noise


# ----------------------------------------------------------------------------------------------------------------------
# the sampler


def _batched(t: torch.Tensor, batch: int, what: str) -> torch.Tensor:
    if t.shape[0] == batch:
        return t
    if t.shape[0] == 1:
        return t.expand(batch, *t.shape[1:])
    raise ValueError(f"{what} has batch {t.shape[0]}, the noise has {batch}")


def _host_mask(embeds: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The text mask on the host (all ones when None): read there once per image, never per pass."""
    if mask is None:
        return torch.ones(embeds.shape[:2], dtype=torch.bool)
    return mask.cpu()


class _Velocity:
    """The model's velocity for one text condition. A model with ``prepare_text`` / ``forward_with_text`` (the
    MossImage DiT) gets its timestep-independent work (text refiner, RoPE, masks) done once, here; any other model
    is called as ``model(x, t, embeds, mask[, skip_layers=...])`` every pass."""

    def __init__(self, model: VelocityModel, embeds: torch.Tensor, mask: torch.Tensor, grid: tuple[int, int]):
        self.model = model
        self.prepared = hasattr(model, "prepare_text") and hasattr(model, "forward_with_text")
        self.cond = model.prepare_text(embeds, mask, grid) if self.prepared else (embeds, mask)

    def __call__(self, x: torch.Tensor, t: torch.Tensor, skip: Sequence[int] = ()) -> torch.Tensor:
        if self.prepared:
            return self.model.forward_with_text(x, t, self.cond, skip_layers=list(skip) or None).float()
        if skip:
            return self.model(x, t, *self.cond, skip_layers=list(skip)).float()
        return self.model(x, t, *self.cond).float()


def _packed(model: VelocityModel, cond: _Velocity, uncond: _Velocity | None) -> Any:
    """The two passes of a CFG step as one pass over both texts side by side, where the model packs them
    (`MossImage.pack_texts`, `library.moss_image.cfg_packing`); None: two passes."""
    if uncond is None or not (cond.prepared and uncond.prepared) or not hasattr(model, "pack_texts"):
        return None
    return model.pack_texts([cond.cond, uncond.cond])


def cfg_velocity(v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance: ``v_uncond + scale * (v_cond - v_uncond)``."""
    return v_uncond + guidance_scale * (v_cond - v_uncond)


def repeated_velocity(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                       t: torch.Tensor, repeated: Callable[[], Any]) -> tuple[torch.Tensor, Any]:
    """velocity(x, t) inside the model's `repeated_calls()`; where a compiled graph turns out to be missing there
    (torch refuses to compile one while it skips guards: the step did not repeat the first one's calls, which a
    process that compiled other models' blocks before can cause), the step again with every guard checked, and no
    `repeated_calls` for the rest of the image. Returns the velocity and the context to use next."""
    try:
        with repeated():
            return velocity(x, t), repeated
    except RuntimeError as e:
        if "skip_guard_eval_unsafe" not in str(e):
            raise
    logger.info("a sampling step needed a new compiled graph: every guard is checked for the rest of this image")
    return velocity(x, t), None


@torch.no_grad()
def sample(
    model: VelocityModel,
    noise: torch.Tensor,
    cond_embeds: torch.Tensor,
    cond_mask: Optional[torch.Tensor],
    uncond_embeds: Optional[torch.Tensor] = None,
    uncond_mask: Optional[torch.Tensor] = None,
    steps: int = DEFAULT_STEPS,
    guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
    shift: float = DEFAULT_FLOW_SHIFT,
    uncond_skip_layers: Union[str, Iterable[int], None] = DEFAULT_UNCOND_SKIP_LAYERS,
    callback: Optional[Callable[[int, int, torch.Tensor], None]] = None,
    unguarded_repeats: bool = False,
) -> torch.Tensor:
    """Denoise ``noise`` [B, 128, h, w] into latents (float32, same shape) with the official sampler.

    ``cond_embeds`` / ``uncond_embeds`` are [B or 1, T, D] prompt embeddings with masks [B or 1, T] (None: all
    tokens valid); the unconditional ones (the encoded negative prompt, empty by default) are needed unless
    ``guidance_scale`` is 1.0. ``callback(step, steps, x)`` runs after every step. The model runs in whatever mode it
    is in: put it in eval mode first. A model with ``prepare_text`` / ``forward_with_text`` has its text refiner,
    RoPE tables and masks computed once per call (per image), not once per pass. With ``unguarded_repeats`` the
    model's passes after the first step run inside its ``repeated_calls()`` context where it has one (the DiT with
    compiled regions: only the guards that tell its compiled graphs apart are checked, since every later step repeats
    the first step's calls with new values in the same tensors' shapes).
    """
    sigmas = sampling_sigmas(steps, shift)
    grid = sampling_grid(steps, shift)
    x = noise.to(torch.float32)
    batch = x.shape[0]
    size = (x.shape[-2], x.shape[-1])
    use_cfg = float(guidance_scale) != 1.0
    skip = parse_uncond_skip_layers(uncond_skip_layers)

    cond_embeds = _batched(cond_embeds, batch, "cond_embeds")
    cond_mask = _batched(_host_mask(cond_embeds, cond_mask), batch, "cond_mask")
    one_batch = False
    if use_cfg:
        if uncond_embeds is None:
            raise ValueError("guidance_scale != 1.0 needs the unconditional (negative prompt) embeddings")
        uncond_embeds = _batched(uncond_embeds, batch, "uncond_embeds")
        uncond_mask = _batched(_host_mask(uncond_embeds, uncond_mask), batch, "uncond_mask")
        one_batch = not skip and cond_embeds.shape == uncond_embeds.shape and cond_mask.shape == uncond_mask.shape
    packed = None
    if one_batch:
        both = _Velocity(model, torch.cat([cond_embeds, uncond_embeds]),
                         torch.cat([cond_mask, uncond_mask.to(cond_mask.dtype)]), size)
    else:
        cond = _Velocity(model, cond_embeds, cond_mask, size)
        uncond = _Velocity(model, uncond_embeds, uncond_mask, size) if use_cfg else None
        packed = _packed(model, cond, uncond)

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if not use_cfg:
            return cond(x, t)
        if one_batch:
            v_cond, v_uncond = both(torch.cat([x, x]), torch.cat([t, t])).chunk(2)
            return cfg_velocity(v_cond, v_uncond, guidance_scale)
        if packed is not None:
            v_cond, v_uncond = model.forward_packed(x, t, packed, ((), skip))
            return cfg_velocity(v_cond.float(), v_uncond.float(), guidance_scale)
        return cfg_velocity(cond(x, t), uncond(x, t, skip), guidance_scale)

    repeated = getattr(model, "repeated_calls", None) if unguarded_repeats else None
    for i in range(len(grid) - 1):
        t = torch.full((batch,), float(grid[i]), dtype=torch.float32, device=x.device)
        if repeated is not None and i > 0:
            v, repeated = repeated_velocity(velocity, x, t, repeated)
        else:
            v = velocity(x, t)
        x = x + (sigmas[i + 1] - sigmas[i]).item() * v
        if callback is not None:
            callback(i, len(grid) - 1, x)
    return x


# ----------------------------------------------------------------------------------------------------------------------
# prompt files


def _convert(key: str, value: Any, option: str) -> Any:
    """Type and range of one prompt option (key is a prompt dict key)."""
    if key in ("prompt", "negative_prompt"):
        if not isinstance(value, str):
            raise UserError(f"{option} must be text, got {value!r}.")
        return value.replace("\\n", "\n")
    try:
        if key in ("width", "height", "sample_steps", "seed"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            number: Any = int(value) if not isinstance(value, str) else int(value.strip())
        else:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
    except (TypeError, ValueError):
        kind = "an integer" if key in ("width", "height", "sample_steps", "seed") else "a number"
        raise UserError(f"{option} must be {kind}, got {value!r}.") from None
    if not math.isfinite(number):
        raise UserError(f"{option} must be a finite number, got {value!r}.")
    if key == "sample_steps" and not 1 <= number <= MAX_STEPS:
        raise UserError(f"{option} (steps) must be between 1 and {MAX_STEPS}, got {number}.")
    if key == "flow_shift" and not number > 0:
        raise UserError(f"{option} (flow shift) must be positive, got {number}.")
    if key == "seed" and number < 0:
        raise UserError(f"{option} (seed) must not be negative, got {number}.")
    return number


def _is_euler(key: str, value: Any) -> bool:
    """A sampler choice that names the sampler used anyway (no warning for it)."""
    return key == "sample_sampler" and str(value).strip().lower() in EULER_SAMPLER_NAMES


def _ignored_key(key: str, value: Any) -> str:
    reason = _OTHER_MODEL_REASONS.get(key, f"not a prompt key; the keys are {', '.join(PROMPT_KEYS[:-1])}")
    return f"{key} = {value!r} ({reason})"


def _ignored_line_option(name: str, value: str) -> str:
    key = _OTHER_MODEL_OPTIONS.get(name)
    reason = _OTHER_MODEL_REASONS[key] if key else f"not a prompt option; the options are {_LINE_OPTION_LIST}"
    return f"--{name}{' ' + value if value else ''} ({reason})"


def _normalize(entry: dict[str, Any], defaults: Optional[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """(the prompt dict, the keys that were ignored as `_ignored_key` names them)."""
    ignored = [_ignored_key(k, v) for k, v in entry.items() if k not in PROMPT_KEYS and not _is_euler(k, v)]
    if "prompt" not in entry:
        raise UserError(f"prompt entry {entry!r} has no 'prompt' text.")
    result: dict[str, Any] = {"prompt": None, **PROMPT_DEFAULTS, **(defaults or {})}
    for key, value in entry.items():
        if key not in PROMPT_KEYS or key == "enum" or (value is None and key in ("seed", "negative_prompt")):
            continue
        result[key] = _convert(key, value, key)
    check_image_size(result["width"], result["height"])
    return result, ignored


def _parse_line(line: str, defaults: Optional[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """(the prompt dict of a .txt line, the options that were ignored as `_ignored_line_option` names them)."""
    parts = line.strip().split(" --")
    entry: dict[str, Any] = {"prompt": parts[0].strip()}
    ignored: list[str] = []
    for part in parts[1:]:
        m = re.match(r"([A-Za-z]+)(?:\s+(.*))?$", part.strip(), re.S)
        name = m.group(1).lower() if m else part.strip().split(" ")[0]
        value = (m.group(2) or "").strip() if m else ""
        if not m or name not in _LINE_OPTIONS:
            if not _is_euler(_OTHER_MODEL_OPTIONS.get(name, ""), value):
                ignored.append(_ignored_line_option(name, value))
            continue
        key = _LINE_OPTIONS[name]
        if value == "" and key != "negative_prompt":
            raise UserError(f"prompt option --{name} needs a value.")
        entry[key] = value
    return _normalize(entry, defaults)[0], ignored


def _ignored_message(where: str, ignored: Iterable[str]) -> str:
    return f"{where}: prompt options that MOSS-Image does not use are ignored: {', '.join(dict.fromkeys(ignored))}"


def normalize_prompt_dict(entry: dict[str, Any], defaults: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A prompt dict with every key (defaults filled, types checked, ``\\n`` turned into line breaks). ``defaults``
    replaces the official defaults (e.g. the command-line values of the inference script). Keys of other models'
    prompt files (``guidance_scale``, ...) and unknown keys are ignored with a warning, as sd-scripts ignores them."""
    result, ignored = _normalize(entry, defaults)
    if ignored:
        logger.warning(_ignored_message("prompt entry", ignored))
    return result


def parse_prompt_line(line: str, defaults: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One .txt prompt line: ``text --w 1024 --h 1024 --s 50 --l 3.0 --fs 5.0 --n negative --d 42``. Options of other
    models' prompt files (``--g``, ``--ss``, ...) and unknown options are ignored with a warning, as sd-scripts
    ignores them; a bad value of one of ours is an error."""
    result, ignored = _parse_line(line, defaults)
    if ignored:
        logger.warning(_ignored_message(f"prompt {result['prompt'][:40]!r}", ignored))
    return result


def _located(path: str, where: str, error: UserError) -> UserError:
    return UserError(f"{path} {where}: {error}")


def _txt_prompts(path: str, defaults: Optional[dict[str, Any]] = None) -> tuple[list[dict[str, Any]], list[str]]:
    prompts, ignored = [], []
    with open(path, "r", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            try:
                prompt, more = _parse_line(text, defaults)
            except UserError as e:
                raise _located(path, f"line {number}", e) from None
            prompts.append(prompt)
            ignored += more
    return prompts, ignored


def _entries_to_prompts(
    path: str, entries: Sequence[Any], defaults: Optional[dict[str, Any]] = None
) -> tuple[list[dict[str, Any]], list[str]]:
    prompts, ignored = [], []
    for i, entry in enumerate(entries):
        try:
            if isinstance(entry, str):
                prompt, more = _parse_line(entry, defaults)
            elif isinstance(entry, dict):
                prompt, more = _normalize(entry, defaults)
            else:
                raise UserError(f"a prompt entry must be a text or a table/object, got {type(entry).__name__}.")
        except UserError as e:
            raise _located(path, f"entry {i + 1}", e) from None
        prompts.append(prompt)
        ignored += more
    return prompts, ignored


def _toml_entries(path: str, data: dict[str, Any]) -> list[Any]:
    table = data.get("prompt")
    if not isinstance(table, dict):
        raise UserError(f"{path} has no [prompt] table; see the sample prompt format of the documentation.")
    defaults = {k: v for k, v in table.items() if k != "subset"}
    subsets = table.get("subset")
    if subsets is None:
        return [defaults]
    if not isinstance(subsets, list):
        raise UserError(f"{path}: [prompt] subset must be an array of tables ([[prompt.subset]]).")
    return [{**defaults, **subset} if isinstance(subset, dict) else subset for subset in subsets]


def _warn_once(message: str) -> None:
    """A warning logged the first time only: the trainer reads its prompt file again at every sampling."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def load_prompts(path: str, defaults: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """Read a prompt file (.txt, .toml, .json, .jsonl) into prompt dicts with every key filled and ``enum`` set to the
    prompt's position (used in the sample image names). The options and keys MOSS-Image does not use are named in
    one warning (once per process for the same file and options)."""
    if not os.path.isfile(path):
        raise UserError(f"The prompt file {path} does not exist; check --sample_prompts / --from_file.")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".txt":
            prompts, ignored = _txt_prompts(path, defaults)
        elif ext == ".toml":
            with open(path, "rb") as f:
                prompts, ignored = _entries_to_prompts(path, _toml_entries(path, tomllib.load(f)), defaults)
        elif ext == ".json":
            with open(path, "r", encoding="utf-8") as f:
                data = json.load(f)
            prompts, ignored = _entries_to_prompts(path, data if isinstance(data, list) else [data], defaults)
        elif ext == ".jsonl":
            entries = []
            with open(path, "r", encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            entries.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise UserError(f"{path} line {number} is not valid JSON ({e.msg}).") from None
            prompts, ignored = _entries_to_prompts(path, entries, defaults)
        else:
            raise UserError(f"The prompt file {path} must end in .txt, .toml, .json or .jsonl.")
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"The prompt file {path} is not valid TOML ({e}).") from None
    except json.JSONDecodeError as e:
        raise UserError(f"The prompt file {path} is not valid JSON ({e.msg} at line {e.lineno}).") from None
    except UnicodeDecodeError:
        raise UserError(f"The prompt file {path} is not UTF-8 text; save it as UTF-8.") from None
    if not prompts:
        raise UserError(f"The prompt file {path} contains no prompts.")
    if ignored:
        _warn_once(_ignored_message(path, ignored))
    for i, prompt in enumerate(prompts):
        prompt["enum"] = i
    logger.info(f"{len(prompts)} prompts read from {path}")
    return prompts
