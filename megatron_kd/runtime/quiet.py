"""Quiet megatron-core's and Megatron-Bridge's notices for CLI users: a training run's output is its progress, loss
and throughput, not the libraries' import-time notices or a line per parameter."""
import logging
import warnings

LIBRARIES = r"megatron\.(core|bridge)(\..*)?$"
# megatron-core logs at INFO for its own developers (its DDP lists every parameter of every gradient bucket,
# "... (param.main_grad.dtype=...)", hundreds of lines per model); its warnings still come through
CHATTY_LOGGERS = ("megatron.core",)
# ... except the deprecation notices of classes and options megatron-kd chose, which a user cannot act on
DEPRECATION_LOGGERS = ("megatron.core.models.gpt.gpt_model", "megatron.core.dist_checkpointing.strategies.torch")


def _not_a_deprecation(record: logging.LogRecord) -> bool:
    return "deprecated" not in record.getMessage().lower()


def quiet_megatron_warnings() -> None:
    """Drop megatron-core's and Bridge's notices about optional fused kernels (TE, apex) and their deprecations,
    and the per-parameter bucket listing of megatron-core's DDP."""
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=LIBRARIES)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in DEPRECATION_LOGGERS:
        logger = logging.getLogger(name)
        if _not_a_deprecation not in logger.filters:
            logger.addFilter(_not_a_deprecation)
