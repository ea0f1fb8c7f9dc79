"""The training loop alone: steps, forward/backward schedule, metrics, held-out evaluation."""
