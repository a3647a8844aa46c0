"""Sweep of the forward int8 GEMM (`library.quant.int8_gemm_kernels`): every variant x configuration at the DiT and
Qwen3.5 text-encoder shapes, one JSON, and a pinned table of the winners.

Shapes ("cases", in the order they are measured, so that a budget cut leaves the important ones done):

- ``dit``: M = 4352 (1024² image + 256 text tokens), (N, K) = (3072, 3072) q/k/v/o, (16384, 3072) ffn_up_gate,
  (3072, 8192) ffn_down; int8 activation x K-major int8 weight, fp32 row and column scales, bf16 out.
- ``qkv``: the same M, (N, K) = (9216, 3072): q, k and v stacked, as compiled ConvRot INT8 inference runs them (one
  product for the three; `MossImage.stack_qkv_weights`).
- ``bwd``: the int8 backward's grad-input GEMMs at M = 4352 (grad_y codes x the weight read N-major, fp32 out, no
  column scale); the pointer variants only (TMA needs K-major operands).
- ``te``: the Linear shapes of the Qwen3.5-9B text model (from ``configs/moss_image_qwen35_9b/config.json``, one
  decoder layer of each type built on the meta device, the Gated DeltaNet gates left out as the quantiser does) at
  M = 300 / 1024 / 2560 / 4352.

Per case: every variant x configuration timed (GPU time: `--inner` launches captured in one CUDA graph, replayed
`--reps` times with CUDA events, median per launch; L2 not flushed, so weights that fit the 50 MB L2 may be served
from it), TOPS, the output checked for exact equality against torch (``torch._int_mm`` + the same epilogue in
torch: int32 sums are exact, so the outputs must be identical), bf16 ``F.linear``, ``torch._int_mm`` and fp8
``torch._scaled_mm`` (row-wise scales) at the same shape for reference, the activation quantiser at M x K, and the
int8/bf16 ratios with and without it. A configuration that fails to compile or launch is recorded, not fatal; a
small random case checks each variant once before the sweep. With `--jobs N` the kernels are compiled first by N
worker processes into Triton's cache (default 0: each is compiled by this process when it is first timed). The whole run stops measuring after `--budget_s` seconds (what is left is listed as
skipped).

    python -m bench.int8_gemm_sweep --out $OUT/sweep.json --table_out $OUT/int8_gemm_table.json
    python -m bench.int8_gemm_sweep --from_json sweep.json --table_out library/quant/int8_gemm_table.json \
        --merge_table --capability_rows   # no GPU: the shipped table updated from a sweep's JSON

The table file has the format of ``library/quant/int8_gemm_table.json``: per case the fastest configuration measured
exact, a TMA variant only where its GPU time is at least `--tma_min_us` (default 0: since TMA kernels launch raw, with
their descriptors encoded once per operand, their host time per call matches the pointer kernel's, about 15-20 us
on the H200; before, 55-70 us per call kept TMA off GEMMs under 80 us);
``MOSS_INT8_GEMM_TABLE=$OUT/int8_gemm_table.json`` makes the product use it without copying it there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from library.quant import convrot_kernels as K
from library.quant import int8_gemm_kernels as G
from library.quant.int8_gemm_kernels import GemmConfig

REPO = Path(__file__).resolve().parent.parent
TE_CONFIG = REPO / "configs" / "moss_image_qwen35_9b" / "config.json"
DIT_M = 4352
DIT_SHAPES = [(3072, 3072), (16384, 3072), (3072, 8192)]  # (N, K)
QKV_SHAPE = (9216, 3072)  # q, k and v stacked (inference)
TE_MS = (300, 1024, 2560, 4352)
# The first H200 sweep, with all six variants and a pool of 12 compiling workers, printed nothing in 370 s; the
# same sweep with these variants compiling in its own process took 75 s. "tma_persistent_ws" and "tma_split_tail"
# (int32 atomics into a shared workspace) ran on an H200 in docs/benchmarks.md's seventeenth run: exact, but no faster
# than these at the DiT's shapes (split tail 1 % at 3072 x 8192, 11 % slower at 3072 x 3072; warp specialisation 5 %
# slower at 3072 x 3072, and about 25 s of compilation per configuration): only with --variants, and with a timeout.
DEFAULT_VARIANTS = ("ptr", "tma", "ptr_persistent", "tma_persistent")
PARTS = ("dit", "qkv", "bwd", "te")
GROUP = 256  # the ConvRot group of the quantiser timing


@dataclasses.dataclass(frozen=True)
class Case:
    """One GEMM shape: C [M, N] = epilogue(A [M, K] @ B), B K-major (the forward) or N-major (the int8 backward)."""

    part: str
    m: int
    n: int
    k: int
    b_kmajor: bool = True

    @property
    def name(self) -> str:
        return f"{self.part}:{self.m}x{self.n}x{self.k}{'' if self.b_kmajor else ':nmajor'}"

    @property
    def out_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.b_kmajor else torch.float32

    def signature(self) -> tuple:
        """What Triton specialises the kernels on for this case (one compile per variant, config and signature)."""
        return (self.b_kmajor, self.m % 16 == 0, self.n % 16 == 0, self.k % 16 == 0, self.k % 256 == 0)

    def proxy(self) -> Case:
        """A small case that compiles to the same kernels (sizes with the same residues modulo 16 and K's modulo
        512, which decide the specialisation and EVEN_K)."""
        return Case(self.part, 256 + self.m % 16, 256 + self.n % 16, 512 + self.k % 512, self.b_kmajor)


# ---------------------------------------------------------------------------------------------------- shapes
def te_linear_shapes(config_path: Path = TE_CONFIG) -> list[tuple[int, int]]:
    """The distinct (N, K) of the text model's quantised Linears: one decoder layer of each type on meta."""
    from transformers import Qwen3_5TextConfig  # heavy; only the te part needs it
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    from library.text_encoder.quant import SKIPPED_LINEARS

    text = json.loads(Path(config_path).read_text(encoding="utf-8"))["text_config"]
    cfg = Qwen3_5TextConfig(**text)
    shapes: list[tuple[int, int]] = []
    with torch.device("meta"):
        for kind in dict.fromkeys(cfg.layer_types):
            layer = Qwen3_5DecoderLayer(cfg, cfg.layer_types.index(kind))
            for name, mod in layer.named_modules():
                if type(mod) is torch.nn.Linear and not name.endswith(SKIPPED_LINEARS):
                    shape = (mod.out_features, mod.in_features)
                    if shape not in shapes:
                        shapes.append(shape)
    return shapes


