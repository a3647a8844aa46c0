"""Load times of the text encoder and the DiT from the page cache, the staged path against the per-tensor one.

    python -m bench.make_full_snapshot /tmp/full --what dit,te,vae
    python3 -m bench.loading --snapshot /tmp/full --out loading.json
    python -m bench.loading --tiny --out tiny.json        # the tiny snapshot, on the CPU when there is no GPU

Run from the repository root. The files are read once first (page cache warm). The text encoder's model code
(transformers' Qwen3.5 modules, accelerate, the linear-attention kernels) is imported in this process before any
timing (`te_model_code_import_s`), so that no timed load pays it (the first load of a process does:
`te_fresh_process`; `import_transformers_s` is what torch + that import cost a fresh interpreter). Then, each timed
with the device synchronised at both ends, in this process:

- `read_floor`: every tensor of the DiT and of the text-model part of the encoder read to the device and dropped (no
  model): the staged reads (`TensorSource.iter_tensors`) against `get_tensor(key).to(device)` per tensor, and a
  sweep of the staged reader's thread count and chunk size over the DiT;
- `te`: `library.text_encoder.loading.load_text_encoder` (what the scripts call: bf16, --te_quant none) onto the
  device; `te_fresh_process`: the same as the first load of a new process (imports and CUDA context included, split
  out);
- `dit`: `load_moss_image_model` in bf16 onto the device;
- `dit_lora`: the same with a rank-16 LoRA on every block Linear (a random file written next to the output) merged at
  load (`LoraMergePlan`, reading the LoRA file included): the new path merges on the GPU, the old one on the CPU;
- `dit_cpu_home`: the DiT read to the CPU (what --convrot_int8 and --blocks_to_swap do), no LoRA: memory-mapped,
  nothing copied;
- `dit_lora_cpu_home`: the same with the merge, on the GPU (`LoraMergePlan(device=...)`: the targeted weights go
  there and back by blocks of rows through pinned buffers, the others stay memory-mapped) against the CPU.

Each pair runs `--repeats` times (default 2), the order alternating (new, old, then old, new, ...); `new_s` /
`old_s` are the best runs, `*_runs_s` all of them, and `*_split` the best run's parts: `sync_s` (the final
synchronize), the staged reads' host time (`library.files.safetensors_io.STREAM_TIMES`: setup, read_wait, copy,
consumer = the loader's work between two tensors, drain) and, for the merges, the plan's (`LoraMergePlan.times`:
merge_s in all, and for a CPU weight merged on the GPU copy_in, device_wait, copy_out).

"new" is the product's path; "old" is the per-tensor path reached with `safetensors_io.DIRECT_DEVICE_READS = False`
and a merge plan without a device: the code before the staged reads, except that its CPU merge is today's (by blocks
of rows, about twice as fast as the whole-tensor passes it replaced). Each new/old pair is compared tensor by tensor:
`equal` for the plain loads (bit for bit), and for the merges the count of elements that differ (a GPU fp32 GEMM
sums in another order than the CPU's, so an element may round to the next bf16 value) and the largest difference.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from library.files import safetensors_io
from library.files.safetensors_io import save_file_atomic
from library.lora.conventions import lora_name_for_weight
from library.lora.merge import LoraMergePlan, load_lora_files
from library.moss_image.loaders import dit_checkpoint_files, load_moss_image_model, open_dit_source
from library.text_encoder.kernels import route_linear_attention_kernels
from library.text_encoder.loading import TextEncoderOptions, load_text_encoder
from library.text_encoder.qwen35 import open_text_encoder_source

LORA_RANK = 16
_READ_CHUNK = 64 * 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    value = fn()
    _sync(device)
    return time.perf_counter() - start, value


Load = Callable[[str], tuple[torch.nn.Module, dict[str, Any]]]  # "new"/"old" -> (model, the load's own split)


def _run_once(device: torch.device, load: Load, which: str) -> tuple[dict[str, Any], torch.nn.Module]:
    """One timed load on the `which` path: its seconds and their split (see the module docstring), and the model."""
    safetensors_io.STREAM_TIMES.reset()
    with ReadPath(which):
        _sync(device)
        start = time.perf_counter()
        model, extra = load(which)
        returned = time.perf_counter()
        _sync(device)
        end = time.perf_counter()
    split: dict[str, Any] = {"s": round(end - start, 3), "sync_s": round(end - returned, 4)}
    if safetensors_io.STREAM_TIMES.calls:
        split["stream"] = safetensors_io.STREAM_TIMES.as_dict()
    split.update(extra)
    return split, model


def import_model_code() -> float:
    """Import the text encoder's model code here (what the first `load_text_encoder` of a process imports), so that
    no timed load pays it; returns the seconds it took."""
    start = time.perf_counter()
    route_linear_attention_kernels()  # transformers' Qwen3.5 modules (and fla, when installed)
    from accelerate import init_empty_weights  # noqa: F401  heavy: imported here for its import time only
    from transformers import Qwen3_5TextModel  # noqa: F401  heavy: imported here for its import time only

    return round(time.perf_counter() - start, 3)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def import_seconds() -> float:
    """Seconds a fresh interpreter takes to import torch + transformers' Qwen3.5 model code (the first text encoder
    load of a process pays it; here it is imported before the timed loads)."""
    code = ("import time; s = time.perf_counter(); import torch; from transformers import Qwen3_5TextModel; "
            "print(time.perf_counter() - s)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    try:
        return round(float(done.stdout.strip().splitlines()[-1]), 3)
    except (ValueError, IndexError):
        return -1.0


_FRESH = """
import json, sys, time
start = time.perf_counter()
import torch
from library.files import safetensors_io
from library.text_encoder.loading import TextEncoderOptions, load_text_encoder
from library.text_encoder.kernels import route_linear_attention_kernels
route_linear_attention_kernels()  # the loader's first call would import transformers' model code (and fla) here
imported = time.perf_counter()
safetensors_io.DIRECT_DEVICE_READS = sys.argv[2] == "new"
device = torch.device(sys.argv[3])
if device.type == "cuda":
    torch.empty(1, device=device)
