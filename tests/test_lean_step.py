"""The lean training step: cached RoPE tables equal the formula, the padding decision and the text lengths come from
the host mask (no scalar read in the DiT forward and backward), the trainer logs each step's loss one step later
with the values and step numbers of that step, Python's GC stays out of the steps, and fused AdamW on CUDA."""

from __future__ import annotations

import argparse
import gc
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moss_image_train_network as m
from library.moss_image.dit import text_lengths
from library.moss_image.loaders import load_moss_image_model
from library.moss_image.rope import RopeTables, rope_cos_sin
from library.moss_image.tiny_snapshot import TINY_DIT_CONFIG
from library.training import optimizers
from networks.lora_generic import create_network
from tests.test_trainer import base_args, make_toy_dataset

SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                torch.ops.aten.is_nonzero.default}


class ScalarReads(TorchDispatchMode):
    """Records tensor -> Python number reads (`.item()`, `bool(t)`, `float(t)`): each one is a device sync on a
    GPU. Reads of the optimizer's step counters (host tensors on every device) are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in SCALAR_READS:
            frame = sys._getframe(1)
            while frame is not None and "torch/optim/" not in frame.f_code.co_filename.replace("\\", "/"):
                frame = frame.f_back
            if frame is None:
                caller = sys._getframe(1)
                while caller.f_back is not None and "torch/" in caller.f_code.co_filename.replace("\\", "/"):
                    caller = caller.f_back
                self.reads[f"{caller.f_code.co_filename}:{caller.f_lineno}"] += 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------------- RoPE
def positions(lengths: list[int], t_pad: int, h: int, w: int) -> torch.Tensor:
    """The positions of the model's documentation, written out: text i at (i, 0, 0), image (r, c) at (T, r, c)."""
    rows = []
    for n in lengths:
        text = [(i, 0, 0) for i in range(t_pad)]
        image = [(n, r, c) for r in range(h) for c in range(w)]
        rows.append(text + image)
    return torch.tensor(rows)


@pytest.mark.parametrize("lengths, t_pad, h, w", [([5], 5, 4, 4), ([3, 7], 7, 2, 3), ([70], 80, 9, 70),
                                                 ([200, 256], 256, 64, 64)])
def test_cached_rope_tables_equal_the_formula(lengths, t_pad, h, w):
    tables = RopeTables(TINY_DIT_CONFIG.rope_axes_dims, TINY_DIT_CONFIG.rope_theta)
    tables.cos_sin([2], 2, 1, 1, torch.device("cpu"))  # small tables first: later calls must grow them
    cos, sin = tables.cos_sin(lengths, t_pad, h, w, torch.device("cpu"))
    ref_cos, ref_sin = rope_cos_sin(positions(lengths, t_pad, h, w), TINY_DIT_CONFIG.rope_axes_dims,
                                    TINY_DIT_CONFIG.rope_theta)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)  # the same float64 angles: bitwise
    again = tables.cos_sin(lengths, t_pad, h, w, torch.device("cpu"))
    assert torch.equal(again[0], cos) and tables.grid(h, w, torch.device("cpu"))[0] is tables.grid(h, w, "cpu")[0]


def test_text_lengths_from_the_host_mask():
    assert text_lengths(None, 2, 6) == [6, 6]
    assert text_lengths(torch.tensor([[1, 1, 0], [1, 1, 1]]), 2, 3) == [2, 3]


# ----------------------------------------------------------------------------------------------- the DiT step
@pytest.mark.parametrize("policy", [None, "full", "selective"])
@pytest.mark.parametrize("padded", [False, True])
def test_dit_forward_and_backward_read_no_scalar(tiny_snapshot, policy, padded):
    model = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32)
    model.requires_grad_(False)
    network = create_network(1.0, 4, 1.0, None, None, model)
    network.apply_to(None, model, False, True)
    if policy:
        model.enable_gradient_checkpointing(policy=policy)
    g = torch.Generator().manual_seed(0)
    x, emb = torch.randn(2, 128, 2, 3, generator=g).requires_grad_(True), torch.randn(2, 6, 64, generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    if padded:
        mask[1, 4:] = False
    probe = ScalarReads()
    with probe:
        loss = model(x, torch.tensor([700.0, 300.0]), emb, mask).square().mean()
        loss.backward()
    assert not probe.reads, probe.reads
    assert all(p.grad is not None for p in network.parameters())


# -------------------------------------------------------------------------------------------- the trainer loop
class FakeTracker:
    name = "fake"

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict]] = []

    def log(self, values: dict, step: int | None = None, **kwargs: object) -> None:
        self.logs.append((step, dict(values)))

    def finish(self) -> None:
        pass


