"""The bitsandbytes paths through the trainer on a CUDA GPU: `--te_quant int8/nf4` and the 8-bit optimizers.

    python -m bench.bnb_cuda --out bnb_cuda.json        # needs CUDA and bitsandbytes

On the embedded tiny snapshot (the code paths, not the speed): for each case one training run of a few steps with
the text encoder quantised by bitsandbytes while it caches its outputs, and the optimizer under test; reported per
case: exit status, the text-encoder cache variant the run recorded, the first and last training loss, whether the
saved LoRA is finite, and the seconds. The losses must be finite and the LoRA must have changed from its start.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

import moss_image_train_network as trainer
from library.moss_image.tiny_snapshot import build_tiny_snapshot
from tools.demo import write_dataset

CASES = {
    "adamw8bit_te_int8": ("AdamW8bit", "int8"),
    "paged_adamw8bit_te_nf4": ("PagedAdamW8bit", "nf4"),
    "lion8bit_te_none": ("Lion8bit", "none"),
}


def run_case(name: str, optimizer: str, te_quant: str, snapshot: Path, work: Path) -> dict[str, Any]:
    config = write_dataset(work / f"data_{name}", n=4)  # images/ and dataset.toml
    data = config.parent / "images"
    out = work / f"out_{name}"
    argv = ["--snapshot", str(snapshot), "--dataset_config", str(config), "--output_dir", str(out),
            "--output_name", name, "--network_module", "networks.lora_generic", "--network_dim", "4",
            "--network_train_unet_only", "--optimizer_type", optimizer, "--learning_rate", "1e-3",
            "--max_train_steps", "6", "--seed", "1", "--mixed_precision", "bf16", "--te_quant", te_quant,
            "--cache_latents", "--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk",
            "--max_data_loader_n_workers", "0"]
    start = time.perf_counter()
    res: dict[str, Any] = {"optimizer": optimizer, "te_quant": te_quant}
    try:
        run = trainer.MossImageNetworkTrainer().train(trainer.setup_parser().parse_args(argv))
    except Exception as exc:  # reported, the next case still runs
        return res | {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000],
                      "traceback": traceback.format_exc()[-3000:]}
    res["seconds"] = round(time.perf_counter() - start, 1)
    losses = [float(v) for v in run.loss_history]
    lora = load_file(str(out / f"{name}.safetensors"))
    res["lora_finite"] = all(bool(torch.isfinite(t.float()).all()) for t in lora.values())
    ups = [t.float().abs().max().item() for k, t in lora.items() if k.endswith("lora_up.weight")]
    res["lora_up_max"] = max(ups) if ups else None  # lora_up starts at zero: non-zero means it trained
    te_files = sorted(data.glob("*_moss_te.npz"))
    if te_files:
        with np.load(te_files[0]) as z:
            res["te_cache_keys"] = sorted(z.files)[:12]
            res["te_variant"] = str(z["encoder"]) if "encoder" in z.files else None
    if losses:
        res["loss_first"], res["loss_last"] = losses[0], losses[-1]
    res["ok"] = res["lora_finite"] and bool(res["lora_up_max"])
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bnb_cuda", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.bnb_cuda needs a CUDA GPU")
    import bitsandbytes  # noqa: F401  (optional dependency: the benchmark is about it)

    results: dict[str, Any] = {"bitsandbytes": bitsandbytes.__version__, "torch": torch.__version__, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="bnb_cuda_") as tmp:
        work = Path(tmp)
        snapshot = build_tiny_snapshot(work / "snap")
        for name in args.cases.split(","):
            optimizer, te_quant = CASES[name]
            results["cases"][name] = run_case(name, optimizer, te_quant, snapshot, work)
            print(name, json.dumps(results["cases"][name])[:400], flush=True)
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0 if all(c.get("ok") for c in results["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
