"""The training step's own generator for the random numbers it draws on the host.

The step draws its timesteps (and `--ip_noise_gamma_random_strength`'s factor) from a CPU generator of its own, not
from torch's global one. Compiled code may draw on the global generator: on CUDA, AOTAutograd's graph-safe RNG
functionalisation seeds a private generator for each random operator that a checkpointed compiled graph recomputes
(attention is tagged random), with `torch.randint` on the global CPU generator, at the first run of each such graph.
With the timesteps on the global generator, a compiled run would draw other timesteps than an eager one, and a resumed
run, which compiles again, other ones than the uninterrupted run. With their own generator, `--compile` keeps torch's
default functionalisation (the graph-safe one, which the CUDA-graph modes need) and the timesteps stay those of eager
mode. The LoRA modules' `module_dropout` decisions stay on the global generator: they are drawn inside the
checkpointed blocks, and checkpointing restores only torch's own generators before it recomputes a block.

The generator is seeded from `--seed` and the process index (each process of a multi-GPU run draws its own
timesteps), and saved in the state folder beside accelerate's random states, one safetensors file per process.
"""

from __future__ import annotations

from pathlib import Path

import torch

HOST_RANDOM_FILE = "host_random_{index}.safetensors"
_KEY = "cpu_generator_state"
_SEED_SALT = 0x5DEECE66D  # keeps the stream apart from the global generator's, which --seed also seeds


def new_host_generator(seed: int, process_index: int = 0) -> torch.Generator:
    """The step's host generator of process `process_index` for `--seed` `seed`."""
    return torch.Generator().manual_seed((int(seed) ^ _SEED_SALT) + 7919 * int(process_index))


def host_random_path(folder: Path, process_index: int) -> Path:
    return folder / HOST_RANDOM_FILE.format(index=process_index)


def save_host_generator(generator: torch.Generator, folder: Path, process_index: int) -> None:
    """Write the generator's state into a state folder being written (state_io seals and renames the folder)."""
    from safetensors.torch import save_file

    save_file({_KEY: generator.get_state()}, str(host_random_path(folder, process_index)))


def _read_state(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    state = load_file(str(path))[_KEY]
    reference = torch.Generator().get_state()
    if state.dtype != reference.dtype or state.shape != reference.shape:
        raise ValueError(f"a {tuple(state.shape)} {state.dtype} state, not a CPU generator's")
    return state


def host_random_problem(folder: Path, process_index: int) -> str | None:
    """Why `folder` cannot restore this process's host generator (None when it can)."""
    path = host_random_path(folder, process_index)
    if not path.is_file():
        return (f"the step's random state {path.name} is missing (a state of an earlier version, which drew the"
                " timesteps on torch's global generator)")
    try:
        _read_state(path)
    except Exception as e:  # a truncated or foreign file
        return f"the step's random state {path.name} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None


def load_host_generator(generator: torch.Generator, folder: Path, process_index: int) -> bool:
    """Restore the generator from a state folder; False (generator untouched) when the file is missing or
    unreadable, which `check_resume` has reported already (an error, or a warning with --resume_inexact)."""
    try:
        state = _read_state(host_random_path(folder, process_index))
    except Exception:  # noqa: BLE001 (reported by host_random_problem)
        return False
    generator.set_state(state)
    return True
