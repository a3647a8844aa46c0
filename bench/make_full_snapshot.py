#!/usr/bin/env python
"""Write a MOSS-Image snapshot with deterministic random weights in the official layouts and sizes, for benchmarks:

    python -m bench.make_full_snapshot OUT_DIR [--scale full|small] [--seed N] [--what dit,te,vae,comfy]
                                       [--device auto|cpu|cuda] [--threads N] [--dry-run]

    dit    transformer/diffusion_pytorch_model-0000{1,2,3}-of-00003.safetensors, its index, config.json
    te     text_encoder/model-0000{1..4}-of-00004.safetensors, model.safetensors.index.json, config.json (the
           Qwen3.5-9B VL layout: `model.language_model.*` text weights, the `model.visual.*` vision tower of the 9B
           vision config, `lm_head.weight` and an `mtp.*` draft layer: fc, pre-fc norms, one full-attention decoder
           layer, norm); tokenizer/: the TINY byte-level tokenizer of library/moss_image/tiny_snapshot.py (400 tokens, the Qwen
           special tokens), not the real 248k-token one: its ids are valid for any vocabulary, which is all a
           benchmark needs
    vae    vae/diffusion_pytorch_model.safetensors + config.json (diffusers AutoencoderKLFlux2) and
           flux2-vae.safetensors (BFL / ComfyUI keys), fp32, the full FLUX.2 widths in both (the official vae/
           folder holds the small decoder; the loaders take either)
    comfy  moss_image_base_bf16.safetensors (fused `proj.qkv`), moss_image_base_int8_convrot.safetensors and
           text_encoder_int8/qwen3.5_9b_int8_convrot.safetensors (+ its config.json): ConvRot INT8 made by the
           project's quantiser (`quantize_convrot_weight`, group size 256, the loader's scopes: 252 block Linears;
           200 text Linears + embed_tokens), each layer quantised exactly as quantise-at-load does it (q, k and v one
           by one, then concatenated), so --convrot_int8 at load on the same device gives the same codes. Read
           back tensor by tensor from the shards in OUT_DIR (written in the same run, or before at the same scale).

Streaming: every file is planned (names, shapes, dtypes -> header) and then written tensor by tensor, big tensors in
row chunks (`bench.stream_safetensors`); the ComfyUI files read one tensor at a time from the shards (plain reads,
no mmap). Memory stays at about one tensor (the largest: the 248320 x 4096 embedding / lm_head, 1.9 GiB in bf16),
never a model. Values (per tensor, seeded by --seed and the tensor name; CPU and CUDA give different numbers) keep a
real-size model numerically sane: Linear / conv weights N(0, 1/fan_in), norm weights near 1 (the zero-centred Qwen3.5
RMSNorms near 0), biases N(0, 0.02^2), DiT scale_shift_table N(0, 0.05^2), GatedDeltaNet A_log = log U(1, 16) and
dt_bias near 1, VAE BatchNorm statistics mean N(0, 0.3^2) and var U(0.5, 2). A JSON summary (files, bytes, seconds,
peak RSS) is printed at the end; `--dry-run` prints the planned files and sizes without writing anything.

`--scale small` writes the same layouts with a small config (DiT 4 blocks of width 256, text encoder 4 layers of
hidden 256 with vocabulary 2048 and a 2-block vision tower, VAE widths 32, 32, 64, 64) for tests.

Full size, from the configs (exact byte counts: `--dry-run`, which writes nothing; 1 GB = 1e9 bytes; not run here):
    transformer/        3 shards  10.166 GB ( 9.47 GiB)  5.083B bf16 parameters
    text_encoder/       4 shards  19.306 GB (17.98 GiB)  9.653B: text 7.937B, vision 0.456B, lm_head 1.017B, MTP 0.243B
    vae/, flux2-vae.safetensors    2 x 0.336 GB           84.0M fp32 parameters each
    moss_image_base_bf16.safetensors                     10.166 GB ( 9.47 GiB)
    moss_image_base_int8_convrot.safetensors              5.415 GB ( 5.04 GiB)
    text_encoder_int8/qwen3.5_9b_int8_convrot.safetensors 7.951 GB ( 7.40 GiB)
    in all 53.68 GB (49.99 GiB): it fits the 64 GiB disk of the one-GPU machine with about 10 GiB to spare; leave out
    what a run does not need (--what dit,vae writes 10.8 GB; comfy needs the dit and te shards).
Expected time of the full run (estimated, not measured): it writes 53.7 GB and reads 36.2 GB back (the DiT shards
twice, the text weights once; from the page cache on a 128 GiB machine). With a GPU (--device auto picks it) drawing
14.7B values and quantising 12.7B weights cost seconds of GPU time and 5-15 s of host-device copies, so the
disk decides: about 1 min at 1 GB/s, 2 min at 0.5 GB/s, 3.5 min at the 0.27 GB/s this development machine's disk
managed. On the CPU alone add about 0.5-1 min on 16 cores (measured here per core: 165M values/s drawn by the torch
generator, 25-55M weights/s quantised). Peak RSS: about 1 GiB of Python, torch and transformers plus the largest
tensor in flight, the 248320 x 4096 token embedding read back for the INT8 file (1.9 GiB bf16 + 0.95 GiB int8 codes
+ fp32 row chunks), and on the CPU up to 2 x threads drawn chunks of 32 MiB: about 4-6 GiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.stream_safetensors import (
    FileJob,
    Init,
    Piece,
    RandomSource,
    Spec,
    shard_jobs,
    write_file,
    write_json,
)
from library.errors import UserError
from library.moss_image.vae import Flux2VAEConfig
from library.moss_image.dit import MossImageConfig

logger = logging.getLogger(__name__)

GROUP_SIZE = 256  # the official ConvRot group size
DIT_DIR, TE_DIR, VAE_DIR, TOKENIZER_DIR = Path("transformer"), Path("text_encoder"), Path("vae"), Path("tokenizer")
DIT_STEM, DIT_SHARDS = "diffusion_pytorch_model", 3
TE_STEM, TE_SHARDS = "model", 4
COMFY_BF16 = Path("moss_image_base_bf16.safetensors")
COMFY_INT8 = Path("moss_image_base_int8_convrot.safetensors")
TE_INT8 = Path("text_encoder_int8") / "qwen3.5_9b_int8_convrot.safetensors"
BFL_VAE = Path("flux2-vae.safetensors")
TEXT_PREFIX = "model.language_model."
WHAT = ("dit", "te", "vae", "comfy", "comfy_int8")  # comfy_int8: the two INT8 files without the bf16 one
REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------------ configs
@dataclass(frozen=True)
class Scale:
    dit: MossImageConfig
    te: dict[str, Any]  # the VL config.json of the text encoder (text_config + vision_config)
    vae: Flux2VAEConfig


def full_scale() -> Scale:
    te = json.loads((REPO / "configs" / "moss_image_qwen35_9b" / "config.json").read_text(encoding="utf-8"))
    return Scale(MossImageConfig(), te, Flux2VAEConfig())


def small_scale() -> Scale:
    dit = MossImageConfig(hidden_size=256, num_layers=4, num_heads=2, head_dim=128, ffn_hidden=512, text_dim=256)
    text = dict(
        model_type="qwen3_5_text", vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], full_attention_interval=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, rms_norm_eps=1e-6, attn_output_gate=True,
        attention_bias=False, hidden_act="silu", tie_word_embeddings=False, eos_token_id=0, pad_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                             mrope_section=[6, 5, 5], mrope_interleaved=True),
        dtype="bfloat16",
    )
    vision = dict(model_type="qwen3_5_vision", depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                  patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=256, in_channels=3,
                  num_position_embeddings=64, hidden_act="gelu_pytorch_tanh")
    te = dict(architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", text_config=text,
              vision_config=vision, tie_word_embeddings=False, dtype="bfloat16")
    return Scale(dit, te, Flux2VAEConfig(ch=32, ch_mult=(1, 1, 2, 2)))


SCALES: dict[str, Callable[[], Scale]] = {"full": full_scale, "small": small_scale}


# -------------------------------------------------------------------------------------------------------- specs
def dit_specs(cfg: MossImageConfig) -> list[Spec]:
    from library.moss_image.dit import MossImage

    with torch.device("meta"):
        model = MossImage(cfg)
    return [Spec(k, tuple(v.shape), torch.bfloat16) for k, v in model.state_dict().items()]


def _te_models(te: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """(VL state dict, MTP decoder layer state dict, text config), all on the meta device."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    cfg = Qwen3_5Config(**te)
    text = cfg.text_config
    full = text.layer_types.index("full_attention")
    with torch.device("meta"):
        vl = Qwen3_5ForConditionalGeneration(cfg).state_dict()
        mtp_layer = Qwen3_5DecoderLayer(text, full).state_dict()
    return vl, mtp_layer, text


