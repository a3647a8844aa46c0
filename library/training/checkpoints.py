"""Saved files of a training run: LoRA checkpoint names, rotation of old saves, and the resumable training state.

Names (sd-scripts style): `<name>-<epoch:06d>.safetensors` per epoch, `<name>-step<step:08d>.safetensors` per step,
`<name>.safetensors` at the end; states beside them as `<same stem>-state/` folders holding accelerate's state
(optimizer, scheduler, RNGs, data order), `host_random_<i>.safetensors` (the step's own generator, `host_random`),
`network.safetensors` (exact fp32 LoRA weights), `train_state.json` and `manifest.json`; the folders are written and
checked by `library.training.state_io`.

`train_state.json` holds the epoch and step, and what a resume must repeat to continue exactly (`RunFingerprint`):
the seed, the batch sizes, the gradient accumulation, the number of processes and two hashes of the dataset (its
config and its files with their captions). `check_resume` compares them with the current run, and checks that the
random state of this process can be read: any difference is an error that names it, or with `--resume_inexact` a
warning saying that the run will not match the uninterrupted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.errors import UserError
from library.files.safetensors_io import write_text_atomic
from library.training import host_random, state_io

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.json"
NETWORK_STATE_FILE = "network.safetensors"
RANDOM_STATE_FILE = "random_states_{index}.pkl"  # accelerate's name
_RANDOM_STATE_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")


def epoch_name(name: str, epoch: int) -> str:
    return f"{name}-{epoch:06d}"


def step_name(name: str, step: int) -> str:
    return f"{name}-step{step:08d}"


def saved_stem_pattern(name: str) -> re.Pattern[str]:
    """The stems of every file and state folder a run with output name `name` saves: `<name>`, `<name>-<epoch>`,
    `<name>-step<step>`, each with or without `-state`."""
    return re.compile(rf"{re.escape(name)}(-\d{{6}}|-step\d{{8}})?(-state)?")


# ----------------------------------------------------------------------------------------------- fingerprint
@dataclass(frozen=True)
class RunFingerprint:
    """What a resumed run must repeat to continue with the same batches, noise and weights."""

    seed: int
    batch_sizes: tuple[int, ...]  # per dataset
    gradient_accumulation_steps: int
    num_processes: int
    dataset_config: str  # sha256 of the dataset and subset settings
    dataset_files: str  # sha256 of the image files (relative to their folders), repeats and captions

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "batch_sizes": list(self.batch_sizes)}

    @staticmethod
    def from_json(data: dict[str, Any]) -> RunFingerprint:
        return RunFingerprint(int(data["seed"]), tuple(int(b) for b in data["batch_sizes"]),
                              int(data["gradient_accumulation_steps"]), int(data["num_processes"]),
                              str(data["dataset_config"]), str(data["dataset_files"]))

    def differences(self, saved: RunFingerprint) -> list[str]:
        """What differs from the `saved` run, one phrase each."""
        out = []
        if self.seed != saved.seed:
            out.append(f"--seed is {self.seed}, the state's run had {saved.seed}")
        if self.batch_sizes != saved.batch_sizes:
            out.append(f"the batch sizes are {list(self.batch_sizes)}, the state's run had {list(saved.batch_sizes)}")
        if self.gradient_accumulation_steps != saved.gradient_accumulation_steps:
            out.append(f"--gradient_accumulation_steps is {self.gradient_accumulation_steps}, the state's run had"
                       f" {saved.gradient_accumulation_steps}")
        if self.num_processes != saved.num_processes:
            out.append(f"{self.num_processes} processes run, the state's run had {saved.num_processes}")
        if self.dataset_config != saved.dataset_config:
            out.append("the dataset settings differ (dataset config or dataset options)")
        if self.dataset_files != saved.dataset_files:
            out.append("the dataset's files differ (images added, removed or renamed, repeats or captions changed)")
        return out


def _subset_identity(subset: Any) -> dict[str, Any]:
    values = {k: v for k, v in dataclasses.asdict(subset).items() if k != "sources"}
    for key in ("image_dir", "metadata_file"):  # the folder's name, not where it lies on this machine
        if values.get(key):
            values[key] = os.path.basename(os.path.normpath(values[key]))
    return values


def _relative_image_path(info: Any) -> str:
    folder = info.subset.image_dir
    if folder:
        try:
            return Path(os.path.relpath(info.absolute_path, folder)).as_posix()
        except ValueError:  # another drive (Windows)
            pass
    return os.path.basename(info.absolute_path)


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def dataset_fingerprint(group: Any) -> tuple[str, str]:
    """(config hash, files hash) of a training dataset group."""
    config, files = [], []
    for dataset in group.datasets:
        params = {k: v for k, v in dataclasses.asdict(dataset.params).items() if k != "sources"}
        config.append({"params": params, "subsets": [_subset_identity(s) for s in dataset.subsets]})
        files.append(sorted(
            (info.subset.index, _relative_image_path(info), info.num_repeats, list(info.caption_candidates))
            for info in dataset.image_infos
        ))
    return _sha256_json(config), _sha256_json(files)


def run_fingerprint(args: argparse.Namespace, group: Any, num_processes: int) -> RunFingerprint:
    config, files = dataset_fingerprint(group)
    return RunFingerprint(int(args.seed), tuple(d.params.batch_size for d in group.datasets),
                          int(args.gradient_accumulation_steps), int(num_processes), config, files)


# ------------------------------------------------------------------------------------------------ train state
@dataclass
class TrainState:
    epoch: int  # epochs completed
    step: int  # optimizer steps completed
    run: RunFingerprint | None = None  # None in states of earlier versions

    def write(self, folder: Path) -> None:
        body: dict[str, Any] = {"current_epoch": self.epoch, "current_step": self.step}
        if self.run is not None:
            body["run"] = self.run.to_json()
        write_text_atomic(json.dumps(body, indent=1), folder / STATE_FILE)

    @staticmethod
    def read(folder: Path) -> TrainState:
        path = folder / STATE_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            run = RunFingerprint.from_json(data["run"]) if "run" in data else None
            return TrainState(int(data["current_epoch"]), int(data["current_step"]), run)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--resume '{folder}' has no readable {STATE_FILE} ({e}): give a '-state' folder saved with"
                            " --save_state.") from e


# ---------------------------------------------------------------------------------------------------- resume
def check_resume_folder(path: str) -> Path:
    """The --resume folder, checked before anything is loaded: a folder (put back first when a save was killed while
    it replaced it), a state of this trainer, and every file as its manifest lists it (sizes and sha256)."""
    folder = Path(path)
    state_io.recover(folder)
    if not folder.exists():
        raise UserError(f"--resume '{path}' does not exist: give a '-state' folder saved with --save_state.")
    if not folder.is_dir():
        raise UserError(f"--resume '{path}' is not a folder: give a '-state' folder saved with --save_state.")
    if not (folder / NETWORK_STATE_FILE).exists() and not (folder / state_io.MANIFEST_FILE).exists():
        raise UserError(f"--resume '{path}' holds no {NETWORK_STATE_FILE}: it is not a state saved by this trainer"
                        " (states of sd-scripts cannot be resumed here).")
    state_io.verify_folder(folder)
    return folder


def seed_from_state(args: argparse.Namespace) -> None:
    """Without --seed, a resumed run takes the seed of the state (a new random seed would change the run)."""
    if not args.resume or args.seed is not None:
        return
    run = TrainState.read(Path(args.resume)).run
    if run is not None:
        args.seed = run.seed
        logger.info("no --seed given: using the seed of the state, %d", run.seed)


def random_state_problem(folder: Path, process_index: int) -> str | None:
    """Why this process's random state in `folder` cannot restore the generators (None when it can). Read with
    accelerate's loader (weights only: no pickled code runs)."""
    from accelerate.utils import load  # heavy import, only when resuming

    path = folder / RANDOM_STATE_FILE.format(index=process_index)
    if not path.is_file():
        return f"the random state {path.name} is missing"
    try:
        states = load(str(path))
    except Exception as e:  # a truncated or hostile pickle: torch raises many kinds
        return f"the random state {path.name} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    keys = _RANDOM_STATE_KEYS + (("torch_cuda_manual_seed",) if torch.cuda.is_available() else ())
    missing = [k for k in keys if not isinstance(states, dict) or k not in states]
    if missing:
        return f"the random state {path.name} lacks {', '.join(missing)}"
    return None