def sweep_cases(parts: list[str], te_ms: tuple[int, ...] = TE_MS) -> list[Case]:
    cases: list[Case] = []
    if "dit" in parts:
        cases += [Case("dit", DIT_M, n, k) for n, k in DIT_SHAPES]
    if "qkv" in parts:
        cases.append(Case("qkv", DIT_M, *QKV_SHAPE))
    if "bwd" in parts:  # grad_x [M, K_w] = q_g [M, N_w] @ W [N_w, K_w]: the reduction over the weight's rows
        cases += [Case("bwd", DIT_M, k, n, b_kmajor=False) for n, k in DIT_SHAPES]
    if "te" in parts:
        cases += [Case("te", m, n, k) for m in te_ms for n, k in te_linear_shapes()]
    return cases


# ---------------------------------------------------------------------------------------------------- configs
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, GROUP_M)
_BROAD = [
    (128, 256, 128, 3, 8, 8), (128, 256, 128, 4, 8, 8), (128, 256, 128, 4, 8, 16), (128, 256, 64, 5, 8, 8),
    (256, 128, 128, 3, 8, 8), (256, 128, 128, 4, 8, 8), (128, 128, 128, 4, 4, 8), (128, 128, 128, 4, 8, 8),
    (128, 128, 128, 5, 8, 8), (128, 128, 256, 3, 8, 8), (64, 256, 128, 4, 4, 8), (64, 128, 128, 4, 4, 8),
]
# the text encoder's smaller M: fewer, smaller tiles
_SMALL = [
    (64, 128, 128, 4, 4, 8), (64, 256, 128, 4, 4, 8), (128, 128, 128, 4, 8, 8), (128, 256, 128, 3, 8, 8),
    (128, 128, 256, 3, 8, 8), (128, 256, 64, 5, 8, 8),
]
# the persistent kernels' epilogue options, tried on the large tiles: (epi_subtile, flatten)
_EPILOGUE_OPTIONS = [(True, True), (False, False), (True, False)]


