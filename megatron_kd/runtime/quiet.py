"""Quiet megatron-core's import-time notices for CLI users."""
import warnings


def quiet_megatron_warnings() -> None:
    """Drop megatron-core's import-time notices about optional fused kernels (TE, apex) for CLI users."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core(\..*)?$")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.core(\..*)?$")
