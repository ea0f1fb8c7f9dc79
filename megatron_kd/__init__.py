"""megatron-kd: offline top-K knowledge distillation for Megatron-Core, long context on one node."""

__version__ = "0.1.0"
__all__ = ["topk_kl_loss", "__version__"]


def __getattr__(name):
    # `from megatron_kd import topk_kl_loss` imports torch; the CLI (`megatron-kd X --help`) does not need it.
    if name == "topk_kl_loss":
        from .loss import topk_kl_loss
        return topk_kl_loss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
