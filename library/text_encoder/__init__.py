"""The Qwen3.5 text encoder: loading, tokenising, encoding, quantisation, cache variants and base weights."""
