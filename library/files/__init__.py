"""Safetensors reading and atomic writing, and the metadata and hashes of saved files."""
