"""Merge LoRA weights into base weights at load time: W' = W + multiplier * dW.

dW is the module's weight change (`library.lora.weights`): (alpha / rank) * up @ down for a LoRA, the Hadamard
product of two low-rank pairs for a LoHa (`networks.loha`), a Kronecker product for a LoKr (`networks.lokr`); one file
may mix them, as LyCORIS files can.

The math runs in fp32 and the result is rounded once, to the dtype the model is loaded in, whatever the number of
LoRAs and whatever the checkpoint's dtype: W' = round(W_fp32 + sum_i multiplier_i * dW_i) (`merged_modules`' `dtype`;
the loaders hand the hook the weight in a dtype that holds both the checkpoint's and the model's values, so a bf16
checkpoint loaded in fp32 keeps the merge's fp32 result). The math runs on the plan's `device` when one is given
(the run's GPU; the LoRA factors are moved there once), else where the weight is; TF32 is off for it, so a GPU
merge is an fp32 merge. A weight read to the CPU (--convrot_int8, --blocks_to_swap) and merged on the GPU goes there
and back by blocks of rows through a few pinned buffers (`DeviceRoundTrip`): the copies into and out of them overlap
the transfers and the math of the block before, and the weights no LoRA targets are not touched (they stay
memory-mapped). `LoraMergePlan.times` keeps where a plan's merges spent their time (for `bench.loading`).

Streaming use (the loader reads the checkpoint tensor by tensor, no second copy of the model):

    plan = LoraMergePlan([(lora_sd, 1.0), (other_sd, 0.5)], prefix="lora_unet")
    plan.check_checkpoint_keys(source.keys(), path)       # reject a pre-quantized checkpoint before reading anything
    for key in source.keys():
        tensor = plan.merge(key, source.get_tensor(key))   # unchanged unless a LoRA targets this weight
        ...
    plan.finish()                                          # warns about LoRA modules that matched no weight

Keys given to the plan are the model's own parameter names (`layers.3.proj.q.weight` for the DiT,
`layers.3.self_attn.q_proj.weight` for the text encoder), i.e. after the loader renamed the checkpoint's keys and split
any fused tensor (a ComfyUI file's fused qkv is split into q / k / v first, then merged). LoRA files in the PEFT
naming (diffusers / ComfyUI) are accepted and converted to the sd-scripts naming first; a LoRA for a fused qkv module
is split into q / k / v the same way.

Pre-quantized weights (ConvRot INT8: an int8 `weight` with `weight_scale` / `comfy_quant`; or fp8) cannot take a
merge: the plan refuses such a checkpoint with a UserError that points to the bf16 file with --convrot_int8 (the LoRA
is merged first, then quantized).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from library.errors import UserError
from library.lora.conventions import (
    ALGORITHM_LABELS,
    ALPHA,
    LORA_DOWN,
    LORA_PREFIX_TEXT_ENCODER,
    LORA_PREFIX_UNET,
    LORA_PREFIXES,
    LORA_UP,
    group_modules,
    lora_name_for_weight,
    module_algorithm,
)
from library.lora.convert import read_lora, to_sd_scripts
from library.lora.weights import delta_shape, delta_weight, module_scale
from library.runtime.compile import exact_fp32_matmul

logger = logging.getLogger(__name__)

PREFIXES = LORA_PREFIXES
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_KEY_SUFFIXES = (".weight_scale", ".comfy_quant", ".scale_weight")
_QUANT_OPTION = {
    LORA_PREFIX_UNET: ("DiT", "--convrot_int8"),
    LORA_PREFIX_TEXT_ENCODER: ("text encoder", "--convrot_int8_text_encoder"),
}

LoraFactor = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | float | None", float]  # (down, up, alpha, multiplier)
ModuleParts = Mapping[str, torch.Tensor]  # one module's tensors by suffix (lora_down.weight / hada_w1_a / ...)
CPU_MERGE_BLOCK = 1 << 18  # fp32 elements per block of rows in a CPU merge (1 MiB: stays in the cache)
ROUND_TRIP_BYTES = 8 * 2**20  # bytes of one pinned buffer of a CPU weight merged on a GPU (a few blocks per weight)
ROUND_TRIP_SLOTS = 2  # blocks in flight: the next block is copied in while the device merges this one
RowUpdate = Callable[[torch.Tensor, int, int], None]  # (fp32 block of rows, first row, end row): adds one module


def merged_weight(weight: torch.Tensor, factors: Sequence[LoraFactor], key: str = "weight") -> torch.Tensor:
    """weight + sum(multiplier * alpha / rank * up @ down), computed in fp32 on the weight's device, cast back once."""
    modules = []
    for down, up, alpha, multiplier in factors:
        parts = {LORA_DOWN: down, LORA_UP: up}
        if alpha is not None:
            parts[ALPHA] = alpha if isinstance(alpha, torch.Tensor) else torch.tensor(float(alpha))
        modules.append((parts, multiplier))
    return merged_modules(weight, modules, key)


