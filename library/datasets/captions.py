"""The caption pipeline: caption candidates, prefix/suffix, dropout, wildcards, shuffle with kept tokens, warmup.

A caption file (or metadata caption) becomes a list of *candidates*; one is picked at random at each step:
- default: the first line of the file is the only candidate;
- `enable_wildcard`: every non-empty line is a candidate (sd-scripts picks one random line per step);
- `enable_multiline_caption`: the whole text is kept with its line breaks; a line holding only `---` separates
  candidates, and a text without such a line is a single candidate.

Per step, `process_caption` then applies, in this order: prefix/suffix (joined with a space), caption dropout
(`caption_dropout_rate`, or every `caption_dropout_every_n_epochs`-th epoch), `{a|b}` wildcards (`{{` and `}}`
escape braces), then, when shuffling, tag dropout or token warmup is on, the tag list split by `caption_separator`
with kept tokens in front (the first `keep_tokens` tags, or the part before `keep_tokens_separator`; a second
separator also fixes a tail), rejoined with ", "; finally `secondary_separator` becomes `caption_separator`.
All randomness comes from the `random.Random` passed in, so results are reproducible from a seed.

Two deliberate departures from sd-scripts (both only change captions that were broken before):
- the candidate (or wildcard line) is chosen *before* prefix/suffix are added, so every line gets them;
- `keep_tokens_separator` is removed from the text even when no shuffling happens (sd-scripts left it in).
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from library.errors import UserError

logger = logging.getLogger(__name__)

CANDIDATE_SEPARATOR = "---"
_WILDCARD_RE = re.compile(r"\{([^{}]+)\}")


@dataclass(frozen=True)
class CaptionSettings:
    """The caption options of one subset."""

    caption_prefix: str | None = None
    caption_suffix: str | None = None
    shuffle_caption: bool = False
    caption_separator: str = ","
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    secondary_separator: str | None = None
    enable_wildcard: bool = False
    enable_multiline_caption: bool = False
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    token_warmup_min: int = 1
    token_warmup_step: float = 0.0

    @property
    def uses_tag_processing(self) -> bool:
        """Whether the tag list is split and rejoined at each step (shuffle, tag dropout or token warmup)."""
        return self.shuffle_caption or self.caption_tag_dropout_rate > 0 or self.token_warmup_step > 0

    @property
    def uses_dropout(self) -> bool:
        return self.caption_dropout_rate > 0 or self.caption_dropout_every_n_epochs > 0


@dataclass(frozen=True)
class CaptionResult:
    """The caption of one sample at one step."""

    text: str  # "" when dropped
    candidate_index: int
    dropped: bool
    variant_index: int = 0  # the cached caption variant used (library.datasets.caption_variants); 0 without


def split_candidates(text: str, settings: CaptionSettings) -> list[str]:
    """Turn a raw caption text into its candidates (see the module docstring); never returns an empty list."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if settings.enable_multiline_caption:
        blocks: list[list[str]] = [[]]
        for line in text.split("\n"):
            if line.strip() == CANDIDATE_SEPARATOR:
                blocks.append([])
            else:
                blocks[-1].append(line)
        candidates = ["\n".join(b).strip() for b in blocks]
        candidates = [c for c in candidates if c]
    elif settings.enable_wildcard:
        candidates = [line.strip() for line in text.split("\n") if line.strip()]
    else:
        candidates = [text.split("\n")[0].strip()]
    return candidates or [""]


def has_extra_lines(text: str) -> bool:
    """True when a caption has non-empty lines after the first (they are dropped without multiline/wildcard)."""
    lines = [line for line in text.replace("\r\n", "\n").split("\n")[1:] if line.strip()]
    return bool(lines)


def append_tags(candidates: Sequence[str], tags: str | None, separator: str) -> list[str]:
    """Append fine-tuning metadata tags (one line) to every candidate, after the caption separator."""
    if not tags:
        return list(candidates)
    tags = tags.replace("\r\n", "\n").replace("\n", separator)
    return [f"{c}{separator}{tags}" if c else tags for c in candidates]


def add_prefix_suffix(text: str, settings: CaptionSettings) -> str:
    parts = [p for p in (settings.caption_prefix, text, settings.caption_suffix) if p]
    return " ".join(parts)


def expand_wildcards(text: str, rng: random.Random) -> str:
    """Replace each `{a|b|c}` by one random option; `{{` and `}}` stand for literal braces."""
    open_mark, close_mark = "\x00(", "\x00)"
    text = text.replace("{{", open_mark).replace("}}", close_mark)
    text = _WILDCARD_RE.sub(lambda m: rng.choice(m.group(1).split("|")), text)
    return text.replace(open_mark, "{").replace(close_mark, "}")


def has_wildcards(text: str) -> bool:
    """True when the text contains a `{a|b}` pattern that `expand_wildcards` would replace."""
    return bool(_WILDCARD_RE.search(text.replace("{{", "").replace("}}", "")))


def _split_tags(text: str, separator: str) -> list[str]:
    return [t.strip() for t in text.split(separator) if t.strip()]


