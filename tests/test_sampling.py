import json
import math

import pytest
import torch

from library.sampling import sampler as ms
from library.errors import UserError


class FakeDiT(torch.nn.Module):
    """Same call signature as the MOSS-Image DiT; the velocity depends on x, t, the masked text and skip_layers."""

    def __init__(self, channels: int = 128, text_dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.mix = torch.nn.Conv2d(channels, channels, 1)
        self.text = torch.nn.Linear(text_dim, channels)
        self.calls: list[dict] = []

    def forward(self, x, timesteps, prompt_embeds, attn_mask, skip_layers=None):
        assert timesteps.dtype == torch.float32 and timesteps.shape == (x.shape[0],)
        self.calls.append({"batch": x.shape[0], "t": timesteps.tolist(), "skip": skip_layers})
        m = attn_mask.to(prompt_embeds.dtype).unsqueeze(-1)
        text = self.text((prompt_embeds * m).sum(1) / m.sum(1).clamp(min=1))
        v = torch.tanh(self.mix(x)) + text[:, :, None, None] * (timesteps / 1000)[:, None, None, None]
        if skip_layers:
            v = v * (1.0 + 0.1 * len(skip_layers))
        return v


def hand_grid(steps: int, shift: float) -> list[float]:
    out = []
    for i in range(steps + 1):
        s = 1 - i / steps
        if i == steps:
            out.append(0.0)
            continue
        shifted = shift * s / (1 + (shift - 1) * s)
        out.append(max(round(shifted * 1000), 1) / 1000)
    return out


def hand_euler(model, x, cond, cmask, uncond, umask, steps, g, shift, skip):
    grid = hand_grid(steps, shift)
    x = x.clone()
    for i in range(steps):
        t = torch.full((x.shape[0],), grid[i] * 1000, dtype=torch.float32)
        v_c = model(x, t, cond, cmask)
        if g == 1.0:
            v = v_c
        else:
            v_u = model(x, t, uncond, umask, skip_layers=list(skip) if skip else None)
            v = v_u + g * (v_c - v_u)
        x = x + (grid[i + 1] - grid[i]) * v
    return x


def embeds(batch: int, tokens: int, dim: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, dim, generator=g), torch.ones(batch, tokens, dtype=torch.bool)


def test_sampling_sigmas():
    s = ms.sampling_sigmas(50, 5.0)
    assert s.dtype == torch.float32 and s.shape == (51,)
    assert s[0] == 1.0 and s[-1] == 0.0
    assert torch.all(s[:-1] >= 0.001) and torch.all(s[1:] <= s[:-1])
    grid = s[:-1].double() * 1000
    assert torch.allclose(grid, grid.round(), atol=1e-3)  # snapped to the 1000-step grid
    assert s[25].item() == pytest.approx(0.833)  # s = 0.5 -> 2.5 / 3
    assert torch.allclose(s, torch.tensor(hand_grid(50, 5.0)))
    assert ms.sampling_sigmas(4, 1.0).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    tiny = ms.sampling_sigmas(1000, 0.2)  # tiny shifted values are kept at 1/1000, never 0 before the end
    assert tiny[-2].item() == pytest.approx(0.001) and (tiny[:-1] > 0).all()
    assert ms.sampling_grid(3, 5.0) == [1000, 909, 714, 0]
    for bad in ((0, 5.0), (2.5, 5.0), (10, 0.0)):
        with pytest.raises(UserError):
            ms.sampling_sigmas(*bad)


def test_sampler_matches_hand_written_euler_with_cfg_and_skip():
    model = FakeDiT()
    noise = torch.randn(2, 128, 4, 6, generator=torch.Generator().manual_seed(3))
    cond, cmask = embeds(2, 5)
    uncond, umask = embeds(2, 2, seed=2)
    out = ms.sample(model, noise, cond, cmask, uncond, umask, steps=6, guidance_scale=3.0, shift=5.0)
    ref = hand_euler(model, noise, cond, cmask, uncond, umask, 6, 3.0, 5.0, (22,))
    assert out.dtype == torch.float32 and out.shape == noise.shape
    assert torch.allclose(out, ref, atol=1e-5)


class RepeatingFakeDiT(FakeDiT):
    """FakeDiT with `repeated_calls`: counts the contexts entered, and its first call inside one fails the way torch
    fails a compile under `skip_guard_eval_unsafe`."""

    def __init__(self):
        super().__init__()
        self.inside = False
        self.entered = 0
        self.fail_once = True

    def repeated_calls(self):
        fake = self

        class Context:
            def __enter__(self):
                fake.entered += 1
                fake.inside = True

            def __exit__(self, *exc):
                fake.inside = False

        return Context()

    def forward(self, *args, **kwargs):
        if self.inside and self.fail_once:
            self.fail_once = False
            raise RuntimeError("Recompilation triggered with skip_guard_eval_unsafe stance.")
        return super().forward(*args, **kwargs)


def test_unguarded_repeats_fall_back_to_every_guard_when_a_graph_is_missing():
    """With `unguarded_repeats`, the steps after the first run inside the model's `repeated_calls()`; a step that
    needs a new compiled graph there runs again without it, and so do the rest of the image's steps: the same
    latents as without it."""
    noise = torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(3))
    cond, cmask = embeds(1, 5)
    uncond, umask = embeds(1, 2, seed=2)
    args = (noise, cond, cmask, uncond, umask)
    ref = ms.sample(RepeatingFakeDiT(), *args, steps=4)
    model = RepeatingFakeDiT()
    out = ms.sample(model, *args, steps=4, unguarded_repeats=True)
    assert torch.equal(out, ref) and model.entered == 1 and not model.fail_once
    model = RepeatingFakeDiT()
    model.fail_once = False
    assert torch.equal(ms.sample(model, *args, steps=4, unguarded_repeats=True), ref) and model.entered == 3
    with pytest.raises(RuntimeError, match="other"):
        ms.repeated_velocity(lambda x, t: (_ for _ in ()).throw(RuntimeError("other")), noise, noise,
                              model.repeated_calls)


