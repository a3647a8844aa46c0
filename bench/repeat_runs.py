"""Does a run give the same LoRA when it is repeated in the same process? The tiny snapshot trained `--runs` times in
one process with the same options and seed; each run's LoRA file is compared with the last run's (the largest
difference of any tensor, relative to that tensor's largest value), with the switches of the eager step (the fused
element-wise kernels, the one-node LoRA) set as given.

    python -m bench.repeat_runs --runs 3 --out repeat.json                                   # where the trainer runs
    python -m bench.repeat_runs --runs 3 --no_kernels --out repeat.json                      # without the kernels
    python -m bench.repeat_runs --runs 3 --no_direct_launch --out repeat.json                # Triton's launches only
    python -m bench.repeat_runs --runs 2 --policies full,selective --out repeat.json         # alternating policies

A step is deterministic on one device, so every run should match: a first run that differs from the later ones
points at something the process does once (a first kernel launch, a lazily chosen algorithm), which a comparison of
two runs in one process (the checkpointing tests do that) would take for a difference between the configurations.
Each run's losses and the largest difference of its cached latents and text-encoder outputs from the last run's say
where a difference starts: in the cached inputs, in the first step, or later.
The runs use fp32, 3 steps at lr 1e-2 (AdamW's first steps move every weight by about the learning rate, so a
last-bit difference in a gradient near zero shows as a difference of order 1 in that weight).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from library.files.safetensors_io import load_safetensors
from library.lora import eager_node
from library.moss_image.tiny_snapshot import build_tiny_snapshot
from library.quant import triton_launch
from library.runtime import fused_ops
from tools.demo import write_dataset


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in `value`, a tensor or nested lists / tuples of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _cached_inputs(run: Any) -> dict[str, torch.Tensor]:
    """The cached latents and text-encoder outputs a run trained on, by image path (in-memory caches)."""
    found: dict[str, torch.Tensor] = {}
    for dataset in run.train_group.datasets:
        for info in dataset.image_infos:
            for name in ("latents", "text_encoder_outputs"):
                for j, t in enumerate(_tensors(getattr(info, name))):
                    found[f"{info.absolute_path}:{name}:{j}"] = t.detach().float().cpu()
    return found


def _train(snapshot: Path, config: Path, out: Path, policy: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One run of the trainer on the dataset `config` (on the GPU where there is one): its LoRA, and its losses and
    cached inputs."""
    from accelerate.state import AcceleratorState

    import moss_image_train_network as trainer

    AcceleratorState._reset_state(reset_partial_state=True)  # one process, several runs
    argv = ["--snapshot", str(snapshot), "--dataset_config", str(config), "--output_dir", str(out), "--output_name",
            "toy", "--network_module", "networks.lora_generic", "--network_dim", "4", "--network_train_unet_only", "--seed", "7", "--max_data_loader_n_workers", "0", "--cache_latents",
            "--cache_text_encoder_outputs", "--max_train_steps", "3", "--learning_rate", "1e-2",
            "--gradient_checkpointing", "--checkpointing_policy", policy]
    run = trainer.MossImageNetworkTrainer().train(trainer.setup_parser().parse_args(argv))
    return load_safetensors(out / "toy.safetensors"), {"losses": list(run.loss_history),
                                                        "inputs": _cached_inputs(run)}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a - b| of any tensor, relative to that tensor's largest |b|."""
    return max((float((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp_min(1e-12))
                for k in b), default=0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.repeat_runs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--policies", default="full", help="checkpointing policies, used in turn (full, selective)")
    p.add_argument("--no_kernels", action="store_true", help="the fused element-wise kernels off from the start")
    p.add_argument("--lora_ops", action="store_true", help="the LoRA as separate operators (not one node)")
    p.add_argument("--no_direct_launch", action="store_true",
                   help="every Triton launch through Triton's own launch path (no direct launches)")
    p.add_argument("--out", type=Path, required=True)
    ns = p.parse_args(argv)
    policies = [s.strip() for s in ns.policies.split(",") if s.strip()]
    if ns.runs < 2 or not policies or any(s not in ("full", "selective") for s in policies):
        print("--runs must be at least 2 and --policies a list of full and selective", file=sys.stderr)
        return 2
    kernels = fused_ops.set_fused_kernels(not ns.no_kernels)
    one_node = eager_node.set_lora_one_node(not ns.lora_ops)
    direct = triton_launch.direct_launch_enabled()
    triton_launch.set_direct_launch(not ns.no_direct_launch)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            snapshot = build_tiny_snapshot(root / "snapshot")
            config = write_dataset(root / "data", n=2)  # the demo's images and dataset.toml
            results = [_train(snapshot, config, root / f"run{i}", policies[i % len(policies)])
                       for i in range(ns.runs)]
    finally:
        fused_ops.set_fused_kernels(kernels)
        eager_node.set_lora_one_node(one_node)
        triton_launch.set_direct_launch(direct)
    last_file, last = results[-1]
    runs: list[dict[str, Any]] = [
        {"run": i, "policy": policies[i % len(policies)], "vs_last_run": largest_difference(f, last_file),
         "cached_inputs_vs_last_run": largest_difference(extra["inputs"], last["inputs"]),
         "cached_tensors": len(extra["inputs"]), "losses": extra["losses"]}
        for i, (f, extra) in enumerate(results)]
    command = ["python", "-m", "bench.repeat_runs", *(argv if argv is not None else sys.argv[1:])]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    payload = {"command": " ".join(command), "device": device, "torch": torch.__version__,
               "kernels": not ns.no_kernels, "one_node": not ns.lora_ops, "direct_launch": not ns.no_direct_launch,
               "runs": runs}
    tmp_out = ns.out.with_name(f".{ns.out.name}.tmp")
    tmp_out.write_text(json.dumps(payload, indent=1))
    tmp_out.replace(ns.out)
    for r in runs:
        print(f"run {r['run']} ({r['policy']}): {r['vs_last_run']:.3e} against the last run (cached inputs"
              f" {r['cached_inputs_vs_last_run']:.3e}; losses {r['losses']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