def te_specs(te: dict[str, Any]) -> list[Spec]:
    """The official VL checkpoint's tensors: language model, vision tower, lm_head, then the MTP draft layer."""
    vl, mtp_layer, text = _te_models(te)
    h = text.hidden_size
    order = [k for k in vl if k.startswith(TEXT_PREFIX)] + [k for k in vl if not k.startswith(TEXT_PREFIX)]
    specs = [Spec(k, tuple(vl[k].shape), torch.bfloat16) for k in order]
    specs.append(Spec("mtp.fc.weight", (h, 2 * h), torch.bfloat16))
    specs += [Spec(f"mtp.{n}.weight", (h,), torch.bfloat16) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden")]
    specs += [Spec(f"mtp.layers.0.{k}", tuple(v.shape), torch.bfloat16) for k, v in mtp_layer.items()]
    specs.append(Spec("mtp.norm.weight", (h,), torch.bfloat16))
    return specs


def vae_specs(cfg: Flux2VAEConfig) -> list[tuple[Spec, Spec]]:
    """(BFL spec, diffusers spec) of every VAE tensor, fp32 (the step counter int64)."""
    from library.moss_image.vae import AutoEncoder, bfl_to_diffusers_state_dict

    with torch.device("meta"):
        bfl = AutoEncoder(cfg).state_dict()
    diffusers = bfl_to_diffusers_state_dict(bfl)  # one output per input, in the same order
    pairs = []
    for (bk, bv), (dk, dv) in zip(bfl.items(), diffusers.items(), strict=True):
        dtype = torch.float32 if bv.is_floating_point() else bv.dtype
        pairs.append((Spec(bk, tuple(bv.shape), dtype), Spec(dk, tuple(dv.shape), dtype)))
    return pairs


# ------------------------------------------------------------------------------------------------------ values
def _fan_in_normal(shape: tuple[int, ...]) -> Init:
    return Init("normal", 0.0, 1.0 / math.sqrt(max(math.prod(shape[1:]), 1)))


def dit_init(name: str, shape: tuple[int, ...]) -> Init:
    if len(shape) == 1 and "norm" in name:
        return Init("normal", 1.0, 0.05)
    if name.endswith("scale_shift_table"):
        return Init("normal", 0.0, 0.05)
    if len(shape) == 1:
        return Init("normal", 0.0, 0.02)  # Linear biases
    return _fan_in_normal(shape)


def te_init(name: str, shape: tuple[int, ...]) -> Init:
    if name.endswith("linear_attn.A_log"):
        return Init("log_uniform", 1.0, 16.0)
    if name.endswith(("linear_attn.dt_bias", "linear_attn.norm.weight")):
        return Init("normal", 1.0, 0.05)  # dt_bias starts at 1; the gated RMSNorm multiplies by its weight
    if len(shape) == 1 and name.startswith("model.visual."):
        return Init("normal", 1.0, 0.05) if "norm" in name and name.endswith(".weight") else Init("normal", 0.0, 0.02)
    if len(shape) == 1 and "norm" in name:
        return Init("normal", 0.0, 0.05)  # Qwen3.5 RMSNorm weights are stored zero-centred: y = norm(x) * (1 + w)
    if len(shape) == 1:
        return Init("normal", 0.0, 0.02)
    return _fan_in_normal(shape)


def vae_init(name: str, shape: tuple[int, ...]) -> Init:
    if name == "bn.running_mean":
        return Init("normal", 0.0, 0.3)
    if name == "bn.running_var":
        return Init("log_uniform", math.e ** 0.5, math.e ** 2.0)  # log U(e^0.5, e^2) = values in (0.5, 2)
    if name == "bn.num_batches_tracked":
        return Init("zeros")
    if len(shape) == 1:
        return Init("normal", 1.0, 0.05) if "norm" in name and name.endswith(".weight") else Init("normal", 0.0, 0.02)
    return _fan_in_normal(shape)


# ------------------------------------------------------------------------------------------ ComfyUI read-back
class ShardReader:
    """Tensors of shards written earlier, one at a time (plain reads, no mmap), checked against the plan."""

    def __init__(self, root: Path, first_shard: Path, expected: list[Spec], option: str):
        self.root, self.first, self.expected, self.option = root, first_shard, expected, option
        self._source: Any = None

    def open(self) -> None:
        from library.files.safetensors_io import TensorSource, discover_shards

        path = self.root / self.first
        if not path.exists():
            raise UserError(f"'{path}' does not exist: the ComfyUI files are made from the shards, so add"
                            f" {self.option} to --what (or write it first with the same --scale).")
        source = TensorSource(discover_shards(path), disable_mmap=True)
        for spec in self.expected:
            found = (source.shape(spec.name), source.dtype(spec.name)) if spec.name in source else None
            if found != (spec.shape, spec.dtype):
                source.close()
                raise UserError(f"The shards beside '{path}' do not match this --scale (tensor '{spec.name}'):"
                                f" write them again with {self.option} in --what.")
        self._source = source

    def get(self, name: str) -> torch.Tensor:
        if self._source is None:
            self.open()
        return self._source.get_tensor(name)

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None


def _quantize(t: torch.Tensor, device: torch.device, embedding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ConvRot INT8 codes and fp32 [N, 1] scales as the loader makes them (the embedding in the loader's row chunks)."""
    from library.quant.convrot_kernels import quantize_convrot_weight
    from library.quant.convrot import EMBEDDING_ROW_CHUNK

    q, s = quantize_convrot_weight(t.to(device), GROUP_SIZE, row_chunk=EMBEDDING_ROW_CHUNK if embedding else None)
    return q.cpu(), s.cpu()


def _marker() -> torch.Tensor:
    from library.quant.convrot import comfy_quant_spec, comfy_quant_tensor

    return comfy_quant_tensor(comfy_quant_spec(GROUP_SIZE))


def _qkv_parts(name: str) -> tuple[str, list[str]] | None:
    """For `...proj.q.weight`: (`...proj.qkv`, the q/k/v weight names); None for any other tensor."""
    if not name.endswith(".proj.q.weight"):
        return None
    block = name[: -len(".q.weight")]
    return f"{block}.qkv", [f"{block}.{n}.weight" for n in "qkv"]


def _is_k_or_v(name: str) -> bool:
    return name.endswith((".proj.k.weight", ".proj.v.weight"))


def comfy_bf16_job(specs: list[Spec], reader: ShardReader) -> FileJob:
    """The ComfyUI bf16 DiT: q/k/v rows concatenated into `proj.qkv` (streamed as q, k, v: no concatenated copy)."""
    pieces = []
    for spec in specs:
        fused = _qkv_parts(spec.name)
        if fused is not None:
            prefix, parts = fused
            rows = (3 * spec.shape[0], *spec.shape[1:])
            pieces.append(Piece([Spec(f"{prefix}.weight", rows, spec.dtype)],
                                lambda parts=parts: (reader.get(p) for p in parts)))
        elif not _is_k_or_v(spec.name):
            pieces.append(Piece([spec], lambda n=spec.name: [reader.get(n)]))
    return FileJob(COMFY_BF16, pieces)


def _int8_piece(prefix: str, names: list[str], shape: tuple[int, ...], reader: ShardReader, device: torch.device,
                embedding: bool) -> Piece:
    """int8 `prefix.weight` + fp32 `prefix.weight_scale` from the tensors `names` (row-concatenated when several)."""
    if shape[-1] % GROUP_SIZE:
        raise ValueError(f"'{prefix}' has input width {shape[-1]}, not a multiple of the group size {GROUP_SIZE}")
    rows = shape[0] * len(names)
    specs = [Spec(f"{prefix}.weight", (rows, shape[-1]), torch.int8), Spec(f"{prefix}.weight_scale", (rows, 1),
                                                                           torch.float32)]

    def produce() -> Iterator[torch.Tensor]:
        parts = [_quantize(reader.get(n), device, embedding) for n in names]
        yield from (q for q, _ in parts)
        yield from (s for _, s in parts)

    return Piece(specs, produce)


def comfy_int8_dit_job(specs: list[Spec], reader: ShardReader, device: torch.device) -> FileJob:
    """The ComfyUI ConvRot INT8 DiT: the 252 block Linears int8 (q/k/v fused into `proj.qkv`), the rest bf16."""
    from library.quant.convrot import dit_convrot_filter

    job = FileJob(COMFY_INT8, [])
    for spec in specs:
        module = spec.name[: -len(".weight")] if spec.name.endswith(".weight") else None
        fused = _qkv_parts(spec.name)
        if module is None or not dit_convrot_filter(module):
            job.pieces.append(Piece([spec], lambda n=spec.name: [reader.get(n)]))
        elif fused is not None:
            job.pieces.append(_int8_piece(fused[0], fused[1], spec.shape, reader, device, False))
            job.constants[f"{fused[0]}.comfy_quant"] = _marker()
        elif not _is_k_or_v(spec.name):
            job.pieces.append(_int8_piece(module, [spec.name], spec.shape, reader, device, False))
            job.constants[f"{module}.comfy_quant"] = _marker()
    return job


def comfy_int8_te_job(specs: list[Spec], reader: ShardReader, device: torch.device) -> FileJob:
    """The ComfyUI ConvRot INT8 text encoder: text weights only, the loader's scope int8, the rest bf16."""
    from library.quant.convrot import text_encoder_convrot_filter

    job = FileJob(TE_INT8, [])
    for spec in specs:
        if not spec.name.startswith(TEXT_PREFIX):
            continue
        local = spec.name[len(TEXT_PREFIX):]
        module = local[: -len(".weight")] if local.endswith(".weight") else None
        if module is not None and text_encoder_convrot_filter(module):
            prefix = spec.name[: -len(".weight")]
            job.pieces.append(_int8_piece(prefix, [spec.name], spec.shape, reader, device,
                                          module.endswith("embed_tokens")))
            job.constants[f"{prefix}.comfy_quant"] = _marker()
        else:
            job.pieces.append(Piece([spec], lambda n=spec.name: [reader.get(n)]))
    return job


# ---------------------------------------------------------------------------------------------------- planning
@dataclass
class Step:
    """One unit of output: safetensors jobs, small JSON files, and an optional extra writer (the tokenizer)."""

    label: str
    jobs: list[FileJob]
    jsons: dict[Path, object] = dataclasses.field(default_factory=dict)
    extra: Callable[[Path], list[Path]] | None = None
    readers: list[ShardReader] = dataclasses.field(default_factory=list)


def _dit_config_json(cfg: MossImageConfig) -> dict[str, Any]:
    fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items() if k != "extra"}
    return {"_class_name": "MossImageTransformer2DModel", **fields}


def first_shard(folder: Path, stem: str, shards: int) -> Path:
    return folder / f"{stem}-00001-of-{shards:05d}.safetensors"


def _write_tokenizer(out: Path) -> list[Path]:
    from library.moss_image.tiny_snapshot import write_tokenizer

    write_tokenizer(out)
    return [TOKENIZER_DIR / "tokenizer.json", TOKENIZER_DIR / "tokenizer_config.json"]


def dit_step(cfg: MossImageConfig, rng: RandomSource) -> Step:
    """transformer/: 3 shards, index, config.json."""
    pieces = [rng.piece(s, dit_init(s.name, s.shape)) for s in dit_specs(cfg)]
    jobs, index = shard_jobs(DIT_DIR, DIT_STEM, pieces, DIT_SHARDS)
    return Step("dit", jobs, {DIT_DIR / f"{DIT_STEM}.safetensors.index.json": index,
                              DIT_DIR / "config.json": _dit_config_json(cfg)})


def te_step(te: dict[str, Any], rng: RandomSource) -> Step:
    """text_encoder/: 4 shards of the VL checkpoint, index, config.json; tokenizer/."""
    jobs, index = shard_jobs(TE_DIR, TE_STEM, [rng.piece(s, te_init(s.name, s.shape)) for s in te_specs(te)], TE_SHARDS)
    return Step("te", jobs, {TE_DIR / f"{TE_STEM}.safetensors.index.json": index, TE_DIR / "config.json": te},
                extra=_write_tokenizer)


def vae_step(cfg: Flux2VAEConfig, rng: RandomSource) -> Step:
    """vae/ (diffusers) and flux2-vae.safetensors (BFL): the same values under both key sets."""
    pairs = vae_specs(cfg)
    bfl = [rng.piece(b, vae_init(b.name, b.shape)) for b, _ in pairs]
    diffusers = [Piece([d], lambda b=b: rng.chunks(b, vae_init(b.name, b.shape))) for b, d in pairs]
    return Step("vae", [FileJob(VAE_DIR / "diffusion_pytorch_model.safetensors", diffusers), FileJob(BFL_VAE, bfl)],
                {VAE_DIR / "config.json": cfg.to_diffusers_config()})


def comfy_step(scale: Scale, root: Path, device: torch.device, with_bf16: bool = True) -> Step:
    """The three ComfyUI single files (the two INT8 ones without `with_bf16`), read back from the shards."""
    dit, te = dit_specs(scale.dit), te_specs(scale.te)
    dit_reader = ShardReader(root, first_shard(DIT_DIR, DIT_STEM, DIT_SHARDS), dit, "dit")
    te_reader = ShardReader(root, first_shard(TE_DIR, TE_STEM, TE_SHARDS), te, "te")
    jobs = [comfy_bf16_job(dit, dit_reader)] if with_bf16 else []
    jobs += [comfy_int8_dit_job(dit, dit_reader, device), comfy_int8_te_job(te, te_reader, device)]
    return Step("comfy", jobs, {TE_INT8.parent / "config.json": scale.te}, readers=[dit_reader, te_reader])


def plan(scale: Scale, what: list[str], rng: RandomSource, root: Path, device: torch.device) -> list[Step]:
    """The steps for the parts in `what`, in the order dit, te, vae, comfy (comfy reads the shards back)."""
    makers: dict[str, Callable[[], Step]] = {
        "dit": lambda: dit_step(scale.dit, rng),
        "te": lambda: te_step(scale.te, rng),
        "vae": lambda: vae_step(scale.vae, rng),
        "comfy": lambda: comfy_step(scale, root, device),
        "comfy_int8": lambda: comfy_step(scale, root, device, with_bf16=False),
    }
    if "comfy" in what and "comfy_int8" in what:
        what = [w for w in what if w != "comfy_int8"]  # comfy already writes the INT8 files
    return [makers[name]() for name in WHAT if name in what]


# ------------------------------------------------------------------------------------------------------ running
def _peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux


def run_steps(steps: list[Step], root: Path, dry_run: bool) -> list[dict[str, Any]]:
    files: list[dict[str, Any]] = []
    for step in steps:
        try:
            for reader in step.readers if not dry_run else []:
                reader.open()  # a mismatch stops the run before a large file is started
            for job in step.jobs:
                t0 = time.perf_counter()
                size = job.nbytes if dry_run else write_file(root, job)
                seconds = time.perf_counter() - t0
                files.append({"path": str(job.path), "bytes": size, "seconds": round(seconds, 3)})
                if not dry_run:
                    logger.info("%s: %.3f GB in %.1f s (peak RSS %.0f MiB)", job.path, size / 1e9, seconds,
                                _peak_rss_mib())
        finally:
            for reader in step.readers:
                reader.close()
        for rel, payload in step.jsons.items():
            size = len(json.dumps(payload, indent=2)) + 1 if dry_run else write_json(root, rel, payload)
            files.append({"path": str(rel), "bytes": size, "seconds": 0.0})
        if step.extra is not None and not dry_run:
            files += [{"path": str(p), "bytes": (root / p).stat().st_size, "seconds": 0.0} for p in step.extra(root)]
    return files


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was given but torch sees no CUDA device: use --device cpu or auto.")
    return torch.device(name)


def _what(value: str) -> list[str]:
    parts = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in parts if p not in WHAT]
    if bad or not parts:
        raise UserError(f"--what {value!r} is not a comma-separated list of {', '.join(WHAT)}: fix the option.")
    return parts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.make_full_snapshot", description=(__doc__ or "").split("\n")[0])
    p.add_argument("out", type=Path, help="output folder (the snapshot root)")
    p.add_argument("--scale", choices=sorted(SCALES), default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--what", default="dit,te,vae,comfy", help=f"comma-separated subset of {','.join(WHAT)} (default: dit,te,vae,comfy)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where values are drawn and quantised (auto: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads drawing values (default: cores, max 16)")
    p.add_argument("--dry-run", action="store_true", help="print the planned files and sizes, write nothing")
    return p.parse_args(argv)


def make_snapshot(args: argparse.Namespace) -> dict[str, Any]:
    """Plan and write (or size, with --dry-run) the requested parts; returns the summary."""
    t0 = time.perf_counter()
    what = _what(args.what)
    device = _device(args.device)
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads} must be at least 1.")
    root = args.out
    rng = RandomSource(args.seed, device, args.threads)
    try:
        steps = plan(SCALES[args.scale](), what, rng, root, device)
        if not args.dry_run:
            root.mkdir(parents=True, exist_ok=True)
        files = run_steps(steps, root, args.dry_run)
    finally:
        rng.close()
    total = sum(f["bytes"] for f in files)
    return {"out": str(root), "scale": args.scale, "seed": args.seed, "what": what, "device": str(device),
            "threads": rng.threads, "dry_run": bool(args.dry_run), "files": files, "total_bytes": total,
            "total_gb": round(total / 1e9, 3), "seconds": round(time.perf_counter() - t0, 2),
            "peak_rss_mib": _peak_rss_mib()}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        summary = make_snapshot(args)
    except UserError as e:
        logger.error("%s", e)
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