def test_uncond_skip_layers_only_on_the_uncond_pass():
    model = FakeDiT()
    noise = torch.randn(1, 128, 2, 2)
    cond, cmask = embeds(1, 3)
    ms.sample(model, noise, cond, cmask, *embeds(1, 3, seed=5), steps=3, uncond_skip_layers="22,7")
    assert len(model.calls) == 6
    assert [c["skip"] for c in model.calls] == [None, [22, 7]] * 3
    assert [c["t"][0] for c in model.calls[::2]] == [1000.0, 909.0, 714.0]


def test_batched_cond_uncond_when_shapes_match_and_nothing_is_skipped():
    model = FakeDiT()
    noise = torch.randn(2, 128, 4, 4, generator=torch.Generator().manual_seed(4))
    cond, cmask = embeds(2, 4)
    uncond, umask = embeds(2, 4, seed=9)
    umask[:, 3] = False  # masks may differ; only shapes must match
    out = ms.sample(model, noise, cond, cmask, uncond, umask, steps=5, guidance_scale=4.0, uncond_skip_layers="")
    assert [c["batch"] for c in model.calls] == [4] * 5  # one forward per step
    model.calls.clear()
    ref = hand_euler(model, noise, cond, cmask, uncond, umask, 5, 4.0, 5.0, ())
    assert torch.allclose(out, ref, atol=1e-5)
    # different token counts: two passes even without skipped layers
    model.calls.clear()
    ms.sample(model, noise, cond, cmask, *embeds(2, 1), steps=2, uncond_skip_layers=())
    assert [c["batch"] for c in model.calls] == [2, 2, 2, 2]


def test_guidance_one_skips_the_uncond_pass_and_broadcasts_the_prompt():
    model = FakeDiT()
    noise = torch.randn(3, 128, 2, 2)
    cond, _ = embeds(1, 4)
    out = ms.sample(model, noise, cond, None, steps=4, guidance_scale=1.0)
    assert len(model.calls) == 4 and all(c["batch"] == 3 for c in model.calls)
    model.calls.clear()
    ref = hand_euler(model, noise, cond.expand(3, -1, -1), torch.ones(3, 4, dtype=torch.bool), None, None, 4, 1.0,
                     5.0, ())
    assert torch.allclose(out, ref, atol=1e-5)
    with pytest.raises(ValueError):
        ms.sample(model, noise, cond, None, steps=2, guidance_scale=2.0)


def test_exact_velocity_lands_on_the_data():
    # on the straight path x_t = (1 - s) x0 + s n the velocity is (x_t - x0) / s: Euler is exact on any grid
    x0 = torch.randn(1, 128, 2, 2, generator=torch.Generator().manual_seed(6))

    def oracle(x, t, e, m, skip_layers=None):
        return (x - x0) / (t / 1000)[:, None, None, None]

    out = ms.sample(oracle, torch.randn(1, 128, 2, 2), *embeds(1, 2), steps=7, guidance_scale=1.0)
    assert torch.allclose(out, x0, atol=1e-4)
    steps_seen = []
    ms.sample(oracle, torch.randn(1, 128, 2, 2), *embeds(1, 2), steps=3, guidance_scale=1.0,
              callback=lambda i, n, x: steps_seen.append((i, n)))
    assert steps_seen == [(0, 3), (1, 3), (2, 3)]


