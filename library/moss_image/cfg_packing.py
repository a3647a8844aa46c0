"""The two passes of a CFG step as one pass over packed sequences.

A sampling step with classifier-free guidance runs the DiT on the same latents, at the same timestep, with two texts
(the prompt and the negative prompt). In a block everything but attention works row by row, and the modulation
depends on the timestep alone. So the two passes' sequences can run side by side as one sequence,
``[text_c ; image ; text_u ; image]``, where each part attends only within itself (`Segments`, one attention call
per part, no mask). Each Linear then multiplies twice the rows in one product: fewer partly filled waves of GPU
tiles, one kernel launch where there were two, and half the block calls on the host.

Each row goes through the same operations as in its own pass: the int8 products are exact integer sums and the norms
are row-wise, so ConvRot INT8 packed passes give the same bits as separate ones; bf16 products may round differently
with another row count.

It applies where neither text is padded (no key mask: a single prompt never is) and both are prepared for the same
latent size. A block that one condition skips (`uncond_skip_layers`) runs on the other part alone, as its own pass
would run it. `set_cfg_packing(False)` turns packing off (the benchmark's comparison).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from library.runtime.attention import Segments, segment_starts

__all__ = ["PackedText", "cfg_packing_on", "pack_texts", "packed_forward", "set_cfg_packing"]

_ON = {"cfg_packing": True}


def set_cfg_packing(on: bool) -> bool:
    """Turn the packing of a step's passes on or off (on by default); returns the previous setting."""
    previous = _ON["cfg_packing"]
    _ON["cfg_packing"] = bool(on)
    return previous


def cfg_packing_on() -> bool:
    return _ON["cfg_packing"]


@dataclass(frozen=True)
class PackedText:
    """Several prepared texts (`MossImage.prepare_text`) for one pass: each one's text conditioning, the RoPE tables
    of the packed sequence, and the length of each part [text_i ; image]."""

    texts: tuple[Any, ...]  # TextConditioning, in pass order
    cos: torch.Tensor  # [B, sum of the parts, head_dim/2]
    sin: torch.Tensor
    segments: Segments
    grid: tuple[int, int]

    def offsets(self) -> list[int]:
        """Where each part starts in the packed sequence."""
        return segment_starts(self.segments)


def pack_texts(texts: Sequence[Any]) -> PackedText | None:
    """The packed form of `texts` (TextConditioning, at least two), or None where packing does not apply: turned off,
    a padded text (a key mask), different latent sizes or batch sizes."""
    if not cfg_packing_on() or len(texts) < 2:
        return None
    if any(t.key_mask is not None for t in texts):
        return None
    if len({t.grid for t in texts}) != 1 or len({t.tokens.shape[0] for t in texts}) != 1:
        return None
    segments = tuple(int(t.cos.shape[1]) for t in texts)
    return PackedText(tuple(texts), torch.cat([t.cos for t in texts], dim=1), torch.cat([t.sin for t in texts], dim=1),
                      segments, texts[0].grid)


def packed_forward(model: Any, x: torch.Tensor, timesteps: torch.Tensor, packed: PackedText,
                   skip_layers: Sequence[Iterable[int] | None]) -> tuple[torch.Tensor, ...]:
    """The velocities of latents `x` at `timesteps` for each of the packed texts, from one pass of `model` (a
    MossImage); `skip_layers[i]`: the main blocks that text i's pass skips."""
    h, w = x.shape[-2:]
    if (h, w) != packed.grid:
        raise ValueError(f"the packed texts were prepared for latents {packed.grid}, not {(h, w)}")
    if len(skip_layers) != len(packed.texts):
        raise ValueError(f"{len(skip_layers)} skip lists for {len(packed.texts)} packed texts")
    seq, t_emb, mod = model._region("_embed_image_and_time")(
        x, timesteps.to(x.device, non_blocking=True), tuple(t.tokens for t in packed.texts))
    skips = [set(s or ()) for s in skip_layers]

    def one_block(i: int, block: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
        running = [j for j in range(len(skips)) if i not in skips[j]]
        if len(running) == len(skips):
            return model._run_block(block, seq, packed.cos, packed.sin, packed.segments, mod)
        return _run_parts(model, block, seq, packed, running, mod) if running else seq

    seq = model.run_main_blocks(seq, one_block)
    final = model._region("_final")
    return tuple(final(seq[:, start:start + n], t_emb, text.tokens.shape[1], h, w)
                 for start, n, text in zip(packed.offsets(), packed.segments, packed.texts))


def _run_parts(model: Any, block: torch.nn.Module, seq: torch.Tensor, packed: PackedText, running: list[int],
               mod: torch.Tensor) -> torch.Tensor:
    """`block` on the parts in `running` only, each as its own pass runs it; the other parts as they are."""
    parts = []
    for j, (start, n, text) in enumerate(zip(packed.offsets(), packed.segments, packed.texts)):
        part = seq[:, start:start + n]
        if j in running:
            part = model._run_block(block, part, text.cos, text.sin, None, mod)
        parts.append(part)
    return torch.cat(parts, dim=1)
