#!/usr/bin/env bash
# GPU smoke run of the product's main paths on the tiny snapshot (run on the device machine):
# bf16 training with ConvRot INT8 (DiT + text encoder), checkpointing and per-block compile, samples, resume state,
# then inference with the LoRA merged before quantisation, three repeated runs in one process (bench.repeat_runs: the
# same LoRA each time), and the CUDA tests of the Triton kernels (ConvRot INT8, the fused element-wise kernels, the
# direct launches, the kernels as ops inside compiled blocks), of the eager block forms and LoRA nodes (their fp32
# weight gradients too), and of two training runs in one process.
# Run from the repository root (`bash bench/gpu_smoke.sh`); no install needed: the tools run as modules (`-m`).
set -euo pipefail
OUT=${OUT:-/tmp/gpu_smoke}
W=/tmp/gpu_smoke_work
rm -rf "$W" && mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m tools.make_tiny_snapshot "$W/snap" > /dev/null
python3 - "$W" <<'PY'
import sys, numpy as np
from pathlib import Path
from PIL import Image
d = Path(sys.argv[1]) / "data" / "4_toy"; d.mkdir(parents=True)
for i in range(8):
    a = np.full((64, 64, 3), 128, np.uint8); a[16:48, 16:48] = (220, 30, 30)
    Image.fromarray(a).save(d / f"i{i}.png"); (d / f"i{i}.txt").write_text("a red square")
(Path(sys.argv[1]) / "p.txt").write_text("a red square --w 64 --h 64 --s 8 --d 1\n")
PY
common=(--snapshot "$W/snap" --train_data_dir "$W/data" --resolution 64 --network_module networks.lora_generic
  --network_dim 8 --network_train_unet_only --learning_rate 1e-3 --seed 1 --max_data_loader_n_workers 0
  --cache_latents --cache_text_encoder_outputs --mixed_precision bf16 --gradient_checkpointing)
t0=$(date +%s)
python3 moss_image_train_network.py "${common[@]}" --output_dir "$W/out" --output_name int8 --max_train_steps 20 \
  --convrot_int8 --convrot_int8_text_encoder --compile --sample_prompts "$W/p.txt" --sample_every_n_steps 20 \
  --save_every_n_steps 10 --save_state 2>&1 | grep -vE "it/s|s/it" | tail -n 12
python3 moss_image_train_network.py "${common[@]}" --output_dir "$W/out" --output_name int8 --max_train_steps 20 \
  --convrot_int8 --convrot_int8_bwd int8 --resume "$W/out/int8-step00000010-state" 2>&1 | grep -vE "it/s|s/it" | tail -n 3
python3 moss_image_train_network.py "${common[@]}" --output_dir "$W/out" --output_name unsloth --max_train_steps 5 \
  --unsloth_offload_checkpointing 2>&1 | grep -vE "it/s|s/it" | tail -n 2
python3 moss_image_minimal_inference.py --snapshot "$W/snap" --prompt "a red square" --image_size 64 64 \
  --infer_steps 8 --seed 1 --save_path "$W/inf" --convrot_int8 --convrot_int8_text_encoder \
  --lora_weight "$W/out/int8.safetensors" 2>&1 | tail -n 3
python3 -m tools.show_metadata "$W/out/int8.safetensors" | grep -E "ss_convrot|architecture|hash" || true
echo "wall $(( $(date +%s) - t0 )) s"
cp "$W"/out/sample/*.png "$W"/inf/*.png "$OUT"/ 2>/dev/null || true
python3 -m bench.repeat_runs --runs 3 --out "$OUT/repeat_runs.json" 2>&1 | grep "^run " || true
python3 -m pytest -q -p no:cacheprovider tests/test_convrot_int8_triton.py tests/test_fused_kernels.py \
  tests/test_triton_launch.py tests/test_moss_image_models.py tests/test_eager_fusion.py tests/test_transfer.py \
  tests/test_fused_compiled.py tests/test_lora_weight_grads.py \
  tests/test_checkpointing.py::test_trainer_selective_policy_trains_the_same_lora_as_full 2>&1 | tail -n 3
