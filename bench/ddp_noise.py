"""Bench-only setup for the DDP equivalence check (`python -m bench.measure --setup bench.ddp_noise:install`).

The trainer draws noise and timesteps from each process's global RNG, so one process with batch 2 and two processes
with batch 1 give their samples different noise even with the same seed, and their LoRAs cannot be compared. This
patch makes every training sample draw its noise, timestep and input-perturbation noise from a generator seeded by
its image key and the step, and runs the DiT once per sample: the two layouts then compute the same per-sample
losses, and the averaged gradients (the trainer's code under test) must agree to bf16 tolerance.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch


def _sample(batch: dict[str, Any], i: int, n: int) -> dict[str, Any]:
    out = {}
    for k, v in batch.items():
        if isinstance(v, (list, tuple, torch.Tensor)) and len(v) == n:
            out[k] = v[i:i + 1]
        else:
            out[k] = v
    return out


def install() -> None:
    import moss_image_train_network as m

    original = m.MossImageNetworkTrainer.get_noise_pred_and_target

    def per_image(self: Any, run: Any, latents: torch.Tensor, text_conds: Any, batch: dict[str, Any], is_train: bool,
                  fixed_sigmas: torch.Tensor | None = None, generator: torch.Generator | None = None) -> tuple:
        if not is_train:
            return original(self, run, latents, text_conds, batch, is_train, fixed_sigmas, generator)
        keys = batch["image_keys"]
        embeds, mask = text_conds
        parts = []
        for i, key in enumerate(keys):
            g = torch.Generator().manual_seed(zlib.crc32(str(key).encode()) + 1_000_003 * run.global_step)
            parts.append(original(self, run, latents[i:i + 1], (embeds[i:i + 1], mask[i:i + 1]),
                                  _sample(batch, i, len(keys)), is_train, None, g))
        pred, target, timesteps = (torch.cat([p[j] for p in parts]) for j in range(3))
        weighting = None if parts[0][3] is None else torch.cat([p[3] for p in parts])
        return pred, target, timesteps, weighting

    m.MossImageNetworkTrainer.get_noise_pred_and_target = per_image  # type: ignore[method-assign]
