"""The forward int8 GEMM variants (library.quant.int8_gemm_kernels): kernels under Triton's interpreter against
torch, the pinned per-shape table and the variant choice, and the CPU-safe parts of bench.int8_gemm_sweep.

The kernels run under TRITON_INTERPRET=1 in a subprocess (the interpreter is chosen when the kernels are defined);
running this file as a script prints those checks as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import int8_gemm_sweep as S
from library.errors import UserError
from library.quant import int8_gemm_kernels as G
from library.quant.int8_gemm_kernels import GemmConfig
from tests.test_convrot_int8_triton import _interpreter_runs_int8_dots

ROOT = Path(__file__).resolve().parents[1]
# (M, N, K): ragged everything (K a multiple of 16 for the descriptors, not of the 32-wide K block), exact tiles
SHAPES = [(40, 72, 80), (64, 64, 64)]


def run_checks() -> dict:
    """Every variant this Triton builds, with and without the subtiled epilogue, against torch (exact equality)."""
    from library.quant import convrot_kernels as K

    torch.manual_seed(0)
    out: dict = {"variants": list(G.available_gemm_variants()), "cases": []}
    for m, n, k in SHAPES:
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8)
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        sa, sb = torch.rand(m), torch.rand(n)
        bias = torch.randn(n).to(torch.bfloat16)
        ref = K._epilogue_eager(K.int8_mm(a, w), sa, sb, torch.bfloat16).add_(bias)
        acc = K.int8_mm(a, w).float()
        wt = w.t().contiguous()  # the int8 backward's layout: B read N-major
        for v in out["variants"]:
            for sub in (False, True):
                cfg = GemmConfig(16, 32, 32, group_m=2, num_stages=2, num_warps=4, epi_subtile=sub)
                # 4 programs: they loop over the 9 or 8 tiles; the split-tail kernel splits the 9th over 3 of them
                outs = [G.launch_gemm_variant(v, cfg, a, sa, w, w.stride(), sb, bias,
                                              torch.empty(m, n, dtype=torch.bfloat16), programs=4)
                        for _ in range(2 if G.GEMM_VARIANTS[v].split_tail else 1)]
                case = {"variant": v, "subtile": sub, "shape": [m, n, k],
                        "identical": all(torch.equal(c, ref) for c in outs)}
                if G.GEMM_VARIANTS[v].split_tail:  # the kernel leaves its workspace and counters zeroed
                    case["workspace_clean"] = all(not t.any() for t in G._WORKSPACES[a.device])
                if not G.GEMM_VARIANTS[v].tma:
                    c32 = G.launch_gemm_variant(v, cfg, a, sa, wt, (1, n), None, None,
                                                torch.empty(m, n, dtype=torch.float32), programs=4)
                    case["nmajor_identical"] = bool(torch.equal(c32, K._epilogue_eager(acc, sa, None, torch.float32)))
                out["cases"].append(case)
    # the public path with a persistent variant forced, and a pinned plan that never runs the autotuner
    a = torch.randint(-128, 128, (33, 96), dtype=torch.int8)
    w = torch.randint(-128, 128, (48, 96), dtype=torch.int8)
    sa, sb = torch.rand(33), torch.rand(48)
    ref = K._epilogue_eager(K.int8_mm(a, w), sa, sb, torch.float16)
    G.set_gemm_kernel("ptr_persistent")
    try:
        out["forced_persistent"] = bool(torch.equal(K.int8_gemm(a, sa, w, sb, None, torch.float16, "triton"), ref))
    finally:
        G.set_gemm_kernel("auto")
    out["pinned_plan"] = _check_pinned_plan(a, sa, w, sb, ref)
    return out


def _check_pinned_plan(a, sa, w, sb, ref) -> bool:
    class NoTuner:  # a pinned configuration must never reach the autotuner
        def __getitem__(self, grid):
            raise AssertionError("the autotuner ran for a pinned configuration")

    cfg = GemmConfig(16, 16, 32, group_m=2, num_stages=2, num_warps=4, epi_subtile=True)
    v = G.GEMM_VARIANTS["ptr_persistent"]
    key = ("test-pinned", *a.shape, w.shape[0])
    G._GEMM_PLANS.pop(key, None)
    outs = []
    for _ in range(2):
        c = torch.empty(a.shape[0], w.shape[0], dtype=torch.float16)
        args = G._gemm_args(a, sa, w, w.stride(), sb, None, c, w.shape[0])
        G._launch_tuned(NoTuner(), G._RAW_GEMMS["ptr_persistent"], key, a.shape[0], w.shape[0], args,
                        {"HAS_SB": True, "HAS_BIAS": False, "EVEN_K": a.shape[1] % 32 == 0}, None,
                        pinned=(cfg.meta(v), cfg.options()), programs=3)
        outs.append(c)
    G._GEMM_PLANS.pop(key, None)
    return all(torch.equal(c, ref) for c in outs)


@pytest.mark.skipif(not _interpreter_runs_int8_dots(), reason="needs triton >= 3.9 for the CPU interpreter")
def test_gemm_variants_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env.pop(G.GEMM_KERNEL_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "tests.test_int8_gemm_kernels"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"ptr", "ptr_persistent", "tma", "tma_persistent", "tma_split_tail"} <= set(res["variants"])
    assert len(res["cases"]) == 2 * 2 * len(res["variants"])
    for c in res["cases"]:
        assert c["identical"] and c.get("nmajor_identical", True) and c.get("workspace_clean", True), c
    assert res["forced_persistent"] and res["pinned_plan"]


# ------------------------------------------------------------------------------------------------ host logic
def _table(*entries: dict) -> dict:
    return {"entries": list(entries)}


def _entry(gpu: str, n: int, k: int, bucket: int, variant: str, bm: int = 128, **extra) -> dict:
    return {"gpu": gpu, "n": n, "k": k, "m_bucket": bucket, "variant": variant,
            "config": {"block_m": bm, "block_n": 256, "block_k": 128, "num_stages": 4}, **extra}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Installs a table file; restores the shipped one and the kernel setting afterwards."""
    def install(data: dict) -> Path:
        path = tmp_path / "table.json"
        path.write_text(json.dumps(data), encoding="utf-8")
        G.set_gemm_table(path)
        return path

    monkeypatch.delenv(G.GEMM_TABLE_ENV, raising=False)
    yield install
    G.set_gemm_kernel("auto")
    G.set_gemm_table(None)


