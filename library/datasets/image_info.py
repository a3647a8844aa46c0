"""`ImageInfo` (one image of one subset) and the two hooks through which caching strategies plug in.

The dataset never reads or writes cache files itself. A latents strategy and a text-encoder-output strategy (see
`library/strategy_base.py`) are attached to a `DatasetGroup`; the group asks them for each image's cache path
(stored on the ImageInfo as `latents_npz` / `te_outputs_npz`) and, once attached, for the cached values that go
into a batch. The in-memory slots of ImageInfo (`latents`, `latents_flipped`, `alpha_mask`, `text_encoder_outputs`)
belong to the strategies: they fill them when caching in memory and read them back in `get_latents` /
`get_outputs`; the dataset does not interpret them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from library.datasets.config import SubsetParams


@dataclass(eq=False)
class ImageInfo:
    """One image of one subset, with its captions, bucket and cache slots."""

    image_key: str  # the absolute path; unique within a dataset
    absolute_path: str
    subset: SubsetParams
    caption_candidates: list[str]  # raw candidates (before prefix/suffix and per-step processing)
    num_repeats: int  # the subset's num_repeats, or the balanced count for regularisation images
    is_reg: bool
    image_size: tuple[int, int] | None = None  # ORIGINAL (width, height) of the file
    bucket_reso: tuple[int, int] | None = None  # (width, height) of the bucket
    resized_size: tuple[int, int] | None = None  # size the image is resized to before the crop
    latents_npz: str | None = None  # set by attach_latents_cache: <stem>_<WWWW>x<HHHH>_moss.npz
    te_outputs_npz: str | None = None  # set by attach_text_encoder_outputs_cache: <stem>_moss_te.npz
    latents: Any = None  # in-memory latents cache (owned by the latents strategy)
    latents_flipped: Any = None
    alpha_mask: Any = None
    text_encoder_outputs: Any = None  # in-memory TE cache (owned by the TE strategy)


@runtime_checkable
class LatentsCacheHook(Protocol):
    """What the dataset needs from a latents caching strategy."""

    def get_latents_npz_path(self, absolute_path: str, image_size: tuple[int, int]) -> str:
        """Cache file of an image; `image_size` is the ORIGINAL (width, height) of the file."""
        ...

    def get_latents(self, info: ImageInfo, flipped: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(latents [C, h, w] for the requested orientation, alpha mask [H, W] NOT flipped, or None) of an image
        at `info.bucket_reso`, from memory or from `info.latents_npz`."""
        ...


@runtime_checkable
class TextEncoderOutputsCacheHook(Protocol):
    """What the dataset needs from a text-encoder-output caching strategy."""

    def get_outputs_npz_path(self, absolute_path: str) -> str:
        """Cache file of an image's caption candidates."""
        ...

    def get_outputs(self, info: ImageInfo, candidate_index: int, dropped: bool, variant_index: int = 0) -> Any:
        """The cached outputs of candidate `candidate_index` (its caption variant `variant_index` when the cache
        holds variants), or the unconditional (empty-prompt) outputs when `dropped`, from memory or from
        `info.te_outputs_npz`."""
        ...