def _config(t: tuple[int, ...], epi_subtile: bool = False, flatten: bool = True) -> GemmConfig:
    bm, bn, bk, st, wp, gm = t
    return GemmConfig(bm, bn, bk, group_m=gm, num_stages=st, num_warps=wp, epi_subtile=epi_subtile, flatten=flatten)


def sweep_configs(variant: str, small: bool = False) -> list[GemmConfig]:
    """The configurations tried for `variant` (`small`: the shorter list of the text-encoder cases)."""
    base = [_config(t) for t in (_SMALL if small else _BROAD)]
    if not G.GEMM_VARIANTS[variant].persistent or small:
        return base
    extra = [_config(t, sub, fl) for t in _BROAD[:2] + _BROAD[4:5] for sub, fl in _EPILOGUE_OPTIONS]
    if G.GEMM_VARIANTS[variant].warp_specialize:  # flatten does not apply: only the subtiled epilogue is new
        extra = [_config(t, True, True) for t in _BROAD[:2] + _BROAD[4:5]]
    return base + extra


def case_variants(case: Case, variants: list[str]) -> list[str]:
    return [v for v in variants if case.b_kmajor or not G.GEMM_VARIANTS[v].tma]


def work_list(cases: list[Case], variants: list[str]) -> list[tuple[Case, str, GemmConfig]]:
    return [(case, v, cfg) for case in cases for v in case_variants(case, variants)
            for cfg in sweep_configs(v, small=case.part == "te")]


