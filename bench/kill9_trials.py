"""kill -9 trials of every save on the tiny snapshot (CPU, Linux): intact or corrupted after a kill at a random moment.

    python -m bench.kill9_trials [--trials 10] [--kinds lora,state_new,state_overwrite,latents,te] [--snapshot DIR]

One process prepares what the trainer saves (the tiny snapshot's DiT with a LoRA network, an AdamW optimizer and a
scheduler prepared by accelerate, the toy dataset's latent and text-encoder caches). For each trial it forks a child
that does nothing but save, over and over, through the product's own writers, and kills it with SIGKILL inside its
first, second or third save, at a random moment (up to 1.2 times the time of one save, so kills land in every phase
of a save, and the saves before it are complete). Then it checks what is on
disk as the next run would:

- lora: the LoRA file, overwritten at every save (`network.save_weights`): absent (killed before the first save) or
  complete and equal to one save, never torn;
- state_new: a new `-state` folder per save (accelerate's `save_state` + `network.safetensors` + `train_state.json`,
  written by `library.training.state_io`): every folder under its final name passes `--resume`'s check;
- state_overwrite: one `-state` folder overwritten at every save: it passes `--resume`'s check (put back first when
  the kill fell between the two renames), and its files belong to ONE save (the weights, the optimizer's learning rate
  and the step carry the same save number), else it is refused: a resumable mix counts as corrupted;
- latents / te: the `*_moss.npz` / `*_moss_te.npz` cache files, rewritten at every save: each absent or valid for the
  strategy's check; then the real caching driver runs and must re-make exactly the files that were not valid.

After each trial the start-of-run cleanup runs (`library.training.output_folder.remove_leftovers` for the output
folder; for the caches, the drivers remove the temp files of their files once they are STALE_TEMP_SECONDS old, so the
trial ages them to stand for a later run): what it removed is counted, and anything left after it counts as a
leftover. The result is JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

import library.caching.strategies as cs
import moss_image_train_network as trainer_script
from library.datasets import build_dataset_groups
from library.errors import UserError
from library.files.safetensors_io import STALE_TEMP_SECONDS, leftover_temp_files, load_safetensors
from library.moss_image.loaders import load_moss_image_model
from library.moss_image.tiny_snapshot import build_tiny_snapshot
from library.training import checkpoints, output_folder, state_io
from networks import lora_generic

KINDS = ("lora", "state_new", "state_overwrite", "latents", "te")
NAME = "toy"
CAPTION = "a red square on a grey background"


@dataclass
class Tally:
    trials: int = 0
    intact: int = 0
    corrupted: int = 0
    absent: int = 0  # killed before the first save finished: nothing under the final name, which is correct
    refused: int = 0  # state_overwrite: --resume refused the folder with a sentence (no silent mix)
    remade: int = 0  # caches: files the driver re-made after the kill
    remade_wrong: int = 0  # caches: trials where the driver re-made other files than the invalid ones
    leftovers_cleaned: int = 0  # temp files / folders removed by the start-of-run cleanup
    leftovers_after_cleanup: int = 0
    seconds_per_save: float = 0.0
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------------ setup
class Setup:
    """Everything the savers need, made once before the children are forked."""

    def __init__(self, root: Path, snapshot: Path | None) -> None:
        torch.set_num_threads(1)
        self.root = root
        self.snapshot = snapshot or build_tiny_snapshot(root / "snapshot" / "moss-image-tiny")
        self.data = self._toy_dataset(root / "data")
        self.args = trainer_script.setup_parser().parse_args([
            "--snapshot", str(self.snapshot), "--train_data_dir", str(self.data), "--resolution", "64",
            "--output_dir", str(root / "out"), "--output_name", NAME, "--network_module", "networks.lora_generic",
            "--seed", "7", "--save_state", "--max_data_loader_n_workers", "0"])
        self.group, _ = build_dataset_groups(self.args)
        dit = load_moss_image_model("cpu", self.snapshot, dtype=torch.float32)
        self.network = lora_generic.create_network(1.0, 4, 1.0, None, [], dit)
        self.network.apply_to([], dit, False, True)
        self.marker = next(iter(self.network.get_trainable_params()))
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)
        optimizer = torch.optim.AdamW(self.network.get_trainable_params(), lr=1e-4)
        for p in self.network.get_trainable_params():
            p.grad = torch.ones_like(p)
        optimizer.step()  # the moments exist: optimizer.bin has its real size
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        self.optimizer, self.scheduler = self.accelerator.prepare(optimizer, scheduler)
        self.fingerprint = checkpoints.run_fingerprint(self.args, self.group, 1)

    @staticmethod
    def _toy_dataset(root: Path) -> Path:
        folder = root / "4_toy"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(4):
            arr = np.full((64, 64, 3), 128, np.uint8)
            arr[16:48, 16:48] = (220, 30 + 20 * i, 30)
            Image.fromarray(arr).save(folder / f"img{i}.png")
            (folder / f"img{i}.txt").write_text(CAPTION)
        return root

    # the savers: `save(folder, number)` writes save number `number` ------------------------------------------
    def mark(self, number: int) -> None:
        with torch.no_grad():
            self.marker.view(-1)[0] = float(number)
        for group in self.optimizer.param_groups:
            group["lr"] = number * 1e-6

    def save_lora(self, folder: Path, number: int) -> None:
        self.mark(number)
        self.network.save_weights(str(folder / f"{NAME}.safetensors"), torch.float32, {"ss_steps": str(number)})

    def save_state(self, folder: Path, name: str, number: int) -> None:
        self.mark(number)

        def write(temp: Path) -> None:  # what the trainer's _save_state writes
            self.accelerator.save_state(str(temp))
            self.network.save_weights(str(temp / checkpoints.NETWORK_STATE_FILE), torch.float32, None)
            checkpoints.TrainState(0, number, self.fingerprint).write(temp)

        state_io.save_state_folder(folder / name, write, self.accelerator)

    def attach_caches(self, folder: Path) -> tuple[Any, Any]:
        """The toy images copied into `folder`, with both strategies attached (the cache files land beside them)."""
        images = folder / "data" / "4_toy"
        shutil.copytree(self.data / "4_toy", images)
        args = argparse.Namespace(**{**vars(self.args), "train_data_dir": str(folder / "data")})
        group, _ = build_dataset_groups(args)
        latents = cs.MossImageLatentsCachingStrategy(True)
        text = cs.MossImageTextEncoderOutputsCachingStrategy(True, max_token_length=64, encoder_variant="none")
        group.attach_latents_cache(latents)
        group.attach_text_encoder_outputs_cache(text, cache_supports_dropout=True,
                                                supports_multiple_caption_candidates=True)
        text.set_uncond((torch.zeros(3, 8), torch.ones(3, dtype=torch.bool)))
        return group, (latents, text)

    @staticmethod
    def save_latents(group: Any, strategy: Any, number: int) -> None:
        for info in group.image_infos():
            h, w = strategy.latent_hw(info.bucket_reso)
            strategy.store(info, torch.full((32, h, w), float(number)), None, None, (0, 0, *info.bucket_reso))

    @staticmethod
    def save_te(group: Any, strategy: Any, number: int) -> None:
        for info in group.image_infos():
            captions = group.captions_for_text_encoder_cache(info)
            strategy.store(info, captions, [(torch.full((5, 8), float(number)), torch.ones(5, dtype=torch.bool))
                                            for _ in captions])


# ------------------------------------------------------------------------------------------------- a trial
def kill_during(save: Callable[[int], None], completed: int, delay: float) -> None:
    """Fork a child that saves over and over (save numbers 1, 2, ...); once it has completed `completed` saves, SIGKILL
    it `delay` seconds into the next one."""
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(done_r)
            number = 1
            while True:
                save(number)
                os.write(done_w, b".")
                number += 1
        finally:
            os._exit(0)
    os.close(done_w)
    for _ in range(completed):
        os.read(done_r, 1)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(done_r)


def timed(save: Callable[[int], None]) -> float:
    start = time.perf_counter()
    save(10**6)
    return time.perf_counter() - start


def clean(folder: Path, tally: Tally) -> None:
    """The start-of-run cleanup, then what it left behind."""
    tally.leftovers_cleaned += output_folder.remove_leftovers(folder, NAME)
    ours = checkpoints.saved_stem_pattern(NAME)

    def is_ours(target: str) -> bool:
        return ours.fullmatch(target.removesuffix(".safetensors")) is not None

    tally.leftovers_after_cleanup += len(leftover_temp_files(folder, is_ours))
    tally.leftovers_after_cleanup += len(state_io.leftover_folders(folder, is_ours))


def _number_of_lora(path: Path, base: dict[str, torch.Tensor], marker_key: str) -> int:
    """The save number of a LoRA file that is one save exactly; raises for anything else."""
    sd = load_safetensors(path)
    if set(sd) != set(base):
        raise ValueError("keys differ")
    for k, v in sd.items():
        if k != marker_key and not torch.equal(v, base[k]):
            raise ValueError(f"{k} differs")
    number = float(sd[marker_key].view(-1)[0])
    if not number.is_integer() or number < 1:
        raise ValueError(f"marker {number}")
    return int(number)


def trial_lora(setup: Setup, folder: Path, kill_at: tuple[int, float], tally: Tally, base: dict[str, torch.Tensor],
               marker_key: str) -> None:
    kill_during(lambda n: setup.save_lora(folder, n), *kill_at)
    path = folder / f"{NAME}.safetensors"
    if not path.exists():
        tally.absent += 1
    else:
        try:
            _number_of_lora(path, base, marker_key)
            tally.intact += 1
        except (UserError, ValueError, OSError) as e:
            tally.corrupted += 1
            tally.notes.append(f"lora: {e}")
    clean(folder, tally)


def _state_number(folder: Path, base: dict[str, torch.Tensor], marker_key: str) -> int:
    """The save number of a whole state folder whose files all come from that save; raises for anything else."""
    checkpoints.check_resume_folder(str(folder))  # the check --resume makes first (puts back an interrupted one)
    step = checkpoints.TrainState.read(folder).step
    weights = _number_of_lora(folder / checkpoints.NETWORK_STATE_FILE, base, marker_key)
    from accelerate.utils import load

    lr = load(str(folder / "optimizer.bin"))["param_groups"][0]["lr"]
    if not (weights == step and round(lr / 1e-6) == step):
        raise ValueError(f"mixed save: weights {weights}, lr {lr}, step {step}")
    return step


def trial_state_new(setup: Setup, folder: Path, kill_at: tuple[int, float], tally: Tally,
                    base: dict[str, torch.Tensor], marker_key: str) -> None:
    kill_during(lambda n: setup.save_state(folder, f"{checkpoints.step_name(NAME, n)}-state", n), *kill_at)
    clean(folder, tally)
    states = sorted(p for p in folder.iterdir() if p.name.endswith("-state") and not p.name.startswith("."))
    if not states:
        tally.absent += 1
    for state in states:
        try:
            _state_number(state, base, marker_key)
            tally.intact += 1
        except (UserError, ValueError, OSError, KeyError) as e:
            tally.corrupted += 1
            tally.notes.append(f"state_new {state.name}: {e}")


def trial_state_overwrite(setup: Setup, folder: Path, kill_at: tuple[int, float], tally: Tally,
                          base: dict[str, torch.Tensor], marker_key: str) -> None:
    name = f"{NAME}-state"
    setup.save_state(folder, name, 10**6)  # the state a second run overwrites
    kill_during(lambda n: setup.save_state(folder, name, n), *kill_at)
    try:
        _state_number(folder / name, base, marker_key)
        tally.intact += 1
    except UserError as e:  # refused with a sentence: not resumable, but not silent either
        tally.refused += 1
        tally.notes.append(f"state_overwrite refused: {e}")
    except (ValueError, OSError, KeyError) as e:
        tally.corrupted += 1
        tally.notes.append(f"state_overwrite: {e}")
    clean(folder, tally)


def trial_cache(setup: Setup, folder: Path, kill_at: tuple[int, float], tally: Tally, kind: str) -> None:
    group, (latents, text) = setup.attach_caches(folder)
    if kind == "latents":
        kill_during(lambda n: setup.save_latents(group, latents, n), *kill_at)
        valid = [latents.is_disk_cached_latents_expected(i.bucket_reso, i.latents_npz, False, False)
                 for i in group.image_infos()]
        paths = [i.latents_npz for i in group.image_infos()]
    else:
        kill_during(lambda n: setup.save_te(group, text, n), *kill_at)
        valid = [text.is_disk_cached_outputs_expected(i.te_outputs_npz, group.captions_for_text_encoder_cache(i))
                 for i in group.image_infos()]
        paths = [i.te_outputs_npz for i in group.image_infos()]
    present = [os.path.exists(p) for p in paths]
    if not any(present):
        tally.absent += 1
    elif all(v for v, p in zip(valid, present) if p):
        tally.intact += 1
    else:
        tally.corrupted += 1
        tally.notes.append(f"{kind}: {sum(p and not v for v, p in zip(valid, present))} invalid files")
    # the next run, later than STALE_TEMP_SECONDS (a killed write's temp file is that old by then): the real driver
    # removes the temp files and re-makes exactly the files that are not valid
    cache_folder = folder / "data" / "4_toy"
    temps = leftover_temp_files(cache_folder, lambda target: target.endswith(".npz"))
    for temp in temps:
        past = time.time() - STALE_TEMP_SECONDS - 1
        os.utime(temp, (past, past))
    tally.leftovers_cleaned += len(temps)
    invalid = sum(not v for v in valid)
    if kind == "latents":
        remade = cs.cache_latents([group], _ConstantVAE(), latents, show_progress=False)
    else:
        remade = cs.cache_text_encoder_outputs([group], _constant_encoder, text, show_progress=False)
    tally.remade += remade
    tally.remade_wrong += remade != invalid
    tally.leftovers_after_cleanup += len(leftover_temp_files(cache_folder, lambda target: target.endswith(".npz")))


class _ConstantVAE:
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return torch.ones(images.shape[0], 32, images.shape[-2] // 8, images.shape[-1] // 8)


def _constant_encoder(captions: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.ones(5, 8), torch.ones(5, dtype=torch.bool)) for _ in captions]


# ---------------------------------------------------------------------------------------------------- main
def run_kind(setup: Setup, kind: str, trials: int, rng: random.Random) -> Tally:
    tally = Tally()
    base = {k: v.detach().clone().float() for k, v in setup.network.state_dict().items()}
    marker_key = next(k for k, v in setup.network.state_dict().items() if v.data_ptr() == setup.marker.data_ptr())
    probe = setup.root / f"probe_{kind}"
    probe.mkdir()
    if kind == "lora":
        tally.seconds_per_save = timed(lambda n: setup.save_lora(probe, n))
    elif kind.startswith("state"):
        tally.seconds_per_save = timed(lambda n: setup.save_state(probe, f"{NAME}-state", n))
    else:
        group, (latents, text) = setup.attach_caches(probe)
        saver = setup.save_latents if kind == "latents" else setup.save_te
        tally.seconds_per_save = timed(lambda n: saver(group, latents if kind == "latents" else text, n))
    for t in range(trials):
        folder = setup.root / f"{kind}_{t:03d}"
        folder.mkdir()
        kill_at = (rng.randrange(3), rng.uniform(0.0, 1.2 * tally.seconds_per_save))  # inside save 1, 2 or 3
        if kind == "lora":
            trial_lora(setup, folder, kill_at, tally, base, marker_key)
        elif kind == "state_new":
            trial_state_new(setup, folder, kill_at, tally, base, marker_key)
        elif kind == "state_overwrite":
            trial_state_overwrite(setup, folder, kill_at, tally, base, marker_key)
        else:
            trial_cache(setup, folder, kill_at, tally, kind)
        tally.trials += 1
        shutil.rmtree(folder, ignore_errors=True)
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10, help="trials per kind")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    p.add_argument("--snapshot", default=None, help="an existing tiny snapshot (built in a temp folder otherwise)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill delays")
    args = p.parse_args(argv)
    if not hasattr(os, "fork"):
        p.error("the trials fork and SIGKILL child processes: Linux or macOS only")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        p.error(f"unknown kinds {unknown}: choose from {', '.join(KINDS)}")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kill9_") as tmp:
        setup = Setup(Path(tmp), Path(args.snapshot) if args.snapshot else None)
        results = {kind: run_kind(setup, kind, args.trials, rng).__dict__ for kind in kinds}
    for tally in results.values():
        tally["notes"] = tally["notes"][:5]
        tally["seconds_per_save"] = round(tally["seconds_per_save"], 4)
    print(json.dumps({"trials_per_kind": args.trials, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