ready = time.perf_counter()
model = load_text_encoder(TextEncoderOptions(path=sys.argv[1]), device).model
if device.type == "cuda":
    torch.cuda.synchronize(device)
done = time.perf_counter()
print(json.dumps({"imports_s": round(imported - start, 3), "cuda_init_s": round(ready - imported, 3),
                  "load_s": round(done - ready, 3), "total_s": round(done - start, 3)}))
"""


def fresh_process_te(te_path: Path, device: torch.device) -> dict[str, Any]:
    """The first text encoder load of a new process (what the inference script's `text_encoder_load` phase pays,
    its tokenizer aside): the project's and transformers' imports (the loader imports the model code on its first
    call), the CUDA context, the load; new and old path, each in its own process."""
    out: dict[str, Any] = {}
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    for which in ("new", "old"):
        done = subprocess.run([sys.executable, "-c", _FRESH, str(te_path), which, str(device)], capture_output=True,
                              text=True, timeout=300, check=False, cwd=root, env=env)
        try:
            out[which] = json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out[which] = {"error": (done.stderr or done.stdout)[-2000:]}
    return out


def warm_page_cache(files: list[Path]) -> dict[str, float]:
    """Read every file once (plain reads, dropped): the timed loads then read from the page cache."""
    start = time.perf_counter()
    total = 0
    buffer = bytearray(_READ_CHUNK)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return {"bytes": total, "seconds": round(time.perf_counter() - start, 3)}


class ReadPath:
    """Switch between the product's path ("new") and the per-tensor one ("old") for the duration of a block."""

    def __init__(self, which: str):
        self.which = which
        self.before = safetensors_io.DIRECT_DEVICE_READS

    def __enter__(self) -> None:
        safetensors_io.DIRECT_DEVICE_READS = self.which == "new"

    def __exit__(self, *exc: object) -> None:
        safetensors_io.DIRECT_DEVICE_READS = self.before


def read_all(source: Any, device: torch.device) -> int:
    """Every tensor of `source` to `device`, dropped one by one; returns the bytes read."""
    total = 0
    with source:
        for _, tensor in source.iter_tensors(source.keys(), device):
            total += tensor.numel() * tensor.element_size()
    return total


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


