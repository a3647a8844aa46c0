"""The --vram_budget planner: its choices at 8-48 GiB, explicit options kept, the sentence when nothing fits,
tools/plan_memory.py, and the call sites of the trainer and the inference script."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest

import moss_image_minimal_inference as inference_script
import moss_image_train_network as trainer_script
from library.errors import UserError
from library.planning import run_options
from library.planning.planner import INT8_TIE, STEP_TIE
from library.planning.speed_model import PLANNED_SKIP_MAX
from tools import plan_memory

# the e2e training rows of docs/benchmarks.md: 1024 x 1024, batch 1, LoRA 16, AdamW, bf16, latents and TE cached
RUN = ["--resolution", "1024", "--network_dim", "16", "--mixed_precision", "bf16", "--cache_latents_to_disk",
       "--cache_text_encoder_outputs_to_disk", "--network_train_unet_only", "--optimizer_type", "AdamW"]


@pytest.fixture
def no_bitsandbytes(monkeypatch):
    monkeypatch.setattr(run_options, "bitsandbytes_available", lambda: False)


@pytest.fixture
def with_bitsandbytes(monkeypatch):
    monkeypatch.setattr(run_options, "bitsandbytes_available", lambda: True)


def training_plan(argv: list[str], selective: bool = False):
    """The plan of a command line as the trainer makes it (its parser; explicit options from argv and defaults).
    `selective`: plan as a trainer with `--checkpointing_policy` (added when the parser lacks it); without it, as one
    without (the option is taken away from the parsed options), so that the expectations hold either way."""
    def factory():
        parser = plan_memory.training_parser()
        if selective and not any("--checkpointing_policy" in a.option_strings for a in parser._actions):
            parser.add_argument("--checkpointing_policy", choices=["full", "selective"], default="full")
        return parser

    parser = factory()
    args = parser.parse_args(argv)
    if not selective and hasattr(args, "checkpointing_policy"):
        delattr(args, "checkpointing_policy")
    explicit = run_options.explicit_options(parser, args, argv, run_options.parser_defaults(factory()))
    plan, values = run_options.make_training_plan(args, explicit)
    return plan, values, args


def real_plan(argv: list[str]):
    """The plan of the trainer's own parser, whatever checkpointing policies it has."""
    parser = plan_memory.training_parser()
    args = parser.parse_args(argv)
    explicit = run_options.explicit_options(parser, args, argv, run_options.parser_defaults(plan_memory.training_parser()))
    plan, values = run_options.make_training_plan(args, explicit)
    return replace(plan, options=run_options.option_words(values, run_options.parser_defaults(parser))), values


def summary(plan) -> tuple:
    s = plan.chosen.setup
    return s.dit, s.checkpointing, s.blocks_to_swap, s.te_variant, s.te_on_gpu


def check_invariants(plan) -> None:
    chosen = plan.chosen
    assert chosen.fits(plan.budget)
    for c in plan.candidates:
        if c.fits(plan.budget):  # nothing that fits is clearly faster (bf16 weights may cost INT8_TIE)
            tie = INT8_TIE if chosen.setup.dit == "bf16" and c.setup.dit != "bf16" else STEP_TIE
            assert c.step >= chosen.step / (1 + tie) - 1e-9
    lines = plan.lines()
    assert len(lines) == len(plan.candidates) + 5 and lines[0].startswith("VRAM plan for --vram_budget")
    assert sum("<- chosen" in line for line in lines) == 1


