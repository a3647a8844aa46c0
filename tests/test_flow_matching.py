import argparse
import io
import logging
import math
import sys

import pytest
import torch

from library.training import flow_matching as fm
from library.errors import UserError


def make_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fm.add_flow_matching_arguments(parser)
    return parser.parse_args(list(argv))


def sampling(*argv: str) -> fm.TimestepSamplingConfig:
    return fm.TimestepSamplingConfig.from_args(make_args(*argv))


def loss(*argv: str) -> fm.LossConfig:
    return fm.LossConfig.from_args(make_args(*argv))


def show(*argv: str) -> fm.ShowTimestepsConfig:
    return fm.ShowTimestepsConfig.from_args(make_args(*argv))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_defaults_match_sd_scripts():
    a = make_args()
    assert a.timestep_sampling == "sigmoid"
    assert a.discrete_flow_shift == 1.0 and a.sigmoid_scale == 1.0
    assert a.weighting_scheme == "uniform"
    assert (a.logit_mean, a.logit_std, a.mode_scale) == (0.0, 1.0, 1.29)
    assert a.loss_type == "l2" and a.huber_schedule == "snr"
    assert (a.huber_c, a.huber_scale) == (0.1, 1.0)
    assert a.ip_noise_gamma is None and a.ip_noise_gamma_random_strength is False
    assert a.show_timesteps is None and a.show_timesteps_resolution == 1024
    assert fm.NUM_TRAIN_TIMESTEPS == 1000


def test_scheduler_grid_unshifted_and_shifted():
    s1 = fm.FlowMatchEulerDiscreteScheduler(1000, shift=1.0)
    assert s1.timesteps.dtype == torch.float32 and s1.sigmas.dtype == torch.float32
    assert s1.timesteps.shape == (1000,) and s1.sigmas.shape == (1001,)
    assert s1.timesteps[0] == 1000 and s1.timesteps[-1] == 1 and s1.sigmas[-1] == 0
    assert torch.allclose(s1.timesteps, torch.arange(1000, 0, -1, dtype=torch.float32))
    s3 = fm.FlowMatchEulerDiscreteScheduler(1000, shift=3.0)
    # s = 0.5 -> 3 * 0.5 / (1 + 2 * 0.5) = 0.75; index 500 is t = 500
    assert s3.sigmas[500].item() == pytest.approx(0.75)
    assert s3.timesteps[500].item() == pytest.approx(750.0)
    assert s3.sigmas[0] == 1.0
    with pytest.raises(UserError):
        fm.FlowMatchEulerDiscreteScheduler(1000, shift=0.0)


def test_sigmoid_uniform_shift_follow_the_formulas():
    n = 64
    ref_normal = torch.randn(n, generator=gen(1))
    ref_uniform = torch.rand(n, generator=gen(1))
    got = fm.sample_sigmas(sampling("--timestep_sampling", "sigmoid", "--sigmoid_scale", "2"), n, generator=gen(1))
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert torch.allclose(got, torch.sigmoid(2 * ref_normal))
    got = fm.sample_sigmas(sampling("--timestep_sampling", "uniform"), n, generator=gen(1))
    assert torch.allclose(got, ref_uniform)
    got = fm.sample_sigmas(
        sampling("--timestep_sampling", "shift", "--discrete_flow_shift", "3"), n, generator=gen(1)
    )
    s = torch.sigmoid(ref_normal)
    assert torch.allclose(got, 3 * s / (1 + 2 * s))


def test_flux_shift_depends_on_resolution():
    assert fm.flux_shift_mu(256) == pytest.approx(0.5)
    assert fm.flux_shift_mu(4096) == pytest.approx(1.15)
    args = sampling("--timestep_sampling", "flux_shift", "--discrete_flow_shift", "7")
    ref = torch.sigmoid(torch.randn(32, generator=gen(2)))
    for hw, mu in (((64, 64), 1.15), ((16, 16), 0.5)):
        got = fm.sample_sigmas(args, 32, hw, generator=gen(2))
        expected = math.exp(mu) / (math.exp(mu) + (1 / ref - 1))
        assert torch.allclose(got, expected, atol=1e-6)
    big = fm.sample_sigmas(args, 4000, (64, 64), generator=gen(3)).mean()
    small = fm.sample_sigmas(args, 4000, (16, 16), generator=gen(3)).mean()
    assert big > small  # more tokens -> more noise
    with pytest.raises(ValueError):
        fm.sample_sigmas(args, 4)