# ---------------------------------------------------------------------------------------------------- inputs
def make_inputs(case: Case, device: str, seed: int = 0) -> dict[str, Any]:
    """Random int8 operands and positive fp32 scales; the weight as the product stores it ([N_w, K_w])."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randint(-128, 128, (case.m, case.k), generator=g, dtype=torch.int8).to(device)
    if case.b_kmajor:  # B[k, n] = w[n, k]: w [N, K]
        w = torch.randint(-128, 128, (case.n, case.k), generator=g, dtype=torch.int8).to(device)
        strides = w.stride()
    else:  # B[k, n] = w[k, n]: w [K, N] read with (stride_n, stride_k) = (1, N)
        w = torch.randint(-128, 128, (case.k, case.n), generator=g, dtype=torch.int8).to(device)
        strides = (w.stride(1), w.stride(0))
    sa = (torch.rand(case.m, generator=g) * 1e-3 + 1e-4).to(device)
    sb = (torch.rand(case.n, generator=g) * 1e-3 + 1e-4).to(device) if case.b_kmajor else None
    out = torch.empty(case.m, case.n, dtype=case.out_dtype, device=device)
    return {"a": a, "w": w, "strides": strides, "sa": sa, "sb": sb, "out": out}


def reference(case: Case, t: dict[str, Any]) -> torch.Tensor:
    """torch's result: exact int32 sums, then the epilogue's arithmetic in torch."""
    b_t = t["w"] if case.b_kmajor else t["w"].t()
    return K._epilogue_eager(K.int8_mm(t["a"], b_t), t["sa"], t["sb"], case.out_dtype)


def launch(variant: str, cfg: GemmConfig, t: dict[str, Any]) -> None:
    G.launch_gemm_variant(variant, cfg, t["a"], t["sa"], t["w"], t["strides"], t["sb"], None, t["out"])


# ---------------------------------------------------------------------------------------------------- timing
def time_gpu(fn: Callable[[], Any], reps: int, inner: int) -> dict[str, Any]:
    """GPU time per call: `inner` calls captured in one CUDA graph (no host launch cost), replayed `reps` times
    between CUDA events; median over the replays / inner. Without a graph (capture refused) each call is timed
    alone and `graph` is False."""
    fn()
    torch.cuda.synchronize()
    graph = None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except Exception:  # noqa: BLE001 - any capture failure: plain event timing
        graph = None
        torch.cuda.synchronize()
    run, per = (graph.replay, inner) if graph is not None else (fn, 1)
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per)
    times.sort()
    return {"ms": statistics.median(times), "p10_ms": times[len(times) // 10], "p90_ms": times[(len(times) * 9) // 10],
            "graph": graph is not None}


def tops(case: Case, ms: float) -> float:
    return 2.0 * case.m * case.n * case.k / (ms * 1e-3) / 1e12


def reference_timings(case: Case, t: dict[str, Any], reps: int, inner: int) -> dict[str, Any]:
    """bf16 F.linear, torch._int_mm and fp8 torch._scaled_mm (row-wise scales) at the case's shape, and the
    activation quantiser at M x K (forward cases)."""
    r: dict[str, Any] = {}
    dev = t["a"].device
    x = torch.randn(case.m, case.k, device=dev, dtype=torch.bfloat16)
    wb = torch.randn(case.n, case.k, device=dev, dtype=torch.bfloat16)
    b_t = t["w"] if case.b_kmajor else t["w"].t()
    trials: dict[str, Callable[[], Any]] = {
        "bf16_linear": lambda: F.linear(x, wb),
        "int_mm": lambda: torch._int_mm(t["a"], b_t.t()),
    }
    if hasattr(torch, "float8_e4m3fn"):
        xf, wf = x.to(torch.float8_e4m3fn), wb.to(torch.float8_e4m3fn)
        s_x = torch.ones(case.m, 1, device=dev)
        s_w = torch.ones(1, case.n, device=dev)
        trials["fp8_scaled_mm"] = lambda: torch._scaled_mm(xf, wf.t(), scale_a=s_x, scale_b=s_w,
                                                           out_dtype=torch.bfloat16)
    if case.b_kmajor and case.k % GROUP == 0:
        trials["quantiser"] = lambda: K._quantize_rows_triton(x, GROUP, one_buffer=True)
    for name, fn in trials.items():
        try:
            tm = time_gpu(fn, reps, inner)
            r[name] = {"ms": tm["ms"], "graph": tm["graph"]}
            if name != "quantiser":
                r[name]["tops"] = tops(case, tm["ms"])
        except Exception as e:  # noqa: BLE001 - a reference that this torch/GPU lacks is recorded
            r[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return r


# ---------------------------------------------------------------------------------------------------- checks
def check_variants(variants: list[str], device: str) -> dict[str, Any]:
    """Each variant once on a small random case with ragged M, N and K (K a multiple of 16 for the descriptors),
    with a bias: exact int32 sums (fp32 out, unit scales) and the full epilogue against torch."""
    out: dict[str, Any] = {}
    m, n, k = 77, 200, 336
    g = torch.Generator(device="cpu").manual_seed(1)
    a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8).to(device)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(device)
    sa, sb = torch.rand(m, generator=g).to(device), torch.rand(n, generator=g).to(device)
    bias = torch.randn(n, generator=g).to(device=device, dtype=torch.bfloat16)
    acc = K.int8_mm(a, w)
    ref = K._epilogue_eager(acc, sa, sb, torch.bfloat16).add_(bias)
    ones_m, ones_n = torch.ones(m, device=device), torch.ones(n, device=device)
    cfg = GemmConfig(64, 128, 128, group_m=8, num_stages=3, num_warps=4, epi_subtile=True)
    for v in variants:
        try:
            c32 = torch.empty(m, n, dtype=torch.float32, device=device)
            G.launch_gemm_variant(v, cfg, a, ones_m, w, w.stride(), ones_n, None, c32, programs=3)
            c = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            G.launch_gemm_variant(v, cfg, a, sa, w, w.stride(), sb, bias, c, programs=3)
            out[v] = {"int32_exact": bool(torch.equal(c32, acc.float())), "epilogue_identical": bool(torch.equal(c, ref))}
        except Exception as e:  # noqa: BLE001 - recorded: the variant is left out of the sweep
            out[v] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    return out


# ---------------------------------------------------------------------------------------------------- compile
def _check_task(variant: str) -> tuple[str, dict[str, Any]]:
    return variant, check_variants([variant], "cuda")[variant]


def run_checks_in(pool: Any, variants: list[str], deadline: float) -> dict[str, Any]:
    """`check_variants` in the worker pool, one variant per worker; a variant not done by `deadline` (a compile
    that hangs) is recorded as timed out and left out of the sweep."""
    checks: dict[str, Any] = {v: {"error": "timeout"} for v in variants}
    results = pool.imap_unordered(_check_task, variants)
    for _ in variants:
        try:
            v, r = results.next(timeout=max(1.0, deadline - time.monotonic()))
        except multiprocessing.TimeoutError:
            break
        checks[v] = r
    return checks


def _compile_task(task: tuple[dict, str, dict]) -> tuple[tuple, str, dict, str | None]:
    """Worker: compile (and launch once) one variant x config at one case's specialisation."""
    case_d, variant, cfg_d = task
    case = Case(**case_d)
    try:
        launch(variant, GemmConfig(**cfg_d), make_inputs(case, "cuda"))
        torch.cuda.synchronize()
        return case.signature(), variant, cfg_d, None
    except Exception as e:  # noqa: BLE001 - reported to the parent, which records it
        return case.signature(), variant, cfg_d, f"{type(e).__name__}: {str(e)[:500]}"


