"""Block swap (library/memory/block_swap.py): the schedule, the data movement and the numerics, on the CPU in the offloader's
test mode (CPU "slots", synchronous copies); the same on CUDA streams when a GPU is present; the argument checks."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from library.errors import UserError
from library.memory.block_swap import (
    BlockSwapConfig,
    ModelOffloader,
    check_block_swap_args,
    place_model,
    spread_positions,
)

CPU = torch.device("cpu")


def cfg(h2d_only: bool = False, **kw) -> BlockSwapConfig:
    return BlockSwapConfig(CPU, h2d_only=h2d_only, allow_cpu_for_tests=True, **kw)


class FakeBlock(nn.Module):
    """A block with a bf16-free mix of tensors: a float Linear, an int8 weight buffer and its fp32 scale buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("w8", torch.randint(-127, 128, (8, 8), dtype=torch.int8))
        self.register_buffer("scale", torch.rand(8, 1) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) + x @ (self.w8.float() * self.scale).t()


def fake_blocks(n: int = 8, seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    blocks = nn.ModuleList(FakeBlock() for _ in range(n))
    blocks.requires_grad_(False)
    return blocks


def run_chain(blocks: nn.ModuleList, off: ModelOffloader | None, x: torch.Tensor, ckpt: bool = True) -> torch.Tensor:
    """The forward loop of MossImage, reduced to the swap calls."""
    if off is not None:
        off.begin_forward(torch.is_grad_enabled(), ckpt)
    for i, block in enumerate(blocks):
        if off is not None:
            off.wait_for_block(i)
        x = checkpoint(block, x, use_reentrant=False) if ckpt and torch.is_grad_enabled() else block(x)
        if off is not None:
            x = off.block_done(i, x)
    return x


def storage_in(t: torch.Tensor, flat: torch.Tensor) -> bool:
    start = flat.data_ptr()
    return start <= t.data_ptr() < start + flat.numel()


def test_spread_positions_include_both_ends():
    assert spread_positions(6, 8) == [0, 1, 3, 4, 6, 7]
    assert spread_positions(4, 42) == [0, 14, 27, 41]
    assert spread_positions(42, 42) == list(range(42)) and spread_positions(1, 5) == [0]


def test_layout_after_enable_every_tensor_in_host_arena_or_slot():
    blocks = fake_blocks()
    off = ModelOffloader(list(blocks), 4, cfg())
    # 8 blocks, 4 swapped: 4 GPU slots = 2 fixed blocks + a ring of 2; 6 streamed blocks
    assert off.ring == 2 and off.streamed == [0, 1, 3, 4, 6, 7]
    assert off.resident_blocks() == [0, 1, 2, 5] and off.is_armed()
    assert off.host.numel() == 6 * off.layout.nbytes
    for b in off.streamed:
        where = off.slots[off.slot_of[b]] if off.slot_of[b] is not None else off.host
        tensors = [blocks[b].lin.weight, blocks[b].lin.bias, blocks[b].w8, blocks[b].scale]
        assert all(storage_in(t, where) for t in tensors), b  # the int8 weight and its fp32 scale move together
    assert blocks[2].lin.weight.data_ptr() not in range(off.host.data_ptr(), off.host.data_ptr() + off.host.numel())


@pytest.mark.parametrize("h2d_only", [False, True])
def test_forward_without_grad_wraps_around_and_matches(h2d_only):
    ref, blocks = fake_blocks(), fake_blocks()
    off = ModelOffloader(list(blocks), 4, cfg(h2d_only))
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(3):
            loads = off.loads
            assert torch.equal(run_chain(blocks, off, x), run_chain(ref, None, x))
            assert off.loads - loads == 4 + 2 and off.is_armed()  # S + k loads, ends armed: no re-arm needed
    assert off.write_backs == (0 if h2d_only else off.loads - 2)


@pytest.mark.parametrize("h2d_only", [False, True])
def test_training_pass_matches_plain_and_ends_armed(h2d_only):
    ref, blocks = fake_blocks(), fake_blocks()
    off = ModelOffloader(list(blocks), 5, cfg(h2d_only))
    for step in range(2):
        x0 = torch.randn(2, 8, generator=torch.Generator().manual_seed(step))
        xa, xb = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
        run_chain(ref, None, xa).pow(2).sum().backward()
        loads = off.loads
        out = run_chain(blocks, off, xb)
        assert not off.is_armed()  # the forward leaves the last k streamed blocks for the backward
        out.pow(2).sum().backward()
        assert off.loads - loads == 2 * 5 and off.is_armed()  # 2S loads per step: the same traffic as pair swaps
        torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=0)