class RecordingTrainer(m.MossImageNetworkTrainer):
    """The real trainer, recording what each step returned (read at once, here only), whether GC was enabled during
    the steps, the scalar reads of the steps, and how many losses a validation saw."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = FakeTracker()
        self.step_losses: list[float] = []
        self.gc_enabled_in_steps: set[bool] = set()
        self.reads: Counter = Counter()
        self.losses_seen_by_validation: list[tuple[int, int]] = []

    def _prepare_accelerator(self, args: argparse.Namespace, log_with):  # type: ignore[no-untyped-def]
        acc = super()._prepare_accelerator(args, log_with)
        acc.trackers = [self.tracker]
        return acc

    def _train_step(self, run, batch):  # type: ignore[no-untyped-def]
        self.gc_enabled_in_steps.add(gc.isenabled())
        probe = ScalarReads()
        with probe:
            loss = super()._train_step(run, batch)
        self.reads.update(probe.reads)
        assert isinstance(loss, torch.Tensor) and not loss.requires_grad
        self.step_losses.append(float(loss))
        return loss

    def _validate(self, run, what, log_key):  # type: ignore[no-untyped-def]
        self.losses_seen_by_validation.append((run.global_step, len(run.loss_history)))
        return super()._validate(run, what, log_key)


def test_trainer_logs_each_step_loss_at_its_step_without_syncs_and_gc_outside_the_steps(tiny_snapshot, tmp_path):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    data = make_toy_dataset(tmp_path / "data", n=4)
    argv = base_args(tiny_snapshot, data, tmp_path / "out", "--max_train_steps", "5", "--learning_rate", "1e-3",
                     "--gradient_checkpointing", "--checkpointing_policy", "selective", "--validation_split", "0.25",
                     "--validate_every_n_steps", "3", "--max_validation_steps", "1")
    trainer = RecordingTrainer()
    run = trainer.train(m.setup_parser().parse_args(argv))

    assert run.loss_history == trainer.step_losses  # every step's loss, in order, the values the step returned
    step_logs = [(step, v) for step, v in trainer.tracker.logs if "loss/current" in v]
    assert [step for step, _ in step_logs] == [1, 2, 3, 4, 5]
    window = len(run.train_dataloader)
    for i, (step, values) in enumerate(step_logs):
        assert values["loss/current"] == trainer.step_losses[i]
        seen = trainer.step_losses[: i + 1][-window:]
        assert values["loss/average"] == pytest.approx(sum(seen) / len(seen))
        assert any(k.startswith("lr/") for k in values)
    logged_steps = [step for step, _ in trainer.tracker.logs]
    assert logged_steps == sorted(logged_steps)  # trackers (wandb) need non-decreasing steps
    assert trainer.losses_seen_by_validation[0] == (3, 3)  # the validation at step 3 reads step 3's loss
    assert not trainer.reads, trainer.reads  # no tensor -> number read inside a step
    assert trainer.gc_enabled_in_steps == {False} and gc.isenabled() and gc.get_freeze_count() == 0


# ------------------------------------------------------------------------------------------------- fused AdamW
def _optimizer(*argv: str) -> optimizers.OptimizerConfig:
    parser = argparse.ArgumentParser()
    optimizers.add_optimizer_arguments(parser)
    return optimizers.OptimizerConfig.from_args(parser.parse_args(["--learning_rate", "1e-3", *argv]))


def test_fused_adamw_only_for_adamw_on_cuda_unless_chosen():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert optimizers.fused_adamw_defaults(_optimizer(), cuda) == {"fused": True}
    assert optimizers.fused_adamw_defaults(_optimizer(), cpu) == {}
    assert optimizers.fused_adamw_defaults(_optimizer("--optimizer_args", "foreach=True"), cuda) == {}
    assert optimizers.fused_adamw_defaults(_optimizer("--optimizer_args", "fused=False"), cuda) == {}
    assert optimizers.fused_adamw_defaults(_optimizer("--optimizer_type", "Lion"), cuda) == {}


def test_fused_adamw_is_the_same_update_and_keeps_the_description():
    torch.manual_seed(0)
    weights = [torch.randn(16, 64), torch.randn(64, 16)]
    config = _optimizer("--optimizer_args", "weight_decay=0.01")
    results = []
    for defaults in ({}, {"fused": True}):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        name, desc, opt = optimizers.get_optimizer(config, params, defaults)
        assert (name, desc) == ("torch.optim.adamw.AdamW", "weight_decay=0.01")
        assert opt.defaults["fused"] is (True if defaults else None)
        for step in range(3):
            for p in params:
                p.grad = torch.sin(p.detach() * (step + 1))
            opt.step()
        results.append([p.detach() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