def merged_modules(
    weight: torch.Tensor, modules: Sequence[tuple[ModuleParts, float]], key: str = "weight",
    dtype: torch.dtype | None = None, round_trip: DeviceRoundTrip | None = None,
) -> torch.Tensor:
    """weight + sum(multiplier * dW) over LoRA / LoHa / LoKr modules (`library.lora.weights`), in fp32 on the weight's
    device, rounded once to `dtype` (default: the weight's); the weight (cast to `dtype`) when every multiplier is 0.
    With `round_trip`, a CPU weight is merged on its device by blocks of rows and comes back to the CPU."""
    active = [(parts, float(m)) for parts, m in modules if m != 0]
    dtype = dtype or weight.dtype
    if not active:
        return weight.to(dtype)
    if weight.dim() != 2:
        raise UserError(
            f"LoRA targets '{key}' of shape {tuple(weight.shape)}: only Linear (2-D) weights can be merged."
        )
    algorithms = [module_algorithm(parts, key) for parts, _ in active]
    for algorithm, (parts, _) in zip(algorithms, active):
        _check_fits(algorithm, parts, weight, key)
    if round_trip is not None and weight.device.type == "cpu":
        with exact_fp32_matmul(round_trip.device):
            return round_trip.merge(weight, _row_updates(active, algorithms, round_trip.device), dtype)
    if weight.device.type == "cpu" and set(algorithms) == {"lora"}:
        return _merge_lora_rows(weight, active, dtype)
    result = weight.to(dtype=torch.float32, copy=True)
    with exact_fp32_matmul(result.device):
        for algorithm, (parts, multiplier) in zip(algorithms, active):
            if algorithm == "lora":  # one fused multiply-add, no full-size temporary
                up32 = parts[LORA_UP].to(result.device, torch.float32)
                down32 = parts[LORA_DOWN].to(result.device, torch.float32)
                result.addmm_(up32, down32, alpha=multiplier * module_scale(algorithm, parts))
            else:
                result.add_(delta_weight(parts, algorithm, result.device), alpha=multiplier)
    return result.to(dtype)


def _row_updates(active: Sequence[tuple[ModuleParts, float]], algorithms: Sequence[str], device: torch.device
                 ) -> list[RowUpdate]:
    """Per module, the fp32 multiply-add of its change into a block of rows, on `device`: a LoRA's up rows times
    down; a LoHa's or LoKr's change is made once, whole, and added row block by row block (the same math per element
    as the whole-tensor merge)."""
    updates: list[RowUpdate] = []
    for algorithm, (parts, multiplier) in zip(algorithms, active):
        if algorithm == "lora":
            up32 = parts[LORA_UP].to(device, torch.float32)
            down32 = parts[LORA_DOWN].to(device, torch.float32)
            scale = multiplier * module_scale(algorithm, parts)
            updates.append(lambda block, s, e, up=up32, down=down32, a=scale: block.addmm_(up[s:e], down, alpha=a))
        else:
            delta = delta_weight(parts, algorithm, device)
            updates.append(lambda block, s, e, d=delta, m=multiplier: block.add_(d[s:e], alpha=m))
    return updates


