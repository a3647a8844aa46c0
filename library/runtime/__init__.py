"""Attention backends, torch.compile set-up and phase timing."""
