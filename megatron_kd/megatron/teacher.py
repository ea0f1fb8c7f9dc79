"""The frozen teacher of online mode, and loading teacher weights.

Online mode runs the teacher GPTModel beside the student on the same TP group and takes its top-K with
`topk_from_hidden`, the vocab-parallel top-K the cache builder uses, so online and offline (cache) targets
are the same numbers up to the cache's log-prob encoding.
"""
import torch

from ..parallel.sequence import gather_sequence
from ..parallel.topk import topk_from_hidden
from .hook import forward_with_head, output_layout
from .model import unwrap


class OnlineTeacher:
    def __init__(self, model, top_k: int, valid_vocab_size: int, temperature: float = 1.0, chunk_size=None):
        self.model, self.top_k, self.valid_vocab_size = model, int(top_k), int(valid_vocab_size)
        self.temperature, self.chunk_size = float(temperature), chunk_size
        freeze(model)

    @torch.no_grad()
    def topk(self, batch: dict):
        """(topk_ids int64 [b, s, K], topk_logprobs float32 [b, s, K]) for the batch's tokens."""
        gpt = unwrap(self.model)
        group, sp = output_layout(gpt)
        out = {}

        def head(hidden, weight):
            if sp:
                hidden = gather_sequence(hidden, group)
            s, b, h = hidden.shape
            ids, lp = topk_from_hidden(hidden.reshape(s * b, h), weight, self.top_k, group, self.chunk_size,
                                       self.temperature, valid_vocab_size=self.valid_vocab_size)
            out["ids"], out["lp"] = ids.reshape(s, b, -1), lp.reshape(s, b, -1)
            return hidden.new_empty((s, b, 0))

        forward_with_head(self.model, head, batch["tokens"], batch["position_ids"], batch.get("attention_mask"))
        return out["ids"].transpose(0, 1).contiguous(), out["lp"].transpose(0, 1).contiguous()


def freeze(model) -> None:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
