"""What the builder needs from a teacher, and adapters for plain callables and HF models (the Megatron-Core
GPTModel adapter, MegatronTeacher, lives in megatron_kd.teacher.megatron: cache/ never imports the Megatron glue).

A teacher is called with tokens [b, s] (int64) and returns a TeacherOutput holding either this rank's
final hidden states plus output-layer rows (the builder then computes logits chunk by chunk) or this rank's
logits shard (or None on a rank that holds an earlier pipeline stage: the teacher's `is_last_stage` is False).
It also names its valid (unpadded) vocabulary size, its TP group (and `pp_group`, if pipelined) and its identity.
"""
import hashlib
import json
import os
from dataclasses import dataclass

import torch

from ..cache.hashing import config_hash


def tokens_to(tokens: torch.Tensor, device) -> torch.Tensor:
    """tokens on device, queued: a copy from pageable memory makes the host wait for the whole stream (the previous
    micro-batch's top-K, on a builder's steady state) before it returns; one from pinned memory does not."""
    device = torch.device(device)
    if device.type != "cuda" or tokens.is_cuda:
        return tokens.to(device)
    return tokens.pin_memory().to(device, non_blocking=True)  # the pinned block is reused only after the copy


@dataclass
class TeacherOutput:
    hidden: torch.Tensor | None = None   # [b, s, H] final hidden states (after the final norm)
    weight: torch.Tensor | None = None   # [V_local, H] this rank's output-layer rows
    logits: torch.Tensor | None = None   # [b, s, V_local] this rank's logits (instead of hidden + weight)
    vocab_start_index: int | None = None  # global id of row 0 of this shard; None = rank * V_local


class CallableTeacher:
    """Wraps fn(tokens [b, s]) -> TeacherOutput, a logits tensor, or (hidden, weight)."""

    def __init__(self, fn, vocab_size: int, *, name: str = "callable", identity: dict | None = None, tp_group=None):
        self.fn, self.vocab_size, self.name, self.tp_group = fn, int(vocab_size), name, tp_group
        self._identity = identity

    def identity(self) -> dict:
        if self._identity is None:
            raise ValueError(f"teacher {self.name!r} has no identity; pass identity={{'name':..., 'config_hash':..., "
                             "'weights_hash':...}} (or teacher_id=...) so a cache can name the teacher it came from")
        return dict(self._identity)

    @torch.no_grad()
    def __call__(self, tokens) -> TeacherOutput:
        out = self.fn(tokens)
        if isinstance(out, TeacherOutput):
            return out
        if torch.is_tensor(out):
            return TeacherOutput(logits=out)
        hidden, weight = out
        return TeacherOutput(hidden=hidden, weight=weight)


class HFTeacher:
    """A Hugging Face transformers causal LM from a local directory (single device, small teachers).

    Uses the base model's last hidden state and the output embeddings; models that post-process logits
    (soft-capping, scaling) are refused rather than cached wrong.
    """

    def __init__(self, model_dir, *, device="cpu", dtype=None, name=None):
        try:
            import transformers
        except ImportError:
            raise ImportError("a Hugging Face teacher needs the `transformers` package: pip install transformers") from None
        self.model_dir = os.fspath(model_dir)
        kw = {} if dtype is None else {"dtype": dtype}  # the keyword since transformers 4.56 (was torch_dtype)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, **kw).to(device)
        self.model.eval()
        cfg = self.model.config
        if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
            raise ValueError(f"{self.model_dir}: this model post-processes its logits (soft-capping/scaling); "
                             "the hidden-state path would cache the wrong distribution. Wrap it in a "
                             "CallableTeacher that returns its logits instead.")
        self.vocab_size = int(cfg.vocab_size)
        self.name = name or os.path.basename(os.path.normpath(self.model_dir))
        self.tp_group = None

    def identity(self) -> dict:
        h = hashlib.sha256()
        for f in sorted(os.listdir(self.model_dir)):
            if f.endswith((".safetensors", ".bin", ".pt")):
                with open(os.path.join(self.model_dir, f), "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 24), b""):
                        h.update(chunk)
        return {"name": self.name, "config_hash": config_hash(json.loads(self.model.config.to_json_string())),
                "weights_hash": h.hexdigest()[:16]}

    @torch.no_grad()
    def __call__(self, tokens) -> TeacherOutput:
        dev = next(self.model.parameters()).device
        out = self.model.base_model(input_ids=tokens_to(tokens, dev))
        head = self.model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"{self.model_dir}: the output layer has a bias; wrap the model in a CallableTeacher "
                             "that returns logits")
        return TeacherOutput(hidden=out.last_hidden_state, weight=head.weight)
