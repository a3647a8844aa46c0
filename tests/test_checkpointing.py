"""--checkpointing_policy: the selective policy's choices, the same LoRA gradients as full checkpointing (eager, inside
compiled blocks, with block swap and with ConvRot INT8), what it keeps (fewer recomputed operators), the refusals."""

from __future__ import annotations

import argparse
import logging
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy

from library.errors import UserError
from library.memory.block_swap import place_model
from library.moss_image.loaders import load_moss_image_model
from library.quant.convrot import convert_model_to_convrot_int8, dit_convrot_filter
from library.runtime import checkpointing
from library.runtime.checkpointing import ATTENTION_OPS, check_checkpointing_args, selective_policy
from library.runtime.eager_fusion import plain_forms
from networks.lora_generic import create_network

TINY_LAYERS = 24
# per block, the selective policy keeps the FFN down-projection and the LoRA down-projections: q, k and v's as one
# product (library.lora.eager_node.LoRAGroup), o's, ffn_up_gate's and ffn_down's
KEPT_PRODUCTS_PER_BLOCK = 5
aten = torch.ops.aten


class OpCounter(TorchDispatchMode):
    """Counts the aten operators that run (including those inside `run_with_rng_state`, which a compiled backward
    uses to recompute an attention)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func] += 1
        if isinstance(func, torch._ops.HigherOrderOperator):
            if func.name() == "run_with_rng_state":
                self.ops[args[1]] += 1
            with _disable_current_modes():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

    def attention_forwards(self) -> int:
        return sum(n for op, n in self.ops.items() if op in ATTENTION_OPS)


# ---------------------------------------------------------------------------------------------------- the policy
def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta")


@pytest.mark.parametrize("op, args, kept", [
    (aten.mm.default, (_meta(4352, 8192), _meta(8192, 3072)), True),  # FFN down-projection
    (aten.mm.default, (_meta(4352, 3072), _meta(3072, 16)), True),  # LoRA down-projection
    (aten.mm.default, (_meta(4352, 3072), _meta(3072, 3072)), False),  # q / k / v / o
    (aten.mm.default, (_meta(4352, 3072), _meta(3072, 16384)), False),  # FFN up-projection
    (aten.mm.default, (_meta(4352, 16), _meta(16, 3072)), False),  # LoRA up-projection
    (aten.addmm.default, (_meta(16), _meta(8, 64), _meta(64, 16)), True),  # with a bias: operands 1 and 2
    (aten.addmm.default, (_meta(64), _meta(8, 64), _meta(64, 64)), False),
    (aten.bmm.default, (_meta(2, 8, 64), _meta(2, 64, 8)), True),
    (aten.add.Tensor, (_meta(8, 64), _meta(8, 64)), False),
    (aten.mul.Tensor, (_meta(8, 64), _meta(8, 64)), False),
])
def test_selective_policy_keeps_attention_and_narrowing_products(op, args, kept):
    want = CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE
    assert selective_policy(None, op, *args) is want


def test_selective_policy_keeps_every_attention_kernel_and_recomputes_unknown_ops():
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in ATTENTION_OPS
    assert aten._scaled_dot_product_efficient_attention.default in ATTENTION_OPS
    assert all(selective_policy(None, op) is CheckpointPolicy.MUST_SAVE for op in ATTENTION_OPS)
    lib = torch.library.Library("moss_ckpt_test", "FRAGMENT")  # a custom op, like the ConvRot INT8 Linear
    lib.define("int8_linear(Tensor x, Tensor w) -> Tensor")
    custom = torch.ops.moss_ckpt_test.int8_linear.default
    assert selective_policy(None, custom, _meta(8, 64), _meta(16, 64)) is CheckpointPolicy.PREFER_RECOMPUTE


# ------------------------------------------------------------------------------------------- the tiny DiT + LoRA
def tiny_dit_with_lora(tiny_snapshot, policy: str | None, int8: bool = False, swap: int | None = None,
                       h2d_only: bool = True, **network_kwargs):
    model = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32)
    model.requires_grad_(False)
    if int8:
        convert_model_to_convrot_int8(model, dit_convrot_filter, group_size=64)
    if swap:
        place_model(model, "cpu", swap, h2d_only=h2d_only, allow_cpu_for_tests=True)
    network = create_network(1.0, 4, 1.0, None, None, model, **network_kwargs)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in network.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    network.apply_to(None, model, False, True)
    if policy is not None:
        model.enable_gradient_checkpointing(policy=policy)
    return model, network


def dit_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[True, True, True, True, False]])  # a padded caption: the key mask reaches attention
    return torch.randn(1, 128, 4, 4, generator=g), torch.tensor([600.0]), torch.randn(1, 5, 64, generator=g), mask


def loss_and_grads(model, network, seed: int = 0, counter: OpCounter | None = None):
    x, t, emb, mask = dit_inputs(seed)
    network.zero_grad(set_to_none=True)
    loss = model(x.requires_grad_(True), t, emb, mask).pow(2).mean()  # the trainer's input requires grad too
    if counter is None:
        loss.backward()
    else:
        with counter:
            loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in network.named_parameters()}


def assert_same(got, ref, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(got[0], ref[0], rtol=rtol, atol=atol)
    assert got[1].keys() == ref[1].keys()
    for name, grad in ref[1].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got[1][name], grad, rtol=rtol, atol=atol, msg=name)


def test_selective_gives_the_lora_gradients_of_full_checkpointing_and_recomputes_less(tiny_snapshot):
    ref = loss_and_grads(*tiny_dit_with_lora(tiny_snapshot, None))
    counts = {}
    for policy in ("full", "selective"):
        counter = OpCounter()
        got = loss_and_grads(*tiny_dit_with_lora(tiny_snapshot, policy), counter=counter)
        assert_same(got, ref, rtol=0, atol=0)  # the same operators on the same values: bitwise
        counts[policy] = counter
    # full recomputes every block's attention in backward, selective none; and it keeps 5 products per block
    assert counts["full"].attention_forwards() == TINY_LAYERS and counts["selective"].attention_forwards() == 0
    mm = aten.mm.default
    assert counts["full"].ops[mm] - counts["selective"].ops[mm] == TINY_LAYERS * KEPT_PRODUCTS_PER_BLOCK


@pytest.mark.parametrize("int8, swap, dropouts", [
    (False, None, False),
    (False, None, True),  # the recomputation draws the forward's random numbers again
    (True, None, False),
    (False, 14, False),
])
def test_eager_full_reentrant_gives_the_gradients_of_the_non_reentrant_form(tiny_snapshot, monkeypatch, int8, swap,
                                                                           dropouts):
    """Eager `full` checkpointing takes torch's reentrant form (less host time per block); the non-reentrant form,
    the same operators on the same values: the same loss and LoRA gradients bit for bit, over two steps (the random
    stream after a step is the same too), with ConvRot INT8 and with block swap."""
    kwargs = {"neuron_dropout": 0.1, "rank_dropout": "0.2", "module_dropout": "0.3"} if dropouts else {}
    forms: Counter = Counter()
    real_checkpoint = checkpointing.checkpoint

    def counting(fn, *args, use_reentrant, **kw):
        forms[use_reentrant] += 1
        return real_checkpoint(fn, *args, use_reentrant=use_reentrant, **kw)

    monkeypatch.setattr(checkpointing, "checkpoint", counting)
    results = {}
    for reentrant in (True, False):
        saved = checkpointing.EAGER_FULL["reentrant"]
        checkpointing.EAGER_FULL["reentrant"] = reentrant
        try:
            model, network = tiny_dit_with_lora(tiny_snapshot, "full", int8=int8, swap=swap, **kwargs)
            torch.manual_seed(5)  # module and rank dropout draw from torch's global generator
            results[reentrant] = [_loss_and_some_grads(model, network, seed) for seed in (0, 1)]
        finally:
            checkpointing.EAGER_FULL["reentrant"] = saved
    assert forms[True] == forms[False] == 2 * TINY_LAYERS  # each form checkpointed every block in both steps
    for (loss, grads), (ref_loss, ref_grads) in zip(results[True], results[False]):
        assert torch.equal(loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        assert [n for n, g in grads.items() if g is None] == [n for n, g in ref_grads.items() if g is None]
        assert sum(g is not None and g.abs().sum() > 0 for g in ref_grads.values()) > len(ref_grads) // 2
        for name, grad in ref_grads.items():
            assert grad is None or torch.equal(grads[name], grad), name


def _loss_and_some_grads(model, network, seed):
    """loss_and_grads where module dropout may leave a module out of a step (no gradient: None)."""
    x, t, emb, mask = dit_inputs(seed)
    network.zero_grad(set_to_none=True)
    loss = model(x.requires_grad_(True), t, emb, mask).pow(2).mean()
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in network.named_parameters()}


def test_eager_full_reentrant_with_the_fused_backward_pass(tiny_snapshot):
    """--fused_backward_pass steps each LoRA tensor as its gradient arrives; the reentrant form produces them inside
    its own backward per block: the weights after two steps are the non-reentrant form's, bit for bit."""
    import argparse

    from library.training import optimizers as opt

    parser = argparse.ArgumentParser()
    opt.add_optimizer_arguments(parser)
    cfg = opt.OptimizerConfig.from_args(parser.parse_args(["--optimizer_type", "Adafactor", "--fused_backward_pass"]))
    weights = {}
    for reentrant in (True, False):
        saved = checkpointing.EAGER_FULL["reentrant"]
        checkpointing.EAGER_FULL["reentrant"] = reentrant
        handles = []
        try:
            model, network = tiny_dit_with_lora(tiny_snapshot, "full")
            before = [p.detach().clone() for p in network.parameters()]
            _, _, optimizer = opt.get_optimizer(cfg, network.parameters())
            opt.check_fused_backward_pass(cfg, optimizer, gradient_accumulation_steps=1)
            handles = opt.install_fused_backward_pass(optimizer, 0.0)
            for seed in (0, 1):
                x, t, emb, mask = dit_inputs(seed)
                model(x.requires_grad_(True), t, emb, mask).pow(2).mean().backward()
                assert all(p.grad is None for p in network.parameters())  # stepped and cleared in backward
            weights[reentrant] = [p.detach().clone() for p in network.parameters()]
            assert all(not torch.equal(a, b) for a, b in zip(before, weights[reentrant]))  # every tensor stepped
        finally:
            for h in handles:
                h.remove()
            checkpointing.EAGER_FULL["reentrant"] = saved
    assert all(torch.equal(a, b) for a, b in zip(weights[True], weights[False]))