@pytest.mark.parametrize("budget, expected, skip", [
    # eager: the INT8 step is 1.05x bf16's speed (speed_model.INT8_FACTOR) and INT8 leaves more memory, so INT8
    # with fewer blocks swapped (8 GiB) or more blocks left out of checkpointing (12 and 16 GiB, the last number)
    # wins up to 16 GiB; at 24 GiB bf16 fits without swapping
    # (the planner turns --cuda_expandable_segments on: a smaller allocator slack than the plain allocator's)
    (8, ("int8", "full", 9, "none", False), 0),  # the bf16 encoder caches from the CPU
    (12, ("int8", "full", 0, "convrot_int8", True), 7),
    (16, ("int8", "full", 0, "convrot_int8", True), 16),
    (24, ("bf16", "full", 0, "none", True), 20),
    (48, ("bf16", "none", 0, "none", True), 0),
])
def test_choices_at_each_budget(no_bitsandbytes, budget, expected, skip):
    plan, values, _ = training_plan(["--vram_budget", str(budget), *RUN])
    check_invariants(plan)
    assert summary(plan) == expected
    assert plan.chosen.setup.skip_blocks == skip and values["checkpointing_skip_blocks"] == skip
    assert values["gradient_checkpointing"] is (expected[1] != "none")
    assert values["convrot_int8"] is (expected[0] == "int8")
    assert values["blocks_to_swap"] == (expected[2] or None)
    assert values["block_swap_h2d_only"] is (expected[2] > 0)


def test_with_bitsandbytes_the_8_gib_plan_caches_with_nf4(with_bitsandbytes):
    plan, values, _ = training_plan(["--vram_budget", "8", *RUN])
    assert summary(plan) == ("int8", "full", 9, "bnb_nf4", True)
    assert values["te_quant"] == "nf4"
    assert "ConvRot INT8 (quantised at load) on the GPU needs 9.2 GiB" in plan.te_line


def test_a_bitsandbytes_encoder_read_at_startup_counts_in_the_latent_caching(with_bitsandbytes):
    # outputs cached in memory: the encoder is read at startup, before the latents are cached, and a bitsandbytes
    # encoder is quantised on the GPU then and stays there; nf4 then needs more than 8 GiB in that phase
    in_memory = [a for a in RUN if a != "--cache_text_encoder_outputs_to_disk"] + ["--cache_text_encoder_outputs"]
    plan, _, _ = training_plan(["--vram_budget", "8", *in_memory])
    assert summary(plan) == ("int8", "full", 9, "none", False)
    assert "nf4 (bitsandbytes) on the GPU needs 10.3 GiB" in plan.te_line
    # cached to disk: the encoder is read in its own caching phase, after the latents (the 8 GiB plan caches with nf4)
    plan, _, _ = training_plan(["--vram_budget", "8", *RUN])
    assert summary(plan) == ("int8", "full", 9, "bnb_nf4", True)
    latents = plan.chosen.estimate.phase("caching latents")
    assert latents.allocated < 4 * 2**30


@pytest.mark.parametrize("budget, expected", [
    # compiled, ConvRot INT8 measured 1.07x bf16 with full checkpointing (the H200's fourteenth run), beyond
    # planner.INT8_TIE: INT8 + selective wins at every budget, at 24 GiB too, where bf16 + selective also fits
    (8, ("int8", "selective", 20, "none", False)),
    (12, ("int8", "selective", 0, "convrot_int8", True)),
    (16, ("int8", "selective", 0, "convrot_int8", True)),
    (24, ("int8", "selective", 0, "none", True)),
])
def test_choices_with_selective_checkpointing_compiled(no_bitsandbytes, budget, expected):
    plan, values, _ = training_plan(["--vram_budget", str(budget), *RUN, "--compile"], selective=True)
    check_invariants(plan)
    assert summary(plan) == expected
    assert values["checkpointing_policy"] == "selective"


@pytest.mark.parametrize("budget", [8, 12, 16, 24])
def test_eager_plans_never_choose_selective(no_bitsandbytes, budget):
    # measured on the H200: without --compile the selective policy is slower than full checkpointing (bf16 746.8 vs
    # 557.6 ms; INT8 about 2x), so the eager plans are those of a trainer without the policy
    plan, values, _ = training_plan(["--vram_budget", str(budget), *RUN], selective=True)
    check_invariants(plan)
    without, _, _ = training_plan(["--vram_budget", str(budget), *RUN])
    assert plan.chosen.setup.checkpointing == "full" and summary(plan) == summary(without)
    assert values.get("checkpointing_policy", "full") == "full"


