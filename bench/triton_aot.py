#!/usr/bin/env python
"""Compile the ConvRot INT8 Triton kernels for a GPU architecture on a machine without that GPU (or without any),
and report what each compiled kernel needs per thread: registers, spill stack, shared memory.

Triton compiles down to a cubin with the ptxas its wheel ships, so a kernel that does not build for sm_90, or a tile
shape that spills, shows here before any device time is spent on it. The figures are those of this machine's Triton,
which may differ from another version's.

    python -m bench.triton_aot --out aot.json               # the default tiles of each kernel, sm_90
    python -m bench.triton_aot --sweep --arch 90 --out aot.json

Kernels: the one-kernel forward of few rows (`fused`), the two-pass tensor-core quantiser (`tiles_mma`), the
one-pass quantisers at K = 3072 (`rows`, and `quarters`, the default, also at 8192 with --sweep), the pointer GEMM
at the pinned table's pointer configurations (`ptr`), and the DiT block's fused element-wise kernels, forward and
backward, at full width (`elementwise`: RMSNorm + modulation, q/k norm + RoPE, SwiGLU, the gated residual, and
the norm + modulation and SwiGLU that write ConvRot INT8 codes too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KINDS = ("fused", "tiles_mma", "rows", "quarters", "ptr", "elementwise")


def _triton() -> Any:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as e:  # any import failure: no ahead-of-time compilation here
        raise SystemExit(f"bench.triton_aot needs triton with its NVIDIA backend ({type(e).__name__}: {e})") from e
    return triton, GPUTarget, ASTSource


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """What the cuobjdump that Triton's NVIDIA backend ships prints for a cubin with `flag`."""
    triton, _, _ = _triton()
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(tool), flag, str(path)], capture_output=True, text=True, check=True).stdout


_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def sass_counts(cubin: bytes) -> dict[str, int]:
    """Instructions of a cubin's machine code by opcode (the part before the first dot), and "total"."""
    counts: dict[str, int] = {}
    for line in _cuobjdump(cubin, "-sass").splitlines():
        m = _SASS_LINE.match(line)
        if m:
            op = m.group(1).split(".")[0]
            counts[op] = counts.get(op, 0) + 1
    counts["total"] = sum(counts.values())
    return counts


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of a cubin, read with the cuobjdump that Triton's NVIDIA backend ships."""
    text = _cuobjdump(cubin, "--dump-resource-usage")
    usage: dict[str, int] = {}
    for line in text.splitlines():
        if "REG:" in line:
            for item in line.split():
                name, _, value = item.partition(":")
                if name in ("REG", "STACK", "SHARED", "LOCAL") and value.isdigit():
                    usage[name.lower()] = int(value)
    return usage


def compile_kernel(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], options: dict[str, int],
                   arch: int, divisible: tuple[str, ...] = (), values: int = 0) -> dict[str, Any]:
    """Compile `fn` (a @triton.jit function) for sm_`arch` with these argument types, constexprs and launch options
    (num_warps, num_stages). A launch specialises as the real ones do: every pointer 16-byte aligned and the integer
    arguments named in `divisible` multiples of 16 (unit strides are given as constexprs of 1, as Triton specialises
    them). Without that, Triton builds another kernel (for example a GEMM without its pipelined stages). `values`: the
    activation values (slots, padding included) one program of a quantiser holds, for its instructions per value."""
    triton, GPUTarget, ASTSource = _triton()
    names = fn.arg_names
    aligned = [k for k, v in signature.items() if v.startswith("*")] + list(divisible)
    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}},
                    constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    t0 = time.perf_counter()
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))
    row = {"kernel": fn.__name__, **options, "compile_s": round(time.perf_counter() - t0, 2),
           **{k: v for k, v in constexprs.items() if k.startswith(("BLOCK", "BM", "NCH", "CH", "GROUP"))},
           **resource_usage(kernel.asm["cubin"]), "dynamic_shared": int(kernel.metadata.shared)}
    sass = sass_counts(kernel.asm["cubin"])
    row["sass_instructions"] = sass["total"]
    row["sass_shuffles"] = sass.get("SHFL", 0)
    if values:  # a quantiser: the machine instructions of one thread per activation value (slot) it holds
        row["values_per_thread"] = values // (32 * options["num_warps"])
        row["sass_per_value"] = round(row["sass_instructions"] / row["values_per_thread"], 2)
    row["spills"] = row.get("stack", 0) > 0 or row.get("local", 0) > 0
    return row