def test_eager_full_takes_the_reentrant_form_only_with_an_input_that_requires_grad(monkeypatch):
    """Without an input that requires grad the reentrant form would leave the parameters inside without gradients
    (a LoRA of the text refiner, whose input is the cached text): the non-reentrant form is taken there."""
    seen = []

    def spy(fn, *args, use_reentrant, **kwargs):
        seen.append(use_reentrant)
        return fn(*args)

    monkeypatch.setattr(checkpointing, "checkpoint", spy)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    checkpointing.checkpointed(lin, "full", x)
    checkpointing.checkpointed(lin, "full", x.requires_grad_(True))
    checkpointing.checkpointed(lin, "selective", x)
    assert seen == [False, True, False]


@pytest.mark.parametrize("h2d_only", [False, True])
def test_selective_with_block_swap(tiny_snapshot, h2d_only):
    """Block swap moves the weights between the forward and the backward: the kept outputs are from the forward,
    the recomputation reads the weights brought back; two steps, so that the ring goes round."""
    ref_model, ref_net = tiny_dit_with_lora(tiny_snapshot, "full")
    model, network = tiny_dit_with_lora(tiny_snapshot, "selective", swap=14, h2d_only=h2d_only)
    for seed in (0, 1):
        assert_same(loss_and_grads(model, network, seed), loss_and_grads(ref_model, ref_net, seed), rtol=0, atol=0)
    assert model.block_offloader.is_armed()


