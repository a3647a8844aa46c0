"""Saved files of a training run: LoRA checkpoint names, rotation of old saves, and the resumable training state.

Names (sd-scripts style): `<name>-<epoch:06d>.safetensors` per epoch, `<name>-step<step:08d>.safetensors` per step,
`<name>.safetensors` at the end; states beside them as `<same stem>-state/` folders holding accelerate's state
(optimizer, scheduler, RNGs, data order), `network.safetensors` (exact fp32 LoRA weights) and `train_state.json`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from library.errors import UserError
from library.files.safetensors_io import write_text_atomic

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.json"
NETWORK_STATE_FILE = "network.safetensors"


def epoch_name(name: str, epoch: int) -> str:
    return f"{name}-{epoch:06d}"


def step_name(name: str, step: int) -> str:
    return f"{name}-step{step:08d}"


@dataclass
class TrainState:
    epoch: int  # epochs completed
    step: int  # optimizer steps completed

    def write(self, folder: Path) -> None:
        write_text_atomic(json.dumps({"current_epoch": self.epoch, "current_step": self.step}), folder / STATE_FILE)

    @staticmethod
    def read(folder: Path) -> "TrainState":
        path = folder / STATE_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return TrainState(int(data["current_epoch"]), int(data["current_step"]))
        except (OSError, ValueError, KeyError) as e:
            raise UserError(
                f"--resume '{folder}' has no readable {STATE_FILE} ({e}): give a '-state' folder saved with --save_state."
            ) from e


def check_resume_folder(path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"--resume '{path}' is not a folder: give a '-state' folder saved with --save_state.")
    if not (folder / NETWORK_STATE_FILE).exists():
        raise UserError(f"--resume '{path}' holds no {NETWORK_STATE_FILE}: it is not a state saved by this trainer.")
    return folder


def remove_path(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed old state %s", path)
    elif path.exists():
        os.remove(path)
        logger.info("removed old checkpoint %s", path)


def old_epoch_to_remove(epoch: int, every: int | None, keep_last: int | None) -> int | None:
    """The epoch whose save falls out of the kept window after saving `epoch` (sd-scripts' rule)."""
    if not every or not keep_last:
        return None
    old = epoch - every * keep_last
    return old if old > 0 else None


def old_step_to_remove(step: int, every: int | None, keep_last_steps: int | None) -> int | None:
    """The step save that falls out of the last `keep_last_steps` steps after saving `step`."""
    if not every or not keep_last_steps:
        return None
    old = step - keep_last_steps - 1
    old -= old % every
    return old if old > 0 else None
