"""`--vram_budget`: a memory model of the MOSS-Image run and a planner that picks the fastest options that fit.

- `sizes`: the bytes of the DiT, the text encoder and the VAE, counted from the model classes on the meta device (any
  model size works), and of the LoRA and its optimizer states.
- `memory_model`: the GPU memory of each phase of a training or inference run (VAE caching, text-encoder caching,
  training steps, sampling, decoding) from those sizes, the run's tokens and batch, and named constants calibrated on
  the H200 figures of docs/benchmarks.md.
- `speed_model`: the relative step time of each option, from the measured speeds in the same document.
- `planner`: the candidates, the choice, the printed table and the sentence when nothing fits.
- `run_options`: the command-line side: `--vram_budget`, which options the user gave explicitly, the workload read
  from the options and the dataset config, and the plan written back into the parsed options.
"""
