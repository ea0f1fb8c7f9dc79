"""Run a GPTModel up to the hidden states entering its output layer; a `head` replaces the logits.

`head(hidden, weight) -> Tensor [s, b, ...]` receives the hidden states exactly as the output layer would
([s, b, H], or this rank's [s/tp, b, H] shard under sequence parallel) and the output weight (this TP rank's
vocab shard; the shared embedding weight when embeddings are tied). The model returns the head's result as
[b, s, ...], where it would return logits. No [s, b, V] tensor is made.

megatron-core >= 0.19 offers this as `GPTModel.forward(..., output_processor=...)`. On 0.16 the output layer's
forward is replaced for the duration of one call (an instance attribute; parameters, state-dict keys and
checkpoints are untouched, and the class's forward comes back afterwards). GPTModel passes the tied weight
as `weight=`, which is what ColumnParallelLinear would have used.
"""
import contextlib
import inspect

from .builder import unwrap

_SUPPORTS = {}


def supports_output_processor(gpt) -> bool:
    cls = type(gpt)
    if cls not in _SUPPORTS:
        _SUPPORTS[cls] = "output_processor" in inspect.signature(cls.forward).parameters
    return _SUPPORTS[cls]


@contextlib.contextmanager
def output_layer_replaced(gpt, head):
    """megatron-core 0.16: the output layer computes head(hidden, weight) instead of logits for this block."""
    if gpt.config.mtp_num_layers:
        raise NotImplementedError("multi-token prediction layers reuse the output layer; the KD head supports "
                                  "models without MTP (unset mtp_num_layers)")
    layer = gpt.output_layer

    def forward(input_, weight=None, *args, **kwargs):
        return head(input_, layer.weight if weight is None else weight), None

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward  # the class's forward again


def forward_with_head(model, head, tokens, position_ids, attention_mask, **kwargs):
    """model(tokens, ...) with `head` in place of the logits; returns [b, s, ...] on the last pipeline stage,
    and the hidden states to send on other stages (where there is no output layer)."""
    gpt = unwrap(model)
    if not gpt.post_process:
        return model(tokens, position_ids, attention_mask, **kwargs)
    if supports_output_processor(gpt):
        def processor(*, hidden_states, output_layer, output_weight, **_):
            w = output_layer.weight if output_weight is None else output_weight
            return head(hidden_states, w).transpose(0, 1).contiguous()
        return model(tokens, position_ids, attention_mask, output_processor=processor, **kwargs)
    with output_layer_replaced(gpt, head):
        return model(tokens, position_ids, attention_mask, **kwargs)


def output_layout(gpt):
    """(tp_group, sequence_parallel) of the output layer: what the head's loss or top-K needs."""
    layer = gpt.output_layer
    group = getattr(layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state
        group = parallel_state.get_tensor_model_parallel_group()
    return group, bool(getattr(layer, "sequence_parallel", False)) and group.size() > 1