def compile_tasks(work: list[tuple[Case, str, GemmConfig]]) -> list[tuple[dict, str, dict]]:
    """One task per variant, configuration and specialisation of the work."""
    tasks, seen = [], set()
    for case, v, cfg in work:
        key = (case.signature(), v, cfg)
        if key not in seen:
            seen.add(key)
            tasks.append((dataclasses.asdict(case.proxy()), v, dataclasses.asdict(cfg)))
    return tasks


def precompile(pool: Any, tasks: list[tuple[dict, str, dict]], deadline: float) -> dict[str, Any]:
    """Compile the tasks' kernels into Triton's cache in the worker `pool` until `deadline`: the number done and
    the errors seen (the timing loop tries every configuration again and records its own result)."""
    errors: dict[str, str] = {}
    done = 0
    results = pool.imap_unordered(_compile_task, tasks)
    for _ in tasks:
        try:
            sig, v, cfg_d, err = results.next(timeout=max(1.0, deadline - time.monotonic()))
        except multiprocessing.TimeoutError:
            break
        done += 1
        if err is not None:
            errors[f"{sig} {v} {GemmConfig(**cfg_d)}"] = err
    return {"tasks": len(tasks), "done": done, "errors": errors}


# ---------------------------------------------------------------------------------------------------- sweep
def sweep_case(case: Case, variants: list[str], reps: int, inner: int, deadline: float) -> dict[str, Any]:
    t = make_inputs(case, "cuda")
    ref = reference(case, t)
    r: dict[str, Any] = {"case": case.name, **dataclasses.asdict(case), "references": reference_timings(case, t, reps,
                                                                                                       inner)}
    rows = []
    for v in case_variants(case, variants):
        for cfg in sweep_configs(v, small=case.part == "te"):
            row: dict[str, Any] = {"variant": v, "config": cfg.to_json()}
            if time.monotonic() > deadline:
                row["skipped"] = "budget"
            else:
                try:
                    t["out"].zero_()
                    tm = time_gpu(lambda v=v, cfg=cfg: launch(v, cfg, t), reps, inner)
                    row.update(ms=tm["ms"], p10_ms=tm["p10_ms"], p90_ms=tm["p90_ms"], graph=tm["graph"],
                               tops=tops(case, tm["ms"]), exact=bool(torch.equal(t["out"], ref)))
                except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch is recorded
                    row["failed"] = f"{type(e).__name__}: {str(e)[:500]}"
            rows.append(row)
            if "skipped" not in row:
                print(f"{case.name} {v} {cfg.to_json()} {row.get('tops', row.get('failed', ''))}", file=sys.stderr,
                      flush=True)
    r["rows"] = rows
    r.update(summarise(rows, r["references"]))
    return r


def summarise(rows: list[dict], refs: dict[str, Any]) -> dict[str, Any]:
    """The fastest exact row overall and per variant, and its ratios to bf16 (GEMM alone, and with the quantiser)."""
    ok = [r for r in rows if r.get("exact")]
    out: dict[str, Any] = {"best": None, "best_per_variant": {}}
    for r in sorted(ok, key=lambda r: r["ms"]):
        out["best_per_variant"].setdefault(r["variant"], {"ms": r["ms"], "tops": r["tops"], "config": r["config"]})
    if not ok:
        return out
    best = min(ok, key=lambda r: r["ms"])
    out["best"] = {"variant": best["variant"], "config": best["config"], "ms": best["ms"], "tops": best["tops"]}
    bf16 = refs.get("bf16_linear", {}).get("ms")
    if bf16:
        out["bf16_over_int8_gemm"] = bf16 / best["ms"]
        q = refs.get("quantiser", {}).get("ms")
        if q:
            out["bf16_over_int8_linear"] = bf16 / (best["ms"] + q)
    return out


