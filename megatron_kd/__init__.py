"""megatron-kd: offline top-K knowledge distillation for Megatron-Core, long context on one node."""
from .loss import topk_kl_loss

__version__ = "0.1.0"
__all__ = ["topk_kl_loss", "__version__"]