def test_selective_inside_compiled_blocks_with_block_swap(tiny_snapshot):
    """The compiled backward (inductor's partitioner, aot_eager_decomp_partition: no C++ build) of the checkpoint
    compiled inside each block: full recomputes each attention, selective none; block swap (host-to-device ring on the
    CPU test slots) moves the weights between the forward and the backward, and the gradients stay the same."""
    ref = loss_and_grads(*tiny_dit_with_lora(tiny_snapshot, None))
    torch._dynamo.reset()
    try:
        counts = {}
        for policy, swap in (("full", None), ("selective", 14)):
            model, network = tiny_dit_with_lora(tiny_snapshot, policy, swap=swap)
            model.compile_regions(backend="aot_eager_decomp_partition")
            for seed in (0, 1):  # the first step compiles, the second runs the compiled code again
                counter = OpCounter()
                got = loss_and_grads(model, network, counter=counter)
                assert_same(got, ref)
            counts[policy] = counter
            if swap:
                assert model.block_offloader.is_armed() and model.block_offloader.loads > swap
    finally:
        torch._dynamo.reset()
    assert counts["full"].attention_forwards() == TINY_LAYERS and counts["selective"].attention_forwards() == 0


def test_selective_with_convrot_int8_layers(tiny_snapshot):
    """The int8 Linears are registered ops the policy does not know (recomputed); attention is still kept. Compiled
    (dynamo with the eager backend: the int8 ops inside the traced checkpoint), the results stay exact."""
    ref = loss_and_grads(*tiny_dit_with_lora(tiny_snapshot, "full", int8=True))
    counter = OpCounter()
    assert_same(loss_and_grads(*tiny_dit_with_lora(tiny_snapshot, "selective", int8=True), counter=counter), ref,
                rtol=0, atol=0)
    assert counter.attention_forwards() == 0
    torch._dynamo.reset()
    try:
        with plain_forms():  # a compiled region computes the plain forms, operator for operator
            ref = loss_and_grads(*tiny_dit_with_lora(tiny_snapshot, "full", int8=True))
        model, network = tiny_dit_with_lora(tiny_snapshot, "selective", int8=True)
        model.compile_regions(backend="eager")
        assert_same(loss_and_grads(model, network), ref, rtol=0, atol=0)
    finally:
        torch._dynamo.reset()


