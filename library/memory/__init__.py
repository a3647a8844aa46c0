"""Block swap: moving DiT blocks between host and GPU memory."""
