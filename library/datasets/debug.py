"""`--debug_dataset`: log what the training would see, batch by batch, without loading any model."""

from __future__ import annotations

import logging

from library.datasets.dataset_group import DatasetGroup

logger = logging.getLogger(__name__)


def debug_dataset(group: DatasetGroup, epochs: int = 1, max_batches: int | None = None) -> int:
    """Build the batches of the first `epochs` epochs (images are really loaded, so unreadable files show up) and
    log, for each batch, its bucket and each sample's image, flip and caption. Returns the number of batches."""
    count = 0
    for epoch in range(1, epochs + 1):
        group.set_current_epoch(epoch)
        for index in range(len(group)):
            if max_batches is not None and count >= max_batches:
                return count
            batch = group[index]
            w, h = batch["bucket_reso"]
            logger.info("epoch %d batch %d/%d: bucket %dx%d, %d samples", epoch, index + 1, len(group), w, h,
                        len(batch["image_keys"]))
            for key, caption, flipped, dropped, weight in zip(
                batch["image_keys"], batch["captions"], batch["flippeds"], batch["captions_dropped"].tolist(),
                batch["loss_weights"].tolist(),
            ):
                logger.info("  %s%s%s loss weight %.3g caption: %r", key, " [flipped]" if flipped else "",
                            " [caption dropped]" if dropped else "", weight, caption)
            count += 1
    return count
