"""Check `--vram_budget` on the GPU: for each budget, one trainer process capped at that memory trains a few steps
with the plan the trainer makes itself, and the measured peaks are compared with the plan's prediction.

    python -m bench.plan_verify --snapshot /tmp/full --root /tmp/pv --out $OUT        # H200, full-size snapshot
    python -m bench.plan_verify --tiny --root /tmp/pv --out /tmp/pv_out               # CPU: the tiny snapshot

Full size: the snapshot comes from `bench/make_full_snapshot.py` (`--what dit,te,vae`; made under --root when
--snapshot is not given). Two 1024 x 1024 images with captions are written once and their latents cached once with
`tools/cache_latents.py`; each run then gets a fresh copy of the images with those latents, and makes its own
text-encoder caches with the encoder variant of its plan, so that the caching phase runs under the cap too.

Each run is its own process (`--child`): it caps torch's allocator with `torch.cuda.set_per_process_memory_fraction`
at the budget minus the planner's CUDA-context allowance (what a card of that size leaves to torch), calls
`moss_image_train_network.main` with `--vram_budget` (the product's own entry point and planner), times every
training step (CUDA synchronised) and records `torch.cuda.max_memory_reserved` / `max_memory_allocated` before the
first step (startup) and after it (training). The report (`plan_verify.json` in --out) has per budget: the plan
(chosen candidate, options, predicted peak and phase), the measured peaks, the prediction error, whether it ran out
of memory, and the step times.

`--tiny` runs on the CPU: the planner's plan (tools/plan_memory.py, the same code the trainer calls) is applied to the
command line with the options that need CUDA left out, since the trainer refuses --vram_budget without a GPU; there is
no memory to measure. It checks the plumbing before device time is spent (tests/test_plan_verify.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
BUDGETS = "8,12,16,24,48"
CUDA_ONLY = {"--blocks_to_swap": 1, "--block_swap_h2d_only": 0, "--unsloth_offload_checkpointing": 0,
             "--cpu_offload_checkpointing": 0, "--te_quant": 1}  # option -> number of values it takes

logger = logging.getLogger("bench.plan_verify")


# ----------------------------------------------------------------------------------------------------- the child
def _child(args: argparse.Namespace, train_argv: list[str]) -> dict[str, Any]:
    """One capped training run in this process; returns the report of the run."""
    import torch

    import moss_image_train_network as trainer
    from library.errors import UserError
    from library.planning import run_options
    from library.planning.planner import CUDA_CONTEXT_GIB
    from library.training.network_trainer import NetworkTrainer

    report: dict[str, Any] = {"budget_gib": args.budget, "argv": train_argv, "oom": False, "error": None}
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        cap = (args.budget - CUDA_CONTEXT_GIB) * GIB
        if not args.no_cap:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
        report.update(cap_gib=None if args.no_cap else round(cap / GIB, 3), device_total_gib=round(total / GIB, 2))
    plans: list[Any] = []
    steps: list[float] = []
    step_peaks: list[float] = []  # max allocated since the first step began, read after each step
    peaks: dict[str, dict[str, float]] = {}

    def read_peaks(phase: str) -> None:
        if cuda:
            peaks[phase] = {"max_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
                            "max_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3)}

    real_apply = run_options.apply_vram_budget

    def capture_plan(*a: Any, **k: Any) -> Any:
        plan = real_apply(*a, **k)
        plans.append(plan)
        return plan

    real_step = NetworkTrainer._train_step

    def timed_step(self: Any, *a: Any, **k: Any) -> Any:
        if not steps and cuda:
            torch.cuda.synchronize()
            read_peaks("startup")
            report["static_allocated_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
            report["static_reserved_gib"] = round(torch.cuda.memory_reserved() / GIB, 3)
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = real_step(self, *a, **k)
        if cuda:
            torch.cuda.synchronize()
            step_peaks.append(round(torch.cuda.max_memory_allocated() / GIB, 3))
        steps.append(round(time.perf_counter() - t0, 4))
        return out

    trainer.apply_vram_budget = capture_plan
    NetworkTrainer._train_step = timed_step
    t0 = time.perf_counter()
    try:
        if args.tiny:
            from tools import plan_memory

            plan, _ = plan_memory.plan(["--vram_budget", str(args.budget), *train_argv])
            plans.append(plan)
            report["returncode"] = trainer.main([*train_argv, *_without_cuda_options(plan.options)])
        else:
            report["returncode"] = trainer.main([*train_argv, "--vram_budget", str(args.budget)])
    except UserError as e:  # the tiny plan's own refusal (the trainer prints its sentence and returns 2)
        report.update(returncode=2, error=str(e))
    except torch.cuda.OutOfMemoryError as e:
        report.update(returncode=1, oom=True, error=str(e).splitlines()[0])
    except Exception as e:  # noqa: BLE001 (the report must say what stopped the run)
        report.update(returncode=1, error=f"{type(e).__name__}: {e}"[:2000],
                      oom="out of memory" in str(e).lower())
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    read_peaks("training" if steps else "startup")
    if plans and plans[0] is not None:
        chosen = plans[0].to_dict()["chosen"]
        report["plan"] = {"chosen": chosen["candidate"], "options": list(plans[0].options),
                          "predicted_reserved_gib": chosen["predicted_reserved_gib"],
                          "predicted_allocated_gib": chosen["predicted_allocated_gib"],
                          "peak_phase": chosen["peak_phase"], "needs_gib": chosen["needs_gib"],
                          "relative_time": chosen["relative_time"], "lines": plans[0].lines()}
        training = plans[0].chosen.estimate.phase("training")
        report["plan"]["predicted_training_static_gib"] = round((training.allocated - training.activations) / GIB, 3)
        report["plan"]["predicted_training_activations_gib"] = round(training.activations / GIB, 3)
    report["steps_s"] = steps
    report["step_max_allocated_gib"] = step_peaks
    if len(steps) > 1:
        report["step_median_s"] = statistics.median(steps[1:])
    if peaks:
        report["peaks"] = peaks
        measured = max(p["max_reserved_gib"] for p in peaks.values())
        report["measured_max_reserved_gib"] = measured
        report["measured_max_allocated_gib"] = max(p["max_allocated_gib"] for p in peaks.values())
        if "plan" in report and measured:
            err = (report["plan"]["predicted_reserved_gib"] - measured) / measured
            report["reserved_prediction_error"] = round(err, 4)
            report["within_10pct"] = abs(err) <= 0.10
    return report


def _without_cuda_options(words: tuple[str, ...]) -> list[str]:
    out, skip = [], 0
    for w in words:
        if skip:
            skip -= 1
            continue
        if w in CUDA_ONLY:
            skip = CUDA_ONLY[w]
            continue
        out.append(w)
    return out


# ---------------------------------------------------------------------------------------------------- the parent
def _run(cmd: list[str], timeout: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})})


def _snapshot(args: argparse.Namespace) -> Path:
    if args.tiny:
        from library.moss_image.tiny_snapshot import build_tiny_snapshot

        return build_tiny_snapshot(Path(args.root) / "tiny")
    if args.snapshot:
        return Path(args.snapshot)
    snap = Path(args.root) / "snapshot"
    if not (snap / "vae").is_dir():
        proc = _run([sys.executable, "-m", "bench.make_full_snapshot", str(snap), "--what", "dit,te,vae"], timeout=900)
        if proc.returncode:
            raise SystemExit(f"make_full_snapshot failed:\n{proc.stderr[-3000:]}")
    return snap


def _caption(i: int) -> str:
    return f"A studio photograph of a {('red', 'blue', 'green')[i % 3]} cube on a grey table, soft light, number {i}."


def _data(args: argparse.Namespace, snap: Path) -> Path:
    """The images with their captions and cached latents, made once (an image folder in the kohya layout)."""
    import numpy as np
    from PIL import Image

    folder = Path(args.root) / "data" / "1_pv"
    if any(folder.glob("*_moss.npz")):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(args.images):
        img = rng.integers(0, 255, (args.resolution, args.resolution, 3), dtype=np.uint8)
        Image.fromarray(img).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(_caption(i), encoding="utf-8")
    proc = _run([sys.executable, "-m", "tools.cache_latents", "--moss_image", "--vae", str(snap / "vae"),
                 "--train_data_dir", str(folder.parent), "--resolution", str(args.resolution), "--caption_extension",
                 ".txt", "--cache_latents_to_disk", "--device", "cpu" if args.tiny else "cuda"], timeout=600)
    if proc.returncode:
        raise SystemExit(f"cache_latents failed:\n{proc.stderr[-3000:]}")
    return folder


def _train_argv(args: argparse.Namespace, snap: Path, data: Path, out: Path) -> list[str]:
    return [
        "--snapshot", str(snap), "--train_data_dir", str(data.parent), "--resolution", str(args.resolution),
        "--caption_extension", ".txt", "--output_dir", str(out), "--output_name", "pv",
        "--network_module", "networks.lora_generic", "--network_dim", "16", "--network_alpha", "16",
        "--network_train_unet_only", "--optimizer_type", "AdamW", "--learning_rate", "1e-4",
        "--max_train_steps", str(args.steps), "--seed", "1", "--mixed_precision", "bf16",
        "--cache_latents", "--cache_latents_to_disk", "--cache_text_encoder_outputs",
        "--cache_text_encoder_outputs_to_disk", "--max_data_loader_n_workers", "0", "--save_model_as", "safetensors",
        *(["--cuda_expandable_segments"] if args.expandable else []),
    ]


def _fresh_copy(data: Path, where: Path) -> Path:
    """The images, captions and latent caches, without text-encoder caches (each run makes its own)."""
    if where.exists():
        shutil.rmtree(where)
    shutil.copytree(data.parent, where, ignore=shutil.ignore_patterns("*_moss_te.npz"))
    return where / data.name


def verify(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    snap = _snapshot(args)
    data = _data(args, snap)
    report: dict[str, Any] = {"snapshot": str(snap), "resolution": args.resolution, "steps": args.steps,
                              "tiny": args.tiny, "runs": []}
    for budget in [float(b) for b in args.budgets.split(",")]:
        if time.perf_counter() - started > args.time_limit_s:
            report["runs"].append({"budget_gib": budget, "skipped": f"time limit {args.time_limit_s} s reached"})
            continue
        label = f"budget_{budget:g}"
        run_data = _fresh_copy(data, Path(args.root) / "runs" / label / "data")
        js = out / f"{label}.json"
        cmd = [sys.executable, "-m", "bench.plan_verify", "--child", str(js), "--budget", str(budget),
               *(["--tiny"] if args.tiny else []), *(["--no_cap"] if args.no_cap else []), "--",
               *_train_argv(args, snap, run_data, Path(args.root) / "runs" / label / "out")]
        t0 = time.perf_counter()
        try:
            proc = _run(cmd, timeout=args.run_timeout_s)
            tail = (proc.stdout + proc.stderr)[-4000:]
            code = proc.returncode
        except subprocess.TimeoutExpired:
            tail, code = f"timed out after {args.run_timeout_s} s", -1
        (out / f"{label}.log").write_text(tail)
        run = json.loads(js.read_text()) if js.exists() else {"budget_gib": budget, "error": tail[-2000:]}
        run.update(process_returncode=code, process_wall_s=round(time.perf_counter() - t0, 1))
        report["runs"].append(run)
        logger.info("budget %g GiB: %s", budget, _one_line(run))
    report["wall_s"] = round(time.perf_counter() - started, 1)
    path = out / "plan_verify.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)
    return report


def _one_line(run: dict[str, Any]) -> str:
    plan = run.get("plan", {})
    return (f"{plan.get('chosen', '-')} | predicted {plan.get('predicted_reserved_gib', '-')} GiB, measured"
            f" {run.get('measured_max_reserved_gib', '-')} GiB | oom {run.get('oom')} | step"
            f" {run.get('step_median_s', '-')} s | rc {run.get('returncode', run.get('process_returncode'))}"
            + (f" | {run['error'][:200]}" if run.get("error") else ""))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_argv: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_argv = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description="--vram_budget on the GPU: capped trainer runs against the plan")
    p.add_argument("--root", default="/tmp/plan_verify", help="work folder (snapshot, data, runs)")
    p.add_argument("--out", default="/tmp/plan_verify_out", help="folder of the JSON reports")
    p.add_argument("--snapshot", default=None, help="a full-size snapshot (bench/make_full_snapshot.py)")
    p.add_argument("--budgets", default=BUDGETS, help="GiB, comma separated")
    p.add_argument("--steps", type=int, default=4, help="training steps per run")
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--resolution", type=int, default=None, help="default 1024 (64 with --tiny)")
    p.add_argument("--time_limit_s", type=int, default=330, help="no new run starts after this")
    p.add_argument("--run_timeout_s", type=int, default=240)
    p.add_argument("--tiny", action="store_true", help="the tiny snapshot on the CPU (plumbing check)")
    p.add_argument("--no_cap", action="store_true",
                   help="do not cap the allocator: measure each plan's real peak (an OOM under the cap hides it)")
    p.add_argument("--expandable", action="store_true",
                   help="train with --cuda_expandable_segments (the plan then counts on its smaller slack)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.child:
        report = _child(args, train_argv)
        Path(args.child).write_text(json.dumps(report, indent=1))
        return 0
    if args.resolution is None:
        args.resolution = 64 if args.tiny else 1024
    report = verify(args)
    print(json.dumps([{k: r.get(k) for k in ("budget_gib", "plan", "measured_max_reserved_gib",
                                               "reserved_prediction_error", "oom", "step_median_s", "error")}
                      for r in report["runs"]], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
