"""The latent and text-encoder output caches: strategies, drivers and what the cache tools share."""