needs_variants = pytest.mark.skipif(
    not {"tma", "tma_persistent"} <= set(G.available_gemm_variants()), reason="needs triton with descriptors")


@needs_variants
def test_pinned_lookup_nearest_bucket_name_then_capability(table):
    table(_table(_entry("NVIDIA H200", 3072, 3072, 8192, "tma_persistent"),
                 _entry("NVIDIA H200", 3072, 3072, 512, "ptr", bm=64),
                 _entry("sm90", 4096, 4096, 1024, "tma"),
                 _entry("NVIDIA H200", 4096, 4096, 1024, "ptr", b_kmajor=False)))
    h200 = ("NVIDIA H200", "sm90")
    assert G.pinned_gemm(h200, 3072, 3072, 4352) == ("tma_persistent", GemmConfig(128, 256, 128, num_stages=4))
    assert G.pinned_gemm(h200, 3072, 3072, 300)[0] == "ptr"  # bucket 512
    assert G.pinned_gemm(h200, 3072, 3072, 20)[1].block_m == 64  # nearest: 512
    assert G.pinned_gemm(h200, 3072, 3072, 2048)[0] == "tma_persistent"  # 2048: 2 from 8192, 2 from 512 -> larger
    assert G.pinned_gemm(h200, 4096, 4096, 900) == ("tma", GemmConfig(128, 256, 128, num_stages=4))  # capability
    assert G.pinned_gemm(h200, 4096, 4096, 900, b_kmajor=False)[0] == "ptr"
    assert G.pinned_gemm(("NVIDIA A100", "sm80"), 3072, 3072, 4352) is None  # unknown GPU: autotuner
    assert G.pinned_gemm(h200, 1024, 4096, 300) is None  # unknown shape


@needs_variants
def test_choice_follows_setting_and_table(table, monkeypatch):
    table(_table(_entry("NVIDIA H200", 3072, 3072, 8192, "tma_persistent")))
    monkeypatch.setattr(G, "_gpu_names", lambda device: ("NVIDIA H200", "sm90"))
    dev = torch.device("cpu")
    pinned = GemmConfig(128, 256, 128, num_stages=4)
    assert G._choose(dev, 4352, 3072, 3072, True) == (G.GEMM_VARIANTS["tma_persistent"], pinned)
    assert G._choose(dev, 4352, 3072, 8192, True) == (G.GEMM_VARIANTS["ptr"], None)  # not pinned: ptr, tuned
    G.set_gemm_kernel("tma_persistent")
    assert G._choose(dev, 4352, 3072, 3072, True) == (G.GEMM_VARIANTS["tma_persistent"], pinned)
    G.set_gemm_kernel("tma")  # forced to another variant than the table's: its autotuner
    assert G._choose(dev, 4352, 3072, 3072, True) == (G.GEMM_VARIANTS["tma"], None)
    monkeypatch.setattr(G, "_gpu_names", lambda device: ("NVIDIA L4", "sm89"))
    G.set_gemm_kernel("auto")
    assert G._choose(dev, 4352, 3072, 3072, True) == (G.GEMM_VARIANTS["ptr"], None)