def table_choice(rows: list[dict], tma_min_ms: float) -> dict | None:
    """The row a pinned table should name for a case: the fastest exact one, unless that is a TMA variant (about
    40-55 us more host time per call: its descriptors are built per launch, no raw launch) faster than `tma_min_ms`
    (too short to hide that host time): then the fastest pointer one."""
    ok = sorted((r for r in rows if r.get("exact")), key=lambda r: r["ms"])
    if ok and (not G.GEMM_VARIANTS[ok[0]["variant"]].tma or ok[0]["ms"] >= tma_min_ms):
        return ok[0]
    return next((r for r in ok if not G.GEMM_VARIANTS[r["variant"]].tma), None)


def table_entries(results: list[dict], gpus: list[str], tma_min_ms: float = 0.0) -> list[dict]:
    """The pinned-table entries of the cases' `table_choice` (one per GPU name of `gpus`, N, K, layout and M
    bucket: the larger M)."""
    entries: dict[tuple, dict] = {}
    for r in sorted(results, key=lambda r: r["m"]):
        pick = table_choice(r.get("rows", []), tma_min_ms)
        if pick is None:
            continue
        for gpu in gpus:
            key = (gpu, r["n"], r["k"], r["b_kmajor"], G.gemm_m_bucket(r["m"]))
            entries[key] = {"gpu": gpu, "n": r["n"], "k": r["k"], "m_bucket": key[4], "b_kmajor": r["b_kmajor"],
                            "variant": pick["variant"], "config": pick["config"],
                            "measured": {"m": r["m"], "ms": round(pick["ms"], 5), "tops": round(pick["tops"], 1)}}
    return list(entries.values())


def _entry_key(e: dict) -> tuple:
    return (e["gpu"], e["n"], e["k"], e.get("b_kmajor", True), e["m_bucket"])


