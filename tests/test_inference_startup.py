"""The inference script's start-up: what its import leaves out, the DiT and VAE read beside the text encoder (the
same images as the sequential order), the start-up timings, and bench.infer_oneshot on the tiny snapshot."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import moss_image_minimal_inference as inf
from bench import infer_oneshot
from library.files.safetensors_io import load_safetensors
from library.runtime import startup
from library.runtime.phase_timer import last_run_timings

REPO = Path(__file__).resolve().parent.parent

# imported only where used: a compile (torch._dynamo / _inductor), the text encoder's load (transformers,
# accelerate), --te_quant int8/nf4 (bitsandbytes), the decode (PIL); never by inference (the trainer, diffusers)
LAZY_MODULES = ("torch._dynamo", "torch._inductor", "transformers", "accelerate", "bitsandbytes", "diffusers", "PIL",
                "library.training.network_trainer", "networks.lora_generic")


def _loaded_in_fresh_process(statement: str) -> list[str]:
    code = textwrap.dedent(f"""
        import json, sys
        {statement}
        print(json.dumps([m for m in {LAZY_MODULES!r} if m in sys.modules]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_script_leaves_the_heavy_modules_out():
    assert _loaded_in_fresh_process("import moss_image_minimal_inference") == []


def test_help_and_the_convrot_modules_leave_dynamo_out():
    statement = ("import library.quant.convrot, moss_image_minimal_inference as inf\n"
                 "        try:\n            inf.setup_parser().parse_args(['--help'])\n"
                 "        except SystemExit:\n            pass")
    assert _loaded_in_fresh_process(statement) == []


def _run(snapshot, out, *extra):
    argv = ["--snapshot", str(snapshot), "--image_size", "32", "32", "--infer_steps", "3", "--seed", "5",
            "--save_path", str(out), "--device", "cpu", "--output_type", "both", *extra]
    return inf.run(inf.setup_parser().parse_args(argv))


def test_loading_together_gives_the_images_of_the_sequential_order(tiny_snapshot, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=inf.logger.name)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square --n blurry\na blue circle --w 48 --h 32\n")
    from library.sampling import generation

    order: list[str] = []
    real_denoise, real_add = generation.denoise, generation.PngWriter.add
    monkeypatch.setattr(generation, "denoise", lambda *a, **k: order.append("denoise") or real_denoise(*a, **k))
    monkeypatch.setattr(generation.PngWriter, "add", lambda self, *a: order.append("decode") or real_add(self, *a))
    together = _run(tiny_snapshot, tmp_path / "together", "--from_file", str(prompts))
    assert "reading the DiT and the VAE while the text encoder encodes" in caplog.text
    assert "DiT + VAE load" in caplog.text
    assert order == ["denoise", "decode"] * 2  # the VAE beside the DiT: each image decoded once denoised
    caplog.clear()
    order.clear()
    monkeypatch.setattr(inf, "loads_overlap", lambda *a: False)
    sequential = _run(tiny_snapshot, tmp_path / "sequential", "--from_file", str(prompts))
    assert "while the text encoder encodes" not in caplog.text and "DiT load" in caplog.text
    assert order == ["denoise"] * 2 + ["decode"] * 2  # the DiT freed first
    assert len(together) == len(sequential) == 4

    def by_kind(paths, suffix):
        return [p for p in sorted(paths, key=lambda p: p.name.split("_", 1)[1]) if p.suffix == suffix]

    for a, b in zip(by_kind(together, ".safetensors"), by_kind(sequential, ".safetensors")):
        assert torch.equal(load_safetensors(a)["latents"], load_safetensors(b)["latents"])
    for a, b in zip(by_kind(together, ".png"), by_kind(sequential, ".png")):
        assert np.array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b)))


def test_the_text_encoder_build_window_does_not_reach_the_models_read_beside_it(tiny_snapshot, tmp_path,
                                                                                  monkeypatch):
    """accelerate's init_empty_weights (the text encoder's build) patches nn.Module for every thread: a DiT filled
    in that window would get meta parameters. The builds take turns."""
    from accelerate import init_empty_weights

    real = inf.load_text_encoder_for

    def slow_build(args, device):
        with init_empty_weights(include_buffers=False):
            time.sleep(1.5)  # the DiT and the VAE load in well under that here
        return real(args, device)

    monkeypatch.setattr(inf, "load_text_encoder_for", slow_build)
    seen = {}
    real_denoise = inf.denoise_all

    def denoise_all(dit, *a, **k):
        seen["meta"] = [n for n, p in dit.named_parameters() if p.is_meta]
        return real_denoise(dit, *a, **k)

    monkeypatch.setattr(inf, "denoise_all", denoise_all)
    assert len(_run(tiny_snapshot, tmp_path, "--prompt", "a cat")) == 2
    assert seen["meta"] == []