def _merge_lora_rows(weight: torch.Tensor, active: Sequence[tuple[ModuleParts, float]], dtype: torch.dtype
                     ) -> torch.Tensor:
    """The LoRA merge on the CPU, `CPU_MERGE_BLOCK` elements of rows at a time: each block goes to fp32, takes every
    module's multiply-add and is rounded into the result while it is in the cache (1.8x faster than whole-tensor
    passes for a 3072 x 12288 bf16 weight); the same math per element, one rounding."""
    factors = [(parts[LORA_UP].float(), parts[LORA_DOWN].float(), multiplier * module_scale("lora", parts))
               for parts, multiplier in active]
    out = torch.empty(weight.shape, dtype=dtype)
    rows = max(1, CPU_MERGE_BLOCK // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        block = weight[start : start + rows].to(torch.float32, copy=True)
        for up32, down32, scale in factors:
            block.addmm_(up32[start : start + rows], down32, alpha=scale)
        out[start : start + rows] = block
    return out


@dataclass
class MergeTimes:
    """Where a plan's merges spent the host's time (seconds; for `bench.loading`): `merge_s` all of it (a merge on
    the weight's own GPU only queues work), and of the CPU weights merged on a GPU (`round_trips` of them) the copies
    into the pinned buffers, the waits for the device and the copies out of them."""

    merges: int = 0
    round_trips: int = 0
    merge_s: float = 0.0
    copy_in_s: float = 0.0
    device_wait_s: float = 0.0
    copy_out_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


class DeviceRoundTrip:
    """A CPU weight merged on `device` and brought back, by blocks of rows through `ROUND_TRIP_SLOTS` pinned buffers
    each way (allocated once, kept while the plan lives; plain buffers when `device` is the CPU, as in the tests).

    Per block: its rows are copied into an in-buffer (the host's one copy of the weight, from its memory map), sent
    with an asynchronous copy, widened to fp32, given every module's multiply-add, rounded to the result dtype and
    sent back into an out-buffer with another asynchronous copy; while the device does that, the host copies the
    block before out of its out-buffer into the result. A buffer is refilled once the copy that used it is done (a
    CUDA event), so the host never waits for a transfer that it could overlap."""

    def __init__(self, device: torch.device, buffer_bytes: int = ROUND_TRIP_BYTES, slots: int = ROUND_TRIP_SLOTS,
                 times: MergeTimes | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots = max(2, slots)  # a block comes back out of its buffer before the block after next goes in
        self.times = times if times is not None else MergeTimes()
        self._bytes = 0
        self._in: list[torch.Tensor] = []
        self._out: list[torch.Tensor] = []
        self._sent = [torch.cuda.Event() if self.cuda else None for _ in range(self.slots)]  # in-buffer sent
        self._back = [torch.cuda.Event() if self.cuda else None for _ in range(self.slots)]  # out-buffer filled
        self._grow(buffer_bytes)

    def _grow(self, nbytes: int) -> None:
        """Buffers of at least `nbytes` (a weight whose single row is larger than the default needs bigger ones)."""
        if nbytes <= self._bytes:
            return
        for event in (*self._sent, *self._back):
            if event is not None:
                event.synchronize()
        self._bytes = nbytes
        self._in = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(self.slots)]
        self._out = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(self.slots)]

    @staticmethod
    def _rows(buffer: torch.Tensor, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
        return buffer[: rows * cols * dtype.itemsize].view(dtype).view(rows, cols)

    def _wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            start = time.perf_counter()
            event.synchronize()  # releases the GIL; an event never recorded is done
            self.times.device_wait_s += time.perf_counter() - start

    def _record(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.record(torch.cuda.current_stream(self.device))

    def merge(self, weight: torch.Tensor, updates: Sequence[RowUpdate], dtype: torch.dtype) -> torch.Tensor:
        """`weight` (2-D, on the CPU) with `updates` applied in fp32 on the device, rounded once to `dtype`, as a new
        CPU tensor."""
        rows_total, cols = weight.shape
        row_bytes = cols * max(weight.element_size(), dtype.itemsize)
        self._grow(row_bytes)
        step = max(1, self._bytes // max(1, row_bytes))
        out = torch.empty(weight.shape, dtype=dtype)
        self.times.round_trips += 1
        back: tuple[int, int, int] | None = None  # (slot, first row, end row) of the block on its way back
        for index, start in enumerate(range(0, rows_total, step)):
            end = min(start + step, rows_total)
            slot = index % self.slots
            self._wait(self._sent[slot])
            began = time.perf_counter()
            host_in = self._rows(self._in[slot], weight.dtype, end - start, cols)
            host_in.copy_(weight[start:end])
            self.times.copy_in_s += time.perf_counter() - began
            block = host_in.to(self.device, non_blocking=True)
            self._record(self._sent[slot])
            block = block.to(torch.float32, copy=not self.cuda)  # the CPU's (tests) must not write the in-buffer
            for update in updates:
                update(block, start, end)
            self._rows(self._out[slot], dtype, end - start, cols).copy_(block.to(dtype), non_blocking=True)
            self._record(self._back[slot])
            if back is not None:
                self._bring_back(back, out)
            back = (slot, start, end)
        if back is not None:
            self._bring_back(back, out)
        return out

    def _bring_back(self, block: tuple[int, int, int], out: torch.Tensor) -> None:
        slot, start, end = block
        self._wait(self._back[slot])
        began = time.perf_counter()
        out[start:end].copy_(self._rows(self._out[slot], out.dtype, end - start, out.shape[1]))
        self.times.copy_out_s += time.perf_counter() - began


def _check_fits(algorithm: str, parts: ModuleParts, weight: torch.Tensor, key: str) -> None:
    if algorithm == "lora":
        up, down = parts[LORA_UP], parts[LORA_DOWN]
        fits = up.dim() == 2 and down.dim() == 2 and up.shape[1] == down.shape[0]
        if not fits or (up.shape[0], down.shape[1]) != tuple(weight.shape):
            raise UserError(
                f"LoRA for '{key}' has up {tuple(up.shape)} / down {tuple(down.shape)}, which does not fit the weight"
                f" {tuple(weight.shape)}: the LoRA was trained for another model size."
            )
        return
    shape = delta_shape(algorithm, parts)
    if shape != tuple(weight.shape):
        label = ALGORITHM_LABELS[algorithm]
        raise UserError(
            f"{label} for '{key}' makes a change of shape {shape}, which does not fit the weight {tuple(weight.shape)}:"
            f" the {label} was trained for another model size."
        )


def is_quantized_key(key: str) -> bool:
    """True for side tensors of quantized layers (ConvRot INT8 `weight_scale` / `comfy_quant`, fp8 `scale_weight`)."""
    return key.endswith(QUANTIZED_KEY_SUFFIXES)


def reject_quantized_weight(
    key: str, tensor: torch.Tensor | None, prefix: str, source: str | os.PathLike | None = None
) -> None:
    """UserError when `key` / `tensor` belong to a pre-quantized checkpoint (a LoRA cannot be merged into it)."""
    dtype = tensor.dtype if tensor is not None else None
    if not is_quantized_key(key) and dtype not in QUANTIZED_DTYPES:
        return
    model, option = _QUANT_OPTION.get(prefix, ("model", "--convrot_int8"))
    where = f" '{source}'" if source else ""
    what = f"'{key}' is {str(dtype).replace('torch.', '')}" if dtype in QUANTIZED_DTYPES else f"it has '{key}'"
    raise UserError(
        f"Cannot merge a LoRA into the pre-quantized {model} checkpoint{where} ({what}): use the bf16 {model} file"
        f" with {option} instead (the LoRA is merged first, then quantized)."
    )


@dataclass
class _Module:
    parts: ModuleParts
    multiplier: float
    source: int
    on_device: dict[torch.device, ModuleParts] = field(default_factory=dict)

    def parts_on(self, device: torch.device) -> ModuleParts:
        """The tensors on `device` in fp32 (the scalar alpha stays where it is), moved once per device."""
        if device.type == "cpu":
            return self.parts
        if device not in self.on_device:
            self.on_device[device] = {
                k: v if k == ALPHA else v.to(device, torch.float32, non_blocking=True) for k, v in self.parts.items()
            }
        return self.on_device[device]


def _lora_modules(sd: Mapping[str, torch.Tensor], name: str) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    if not sd:
        raise UserError(f"The LoRA {name} has no tensors: it is empty or not a LoRA file.")
    return group_modules(to_sd_scripts(sd), name)


class LoraMergePlan:
    """The LoRA modules of one model part (`prefix` "lora_unet" for the DiT, "lora_te" for the text encoder)."""

    def __init__(
        self,
        loras: Sequence[tuple[Mapping[str, torch.Tensor], float]],
        prefix: str,
        names: Sequence[str] | None = None,
        device: str | torch.device | None = None,
    ):
        if prefix not in PREFIXES:
            raise ValueError(f"prefix must be one of {PREFIXES}, got {prefix!r}")
        self.prefix = prefix
        self.device = _usable_device(device)
        self.names = list(names) if names is not None else [f"#{i + 1}" for i in range(len(loras))]
        self._modules: dict[str, list[_Module]] = {}
        for index, (sd, multiplier) in enumerate(loras):
            label = self.names[index] if index < len(self.names) else f"#{index + 1}"
            for (module_prefix, module), parts in _lora_modules(sd, label).items():
                if module_prefix != prefix:
                    continue
                entry = _Module(parts, float(multiplier), index)
                self._modules.setdefault(f"{prefix}_{module}", []).append(entry)
        self._matched: set[str] = set()
        self.times = MergeTimes()
        self._round_trip: DeviceRoundTrip | None = None

    @property
    def is_empty(self) -> bool:
        return not self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def lora_name(self, model_key: str) -> str | None:
        """`layers.3.proj.q.weight` -> `lora_unet_layers_3_proj_q` (None for keys that are not a weight)."""
        return lora_name_for_weight(self.prefix, model_key)

    def targets(self, model_key: str) -> bool:
        name = self.lora_name(model_key)
        return name is not None and name in self._modules

    def check_checkpoint_keys(
        self,
        keys: Iterable[str],
        source: str | os.PathLike | None = None,
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        """Before reading tensors: refuse a pre-quantized checkpoint when there is anything to merge."""
        if self.is_empty:
            return
        for key in keys:
            if is_quantized_key(key):
                reject_quantized_weight(key, None, self.prefix, source)
            if dtypes is not None and dtypes.get(key) in QUANTIZED_DTYPES and key.endswith(".weight"):
                reject_quantized_weight(key, torch.empty(0, dtype=dtypes[key]), self.prefix, source)

    def merge(self, model_key: str, tensor: torch.Tensor, source: str | os.PathLike | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor with every LoRA that targets `model_key` merged in, rounded once to `dtype` (default: the
        tensor's) and on the tensor's device; the same tensor when no LoRA targets it (and `dtype` is its own)."""
        if self.is_empty:
            return tensor if dtype is None else tensor.to(dtype)
        reject_quantized_weight(model_key, tensor, self.prefix, source)
        name = self.lora_name(model_key)
        if name is None or name not in self._modules:
            return tensor if dtype is None else tensor.to(dtype)
        self._matched.add(name)
        start = time.perf_counter()
        home = tensor.device
        work = self.device or home
        modules = [(m.parts_on(work), m.multiplier) for m in self._modules[name]]
        if home.type == "cpu" and work.type != "cpu":  # there and back by blocks; the result is a new CPU tensor
            merged = merged_modules(tensor, modules, model_key, dtype, self._round_trip_to(work))
        else:
            merged = merged_modules(tensor.to(work, non_blocking=True), modules, model_key, dtype).to(home)
        self.times.merges += 1
        self.times.merge_s += time.perf_counter() - start
        return merged

    def _round_trip_to(self, device: torch.device) -> DeviceRoundTrip:
        if self._round_trip is None or self._round_trip.device != device:
            self._round_trip = DeviceRoundTrip(device, times=self.times)
        return self._round_trip

    def unmatched(self) -> list[str]:
        """LoRA modules (of this prefix) that no merged key matched so far."""
        return sorted(set(self._modules) - self._matched)

    def finish(self) -> list[str]:
        """Log a warning for the LoRA modules that matched no weight (count + examples) and return them."""
        missing = self.unmatched()
        if missing:
            logger.warning(
                "%d %s LoRA modules matched no weight of the model and were not merged (e.g. %s): the LoRA was trained"
                " for another model or another module layout",
                len(missing),
                "DiT" if self.prefix == LORA_PREFIX_UNET else "text encoder",
                ", ".join(missing[:5]),
            )
        else:
            logger.info("merged %d %s LoRA modules", len(self._modules), self.prefix)
        self._round_trip = None  # its pinned buffers go back to torch's cache of pinned memory
        return missing


def _usable_device(device: str | torch.device | None) -> torch.device | None:
    """The device to merge on: None (where each weight is) for no device, the CPU or a CUDA device without CUDA."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu" or (device.type == "cuda" and not torch.cuda.is_available()):
        return None
    return device


def load_lora_files(
    paths: Sequence[str | os.PathLike], multipliers: Sequence[float] | None = None
) -> list[tuple[dict[str, torch.Tensor], float]]:
    """Read `--lora_weight` files with their `--lora_multiplier` (none given: 1.0 each; else one per file)."""
    multipliers = list(multipliers or [])
    if multipliers and len(multipliers) != len(paths):
        raise UserError(
            f"{len(paths)} LoRA files but {len(multipliers)} multipliers: give one --lora_multiplier per --lora_weight"
            " (or none for 1.0 each)."
        )
    values = multipliers or [1.0] * len(paths)
    return [(_read_lora_file(p), float(m)) for p, m in zip(paths, values)]


def _read_lora_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A LoRA file (or PEFT save_pretrained folder); a PEFT file's alphas from its adapter config (`read_lora`)."""
    sd, _, configs = read_lora(path)
    return to_sd_scripts(sd, configs) if configs else sd


def merge_into_module(model: nn.Module, plan: LoraMergePlan) -> int:
    """Merge in place into an already built model (parameters and buffers named `*.weight`); returns merged count."""
    if plan.is_empty:
        return 0
    merged = 0
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    plan.check_checkpoint_keys([k for k, _ in tensors])
    for key, tensor in tensors:
        if not key.endswith(".weight"):
            continue
        reject_quantized_weight(key, tensor, plan.prefix)
        if plan.targets(key):
            tensor.data = plan.merge(key, tensor.data)
            merged += 1
    return merged
