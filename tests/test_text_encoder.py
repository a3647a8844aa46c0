"""library/text_encoder as a whole on the tiny snapshot: the one loader (its dtype rule, where the model runs, its
cache variant, the run's RNG), the variant names, the same numbers from the trainer, the inference script and the
cache tool, and sample prompts encoded where the encoder runs (--te_device cpu)."""

from __future__ import annotations

import argparse
import re
from types import SimpleNamespace

import pytest
import torch

import moss_image_minimal_inference as inference
from library.caching.strategies import load_npz
from library.text_encoder.encoding import encode_captions, length_batches, text_encoder_batch_size
from library.text_encoder.kernels import FLA_LENGTH_MULTIPLE
from library.text_encoder.loading import (
    TEXT_ENCODER_DTYPE,
    TextEncoderOptions,
    load_text_encoder,
    predict_text_encoder_variant,
)
from library.text_encoder.qwen35 import load_qwen35_text_model, load_tokenizer
from library.text_encoder.variant import WEIGHTS_VARIANTS, cache_variant, variant_dtype
from library.training.sample_images import _text_outputs
from tests.test_cache_tools import dataset, tool_args
from tools import cache_text_encoder_outputs as te_tool

INT8_TE = "text_encoder_int8/qwen3.5_9b_int8_convrot.safetensors"


def options(path, **kw) -> TextEncoderOptions:
    return TextEncoderOptions(path=path, **kw)


@pytest.mark.parametrize("convrot, path, variant", [(False, "text_encoder", "none"),
                                                    (True, "text_encoder", "convrot_int8"),
                                                    (False, INT8_TE, "convrot_int8")])
def test_the_loader_runs_bf16_on_the_cpu_and_says_so(tiny_snapshot, convrot, path, variant):
    opts = options(tiny_snapshot / path, convrot_int8=convrot)
    rng = torch.get_rng_state()
    loaded = load_text_encoder(opts, "cpu")
    assert torch.equal(torch.get_rng_state(), rng)  # reading it leaves the run's randomness alone
    assert (loaded.device.type, loaded.dtype, loaded.variant) == ("cpu", torch.bfloat16, variant)
    assert loaded.convrot_int8 == (variant == "convrot_int8")
    floats = [p for p in loaded.model.parameters() if p.is_floating_point()]
    assert floats and all(p.dtype == TEXT_ENCODER_DTYPE and p.device.type == "cpu" for p in floats)
    assert not any(p.requires_grad for p in loaded.model.parameters()) and not loaded.model.training
    assert predict_text_encoder_variant(opts, "cpu") == loaded.variant


def test_cuda_without_a_gpu_and_te_device_cpu_run_on_the_cpu(tiny_snapshot):
    loaded = load_text_encoder(options(tiny_snapshot, on_cpu=True), "cuda")
    assert loaded.device.type == "cpu" and loaded.placed() is loaded.model
    assert next(loaded.model.parameters()).device.type == "cpu"
    if not torch.cuda.is_available():
        assert load_text_encoder(options(tiny_snapshot), "cuda").device.type == "cpu"


def test_options_from_each_script_command_line(tiny_snapshot):
    import moss_image_train_network as trainer

    train_args = trainer.setup_parser().parse_args(["--text_encoder", "te", "--text_encoder_cpu",
                                                    "--convrot_int8_text_encoder", "--convrot_int8_bwd", "int8"])
    assert TextEncoderOptions.from_args(train_args) == TextEncoderOptions("te", "none", True, True, "int8", False)
    inf_args = inference.setup_parser().parse_args(["--text_encoder", "te", "--te_quant", "auto",
                                                    "--disable_mmap_load_safetensors"])
    assert TextEncoderOptions.from_args(inf_args) == TextEncoderOptions("te", "auto", False, False, "bf16", True)
    tool_ns = te_tool.setup_parser().parse_args(["--text_encoder", "te", "--te_device", "cpu"])
    assert TextEncoderOptions.from_args(tool_ns) == TextEncoderOptions("te", on_cpu=True)