def test_when_the_models_load_together(tiny_snapshot, monkeypatch):
    args = inf.setup_parser().parse_args(["--snapshot", str(tiny_snapshot), "--prompt", "x", "--device", "cpu"])
    inf.resolve_args(args)
    cpu = torch.device("cpu")
    assert inf.loads_overlap(args, cpu, torch.float32)
    sizes = [inf._checkpoint_bytes(args.text_encoder, "text_encoder"), inf._checkpoint_bytes(args.dit, "transformer"),
             inf._checkpoint_bytes(args.vae, "vae")]
    assert all(s > 0 for s in sizes)
    assert inf._checkpoint_bytes(str(tiny_snapshot), "transformer") == sizes[1]  # a snapshot root: its transformer/
    need = sum(sizes) + sizes[1] + inf.OVERLAP_HEADROOM_BYTES  # fp32 doubles the bf16 DiT
    monkeypatch.setattr(inf, "_free_memory_bytes", lambda device: need - 1)
    assert not inf.loads_overlap(args, cpu, torch.float32)
    assert inf.loads_overlap(args, cpu, torch.bfloat16)
    monkeypatch.setattr(inf, "_free_memory_bytes", lambda device: 2**50)
    args.blocks_to_swap = 2
    assert not inf.loads_overlap(args, cpu, torch.float32)  # block swap plans for one model at a time
    args.blocks_to_swap, args.vram_budget = None, 24.0
    assert not inf.loads_overlap(args, cpu, torch.float32)  # so does a memory budget


def test_startup_timings_are_logged_recorded_and_read_by_the_bench(tiny_snapshot, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=inf.logger.name)
    _run(tiny_snapshot, tmp_path, "--prompt", "a cat")
    t = last_run_timings()
    assert tuple(t) == inf.TIMING_KEYS
    assert 0 < t["startup"] < t["wall"] and 0 < t["text_encoder_import"] <= t["text_encoder_load"]
    parsed = infer_oneshot.parse_log(caplog.text)
    assert parsed["loads_overlapped"] and parsed["to_png_s"] == pytest.approx(t["wall"], abs=0.01)
    assert parsed["phases_s"]["encode"] == pytest.approx(t["encode"], abs=0.01)
    assert parsed["phases_s"]["dit_and_vae_load_beside"] == pytest.approx(t["dit_load"] + t["vae_load"], abs=0.01)
    assert len(parsed["denoise_per_prompt_s"]) == 1 and parsed["interval_per_prompt_s"] == []


def test_the_interval_between_two_images_is_logged_and_read_by_the_bench(tiny_snapshot, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=inf.logger.name)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog on a hill\n")
    _run(tiny_snapshot, tmp_path / "out", "--from_file", str(prompts))
    parsed = infer_oneshot.parse_log(caplog.text)
    (interval,) = parsed["interval_per_prompt_s"]
    assert len(parsed["denoise_per_prompt_s"]) == 2 and interval >= parsed["denoise_per_prompt_s"][1] - 0.01