Job = tuple[Any, dict[str, str], dict[str, Any], dict[str, int], tuple[str, ...], int]


def jobs(kinds: tuple[str, ...], sweep: bool) -> list[Job]:
    """(kernel, signature, constexprs, launch options, integer arguments that are multiples of 16, the values one
    program holds: one-pass quantisers only, else 0) to compile, at the shapes the product launches (K a multiple of
    256, the DiT's and the encoder's widths): the defaults, and with `sweep` the alternatives."""
    from library.quant import convrot_quant_kernels as Q
    from library.quant import fused_linear_kernels as F
    from library.quant import int8_gemm_kernels as G

    bf16 = {"T_CODE": 2, "TINY": 1.1754943508222875e-38}
    out: list[Job] = []
    if "fused" in kinds:
        sig = {"x_ptr": "*bf16", "w_ptr": "*i8", "c_ptr": "*bf16", "sb_ptr": "*fp32", "bias_ptr": "*bf16",
               "h_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
               "stride_cm": "i32"}
        tiles = [(F._FUSED["block_m"], F._FUSED["block_n"], F._FUSED["warps"])]
        tiles += [(32, 64, 4), (16, 128, 4), (32, 128, 8), (16, 64, 8)] if sweep else []
        out += [(F._fused_quant_gemm_kernel, sig, {**bf16, "HAS_BIAS": False, "BLOCK_M": bm, "BLOCK_N": bn,
                                                   "GATHER": False}, {"num_warps": w},
                 ("N", "K", "stride_xm", "stride_wn", "stride_cm"), 0) for bm, bn, w in tiles]
    if "tiles_mma" in kinds:
        sig = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "h_ptr": "*bf16", "M": "i32", "K": "i32",
               "stride_xm": "i32", "stride_qm": "i32"}
        tiles = [(Q._TUNING["tiles_bm"], Q._TUNING["tiles_warps"])]
        tiles += [(16, 4), (64, 8), (32, 8)] if sweep else []
        out += [(Q._rot_quant_tiles_mma_kernel, sig, {**bf16, "BM": bm, "GATHER": False}, {"num_warps": w},
                 ("K", "stride_xm", "stride_qm"), 0) for bm, w in tiles]  # loops over K: no count a value
    if "rows" in kinds:
        bm, nch, ch, warps = Q._rows_launch(3072, 256)
        sig = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "h_ptr": "*fp32", "M": "i32", "K": "i32",
               "stride_xm": "i32", "stride_qm": "i32"}
        out.append((Q._rot_quant_rows_kernel, sig, {**bf16, "LOG4G": 4, "BM": bm, "NCH": nch, "CH": ch,
                                                     "EVEN": False, "MMA": False, "GATHER": False},
                    {"num_warps": warps}, ("K", "stride_xm", "stride_qm"), bm * nch * ch))
    if "quarters" in kinds:  # the default quantiser at the DiT's widths (K = 3072: two parts, 8 + 4 groups)
        sig = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "h_ptr": "*fp32", "M": "i32", "K": "i32",
               "stride_xm": "i32", "stride_qm": "i32"}
        for k in (3072, 8192) if sweep else (3072,):
            bm, nch_a, nch_b, warps, fills = Q._quarters_launch(k, 256)
            out.append((Q._rot_quant_quarters_kernel, sig, {**bf16, "LOG4G": 4, "BM": bm, "NCH_A": nch_a,
                                                             "NCH_B": nch_b, "EVEN": fills, "FAST_DIV": True,
                                                             "GATHER": False},
                        {"num_warps": warps}, ("K", "stride_xm", "stride_qm"), bm * k))
    if "ptr" in kinds:
        sig = {"a_ptr": "*i8", "b_ptr": "*i8", "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
               "bias_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "M_BUCKET": "i32", "stride_am": "i32",
               "stride_bn": "i32", "stride_cm": "i32"}  # A and C row-major, B = W^T (K-major): unit strides below
        configs = {(c["block_m"], c["block_n"], c["block_k"], c["group_m"], c["num_warps"], c["num_stages"])
                   for c in (e["config"] for e in json.loads((Path(G.__file__).parent / "int8_gemm_table.json")
                                                             .read_text())["entries"] if e["variant"] == "ptr")}
        for bm, bn, bk, gm, w, stages in sorted(configs)[: None if sweep else 1]:
            out.append((G._int8_gemm_kernel, sig, {"stride_ak": 1, "stride_bk": 1, "stride_cn": 1, "HAS_SB": True,
                                                    "HAS_BIAS": False, "EVEN_K": True, "BLOCK_M": bm, "BLOCK_N": bn,
                                                    "BLOCK_K": bk, "GROUP_M": gm},
                        {"num_warps": w, "num_stages": stages}, ("N", "K", "M_BUCKET", "stride_am", "stride_bn",
                                                                 "stride_cm"), 0))
    if "elementwise" in kinds:
        out += elementwise_jobs()
    return out