def test_explicit_options_are_kept(no_bitsandbytes, tmp_path):
    # --gradient_checkpointing given: no plan without checkpointing, even with room for it
    plan, values, _ = training_plan(["--vram_budget", "48", "--gradient_checkpointing", *RUN])
    assert summary(plan)[:2] == ("bf16", "full") and "gradient_checkpointing" not in values
    assert {c.setup.checkpointing for c in plan.candidates} == {"full", "unsloth"}
    plan, values, _ = training_plan(["--vram_budget", "48", "--gradient_checkpointing", *RUN], selective=True)
    assert {c.setup.checkpointing for c in plan.candidates} == {"selective", "full", "unsloth"}
    plan, values, _ = training_plan(["--vram_budget", "48", "--checkpointing_policy", "full", *RUN], selective=True)
    assert {c.setup.checkpointing for c in plan.candidates} == {"full"} and "checkpointing_policy" not in values
    # --blocks_to_swap given: kept (H2D-only added), the rest planned around it
    plan, values, _ = training_plan(["--vram_budget", "8", "--blocks_to_swap", "36", *RUN])
    assert summary(plan)[:3] == ("bf16", "full", 36) and "blocks_to_swap" not in values
    assert values["block_swap_h2d_only"] is True
    # --convrot_int8 given: every candidate is INT8; --convrot_int8 false: every candidate is bf16 (at 16 GiB INT8
    # would be the faster fit)
    plan, _, _ = training_plan(["--vram_budget", "48", "--convrot_int8", *RUN])
    assert {c.setup.dit for c in plan.candidates} == {"int8"}
    plan, values, _ = training_plan(["--vram_budget", "16", "--convrot_int8", "false", *RUN])
    assert {c.setup.dit for c in plan.candidates} == {"bf16"} and "convrot_int8" not in values
    assert "--convrot_int8 false" in plan.choices.fixed and summary(plan)[0] == "bf16"
    # --te_quant none given (the default value, seen on the command line): the encoder is never quantised
    plan, values, _ = training_plan(["--vram_budget", "12", "--te_quant", "none", *RUN])
    assert summary(plan)[3:] == ("none", False) and "te_quant" not in values and values["te_device"] == "cpu"
    # an abbreviated option counts too
    plan, _, _ = training_plan(["--vram_budget", "48", "--gradient_check", *RUN])
    assert plan.chosen.setup.checkpointing == "full"
    # a value from --config_file counts (it differs from the parser's default)
    from library.training.args import parse_args_with_config

    cfg = tmp_path / "run.toml"
    cfg.write_text("convrot_int8 = true\n")
    argv = ["--vram_budget", "48", "--config_file", str(cfg), *RUN]
    parser = plan_memory.training_parser()
    args = parse_args_with_config(parser, argv)
    explicit = run_options.explicit_options(parser, args, argv, run_options.parser_defaults(plan_memory.training_parser()))
    assert "convrot_int8" in explicit
    plan, _ = run_options.make_training_plan(args, explicit)
    assert plan.chosen.setup.dit == "int8"


def test_convrot_int8_takes_an_optional_true_or_false():
    parser = plan_memory.training_parser()
    assert parser.parse_args(["--convrot_int8"]).convrot_int8 is True
    assert parser.parse_args(["--convrot_int8", "--gradient_checkpointing"]).convrot_int8 is True
    assert parser.parse_args(["--convrot_int8=no"]).convrot_int8 is False
    assert parser.parse_args(["--convrot_int8", "TRUE"]).convrot_int8 is True
    assert parser.parse_args([]).convrot_int8 is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--convrot_int8", "maybe"])


