"""Block swap (`--blocks_to_swap N`): keep only part of a homogeneous stack of transformer blocks on the GPU.

Layout. Of the N blocks, R = N - S stay on the GPU (S = blocks to swap). R - k of them never move ("permanent");
the other S + k ("streamed") live in one host arena (pinned with cudaHostRegister unless
`--no_pinned_memory_for_block_swap`: exact size, no power-of-two rounding) and pass through a ring of k GPU slots
(k = 2 by default). The streamed blocks are spread evenly over the stack, first and last block included, so the copy
engine works while the permanent blocks compute. Every parameter and buffer of a block moves, as one contiguous
copy: int8 weights and their fp32 scales (ConvRot) always travel together. GPU memory stays flat: the slots are
allocated once.

Schedule (q = position of a block among the streamed ones, M = S + k streamed blocks):
- armed (before a forward): the ring holds streamed[0..k-1];
- forward: before block i runs, the compute stream waits on the event of its copy; once streamed[q] is done, its slot
  receives streamed[q + k] (on side streams, after an event of the compute stream). A pass without gradients
  wraps around (streamed[(q + k) mod M]) and so ends armed; a pass with gradients ends holding the last k;
- backward (the block output carries a marker node): when gradients reach block i, each streamed block above i has
  finished its backward; its slot receives the block k positions below it, and block i is waited for. The backward
  ends armed again. A forward that finds the ring not armed (no backward ran, or a partial one) re-arms first.
Loads per training step: 2S (the same as swapping pairs of blocks); per forward without gradients: S + k.

Two modes: the default writes each block back to the host (device-to-host) before its slot is reused; `h2d_only`
(`--block_swap_h2d_only`, frozen base weights) never writes back, which halves the bus traffic. With gradients both
need gradient checkpointing: the slots are reused, so weights saved by autograd would be overwritten.

On a CPU device block swap saves nothing and is refused; `BlockSwapConfig(allow_cpu_for_tests=True)` runs the same
bookkeeping with CPU "slots" (synchronous copies) so that the schedule and the numerics can be tested anywhere.
"""

from __future__ import annotations

import argparse
import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from library.errors import UserError

logger = logging.getLogger(__name__)

BLOCKS_KEPT_ON_GPU = 2  # at least this many blocks never leave the GPU (sd-scripts' limit: N - 2)
MOSS_IMAGE_NUM_LAYERS = 42
DEFAULT_RING_SLOTS = 2
_ALIGN = 256  # byte alignment of each tensor inside a block's flat buffer


# ---------------------------------------------------------------------------------------------- configuration
@dataclass
class BlockSwapConfig:
    """How the blocks are swapped. `supports_backward=False` (inference) never inserts backward markers."""

    device: torch.device
    h2d_only: bool = False
    use_pinned_memory: bool = True
    supports_backward: bool = True
    ring_slots: int = DEFAULT_RING_SLOTS
    allow_cpu_for_tests: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace, device: str | torch.device, supports_backward: bool = True
                  ) -> BlockSwapConfig:
        return cls(
            device=torch.device(device),
            h2d_only=args.block_swap_h2d_only,
            use_pinned_memory=not args.no_pinned_memory_for_block_swap,
            supports_backward=supports_backward,
        )


def max_blocks_to_swap(num_layers: int) -> int:
    return num_layers - BLOCKS_KEPT_ON_GPU


def check_blocks_to_swap(num_blocks: int, num_layers: int = MOSS_IMAGE_NUM_LAYERS) -> None:
    """The range check of --blocks_to_swap against the depth of the model."""
    if num_blocks < 0:
        raise UserError(f"--blocks_to_swap {num_blocks} is negative: give the number of DiT blocks to swap (1 to"
                        f" {max_blocks_to_swap(num_layers)}), or leave it out.")
    if num_blocks > max_blocks_to_swap(num_layers):
        raise UserError(f"--blocks_to_swap {num_blocks} is too large: the DiT has {num_layers} blocks and"
                        f" {BLOCKS_KEPT_ON_GPU} must stay on the GPU, so use at most {max_blocks_to_swap(num_layers)}.")