def elementwise_jobs() -> list[Job]:
    """The fused element-wise kernels of a block (`library.runtime.fused_kernels`) as a 1024x1024 step launches them:
    bf16, 4,352 tokens, width 3,072 in 24 heads of 128, FFN 8,192."""
    from library.runtime import fused_kernels as E

    rows = {"n_rows": "i32", "seq": "i32", "heads": "i32"}
    tables = {"cs_b": "i32", "cs_s": "i32", "eps": "fp32"}
    rope = {"HALF": 64, "BR": E.TUNING["rope_rows"]}
    rope_div = ("n_rows", "seq", "cs_b", "cs_s")
    fwd = {"x_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "y_ptr": "*bf16", **rows,
           "xs_b": "i32", "xs_s": "i32", "xs_h": "i32", **tables}
    bwd = {"g_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
           "dx_ptr": "*bf16", **rows, "gs_b": "i32", "gs_s": "i32", "gs_h": "i32", "xs_b": "i32", "xs_s": "i32",
           "xs_h": "i32", **tables}
    warps, swiglu_warps = {"num_warps": E.TUNING["rope_warps"]}, {"num_warps": E.TUNING["swiglu_warps"]}
    mod = {"seq": "i32", "width": "i32"}
    residual = {"BR": E.TUNING["residual_rows"], "BLOCK": E.TUNING["residual_block"]}
    quant, ffn_quant = E.fused_quant_plan(3072, 256), E.fused_quant_plan(8192, 256)
    return [
        (E._norm_rope_fwd_kernel, fwd, rope, warps, (*rope_div, "xs_b", "xs_s", "xs_h"), 0),
        (E._norm_rope_bwd_kernel, bwd, rope, warps, (*rope_div, "gs_b", "gs_s", "gs_h", "xs_b", "xs_s", "xs_h"), 0),
        (E._swiglu_fwd_kernel, {"u_ptr": "*bf16", "y_ptr": "*bf16", "width": "i32", "u_row": "i32"},
         {"BLOCK": E.TUNING["swiglu_block"]}, swiglu_warps, ("width", "u_row"), 0),
        (E._swiglu_bwd_kernel, {"g_ptr": "*bf16", "u_ptr": "*bf16", "du_ptr": "*bf16", "width": "i32",
                                "g_row": "i32", "u_row": "i32"}, {"BLOCK": E.TUNING["swiglu_block"]}, swiglu_warps,
         ("width", "g_row", "u_row"), 0),
        (E._norm_modulate_fwd_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "shift_ptr": "*bf16", "scale_ptr": "*bf16",
                                       "y_ptr": "*bf16", **mod, "x_row": "i32", "mod_b": "i32", "eps": "fp32"},
         {"BLOCK": 4096}, {"num_warps": E.TUNING["row_warps"]}, ("seq", "width", "x_row", "mod_b"), 0),
        (E._norm_modulate_bwd_kernel, {"g_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "scale_ptr": "*bf16",
                                       "dx_ptr": "*bf16", **mod, "g_row": "i32", "x_row": "i32", "mod_b": "i32",
                                       "eps": "fp32"},
         {"BLOCK": 4096}, {"num_warps": E.TUNING["row_warps"]}, ("seq", "width", "g_row", "x_row", "mod_b"), 0),
        (E._gated_residual_fwd_kernel, {"x_ptr": "*bf16", "gate_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*bf16",
                                        **mod, "n_tiles": "i32", "x_row": "i32", "y_row": "i32", "gate_b": "i32"},
         residual, {"num_warps": E.TUNING["residual_warps"]}, ("seq", "width", "n_tiles", "x_row", "y_row"), 0),
        (E._gated_residual_bwd_kernel, {"g_ptr": "*bf16", "gate_ptr": "*bf16", "dy_ptr": "*bf16", **mod,
                                        "n_tiles": "i32", "g_row": "i32", "gate_b": "i32"},
         residual, {"num_warps": E.TUNING["residual_warps"]}, ("seq", "width", "n_tiles", "g_row"), 0),
        # the norm + modulation with the ConvRot INT8 codes of its rows (an INT8 block's q/k/v and FFN inputs)
        (E._norm_modulate_quant_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "shift_ptr": "*bf16",
                                         "scale_ptr": "*bf16", "y_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32",
                                         "r_ptr": "*bf16", "gate_ptr": "*bf16", "xo_ptr": "*bf16", "M": "i32",
                                         "seq": "i32", "K": "i32", "x_row": "i32", "r_row": "i32", "mod_b": "i32",
                                         "eps": "fp32"},
         {"T_CODE": 2, "TINY": 1.1754943508222875e-38, "LOG4G": 4, "BM": quant[0], "NCH_A": quant[1],
          "NCH_B": quant[2], "EVEN": quant[4], "FAST_DIV": True, "GATHER": False, "WRITE_Y": True,
          "RESIDUAL": False},
         {"num_warps": quant[3]}, ("seq", "K", "x_row", "mod_b"), 0),
        # SwiGLU with the ConvRot INT8 codes of its rows (an INT8 block's ffn_down input)
        (E._swiglu_quant_kernel, {"u_ptr": "*bf16", "y_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "M": "i32",
                                  "F": "i32", "u_row": "i32"},
         {"T_CODE": 2, "TINY": 1.1754943508222875e-38, "LOG4G": 4, "BM": ffn_quant[0], "NCH_A": ffn_quant[1],
          "NCH_B": ffn_quant[2], "EVEN": ffn_quant[4], "FAST_DIV": True, "GATHER": False, "WRITE_Y": True},
         {"num_warps": ffn_quant[3]}, ("F", "u_row"), 0),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.triton_aot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: Hopper)")
    p.add_argument("--kernels", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--sweep", action="store_true", help="also the alternative tile shapes")
    p.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    ns = p.parse_args(argv)
    kinds = tuple(k.strip() for k in ns.kernels.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        print(f"unknown --kernels {unknown}: choose from {', '.join(KINDS)}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the kernels' own setting (and no warning)
    triton, _, _ = _triton()
    rows = []
    for fn, sig, const, options, divisible, values in jobs(kinds, ns.sweep):
        try:
            rows.append(compile_kernel(fn, sig, const, options, ns.arch, divisible, values))
        except Exception as e:  # noqa: BLE001 - a kernel that does not build is a result, not a crash
            rows.append({"kernel": fn.__name__, **options, "error": f"{type(e).__name__}: {e}"[:2000]})
        print(json.dumps(rows[-1]), flush=True)
    payload = {"command": " ".join(["python", "-m", "bench.triton_aot", *(argv if argv is not None else sys.argv[1:])]),
               "triton": triton.__version__, "arch": ns.arch, "kernels": rows}
    if ns.out:
        tmp = ns.out.with_name(f".{ns.out.name}.tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, ns.out)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
