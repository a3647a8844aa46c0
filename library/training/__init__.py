"""The training loop, its options, flow matching, optimizers, schedulers, checkpoints and sample images."""
