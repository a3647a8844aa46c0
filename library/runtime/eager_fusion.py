"""Eager forms of the element-wise code: the same math in fewer, narrower kernels when a model runs without
torch.compile.

A compiled region fuses element-wise chains itself (inductor), so it keeps the plain forms as written and its graphs
stay as measured; eager mode launches one kernel per operator, each reading and writing whole activations, which is
where an eager training step spends about half of its GPU time (docs/benchmarks.md). The eager forms:

- `library.moss_image.dit`: RMSNorm on the activation's own dtype (torch's rms_norm computes in fp32 inside; one
  kernel on CUDA that keeps the bf16 input for backward), RoPE as one complex product, the adaLN modulation and the
  gated residuals as `addcmul`;
- `networks.lora_generic`: the LoRA up-projection accumulated into the base output by one `addmm` (scale and
  multiplier as its alpha) instead of a product and two element-wise passes.

`set_eager_fusion(False)` restores the plain forms in eager mode too: `bench/eager_block.py` measures both in one
process, and tests compare them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_ENABLED = True


def set_eager_fusion(enabled: bool) -> bool:
    """Turn the eager forms on or off; returns the previous setting."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, bool(enabled)
    return previous


def eager_fused() -> bool:
    """Whether code takes its eager form: on, and not being traced by torch.compile."""
    return _ENABLED and not torch.compiler.is_compiling()


@contextlib.contextmanager
def plain_forms() -> Iterator[None]:
    """The plain forms in eager mode too, inside the block (what a compiled region computes, operator for operator)."""
    previous = set_eager_fusion(False)
    try:
        yield
    finally:
        set_eager_fusion(previous)