def check_resume(folder: Path, current: RunFingerprint, process_index: int, inexact: bool) -> TrainState:
    """The state to resume from, after checking that the resumed run can continue exactly: the same seed, batch
    sizes, gradient accumulation, processes and dataset, and a readable random state. Any difference is a UserError
    naming it, or with `inexact` (--resume_inexact) a warning."""
    state = TrainState.read(folder)
    problems = []
    if not (folder / state_io.MANIFEST_FILE).exists():
        problems.append(f"the folder has no {state_io.MANIFEST_FILE} (an earlier version wrote it), so its files"
                        " cannot be verified")
    if state.run is None:
        problems.append(f"its {STATE_FILE} does not record the seed, batch sizes and dataset of its run")
    else:
        problems += current.differences(state.run)
    for random_problem in (random_state_problem(folder, process_index),
                           host_random.host_random_problem(folder, process_index)):
        if random_problem:
            problems.append(random_problem)
    if problems:
        what = "; ".join(problems)
        if not inexact:
            raise UserError(f"--resume '{folder}' cannot continue exactly: {what}. Repeat the settings of the run"
                            " that saved it, or add --resume_inexact to continue anyway (the run will not match the"
                            " uninterrupted one).")
        logger.warning("--resume_inexact: %s; the resumed run will not match the uninterrupted one", what)
    return state


def load_accelerator_state(accelerator: Any, folder: Path) -> None:
    """accelerate's load_state, with its failures (a file it cannot read) as one sentence."""
    try:
        accelerator.load_state(str(folder))
    except Exception as e:
        raise UserError(f"The state folder '{folder}' cannot be loaded ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else 'no details'}): it does not belong to this"
                        " network and optimizer (other --network_dim, --network_module or --optimizer_type?) or is"
                        " damaged; resume with the settings that saved it or from another state.") from e


# ------------------------------------------------------------------------------------------------- rotation
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