def write_table(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`--table_out` from the sweep results `res`: rows for the GPU's name (and its capability with
    --capability_rows); with --merge_table the file's other rows (other GPUs, shapes or M buckets) are kept."""
    gpus = [res["env"]["gpu"]]
    if args.capability_rows:
        gpus.append("sm{}{}".format(*res["env"]["capability"]))
    new = table_entries(res["cases"], gpus, args.tma_min_us / 1e3)
    out = Path(args.table_out)
    about = json.loads(G.DEFAULT_GEMM_TABLE.read_text(encoding="utf-8")).get("about", "")
    rows: dict[tuple, dict] = {}
    if args.merge_table and out.is_file():
        old = json.loads(out.read_text(encoding="utf-8"))
        about = old.get("about", about)
        rows = {_entry_key(e): e for e in old.get("entries", [])}
    rows.update({_entry_key(e): e for e in new})
    table = {"about": about, "entries": list(rows.values())}
    G.parse_gemm_table(table, str(out))  # what is written must load
    out.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    return table


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.int8_gemm_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="the sweep's JSON (required unless --from_json)")
    ap.add_argument("--table_out", default=None, help="also write the winners as a pinned GEMM table (JSON)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated variants (default: those of {DEFAULT_VARIANTS} this Triton builds)")
    ap.add_argument("--te_ms", default=",".join(map(str, TE_MS)), help="te: the token counts M")
    ap.add_argument("--budget_s", type=float, default=240.0, help="stop measuring after this many seconds")
    ap.add_argument("--reps", type=int, default=20, help="timed graph replays per configuration (>= 20)")
    ap.add_argument("--inner", type=int, default=10, help="launches per captured graph")
    ap.add_argument("--tma_min_us", type=float, default=0.0,
                    help="table: a TMA variant only where its GPU time is at least this (where its host time is"
                         " higher: a Triton without raw TMA launches)")
    ap.add_argument("--capability_rows", action="store_true",
                    help="table: repeat the rows under the GPU's compute capability (e.g. sm90: other Hopper GPUs)")
    ap.add_argument("--merge_table", action="store_true",
                    help="table: keep the other rows of an existing --table_out (replace only the measured ones)")
    ap.add_argument("--from_json", default=None,
                    help="no GPU: rewrite --table_out from this earlier sweep JSON (with this run's --tma_min_us)")
    ap.add_argument("--jobs", type=int, default=0,
                    help="processes compiling the kernels before the timing (0: compile while timing)")
    args = ap.parse_args(argv)
    if args.from_json is None and args.out is None:
        ap.error("--out is required (or --from_json with --table_out)")
    if args.from_json is not None and args.table_out is None:
        ap.error("--from_json needs --table_out")
    parts = [p for p in args.parts.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        ap.error(f"--parts takes a comma-separated subset of {PARTS}, got {args.parts!r}")
    args.parts = parts
    if args.variants is not None:
        names = [v for v in args.variants.split(",") if v]
        unknown = set(names) - set(G.GEMM_VARIANTS)
        if unknown or not names:
            ap.error(f"--variants takes a comma-separated subset of {tuple(G.GEMM_VARIANTS)}, got {args.variants!r}")
        args.variants = names
    try:
        args.te_ms = tuple(int(v) for v in args.te_ms.split(",") if v)
    except ValueError:
        ap.error(f"--te_ms takes comma-separated integers, got {args.te_ms!r}")
    if args.reps < 20:
        ap.error("--reps must be at least 20")
    return args


def _env() -> dict[str, Any]:
    import triton

    return {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "timing": "CUDA graph of --inner launches, median of --reps replays; L2 not flushed"}


def write_results(res: dict[str, Any], args: argparse.Namespace, t0: float) -> None:
    """The sweep's JSON and (with --table_out) the pinned table of the cases measured so far."""
    res["table"] = {"entries": table_entries(res["cases"], [res["env"]["gpu"]], args.tma_min_us / 1e3)}
    res["wall_s"] = time.monotonic() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1), encoding="utf-8")
    if args.table_out:
        write_table(res, args)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.from_json is not None:  # no GPU: the table of an earlier sweep, chosen again
        return write_table(json.loads(Path(args.from_json).read_text(encoding="utf-8")), args)
    if not torch.cuda.is_available():
        sys.exit("bench.int8_gemm_sweep needs a CUDA GPU")
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    res: dict[str, Any] = {"env": _env(), "args": {k: v for k, v in vars(args).items()}}
    avail = list(G.available_gemm_variants())
    wanted = [v for v in (args.variants or DEFAULT_VARIANTS) if v in avail]
    pool = multiprocessing.get_context("spawn").Pool(args.jobs) if args.jobs > 0 else None
    try:
        if pool is not None:  # the small checks compile in parallel too
            res["checks"] = run_checks_in(pool, wanted, t0 + 0.25 * args.budget_s)
        else:
            res["checks"] = check_variants(wanted, "cuda")
        variants = [v for v in wanted if res["checks"][v].get("int32_exact")
                    and res["checks"][v].get("epilogue_identical")]
        res["variants"], res["variants_left_out"] = variants, sorted(set(args.variants or avail) - set(variants))
        cases = sweep_cases(args.parts, args.te_ms)
        if pool is not None:
            t = time.monotonic()
            res["precompile"] = precompile(pool, compile_tasks(work_list(cases, variants)),
                                           t0 + 0.6 * args.budget_s)
            res["precompile"]["s"] = time.monotonic() - t
    finally:
        if pool is not None:  # workers still compiling at the deadline are stopped
            pool.terminate()
            pool.join()
    res["cases"] = []
    for case in cases:
        res["cases"].append(sweep_case(case, variants, args.reps, args.inner, deadline))
        torch.cuda.empty_cache()
        write_results(res, args, t0)  # after every case: a run cut short keeps what it measured
    for r in res["cases"]:
        b = r.get("best") or {}
        print(f"{r['case']:<28} best {b.get('variant', '-'):<18} {b.get('tops', 0):7.1f} TOPS"
              f"  bf16/int8 gemm {r.get('bf16_over_int8_gemm', 0):.2f}x  linear {r.get('bf16_over_int8_linear', 0):.2f}x")
    return res


if __name__ == "__main__":
    main()
