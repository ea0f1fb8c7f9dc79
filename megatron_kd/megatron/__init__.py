"""Megatron-Core integration: CPU patches, student hook, forward_step/loss_func, training loop."""