def test_write_back_keeps_in_place_changes_h2d_only_drops_them():
    for h2d_only, kept in ((False, True), (True, False)):
        blocks = fake_blocks()
        off = ModelOffloader(list(blocks), 4, cfg(h2d_only))
        with torch.no_grad():
            blocks[0].lin.bias.add_(1.0)  # block 0 is resident (in the ring)
            expected = blocks[0].lin.bias.clone()
            run_chain(blocks, off, torch.randn(1, 8))  # block 0 leaves and comes back
        assert torch.equal(blocks[0].lin.bias, expected) is kept


def test_missing_block_is_an_error_not_a_silent_wrong_result():
    blocks = fake_blocks()
    off = ModelOffloader(list(blocks), 4, cfg())
    with pytest.raises(RuntimeError, match="block 3 is needed but is not on"):
        off.wait_for_block(3)


def test_partial_backward_or_no_backward_rearms_on_next_forward():
    ref, blocks = fake_blocks(), fake_blocks()
    off = ModelOffloader(list(blocks), 4, cfg())
    x = torch.randn(2, 8, requires_grad=True)
    run_chain(blocks, off, x)  # a forward with gradients whose backward never runs
    assert not off.is_armed()
    with torch.no_grad():
        assert torch.equal(run_chain(blocks, off, x), run_chain(ref, None, x))
    assert off.is_armed()


def test_gradients_without_checkpointing_are_refused():
    blocks = fake_blocks()
    off = ModelOffloader(list(blocks), 4, cfg())
    with pytest.raises(RuntimeError, match="needs gradient checkpointing"):
        run_chain(blocks, off, torch.randn(2, 8, requires_grad=True), ckpt=False)


def test_offloader_rejects_bad_setups():
    with pytest.raises(UserError, match="too large: the DiT has 8 blocks and 2 must stay on the GPU, so use at most 6"):
        ModelOffloader(list(fake_blocks()), 7, cfg())
    with pytest.raises(UserError, match="needs a CUDA device"):
        ModelOffloader(list(fake_blocks()), 2, BlockSwapConfig(CPU))
    trainable = fake_blocks()
    trainable[3].lin.weight.requires_grad_(True)
    with pytest.raises(UserError, match="base weights frozen"):
        ModelOffloader(list(trainable), 4, cfg(True))
    odd = fake_blocks()
    odd[5].lin = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="block 5 differs"):
        ModelOffloader(list(odd), 4, cfg())


# ------------------------------------------------------------------------------------------- the tiny MOSS-Image DiT
def tiny_pair(blocks_to_swap: int | None, h2d_only: bool = False, **checkpointing: bool):
    from library.moss_image.dit import MossImage
    from library.moss_image.tiny_snapshot import TINY_DIT_CONFIG, tiny_dit_state_dict
    from networks.lora_generic import create_network

    sd = {k: v.float() for k, v in tiny_dit_state_dict(0).items()}
    model = MossImage(TINY_DIT_CONFIG)
    model.load_state_dict(sd)
    model.requires_grad_(False)
    if blocks_to_swap:
        place_model(model, CPU, blocks_to_swap, h2d_only=h2d_only, allow_cpu_for_tests=True)
    net = create_network(1.0, 4, 1.0, None, None, model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    net.apply_to(None, model, False, True)
    model.enable_gradient_checkpointing(**checkpointing)
    return model, net


def dit_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 128, 4, 4, generator=g), torch.tensor([600.0]), torch.randn(1, 5, 64, generator=g),
            torch.tensor([[True, True, True, True, False]]))


