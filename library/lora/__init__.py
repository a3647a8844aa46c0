"""LoRA conventions and merging LoRA files into model weights."""
