"""Forward-only pipeline parallelism for a Megatron-Core GPTModel teacher (cache building).

Megatron's pipeline schedules and p2p_communication hard-code CUDA, and a forward-only pass needs neither
their backward bookkeeping nor their buffers, so the stage-to-stage flow is done here with plain
torch.distributed point-to-point calls on the pipeline group (gloo on CPU, NCCL on GPUs):

    stage 0:      model(tokens)                        -> hidden [s, b, H] -> isend to stage 1
    stage p:      recv from p - 1 -> set_input_tensor -> model(...) -> isend to p + 1
    last stage:   recv -> set_input_tensor -> model(...) with the output layer bypassed -> hidden for the top-K

Sends are asynchronous (at most `max_in_flight` outstanding per stage), so stage p works on micro-batch m + 1
while stage p + 1 works on micro-batch m: a plain fill-and-drain pipeline over the builder's micro-batches.
Every rank of a pipeline must process the same micro-batches in the same order (build_cache sees to it).
"""
import re

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^((?:module\.)*decoder\.layers\.)(\d+)\.")


def global_layer_names(model) -> dict[str, str]:
    """This stage's parameter names -> the names they have in the unpipelined (PP=1) model.

    Megatron numbers a stage's layers from 0 (`decoder.layers.0...`); each layer's `layer_number` is its global
    1-based number. Renaming by it keys a stage's weights like the whole model's, so hashes and checkpoints
    compare across pipeline layouts. Identity at PP=1.
    """
    local_to_global = {i: int(layer.layer_number) - 1 for i, layer in enumerate(model.decoder.layers)}

    def rename(name):
        m = _LAYER.match(name)
        if m is None:
            return name
        return f"{m.group(1)}{local_to_global[int(m.group(2))]}.{name[m.end():]}"

    return {name: rename(name) for name, _ in model.named_parameters()}


class PipelineStage:
    """One rank's stage of a forward-only pipeline over `group` (the pipeline-model-parallel group).

    `run(call, shape, dtype)` on every stage: non-first stages receive the previous stage's [s, b, H] hidden
    states and hand them to the model with `set_input_tensor`; `call()` runs this stage's model; non-last stages
    send its output on and return None; the last stage returns `call()`'s result.
    """

    def __init__(self, model, group, *, max_in_flight: int = 2):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("a pipeline-parallel teacher needs torch.distributed initialized")
        self.model, self.group = model, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)  # global ranks in pipeline order (Megatron's next/prev rank)
        self.prev = ranks[self.rank - 1] if self.rank > 0 else None
        self.next = ranks[self.rank + 1] if self.rank < self.size - 1 else None
        self.is_first, self.is_last = self.rank == 0, self.rank == self.size - 1
        pre, post = getattr(model, "pre_process", True), getattr(model, "post_process", True)
        if (pre, post) != (self.is_first, self.is_last):
            raise ValueError(f"pipeline stage {self.rank} of {self.size} holds a model built with pre_process={pre}, "
                             f"post_process={post}; build stage p's GPTModel with pre_process=(p == 0) and "
                             f"post_process=(p == pp - 1)")
        self.max_in_flight = max(1, int(max_in_flight))
        self._pending = []  # (work, tensor): a sent tensor must live until its send completes

    def run(self, call, shape, dtype):
        if not self.is_first:
            device = next(self.model.parameters()).device
            x = torch.empty(tuple(shape), dtype=dtype, device=device)
            dist.recv(x, src=self.prev, group=self.group)
            self.model.set_input_tensor(x)
        out = call()
        if self.is_last:
            return out
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
            raise RuntimeError(f"pipeline stage {self.rank} produced hidden states {tuple(out.shape)} {out.dtype}; "
                               f"the next stage expects {tuple(shape)} {dtype} (config.pipeline_dtype / "
                               f"params_dtype and sequence_parallel must agree across stages)")
        out = out.detach().contiguous()
        self._pending.append((dist.isend(out, dst=self.next, group=self.group), out))
        while len(self._pending) > self.max_in_flight:
            self._pending.pop(0)[0].wait()
        return None

    def flush(self) -> None:
        """Wait for every outstanding send (call before leaving the loop of micro-batches)."""
        while self._pending:
            self._pending.pop(0)[0].wait()
