"""Encoding captions with the Qwen3.5 text encoder: `encode_captions` is the one entry point (caching, sample prompts,
inference and the text-encoder LoRA training all call it).

Each caption is templated (`qwen35.format_prompt`), tokenised and truncated to the token limit; its outputs are the
last hidden state [T, hidden] of its real tokens and an all-true mask [T], exactly as encoding it alone without
padding gives them (the official pipeline encodes one caption at a time, and the caches record that).
`LazyEncoder` defers making an encode function (and so reading the encoder) to its first call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from library.text_encoder.qwen35 import DEFAULT_MAX_TOKEN_LENGTH, tokenize

TextOutputs = tuple[torch.Tensor, torch.Tensor]  # (embeds [T, D], mask [T] bool)
EncodeFn = Callable[[Sequence[str]], list[TextOutputs]]


def model_device(model: Any) -> torch.device:
    return next(p.device for p in model.parameters())


def encode_captions(model: Any, tokenizer: Any, captions: Sequence[str], max_length: int = DEFAULT_MAX_TOKEN_LENGTH,
                    grad: bool = False) -> list[TextOutputs]:
    """The outputs of each caption, in order, on the model's device: (hidden [T_i, D], mask [T_i]).

    `grad=False` (caching, sampling, inference) builds no autograd graph; `grad=True` (the text encoder LoRA is
    trained) leaves the caller's grad mode in force, so gradients flow when it is enabled."""
    device = model_device(model)
    outputs: list[TextOutputs] = []
    with contextlib.nullcontext() if grad else torch.no_grad():
        for caption in captions:
            ids = tokenize(tokenizer, caption, max_length).to(device)
            hidden = model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
            outputs.append((hidden, torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)))
    return outputs


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
