"""The MOSS-Image DiT and FLUX.2 VAE, their loaders, and the tiny snapshot in the official layouts."""