def test_sampler_with_the_tiny_moss_image_dit():
    models = pytest.importorskip("library.moss_image.dit")
    cfg = models.MossImageConfig(hidden_size=32, num_layers=3, num_heads=2, head_dim=16, ffn_hidden=64, text_dim=24,
                                 num_refiner_layers=1, rope_axes_dims=(4, 6, 6))
    torch.manual_seed(0)
    dit = models.MossImage(cfg).eval()
    noise = torch.randn(1, 128, 2, 3, generator=torch.Generator().manual_seed(7))
    cond = torch.randn(1, 5, 24)
    uncond = torch.randn(1, 2, 24)
    cm, um = torch.ones(1, 5, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool)
    with torch.no_grad():
        out = ms.sample(dit, noise, cond, cm, uncond, um, steps=4, guidance_scale=3.0, uncond_skip_layers="1")
        ref = hand_euler(dit, noise, cond, cm, uncond, um, 4, 3.0, 5.0, (1,))
        plain = ms.sample(dit, noise, cond, cm, uncond, um, steps=4, guidance_scale=3.0, uncond_skip_layers="")
    assert torch.allclose(out, ref, atol=1e-5)
    assert not torch.allclose(out, plain)  # skipping a block in the uncond branch changes the result


def test_parse_uncond_skip_layers():
    assert ms.parse_uncond_skip_layers("22") == (22,)
    assert ms.parse_uncond_skip_layers("22, 23") == (22, 23)
    assert ms.parse_uncond_skip_layers("") == () and ms.parse_uncond_skip_layers(None) == ()
    assert ms.parse_uncond_skip_layers([3, 3, 1]) == (3, 1)
    assert ms.parse_uncond_skip_layers(22, num_layers=42) == (22,)
    for bad in ("abc", "22;23", "-1", "1.5", [1.5]):
        with pytest.raises(UserError):
            ms.parse_uncond_skip_layers(bad)
    with pytest.raises(UserError, match="42 blocks"):
        ms.parse_uncond_skip_layers("42", num_layers=42)


def test_initial_noise():
    a = ms.initial_noise(64, 32, seed=5)
    assert a.shape == (1, 128, 4, 2) and a.dtype == torch.float32
    assert torch.equal(a, ms.initial_noise(64, 32, seed=5))
    assert not torch.equal(a, ms.initial_noise(64, 32, seed=6))
    with pytest.raises(UserError, match="multiple of 16"):
        ms.initial_noise(1000, 64, seed=1)


def test_parse_prompt_line_options_and_defaults():
    d = ms.parse_prompt_line("A cat\\non a mat --w 512 --h 768 --s 20 --l 4.5 --fs 3 --n blurry, ugly --d 42")
    assert d == {"prompt": "A cat\non a mat", "negative_prompt": "blurry, ugly", "width": 512, "height": 768,
                 "sample_steps": 20, "scale": 4.5, "flow_shift": 3.0, "seed": 42}
    d = ms.parse_prompt_line("just text")
    assert d == {"prompt": "just text", "negative_prompt": "", "width": 1024, "height": 1024, "sample_steps": 50,
                 "scale": 3.0, "flow_shift": 5.0, "seed": None}
    assert ms.parse_prompt_line("x --W 256 --D 1")["width"] == 256  # options are case-insensitive
    assert ms.parse_prompt_line("x --n a\\nb")["negative_prompt"] == "a\nb"
    for bad, match in [("x --w 1000", "multiple of 16"),
                       ("x --s 0", "between 1"), ("x --l abc", "number"), ("x --w", "needs a value"),
                       ("x --fs -1", "positive"), ("x --d 1.5", "integer")]:
        with pytest.raises(UserError, match=match):
            ms.parse_prompt_line(bad)