def split_kept_tokens(text: str, settings: CaptionSettings) -> tuple[list[str], list[str], list[str]]:
    """Split a caption into (fixed head, flexible tags, fixed tail)."""
    sep = settings.keep_tokens_separator
    if sep and sep in text:
        head, flex = text.split(sep, 1)
        tail = ""
        if sep in flex:
            flex, tail = flex.split(sep, 1)
        return (
            _split_tags(head, settings.caption_separator),
            _split_tags(flex, settings.caption_separator),
            _split_tags(tail, settings.caption_separator),
        )
    tags = [t.strip() for t in text.strip().split(settings.caption_separator)]
    keep = settings.keep_tokens
    return tags[:keep], tags[keep:], []


def resolve_token_warmup_steps(settings: CaptionSettings, max_train_steps: int | None) -> int:
    """`token_warmup_step` in steps: values below 1 are a fraction of the whole run."""
    step = settings.token_warmup_step
    if step <= 0:
        return 0
    if step >= 1:
        return int(step)
    if max_train_steps is None:
        raise UserError(
            f"token_warmup_step = {step} is a fraction of the training steps, but the number of training steps is"
            " unknown here; give token_warmup_step as a number of steps instead."
        )
    return math.floor(step * max_train_steps)


def _warmup(flex: list[str], settings: CaptionSettings, step: int, max_train_steps: int | None) -> list[str]:
    warmup_steps = resolve_token_warmup_steps(settings, max_train_steps)
    if warmup_steps <= 0 or step >= warmup_steps:
        return flex
    count = math.floor(step * (len(flex) - settings.token_warmup_min) / warmup_steps) + settings.token_warmup_min
    return flex[: max(count, 0)]


def _tag_processing(
    text: str, settings: CaptionSettings, rng: random.Random, step: int, max_train_steps: int | None
) -> str:
    fixed, flex, tail = split_kept_tokens(text, settings)
    flex = _warmup(flex, settings, step, max_train_steps)
    if settings.shuffle_caption:
        rng.shuffle(flex)
    if settings.caption_tag_dropout_rate > 0:
        flex = [t for t in flex if rng.random() >= settings.caption_tag_dropout_rate]
    return ", ".join(fixed + flex + tail)


def _remove_keep_separator(text: str, settings: CaptionSettings) -> str:
    sep = settings.keep_tokens_separator
    if not sep or sep not in text:
        return text
    return ", ".join(part.strip() for part in text.split(sep) if part.strip())


def _finish(text: str, settings: CaptionSettings) -> str:
    if settings.secondary_separator:
        text = text.replace(settings.secondary_separator, settings.caption_separator)
    return text


def cacheable_caption(candidate: str, settings: CaptionSettings) -> str:
    """The text a candidate becomes when no random step applies: what a text-encoder cache encodes."""
    text = add_prefix_suffix(candidate, settings)
    return _finish(_remove_keep_separator(text, settings), settings)


def caption_variant(candidate: str, settings: CaptionSettings, rng: random.Random) -> str:
    """One draw of what `process_caption` makes of a candidate (prefix/suffix, `{a|b}` wildcards, shuffle with kept
    tokens, tag dropout), without caption dropout, which stays a per-step choice: a cached caption variant. Token
    warmup, whose tags change with the step, is not applied (the caches refuse it)."""
    text = add_prefix_suffix(candidate, settings)
    if settings.enable_wildcard:
        text = expand_wildcards(text, rng)
    if settings.uses_tag_processing:
        text = _tag_processing(text, settings, rng, step=0, max_train_steps=None)
    else:
        text = _remove_keep_separator(text, settings)
    return _finish(text, settings)


def is_dropped(settings: CaptionSettings, rng: random.Random, epoch: int) -> bool:
    """Caption dropout decision for one sample (draws from `rng` only when a rate is set)."""
    dropped = settings.caption_dropout_rate > 0 and rng.random() < settings.caption_dropout_rate
    every = settings.caption_dropout_every_n_epochs
    return dropped or (every > 0 and epoch % every == 0)


def process_caption(
    candidates: Sequence[str],
    settings: CaptionSettings,
    rng: random.Random,
    *,
    epoch: int = 1,
    step: int = 0,
    max_train_steps: int | None = None,
    augment: bool = True,
) -> CaptionResult:
    """The caption of one sample at one step. `augment=False` (validation) turns off every random change except
    the candidate choice and wildcards, which stay random but come from the seeded `rng`."""
    index = rng.randrange(len(candidates)) if len(candidates) > 1 else 0
    text = add_prefix_suffix(candidates[index], settings)
    if augment and is_dropped(settings, rng, epoch):
        return CaptionResult("", index, True)
    if settings.enable_wildcard:
        text = expand_wildcards(text, rng)
    if augment and settings.uses_tag_processing:
        text = _tag_processing(text, settings, rng, step, max_train_steps)
    else:
        text = _remove_keep_separator(text, settings)
    return CaptionResult(_finish(text, settings), index, False)