@pytest.mark.parametrize("h2d_only", [False, True])
def test_dit_block_swap_same_loss_and_lora_gradients(h2d_only):
    (ref, ref_net), (dit, net) = tiny_pair(None), tiny_pair(14, h2d_only)
    off = dit.block_offloader
    assert len(off.streamed) == 16 and off.resident_blocks() == sorted(set(range(24)) - set(off.streamed[2:]))
    for step in range(2):
        x, t, emb, mask = dit_inputs(step)
        losses = []
        for model, network in ((ref, ref_net), (dit, net)):
            network.zero_grad(set_to_none=True)
            loss = model(x.requires_grad_(True), t, emb, mask).pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-7)
        for (name, a), b in zip(ref_net.named_parameters(), net.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
        assert off.is_armed()
    with torch.no_grad():  # sampling: forward passes without gradients, CFG with the uncond skip layer
        x, t, emb, mask = dit_inputs(5)
        for skip in ((), (22,)):
            torch.testing.assert_close(dit(x, t, emb, mask, skip_layers=skip), ref(x, t, emb, mask, skip_layers=skip))
    dit.prepare_block_swap_before_forward()  # what the trainer calls after each validation batch: a no-op here
    assert off.is_armed()


@pytest.mark.parametrize("mode", ["cpu_offload", "unsloth_offload"])
def test_dit_offloaded_checkpointing_same_loss_and_lora_gradients(mode):
    (ref, ref_net), (dit, net) = tiny_pair(None), tiny_pair(None, **{mode: True})
    x, t, emb, mask = dit_inputs(1)
    for model in (ref, dit):
        model(x.clone().requires_grad_(True), t, emb, mask).pow(2).mean().backward()
    for (name, a), b in zip(ref_net.named_parameters(), net.parameters()):
        assert b.grad is not None and a.grad.abs().sum() > 0, name  # the LoRA outside the block gets its gradient
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


# ---------------------------------------------------------------------------------------------------- CUDA streams
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("h2d_only", [False, True])
def test_cuda_streams_same_results_as_resident_model(h2d_only):
    from library.moss_image.dit import MossImage
    from library.moss_image.tiny_snapshot import TINY_DIT_CONFIG, tiny_dit_state_dict

    dev = torch.device("cuda")
    sd = {k: v.float() for k, v in tiny_dit_state_dict(0).items()}
    ref, dit = MossImage(TINY_DIT_CONFIG), MossImage(TINY_DIT_CONFIG)
    for m in (ref, dit):
        m.load_state_dict(sd)
        m.requires_grad_(False)
        m.enable_gradient_checkpointing()
    ref.to(dev)
    place_model(dit, dev, 20, h2d_only=h2d_only)
    off = dit.block_offloader
    assert off.pinned and off.host.is_pinned() and off.slots[0].device.type == "cuda"
    x, t, emb, mask = (v.to(dev) for v in dit_inputs(3))
    grads = []
    for model in (ref, dit):
        xi = x.clone().requires_grad_(True)
        model(xi, t, emb, mask).pow(2).mean().backward()
        grads.append(xi.grad)
    torch.testing.assert_close(grads[1], grads[0])
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(dit(x, t, emb, mask), ref(x, t, emb, mask))
    assert off.is_armed()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_trainer_with_block_swap_validation_and_samples(tiny_snapshot, tmp_path):
    from library.files.safetensors_io import load_safetensors
    from tests.test_trainer import base_args, make_toy_dataset, train

    data = make_toy_dataset(tmp_path / "data")
    cfg_file = tmp_path / "dataset.toml"
    cfg_file.write_text(f'[general]\nresolution = 64\ncaption_extension = ".txt"\n[[datasets]]\n'
                        f'validation_split = 0.25\n[[datasets.subsets]]\nimage_dir = "{(data / "4_toy").as_posix()}"\n')
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square on a grey background --w 64 --h 64 --s 2 --d 5\n")
    # the trainer turns TF32 on for the process when the DiT is placed; on from the start, the three runs cache the
    # same latents and text encoder outputs
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    loras = []
    for name, extra in (("plain", []), ("swap", ["--blocks_to_swap", "12"]), ("h2d", ["--blocks_to_swap", "20",
                                                                                      "--block_swap_h2d_only"])):
        argv = base_args(tiny_snapshot, data, tmp_path / name, "--max_train_steps", "4", "--learning_rate", "1e-3",
                         "--gradient_checkpointing", "--validate_every_n_steps", "2", "--sample_prompts", str(prompts),
                         "--sample_every_n_steps", "4", *extra)
        argv[argv.index("--train_data_dir"): argv.index("--train_data_dir") + 2] = ["--dataset_config", str(cfg_file)]
        run = train(argv)
        assert len(run.validation_history) == 2 and list((tmp_path / name / "sample").glob("*.png"))
        if extra:
            assert run.unet.block_offloader is not None and run.unet.block_offloader.is_armed()
        loras.append(load_safetensors(tmp_path / name / "toy.safetensors"))
    for other in loras[1:]:
        for key, value in loras[0].items():
            assert ((other[key] - value).norm() / value.norm().clamp_min(1e-12)).item() < 1e-3, key


# -------------------------------------------------------------------------------------------------- argument checks
def swap_args(**kw) -> argparse.Namespace:
    base = dict(blocks_to_swap=None, block_swap_h2d_only=False, no_pinned_memory_for_block_swap=False,
                gradient_checkpointing=True, cpu_offload_checkpointing=False, unsloth_offload_checkpointing=False)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(blocks_to_swap=41), "--blocks_to_swap 41 is too large"),
        (dict(blocks_to_swap=-1), "is negative"),
        (dict(block_swap_h2d_only=True), "--block_swap_h2d_only only applies to block swap"),
        (dict(no_pinned_memory_for_block_swap=True), "--no_pinned_memory_for_block_swap only applies"),
        (dict(blocks_to_swap=8, cpu_offload_checkpointing=True), "not supported with --cpu_offload_checkpointing"),
        (dict(blocks_to_swap=8, unsloth_offload_checkpointing=True), "not supported with --unsloth_offload_checkpoint"),
        (dict(blocks_to_swap=8, block_swap_h2d_only=True, gradient_checkpointing=False),
         "--block_swap_h2d_only requires --gradient_checkpointing"),
    ],
)
def test_argument_errors(kw, message):
    with pytest.raises(UserError, match=message):
        check_block_swap_args(swap_args(**kw))