def test_skip_blocks_given_are_planned_around(no_bitsandbytes):
    """--checkpointing_skip_blocks is kept, never planned: only full/selective candidates, each with the blocks'
    activations in its peak (the memory model's rows for it: tests/test_planning_model.py) and less recomputation."""
    argv = ["--vram_budget", "16", *RUN, "--compile"]
    base, _, _ = training_plan(argv, selective=True)
    plan, values, _ = training_plan([*argv, "--checkpointing_skip_blocks", "13"], selective=True)
    check_invariants(plan)
    assert {c.setup.checkpointing for c in plan.candidates} == {"full", "selective"}
    assert {c.setup.skip_blocks for c in plan.candidates} == {13}
    assert values["gradient_checkpointing"] is True and "checkpointing_skip_blocks" not in values
    assert "last 13 blocks not checkpointed" in plan.label(plan.chosen)
    assert "--checkpointing_skip_blocks 13" in plan.choices.fixed
    unswapped = {(c.setup.dit, c.setup.checkpointing): c for c in base.candidates
                 if not c.setup.blocks_to_swap and not c.setup.skip_blocks}
    for c in plan.candidates:
        if c.setup.blocks_to_swap == 0 and (c.setup.dit, c.setup.checkpointing) in unswapped:
            same = unswapped[(c.setup.dit, c.setup.checkpointing)]
            assert c.reserved > same.reserved + 12 * 0.3 * 2**30 and c.step < same.step
    with pytest.raises(UserError, match="need full or selective checkpointing"):
        training_plan(["--vram_budget", "16", "--unsloth_offload_checkpointing", "--checkpointing_skip_blocks", "3",
                       *RUN])
    with pytest.raises(UserError, match="--checkpointing_skip_blocks 43 is more than the DiT's 42 blocks"):
        training_plan(["--vram_budget", "16", "--checkpointing_skip_blocks", "43", *RUN])


def test_memory_to_spare_leaves_blocks_out_of_checkpointing(no_bitsandbytes):
    """Without --checkpointing_skip_blocks, a full or selective candidate that fits unswapped gets a twin with the
    most blocks left out of checkpointing that still fits (at most speed_model.PLANNED_SKIP_MAX), which is faster."""
    bf16 = ["--convrot_int8", "false"]  # the INT8 twin leaves the most blocks out (PLANNED_SKIP_MAX) at this budget
    plan, values, _ = training_plan(["--vram_budget", "22", *bf16, *RUN])
    check_invariants(plan)
    chosen = plan.chosen
    assert chosen.setup.checkpointing == "full" and 0 < chosen.setup.skip_blocks < PLANNED_SKIP_MAX["full"]
    assert values["checkpointing_skip_blocks"] == chosen.setup.skip_blocks
    options = run_options.option_words(values, run_options.parser_defaults(plan_memory.training_parser()))
    assert f"--checkpointing_skip_blocks {chosen.setup.skip_blocks}" in " ".join(options)
    twin = next(c for c in plan.candidates if c.setup == replace(chosen.setup, skip_blocks=0))
    assert chosen.step < twin.step and chosen.reserved > twin.reserved
    # one block more does not fit unswapped: the planner swaps a block for it
    more, _, _ = training_plan(["--vram_budget", "22", "--checkpointing_skip_blocks", str(chosen.setup.skip_blocks + 1),
                                *bf16, *RUN])
    same = [c for c in more.candidates if (c.setup.dit, c.setup.checkpointing) == ("bf16", "full")]
    assert len(same) == 1 and same[0].setup.blocks_to_swap >= 1
    roomy, _, _ = training_plan(["--vram_budget", "30", "--gradient_checkpointing", *RUN])
    assert roomy.chosen.setup.skip_blocks == PLANNED_SKIP_MAX["full"]  # the cap, with memory left over
    # given (0 too) it is kept; with blocks swapped there is nothing to spare
    kept, values, _ = training_plan(["--vram_budget", "24", "--checkpointing_skip_blocks", "0", *RUN])
    assert {c.setup.skip_blocks for c in kept.candidates} == {0} and "checkpointing_skip_blocks" not in values
    swapped, _, _ = training_plan(["--vram_budget", "24", "--blocks_to_swap", "4", *RUN])
    assert {c.setup.skip_blocks for c in swapped.candidates} == {0}