def check_block_swap_device(device: str | torch.device, num_processes: int = 1) -> None:
    """Block swap moves blocks between host memory and one CUDA device (per process under DDP)."""
    if torch.device(device).type != "cuda":
        raise UserError("--blocks_to_swap needs a CUDA device: on the CPU every block is already in host memory, so"
                        " drop --blocks_to_swap.")
    if num_processes > 1:
        # each process swaps the blocks of its own GPU and keeps its own host copy of the swapped blocks (the LoRA
        # gradients are averaged outside the model, so the frozen weights moving never meet a DDP reducer)
        logger.info("block swap in each of the %d processes: every process holds its own host copy of the swapped"
                    " blocks (host RAM scales with the number of processes)", num_processes)


def check_block_swap_args(args: argparse.Namespace, training: bool = True, device: str | None = None) -> None:
    """Argument checks of --blocks_to_swap (and, in training, --block_swap_h2d_only / --no_pinned_memory_for_block_swap
    and the offloading options) before any loading; they change nothing (in training,
    `library.options.implications` has turned --gradient_checkpointing on for the default swap mode). `device`: the
    device of an inference run (default: CUDA when available)."""
    n = args.blocks_to_swap or 0
    if n < 0:
        check_blocks_to_swap(n)
    if not n:
        if training and (args.block_swap_h2d_only or args.no_pinned_memory_for_block_swap):
            flag = "--block_swap_h2d_only" if args.block_swap_h2d_only else "--no_pinned_memory_for_block_swap"
            raise UserError(f"{flag} only applies to block swap: add --blocks_to_swap N (1 to"
                            f" {max_blocks_to_swap(MOSS_IMAGE_NUM_LAYERS)}) or drop {flag}.")
        return
    check_blocks_to_swap(n)
    if not training:
        check_block_swap_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return
    if args.cpu_offload_checkpointing:
        raise UserError("--blocks_to_swap is not supported with --cpu_offload_checkpointing: use one of them.")
    if args.unsloth_offload_checkpointing:
        raise UserError("--blocks_to_swap is not supported with --unsloth_offload_checkpointing: use one of them.")
    if not args.gradient_checkpointing:
        if args.block_swap_h2d_only:
            raise UserError("--block_swap_h2d_only requires --gradient_checkpointing (the GPU ring buffer is reused,"
                            " so the blocks must be recomputed in backward): add --gradient_checkpointing.")
        raise UserError("--blocks_to_swap in training needs --gradient_checkpointing (a swapped block's weights leave"
                        " the GPU before backward, so its activations are recomputed): add --gradient_checkpointing.")
    check_block_swap_device("cuda" if torch.cuda.is_available() else "cpu", int(os.environ.get("WORLD_SIZE", "1")))