def read_floor(snapshot: Path, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for what, opener in (("dit", lambda: open_dit_source(dit_checkpoint_files(snapshot / "transformer")[0]).source),
                         ("te", lambda: open_text_encoder_source(snapshot / "text_encoder")[0])):
        for which in ("new", "old"):
            with ReadPath(which):
                seconds, nbytes = _timed(device, lambda o=opener: read_all(o(), device))
            out[f"{what}_{which}_s"] = round(seconds, 3)
            out[f"{what}_{which}_GBps"] = _gbps(nbytes, seconds)
            _free(device)
    return out


def sweep(snapshot: Path, device: torch.device, threads: list[int], chunks_mib: list[int]) -> list[dict[str, Any]]:
    """The staged reader over the DiT with other thread counts and chunk sizes (the defaults are restored)."""
    if device.type != "cuda":
        return []
    saved = (safetensors_io.READ_THREADS, safetensors_io.STAGING_BYTES, safetensors_io.STAGING_BUFFERS)
    rows = []
    try:
        for t in threads:
            for c in chunks_mib:
                safetensors_io.READ_THREADS = t
                safetensors_io.STAGING_BUFFERS = max(t, 2)
                safetensors_io.STAGING_BYTES = c * 2**20
                source = open_dit_source(dit_checkpoint_files(snapshot / "transformer")[0]).source
                seconds, nbytes = _timed(device, lambda s=source: read_all(s, device))
                rows.append({"threads": t, "chunk_mib": c, "seconds": round(seconds, 3),
                             "GBps": _gbps(nbytes, seconds)})
                _free(device)
    finally:
        safetensors_io.READ_THREADS, safetensors_io.STAGING_BYTES, safetensors_io.STAGING_BUFFERS = saved
    return rows


def write_lora(snapshot: Path, path: Path, rank: int = LORA_RANK) -> tuple[Path, int]:
    """A random rank-`rank` LoRA (bf16, alpha = rank) on every 2-D block weight of the snapshot's DiT."""
    source = open_dit_source(dit_checkpoint_files(snapshot / "transformer")[0])
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for key in source.keys():
        shape = source.shape(key)
        if not key.startswith("layers.") or len(shape) != 2 or not key.endswith(".weight"):
            continue
        name = lora_name_for_weight("lora_unet", key)
        out_f, in_f = shape
        sd[f"{name}.lora_down.weight"] = (torch.randn(rank, in_f, generator=g) / in_f**0.5).to(torch.bfloat16)
        sd[f"{name}.lora_up.weight"] = (torch.randn(out_f, rank, generator=g) * 0.01).to(torch.bfloat16)
        sd[f"{name}.alpha"] = torch.tensor(float(rank))
    source.source.close()
    save_file_atomic(sd, path)
    return path, len(sd) // 3


def _compare(a: torch.nn.Module, b: torch.nn.Module) -> dict[str, Any]:
    """Bit-for-bit comparison of two models' tensors (on their device)."""
    differing = 0
    worst = 0.0
    tensors = 0
    sb = b.state_dict()
    for key, x in a.state_dict().items():
        y = sb[key].to(x.device)
        if x.dtype != y.dtype or x.shape != y.shape:
            return {"equal": False, "why": f"{key}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"}
        if not torch.equal(x, y):
            tensors += 1
            ne = x != y
            differing += int(ne.sum())
            if x.is_floating_point():
                worst = max(worst, float((x.float() - y.float()).abs().max()))
    return {"equal": tensors == 0, "tensors_differing": tensors, "elements_differing": differing,
            "max_abs_diff": worst}


def _guarded(device: torch.device, phase: Callable[[], Any]) -> Any:
    """A phase's result, or {"error": the traceback's tail} when it raised (the other phases still run)."""
    try:
        return phase()
    except Exception:  # a bench records every failure and goes on
        _free(device)
        return {"error": traceback.format_exc()[-3000:]}


def _pair(device: torch.device, load: Load, compare: bool, repeats: int = 2) -> dict[str, Any]:
    """Time `load("new")` and `load("old")` `repeats` times each, the order alternating; the best of each, every
    run's seconds and the best run's split; the last round's two models compared when `compare`."""
    runs: dict[str, list[dict[str, Any]]] = {"new": [], "old": []}
    kept: dict[str, torch.nn.Module] = {}
    for round_ in range(repeats):
        for which in ("new", "old") if round_ % 2 == 0 else ("old", "new"):
            split, model = _run_once(device, load, which)
            runs[which].append(split)
            if compare and round_ == repeats - 1:
                kept[which] = model
            del model
            _free(device)
    out: dict[str, Any] = {}
    for which in ("new", "old"):
        best = min(runs[which], key=lambda r: r["s"])
        out[f"{which}_s"] = best["s"]
        out[f"{which}_runs_s"] = [r["s"] for r in runs[which]]
        out[f"{which}_split"] = best
    if compare:
        out.update(_compare(kept["new"], kept["old"]))
    kept.clear()
    _free(device)
    return out


def run(snapshot: Path, device: torch.device, out_dir: Path, threads: list[int], chunks: list[int],
        compare: bool, fresh: bool = True, save: Callable[[dict[str, Any]], None] | None = None,
        repeats: int = 2) -> dict[str, Any]:
    """Every phase in order; `save(result)` after each (a run cut short keeps what it measured)."""
    result = _Saved(save)
    result["device"] = str(device)
    result["snapshot"] = str(snapshot)
    result["staging"] = {"threads": safetensors_io.READ_THREADS, "chunk_mib": safetensors_io.STAGING_BYTES // 2**20,
                         "buffers": safetensors_io.STAGING_BUFFERS}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
        torch.empty(1, device=device)  # CUDA context before any timing
    if fresh:
        result["import_transformers_s"] = import_seconds()
    result["te_model_code_import_s"] = import_model_code()
    files = dit_checkpoint_files(snapshot / "transformer") + sorted((snapshot / "text_encoder").glob("*.safetensors"))
    result["page_cache_warm"] = warm_page_cache(files)
    result["read_floor"] = _guarded(device, lambda: read_floor(snapshot, device))
    result["sweep"] = _guarded(device, lambda: sweep(snapshot, device, threads, chunks))

    te_path = snapshot / "text_encoder"
    result["te"] = _guarded(device, lambda: _pair(
        device, lambda w: (load_text_encoder(TextEncoderOptions(path=te_path), device).model, {}), compare, repeats))
    if fresh:
        result["te_fresh_process"] = fresh_process_te(te_path, device)

    dit_path = snapshot / "transformer"
    cpu = torch.device("cpu")
    result["dit"] = _guarded(device, lambda: _pair(
        device, lambda w: (load_moss_image_model(device, dit_path, dtype=torch.bfloat16), {}), compare, repeats))
    result["dit_cpu_home"] = _guarded(device, lambda: _pair(device, lambda w: (load_moss_image_model(
        device, dit_path, loading_device=cpu, dtype=torch.bfloat16), {}), compare, repeats))

    lora, modules = write_lora(snapshot, out_dir / "bench_loading_lora_r16.safetensors")
    result["lora"] = {"file": lora.name, "bytes": lora.stat().st_size, "modules": modules, "rank": LORA_RANK}

    def merged(which: str, home: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
        plan = LoraMergePlan(load_lora_files([lora]), "lora_unet", names=[str(lora)],
                             device=device if which == "new" else None)
        model = load_moss_image_model(device, dit_path, loading_device=home, dtype=torch.bfloat16,
                                      tensor_hook=plan.merge, calc_device=device)
        plan.finish()
        return model, {"merge": plan.times.as_dict()}

    result["dit_lora"] = _guarded(device, lambda: _pair(device, lambda w: merged(w, device), compare, repeats))
    result["dit_lora_cpu_home"] = _guarded(device, lambda: _pair(device, lambda w: merged(w, cpu), compare, repeats))
    lora.unlink()
    return dict(result)


class _Saved(dict):
    """A dict that calls `save(self)` whenever a key is set."""

    def __init__(self, save: Callable[[dict[str, Any]], None] | None):
        super().__init__()
        self._save = save

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if self._save is not None:
            self._save(dict(self))


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loading", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--snapshot", type=Path, help="a snapshot root (bench.make_full_snapshot --what dit,te)")
    p.add_argument("--tiny", action="store_true", help="build and use the tiny snapshot (for tests)")
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    p.add_argument("--threads", type=int, default=None, help="staged reader threads (default: the product's)")
    p.add_argument("--chunk_mib", type=int, default=None, help="staged reader chunk in MiB (default: the product's)")
    p.add_argument("--sweep_threads", default="1,2,4,8", help="thread counts of the read sweep")
    p.add_argument("--sweep_chunk_mib", default="16,64", help="chunk sizes (MiB) of the read sweep")
    p.add_argument("--no_compare", action="store_true", help="do not keep both models to compare them (less memory)")
    p.add_argument("--no_fresh", action="store_true",
                   help="skip the text encoder loads in fresh processes (and the fresh interpreter's import time)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each path per pair, the order alternating")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        safetensors_io.READ_THREADS = args.threads
        safetensors_io.STAGING_BUFFERS = max(args.threads, safetensors_io.STAGING_BUFFERS)
    if args.chunk_mib:
        safetensors_io.STAGING_BYTES = args.chunk_mib * 2**20
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        if args.tiny:
            from library.moss_image.tiny_snapshot import build_tiny_snapshot

            snapshot = build_tiny_snapshot(Path(tmp) / "tiny")
        elif args.snapshot is None:
            p.error("give --snapshot DIR or --tiny")
        else:
            snapshot = args.snapshot
        start = time.perf_counter()

        def save(partial: dict[str, Any]) -> None:
            args.out.write_text(json.dumps(partial, indent=2) + "\n", encoding="utf-8")

        result = run(snapshot, device, Path(tmp), _ints(args.sweep_threads), _ints(args.sweep_chunk_mib),
                     not args.no_compare, not args.no_fresh, save, max(1, args.repeats))
        result["total_s"] = round(time.perf_counter() - start, 1)
    save(result)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