def test_variant_names_keep_the_bf16_names_and_name_other_dtypes():
    assert cache_variant("none", torch.bfloat16) == "none" and cache_variant("convrot_int8", "bf16") == "convrot_int8"
    assert cache_variant("none", torch.float32) == "none_fp32"
    for weights in WEIGHTS_VARIANTS:
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            name = cache_variant(weights, dtype)
            assert variant_dtype(name) == {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[dtype]
    assert variant_dtype("unknown") == "bf16"


def test_the_three_scripts_give_the_same_numbers(tiny_snapshot, tmp_path):
    """A cache file of the tool is what the inference script (and the trainer, which reads the tool's files as
    valid: tests/test_cache_tools.py) computes for the same caption, to the bit."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    cfg = dataset(tmp_path)
    assert te_tool.run(tool_args(tiny_snapshot, cfg, "--cache_text_encoder_outputs_to_disk")).encoded == 4
    cached = load_npz(tmp_path / "data" / "4_toy" / "img1_moss_te.npz")
    assert (str(cached["encoder"]), str(cached["encoder_dtype"])) == ("none", "bf16")
    args = inference.setup_parser().parse_args(["--snapshot", str(tiny_snapshot), "--prompt", "x"])
    inference.resolve_args(args)
    te, tokenizer = inference.load_text_encoder_for(args, torch.device("cpu"))
    caption = str(cached["caption_0"])
    outputs = inference.encode_texts(args, te, tokenizer, [caption, ""])
    assert torch.equal(outputs[caption][0].float(), torch.from_numpy(cached["prompt_embeds_0"]))
    assert torch.equal(outputs[""][0].float(), torch.from_numpy(cached["uncond_embeds"]))


def test_sample_prompts_are_encoded_where_the_encoder_runs(tiny_snapshot):
    """--te_device cpu: the encoder stays on the CPU even though the run's device is another (here 'meta', which
    would leave no numbers at all)."""
    loaded = load_text_encoder(options(tiny_snapshot, on_cpu=True), "cpu")
    tokenizer = load_tokenizer(text_encoder_path=str(tiny_snapshot / "text_encoder"))
    trainer = SimpleNamespace(sample_prompts_te_outputs={"cached": "kept"}, te_device=loaded.device,
                              tokenizer=tokenizer, is_train_text_encoder=lambda args: False)
    run = SimpleNamespace(text_encoders=[loaded.model], accelerator=SimpleNamespace(device=torch.device("meta")),
                          args=argparse.Namespace(moss_max_token_length=4096, sample_prompts="prompts.txt",
                                                  text_encoder_batch_size=2))
    texts = ["cached", "a red square", "a blue circle on white"]
    outputs = _text_outputs(trainer, run, texts)
    expected = encode_captions(loaded.model, tokenizer, texts[1:], batch_size=2)
    assert outputs["cached"] == "kept" and outputs["a red square"][0].device.type == "cpu"
    assert all(torch.equal(outputs[t][0], e) for t, (e, _) in zip(texts[1:], expected))
    assert next(loaded.model.parameters()).device.type == "cpu"


# ------------------------------------------------------------------------------------------- batched encoding
CAPTIONS = ["a red square", "", "a much longer caption that runs on " * 8, "two words", "x",
            "a watercolor painting of mountains at dawn, " * 5, "a red square"]


@pytest.fixture(scope="module")
def fp32_encoder(tiny_snapshot):
    model = load_qwen35_text_model(tiny_snapshot, dtype=torch.float32)
    return model, load_tokenizer(text_encoder_path=str(tiny_snapshot / "text_encoder"))


def max_difference(a, b) -> float:
    assert [e.shape for e, _ in a] == [e.shape for e, _ in b]
    assert all(torch.equal(ma, mb) and ma.all() for (_, ma), (_, mb) in zip(a, b))
    return max((ea.float() - eb.float()).abs().max().item() for (ea, _), (eb, _) in zip(a, b))


class ForwardCounter:
    def __init__(self, model) -> None:
        self.shapes: list[tuple[int, ...]] = []
        model.register_forward_pre_hook(lambda m, args, kwargs: self.shapes.append(tuple(kwargs["input_ids"].shape)),
                                        with_kwargs=True)


def test_batched_outputs_equal_alone_encoding_in_fp32(fp32_encoder):
    model, tokenizer = fp32_encoder
    alone = encode_captions(model, tokenizer, CAPTIONS)
    assert max(len(e) for e, _ in alone) > 64 > min(len(e) for e, _ in alone)  # across a GDN chunk boundary
    counter = ForwardCounter(model)
    for batch_size in (2, 3, 8):
        counter.shapes.clear()
        batched = encode_captions(model, tokenizer, CAPTIONS, batch_size=batch_size)
        assert max_difference(batched, alone) < 1e-5, batch_size  # same order, same lengths, same values
        assert len(counter.shapes) == -(-len(CAPTIONS) // batch_size)
        assert max(shape[0] for shape in counter.shapes) == min(batch_size, len(CAPTIONS))
    assert encode_captions(model, tokenizer, []) == []


def test_captions_of_similar_length_are_batched_together():
    lengths = [30, 5, 200, 7, 31, 6]
    assert length_batches(lengths, 2) == [[1, 5], [3, 0], [4, 2]]
    assert length_batches(lengths, 1) == [[1], [5], [3], [0], [4], [2]]
    assert length_batches(lengths, 10) == [[1, 5, 3, 0, 4, 2]]


def test_padding_to_a_length_bucket_is_exact(fp32_encoder, monkeypatch):
    """Where fla runs, batches (and single captions) are padded to a multiple of 64 tokens: still the alone outputs."""
    import library.text_encoder.encoding as encoding

    model, tokenizer = fp32_encoder
    alone = encode_captions(model, tokenizer, CAPTIONS)
    monkeypatch.setattr(encoding, "length_multiple", lambda device: FLA_LENGTH_MULTIPLE)
    counter = ForwardCounter(model)
    for batch_size in (1, 4):
        counter.shapes.clear()
        assert max_difference(encode_captions(model, tokenizer, CAPTIONS, batch_size=batch_size), alone) < 1e-5
        assert all(shape[1] % FLA_LENGTH_MULTIPLE == 0 for shape in counter.shapes)


def test_batched_bf16_differs_from_alone_less_than_bf16_itself(tiny_snapshot, fp32_encoder):
    model32, tokenizer = fp32_encoder
    model = load_qwen35_text_model(tiny_snapshot, dtype=torch.bfloat16)
    reference = encode_captions(model32, tokenizer, CAPTIONS)
    alone = encode_captions(model, tokenizer, CAPTIONS)
    batched = encode_captions(model, tokenizer, CAPTIONS, batch_size=4)
    assert max_difference(batched, alone) <= max_difference(alone, reference)


def test_gradients_through_a_padded_batch_equal_those_of_alone_encoding(fp32_encoder):
    """The text encoder LoRA path: the same function with grad=True; padding adds nothing to the gradients."""
    model, tokenizer = fp32_encoder
    weight = model.layers[0].linear_attn.in_proj_qkv.weight
    grads = []
    for batch_size in (1, 3):
        weight.requires_grad_(True)
        weight.grad = None
        outputs = encode_captions(model, tokenizer, CAPTIONS[:4], batch_size=batch_size, grad=True)
        sum(e.pow(2).mean() for e, _ in outputs).backward()
        grads.append(weight.grad.clone())
        weight.requires_grad_(False)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)
    with torch.enable_grad():
        assert not encode_captions(model, tokenizer, ["x"])[0][0].requires_grad  # grad=False: no graph


def test_text_encoder_batch_size_is_checked_in_every_script(tiny_snapshot, tmp_path):
    import moss_image_train_network as trainer
    from library.errors import UserError
    from tests.test_trainer import base_args, make_toy_dataset

    assert text_encoder_batch_size(None) == 1 and text_encoder_batch_size(4) == 4
    with pytest.raises(UserError, match="--text_encoder_batch_size 0 must be at least 1"):
        text_encoder_batch_size(0)
    data = make_toy_dataset(tmp_path / "data", n=1)
    argv = base_args(tiny_snapshot, data, tmp_path / "out", "--text_encoder_batch_size", "0")
    assert trainer.main(argv) == 2
    with pytest.raises(UserError, match="must be at least 1"):
        inference._check_args(inference.setup_parser().parse_args(["--prompt", "x", "--text_encoder_batch_size", "-1"]))
    assert te_tool.main(tool_args(tiny_snapshot, dataset(tmp_path / "t"), "--cache_text_encoder_outputs_to_disk",
                                  "--text_encoder_batch_size", "0")) == 2


def test_the_cache_tool_batches_and_reports(tiny_snapshot, tmp_path, capsys):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    cfg = dataset(tmp_path)
    summary = te_tool.run(tool_args(tiny_snapshot, cfg, "--cache_text_encoder_outputs_to_disk",
                                    "--text_encoder_batch_size", "4"))
    assert (summary.encoded, summary.valid, summary.skipped, summary.captions) == (4, 0, 0, 5)  # img0: 2 candidates
    captured = capsys.readouterr()
    out = captured.out
    assert re.search(r"caching text encoder outputs: 100%.*5/5 \[[\d:]+<[\d:]+, +[\d.]+ captions/s\]", captured.err)
    assert "text encoder outputs: 4 cache files; 4 encoded now, 0 already cached (1 process)" in out
    assert re.search(r"text encoder outputs: 4 encoded, 0 valid, 0 skipped \(--skip_cache_check\); 5 captions at"
                     r" [\d.]+ captions/s; [\d.]+ s with the text encoder's read", out)
    (tmp_path / "data" / "4_toy" / "img2.txt").write_text("changed")
    summary = te_tool.run(tool_args(tiny_snapshot, cfg, "--cache_text_encoder_outputs_to_disk", "--skip_cache_check"))
    assert (summary.encoded, summary.valid, summary.skipped) == (0, 0, 4)
    summary = te_tool.run(tool_args(tiny_snapshot, cfg, "--cache_text_encoder_outputs_to_disk"))
    assert (summary.encoded, summary.valid, summary.skipped, summary.captions) == (1, 3, 0, 1)
    # batched files are valid for a run encoding alone (same variant), and their values those of alone encoding
    cached = load_npz(tmp_path / "data" / "4_toy" / "img0_moss_te.npz")
    args = inference.setup_parser().parse_args(["--snapshot", str(tiny_snapshot), "--prompt", "x"])
    inference.resolve_args(args)
    te, tokenizer = inference.load_text_encoder_for(args, torch.device("cpu"))
    alone = encode_captions(te, tokenizer, [str(cached["caption_0"]), str(cached["caption_1"])])
    bf16_noise = 0.05 * max(e.float().abs().max().item() for e, _ in alone)
    for k, (e, _) in enumerate(alone):
        assert (torch.from_numpy(cached[f"prompt_embeds_{k}"]) - e.float()).abs().max() < bf16_noise


# --------------------------------------------------------------------------- flash-linear-attention on the CPU
FAKE_KERNEL = '''def _no_driver(*args, **kwargs):
    raise RuntimeError("0 active drivers ([]). There should only be one.")  # Triton without a GPU


{names} = {values}
'''
CHILD = '''import sys
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

from library.text_encoder.encoding import encode_captions
from library.text_encoder.loading import TextEncoderOptions, load_text_encoder
from library.text_encoder.qwen35 import load_tokenizer

snapshot, out = sys.argv[1], sys.argv[2]
assert {"fla", "causal_conv1d"} <= set(sys.modules), "transformers did not import the installed kernel packages"
try:  # transformers up to 5.24 serves every tensor with the installed kernel: it fails on CPU tensors
    modeling.causal_conv1d_fn(torch.zeros(1, 4, 3), torch.zeros(4, 4))
    print("transformers routes CPU tensors itself")  # 5.25 on: the PyTorch reference off the package's devices
except RuntimeError as e:
    assert "0 active drivers" in str(e), e
    print("transformers picked the installed kernel for CPU tensors")
loaded = load_text_encoder(TextEncoderOptions(path=snapshot), "cpu")
tokenizer = load_tokenizer(text_encoder_path=snapshot + "/text_encoder")
captions = ["a red square", "a much longer caption that runs on " * 8, "x"]
torch.save([e for e, _ in encode_captions(loaded.model, tokenizer, captions, batch_size=2)], out)
'''


def fake_kernel_packages(root) -> None:
    """`fla` and `causal_conv1d` as transformers finds them, with kernels that fail as Triton does without a GPU."""
    files = {"fla/__init__.py": "from fla import ops\n",
             "fla/ops/__init__.py": "from fla.ops import gated_delta_rule\n",
             "fla/ops/gated_delta_rule/__init__.py": FAKE_KERNEL.format(
                 names="chunk_gated_delta_rule, fused_recurrent_gated_delta_rule", values="_no_driver, _no_driver"),
             "causal_conv1d/__init__.py": FAKE_KERNEL.format(names="causal_conv1d_fn, causal_conv1d_update",
                                                             values="_no_driver, _no_driver")}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_cpu_path_works_with_flash_linear_attention_installed(tiny_snapshot, tmp_path):
    """With fla and causal-conv1d importable, transformers up to 5.24 uses their kernels for every tensor (5.25 on
    routes CPU tensors itself); the loader routes CPU tensors to the PyTorch reference, so on either the CPU encoder
    works and gives the numbers it gives without them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    fake_kernel_packages(tmp_path / "site")
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(repo), os.environ.get("PYTHONPATH", "")])}
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    done = subprocess.run([sys.executable, str(child), str(tiny_snapshot), str(tmp_path / "out.pt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded = load_text_encoder(options(tiny_snapshot), "cpu")
    tokenizer = load_tokenizer(text_encoder_path=str(tiny_snapshot / "text_encoder"))
    captions = ["a red square", "a much longer caption that runs on " * 8, "x"]
    expected = encode_captions(loaded.model, tokenizer, captions, batch_size=2)
    got = torch.load(tmp_path / "out.pt")
    assert len(got) == 3 and all(torch.equal(g, e) for g, (e, _) in zip(got, expected))


def test_length_buckets_only_where_fla_runs(monkeypatch):
    import library.text_encoder.kernels as kernels

    monkeypatch.setattr(kernels, "fla_installed", lambda: True)
    assert kernels.length_multiple(torch.device("cuda")) == FLA_LENGTH_MULTIPLE
    assert kernels.length_multiple(torch.device("cpu")) == 1
    monkeypatch.setattr(kernels, "fla_installed", lambda: False)
    assert kernels.length_multiple(torch.device("cuda")) == 1


def test_the_trainer_batches_its_caching_and_sample_prompts(tiny_snapshot, tmp_path, monkeypatch):
    import library.text_encoder.encoding as encoding
    from tests.test_te_lazy_load import _trainer_of, te_disk_args
    from tests.test_trainer import make_toy_dataset, train

    sizes: list[int] = []
    real = encoding._encode_batch
    monkeypatch.setattr(encoding, "_encode_batch",
                        lambda model, ids, *a: sizes.append(len(ids)) or real(model, ids, *a))
    data = make_toy_dataset(tmp_path / "data", n=4)
    for i in range(4):
        (data / "4_toy" / f"img{i}.txt").write_text(f"a red square number {i}" + " on grey" * i)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square --n blurry\na grey background\n")
    made = _trainer_of(monkeypatch)
    train(te_disk_args(tiny_snapshot, data, tmp_path / "out", "--max_train_steps", "1",
                       "--text_encoder_batch_size", "3", "--sample_prompts", str(prompts)))
    assert sizes[0] == 1 and sorted(sizes[1:]) == [1, 1, 3, 3]  # uncond; 4 captions as 3 + 1; 4 prompts as 3 + 1
    assert set(made[0].sample_prompts_te_outputs) == {"a red square", "blurry", "a grey background", ""}