# ------------------------------------------------------------------------------------------------ block layout
@dataclass(frozen=True)
class _Slot:
    """Where one tensor of a block lives inside the block's flat byte buffer."""

    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class BlockLayout:
    """The tensors of one block (every parameter and buffer) packed into one aligned byte buffer."""

    entries: list[_Slot] = field(default_factory=list)
    nbytes: int = 0

    @staticmethod
    def of(block: nn.Module) -> BlockLayout:
        layout = BlockLayout()
        for name, t in block_tensors(block):
            size = t.numel() * t.element_size()
            layout.entries.append(_Slot(name, layout.nbytes, size, t.dtype, tuple(t.shape)))
            layout.nbytes += -(-size // _ALIGN) * _ALIGN
        return layout

    def describe_mismatch(self, other: BlockLayout) -> str | None:
        if len(self.entries) != len(other.entries):
            return f"{len(other.entries)} tensors instead of {len(self.entries)}"
        for a, b in zip(self.entries, other.entries):
            if (a.name, a.dtype, a.shape) != (b.name, b.dtype, b.shape):
                return f"'{b.name}' {b.dtype} {list(b.shape)} where block 0 has '{a.name}' {a.dtype} {list(a.shape)}"
        return None

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of a flat uint8 buffer, one per tensor of the block."""
        return [flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries]


def block_tensors(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of a block, in a fixed order (duplicates once)."""
    seen: set[int] = set()
    out = []
    for name, t in [*block.named_parameters(), *block.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def spread_positions(count: int, total: int) -> list[int]:
    """`count` indices of 0..total-1 spread evenly, the first and the last included."""
    if count >= total:
        return list(range(total))
    if count == 1:
        return [0]
    return sorted({round(j * (total - 1) / (count - 1)) for j in range(count)})


# ------------------------------------------------------------------------------------------ streams and events
class _Copier:
    """Two side CUDA streams (device-to-host write-backs and host-to-device loads, so that the two directions of the
    bus work at once) and events; on the CPU (tests) every copy is synchronous and the events are None."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.load_stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.store_stream = torch.cuda.Stream(device=device) if self.cuda else None

    def compute_event(self) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def wait_on_compute(self, ev: Any) -> None:
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def _on(self, stream: Any, after: Sequence[Any], dst: torch.Tensor, src: torch.Tensor) -> Any:
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(stream):
            for ev in after:
                if ev is not None:
                    stream.wait_event(ev)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def store(self, after: Sequence[Any], host: torch.Tensor, slot: torch.Tensor) -> Any:
        """host <- slot on the write-back stream once the events `after` are reached; returns its event."""
        return self._on(self.store_stream, after, host, slot)

    def load(self, after: Sequence[Any], slot: torch.Tensor, host: torch.Tensor) -> Any:
        """slot <- host on the load stream once the events `after` are reached; returns its event."""
        return self._on(self.load_stream, after, slot, host)

    def synchronize(self) -> None:
        if self.cuda:
            self.load_stream.synchronize()
            self.store_stream.synchronize()


def _pin(flat: torch.Tensor) -> bool:
    """Page-lock a host buffer in place (exact size). False (with a warning) when the driver refuses."""
    err = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 1))
    if err != 0:
        logger.warning("block swap: could not pin %.2f GiB of host memory (cudaError %d); using pageable memory,"
                       " which makes the copies synchronous", flat.numel() / 2**30, err)
        return False
    return True


def _unpin(flat: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
    except (RuntimeError, AttributeError) as e:  # at interpreter shutdown the driver may be gone already
        logger.debug("block swap: unpinning the host copies failed: %s", e)


# ------------------------------------------------------------------------------------------------- the offloader
class _BackwardMarker(torch.autograd.Function):
    """Identity on a block's output; its backward runs just before the block's own backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offloader: ModelOffloader, index: int  # type: ignore[override]
                ) -> torch.Tensor:
        ctx.offloader = offloader
        ctx.index = index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.offloader.on_backward(ctx.index)
        return grad, None, None


class ModelOffloader:
    """Swaps the blocks of a homogeneous ModuleList between host memory and a GPU ring buffer (see module doc)."""

    def __init__(self, blocks: Sequence[nn.Module], blocks_to_swap: int, config: BlockSwapConfig, name: str = "DiT"):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_blocks = n = len(blocks)
        check_blocks_to_swap(blocks_to_swap, n)
        if blocks_to_swap < 1:
            raise UserError(f"--blocks_to_swap {blocks_to_swap}: give 1 or more blocks to swap, or leave it out.")
        if self.device.type != "cuda" and not config.allow_cpu_for_tests:
            check_block_swap_device(self.device)
        self.blocks_to_swap = blocks_to_swap
        resident = n - blocks_to_swap
        self.ring = min(max(config.ring_slots, 2), resident)
        self.streamed = spread_positions(blocks_to_swap + self.ring, n)
        self.position = {b: q for q, b in enumerate(self.streamed)}
        self.layout = self._check_homogeneous(blocks)
        self._check_frozen(blocks, name)
        self.tensors = {b: [t for _, t in block_tensors(blocks[b])] for b in self.streamed}
        self.copier = _Copier(self.device)
        self._make_host_copies()
        self.slots = [torch.empty(self.layout.nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.ring)]
        self.slot_views = [self.layout.views(s) for s in self.slots]
        self.slot_of: dict[int, int | None] = {b: None for b in self.streamed}
        self.block_in_slot: list[int | None] = [None] * self.ring
        self._ready: dict[int, Any] = {}  # block -> event of its load into a slot
        self._stored: dict[int, Any] = {}  # block -> event of its last write-back to the host
        self._backward_pass = False
        self._checkpointing = False
        self._release_pos = len(self.streamed) - 1
        self.loads = 0
        self.write_backs = 0
        for s in range(self.ring):
            self._move(self.streamed[s], s)
        logger.info(
            "block swap (%s): %d of %d blocks swapped, %d GPU slots (%d blocks fixed + ring of %d), %.1f MiB per"
            " block, host %.2f GiB (%s), %s", name, blocks_to_swap, n, resident, resident - self.ring, self.ring,
            self.layout.nbytes / 2**20, self.host.numel() / 2**30, "pinned" if self.pinned else "pageable",
            "host-to-device only" if config.h2d_only else "with device-to-host write-back",
        )

    # ----------------------------------------------------------------------------------------------- setup
    @staticmethod
    def _check_homogeneous(blocks: Sequence[nn.Module]) -> BlockLayout:
        layout = BlockLayout.of(blocks[0])
        for i, block in enumerate(blocks[1:], start=1):
            diff = layout.describe_mismatch(BlockLayout.of(block))
            if diff:
                raise ValueError(f"block swap needs identical blocks, but block {i} differs from block 0: {diff}")
        return layout

    def _check_frozen(self, blocks: Sequence[nn.Module], name: str) -> None:
        trainable = [f"{b}.{n}" for b in self.streamed for n, p in blocks[b].named_parameters() if p.requires_grad]
        if trainable:
            raise UserError(f"Block swap needs the {name} base weights frozen (LoRA training), but {len(trainable)}"
                            f" block parameters require gradients (e.g. '{trainable[0]}'): freeze the model first.")

    def _make_host_copies(self) -> None:
        size = self.layout.nbytes
        self.host = torch.empty(size * len(self.streamed), dtype=torch.uint8)
        self.pinned = False
        if self.device.type == "cuda" and self.config.use_pinned_memory:
            self.pinned = _pin(self.host)
            if self.pinned:
                weakref.finalize(self, _unpin, self.host)
        self.host_views: dict[int, list[torch.Tensor]] = {}
        for q, b in enumerate(self.streamed):
            views = self.layout.views(self.host[q * size : (q + 1) * size])
            with torch.no_grad():
                for view, t in zip(views, self.tensors[b]):
                    view.copy_(t.detach())
                    t.data = view  # the original storage is released here
            self.host_views[b] = views

    # ----------------------------------------------------------------------------------------------- moves
    def _point(self, block: int, views: list[torch.Tensor]) -> None:
        for t, v in zip(self.tensors[block], views):
            t.data = v

    def _move(self, block: int, slot: int) -> None:
        """Load `block` into `slot`, evicting (and, unless h2d_only, writing back) the block that held it."""
        free = self.copier.compute_event()  # the compute work queued so far is the last use of the slot
        after = [free, self._stored.pop(block, None)]  # the block's host copy must be complete before it is read
        old = self.block_in_slot[slot]
        loading = self._ready.pop(old, None) if old is not None else None  # a load of `old` nobody waited for
        if old is not None and not self.config.h2d_only:
            self._stored[old] = self.copier.store([free, loading], self._host_region(old), self.slots[slot])
            after.append(self._stored[old])
            self.write_backs += 1
        self._ready[block] = self.copier.load(after, self.slots[slot], self._host_region(block))
        if old is not None:
            self._point(old, self.host_views[old])
            self.slot_of[old] = None
        self._point(block, self.slot_views[slot])
        self.slot_of[block] = slot
        self.block_in_slot[slot] = block
        self.loads += 1

    def _host_region(self, block: int) -> torch.Tensor:
        q = self.position[block]
        return self.host[q * self.layout.nbytes : (q + 1) * self.layout.nbytes]

    # ------------------------------------------------------------------------------------------- bookkeeping
    def resident_blocks(self) -> list[int]:
        """Blocks whose weights are on the device now (fixed blocks and the ring's content)."""
        fixed = [b for b in range(self.num_blocks) if b not in self.position]
        return sorted(fixed + [b for b in self.block_in_slot if b is not None])

    def is_armed(self) -> bool:
        return all(self.slot_of[b] is not None for b in self.streamed[: self.ring])

    def prepare_before_forward(self) -> None:
        """Bring the ring to its armed content (streamed[0..k-1]); a no-op when it is already there."""
        wanted = self.streamed[: self.ring]
        free = [s for s, b in enumerate(self.block_in_slot) if b not in wanted]
        for b in wanted:
            if self.slot_of[b] is None:
                self._move(b, free.pop())
        self._backward_pass = False
        self._release_pos = len(self.streamed) - 1

    def begin_forward(self, grad_enabled: bool, checkpointing: bool) -> None:
        if not self.is_armed():
            logger.debug("block swap: re-arming the ring before the forward pass")
        self.prepare_before_forward()
        self._backward_pass = grad_enabled and self.config.supports_backward
        self._checkpointing = checkpointing

    def wait_for_block(self, block: int) -> None:
        """Make the compute stream wait for `block`'s copy. Raises when the block is not on the device."""
        if block not in self.position:
            return
        if self.slot_of[block] is None:
            raise RuntimeError(
                f"block swap: block {block} is needed but is not on {self.device} (resident: {self.resident_blocks()});"
                " one backward per forward is supported, and the model must not be moved with .to() while swapping"
            )
        self.copier.wait_on_compute(self._ready.pop(block, None))

    def block_done(self, block: int, x: torch.Tensor) -> torch.Tensor:
        """After `block`'s forward: refill its slot with the block k positions ahead; mark the output for backward."""
        q = self.position.get(block)
        m = len(self.streamed)
        if q is not None:
            nxt = q + self.ring
            if not self._backward_pass:
                nxt %= m
            if nxt < m:
                slot = self.slot_of[block]
                assert slot is not None
                self._move(self.streamed[nxt], slot)
        if self._backward_pass and x.requires_grad:
            if not self._checkpointing and q is not None:
                raise RuntimeError("block swap with gradients needs gradient checkpointing: the weights of a swapped"
                                   " block leave the GPU before backward (enable gradient checkpointing)")
            x = _BackwardMarker.apply(x, self, block)
        return x

    def on_backward(self, block: int) -> None:
        """Gradients reached `block`'s output: the streamed blocks above it are done, their slots load the blocks k
        positions below; then wait for `block` itself."""
        while self._release_pos >= 0 and self.streamed[self._release_pos] > block:
            done = self.streamed[self._release_pos]
            below = self._release_pos - self.ring
            if below >= 0:
                slot = self.slot_of[done]
                if slot is None:
                    raise RuntimeError(f"block swap: block {done} left the device before its backward")
                self._move(self.streamed[below], slot)
            self._release_pos -= 1
        self.wait_for_block(block)

    def synchronize(self) -> None:
        """Wait for all copies (before reading the host copies or tearing down)."""
        self.copier.synchronize()


def place_model(model: nn.Module, device: str | torch.device, blocks_to_swap: int | None = None, **config: Any
                ) -> None:
    """Put a model with block swap support (`MossImage`) on `device`, swapping `blocks_to_swap` blocks when given
    (`config`: BlockSwapConfig fields, e.g. supports_backward=False for inference)."""
    if not blocks_to_swap:
        model.to(device)
        return
    model.requires_grad_(False)
    model.enable_block_swap(blocks_to_swap, BlockSwapConfig(device=torch.device(device), **config))
    model.move_to_device_except_swap_blocks(device)
    model.prepare_block_swap_before_forward()
