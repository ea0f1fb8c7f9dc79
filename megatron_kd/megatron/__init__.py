"""Megatron-Core integration: CPU patches, student hook, forward_step/loss_func, training loop."""
import warnings


def quiet_megatron_warnings() -> None:
    """Drop megatron-core's import-time notices about optional fused kernels (TE, apex) for CLI users."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core(\..*)?$")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.core(\..*)?$")
