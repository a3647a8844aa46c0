"""The ConvRot INT8 Linear as registered ``torch.library`` ops, so that ``torch.compile(fullgraph=True)`` traces an
int8 block as one graph (no graph break per Linear), and its eager autograd formula.

Ops (namespace ``moss_image``), each with a fake (meta) implementation for tracing, a default implementation (the
eager torch numerics, any device) and a CUDA one (the Triton kernels where usable, else the same eager code):

- ``convrot_int8_quantize(x2, group_size) -> (x_q int8 [M, K], x_scale fp32 [M])``: rotate + quantise rows;
- ``convrot_int8_quantize_segments(xs, group_size) -> (x_q, x_scale)``: the same of several inputs' rows stacked,
  each written in place in the stacked codes (packed sequences' attention outputs, `library.moss_image.cfg_packing`);
- ``convrot_int8_linear(x, x_q, x_scale, weight, weight_scale, bias, group_size, bwd) -> y [..., N]``: the int32
  GEMM and the dequantisation epilogue of `x`'s quantised rows (output dtype x.dtype). `linear` makes it
  differentiable in `x` (and `bias`) with an autograd.Function: the gradient goes through the frozen int8 weight,
  and nothing of `x` is saved for it. It reads only the quantised rows, so the q, k and v projections of one input
  share one ``convrot_int8_quantize`` node, which the compiled training graph keeps once (common-subexpression
  elimination of the joint graph);
- ``convrot_int8_linear_codes(x_q, x_scale, weight, weight_scale, bias, dtype) -> y [M, N]``: the same product of
  rows given only as their codes (`linear_from_codes`, with `QuantizedRows`), for compiled inference blocks whose
  producers write the codes of their output and not the output (`library.runtime.fused_compiled`); no autograd;
- ``convrot_int8_linear_grad_input(grad, weight, weight_scale, group_size, bwd) -> grad_x [..., K]``;
- ``convrot_int8_dequantize(weight, weight_scale, group_size, dtype) -> W`` (layers flagged full precision).

The module calls `linear` under ``torch.compile`` and `linear_eager` otherwise: the same kernels, without the
dispatcher's per-call cost, with the activation cache (which compiled code must not use: it reuses buffers) and
the module's launch plans (`library.quant.linear_plan`).
Inference graphs get no common-subexpression elimination from torch; `enable_inductor_quantize_dedupe` (called by
`library.runtime.compile.compile_blocks`) adds an inductor pass that keeps one quantisation per input there too.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from library.quant import convrot_kernels as kernels
from library.quant.linear_plan import LinearPlans

__all__ = [
    "DEQUANTIZE", "LINEAR", "LINEAR_CODES", "LINEAR_GRAD_INPUT", "QUANTIZE", "QUANTIZE_SEGMENTS", "QuantizedRows",
    "VIEW_OPS", "dedupe_quantize", "dequantize", "eager_forward", "enable_inductor_quantize_dedupe", "input_key",
    "linear", "linear_eager", "linear_from_codes",
]


# The ops are declared with `torch.library.Library` (schema, per-device kernels, fake and autograd registrations)
# rather than the `torch.library.custom_op` decorator: the decorator's per-call wrapper (output alias checks, a
# dynamo-disabled frame) costs about 30 us of host time on every call of a compiled graph, which calls these ops
# about a thousand times per ConvRot INT8 training step. Same schemas, same kernels, same autograd formula.
_LIB = torch.library.Library("moss_image", "DEF")  # kept for the life of the process (it owns the registrations)


def _define(name: str, schema: str, default: Any, cuda: Any, fake: Any) -> None:
    """Op ``moss_image::name`` with `default` for every device (the eager torch numerics), `cuda` for CUDA tensors
    and `fake` for tracing (shapes and dtypes only)."""
    _LIB.define(f"{name}{schema}")
    _LIB.impl(name, default, "CompositeExplicitAutograd")
    _LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"moss_image::{name}", lib=_LIB)(fake)


# --------------------------------------------------------------------------------------------------------------------
# convrot_int8_quantize
# --------------------------------------------------------------------------------------------------------------------
def _quantize(x2: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.quantize_activation(x2, group_size, "eager")


def _quantize_fake(x2: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x2.new_empty(x2.shape, dtype=torch.int8), x2.new_empty(x2.shape[:1], dtype=torch.float32)


def _quantize_cuda(x2: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.quantize_activation(x2, group_size, "auto")


_define("convrot_int8_quantize", "(Tensor x2, int group_size) -> (Tensor, Tensor)", _quantize, _quantize_cuda,
        _quantize_fake)


# --------------------------------------------------------------------------------------------------------------------
# convrot_int8_quantize_segments (no autograd: compiled inference blocks of packed sequences)
# --------------------------------------------------------------------------------------------------------------------
def _quantize_segments(xs: list[torch.Tensor], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.quantize_segments(xs, group_size, "eager")


def _quantize_segments_fake(xs: list[torch.Tensor], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = sum(x.shape[0] for x in xs)
    return xs[0].new_empty((m, xs[0].shape[1]), dtype=torch.int8), xs[0].new_empty((m,), dtype=torch.float32)


def _quantize_segments_cuda(xs: list[torch.Tensor], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.quantize_segments(xs, group_size, "auto")


_define("convrot_int8_quantize_segments", "(Tensor[] xs, int group_size) -> (Tensor, Tensor)", _quantize_segments,
        _quantize_segments_cuda, _quantize_segments_fake)


# --------------------------------------------------------------------------------------------------------------------
# convrot_int8_linear (+ autograd)
# --------------------------------------------------------------------------------------------------------------------
def _linear_impl(
    x: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, backend: str,
) -> torch.Tensor:
    n = weight.shape[0]
    out = kernels.int8_gemm(x_q, x_scale, weight, weight_scale, bias, x.dtype, backend)
    return out.view(*x.shape[:-1], n)


def _linear(x, x_q, x_scale, weight, weight_scale, bias, group_size, bwd):
    return _linear_impl(x, x_q, x_scale, weight, weight_scale, bias, "eager")


def _linear_fake(x, x_q, x_scale, weight, weight_scale, bias, group_size, bwd):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_cuda(x, x_q, x_scale, weight, weight_scale, bias, group_size, bwd):
    return _linear_impl(x, x_q, x_scale, weight, weight_scale, bias, "auto")


_define("convrot_int8_linear",
        "(Tensor x, Tensor x_q, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor? bias, int group_size,"
        " str bwd) -> Tensor", _linear, _linear_cuda, _linear_fake)


def _linear_grad_input(grad, weight, weight_scale, group_size, bwd):
    return kernels.int8_linear_grad_input(grad, weight, weight_scale, group_size, bwd, backend="eager")


def _linear_grad_input_fake(grad, weight, weight_scale, group_size, bwd):
    return grad.new_empty((*grad.shape[:-1], weight.shape[1]))


def _linear_grad_input_cuda(grad, weight, weight_scale, group_size, bwd):
    return kernels.int8_linear_grad_input(grad, weight, weight_scale, group_size, bwd, backend="auto")


_define("convrot_int8_linear_grad_input",
        "(Tensor grad, Tensor weight, Tensor weight_scale, int group_size, str bwd) -> Tensor",
        _linear_grad_input, _linear_grad_input_cuda, _linear_grad_input_fake)


def _bias_grad(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).float().sum(0).to(dtype)


# --------------------------------------------------------------------------------------------------------------------
# convrot_int8_dequantize
# --------------------------------------------------------------------------------------------------------------------
def _dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    return kernels.dequantize_weight(weight, weight_scale, group_size, dtype, backend="eager")


def _dequantize_fake(weight, weight_scale, group_size, dtype):
    return weight.new_empty(weight.shape, dtype=dtype)


def _dequantize_cuda(weight, weight_scale, group_size, dtype):
    return kernels.dequantize_weight(weight, weight_scale, group_size, dtype, backend="auto")


_define("convrot_int8_dequantize", "(Tensor weight, Tensor weight_scale, int group_size, ScalarType dtype) -> Tensor",
        _dequantize, _dequantize_cuda, _dequantize_fake)


# --------------------------------------------------------------------------------------------------------------------
# convrot_int8_linear_codes (no autograd: compiled inference blocks only)
# --------------------------------------------------------------------------------------------------------------------
def _linear_codes(x_q, x_scale, weight, weight_scale, bias, dtype):
    return kernels.int8_gemm(x_q, x_scale, weight, weight_scale, bias, dtype, "eager")


def _linear_codes_fake(x_q, x_scale, weight, weight_scale, bias, dtype):
    return x_q.new_empty((x_q.shape[0], weight.shape[0]), dtype=dtype)


def _linear_codes_cuda(x_q, x_scale, weight, weight_scale, bias, dtype):
    return kernels.int8_gemm(x_q, x_scale, weight, weight_scale, bias, dtype, "auto")


_define("convrot_int8_linear_codes",
        "(Tensor x_q, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor? bias, ScalarType dtype) -> Tensor",
        _linear_codes, _linear_codes_cuda, _linear_codes_fake)


QUANTIZE = torch.ops.moss_image.convrot_int8_quantize.default
QUANTIZE_SEGMENTS = torch.ops.moss_image.convrot_int8_quantize_segments.default
LINEAR = torch.ops.moss_image.convrot_int8_linear.default
LINEAR_CODES = torch.ops.moss_image.convrot_int8_linear_codes.default
LINEAR_GRAD_INPUT = torch.ops.moss_image.convrot_int8_linear_grad_input.default
DEQUANTIZE = torch.ops.moss_image.convrot_int8_dequantize.default


class QuantizedRows(NamedTuple):
    """An activation [*lead_shape, K] of `dtype` given only as the ConvRot INT8 codes [M, K] and fp32 scales [M] of its
    rows, as ``convrot_int8_quantize`` makes them: what a compiled inference block's producer writes for int8 Linears
    that read nothing else (`library.runtime.fused_compiled`), so that the activation itself is never written."""

    codes: torch.Tensor
    scales: torch.Tensor
    lead_shape: tuple[int, ...]
    dtype: torch.dtype


def linear_from_codes(rows: QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """The int8 linear of an input given as its codes (``convrot_int8_linear_codes``): [*rows.lead_shape, N] of
    rows.dtype. No gradient: for compiled blocks traced without one."""
    out = LINEAR_CODES(rows.codes, rows.scales, weight, weight_scale, bias, rows.dtype)
    return out.view(*rows.lead_shape, weight.shape[0])


# --------------------------------------------------------------------------------------------------------------------
# One quantisation per input in compiled inference graphs
# --------------------------------------------------------------------------------------------------------------------
VIEW_OPS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
             torch.ops.aten.alias.default, torch.ops.aten.detach.default)


def _hashable(value: object) -> object:
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value


def input_key(node: object) -> tuple:
    """A QUANTIZE input as (base node, the view ops from it): two views of one tensor with the same shape match."""
    chain = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in VIEW_OPS:
        chain.append((node.target, _hashable(node.args[1:]), _hashable(tuple(sorted(node.kwargs.items())))))
        node = node.args[0]
    return node, tuple(reversed(chain))


def dedupe_quantize(graph: torch.fx.Graph) -> int:
    """Keep one ``convrot_int8_quantize`` per distinct input in a functional (post-grad) graph: later calls on the
    same tensor reuse the first one's outputs. Returns the number of calls removed.

    The training graph needs no help (the partitioner's common-subexpression elimination already merges them); a
    compiled inference graph would otherwise rotate and quantise one block input once for each of q, k and v."""
    seen: dict[tuple, torch.fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not QUANTIZE:
            continue
        key = (input_key(node.args[0]), _hashable(node.args[1:]), _hashable(tuple(sorted(node.kwargs.items()))))
        first = seen.setdefault(key, node)
        if first is node:
            continue
        source = node.args[0]
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        removed += 1
        while isinstance(source, torch.fx.Node) and source.target in VIEW_OPS and not source.users:
            parent = source.args[0]
            graph.erase_node(source)
            source = parent
    return removed


@functools.cache
def _dedupe_pass_type() -> type:
    """The inductor pass class, made at the first compile: torch._inductor (with torch._dynamo, seconds to import) is
    loaded only when something compiles."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _DedupeQuantizePass(CustomGraphPass):
        """`dedupe_quantize` as an inductor post-grad pass, followed by the pass that was configured before it."""

        def __init__(self, then: Any = None):
            self.then = then

        def __call__(self, graph: torch.fx.Graph) -> None:
            dedupe_quantize(graph)
            if self.then is not None:
                self.then(graph)

        def uuid(self) -> Any:
            then = self.then.uuid() if isinstance(self.then, CustomGraphPass) else self.then
            return ("moss_image.convrot_int8_quantize dedupe", 1, then)

    return _DedupeQuantizePass


def enable_inductor_quantize_dedupe() -> None:
    """Install `dedupe_quantize` as inductor's ``post_grad_custom_pre_pass`` (idempotent; a pass set before runs
    after it). It touches only ``convrot_int8_quantize`` nodes, so other graphs compile as before."""
    import torch._inductor.config as inductor_config  # heavy (torch._dynamo with it): only a compile needs it

    pass_type = _dedupe_pass_type()
    current = inductor_config.post_grad_custom_pre_pass
    if not isinstance(current, pass_type):
        inductor_config.post_grad_custom_pre_pass = pass_type(current)


# --------------------------------------------------------------------------------------------------------------------
# Entry points for the modules
# --------------------------------------------------------------------------------------------------------------------
class _OpLinear(torch.autograd.Function):
    """The autograd formula around the registered ops (traced by torch.compile into the joint graph): grad_x through
    the frozen int8 weight by ``convrot_int8_linear_grad_input``, grad_bias only if the bias is trainable.

    The ops themselves carry no autograd registration on purpose: ``torch.library.register_autograd`` puts a Python
    kernel in front of the op that runs on every call of a compiled graph, with or without grad (about 10 us of host
    time against 2-3 us for the bare op, on this project's CPU measurements), and a compiled ConvRot INT8 training
    step calls the linear about 460 times. Inside a compiled graph the forward and the backward ops run under
    no_grad, through the dispatcher's C++ fallback."""

    @staticmethod
    def forward(ctx, x, x_q, x_scale, weight, weight_scale, bias, group_size, bwd):  # type: ignore[override]
        _save_for_backward(ctx, weight, weight_scale, bias, group_size, bwd)
        return LINEAR(x, x_q, x_scale, weight, weight_scale, bias, group_size, bwd)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        weight, weight_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = LINEAR_GRAD_INPUT(grad, weight, weight_scale, ctx.group_size, ctx.bwd)
        if ctx.needs_input_grad[5]:
            grad_bias = _bias_grad(grad, ctx.bias_dtype)
        return grad_x, None, None, None, None, grad_bias, None, None


def _save_for_backward(ctx: Any, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                       group_size: int, bwd: str) -> None:
    """What both autograd formulae keep: the frozen weight and its scales (nothing of the input)."""
    ctx.save_for_backward(weight, weight_scale)
    ctx.group_size = group_size
    ctx.bwd = bwd
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _needs_grad(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))


def linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, group_size: int,
    bwd: str,
) -> torch.Tensor:
    """The int8 linear through the registered ops (what torch.compile traces), differentiable in `x` and `bias`.
    The quantisation is not differentiable; its input is detached so that autograd sees only the linear's
    formula."""
    x_q, x_scale = QUANTIZE(x.detach().reshape(-1, x.shape[-1]), group_size)
    if _needs_grad(x, bias):
        return _OpLinear.apply(x, x_q, x_scale, weight, weight_scale, bias, group_size, bwd)
    return LINEAR(x, x_q, x_scale, weight, weight_scale, bias, group_size, bwd)


class _EagerLinear(torch.autograd.Function):
    """The eager autograd formula (the same as `_OpLinear`'s, without the dispatcher): grad_x through the frozen int8
    weight, and grad_bias only if someone made the bias trainable."""

    @staticmethod
    def forward(ctx, x, weight, weight_scale, bias, group_size, bwd, plans):  # type: ignore[override]
        _save_for_backward(ctx, weight, weight_scale, bias, group_size, bwd)
        ctx.plans = plans
        return eager_forward(x, weight, weight_scale, bias, group_size, plans)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        weight, weight_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            if ctx.plans is not None:
                grad_x = ctx.plans.grad_input(grad, weight, weight_scale, ctx.group_size, ctx.bwd)
            else:
                grad_x = kernels.int8_linear_grad_input(grad, weight, weight_scale, ctx.group_size, ctx.bwd)
        if ctx.needs_input_grad[3]:
            grad_bias = _bias_grad(grad, ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None, None, None


def eager_forward(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                  group_size: int, plans: LinearPlans | None) -> torch.Tensor:
    """The int8 product without autograd, from `plans` where given (the eager forward's launches)."""
    if plans is not None:
        return plans.forward(x, weight, weight_scale, bias, group_size)
    return kernels.linear_forward(x, weight, weight_scale, bias, group_size)


def linear_eager(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, group_size: int,
    bwd: str, plans: LinearPlans | None = None,
) -> torch.Tensor:
    """The int8 linear in eager mode: an autograd node only when a gradient can flow (x or the bias needs one).
    `plans`: the calling module's launch plans (`library.quant.linear_plan`), which replay the forward's launches."""
    if _needs_grad(x, bias):
        return _EagerLinear.apply(x, weight, weight_scale, bias, group_size, bwd, plans)
    return eager_forward(x, weight, weight_scale, bias, group_size, plans)


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight in the original basis in `dtype` (through the registered op when compiling)."""
    if torch.compiler.is_compiling():
        return DEQUANTIZE(weight, weight_scale, group_size, dtype)
    return kernels.dequantize_weight(weight, weight_scale, group_size, dtype)