def test_sigma_mode_uses_the_shifted_grid_and_weighting_distribution():
    args = sampling(
        "--timestep_sampling", "sigma", "--weighting_scheme", "logit_normal", "--logit_mean", "-1.09",
        "--logit_std", "0.95",
    )
    s, t = fm.sample_sigmas_and_timesteps(args, 20000, generator=gen(4))
    assert torch.equal(s, fm.sample_sigmas(args, 20000, generator=gen(4)))
    assert torch.equal(t, t.round())  # on the 1000-step grid
    assert torch.allclose(t, s * 1000)
    assert s.min() >= 0.001 and s.max() <= 1.0
    u = torch.sigmoid(torch.randn(20000, generator=gen(4)) * 0.95 - 1.09)
    assert torch.allclose(t, 1000 - (u * 1000).floor())  # index 0 is sigma 1: small u = more noise
    assert s.mean() > 0.65  # the negative mean biases toward noise
    shifted = fm.sample_sigmas(
        sampling("--timestep_sampling", "sigma", "--discrete_flow_shift", "3"), 8, generator=gen(5)
    )
    base = fm.sample_sigmas(sampling("--timestep_sampling", "sigma"), 8, generator=gen(5))
    assert torch.allclose(shifted, 3 * base / (1 + 2 * base), atol=1e-6)


def test_sigma_mode_mode_scheme_stays_in_grid():
    u = fm.compute_density_for_timestep_sampling("mode", 5000, mode_scale=1.29, generator=gen(6))
    assert u.min() >= 0 and u.max() <= 1
    s = fm.sample_sigmas(sampling("--timestep_sampling", "sigma", "--weighting_scheme", "mode"), 5000, generator=gen(6))
    assert s.min() >= 0.001 and s.max() <= 1.0
    # u = 1 exactly would index past the grid: it is clamped to the last (least noisy) step
    sched = fm.get_scheduler(1.0)
    assert sched.sigmas_at(torch.tensor([1000])).item() == pytest.approx(0.001)


@pytest.mark.parametrize("mode", fm.TIMESTEP_SAMPLING_CHOICES)
def test_offset_zero_is_identity_and_sign_moves_noise(mode):
    args = sampling("--timestep_sampling", mode)
    hw = (32, 32)
    base = fm.sample_sigmas(args, 256, hw, generator=gen(7))
    assert torch.equal(fm.sample_sigmas(args, 256, hw, generator=gen(7), offset=0.0), base)
    assert torch.equal(fm.sample_sigmas(args, 256, hw, generator=gen(7), offset=torch.zeros(256)), base)
    up = fm.sample_sigmas(args, 256, hw, generator=gen(7), offset=1.0)
    down = fm.sample_sigmas(args, 256, hw, generator=gen(7), offset=-1.0)
    assert up.mean() > base.mean() > down.mean()
    assert torch.all(up >= base) and torch.all(down <= base)
    per_sample = torch.tensor([-1.0, 0.0, 0.0, 1.0]).repeat(64)
    mixed = fm.sample_sigmas(args, 256, hw, generator=gen(7), offset=per_sample)
    zero = per_sample == 0
    assert torch.equal(mixed[zero], base[zero])
    assert torch.equal(mixed[per_sample > 0], up[per_sample > 0])


def test_offset_definition_and_errors():
    s = torch.tensor([0.5, 0.2, 0.9999])
    moved = fm.apply_logit_offset(s, torch.tensor([1.0, 0.0, 5.0]))
    assert moved[0].item() == pytest.approx(torch.sigmoid(torch.tensor(1.0)).item())
    assert moved[1] == s[1]
    assert moved[2] == s[2]  # the clamp to 1 - OFFSET_EPS never moves a sample against the offset
    clamped = fm.apply_logit_offset(torch.tensor([0.99, 0.01]), torch.tensor([20.0, -20.0]))
    assert torch.allclose(clamped, torch.tensor([1 - fm.OFFSET_EPS, fm.OFFSET_EPS]))
    args = sampling()
    with pytest.raises(UserError):
        fm.sample_sigmas(args, 2, offset=[float("nan"), 0.0])
    with pytest.raises(ValueError):
        fm.sample_sigmas(args, 3, offset=[0.1, 0.2])


def test_noisy_input_timesteps_and_sigmas():
    torch.manual_seed(0)
    latents = torch.randn(4, 3, 2, 2)
    noise = torch.randn(4, 3, 2, 2)
    args = sampling("--timestep_sampling", "uniform")
    noisy, timesteps, sigmas = fm.get_noisy_model_input_and_timesteps(args, latents, noise, generator=gen(8))
    assert timesteps.dtype == torch.float32 and sigmas.dtype == torch.float32
    assert timesteps.shape == (4,) and sigmas.shape == (4, 1, 1, 1)
    assert torch.allclose(timesteps, sigmas.flatten() * 1000)
    assert torch.allclose(sigmas.flatten(), torch.rand(4, generator=gen(8)))
    assert torch.allclose(noisy, (1 - sigmas) * latents + sigmas * noise)
    # bf16 latents: noisy follows the latents' dtype (or dtype=), timesteps stay float32
    noisy16, t16, _ = fm.get_noisy_model_input_and_timesteps(args, latents.bfloat16(), noise, generator=gen(8))
    assert noisy16.dtype == torch.bfloat16 and t16.dtype == torch.float32
    noisy32, _, _ = fm.get_noisy_model_input_and_timesteps(
        args, latents.bfloat16(), noise, dtype=torch.float32, generator=gen(8)
    )
    assert noisy32.dtype == torch.float32


def test_fixed_validation_sigmas():
    v = fm.validation_sigmas(4)
    assert v.dtype == torch.float32
    assert torch.allclose(v, torch.tensor([0.2, 0.4, 0.6, 0.8]))
    latents, noise = torch.ones(1, 2, 2, 2), torch.zeros(1, 2, 2, 2)
    noisy, t, s = fm.get_noisy_model_input_and_timesteps(sampling(), latents, noise, sigmas=v[1])
    assert t.item() == pytest.approx(400.0) and torch.allclose(noisy, torch.full_like(noisy, 0.6))
    with pytest.raises(ValueError):
        fm.validation_sigmas(0)


def test_ip_noise_gamma_perturbs_input_only():
    latents = torch.randn(2, 3, 4, 4, generator=gen(9))
    noise = torch.randn(2, 3, 4, 4, generator=gen(10))
    args = make_args("--timestep_sampling", "sigmoid", "--ip_noise_gamma", "0.1")
    cfg, ip = fm.TimestepSamplingConfig.from_args(args), fm.InputPerturbation.from_args(args)
    assert ip == fm.InputPerturbation(0.1, False) and fm.InputPerturbation.from_args(make_args()).gamma == 0.0
    g = gen(11)
    noisy, _, s = fm.get_noisy_model_input_and_timesteps(cfg, latents, noise, generator=g, ip_noise=ip)
    g2 = gen(11)
    sig = torch.sigmoid(torch.randn(2, generator=g2)).view(-1, 1, 1, 1)
    xi = torch.randn(latents.shape, generator=g2)
    assert torch.allclose(s, sig)
    assert torch.allclose(noisy, (1 - sig) * latents + sig * (noise + 0.1 * xi), atol=1e-6)
    args.ip_noise_gamma_random_strength = True
    ip = fm.InputPerturbation.from_args(args)
    noisy_r, _, s_r = fm.get_noisy_model_input_and_timesteps(cfg, latents, noise, generator=gen(11), ip_noise=ip)
    g3 = gen(11)
    torch.randn(2, generator=g3)
    xi3 = torch.randn(latents.shape, generator=g3)
    strength = torch.rand(1, generator=g3).item() * 0.1
    assert 0 <= strength <= 0.1
    assert torch.allclose(noisy_r, (1 - s_r) * latents + s_r * (noise + strength * xi3), atol=1e-6)
    plain, _, _ = fm.get_noisy_model_input_and_timesteps(cfg, latents, noise, sigmas=0.5, ip_noise=None)
    assert torch.allclose(plain, 0.5 * latents + 0.5 * noise)


def test_loss_weighting():
    s = torch.tensor([0.1, 0.5, 0.9]).view(-1, 1, 1, 1)
    assert torch.allclose(fm.compute_loss_weighting("sigma_sqrt", s), s**-2)
    cos = fm.compute_loss_weighting("cosmap", s)
    assert cos.shape == s.shape
    assert cos[1].item() == pytest.approx(2 / (math.pi * 0.5))
    for scheme in ("uniform", "none", "logit_normal", "mode"):
        assert torch.equal(fm.compute_loss_weighting(scheme, s), torch.ones_like(s))
    with pytest.raises(UserError):
        fm.compute_loss_weighting("bogus", s)


def test_conditional_loss_types():
    torch.manual_seed(1)
    p, y = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    assert torch.allclose(fm.conditional_loss(p, y, "l2"), torch.nn.functional.mse_loss(p, y, reduction="none"))
    assert torch.allclose(fm.conditional_loss(p, y, "l1"), (p - y).abs())
    assert fm.conditional_loss(p, y, "l2", reduction="mean").item() == pytest.approx(((p - y) ** 2).mean().item())
    c = torch.tensor([0.1, 1.0])
    hub = fm.conditional_loss(p, y, "huber", c)
    d = p - y
    assert torch.allclose(hub[1], 2 * 1.0 * (torch.sqrt(d[1] ** 2 + 1) - 1))
    assert torch.allclose(hub[0], 2 * 0.1 * (torch.sqrt(d[0] ** 2 + 0.01) - 0.1))
    sl1 = fm.conditional_loss(p, y, "smooth_l1", 0.5)
    assert torch.allclose(sl1, 2 * (torch.sqrt(d**2 + 0.25) - 0.5))
    # Huber: quadratic for small errors (~ d^2), linear for large ones (~ 2c|d|)
    zero = torch.tensor([0.0], dtype=torch.float64)
    small = fm.conditional_loss(torch.tensor([1e-3], dtype=torch.float64), zero, "huber", 1.0)
    large = fm.conditional_loss(torch.tensor([1e3], dtype=torch.float64), zero, "huber", 0.1)
    assert small.item() == pytest.approx(1e-6, rel=1e-3)
    assert large.item() == pytest.approx(2 * 0.1 * 1e3, rel=1e-3)
    with pytest.raises(ValueError):
        fm.conditional_loss(p, y, "huber")


def test_huber_thresholds_for_flow_matching():
    t = torch.tensor([0.0, 500.0, 1000.0])
    assert fm.get_huber_threshold(loss(), t) is None  # l2
    snr = fm.get_huber_threshold(loss("--loss_type", "huber"), t)  # default schedule snr: no crash
    assert snr.dtype == torch.float32
    assert torch.allclose(snr, torch.tensor([1.0, 0.9 * 0.25 + 0.1, 0.1]))
    snr2 = fm.get_huber_threshold(loss("--loss_type", "smooth_l1", "--huber_scale", "2"), t)
    assert torch.allclose(snr2, 2 * snr)
    const = fm.get_huber_threshold(
        loss("--loss_type", "huber", "--huber_schedule", "constant", "--huber_scale", "3"), t
    )
    assert torch.allclose(const, torch.full((3,), 0.3))
    exp = fm.get_huber_threshold(loss("--loss_type", "huber", "--huber_schedule", "exponential"), t)
    assert torch.allclose(exp, torch.tensor([1.0, math.sqrt(0.1), 0.1]))
    with pytest.raises(UserError):
        fm.get_huber_threshold(loss("--loss_type", "huber", "--huber_c", "0"), t)


@pytest.mark.parametrize(
    "mode,applied", [("sigma", True), ("shift", True), ("uniform", False), ("sigmoid", False), ("flux_shift", False)]
)
def test_log_line_states_whether_shift_applies(mode, applied, caplog):
    with caplog.at_level(logging.INFO, logger="library.training.flow_matching"):
        line = fm.log_timestep_sampling_info(sampling("--timestep_sampling", mode, "--discrete_flow_shift", "3"))
    assert "\n" not in line and line in caplog.text
    assert ("discrete_flow_shift=3.0 is applied" in line) == applied
    assert ("discrete_flow_shift=3.0 is NOT applied" in line) == (not applied)


def test_show_timesteps_console():
    args = show("--timestep_sampling", "shift", "--discrete_flow_shift", "3", "--weighting_scheme", "sigma_sqrt",
                "--show_timesteps", "console")
    out = io.StringIO()
    text = fm.show_timesteps(args, out=out, num_samples=20000)
    assert out.getvalue().strip() == text.strip()
    rows = [r for r in text.splitlines() if r.count("|") == 3 and r.strip()[0].isdigit()]
    assert len(rows) == fm.SHOW_TIMESTEPS_BINS
    shares = [float(r.split("|")[1].strip().rstrip("%")) for r in rows]
    assert sum(shares) == pytest.approx(100.0, abs=0.5)
    assert shares[-3] > shares[2]  # shift 3 puts the mass at high noise
    weights = [float(r.split("|")[2]) for r in rows]
    assert weights[0] == pytest.approx(0.025**-2, rel=1e-3) and weights[0] > weights[-1]
    with_offset = fm.format_timestep_histogram(
        show("--timestep_sampling", "shift", "--show_timesteps_offset", "1.0"), 2000
    )
    assert "offset +1" in with_offset
    with pytest.raises(UserError):
        fm.show_timesteps(show("--show_timesteps", "console", "--show_timesteps_resolution", "1000"), out=out)


def test_show_timesteps_console_logs_without_stream(caplog):
    with caplog.at_level(logging.INFO, logger="library.training.flow_matching"):
        fm.show_timesteps(show("--show_timesteps", "console"), num_samples=1000)
    assert "950 - 1000" in caplog.text


def test_show_timesteps_image_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(UserError, match="pip install matplotlib"):
        fm.show_timesteps(show("--show_timesteps", "image"), num_samples=100)
