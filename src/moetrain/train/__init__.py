"""Training: run configuration, optimizer and schedule, the loop, checkpoints and metrics."""
