"""The text encoder is not read when every text-encoder output is already cached on disk: the caching driver with a
lazy encoder (one and two processes, older files without the unconditional embedding), the variant predicted from
the options and the file header, the trainer (valid / stale / missing caches, sample prompts, caption dropout, the
internal check after a deferred load) and tools/cache_text_encoder_outputs.py."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

import library.caching.strategies as sm
import library.text_encoder.loading as te_loading
import moss_image_train_network as trainer_module
from library.errors import UserError
from library.files.safetensors_io import SafetensorsFile, load_safetensors
from library.text_encoder.encoding import LazyEncoder
from library.text_encoder.loading import TextEncoderOptions, predict_text_encoder_variant
from library.text_encoder.qwen35 import load_qwen35_text_model
from library.text_encoder.variant import check_predicted_variant, weights_variant
from tests.test_caching import FakeTextEncoder, all_batches, image_folder, te_groups
from tests.test_trainer import base_args, make_toy_dataset, train


class LoadSpy:
    """Counts the reads of the text encoder (the weights reader `library.text_encoder.loading` calls) and passes them
    on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = te_loading.load_qwen35_text_model

        def spy(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(te_loading, "load_qwen35_text_model", spy)


class HomeSpy:
    """Records the `home` each text encoder load of the trainer asks for (None: straight to where it runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.homes: list[object] = []
        real = trainer_module.load_text_encoder

        def spy(*args, **kwargs):
            self.homes.append(kwargs.get("home"))
            return real(*args, **kwargs)

        monkeypatch.setattr(trainer_module, "load_text_encoder", spy)


def lazy(encoder: FakeTextEncoder) -> LazyEncoder:
    return LazyEncoder(lambda: encoder)


# ------------------------------------------------------------------------------------------------ the driver
def test_driver_calls_the_encoder_only_when_a_file_is_missing_or_stale(tmp_path, caplog):
    folder = image_folder(tmp_path / "a", ["one", "two", "three"])
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True)
    first = lazy(FakeTextEncoder())
    assert sm.cache_text_encoder_outputs([te_groups(tmp_path, folder)], first, strategy, show_progress=False) == 3
    assert first.loaded

    enc = FakeTextEncoder()
    again = lazy(enc)
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True)
    with caplog.at_level(logging.INFO):
        assert sm.cache_text_encoder_outputs([te_groups(tmp_path, folder)], again, strategy, show_progress=False) == 0
    assert not again.loaded and enc.encoded == [] and strategy.uncond is None
    assert "all 3 text-encoder cache files are valid: the text encoder is not loaded" in caplog.text

    (folder / "img1_moss_te.npz").unlink()  # a missing file: the encoder is made, the empty prompt comes first
    enc = FakeTextEncoder()
    again = lazy(enc)
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True)
    assert sm.cache_text_encoder_outputs([te_groups(tmp_path, folder)], again, strategy, show_progress=False) == 1
    assert again.loaded and enc.encoded == ["", "two"] and strategy.uncond is not None


def test_dropout_reads_the_uncond_from_the_files_when_nothing_was_encoded(tmp_path):
    folder = image_folder(tmp_path / "a", ["a cat", "a dog"])
    sm.cache_text_encoder_outputs([te_groups(tmp_path, folder)], FakeTextEncoder(),
                                  sm.MossImageTextEncoderOutputsCachingStrategy(True), show_progress=False)
    group = te_groups(tmp_path, folder, caption_dropout_rate=0.5, num_repeats=8)
    never = lazy(FakeTextEncoder())
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True)
    assert sm.cache_text_encoder_outputs([group], never, strategy, show_progress=False) == 0
    assert not never.loaded and strategy.uncond is None
    uncond = FakeTextEncoder.outputs("")[0]
    dropped = kept = 0
    for batch in all_batches(group):
        for (embeds, _), was_dropped in zip(batch["text_encoder_outputs"], batch["captions_dropped"]):
            if was_dropped:
                dropped += 1
                assert torch.equal(embeds, uncond)
            else:
                kept += 1
                assert not torch.equal(embeds, uncond)
    assert dropped and kept


def test_older_files_without_uncond_still_get_the_empty_prompt_encoded(tmp_path, caplog):
    folder = image_folder(tmp_path / "a", ["a cat"])
    old = FakeTextEncoder.outputs("made by an older version")
    sm.save_npz_atomic(folder / "img0_moss_te.npz", {"prompt_embeds": old[0].numpy(), "attn_mask": old[1].numpy()})
    enc = FakeTextEncoder()
    strategy = sm.MossImageTextEncoderOutputsCachingStrategy(True)
    with caplog.at_level(logging.INFO):
        count = sm.cache_text_encoder_outputs([te_groups(tmp_path, folder)], lazy(enc), strategy, show_progress=False)
    assert count == 0 and enc.encoded == [""]  # the file is valid; only the uncond for dropout
    assert strategy.uncond is not None and "have no unconditional embedding" in caplog.text


def test_each_process_reads_the_encoder_only_for_its_own_share(tmp_path):
    folder = image_folder(tmp_path / "a", [f"caption {i}" for i in range(4)])
    sm.cache_text_encoder_outputs([te_groups(tmp_path, folder)], FakeTextEncoder(),
                                  sm.MossImageTextEncoderOutputsCachingStrategy(True), show_progress=False)
    (folder / "img1_moss_te.npz").unlink()  # sorted files: img1 is in process 1's share of two
    loaded = {}
    for process in (0, 1):
        enc = lazy(FakeTextEncoder())
        n = sm.cache_text_encoder_outputs([te_groups(tmp_path, folder)], enc,
                                          sm.MossImageTextEncoderOutputsCachingStrategy(True), process, 2, False)
        loaded[process] = (n, enc.loaded)
    assert loaded == {0: (0, False), 1: (1, True)}


def test_an_encoder_in_memory_says_nothing_to_encode(tmp_path, caplog):
    folder = image_folder(tmp_path / "a", ["one"])
    sm.cache_text_encoder_outputs([te_groups(tmp_path, folder)], FakeTextEncoder(),
                                  sm.MossImageTextEncoderOutputsCachingStrategy(True), show_progress=False)
    with caplog.at_level(logging.INFO):
        sm.cache_text_encoder_outputs([te_groups(tmp_path, folder)], LazyEncoder(FakeTextEncoder, False),
                                      sm.MossImageTextEncoderOutputsCachingStrategy(True), show_progress=False)
    assert "all 1 text-encoder cache files are valid: nothing to encode" in caplog.text


# ------------------------------------------------------------------------------------------ variant prediction
def te_args(path: Path, **kw) -> TextEncoderOptions:
    base = {"text_encoder": str(path), "te_quant": "none", "te_device": None, "text_encoder_cpu": False,
            "convrot_int8_text_encoder": False}
    return TextEncoderOptions.from_args(argparse.Namespace(**{**base, **kw}))


def test_the_predicted_variant_is_the_loaded_one(tiny_snapshot, monkeypatch):
    int8_file = tiny_snapshot / "text_encoder_int8" / "qwen3.5_9b_int8_convrot.safetensors"
    cases = [(te_args(tiny_snapshot / "text_encoder"), "none"),
             (te_args(tiny_snapshot), "none"),  # a snapshot root, as load_text_encoder takes it
             (te_args(tiny_snapshot / "text_encoder", convrot_int8_text_encoder=True), "convrot_int8"),
             (te_args(int8_file), "convrot_int8")]
    for args, expected in cases:
        assert predict_text_encoder_variant(args, "cpu") == expected
        model = load_qwen35_text_model(args.path, dtype=torch.float32, convrot_int8=args.convrot_int8)
        assert weights_variant(model) == expected

    def no_weights(self, key):
        raise AssertionError(f"a weight was read: {key}")

    monkeypatch.setattr(SafetensorsFile, "get_tensor", no_weights)  # the prediction reads the headers only
    assert predict_text_encoder_variant(te_args(int8_file), "cpu") == "convrot_int8"
    assert predict_text_encoder_variant(te_args(tiny_snapshot / "text_encoder"), "cpu") == "none"


def test_te_quant_prediction_and_its_errors(tiny_snapshot, monkeypatch):
    import library.text_encoder.quant as tq

    te = tiny_snapshot / "text_encoder"
    int8_file = tiny_snapshot / "text_encoder_int8" / "qwen3.5_9b_int8_convrot.safetensors"
    assert predict_text_encoder_variant(te_args(te, te_quant="auto"), "cpu") == "none"
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        predict_text_encoder_variant(te_args(te, te_quant="int8"), "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tq, "bitsandbytes_available", lambda: True)
    assert predict_text_encoder_variant(te_args(te, te_quant="auto"), "cuda") is None  # by free VRAM at load
    assert predict_text_encoder_variant(te_args(te, te_quant="auto", te_device="cpu"), "cuda") == "none"
    assert predict_text_encoder_variant(te_args(int8_file, te_quant="auto"), "cuda") == "convrot_int8"
    assert predict_text_encoder_variant(te_args(te, te_quant="int8"), "cuda") == "bnb_int8"
    assert predict_text_encoder_variant(te_args(te, te_quant="nf4"), "cuda") == "bnb_nf4"
    with pytest.raises(UserError, match="cannot quantise a ConvRot INT8"):
        predict_text_encoder_variant(te_args(int8_file, te_quant="nf4"), "cuda")
    monkeypatch.setattr(tq, "bitsandbytes_available", lambda: False)
    with pytest.raises(UserError, match="bitsandbytes"):
        predict_text_encoder_variant(te_args(te, te_quant="int8"), "cuda")
    check_predicted_variant("none", "none")
    with pytest.raises(RuntimeError, match="internal error"):
        check_predicted_variant("bnb_int8", "none")


# ---------------------------------------------------------------------------------------------------- trainer
def lora(out: Path) -> dict[str, torch.Tensor]:
    return load_safetensors(out / "toy.safetensors")


def te_disk_args(snapshot: Path, data: Path, out: Path, *extra: str) -> list[str]:
    # latents on disk too: compared runs then read the same inputs also on a GPU, where the first run of a process
    # caches before TF32 is switched on and later runs after
    return base_args(snapshot, data, out, "--cache_text_encoder_outputs_to_disk", "--cache_latents_to_disk",
                     "--max_train_steps", "2", "--learning_rate", "1e-2", *extra)


def test_trainer_reads_the_text_encoder_only_for_missing_or_stale_files(tiny_snapshot, tmp_path, monkeypatch,
                                                                         caplog):
    data = make_toy_dataset(tmp_path / "data", n=4)
    spy = LoadSpy(monkeypatch)
    homes = HomeSpy(monkeypatch)
    train(te_disk_args(tiny_snapshot, data, tmp_path / "made"))  # no files yet: read (deferred) to make them
    assert spy.calls == 1 and len(list(data.glob("4_toy/*_moss_te.npz"))) == 4
    assert homes.homes == [None]  # read in the caching phase that uses it: straight to its run device

    caplog.clear()
    with caplog.at_level(logging.INFO):
        run = train(te_disk_args(tiny_snapshot, data, tmp_path / "cached"))
    assert spy.calls == 1  # every file valid: never read
    assert "all 4 text-encoder cache files are valid: the text encoder is not loaded" in caplog.text
    assert run.text_encoders == [None]
    made, cached = lora(tmp_path / "made"), lora(tmp_path / "cached")
    assert made.keys() == cached.keys() and all(torch.equal(made[k], cached[k]) for k in made)

    stale = data / "4_toy" / "img2_moss_te.npz"  # made for another caption
    sm.save_npz_atomic(stale, {**sm.load_npz(stale), "caption_0": np.array("another caption")})
    (data / "4_toy" / "img3_moss_te.npz").unlink()  # missing
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(te_disk_args(tiny_snapshot, data, tmp_path / "stale", "--max_train_steps", "1"))
    assert spy.calls == 2 and "text encoder outputs: 2 images encoded by this process" in caplog.text

    # another variant (ConvRot INT8 at load) makes every file stale; the deferred load checks the prediction
    train(te_disk_args(tiny_snapshot, data, tmp_path / "int8", "--max_train_steps", "1", "--convrot_int8_text_encoder"))
    assert spy.calls == 3
    assert str(sm.load_npz(data / "4_toy" / "img0_moss_te.npz")["encoder"]) == "convrot_int8"


def test_sample_prompts_read_the_text_encoder_at_startup(tiny_snapshot, tmp_path, monkeypatch):
    data = make_toy_dataset(tmp_path / "data", n=4)
    train(te_disk_args(tiny_snapshot, data, tmp_path / "a", "--max_train_steps", "1"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square --n blurry\n")
    spy = LoadSpy(monkeypatch)
    homes = HomeSpy(monkeypatch)
    run_trainer = _trainer_of(monkeypatch)
    train(te_disk_args(tiny_snapshot, data, tmp_path / "b", "--max_train_steps", "1", "--sample_prompts",
                       str(prompts)))
    assert spy.calls == 1
    assert homes.homes == ["cpu"]  # read at startup, before the latents are cached: it waits on the CPU
    assert set(run_trainer[0].sample_prompts_te_outputs) == {"a red square", "blurry"}
    a, b = lora(tmp_path / "a"), lora(tmp_path / "b")  # read or not, the encoder leaves the run's RNG alone
    assert all(torch.equal(a[k], b[k]) for k in a)


def _trainer_of(monkeypatch: pytest.MonkeyPatch) -> list:
    """The trainer objects `train` makes, in a list filled as they are created."""
    import moss_image_train_network as m

    made: list = []
    real_init = m.MossImageNetworkTrainer.__init__

    def init(self) -> None:
        real_init(self)
        made.append(self)

    monkeypatch.setattr(m.MossImageNetworkTrainer, "__init__", init)
    return made


def test_caption_dropout_with_a_never_read_text_encoder(tiny_snapshot, tmp_path, monkeypatch):
    data = make_toy_dataset(tmp_path / "data", n=4)
    dropout = ("--caption_dropout_rate", "1.0")
    train(te_disk_args(tiny_snapshot, data, tmp_path / "made", *dropout))  # makes the files (encoder read)
    spy = LoadSpy(monkeypatch)
    run = train(te_disk_args(tiny_snapshot, data, tmp_path / "cached", *dropout))
    assert spy.calls == 0 and run.global_step == 2
    made, cached = lora(tmp_path / "made"), lora(tmp_path / "cached")
    assert all(torch.equal(made[k], cached[k]) for k in made)  # every caption dropped: the files' uncond is used
    file_uncond = torch.from_numpy(sm.load_npz(data / "4_toy" / "img0_moss_te.npz")["uncond_embeds"])
    batch = run.train_group[0]
    assert all(batch["captions_dropped"])
    assert all(torch.equal(e, file_uncond) for e, _ in batch["text_encoder_outputs"])


def test_a_wrong_prediction_is_an_internal_error(tiny_snapshot, tmp_path, monkeypatch):
    import moss_image_train_network as m

    data = make_toy_dataset(tmp_path / "data", n=2)
    monkeypatch.setattr(m, "predict_text_encoder_variant", lambda options, device: "bnb_nf4")
    with pytest.raises(RuntimeError, match="internal error.*'bnb_nf4' but loaded as 'none'"):
        train(te_disk_args(tiny_snapshot, data, tmp_path / "out", "--max_train_steps", "1"))


# ------------------------------------------------------------------------------------------------------- tool
def test_cache_tool_exits_without_reading_the_encoder_when_all_files_are_valid(tiny_snapshot, tmp_path,
                                                                                monkeypatch, caplog):
    from accelerate.state import AcceleratorState

    from tests.test_cache_tools import dataset, tool_args
    from tools import cache_text_encoder_outputs as te_tool

    AcceleratorState._reset_state(reset_partial_state=True)  # --device cpu after a trainer run on a GPU
    cfg = dataset(tmp_path)
    spy = LoadSpy(monkeypatch)
    argv = tool_args(tiny_snapshot, cfg, "--cache_text_encoder_outputs_to_disk")
    assert te_tool.run(argv).encoded == 4 and spy.calls == 1
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert te_tool.run(argv).encoded == 0
    assert spy.calls == 1
    assert "all 4 text-encoder cache files are valid: the text encoder is not loaded" in caplog.text
    (tmp_path / "data" / "4_toy" / "img1.txt").write_text("changed")
    assert te_tool.run(argv).encoded == 1 and spy.calls == 2
    assert te_tool.run([*argv, "--convrot_int8_text_encoder"]).encoded == 4 and spy.calls == 3
