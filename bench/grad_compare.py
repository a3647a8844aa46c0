#!/usr/bin/env python
"""Do two checkpointing configurations train alike? The trainer's own steps (as `bench.checkpointing` sets them up:
same inputs, noise and initial LoRA) run in one process per configuration; after each of `--steps` steps the loss
and every LoRA gradient are recorded, then the configurations are compared step by step against the first one:
loss difference, relative norm difference of all gradients together, and the parameters that differ most.

    python -m bench.make_full_snapshot /tmp/full --what dit
    python -m bench.grad_compare --snapshot /tmp/full --configs gc_full_eager,gc_full_compile --out grads.json
    python -m bench.grad_compare --tiny --configs gc_full_eager,gc_full_compile --out tiny.json   # the CPU

A step is the trainer's `process_batch` and the accelerator's backward, then (except after the last step) the
optimizer and scheduler steps exactly as `_train_step` does them; the gradients are read between the backward and the
optimizer step. bf16 rounding aside, two configurations that compute the same thing agree to about 1e-2 in the
gradients' relative norm difference; a larger figure at one step while the earlier ones agree points at that step.
Each step also records a digest of the state of the step's own host generator before it (the timesteps are drawn
there, `library.training.host_random`): two configurations whose digests part at a step draw other timesteps from it
on, whatever their gradients. The digest of torch's global CPU generator is recorded beside it: compiled code may draw
there (the graph-safe RNG functionalisation seeds its generators with it), which no longer changes the timesteps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from bench import checkpointing as ckpt


def record(name: str, snapshot: Path, shape: Any, steps: int, out: Path) -> dict[str, Any]:
    """Run `steps` trainer steps of configuration `name`; write each step's gradients to `out`/step<i>.safetensors and
    return the losses."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp, ckpt.bench_variant(name):
        trainer, run, batch = ckpt.build(snapshot, ckpt.CONFIGS[name], shape, Path(tmp), steps + 1)
        run.train_dataloader = [batch]
        params = dict(run.network.named_parameters())
        losses, cpu_rng, host_rng = [], [], []
        for step in range(steps):
            cpu_rng.append(_digest(torch.get_rng_state()))
            host_rng.append(_digest(run.host_generator.get_state()))
            run.train_group.set_current_step(run.global_step)
            with run.accelerator.accumulate():
                loss = trainer.process_batch(run, batch, is_train=True)
                run.accelerator.backward(loss)
                grads = {n: p.grad.detach().float().cpu().contiguous() for n, p in params.items() if p.grad is not None}
                save_file(grads, str(out / f"step{step}.safetensors"))
                losses.append(float(loss.detach()))
                if step + 1 < steps:
                    if run.args.max_grad_norm and run.args.max_grad_norm > 0:
                        run.accelerator.clip_grad_norm_(run.network.get_trainable_params(), run.args.max_grad_norm)
                    run.optimizer.step()
                    run.lr_scheduler.step()
                    run.optimizer.zero_grad(set_to_none=True)
            run.global_step += 1
    return {"config": name, "losses": losses, "host_rng_before_step": host_rng, "cpu_rng_before_step": cpu_rng}


def _digest(state: torch.Tensor) -> str:
    return hashlib.sha1(state.numpy().tobytes()).hexdigest()[:12]


def compare(ref_dir: Path, other_dir: Path, steps: int, top: int = 8) -> list[dict[str, Any]]:
    rows = []
    for step in range(steps):
        a = load_file(str(ref_dir / f"step{step}.safetensors"))
        b = load_file(str(other_dir / f"step{step}.safetensors"))
        if a.keys() != b.keys():
            rows.append({"step": step, "error": f"different gradient sets: {sorted(set(a) ^ set(b))[:5]}"})
            continue
        diff2 = sum(float((b[k] - a[k]).pow(2).sum()) for k in a)
        ref2 = sum(float(a[k].pow(2).sum()) for k in a)
        per = sorted(((float((b[k] - a[k]).norm() / a[k].norm().clamp(min=1e-30)), k) for k in a), reverse=True)
        rows.append({"step": step, "grad_rel_diff": (diff2 / max(ref2, 1e-30)) ** 0.5,
                     "worst": [{"param": k, "rel_diff": round(v, 6)} for v, k in per[:top]]})
    return rows


