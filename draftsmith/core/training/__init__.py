"""Training: the objectives, optimizers, checkpoints, data-parallel groups and live curves."""
