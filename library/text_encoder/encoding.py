"""Encoding captions with the Qwen3.5 text encoder: `encode_captions` is the one entry point (caching, sample prompts,
inference and the text-encoder LoRA training all call it).

Each caption is templated (`qwen35.format_prompt`), tokenised and truncated to the token limit; its outputs are the
last hidden state [T, hidden] of its real tokens and an all-true mask [T], equal to encoding it alone without
padding (the official pipeline encodes one caption at a time, and the caches record that).

Batches (`batch_size` > 1): captions are sorted by token count and encoded `batch_size` at a time, right-padded
with an attention mask, then each is cut back to its own tokens. Every layer of Qwen3.5 is causal (the full-attention
layers' causal mask, the Gated DeltaNet layers' causal depthwise convolution and left-to-right recurrence), so right
padding never reaches a real token; the mask also zeroes the pads' inputs to the Gated DeltaNet layers. The outputs
are those of the caption alone up to float rounding (another matrix shape sums in another order): within 1e-5 in fp32
and within the run-to-run noise in bf16 (tests/test_text_encoder.py). Left padding would not be exact (the pads would
enter the recurrent state before the caption), and packed sequences need flash-linear-attention, so neither is used.
Where fla's Triton kernels run, the padded length is rounded up to `kernels.length_multiple` tokens, so that a
kernel is compiled once per length bucket, not once per caption. `batch_size` 1 (the default) is the exact
one-at-a-time path, unpadded.
`LazyEncoder` defers making an encode function (and so reading the encoder) to its first call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from library.errors import UserError
from library.text_encoder.kernels import length_multiple
from library.text_encoder.qwen35 import DEFAULT_MAX_TOKEN_LENGTH, tokenize

TextOutputs = tuple[torch.Tensor, torch.Tensor]  # (embeds [T, D], mask [T] bool)
EncodeFn = Callable[[Sequence[str]], list[TextOutputs]]


def model_device(model: Any) -> torch.device:
    return next(p.device for p in model.parameters())


def encode_captions(model: Any, tokenizer: Any, captions: Sequence[str], max_length: int = DEFAULT_MAX_TOKEN_LENGTH,
                    batch_size: int = 1, grad: bool = False) -> list[TextOutputs]:
    """The outputs of each caption, in the order given, on the model's device: (hidden [T_i, D], mask [T_i]).

    `batch_size`: captions per forward (see the module docstring; 1 encodes each alone). `grad=False` (caching,
    sampling, inference) builds no autograd graph; `grad=True` (the text encoder LoRA is trained) leaves the caller's
    grad mode in force, so gradients flow when it is enabled."""
    device = model_device(model)
    ids = [tokenize(tokenizer, c, max_length) for c in captions]
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    multiple = length_multiple(device)
    outputs: list[TextOutputs | None] = [None] * len(ids)
    with contextlib.nullcontext() if grad else torch.no_grad():
        for group in length_batches([len(t) for t in ids], batch_size):
            for i, out in zip(group, _encode_batch(model, [ids[i] for i in group], device, pad_id, multiple)):
                outputs[i] = out
    return outputs  # type: ignore[return-value]  # every index is filled


def text_encoder_batch_size(value: int | None) -> int:
    """`--text_encoder_batch_size` checked: None (not given) is 1, one caption at a time."""
    if value is None:
        return 1
    if value < 1:
        raise UserError(f"--text_encoder_batch_size {value} must be at least 1.")
    return int(value)


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices into `lengths`, sorted by length (stable) and cut into batches of at most `batch_size`."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    size = max(1, int(batch_size))
    return [order[k : k + size] for k in range(0, len(order), size)]


def _encode_batch(model: Any, ids: list[torch.Tensor], device: torch.device, pad_id: int,
                  multiple: int) -> list[TextOutputs]:
    lengths = [len(t) for t in ids]
    if len(ids) == 1 and multiple == 1:  # alone: no padding, no mask
        hidden = model(input_ids=ids[0].to(device)[None], use_cache=False).last_hidden_state
    else:
        width = -(-max(lengths) // multiple) * multiple
        input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for b, t in enumerate(ids):
            input_ids[b, : len(t)] = t
            mask[b, : len(t)] = 1
        out = model(input_ids=input_ids.to(device), attention_mask=mask.to(device), use_cache=False)
        hidden = out.last_hidden_state
    return [(hidden[b, :n], torch.ones(n, dtype=torch.bool, device=hidden.device)) for b, n in enumerate(lengths)]


def pad_and_stack(encoded: Sequence[TextOutputs]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad per-caption outputs into a batch: embeds [B, T_max, D] (zeros in the padding), mask [B, T_max]."""
    t_max = max(e.shape[0] for e, _ in encoded)
    first = encoded[0][0]
    embeds = first.new_zeros(len(encoded), t_max, first.shape[-1])
    mask = torch.zeros(len(encoded), t_max, dtype=torch.bool, device=first.device)
    for i, (e, m) in enumerate(encoded):
        embeds[i, : e.shape[0]] = e
        mask[i, : m.shape[0]] = m.bool()
    return embeds, mask


class LazyEncoder:
    """An encode function (captions -> outputs) made by `factory` on its first call, so that the text encoder is read
    (or placed on the GPU) only when something is encoded. `loads_model`: the factory reads the encoder from disk
    (False when it is in memory already); it only changes what the caching driver logs."""

    def __init__(self, factory: Callable[[], EncodeFn], loads_model: bool = True):
        self._factory = factory
        self._encode: EncodeFn | None = None
        self.loads_model = loads_model

    @property
    def loaded(self) -> bool:
        return self._encode is not None

    def __call__(self, captions: Sequence[str]) -> list[TextOutputs]:
        if self._encode is None:
            self._encode = self._factory()
        return self._encode(captions)