def test_a_plan_that_cannot_fit_gives_the_smallest_budget(no_bitsandbytes):
    with pytest.raises(UserError) as e:
        training_plan(["--vram_budget", "3", *RUN])
    text = str(e.value)
    # the latent caching bounds the smallest plans (4.9 GiB): of those, the fastest is named
    assert text.startswith("--vram_budget 3 GiB is too small for this run: the smallest plan (INT8 (at load),"
                           " gradient checkpointing, swap 40 (h2d), text encoder bf16 on the CPU) needs 4.9 GiB at its"
                           " caching latents peak")
    assert text.count(". ") == 0 and text.endswith(".")  # one sentence
    need = float(text.split("give --vram_budget ")[1].split(" ")[0])
    plan, _, _ = training_plan(["--vram_budget", str(need), *RUN])  # that budget fits
    assert plan.chosen.needs <= plan.budget and plan.chosen.setup.blocks_to_swap >= 36
    with pytest.raises(UserError, match=r"with the options given \(--unsloth_offload_checkpointing\)"):
        training_plan(["--vram_budget", "6", "--unsloth_offload_checkpointing", *RUN])
    with pytest.raises(UserError, match="is not a size"):
        training_plan(["--vram_budget", "0", *RUN])


def test_text_encoder_lora_plans_the_encoder_with_the_dit(no_bitsandbytes):
    argv = [a for a in RUN if a not in ("--cache_text_encoder_outputs_to_disk", "--network_train_unet_only")]
    plan, values, _ = training_plan(["--vram_budget", "24", *argv])
    check_invariants(plan)
    assert plan.te_in_rows and {c.setup.te_variant for c in plan.candidates} == {"none", "convrot_int8"}
    # the bf16 encoder in every step is much faster than the INT8 one: bf16 + bf16 with the DiT's blocks swapped
    assert summary(plan) == ("bf16", "full", 34, "none", True)
    assert values["convrot_int8_text_encoder"] is False and values["blocks_to_swap"] == 34
    plan, values, _ = training_plan(["--vram_budget", "20", *argv])
    assert summary(plan) == ("int8", "full", 0, "convrot_int8", True)