@needs_variants
def test_table_errors_and_settings(table, tmp_path, monkeypatch):
    with pytest.raises(UserError, match="malformed"):
        table(_table({"gpu": "sm90", "n": 1, "k": 1, "m_bucket": 1, "variant": "bogus", "config": {}}))
    with pytest.raises(UserError, match="malformed"):
        table(_table(_entry("sm90", 1, 1, 1, "ptr") | {"config": {"block_m": 1, "colour": 2}}))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    monkeypatch.setenv(G.GEMM_TABLE_ENV, str(bad))
    with pytest.raises(UserError, match=G.GEMM_TABLE_ENV):
        G.set_gemm_table(None)
    monkeypatch.setenv(G.GEMM_TABLE_ENV, str(tmp_path / "missing.json"))  # a typo is an error, not "no table"
    with pytest.raises(UserError, match="cannot read"):
        G.set_gemm_table(None)
    monkeypatch.setenv(G.GEMM_TABLE_ENV, "none")  # no table: every shape autotuned
    G.set_gemm_table(None)
    assert G.pinned_gemm(("NVIDIA H200", "sm90"), 16384, 3072, 4352) is None
    monkeypatch.delenv(G.GEMM_TABLE_ENV)
    G.set_gemm_table(None)  # the shipped table parses and has the H200's DiT shapes (pointer ones at least)
    assert G.pinned_gemm(("NVIDIA H200", "sm90"), 3072, 3072, 4352)[0] in G.available_gemm_variants()
    with pytest.raises(ValueError, match="unknown ConvRot GEMM kernel"):
        G.set_gemm_kernel("fastest")
    ws = G.GEMM_VARIANTS["tma_persistent_ws"]
    meta = GemmConfig(128, 256, 128, epi_subtile=True).meta(ws)
    assert meta["WARP_SPEC"] and not meta["FLATTEN"] and meta["EPI_SUBTILE"]
    assert set(GemmConfig(64, 64, 64).meta(G.GEMM_VARIANTS["ptr"])) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"}
    assert G.gemm_m_bucket(300) == 512 and G.gemm_m_bucket(4352) == 8192 and G.gemm_m_bucket(20000) == 8192


# ------------------------------------------------------------------------------------------------ the sweep
def test_sweep_arguments_and_cases():
    args = S.parse_args(["--out", "x.json"])
    assert args.parts == list(S.PARTS) and args.budget_s == 240 and args.reps >= 20 and args.te_ms == S.TE_MS
    for bad in (["--parts", "dit,vae"], ["--variants", "ptr,fast"], ["--reps", "5"], ["--te_ms", "a"]):
        with pytest.raises(SystemExit):
            S.parse_args(["--out", "x.json", *bad])
    with pytest.raises(SystemExit):
        S.parse_args([])  # --out is required
    cases = S.sweep_cases(["dit", "bwd"])
    assert [(c.m, c.n, c.k, c.b_kmajor) for c in cases] == [
        (4352, 3072, 3072, True), (4352, 16384, 3072, True), (4352, 3072, 8192, True),
        (4352, 3072, 3072, False), (4352, 3072, 16384, False), (4352, 8192, 3072, False)]
    variants = list(G.GEMM_VARIANTS)
    work = S.work_list(cases, variants)
    assert all(c.b_kmajor or not G.GEMM_VARIANTS[v].tma for c, v, _ in work)  # TMA: K-major only
    persistent = S.sweep_configs("tma_persistent")
    assert any(c.epi_subtile for c in persistent) and any(not c.flatten for c in persistent)
    assert len(set(persistent)) == len(persistent) and len(S.sweep_configs("ptr", small=True)) < len(S._BROAD)
    assert len(S.compile_tasks(work)) == len({(c.signature(), v, cfg) for c, v, cfg in work})
    te = S.Case("te", 300, 1024, 12288)
    assert te.proxy().signature() == te.signature() and te.proxy().m < 300 and te.proxy().k < 12288


