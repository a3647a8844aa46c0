"""Caption variants for cached text-encoder outputs (`caption_cache_variants = N`).

With --cache_text_encoder_outputs the caption is encoded once, so what changes it at every step (`shuffle_caption`
with `keep_tokens` / `keep_tokens_separator`, `caption_tag_dropout_rate`, `{a|b}` wildcards) would be lost. With N > 1
the cache holds N variants of each caption candidate instead, and one of them is used at each step:

- variant v of candidate k of an image is `captions.caption_variant` with a `random.Random` seeded by
  (seed, the image's file name, k, v), the same transforms the uncached path applies at each step (caption dropout
  excepted: it stays a per-step choice of the cached empty-prompt embedding). A draw that repeats an earlier variant
  of the same candidate is drawn again (up to `_DISTINCT_ATTEMPTS` times), so the N variants differ whenever the
  caption allows N different texts;
- the variant of a step: the image's uses are counted over the run, occurrence o = (epoch - 1) x num_repeats + the
  number of earlier uses of the image in the epoch's batch plan (a pure function of the seed and the epoch, so a
  resumed run makes the same picks whatever the number of DataLoader workers). Uses come in cycles of N: cycle
  c = o // N takes the variants in the order of a permutation of 0..N-1 seeded by (seed, file name, c), so every
  N consecutive uses of an image see each variant exactly once;
- a validation group draws its variants without shuffle or tag dropout (as the uncached validation does), so only
  wildcards vary there, and every validation pass uses the same variant (occurrence 0).

The file name (not the folder) seeds the draws, so a dataset folder moved elsewhere keeps its caches. An image to
which nothing random applies (no shuffle or tag dropout, no wildcard in its captions) caches one text per
candidate, today's format, whatever N is. The recipe (N, the transform settings, the seed and the drawing method) is
recorded in each cache file; a change of any of them makes the file stale (`VariantRecipe.change_from`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from library.datasets.captions import CaptionSettings, caption_variant, has_wildcards

VARIANT_DRAW = "sha512-random-v1"  # how variants and picks are drawn; another drawing method re-makes the caches
_DISTINCT_ATTEMPTS = 8  # draws of one variant before a repeat of an earlier variant is accepted


@dataclass(frozen=True)
class VariantRecipe:
    """What the variants of a cache file were drawn with; recorded in the file as JSON (`variant_recipe`)."""

    count: int  # caption_cache_variants
    seed: int
    shuffle_caption: bool
    keep_tokens: int
    keep_tokens_separator: str
    caption_separator: str
    secondary_separator: str | None
    caption_tag_dropout_rate: float
    enable_wildcard: bool
    draw: str = VARIANT_DRAW

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def change_from(self, recorded: str) -> str | None:
        """What differs between a recorded recipe (JSON) and this one, e.g. "seed 3 in the file, now 4" (None
        when nothing does)."""
        try:
            old: Any = json.loads(recorded)
        except json.JSONDecodeError:
            old = None
        if not isinstance(old, dict):
            return "an unreadable recipe in the file"
        new = dataclasses.asdict(self)
        changed = [k for k in sorted(set(new) | set(old)) if old.get(k) != new.get(k)]
        if not changed:
            return None
        name = {"count": "caption_cache_variants"}
        return ", ".join(f"{name.get(k, k)} {old.get(k)!r} in the file, now {new.get(k)!r}" for k in changed)


@dataclass(frozen=True)
class CacheCaptions:
    """The texts a text-encoder cache file holds for one image: one per caption candidate without variants, else
    candidate k's variant v at k * count + v."""

    texts: tuple[str, ...]
    recipe: VariantRecipe | None = None

    @property
    def count(self) -> int:
        """Variants per candidate (1 without variants)."""
        return 1 if self.recipe is None else self.recipe.count

    def text(self, candidate_index: int, variant_index: int) -> str:
        candidates = len(self.texts) // self.count
        return self.texts[(candidate_index % candidates) * self.count + variant_index % self.count]


def variant_settings(settings: CaptionSettings, for_validation: bool) -> CaptionSettings:
    """The caption settings variants are drawn with: no token warmup (refused with cached outputs) and, for a
    validation group, no shuffle or tag dropout either."""
    if for_validation:
        return dataclasses.replace(settings, shuffle_caption=False, caption_tag_dropout_rate=0.0, token_warmup_step=0.0)
    return dataclasses.replace(settings, token_warmup_step=0.0)


def recipe_for(settings: CaptionSettings, count: int, seed: int, candidates: Sequence[str]) -> VariantRecipe | None:
    """The recipe of an image's variants with these (variant) settings, or None when one text per candidate is
    all there is to cache (count 1, or nothing random applies to these captions)."""
    random_parts = settings.shuffle_caption or settings.caption_tag_dropout_rate > 0 or (
        settings.enable_wildcard and any(has_wildcards(c) for c in candidates))
    if count <= 1 or not random_parts:
        return None
    return VariantRecipe(count=count, seed=int(seed), shuffle_caption=settings.shuffle_caption,
                         keep_tokens=settings.keep_tokens, keep_tokens_separator=settings.keep_tokens_separator,
                         caption_separator=settings.caption_separator,
                         secondary_separator=settings.secondary_separator,
                         caption_tag_dropout_rate=settings.caption_tag_dropout_rate,
                         enable_wildcard=settings.enable_wildcard)


def variant_name(absolute_path: str) -> str:
    """The part of an image's path that seeds its variants and picks: the file name."""
    return os.path.basename(absolute_path)


def draw_variants(candidates: Sequence[str], settings: CaptionSettings, recipe: VariantRecipe,
                  name: str) -> tuple[str, ...]:
    """The variant texts of an image (candidate k's variant v at k * count + v); see the module docstring."""
    texts: list[str] = []
    for k, candidate in enumerate(candidates):
        seen: set[str] = set()
        for v in range(recipe.count):
            for attempt in range(_DISTINCT_ATTEMPTS):
                rng = random.Random(f"{recipe.seed}/caption-variant/{name}/{k}/{v}/{attempt}")
                text = caption_variant(candidate, settings, rng)
                if text not in seen:
                    break
            seen.add(text)
            texts.append(text)
    return tuple(texts)


def pick_variant(seed: int, name: str, occurrence: int, count: int) -> int:
    """The variant used at an image's `occurrence`-th use in the run (counted from 0); see the module docstring."""
    cycle, position = divmod(max(0, occurrence), count)
    order = list(range(count))
    random.Random(f"{seed}/caption-variant-pick/{name}/{cycle}").shuffle(order)
    return order[position]


def occurrence_of(epoch: int, num_repeats: int, ordinal: int) -> int:
    """An image's use in the run from its epoch (from 1; 0 for validation) and its earlier uses in that epoch."""
    return (max(epoch, 1) - 1) * num_repeats + ordinal