def test_load_txt_prompts(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("# a comment\n\nfirst prompt --d 1\n  # indented comment\nsecond\\nline --w 512 --h 512\n",
                 encoding="utf-8")
    prompts = ms.load_prompts(str(p))
    assert [x["prompt"] for x in prompts] == ["first prompt", "second\nline"]
    assert [x["enum"] for x in prompts] == [0, 1]
    assert prompts[0]["seed"] == 1 and prompts[1]["width"] == 512
    bad = tmp_path / "bad.txt"
    bad.write_text("ok\n# c\nbroken --h 100\n", encoding="utf-8")
    with pytest.raises(UserError, match="line 3"):
        ms.load_prompts(str(bad))


def test_load_toml_json_jsonl_prompts(tmp_path):
    t = tmp_path / "p.toml"
    t.write_text(
        '[prompt]\nwidth = 512\nheight = 512\nsample_steps = 20\n\n'
        '[[prompt.subset]]\nprompt = "one"\nseed = 3\n\n'
        '[[prompt.subset]]\nprompt = "two"\nwidth = 256\nnegative_prompt = "bad"\n',
        encoding="utf-8",
    )
    prompts = ms.load_prompts(str(t))
    assert [(x["prompt"], x["width"], x["height"], x["sample_steps"]) for x in prompts] == [
        ("one", 512, 512, 20), ("two", 256, 512, 20)]
    assert prompts[0]["seed"] == 3 and prompts[1]["negative_prompt"] == "bad" and prompts[1]["enum"] == 1
    j = tmp_path / "p.json"
    j.write_text(json.dumps([{"prompt": "a", "scale": 5, "flow_shift": 2.5}, "b --s 10"]), encoding="utf-8")
    prompts = ms.load_prompts(str(j))
    assert prompts[0]["scale"] == 5.0 and prompts[0]["flow_shift"] == 2.5 and prompts[1]["sample_steps"] == 10
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "x", "height": 640}\n\n{"prompt": "y\\\\nz"}\n', encoding="utf-8")
    prompts = ms.load_prompts(str(jl))
    assert prompts[0]["height"] == 640 and prompts[1]["prompt"] == "y\nz"


def test_prompt_file_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        ms.load_prompts(str(tmp_path / "missing.txt"))
    cases = {
        "a.yaml": ("prompt: x", "must end in"),
        "c.json": ("{not json", "not valid JSON"),
        "d.toml": ("[prompt\n", "not valid TOML"),
        "e.toml": ("x = 1\n", "no \\[prompt\\] table"),
        "f.jsonl": ('{"prompt": "x"}\n{oops\n', "line 2"),
        "g.txt": ("# only comments\n", "no prompts"),
        "h.json": ('[{"width": 512}]', "no 'prompt'"),
        "i.json": ('[{"prompt": "x", "width": 100}]', "entry 1"),
    }
    for name, (text, match) in cases.items():
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        with pytest.raises(UserError, match=match):
            ms.load_prompts(str(path))


def test_defaults_are_the_official_ones():
    assert (ms.DEFAULT_STEPS, ms.DEFAULT_GUIDANCE_SCALE, ms.DEFAULT_FLOW_SHIFT) == (50, 3.0, 5.0)
    assert ms.DEFAULT_UNCOND_SKIP_LAYERS == (22,) and ms.DEFAULT_SIZE == 1024
    assert math.isclose(ms.shifted_sigma(0.5, 5.0), 2.5 / 3)


@pytest.mark.parametrize("skip, uncond_tokens", [("1", 3), ("", 5)])
def test_text_work_once_per_image_gives_identical_latents(skip, uncond_tokens):
    """The DiT's text refiner, RoPE tables and masks are prepared once per image (per prompt, or once for the CFG
    pair run as one batch), and the latents are bitwise those of calling the whole forward on every pass."""
    from library.moss_image.dit import MossImage, MossImageConfig

    cfg = MossImageConfig(hidden_size=32, num_layers=3, num_heads=2, head_dim=16, ffn_hidden=64, text_dim=24,
                          num_refiner_layers=2, rope_axes_dims=(4, 6, 6))
    torch.manual_seed(0)
    dit = MossImage(cfg).eval()
    noise = torch.randn(1, 128, 2, 3, generator=torch.Generator().manual_seed(7))
    cond, uncond = torch.randn(1, 5, 24), torch.randn(1, uncond_tokens, 24)
    cm = torch.tensor([[True, True, True, True, False]])  # padded: the key mask reaches attention
    um = torch.ones(1, uncond_tokens, dtype=torch.bool)
    prepared = []
    prepare = dit.prepare_text

    def counting_prepare(*args, **kwargs):
        prepared.append(args[0].shape[0])
        return prepare(*args, **kwargs)

    dit.prepare_text = counting_prepare

    def every_pass(*args, **kwargs):  # the plain model interface: the whole forward on every pass
        return dit(*args, **kwargs)

    with torch.no_grad():
        once = ms.sample(dit, noise, cond, cm, uncond, um, steps=4, guidance_scale=3.0, uncond_skip_layers=skip)
        calls = list(prepared)
        per_pass = ms.sample(every_pass, noise, cond, cm, uncond, um, steps=4, guidance_scale=3.0,
                             uncond_skip_layers=skip)
    assert torch.equal(once, per_pass)
    assert calls == ([1, 1] if skip else [2])  # two prompts, or the CFG pair as one batch of 2
    assert len(prepared) - len(calls) == (8 if skip else 4)  # the per-pass path prepares on every model call
