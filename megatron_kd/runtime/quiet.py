"""Quiet megatron-core's and Megatron-Bridge's notices for CLI users: a training run's output is its progress, loss
and throughput, not the libraries' import-time notices or a line per parameter."""
import logging
import warnings

LIBRARIES = r"megatron\.(core|bridge)(\..*)?$"
# megatron-core's DDP logs every parameter of every gradient bucket at INFO ("... (param.main_grad.dtype=...)"),
# hundreds of lines per model; its warnings still come through.
CHATTY_LOGGERS = ("megatron.core.distributed.param_and_grad_buffer",)


def quiet_megatron_warnings() -> None:
    """Drop megatron-core's and Bridge's notices about optional fused kernels (TE, apex) and their deprecations,
    and the per-parameter bucket listing of megatron-core's DDP."""
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=LIBRARIES)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