def test_the_tool_prints_the_plan(tiny_snapshot, capsys, no_bitsandbytes):
    argv = ["--vram_budget", "16", *RUN]
    expected, _ = real_plan(argv)
    assert plan_memory.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == expected.lines()
    assert out[0].startswith("VRAM plan for --vram_budget 16 GiB: training at 1024x1024 (4096 image tokens)")
    assert sum(line.endswith("<- chosen") for line in out) == 1
    assert out[-1] == "planned options: " + " ".join(expected.options)
    assert "--convrot_int8_text_encoder" in expected.options and "--gradient_checkpointing" in expected.options
    assert plan_memory.main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] == expected.to_dict()["chosen"] and data["budget_gib"] == 16
    assert data["options"] == list(expected.options)
    assert data["chosen"]["dit"] == "int8" and data["chosen"]["blocks_to_swap"] == 0
    assert plan_memory.main(["--vram_budget", "2", *RUN]) == 2
    assert capsys.readouterr().err.startswith("error: --vram_budget 2 GiB is too small for this run")
    # the real files: a pre-quantised DiT is planned as INT8 (file) and the tiny model needs little
    assert plan_memory.main([*RUN, "--vram_budget", "2", "--pretrained_model_name_or_path",
                             str(tiny_snapshot / "moss_image_base_int8_convrot.safetensors"), "--snapshot",
                             str(tiny_snapshot), "--resolution", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"]["candidate"] == "INT8 (file), no checkpointing"
    assert data["chosen"]["predicted_reserved_gib"] < 1
    assert plan_memory.main(["--inference", "--vram_budget", "8", "--image_size", "1024", "1024"]) == 0
    assert "inference at 1024x1024" in capsys.readouterr().out


def test_the_trainer_refuses_without_cuda(caplog):
    with caplog.at_level(logging.ERROR):
        assert trainer_script.main(["--vram_budget", "16", "--train_data_dir", "nowhere", *RUN]) == 2
    assert "--vram_budget plans the memory of a CUDA GPU and this machine has none: drop --vram_budget." in caplog.text


def test_the_trainer_applies_the_plan_before_loading(monkeypatch, caplog, no_bitsandbytes):
    monkeypatch.setattr(run_options.torch.cuda, "is_available", lambda: True)
    argv = ["--vram_budget", "8", *RUN]
    expected, values = real_plan(argv)
    args = trainer_script.setup_parser().parse_args(argv)
    with caplog.at_level(logging.INFO, logger="library.planning.run_options"):
        plan = run_options.apply_vram_budget(args, trainer_script.setup_parser, argv)
    assert plan.options == expected.options and plan.lines() == expected.lines()
    for dest, value in values.items():
        assert getattr(args, dest) == value
    # at 8 GiB: the INT8 DiT with swapped blocks (H2D-only), checkpointing, the bf16 encoder caching on the CPU
    assert (args.convrot_int8, args.gradient_checkpointing, args.block_swap_h2d_only, args.te_device) == \
        (True, True, True, "cpu")
    assert args.blocks_to_swap > 0 and plan.options[:2] == ("--convrot_int8", "--gradient_checkpointing")
    assert "VRAM plan for --vram_budget 8 GiB" in caplog.text
    assert "chosen: INT8 (at load), gradient checkpointing" in caplog.text
    args = trainer_script.setup_parser().parse_args(RUN)  # without --vram_budget nothing changes
    assert run_options.apply_vram_budget(args, trainer_script.setup_parser, RUN) is None
    assert not args.gradient_checkpointing


def test_the_inference_script_applies_the_plan(monkeypatch, no_bitsandbytes):
    monkeypatch.setattr(run_options.torch.cuda, "is_available", lambda: True)
    argv = ["--vram_budget", "8", "--prompt", "a cat", "--image_size", "1024", "1024"]
    args = inference_script.setup_parser().parse_args(argv)
    plan = run_options.apply_inference_vram_budget(args, inference_script.setup_parser,
                                                   inference_script.planned_image_sizes(args), argv)
    # 17 blocks swapped: a CFG step's two passes run packed into one, so a block's transient holds both
    assert (plan.chosen.setup.dit, plan.chosen.setup.blocks_to_swap) == ("bf16", 17)
    assert (args.blocks_to_swap, args.text_encoder_cpu, args.convrot_int8) == (17, True, False)
    assert args.cuda_expandable_segments is True
    argv = ["--vram_budget", "8", "--prompt", "a cat", "--image_size", "1024", "1024", "--convrot_int8", "false"]
    args = inference_script.setup_parser().parse_args(argv)
    plan = run_options.apply_inference_vram_budget(args, inference_script.setup_parser,
                                                   inference_script.planned_image_sizes(args), argv)
    assert {c.setup.dit for c in plan.candidates} == {"bf16"} and "--convrot_int8 false" in plan.choices.fixed
    argv = ["--vram_budget", "8", "--prompt", "a cat", "--blocks_to_swap", "30", "--device", "cpu"]
    args = inference_script.setup_parser().parse_args(argv)
    with pytest.raises(UserError, match="this run has none"):
        run_options.apply_inference_vram_budget(args, inference_script.setup_parser, [(1024, 1024)], argv)


def test_plans_turn_expandable_segments_on_unless_the_environment_sets_the_allocator(monkeypatch, no_bitsandbytes):
    """The planner sets --cuda_expandable_segments (its smaller allocator slack is what the plan counts); a
    PYTORCH_CUDA_ALLOC_CONF of the user's wins, and the plan then counts what it says."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    plan, values, _ = training_plan(["--vram_budget", "12", *RUN])
    assert values["cuda_expandable_segments"] is True
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    plain, values, _ = training_plan(["--vram_budget", "12", *RUN])
    assert values["cuda_expandable_segments"] is False
    assert plain.chosen.reserved > plan.chosen.reserved or plain.chosen.setup != plan.chosen.setup
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    again, values, _ = training_plan(["--vram_budget", "12", *RUN])
    assert again.chosen.setup == plan.chosen.setup and again.chosen.reserved == plan.chosen.reserved