def test_process_start_and_the_collector():
    code = ("import time; time.sleep(0.3); from library.runtime import startup;"
            " print(startup.seconds_since_process_start())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert 0.3 <= float(proc.stdout) < 30
    assert gc.isenabled() and not startup.gc_frozen()
    with startup.imports_without_gc():
        assert not gc.isenabled()
    assert gc.isenabled() and not startup.gc_frozen()
    with startup.frozen_imports():
        assert startup.gc_frozen()
        with startup.imports_without_gc():
            made = [object() for _ in range(3)]
        assert gc.isenabled() and startup.gc_frozen()
    assert not startup.gc_frozen() and made


def test_oneshot_bench_runs_the_script_in_a_fresh_process(tiny_snapshot, tmp_path):
    out = tmp_path / "out"
    argv = ["--snapshot", str(tiny_snapshot), "--out", str(out), "--work", str(tmp_path / "work"), "--runs", "eager",
            "--steps", "2", "--image_size", "32", "32", "--device", "cpu", "--no_bytecode"]
    assert infer_oneshot.main(argv) == 0
    report = json.loads((out / "infer_oneshot.json").read_text())
    (run,) = report["runs"]
    assert run["returncode"] == 0 and run["pngs"] == 1 and run["loads_overlapped"]
    assert 0 < run["phases_s"]["startup"] < run["to_png_s"] <= run["exit_s"]
    assert (out / "infer_oneshot_0_eager.log").exists()
    assert sorted(p.name for p in out.iterdir()) == ["infer_oneshot.json", "infer_oneshot_0_eager.log"]


def _launched(args, run: str, tmp_path, probe_code: str, *argv: str) -> str:
    """What `probe_code` prints when run through the launcher of `infer_oneshot`'s `run` in place of the script."""
    cmd = infer_oneshot.run_command(args, run, tmp_path / "out", tmp_path / "p.txt")
    assert cmd[1] == "-c" and cmd[3] == infer_oneshot.SCRIPT and "--compile" in cmd
    probe = tmp_path / "probe.py"
    probe.write_text(probe_code)
    return subprocess.run([sys.executable, "-c", cmd[2], str(probe), *argv], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parent.parent).stdout.strip()


def test_infer_oneshot_runs_the_script_with_the_compiled_kernels_off_for_its_plain_run(tmp_path):
    """`compile_plain_kernels` runs the script through a launcher that turns the compiled blocks' kernel ops off and
    hands the script its own argv."""
    args = SimpleNamespace(snapshot=tmp_path, image_size=[64, 64], steps=2, device=None, extra="")
    out = _launched(args, "compile_plain_kernels", tmp_path,
                    "import sys\nfrom library.runtime import fused_compiled\n"
                    "print(fused_compiled._SETTINGS['norm_rope'], fused_compiled._SETTINGS['swiglu'], sys.argv[1:])\n",
                    "--flag")
    assert out == "False False ['--flag']"
    # `compile_no_codes`: the ConvRot INT8 blocks' codes-only producers off, the kernel ops on
    out = _launched(args, "compile_no_codes", tmp_path, "from library.runtime import fused_compiled as f\n"
                    "print(f._SETTINGS['inference_codes'], f._SETTINGS['swiglu'])\n")
    assert out == "False True"
    # `compile_unpacked`: a CFG step's two passes one after the other (the compiled kernels as they are)
    out = _launched(args, "compile_unpacked", tmp_path, "from library.moss_image import cfg_packing as c\n"
                    "from library.runtime import fused_compiled as f\n"
                    "print(c.cfg_packing_on(), f._SETTINGS['inference_codes'])\n")
    assert out == "False True"


@pytest.mark.parametrize("int8, swap, float_fits, expected", [
    (True, 0, False, "cpu"),  # the float weights never all on the device
    (True, 0, True, "cuda:0"),  # room checked (loading together): read there, quantised there
    (True, 4, True, "cpu"),  # block swap: the streamed blocks live on the host
    (False, 0, False, "cuda:0"),
])
def test_where_the_dit_is_read(monkeypatch, int8, swap, float_fits, expected):
    import argparse

    from library.memory import block_swap
    from library.moss_image import loaders

    seen = {}
    monkeypatch.setattr(loaders, "load_moss_image_model", lambda *a, **k: seen.update(k) or object())
    monkeypatch.setattr(block_swap, "place_model", lambda *a, **k: None)
    args = argparse.Namespace(lora_weight=None, dit="d", attn_mode="torch", split_attn=False, convrot_int8=int8,
                              blocks_to_swap=swap, disable_mmap_load_safetensors=False)
    inf.load_dit(args, "cuda:0", torch.bfloat16, float_fits=float_fits)
    assert str(seen["loading_device"]) == expected and seen["calc_device"] == "cuda:0"


def test_an_image_is_decoded_beside_the_dit_only_where_its_decode_fits(tiny_snapshot, monkeypatch):
    from library.planning.memory_model import vae_decode_bytes
    from library.planning.sizes import read_vae
    from library.sampling.generation import GenerationSettings

    args = inf.setup_parser().parse_args(["--snapshot", str(tiny_snapshot), "--prompt", "x", "--device", "cpu"])
    inf.resolve_args(args)
    cpu = torch.device("cpu")
    room = inf._checkpoint_bytes(args.text_encoder, "text_encoder") + inf.OVERLAP_HEADROOM_BYTES
    per_pixel = vae_decode_bytes(read_vae(args.vae), 1)
    side = int((room / per_pixel) ** 0.5) // 16 * 16  # the largest square image whose decode fits
    assert inf.decode_fits_beside_dit(args, cpu, [GenerationSettings(prompt="x", width=64, height=64),
                                                  GenerationSettings(prompt="y", width=side, height=side)])
    assert not inf.decode_fits_beside_dit(args, cpu, [GenerationSettings(prompt="x", width=side + 64,
                                                                         height=side + 64)])
    # a text encoder on the CPU beside a GPU leaves only the headroom
    monkeypatch.setattr(inf.TextEncoderOptions, "from_args", lambda a: type("O", (), {"on_cpu": True})())
    assert inf._te_device_bytes(args, torch.device("cuda")) == 0 and inf._te_device_bytes(args, cpu) > 0
