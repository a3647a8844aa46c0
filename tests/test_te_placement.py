"""Where the text encoder is placed, and that a bitsandbytes one (--te_quant int8/nf4) is quantised once on the device
it runs on and never moved (library/text_encoder/loading.py): the decision, `place_text_encoder` on a model with real
bitsandbytes layers, the trainer asking for no other device than the encoder's run device, and (with CUDA) an
encoder read with the trainer's CPU home that encodes on the GPU, before and after the trainer's offload call."""

from __future__ import annotations

import logging

import pytest
import torch

import library.text_encoder.quant as tq
from library.text_encoder.encoding import encode_captions
from library.text_encoder.loading import (
    TextEncoderOptions,
    load_text_encoder,
    place_text_encoder,
    resting_device,
    stays_on_its_device,
)
from library.text_encoder.quant import TextEncoderPlan
from library.text_encoder.qwen35 import load_tokenizer
from tests.test_te_quant import tiny_qwen
from tests.test_trainer import base_args, make_toy_dataset, train

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "quant, device, home, expected",
    [("int8", CUDA, "cpu", CUDA), ("nf4", CUDA, "cpu", CUDA), ("int8", CUDA, None, CUDA),
     ("none", CUDA, "cpu", CPU), ("none", CUDA, None, CUDA), ("none", CPU, "cpu", CPU)],
)
def test_a_bitsandbytes_encoder_rests_where_it_runs(quant, device, home, expected):
    assert resting_device(TextEncoderPlan(quant, device, "test"), home) == expected


class MoveSpy:
    """Records the devices `model.to` is asked for (and does the move)."""

    def __init__(self, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
        self.devices: list[torch.device] = []
        real = model.to

        def to(*args, **kwargs):
            self.devices.append(torch._C._nn._parse_to(*args, **kwargs)[0])
            return real(*args, **kwargs)

        monkeypatch.setattr(model, "to", to)


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_place_text_encoder_never_moves_a_bitsandbytes_encoder(quant, monkeypatch):
    pytest.importorskip("bitsandbytes")
    model = tiny_qwen().to(torch.bfloat16)
    tq.quantise_linear_layers(model, quant)
    model.to("cpu")  # bitsandbytes quantises on this move (the CPU is the run device here)
    assert stays_on_its_device(model)
    spy = MoveSpy(model, monkeypatch)
    for device in ("cpu", "cuda", CPU):
        assert place_text_encoder(model, device) is model
    assert spy.devices == []


def test_place_text_encoder_moves_a_float_encoder(monkeypatch):
    model = tiny_qwen().to(torch.bfloat16)
    assert not stays_on_its_device(model)
    spy = MoveSpy(model, monkeypatch)
    assert place_text_encoder(model, "cpu") is model
    assert spy.devices == [CPU]


def _bnb_on_this_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA, let `--te_quant int8/nf4` run bitsandbytes on the CPU (its CPU kernels), so that the trainer's
    placement calls for a bitsandbytes encoder run here; with CUDA the real plan is used."""
    real = tq.choose_plan

    def plan(mode, device, *args, **kwargs):
        if mode in ("int8", "nf4") and device.type == "cpu":
            return TextEncoderPlan(mode, CPU, "test: bitsandbytes on the CPU")
        return real(mode, device, *args, **kwargs)

    monkeypatch.setattr(tq, "choose_plan", plan)


@pytest.mark.parametrize("disk", [False, True])
def test_the_trainer_asks_a_bitsandbytes_encoder_for_its_run_device_only(tiny_snapshot, tmp_path, monkeypatch,
                                                                          caplog, disk):
    pytest.importorskip("bitsandbytes")
    from transformers import Qwen3_5TextModel

    _bnb_on_this_device(monkeypatch)
    devices: list[torch.device] = []
    real_to = Qwen3_5TextModel.to

    def to(self, *args, **kwargs):  # the moves of the encoder once it has bitsandbytes layers
        if stays_on_its_device(self):
            devices.append(torch._C._nn._parse_to(*args, **kwargs)[0])
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(Qwen3_5TextModel, "to", to)
    data = make_toy_dataset(tmp_path / "data", n=2)
    extra = ("--cache_text_encoder_outputs_to_disk",) if disk else ()  # disk: the deferred load
    with caplog.at_level(logging.INFO):
        run = train(base_args(tiny_snapshot, data, tmp_path / "out", "--te_quant", "int8", "--max_train_steps", "1",
                              *extra))
    run_device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else CPU
    # quantised by the one move to where it runs, then never asked to move (caching, offload)
    assert [torch.device(d.type, d.index if d.index is not None else run_device.index) for d in devices] == \
        [run_device]
    assert "Linear layers -> bitsandbytes int8" in caplog.text
    if run_device.type == "cuda":
        assert "stays on cuda" in caplog.text
    assert run.global_step == 1


# ---------------------------------------------------------------------------------------------------- CUDA
@needs_cuda
@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_an_encoder_read_with_a_cpu_home_encodes_on_the_gpu(tiny_snapshot, quant):
    """The trainer's sequence: read with home="cpu", encode on the GPU, the offload call, encode again."""
    pytest.importorskip("bitsandbytes")
    loaded = load_text_encoder(TextEncoderOptions(tiny_snapshot, quant=quant), "cuda", home="cpu")
    assert loaded.device.type == "cuda" and loaded.variant == f"bnb_{quant}"
    assert {p.device.type for p in loaded.model.parameters()} == {"cuda"}
    if quant == "int8":
        w = loaded.model.layers[3].mlp.up_proj.weight
        assert w.dtype == torch.int8 and w.CB.device.type == "cuda" and w.SCB.device.type == "cuda"
    tokenizer = load_tokenizer(str(tiny_snapshot / "tokenizer"))
    te = loaded.placed()
    first = encode_captions(te, tokenizer, ["a red square"])[0][0].float()
    place_text_encoder(te, "cpu")  # the trainer's offload after caching: a no-op for a bitsandbytes encoder
    again = encode_captions(place_text_encoder(te, loaded.device), tokenizer, ["a red square"])[0][0].float()
    assert first.device.type == "cuda" and torch.isfinite(first).all()
    assert ((again - first).norm() / first.norm()).item() < 1e-3  # the same weights, where they were
