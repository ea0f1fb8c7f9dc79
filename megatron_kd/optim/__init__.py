"""Optimizers and LR schedules: Megatron DDP + optimizer setup, and lean_adam."""