_POLICY_CALLS: list = []


def _counting_recompute_all(ctx, op, *args, **kwargs):  # a module function: dynamo traces a partial of it
    _POLICY_CALLS.append(op)
    return CheckpointPolicy.PREFER_RECOMPUTE


def test_compiled_full_checkpointing_tags_every_operator_of_the_int8_blocks(tiny_snapshot, monkeypatch):
    """Inside a compiled block, `full` tags every aten operator for recomputation through an all-recompute policy
    (dynamo's own tags cover the traced checkpoint body; on the H200 the compiled INT8 step kept every int8 Linear's
    output with them, 18.0 GiB instead of 8.5; here on the CPU both recompute). The policy reaches the int8 Linear
    inside its autograd.Function, the backward recomputes the Linears and each attention, the loss is eager full
    checkpointing's; eager checkpointing never consults the policy."""
    from library.quant import convrot_ops
    from library.quant.convrot import ConvRotInt8Linear
    from library.runtime import checkpointing

    calls = _POLICY_CALLS
    calls.clear()
    monkeypatch.setattr(checkpointing, "recompute_all_policy", _counting_recompute_all)
    ref = loss_and_grads(*tiny_dit_with_lora(tiny_snapshot, "full", int8=True))
    assert not calls
    torch._dynamo.reset()
    try:
        model, network = tiny_dit_with_lora(tiny_snapshot, "full", int8=True)
        model.compile_regions(backend="aot_eager_decomp_partition")
        got = loss_and_grads(model, network)  # compiles (no dispatch mode may be active while dynamo traces)
        counter = OpCounter()
        assert_same(loss_and_grads(model, network, counter=counter), got, rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
    assert convrot_ops.LINEAR in calls  # the int8 Linear inside its autograd.Function got its tag
    per_block = sum(isinstance(m, ConvRotInt8Linear) and not m.full_precision for m in model.layers[0].modules())
    # each main block recomputes its int8 Linears, all but the FFN down-projection, whose output no gradient reads
    # here (the text refiner's input needs no gradient: it is not checkpointed)
    assert per_block == 6 and counter.ops[convrot_ops.LINEAR] == (per_block - 1) * TINY_LAYERS
    assert counter.attention_forwards() == TINY_LAYERS
    # the decomposed graph rounds the int8 inputs otherwise than eager code: the loss agrees, the gradients of these
    # random tiny weights differ by up to 15 % where a rounding flips a code (the same with dynamo's own tags). The
    # loss moves with the flips too: 8e-5 with q, k and v's LoRA as three products, 8e-4 with the compiled group's
    # one (library.lora.compiled_group), whose sliced rank activations round otherwise in the decomposed graph
    torch.testing.assert_close(got[0], ref[0], rtol=1e-3, atol=0)


# ---------------------------------------------------------------------------------------------------- refusals
def _args(**kw) -> argparse.Namespace:
    base = {"checkpointing_policy": "full", "gradient_checkpointing": False, "cpu_offload_checkpointing": False,
            "unsloth_offload_checkpointing": False}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("flag", ["cpu_offload_checkpointing", "unsloth_offload_checkpointing"])
def test_selective_with_the_offloaded_modes_is_refused(flag):
    with pytest.raises(UserError, match=f"--checkpointing_policy selective cannot be used with --{flag}"):
        check_checkpointing_args(_args(checkpointing_policy="selective", gradient_checkpointing=True, **{flag: True}))
    check_checkpointing_args(_args(gradient_checkpointing=True, **{flag: True}))  # full: fine


def test_selective_turns_gradient_checkpointing_on(caplog):
    import moss_image_train_network as trainer
    from library.options.implications import TRAINING_IMPLICATIONS, apply_implications

    args = trainer.setup_parser().parse_args(["--checkpointing_policy", "selective"])
    with caplog.at_level(logging.WARNING):
        apply_implications(args, TRAINING_IMPLICATIONS)
    assert args.gradient_checkpointing and "checkpointing_policy selective is set, so gradient_checkpointing is" \
        " also enabled" in caplog.text
    before = vars(args).copy()
    check_checkpointing_args(args)  # the check changes nothing
    assert vars(args) == before
    args = trainer.setup_parser().parse_args([])
    apply_implications(args, TRAINING_IMPLICATIONS)
    assert args.checkpointing_policy == "full" and not args.gradient_checkpointing  # full alone changes nothing


def test_model_refuses_a_policy_for_the_offloaded_modes(tiny_snapshot):
    model = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not apply to the offloaded modes"):
        model.enable_gradient_checkpointing(unsloth_offload=True, policy="selective")
    with pytest.raises(ValueError, match="unknown checkpointing policy"):
        model.enable_gradient_checkpointing(policy="everything")
    model.enable_gradient_checkpointing(policy="selective")
    assert {b.checkpointing for b in model.layers} == {"selective"}
    model.enable_gradient_checkpointing(cpu_offload=True)  # the offloaded modes checkpoint around the block
    assert {b.checkpointing for b in model.layers} == {None} and model.checkpoint_mode == "cpu_offload"
    model.disable_gradient_checkpointing()
    assert model.checkpoint_mode == "none" and {b.checkpointing for b in model.text_embedder.blocks} == {None}


# ----------------------------------------------------------------------------------------------------- the trainer
def test_trainer_selective_policy_trains_the_same_lora_as_full(tiny_snapshot, tmp_path):
    from library.files.safetensors_io import load_safetensors
    from tests.test_trainer import base_args, make_toy_dataset, train

    data = make_toy_dataset(tmp_path / "data", n=2)
    files = {}
    for policy in ("full", "selective"):
        out = tmp_path / policy
        run = train(base_args(tiny_snapshot, data, out, "--max_train_steps", "3", "--learning_rate", "1e-2",
                              "--gradient_checkpointing", "--checkpointing_policy", policy))
        assert run.unet.checkpoint_policy == policy and {b.checkpointing for b in run.unet.layers} == {policy}
        files[policy] = load_safetensors(out / "toy.safetensors")
    assert files["full"].keys() == files["selective"].keys()
    for key, value in files["full"].items():
        torch.testing.assert_close(files["selective"][key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_trainer_refuses_selective_with_unsloth_offload(tiny_snapshot, tmp_path):
    from tests.test_trainer import base_args, train

    with pytest.raises(UserError, match="--checkpointing_policy selective cannot be used with --unsloth_offload"):
        train(base_args(tiny_snapshot, tmp_path, tmp_path / "out", "--checkpointing_policy", "selective",
                        "--unsloth_offload_checkpointing"))


def test_selective_without_compile_warns(caplog):
    with caplog.at_level(logging.WARNING):
        check_checkpointing_args(_args(checkpointing_policy="selective", gradient_checkpointing=True, compile=False))
    assert "without --compile" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_checkpointing_args(_args(checkpointing_policy="selective", gradient_checkpointing=True, compile=True))
    assert not caplog.text


# --------------------------------------------------------------------------------- --checkpointing_skip_blocks
def test_skip_blocks_leaves_the_last_blocks_uncheckpointed_with_the_same_gradients(tiny_snapshot):
    """The last N main blocks keep their activations (their attention is not run again in backward), the others
    are checkpointed; the gradients are those of no checkpointing, bitwise, with and without block swap."""
    ref = loss_and_grads(*tiny_dit_with_lora(tiny_snapshot, None))
    for policy in ("full", "selective"):
        model, network = tiny_dit_with_lora(tiny_snapshot, None)
        model.enable_gradient_checkpointing(policy=policy, skip_blocks=5)
        assert [b.checkpointing for b in model.layers] == [policy] * (TINY_LAYERS - 5) + [None] * 5
        assert {b.checkpointing for b in model.text_embedder.blocks} == {policy}
        counter = OpCounter()
        assert_same(loss_and_grads(model, network, counter=counter), ref, rtol=0, atol=0)
        recomputed = TINY_LAYERS - 5 if policy == "full" else 0  # as full: the main blocks (see above)
        assert counter.attention_forwards() == recomputed
    model, network = tiny_dit_with_lora(tiny_snapshot, None, swap=14)
    model.enable_gradient_checkpointing(skip_blocks=TINY_LAYERS)  # every main block kept, the refiner checkpointed
    for seed in (0, 1):
        assert_same(loss_and_grads(model, network, seed), loss_and_grads(*tiny_dit_with_lora(tiny_snapshot, None),
                                                                          seed), rtol=0, atol=0)
    with pytest.raises(ValueError, match="between 0 and the 24 DiT blocks"):
        model.enable_gradient_checkpointing(skip_blocks=TINY_LAYERS + 1)
    with pytest.raises(ValueError, match="plain checkpointing mode only"):
        model.enable_gradient_checkpointing(cpu_offload=True, skip_blocks=1)


@pytest.mark.parametrize("kw, message", [
    ({"checkpointing_skip_blocks": -1}, "must be 0 or more"),
    ({"checkpointing_skip_blocks": 2}, "needs --gradient_checkpointing"),
    ({"checkpointing_skip_blocks": 2, "gradient_checkpointing": True, "unsloth_offload_checkpointing": True},
     "cannot be used with --unsloth_offload_checkpointing"),
])
def test_skip_blocks_refusals(kw, message):
    with pytest.raises(UserError, match=message):
        check_checkpointing_args(_args(**kw))
    check_checkpointing_args(_args(checkpointing_skip_blocks=2, gradient_checkpointing=True))


def test_trainer_skip_blocks(tiny_snapshot, tmp_path):
    from tests.test_trainer import base_args, make_toy_dataset, train

    data = make_toy_dataset(tmp_path / "data", n=2)
    run = train(base_args(tiny_snapshot, data, tmp_path / "out", "--max_train_steps", "1", "--gradient_checkpointing",
                          "--checkpointing_skip_blocks", "3"))
    assert [b.checkpointing for b in run.unet.layers][-4:] == ["full", None, None, None]
    with pytest.raises(UserError, match="--checkpointing_skip_blocks 99 is more than the DiT's 24 blocks"):
        train(base_args(tiny_snapshot, data, tmp_path / "out2", "--max_train_steps", "1", "--gradient_checkpointing",
                        "--checkpointing_skip_blocks", "99"))


def test_draws_on_the_global_generator_leave_the_steps_timesteps(tiny_snapshot, tmp_path, monkeypatch):
    """Compiled code may draw on torch's global CPU generator (on CUDA, the graph-safe RNG functionalisation, which
    --compile keeps, seeds its generators there at the first run of each checkpointed compiled graph). The step
    draws its timesteps on a generator of its own (library.training.host_random), so such draws leave them."""
    from library.moss_image.dit import MossImage
    from tests.test_trainer import base_args, make_toy_dataset, train

    data = make_toy_dataset(tmp_path / "data", n=2)
    forward = MossImage.forward

    def run(perturb: bool) -> torch.Tensor:
        timesteps = []

        def dit_forward(self, x, t, *args, **kwargs):
            timesteps.append(t.detach().clone())
            if perturb:
                torch.randint(0, 2**31 - 1, (3,))  # as the graph-safe functionalisation's seeding does
            return forward(self, x, t, *args, **kwargs)

        monkeypatch.setattr(MossImage, "forward", dit_forward)
        train(base_args(tiny_snapshot, data, tmp_path / f"out{perturb}", "--max_train_steps", "4"))
        return torch.cat(timesteps)

    plain, perturbed = run(False), run(True)
    assert torch.equal(perturbed, plain) and len(set(plain.tolist())) == 4


@pytest.mark.parametrize("extra", [[], ["--compile", "--compile_backend", "eager"]], ids=["eager", "compiled"])
def test_module_dropout_with_checkpointing_recomputes_the_same_decisions(tiny_snapshot, tmp_path, extra):
    """module_dropout decides per call whether a LoRA module adds its delta; a checkpointed block's recomputed forward
    must decide the same (torch's checkpoint restores its own generators, which is why the decisions stay on the
    global one), or the backward finds other operations than the forward recorded."""
    from tests.test_trainer import base_args, make_toy_dataset, train

    data = make_toy_dataset(tmp_path / "data", n=2)
    run = train(base_args(tiny_snapshot, data, tmp_path / "out", "--max_train_steps", "3", "--gradient_checkpointing",
                          "--network_args", "module_dropout=0.5", *extra))
    assert len(run.loss_history) == 3 and all(torch.isfinite(torch.tensor(run.loss_history)))