def test_sweep_text_encoder_shapes():
    shapes = S.te_linear_shapes()
    # hidden 4096, MLP 12288, q (with its gate) 8192, k/v 1024, Gated DeltaNet qkv 8192 / z and out 4096
    assert set(shapes) == {(8192, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (4096, 12288)}


def test_sweep_summary_and_table_entries(tmp_path):
    rows = [{"variant": "ptr", "config": {"block_m": 1}, "ms": 0.5, "tops": 10.0, "exact": True},
            {"variant": "tma", "config": {"block_m": 2}, "ms": 0.2, "tops": 25.0, "exact": False},
            {"variant": "tma_persistent", "config": {"block_m": 3}, "ms": 0.4, "tops": 12.5, "exact": True},
            {"variant": "ptr", "config": {"block_m": 4}, "failed": "OutOfResources"}]
    s = S.summarise(rows, {"bf16_linear": {"ms": 0.6}, "quantiser": {"ms": 0.05}})
    assert s["best"]["variant"] == "tma_persistent"  # the faster inexact row never wins
    assert s["bf16_over_int8_gemm"] == pytest.approx(1.5) and s["bf16_over_int8_linear"] == pytest.approx(0.6 / 0.45)
    assert set(s["best_per_variant"]) == {"ptr", "tma_persistent"}
    # the table names a TMA variant only where its GPU time hides the extra host time
    assert S.table_choice(rows, 0.3)["variant"] == "tma_persistent"
    assert S.table_choice(rows, 0.45)["config"] == {"block_m": 1}
    results = [{"m": 4352, "n": 8, "k": 16, "b_kmajor": True, "rows": rows},
               {"m": 300, "n": 8, "k": 16, "b_kmajor": True, "rows": rows[1:2]}]
    entries = S.table_entries(results, ["NVIDIA H200"], 0.3)
    assert len(entries) == 1 and entries[0]["m_bucket"] == 8192 and entries[0]["variant"] == "tma_persistent"
    assert G.parse_gemm_table({"entries": [entries[0] | {"config": GemmConfig(64, 64, 64).to_json()}]}, "t")
    # --from_json: the table of an earlier sweep, chosen again without a GPU, merged into an existing table
    src = tmp_path / "sweep.json"
    rows_ok = [r | {"config": GemmConfig(64, 64, 64, epi_subtile=i > 1).to_json()} for i, r in enumerate(rows)]
    src.write_text(json.dumps({"env": {"gpu": "NVIDIA H200", "capability": [9, 0]},
                               "cases": [results[0] | {"rows": rows_ok}]}))
    out = tmp_path / "table.json"
    kept = _entry("NVIDIA H200", 8, 16, 512, "ptr", bm=32)
    replaced = _entry("NVIDIA H200", 8, 16, 8192, "tma", bm=32)
    out.write_text(json.dumps({"about": "mine", "entries": [kept, replaced]}))
    S.main(["--from_json", str(src), "--table_out", str(out), "--tma_min_us", "450", "--merge_table",
            "--capability_rows"])
    doc = json.loads(out.read_text())
    table = G.parse_gemm_table(doc, str(out))
    assert doc["about"] == "mine"
    assert table[("NVIDIA H200", 8, 16, True)] == [(512, "ptr", GemmConfig(32, 256, 128, num_stages=4)),
                                                   (8192, "ptr", GemmConfig(64, 64, 64))]
    assert table[("sm90", 8, 16, True)] == [(8192, "ptr", GemmConfig(64, 64, 64))]
    S.main(["--from_json", str(src), "--table_out", str(out)])  # without --merge_table: only the sweep's rows
    assert [e["gpu"] for e in json.loads(out.read_text())["entries"]] == ["NVIDIA H200"]
    with pytest.raises(SystemExit):
        S.parse_args(["--from_json", str(src)])  # needs --table_out


if __name__ == "__main__":  # python -m tests.test_int8_gemm_kernels under TRITON_INTERPRET=1
    print(json.dumps(run_checks()))


def test_shipped_table_keeps_small_m_on_the_pointer_kernel():
    """The shipped table sends short sequences (single captions) to the pointer kernel, whose raw launch is cheap
    on the host, and longer ones to the swept winners; every row parses and names a known variant."""
    G.set_gemm_table(G.DEFAULT_GEMM_TABLE)
    try:
        rows = json.loads(G.DEFAULT_GEMM_TABLE.read_text(encoding="utf-8"))["entries"]
        assert rows and all(r["variant"] in G.GEMM_VARIANTS for r in rows)
        te_shapes = {(r["n"], r["k"]) for r in rows if r["m_bucket"] == 512}
        assert te_shapes, "no small-M rows"
        for gpu in (("NVIDIA H200", "sm90"), ("NVIDIA H100 80GB HBM3", "sm90")):
            for n, k in te_shapes:
                for m in (1, 20, 77, 300, 512):
                    variant, _ = G.pinned_gemm(gpu, n, k, m)
                    assert not G.GEMM_VARIANTS[variant].tma, (gpu, n, k, m, variant)
                assert G.pinned_gemm(gpu, n, k, 2560) is not None
        assert G.pinned_gemm(("NVIDIA A100-SXM4-80GB", "sm80"), 4096, 4096, 300) is None
    finally:
        G.set_gemm_table(None)
