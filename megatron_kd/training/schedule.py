"""One training (or eval) step's forward/backward over all micro-batches.

GPU: Megatron's own schedule from get_forward_backward_func() (1F1B / interleaved under PP).
CPU: those schedules allocate on 'cuda', so micro-batches go through Megatron's per-micro-batch
schedules.forward_step / backward_step directly, with the same no_sync and finalize_model_grads calls as
forward_backward_no_pipelining (no pipeline parallel on CPU).
"""
import contextlib

import torch


def forward_backward(step_fn, data_iterator, chunks, num_microbatches: int, seq_length: int,
                     micro_batch_size: int, forward_only: bool = False) -> list:
    """Returns the loss_func reports of this rank's last-stage micro-batches (empty on other stages).
    data_iterator: one iterator, or a list with one per model chunk (virtual pipeline)."""
    if torch.cuda.is_available():
        from megatron.core.pipeline_parallel import get_forward_backward_func
        return get_forward_backward_func()(
            forward_step_func=step_fn, data_iterator=data_iterator,
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=num_microbatches,
            seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=forward_only)
    return _cpu_forward_backward(step_fn, data_iterator, chunks, num_microbatches, forward_only)


def _cpu_forward_backward(step_fn, data_iterator, chunks, n: int, forward_only: bool) -> list:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_config, get_model_type
    if len(chunks) != 1:
        raise RuntimeError("pipeline parallel needs GPUs; on CPU use parallel.pp=1 (one model chunk)")
    model = chunks[0]
    config = get_model_config(model)
    model_type = get_model_type(model)
    cp = ps.get_context_parallel_world_size()
    store, total = [], torch.zeros([], dtype=torch.int)
    no_sync = config.no_sync_func or contextlib.nullcontext
    for i in range(n):
        last = i == n - 1
        with contextlib.nullcontext() if last or forward_only else no_sync():  # grads sync on the last one
            out, tokens = schedules.forward_step(step_fn, data_iterator, model, n, None, store, config, cp,
                                                 is_first_microbatch=i == 0, current_microbatch=i)
            total += tokens
            if not forward_only:
                # megatron-core 0.19 dropped backward_step's model_type argument (0.16 has it)
                args = (model_type, config) if "model_type" in _params(schedules.backward_step) else (config,)
                schedules.backward_step(None, out, None, *args)
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model], total if config.calculate_per_token_loss else None)
    return store


def _params(fn) -> tuple:
    import inspect
    return tuple(inspect.signature(fn).parameters)