def test_device_and_ddp_checks(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--blocks_to_swap needs a CUDA device"):
        check_block_swap_args(swap_args(blocks_to_swap=8))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import moss_image_train_network as trainer
    from library.options.implications import TRAINING_IMPLICATIONS, apply_implications

    args = trainer.setup_parser().parse_args(["--blocks_to_swap", "8"])
    with caplog.at_level(logging.WARNING):
        apply_implications(args, TRAINING_IMPLICATIONS)  # the default swap mode turns gradient checkpointing on
    assert args.gradient_checkpointing and "gradient_checkpointing is also enabled" in caplog.text
    check_block_swap_args(args)  # the check itself changes nothing, and refuses a swap without checkpointing
    with pytest.raises(UserError, match="needs --gradient_checkpointing"):
        check_block_swap_args(swap_args(blocks_to_swap=8, gradient_checkpointing=False))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.INFO):
        check_block_swap_args(swap_args(blocks_to_swap=8))  # DDP: each process swaps its own GPU's blocks
    assert "block swap in each of the 2 processes" in caplog.text


def test_trainer_and_inference_use_the_checks(monkeypatch):
    import moss_image_minimal_inference as inference
    import moss_image_train_network as trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = trainer.setup_parser().parse_args(["--blocks_to_swap", "20", "--gradient_checkpointing"])
    with pytest.raises(UserError, match="needs a CUDA device"):
        trainer.MossImageNetworkTrainer._check_swap_and_int8_args(args)
    args = trainer.setup_parser().parse_args(["--blocks_to_swap", "20", "--unsloth_offload_checkpointing"])
    with pytest.raises(UserError, match="not supported with --unsloth_offload_checkpointing"):
        trainer.MossImageNetworkTrainer._check_swap_and_int8_args(args)
    args = inference.setup_parser().parse_args(["--prompt", "a", "--blocks_to_swap", "20", "--device", "cpu"])
    with pytest.raises(UserError, match="needs a CUDA device"):
        inference._check_args(args)
    args = inference.setup_parser().parse_args(["--prompt", "a", "--blocks_to_swap", "41"])
    with pytest.raises(UserError, match="at most 40"):
        inference._check_args(args)