def _child(name: str, ns: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.grad_compare", "--single", name, "--grads", str(out), "--steps", str(ns.steps),
           *(["--tiny"] if ns.tiny else []), *(["--snapshot", str(ns.snapshot)] if ns.snapshot else [])]
    result, error = ckpt.run_child(cmd, ns.timeout_s)
    return result if result is not None else {"config": name, "error": error}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grad_compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--snapshot", type=Path, default=None, help="snapshot folder (bench/make_full_snapshot.py)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (the tiny snapshot unless --snapshot)")
    p.add_argument("--configs", default="gc_full_eager,gc_full_compile",
                   help=f"comma-separated, the first is the reference, of {', '.join(ckpt.CONFIGS)}")
    p.add_argument("--steps", type=int, default=4, help="steps per configuration")
    p.add_argument("--out", type=Path, default=Path("grad_compare.json"), help="JSON results")
    p.add_argument("--timeout_s", type=float, default=300, help="limit per configuration (its own process)")
    p.add_argument("--single", default=None, help=argparse.SUPPRESS)
    p.add_argument("--grads", type=Path, default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    names = [n.strip() for n in ns.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in ckpt.CONFIGS]
    if unknown or len(names) < 2:
        print(f"give two or more of {', '.join(ckpt.CONFIGS)} (unknown: {unknown})", file=sys.stderr)
        return 2
    if not ns.tiny and not torch.cuda.is_available():
        print("bench.grad_compare needs a CUDA GPU (or --tiny for the CPU)", file=sys.stderr)
        return 2
    shape = ckpt.Shape(**vars(ckpt.TINY if ns.tiny else ckpt.FULL))
    with tempfile.TemporaryDirectory() as tmp:
        if ns.tiny and ns.snapshot is None:
            from library.moss_image.tiny_snapshot import build_tiny_snapshot

            ns.snapshot = build_tiny_snapshot(Path(tmp) / "moss-image-tiny")
        if ns.single:
            torch.set_num_threads(1) if ns.tiny else None
            print("RESULT " + json.dumps(record(ns.single, ns.snapshot, shape, ns.steps, ns.grads)), flush=True)
            return 0
        if ns.snapshot is None:
            print("give --snapshot (bench/make_full_snapshot.py writes one) or --tiny", file=sys.stderr)
            return 2
        results = []
        for name in names:
            folder = Path(tmp) / name
            folder.mkdir()
            r = _child(name, ns, folder)
            r["folder"] = folder
            results.append(r)
        ref = results[0]
        payload: dict[str, Any] = {
            "command": " ".join(["python", "-m", "bench.grad_compare", *(argv if argv is not None else sys.argv[1:])]),
            "device": torch.cuda.get_device_name() if not ns.tiny else "cpu", "reference": ref["config"],
            "results": []}
        for r in results:
            entry = {k: v for k, v in r.items() if k != "folder"}
            if "error" not in r and "error" not in ref and r is not ref:
                entry["steps"] = compare(ref["folder"], r["folder"], ns.steps)
                entry["loss_diff"] = [b - a for a, b in zip(ref["losses"], r["losses"])]
                for key in ("host_rng_before_step", "cpu_rng_before_step"):
                    entry[f"same_{key}"] = [a == b for a, b in zip(ref[key], r[key])]
            payload["results"].append(entry)
    tmp_out = ns.out.with_name(f".{ns.out.name}.tmp")
    tmp_out.write_text(json.dumps(payload, indent=1))
    os.replace(tmp_out, ns.out)
    print(json.dumps(payload, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
