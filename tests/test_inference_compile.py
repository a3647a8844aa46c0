"""moss_image_minimal_inference.py --compile (per-block torch.compile) and the phase timings, on the tiny snapshot.

The compiled runs use a counting backend that runs the captured graphs eagerly, so the results must match the
uncompiled run exactly, and the counts show that the blocks really ran compiled (and that block 22 is skipped in the
unconditional pass)."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from torch._dynamo import register_backend

import moss_image_minimal_inference as inf
from library.errors import UserError
from library.runtime.eager_fusion import plain_forms
from library.runtime.phase_timer import last_run_timings
from tests.test_inference import _latents, _run

STATS = {"graphs": 0, "calls": 0}
TINY_LAYERS = 24
TINY_REFINER_LAYERS = 2
INT8_DIT = "moss_image_base_int8_convrot.safetensors"


def expected_calls(steps: int, blocks: int = TINY_LAYERS) -> int:
    """Compiled graph calls of one CFG image, whose two passes a step run packed into one
    (`library.moss_image.cfg_packing`): per step every block once (packed where both passes run it, on the
    conditional part alone where the unconditional pass skips it), the image and timestep embedder once and the final
    layer once per part; once per image, for each of the two prompts, the text embedder and the refiner."""
    return steps * (blocks + 1 + 2) + 2 * (1 + TINY_REFINER_LAYERS)


@register_backend
def moss_counting_eager(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """Counts the graphs dynamo captures and their calls; runs them as they are (exactly eager numerics)."""
    STATS["graphs"] += 1

    def run(*args: object) -> object:
        STATS["calls"] += 1
        return gm.forward(*args)

    return run


@pytest.fixture(scope="module")
def lora_file(tiny_snapshot, tmp_path_factory):
    """A LoRA with non-zero weights on every DiT block Linear."""
    from library.moss_image.loaders import load_moss_image_model
    from networks import lora_generic

    net = lora_generic.create_network(1.0, 4, 2.0, None, [], load_moss_image_model("cpu", tiny_snapshot,
                                                                                    dtype=torch.float32))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("lora") / "lora.safetensors"
    net.save_weights(str(path), torch.float32, None)
    return path


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # no compiled code or recompile budget carried over between tests
    STATS.update(graphs=0, calls=0)
    yield
    torch._dynamo.reset()


COUNTING = ["--compile", "--compile_backend", "moss_counting_eager"]


def _pair(tiny_snapshot, tmp_path, *extra):
    """Latents without and with --compile (counting backend); the eager run computes the plain forms of the
    element-wise code, which the compiled regions keep (`library.runtime.eager_fusion`)."""
    with plain_forms():
        plain = _latents(_run(tiny_snapshot, tmp_path / "plain", "--output_type", "latent", *extra))
    compiled = _latents(_run(tiny_snapshot, tmp_path / "compiled", "--output_type", "latent", *COUNTING, *extra))
    return plain, compiled


def _assert_same(plain, compiled):
    assert len(plain) == len(compiled)
    for a, b in zip(plain, compiled):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_compile_same_latents_and_block_22_skipped_in_uncond(tiny_snapshot, tmp_path):
    plain, compiled = _pair(tiny_snapshot, tmp_path, "--prompt", "a cat", "--image_size", "64", "64",
                            "--infer_steps", "3")
    _assert_same(plain, compiled)
    assert STATS["calls"] == expected_calls(3)  # block 22 on the conditional part alone
    # one graph shared by the main blocks, one for the refiner blocks, one per embedder and the final layer, each at
    # most once more for the other text length
    assert 5 <= STATS["graphs"] <= 10


@pytest.mark.parametrize("skip", ["", "1,22"])
def test_compile_with_lora_and_other_skip_layers(tiny_snapshot, tmp_path, lora_file, skip):
    plain, compiled = _pair(tiny_snapshot, tmp_path, "--prompt", "a cat", "--image_size", "64", "64",
                            "--infer_steps", "2", "--lora_weight", str(lora_file), "--uncond_skip_layers", skip)
    _assert_same(plain, compiled)
    assert STATS["calls"] == expected_calls(2)  # the skipped blocks on the conditional part alone


def test_compile_several_sizes_from_a_prompt_file(tiny_snapshot, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="library.runtime.compile")
    prompts = tmp_path / "p.txt"
    prompts.write_text("first --w 64 --h 64 --d 1\nsecond --w 48 --h 32 --d 2\nthird --w 64 --h 64 --l 1.0 --d 3\n")
    plain, compiled = _pair(tiny_snapshot, tmp_path, "--from_file", str(prompts), "--infer_steps", "2")
    _assert_same(plain, compiled)
    assert [c.shape[-2:] for c in compiled] == [(4, 4), (2, 3), (4, 4)]
    assert "dynamic=True" in caplog.text  # two distinct sizes: compiled with dynamic shapes from the start
    # each of the five compiled regions at most twice, besides the packed CFG pass's own graphs of the main blocks and
    # the image embedder (the third prompt, --l 1.0, runs one unpacked pass)
    assert STATS["graphs"] <= 2 * 5 + 2


@pytest.mark.parametrize("different_lengths", [False, True])
def test_prompts_of_several_text_lengths_compile_dynamic_shapes_from_the_first_image(tiny_snapshot, tmp_path, caplog,
                                                                                   different_lengths):
    """A CFG step's two passes are one packed pass, so each pair of text lengths is a shape of its own: prompts of
    different lengths compile with dynamic shapes from the start (no second compile at the second prompt), while
    one prompt with several seeds keeps graphs specialised to its shapes."""
    caplog.set_level(logging.INFO, logger="library.runtime.compile")
    second = "a lighthouse on a cliff at dusk, long exposure, seen from the sea" if different_lengths else "a cat"
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"a cat --w 32 --h 32 --d 1\n{second} --w 32 --h 32 --d 2\n")
    _run(tiny_snapshot, tmp_path, "--from_file", str(prompts), "--infer_steps", "2", "--output_type", "latent",
         *COUNTING)
    assert ("dynamic=True" in caplog.text) == different_lengths, caplog.text


def test_compile_aot_eager_matches(tiny_snapshot, tmp_path):
    args = ("--prompt", "a cat", "--image_size", "64", "64", "--infer_steps", "2")
    with plain_forms():
        plain = _latents(_run(tiny_snapshot, tmp_path / "a", "--output_type", "latent", *args))
    compiled = _latents(_run(tiny_snapshot, tmp_path / "b", "--output_type", "latent", "--compile",
                             "--compile_backend", "aot_eager", *args))
    torch.testing.assert_close(compiled[0], plain[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("int8", [["--convrot_int8"], ["--dit", INT8_DIT]])
def test_compile_with_convrot_int8_keeps_each_block_one_graph(tiny_snapshot, tmp_path, int8, caplog):
    """The int8 Linears are registered ops inside the compiled graphs: one graph per block call, as in bf16, and
    --compile_fullgraph works (quantised at load or a pre-quantised file); either way q, k and v are stacked before
    the blocks compile."""
    caplog.set_level(logging.INFO, logger="library.moss_image.dit")
    int8 = [str(tiny_snapshot / a) if a == INT8_DIT else a for a in int8]
    args = ("--prompt", "a cat", "--image_size", "32", "32", "--infer_steps", "2", *int8)
    plain, compiled = _pair(tiny_snapshot, tmp_path, *args, "--compile_fullgraph")
    _assert_same(plain, compiled)
    assert f"q, k and v stacked into one int8 weight in {TINY_LAYERS} of {TINY_LAYERS} blocks" in caplog.text
    assert STATS["calls"] == expected_calls(2)
    # as in bf16: one graph shared by the main blocks, one for the refiner blocks, one per embedder and the final
    # layer, each at most once more for the other text length
    assert 1 <= STATS["graphs"] <= 2 * 6


def test_fullgraph_conflicts_are_refused_before_loading(tiny_snapshot, tmp_path):
    with pytest.raises(UserError, match="cannot be used with --split_attn"):
        _run(tiny_snapshot, tmp_path, "--prompt", "x", "--compile", "--compile_fullgraph", "--split_attn")


def test_inductor_on_cpu_without_a_cpp_compiler_is_a_clear_error(tiny_snapshot, tmp_path, monkeypatch):
    from torch._inductor import cpp_builder

    def missing() -> str:
        raise RuntimeError("no g++")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    with pytest.raises(UserError, match="needs a C\\+\\+ compiler"):
        _run(tiny_snapshot, tmp_path, "--prompt", "x", "--compile", "--device", "cpu")
    _run(tiny_snapshot, tmp_path, "--prompt", "x", "--output_type", "latent", "--compile", "--compile_backend",
         "eager", "--device", "cpu")  # other backends need no compiler


def test_compile_options_in_help_with_the_trainer_defaults():
    import moss_image_train_network as trainer

    help_text = inf.setup_parser().format_help()
    names = ["compile", "compile_backend", "compile_mode", "compile_dynamic", "compile_fullgraph",
             "compile_cache_size_limit"]
    for name in names:
        assert f"--{name} " in help_text
    ours = vars(inf.setup_parser().parse_args([]))
    theirs = vars(trainer.setup_parser().parse_args([]))
    assert {n: ours[n] for n in names} == {n: theirs[n] for n in names}


def test_timings_after_a_run(tiny_snapshot, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=inf.logger.name)
    _run(tiny_snapshot, tmp_path / "img", "--prompt", "a cat", "--output_type", "both")
    t = last_run_timings()
    assert tuple(t) == inf.TIMING_KEYS
    assert all(v > 0 for v in t.values()), t
    assert t["total"] == pytest.approx(t["encode"] + t["denoise"] + t["decode"])
    assert "timings (s): text encoder load" in caplog.text and "total after loading" in caplog.text
    _run(tiny_snapshot, tmp_path / "lat", "--prompt", "a cat", "--output_type", "latent")
    assert last_run_timings()["vae_load"] == last_run_timings()["decode"] == 0.0
    assert last_run_timings()["denoise"] > 0


def test_compiled_blocks_with_block_swap_match(tiny_snapshot):
    """The inference order (block swap set up at load, then the blocks compiled) on the CPU test ring."""
    from library.memory.block_swap import BlockSwapConfig
    from library.moss_image.loaders import load_moss_image_model
    from library.runtime.compile import compile_blocks
    from library.sampling.sampler import sample

    torch.manual_seed(0)
    noise, cond, uncond = torch.randn(1, 128, 4, 4), torch.randn(1, 5, 64), torch.randn(1, 2, 64)
    dit = load_moss_image_model("cpu", tiny_snapshot, dtype=torch.float32).eval()
    with plain_forms():
        ref = sample(dit, noise, cond, None, uncond, None, steps=2)
    dit.requires_grad_(False)
    dit.enable_block_swap(8, BlockSwapConfig(torch.device("cpu"), supports_backward=False, allow_cpu_for_tests=True))
    dit.prepare_block_swap_before_forward()
    opts = argparse.Namespace(compile_backend="moss_counting_eager", compile_mode="default", compile_dynamic="auto",
                              compile_fullgraph=False, compile_cache_size_limit=None)
    compile_blocks(opts, dit, num_shapes=1)
    loads = dit.block_offloader.loads
    out = sample(dit, noise, cond, None, uncond, None, steps=2)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert dit.block_offloader.loads > loads and STATS["calls"] == expected_calls(2)


def test_the_steps_after_the_first_skip_the_guards_that_tell_nothing_apart(tiny_snapshot, tmp_path, monkeypatch):
    """A compiled DiT's passes after the first step run with dynamo checking only the guards between its graphs
    (`MossImage.repeated_calls`), to the same latents as the uncompiled run, and the stance is restored after each
    image; an eager DiT's context changes nothing."""
    from library.moss_image.dit import MossImage

    entered: list[bool] = []
    original = MossImage.repeated_calls

    def recording(self):
        ctx = original(self)

        class Recorded:
            def __enter__(self_inner):
                ctx.__enter__()
                entered.append(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)

            def __exit__(self_inner, *exc):
                return ctx.__exit__(*exc)

        return Recorded()

    monkeypatch.setattr(MossImage, "repeated_calls", recording)
    args = ("--prompt", "a cat", "--image_size", "32", "32", "--infer_steps", "3")
    plain, compiled = _pair(tiny_snapshot, tmp_path, *args)
    _assert_same(plain, compiled)
    assert entered == [False, False, True, True]  # eager: two later steps, no stance; compiled: the stance
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe
