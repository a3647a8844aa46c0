"""Flow-matching (rectified flow) training utilities: timestep sampling, noising, loss weighting, losses.

Conventions used throughout this module:

* ``sigma`` is the noise level in [0, 1]: ``x_t = (1 - sigma) * x0 + sigma * noise``; the training target is the
  velocity ``noise - x0``.
* ``timesteps`` are ``sigma * NUM_TRAIN_TIMESTEPS`` (0..1000) in float32: this is what the MOSS-Image DiT takes.
  Sigmas and timesteps are always float32 (bf16 would quantise ``sigma * 1000`` to multiples of 4).
* ``latent_hw`` is the (height, width) of the DiT input grid, i.e. the patchified latent ``[B, 128, H/16, W/16]``.
  Its ``h * w`` is the number of image tokens, the same count FLUX gets for the same image size.

Choices that differ from sd-scripts (where sd-scripts either crashes or ignores the input):

* Huber schedule ``snr`` on flow matching. sd-scripts computes ``c = (1 - h) / (1 + s)^2 + h`` from the DDPM noise
  to signal ratio ``s = sqrt((1 - alphas_cumprod) / alphas_cumprod)`` and fails on flow models, which have no
  ``alphas_cumprod``. The flow-matching noise to signal ratio is ``s = sigma / (1 - sigma)`` (flow SNR
  ``(1 - sigma)^2 / sigma^2``), which gives ``c = (1 - h) * (1 - sigma)^2 + h``: ``1`` at sigma 0 falling to ``h`` at
  sigma 1, the same shape as the DDPM schedule. ``--huber_scale`` multiplies all three schedules.
* Per-sample ``timestep_sampling.offset`` (``custom_attributes`` of a dataset subset). The offset is added to the
  noise level in logit space: ``s' = sigmoid(logit(s) + offset)``, where ``s`` is the sample before any shift.
  Positive offsets move samples toward more noise, negative ones toward less. For ``sigmoid``, ``shift`` and
  ``flux_shift`` this is the same as adding it to the normal draw before the sigmoid (as sd-scripts does); unlike
  sd-scripts, ``uniform`` and ``sigma`` honour it as well (``sigma`` on its unshifted grid position). Moved samples
  are clamped to ``[1/1000, 1 - 1/1000]`` before any shift, never against the offset's direction. A zero offset
  leaves a sample bit-identical.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import torch

from library.errors import UserError

logger = logging.getLogger(__name__)

NUM_TRAIN_TIMESTEPS = 1000

TIMESTEP_SAMPLING_CHOICES = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform")
LOSS_TYPES = ("l1", "l2", "huber", "smooth_l1")
HUBER_SCHEDULES = ("constant", "exponential", "snr")

# flux_shift: mu is a line through (256 tokens, 0.5) and (4096 tokens, 1.15), as in FLUX.
FLUX_SHIFT_BASE_TOKENS, FLUX_SHIFT_BASE_MU = 256, 0.5
FLUX_SHIFT_MAX_TOKENS, FLUX_SHIFT_MAX_MU = 4096, 1.15

# Offset samples are clamped to this distance from 0 and 1 (one step of the training grid).
OFFSET_EPS = 1.0 / NUM_TRAIN_TIMESTEPS

# The DiT downsamples the image 16x (8x VAE, 2x2 patchify).
IMAGE_TO_LATENT = 16

OffsetLike = float | Sequence[float] | torch.Tensor | None


# ----------------------------------------------------------------------------------------------------------------------
# arguments


def add_flow_matching_arguments(parser: argparse.ArgumentParser) -> None:
    """Timestep sampling, loss weighting, loss type and input-perturbation options (sd-scripts names and defaults)."""
    parser.add_argument(
        "--timestep_sampling",
        choices=TIMESTEP_SAMPLING_CHOICES,
        default="sigmoid",
        help="how to sample the noise level: sigma (the shifted 1000-step grid, distribution from --weighting_scheme),"
        " uniform, sigmoid (default), shift (sigmoid + --discrete_flow_shift), flux_shift (resolution-dependent)",
    )
    parser.add_argument(
        "--discrete_flow_shift",
        type=float,
        default=1.0,
        help="shift of the noise levels for --timestep_sampling sigma and shift: s' = S*s / (1 + (S-1)*s). Default 1.0",
    )
    parser.add_argument(
        "--sigmoid_scale",
        type=float,
        default=1.0,
        help="scale of the normal draw for --timestep_sampling sigmoid, shift and flux_shift. Default 1.0",
    )
    parser.add_argument(
        "--weighting_scheme",
        choices=WEIGHTING_SCHEMES,
        default="uniform",
        help="loss weighting by noise level (sigma_sqrt, cosmap); logit_normal and mode select the distribution of"
        " --timestep_sampling sigma and weight 1. Default uniform",
    )
    parser.add_argument("--logit_mean", type=float, default=0.0, help="mean of the logit_normal scheme. Default 0.0")
    parser.add_argument("--logit_std", type=float, default=1.0, help="std of the logit_normal scheme. Default 1.0")
    parser.add_argument("--mode_scale", type=float, default=1.29, help="scale of the mode scheme. Default 1.29")
    parser.add_argument(
        "--loss_type", choices=LOSS_TYPES, default="l2", help="loss function: l1, l2 (default), huber, smooth_l1"
    )
    parser.add_argument(
        "--huber_schedule",
        choices=HUBER_SCHEDULES,
        default="snr",
        help="how the Huber threshold depends on the noise level for huber / smooth_l1: constant, exponential, snr"
        " (default; flow-matching form c = (1 - huber_c) * (1 - sigma)^2 + huber_c)",
    )
    parser.add_argument("--huber_c", type=float, default=0.1, help="Huber threshold parameter. Default 0.1")
    parser.add_argument("--huber_scale", type=float, default=1.0, help="scale of the Huber threshold. Default 1.0")
    parser.add_argument(
        "--ip_noise_gamma",
        type=float,
        default=None,
        help="input perturbation: extra noise gamma * xi on the noisy input, the target keeps the plain noise (0.1 is"
        " typical)",
    )
    parser.add_argument(
        "--ip_noise_gamma_random_strength",
        action="store_true",
        help="draw the input perturbation strength uniformly between 0 and --ip_noise_gamma at every step",
    )
    parser.add_argument(
        "--show_timesteps",
        choices=("console", "image"),
        default=None,
        help="show the sampled timestep distribution and the loss weights for the current settings, then exit",
    )
    parser.add_argument(
        "--show_timesteps_resolution",
        type=int,
        default=1024,
        help="resolution assumed by --show_timesteps for resolution-dependent sampling (flux_shift), default 1024",
    )
    parser.add_argument(
        "--show_timesteps_offset",
        type=float,
        default=0.0,
        help="per-sample timestep sampling offset applied in --show_timesteps (as a subset's"
        " timestep_sampling.offset would). Default 0.0",
    )


# ----------------------------------------------------------------------------------------------------------------------
# the typed settings: built from the parsed options in one place (`from_args`); the functions below take these


@dataclass(frozen=True)
class TimestepSamplingConfig:
    """How the noise levels of a training step are drawn (--timestep_sampling and its parameters)."""

    method: str  # --timestep_sampling: sigma, uniform, sigmoid, shift or flux_shift
    discrete_flow_shift: float
    sigmoid_scale: float
    weighting_scheme: str  # also picks the distribution of u for the sigma method
    logit_mean: float
    logit_std: float
    mode_scale: float

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TimestepSamplingConfig:
        return cls(args.timestep_sampling, float(args.discrete_flow_shift), float(args.sigmoid_scale),
                   args.weighting_scheme, float(args.logit_mean), float(args.logit_std), float(args.mode_scale))


@dataclass(frozen=True)
class InputPerturbation:
    """--ip_noise_gamma: extra noise ``gamma * xi`` on the noisy input (0 = off); with ``random_strength`` gamma is
    drawn uniformly from [0, gamma] at every step."""

    gamma: float = 0.0
    random_strength: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InputPerturbation:
        return cls(float(args.ip_noise_gamma or 0.0), bool(args.ip_noise_gamma_random_strength))


@dataclass(frozen=True)
class LossConfig:
    """--loss_type and the Huber threshold schedule of huber / smooth_l1."""

    loss_type: str
    huber_schedule: str
    huber_c: float
    huber_scale: float

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LossConfig:
        return cls(args.loss_type, args.huber_schedule, float(args.huber_c), float(args.huber_scale))


@dataclass(frozen=True)
class ShowTimestepsConfig:
    """--show_timesteps: the sampling to show, console or image, the assumed resolution and offset."""

    sampling: TimestepSamplingConfig
    mode: str  # console or image
    resolution: int
    offset: float

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ShowTimestepsConfig:
        return cls(TimestepSamplingConfig.from_args(args), args.show_timesteps or "console",
                   int(args.show_timesteps_resolution), float(args.show_timesteps_offset))


# ----------------------------------------------------------------------------------------------------------------------
# the scheduler


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Discrete flow shift ``shift * s / (1 + (shift - 1) * s)``; shift 1.0 is the identity."""
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


class FlowMatchEulerDiscreteScheduler:
    """The training grid of rectified flow: timesteps N..1 (descending), ``s = t / N``, sigma = shifted s.

    ``timesteps[i] = sigmas[i] * N`` (float32, length N); ``sigmas`` has a trailing 0 (length N + 1), like diffusers.
    """

    def __init__(self, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS, shift: float = 1.0) -> None:
        if num_train_timesteps < 1:
            raise ValueError(f"num_train_timesteps must be positive, got {num_train_timesteps}")
        if not shift > 0:
            raise UserError(f"--discrete_flow_shift must be positive, got {shift}; use 1.0 for no shift.")
        self.num_train_timesteps = int(num_train_timesteps)
        self.shift = float(shift)
        steps = torch.arange(self.num_train_timesteps, 0, -1, dtype=torch.float64) / self.num_train_timesteps
        sigmas = shift_sigmas(steps, self.shift)
        self.timesteps = (sigmas * self.num_train_timesteps).to(torch.float32)
        self.sigmas = torch.cat([sigmas, sigmas.new_zeros(1)]).to(torch.float32)

    def sigmas_at(self, indices: torch.Tensor) -> torch.Tensor:
        """Sigmas of grid indices (0 = the noisiest), clamped into the grid."""
        return self.sigmas[indices.long().clamp(0, self.num_train_timesteps - 1).cpu()]

    def timesteps_at(self, indices: torch.Tensor) -> torch.Tensor:
        """Timesteps of grid indices (0 = the noisiest), clamped into the grid; integers when shift is 1."""
        return self.timesteps[indices.long().clamp(0, self.num_train_timesteps - 1).cpu()]

    def __repr__(self) -> str:
        return f"FlowMatchEulerDiscreteScheduler(num_train_timesteps={self.num_train_timesteps}, shift={self.shift})"


@functools.lru_cache(maxsize=8)
def get_scheduler(shift: float, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> FlowMatchEulerDiscreteScheduler:
    """A cached scheduler for the given shift (the tensors are small, but built only once per shift)."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps, shift)


# ----------------------------------------------------------------------------------------------------------------------
# timestep sampling


def flux_shift_mu(num_image_tokens: int) -> float:
    """The resolution-dependent shift of flux_shift: linear in the number of image tokens."""
    slope = (FLUX_SHIFT_MAX_MU - FLUX_SHIFT_BASE_MU) / (FLUX_SHIFT_MAX_TOKENS - FLUX_SHIFT_BASE_TOKENS)
    return FLUX_SHIFT_BASE_MU + slope * (num_image_tokens - FLUX_SHIFT_BASE_TOKENS)


def time_shift(mu: float, sigmas: torch.Tensor) -> torch.Tensor:
    """``e^mu / (e^mu + (1/s - 1))``: the exponential shift of flux_shift (equal to shift_sigmas with e^mu)."""
    return shift_sigmas(sigmas, math.exp(mu))


def _draw(kind: str, n: int, generator: torch.Generator | None) -> torch.Tensor:
    device = generator.device if generator is not None else torch.device("cpu")
    fn = torch.rand if kind == "uniform" else torch.randn
    return fn((n,), generator=generator, device=device, dtype=torch.float32).cpu()


def _offset_tensor(offset: OffsetLike, batch_size: int) -> torch.Tensor | None:
    if offset is None:
        return None
    t = torch.as_tensor(offset, dtype=torch.float32).detach().cpu().flatten()
    if t.numel() == 1:
        t = t.expand(batch_size)
    if t.numel() != batch_size:
        raise ValueError(f"timestep sampling offset has {t.numel()} values for a batch of {batch_size}")
    if not torch.isfinite(t).all():
        raise UserError(
            f"timestep_sampling.offset must be a finite number, got {t.tolist()}; fix custom_attributes in the dataset"
            " config."
        )
    if not t.any():
        return None
    return t.clone()


def apply_logit_offset(s: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """``sigmoid(logit(s) + offset)`` where the offset is non-zero, clamped to [OFFSET_EPS, 1 - OFFSET_EPS].

    The clamp never moves a sample against the offset: a positive offset never lowers a sample, a negative one
    never raises it, and samples with a zero offset are returned unchanged.
    """
    if offset is None:
        return s
    moved = torch.sigmoid(torch.logit(s.clamp(1e-7, 1 - 1e-7)) + offset).clamp(OFFSET_EPS, 1.0 - OFFSET_EPS)
    moved = torch.where(offset > 0, torch.maximum(moved, s), torch.minimum(moved, s))
    return torch.where(offset != 0, moved, s)


def compute_density_for_timestep_sampling(
    weighting_scheme: str,
    batch_size: int,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """u in [0, 1] for --timestep_sampling sigma (SD3): logit-normal, mode, or uniform. Small u = more noise."""
    if weighting_scheme == "logit_normal":
        return torch.sigmoid(_draw("normal", batch_size, generator) * logit_std + logit_mean)
    u = _draw("uniform", batch_size, generator)
    if weighting_scheme == "mode":
        return 1.0 - u - mode_scale * (torch.cos(math.pi * u / 2.0) ** 2 - 1.0 + u)
    return u


def _sigma_grid_indices(u: torch.Tensor, offset: torch.Tensor | None, num_train_timesteps: int) -> torch.Tensor:
    # the grid position of u is s = 1 - u (index 0 is sigma 1); the offset moves s, as in the other modes
    if offset is not None:
        u = 1.0 - apply_logit_offset(1.0 - u, offset)
    return (u * num_train_timesteps).floor().long().clamp(0, num_train_timesteps - 1)


def sample_sigmas(
    sampling: TimestepSamplingConfig,
    batch_size: int,
    latent_hw: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    generator: torch.Generator | None = None,
    offset: OffsetLike = None,
    scheduler: FlowMatchEulerDiscreteScheduler | None = None,
) -> torch.Tensor:
    """Draw ``batch_size`` noise levels (float32 [B]) per ``sampling.method`` (--timestep_sampling).

    ``latent_hw`` (the DiT grid, H/16 x W/16) is needed by flux_shift only. ``offset`` is the per-sample
    timestep_sampling offset (scalar or [B]; see the module docstring). Random numbers are drawn on the generator's
    device (CPU without a generator) so that a seed gives the same draws on any device.
    """
    sigmas, _ = sample_sigmas_and_timesteps(sampling, batch_size, latent_hw, device, generator, offset, scheduler)
    return sigmas


def sample_sigmas_and_timesteps(
    sampling: TimestepSamplingConfig,
    batch_size: int,
    latent_hw: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    generator: torch.Generator | None = None,
    offset: OffsetLike = None,
    scheduler: FlowMatchEulerDiscreteScheduler | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_sigmas`` and the matching timesteps (float32 [B]): ``sigma * 1000``, taken from the scheduler's grid
    for --timestep_sampling sigma (exact integers there when the shift is 1)."""
    mode = sampling.method
    timesteps = None
    off = _offset_tensor(offset, batch_size)
    if mode == "sigma":
        scheduler = scheduler if scheduler is not None else get_scheduler(sampling.discrete_flow_shift)
        u = compute_density_for_timestep_sampling(
            sampling.weighting_scheme,
            batch_size,
            sampling.logit_mean,
            sampling.logit_std,
            sampling.mode_scale,
            generator,
        )
        indices = _sigma_grid_indices(u, off, scheduler.num_train_timesteps)
        sigmas, timesteps = scheduler.sigmas_at(indices), scheduler.timesteps_at(indices)
    elif mode == "uniform":
        sigmas = apply_logit_offset(_draw("uniform", batch_size, generator), off)
    elif mode in ("sigmoid", "shift", "flux_shift"):
        logits = _draw("normal", batch_size, generator) * sampling.sigmoid_scale
        sigmas = apply_logit_offset(torch.sigmoid(logits), off)
        if mode == "shift":
            shift = sampling.discrete_flow_shift
            if not shift > 0:
                raise UserError(f"--discrete_flow_shift must be positive, got {shift}; use 1.0 for no shift.")
            sigmas = shift_sigmas(sigmas, shift)
        elif mode == "flux_shift":
            if latent_hw is None:
                raise ValueError("flux_shift needs latent_hw (the DiT latent grid height and width)")
            sigmas = time_shift(flux_shift_mu(int(latent_hw[0]) * int(latent_hw[1])), sigmas)
    else:
        raise UserError(
            f"--timestep_sampling {mode!r} is not supported; choose one of {', '.join(TIMESTEP_SAMPLING_CHOICES)}."
        )
    sigmas = sigmas.to(torch.float32)
    timesteps = sigmas * NUM_TRAIN_TIMESTEPS if timesteps is None else timesteps.to(torch.float32)
    if device is not None:
        sigmas, timesteps = sigmas.to(device), timesteps.to(device)
    return sigmas, timesteps


def validation_sigmas(n: int = 4) -> torch.Tensor:
    """Fixed, evenly spaced noise levels for validation loss: ``i / (n + 1)`` for i = 1..n (n=4: 0.2 0.4 0.6 0.8).

    sd-scripts' fixed validation timesteps are DDPM timesteps that flow models ignore; these are their flow-matching
    counterpart, so that validation losses are comparable from run to run.
    """
    if n < 1:
        raise ValueError(f"validation_sigmas needs n >= 1, got {n}")
    return torch.arange(1, n + 1, dtype=torch.float64).div(n + 1).to(torch.float32)


def _broadcastable(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.reshape(-1, *([1] * (ndim - 1)))


def get_noisy_model_input_and_timesteps(
    sampling: TimestepSamplingConfig,
    latents: torch.Tensor,
    noise: torch.Tensor,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
    timestep_sampling_offset: OffsetLike = None,
    sigmas: torch.Tensor | None = None,
    ip_noise: InputPerturbation | None = None,
    noise_scheduler: FlowMatchEulerDiscreteScheduler | None = None,
    host_generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise a batch of latents ``[B, C, h, w]`` for one training step.

    Returns ``(noisy_model_input, timesteps, sigmas)``: the noisy input in ``dtype`` (default: latents' dtype),
    ``timesteps = sigma * 1000`` float32 ``[B]`` for the DiT, and ``sigmas`` float32 shaped ``[B, 1, 1, 1]`` (one
    per sample, broadcastable against the latents, as sd-scripts returns them). Pass ``sigmas`` (one value or [B]) to
    use fixed noise levels instead of sampling (validation). With ``ip_noise`` (--ip_noise_gamma; None for none, as
    in validation) the input gets extra noise ``gamma * xi`` scaled by sigma; the training target ``noise - latents``
    is unchanged. ``generator`` draws everything (the validation's fixed streams); ``host_generator`` (default
    ``generator``) only the draws made on the host, the sigmas and the ip-noise strength, while the noise tensors come
    from ``generator`` or the device's stream (the trainer's step, ``library.training.host_random``).
    """
    bsz = latents.shape[0]
    host_generator = host_generator if host_generator is not None else generator
    device = torch.device(device) if device is not None else latents.device
    if sigmas is None:
        flat, timesteps = sample_sigmas_and_timesteps(
            sampling, bsz, latents.shape[-2:], None, host_generator, timestep_sampling_offset, noise_scheduler
        )
    else:
        flat = torch.as_tensor(sigmas, dtype=torch.float32).detach().cpu().flatten()
        flat = flat.expand(bsz).clone() if flat.numel() == 1 else flat
        if flat.numel() != bsz:
            raise ValueError(f"{flat.numel()} fixed sigmas given for a batch of {bsz}")
        timesteps = flat * NUM_TRAIN_TIMESTEPS
    # host-to-device without waiting for the queued work (a blocking copy would drain the GPU queue every step)
    timesteps = timesteps.to(device=device, dtype=torch.float32, non_blocking=True)
    flat = flat.to(device=device, dtype=torch.float32, non_blocking=True)
    s = _broadcastable(flat, latents.ndim)

    latents = latents.to(device)
    noise = noise.to(device)
    gamma = ip_noise.gamma if ip_noise is not None else 0.0
    if gamma:
        xi = _ip_noise_like(latents, generator)
        if ip_noise.random_strength:
            gamma = float(_draw("uniform", 1, host_generator)[0]) * gamma
        noisy = (1.0 - s) * latents.float() + s * (noise.float() + gamma * xi.float())
    else:
        noisy = (1.0 - s) * latents.float() + s * noise.float()
    return noisy.to(dtype if dtype is not None else latents.dtype), timesteps, s


def _ip_noise_like(latents: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    if generator is None:
        return torch.randn_like(latents, dtype=torch.float32)
    xi = torch.randn(latents.shape, generator=generator, device=generator.device, dtype=torch.float32)
    return xi.to(latents.device)


# ----------------------------------------------------------------------------------------------------------------------
# loss weighting and losses


def compute_loss_weighting(weighting_scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """Loss weight per noise level, shaped like ``sigmas`` (float32).

    sigma_sqrt: ``sigma^-2`` (unbounded as sigma -> 0); cosmap: ``2 / (pi * (1 - 2 sigma + 2 sigma^2))``;
    uniform, none, logit_normal and mode: 1 (the last two only change the --timestep_sampling sigma distribution).
    """
    s = sigmas.float()
    if weighting_scheme == "sigma_sqrt":
        return s ** -2.0
    if weighting_scheme == "cosmap":
        return 2.0 / (math.pi * (1.0 - 2.0 * s + 2.0 * s**2))
    if weighting_scheme in ("uniform", "none", "logit_normal", "mode", None):
        return torch.ones_like(s)
    raise UserError(
        f"--weighting_scheme {weighting_scheme!r} is not supported; choose one of {', '.join(WEIGHTING_SCHEMES)}."
    )


def get_huber_threshold(loss: LossConfig, timesteps: torch.Tensor) -> torch.Tensor | None:
    """Per-sample Huber threshold c (float32 [B]) for huber / smooth_l1, None for l1 / l2.

    With h = --huber_c, k = --huber_scale, sigma = t / 1000: constant ``h * k``; exponential ``k * h^(t/1000)``
    (k at t=0 down to h*k at t=1000); snr ``k * ((1 - h) * (1 - sigma)^2 + h)`` (the flow-matching form of
    sd-scripts' DDPM schedule, see the module docstring).
    """
    if loss.loss_type not in ("huber", "smooth_l1"):
        return None
    h, k = loss.huber_c, loss.huber_scale
    if not h > 0:
        raise UserError(f"--huber_c must be positive, got {h}.")
    t = timesteps.detach().float().flatten()
    schedule = loss.huber_schedule
    if schedule == "constant":
        return torch.full_like(t, h * k)
    if schedule == "exponential":
        return k * torch.exp(math.log(h) * t / NUM_TRAIN_TIMESTEPS)
    if schedule == "snr":
        sigma = (t / NUM_TRAIN_TIMESTEPS).clamp(0.0, 1.0)
        return k * ((1.0 - h) * (1.0 - sigma) ** 2 + h)
    raise UserError(f"--huber_schedule {schedule!r} is not supported; choose one of {', '.join(HUBER_SCHEDULES)}.")


def conditional_loss(
    model_pred: torch.Tensor,
    target: torch.Tensor,
    loss_type: str = "l2",
    huber_c: float | torch.Tensor | None = None,
    reduction: str = "none",
) -> torch.Tensor:
    """Element-wise loss (reduction none, mean or sum). ``huber_c`` is a float or one value per sample [B].

    l2 ``(p-y)^2``; l1 ``|p-y|``; huber ``2c (sqrt((p-y)^2 + c^2) - c)``; smooth_l1 ``2 (sqrt((p-y)^2 + c^2) - c)``.
    """
    diff = model_pred - target
    if loss_type == "l2":
        loss = diff**2
    elif loss_type == "l1":
        loss = diff.abs()
    elif loss_type in ("huber", "smooth_l1"):
        if huber_c is None:
            raise ValueError(f"loss_type {loss_type} needs huber_c (see get_huber_threshold)")
        c = torch.as_tensor(huber_c, dtype=diff.dtype, device=diff.device)
        if c.ndim > 0:
            c = _broadcastable(c, diff.ndim)
        root = torch.sqrt(diff**2 + c**2) - c
        loss = 2.0 * c * root if loss_type == "huber" else 2.0 * root
    else:
        raise UserError(f"--loss_type {loss_type!r} is not supported; choose one of {', '.join(LOSS_TYPES)}.")
    if reduction == "none":
        return loss
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    raise ValueError(f"unknown reduction {reduction!r}")


# ----------------------------------------------------------------------------------------------------------------------
# reporting: the one-line summary and --show_timesteps


def describe_timestep_sampling(sampling: TimestepSamplingConfig) -> str:
    """One line describing the sampling, whether --discrete_flow_shift applies, and the loss weighting."""
    mode = sampling.method
    shift = sampling.discrete_flow_shift
    scale = sampling.sigmoid_scale
    scheme = sampling.weighting_scheme
    if mode == "sigma":
        if scheme == "logit_normal":
            dist = f"logit-normal u (mean {sampling.logit_mean}, std {sampling.logit_std})"
        elif scheme == "mode":
            dist = f"mode u (mode_scale {sampling.mode_scale})"
        else:
            dist = "uniform u"
        what = f"sigma: {dist} on the {NUM_TRAIN_TIMESTEPS}-step grid"
        applied = f"discrete_flow_shift={shift} is applied"
    elif mode == "shift":
        what = f"shift: sigmoid({scale} * N(0,1)) then shifted"
        applied = f"discrete_flow_shift={shift} is applied"
    elif mode == "flux_shift":
        what = (
            f"flux_shift: sigmoid({scale} * N(0,1)) with a resolution-dependent shift"
            " (mu 0.5 at 256 to 1.15 at 4096 image tokens)"
        )
        applied = f"discrete_flow_shift={shift} is NOT applied"
    elif mode == "sigmoid":
        what = f"sigmoid: sigmoid({scale} * N(0,1))"
        applied = f"discrete_flow_shift={shift} is NOT applied"
    else:
        what = "uniform: U(0, 1)"
        applied = f"discrete_flow_shift={shift} is NOT applied"
    weight = {"sigma_sqrt": "sigma^-2", "cosmap": "cosmap"}.get(scheme, "1")
    return (
        f"Timestep sampling: {what}; {applied} (it applies to sigma and shift only);"
        f" loss weighting {scheme} (weight {weight})"
    )


def log_timestep_sampling_info(sampling: TimestepSamplingConfig) -> str:
    """Log (and return) the one-line summary of the timestep sampling configuration."""
    line = describe_timestep_sampling(sampling)
    logger.info(line)
    return line


SHOW_TIMESTEPS_SAMPLES = 100_000
SHOW_TIMESTEPS_BINS = 20
SHOW_TIMESTEPS_BAR = 50


def _show_timesteps_data(show: ShowTimestepsConfig, num_samples: int, seed: int) -> tuple[torch.Tensor, str]:
    resolution = show.resolution
    if resolution < IMAGE_TO_LATENT or resolution % IMAGE_TO_LATENT:
        raise UserError(
            f"--show_timesteps_resolution must be a positive multiple of {IMAGE_TO_LATENT}, got {resolution}."
        )
    hw = (resolution // IMAGE_TO_LATENT, resolution // IMAGE_TO_LATENT)
    offset = show.offset
    gen = torch.Generator().manual_seed(seed)
    sigmas = sample_sigmas(show.sampling, num_samples, hw, generator=gen, offset=offset if offset else None)
    note = f"resolution {resolution}x{resolution} ({hw[0] * hw[1]} image tokens)"
    if offset:
        note += f", offset {offset:+g}"
    return sigmas * NUM_TRAIN_TIMESTEPS, note


def format_timestep_histogram(show: ShowTimestepsConfig, num_samples: int = SHOW_TIMESTEPS_SAMPLES, seed: int = 0) -> str:
    """The console form of --show_timesteps: an ASCII histogram of real samples with the loss weight per bin."""
    timesteps, note = _show_timesteps_data(show, num_samples, seed)
    edges = torch.linspace(0, NUM_TRAIN_TIMESTEPS, SHOW_TIMESTEPS_BINS + 1, dtype=torch.float64)
    counts = torch.histc(timesteps.double(), bins=SHOW_TIMESTEPS_BINS, min=0, max=NUM_TRAIN_TIMESTEPS)
    centres = ((edges[:-1] + edges[1:]) / 2 / NUM_TRAIN_TIMESTEPS).float()
    weights = compute_loss_weighting(show.sampling.weighting_scheme, centres)
    peak = max(float(counts.max()), 1.0)
    lines = [
        describe_timestep_sampling(show.sampling),
        f"{num_samples} samples, {note}; mean t {timesteps.mean():.1f}, median t {timesteps.median():.1f}",
        f"{'t range':>11} | {'share':>6} | {'weight':>8} | histogram",
    ]
    for i in range(SHOW_TIMESTEPS_BINS):
        share = float(counts[i]) / num_samples
        bar = "#" * int(round(float(counts[i]) / peak * SHOW_TIMESTEPS_BAR))
        lines.append(f"{int(edges[i]):>4} - {int(edges[i + 1]):>4} | {share:6.1%} | {float(weights[i]):8.3g} | {bar}")
    return "\n".join(lines)


def _plot_timesteps(show: ShowTimestepsConfig, num_samples: int, seed: int) -> str | None:
    try:
        import matplotlib
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UserError(
            "--show_timesteps image needs matplotlib, which is not installed; run `pip install matplotlib` or use"
            " --show_timesteps console."
        ) from e
    timesteps, note = _show_timesteps_data(show, num_samples, seed)
    method, scheme = show.sampling.method, show.sampling.weighting_scheme
    t_axis = torch.linspace(0.5, NUM_TRAIN_TIMESTEPS - 0.5, 400)
    weights = compute_loss_weighting(scheme, t_axis / NUM_TRAIN_TIMESTEPS)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.hist(timesteps.numpy(), bins=100, range=(0, NUM_TRAIN_TIMESTEPS), density=True)
    ax1.set_title(f"sampled timesteps ({method}, {note})")
    ax1.set_xlabel("timestep (sigma * 1000)")
    ax2.plot(t_axis.numpy(), weights.numpy())
    ax2.set_title(f"loss weight ({scheme})")
    ax2.set_xlabel("timestep (sigma * 1000)")
    fig.suptitle(describe_timestep_sampling(show.sampling), fontsize=8)
    fig.tight_layout()
    if matplotlib.get_backend().lower() == "agg":  # no display: save instead of showing nothing
        path = os.path.abspath(f"show_timesteps_{method}.png")
        fd, tmp = tempfile.mkstemp(suffix=".png", dir=os.path.dirname(path))
        os.close(fd)
        try:
            fig.savefig(tmp, format="png")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        plt.close(fig)
        logger.info(f"no display for matplotlib: the timestep plot was saved to {path}")
        return path
    plt.show()
    return None


def show_timesteps(
    show: ShowTimestepsConfig,
    out: TextIO | None = None,
    num_samples: int = SHOW_TIMESTEPS_SAMPLES,
    seed: int = 0,
) -> str | None:
    """--show_timesteps: console writes the ASCII histogram to ``out`` (the log when None) and returns it; image
    shows a matplotlib figure (saved to ``show_timesteps_<mode>.png`` when there is no display; returns the path)."""
    mode = show.mode
    if mode == "image":
        return _plot_timesteps(show, num_samples, seed)
    if mode != "console":
        raise UserError(f"--show_timesteps {mode!r} is not supported; choose console or image.")
    text = format_timestep_histogram(show, num_samples, seed)
    if out is None:
        for line in text.splitlines():
            logger.info(line)
    else:
        out.write(text + "\n")
        out.flush()
    return text


__all__ = [
    "NUM_TRAIN_TIMESTEPS",
    "FlowMatchEulerDiscreteScheduler",
    "InputPerturbation",
    "LossConfig",
    "ShowTimestepsConfig",
    "TimestepSamplingConfig",
    "add_flow_matching_arguments",
    "apply_logit_offset",
    "compute_density_for_timestep_sampling",
    "compute_loss_weighting",
    "conditional_loss",
    "describe_timestep_sampling",
    "flux_shift_mu",
    "format_timestep_histogram",
    "get_huber_threshold",
    "get_noisy_model_input_and_timesteps",
    "get_scheduler",
    "log_timestep_sampling_info",
    "sample_sigmas",
    "sample_sigmas_and_timesteps",
    "shift_sigmas",
    "show_timesteps",
    "time_shift",
    "validation_sigmas",
]
