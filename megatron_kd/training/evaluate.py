"""Held-out comparison of students against their teacher: cross-entropy and full-vocabulary KL(teacher || student).

The teacher's full distribution is its top-K with K = the vocabulary (the same vocab-parallel top-K as the
cache builder), so the KL goes through the same loss as training, with no tail to approximate.

Each model is rebuilt from its saved model section, whose attention_backend=auto picks Transformer Engine's spec or
not by what imports here, so it is built on the layer spec its checkpoint records (checkpoint/spec.py), as export
builds its student.
"""
import dataclasses

import torch

from ..loss import LossOptions, VocabLayout, kd_loss
from ..checkpoint import store as ckpt
from ..recipe.schema import ModelConfig, Recipe
from ..data.datasets import build_datasets, load_tokenizer, loader, samples_needed
from ..runtime.dist import distributed
from ..models.hook import forward_with_head, output_layout
from ..models.builder import build_gpt, unwrap
from ..teacher.megatron import OnlineTeacher, freeze


@torch.no_grad()
def compare(r: Recipe, teacher_load: str, students: dict, num_samples: int, micro_batch_size: int = 8,
            attention_backend: str | None = None, setting: str = "model.attention_backend={}") -> dict:
    """students: {name: (ModelConfig, checkpoint dir)}. Returns {name: {"ce", "kl"}} plus "teacher": {"ce"}.

    Uses the recipe's data (held-out split), parallel layout and teacher architecture; single data-parallel
    pass over the first num_samples validation samples (every rank computes the same numbers).
    attention_backend and setting: _load's, for the teacher and every student.
    """
    tok = load_tokenizer(r.data)
    vocab = tok.vocab_size
    with distributed(r.parallel, r.train.seed, r.train.device):
        _, valid = build_datasets(r.data, tok, samples_needed(r.train, r.data)[0], num_samples)
        if valid is None or len(valid) < num_samples:
            raise ValueError(f"the validation split has {0 if valid is None else len(valid)} samples, "
                             f"{num_samples} asked; lower the number or change data.split")
        t_model = _load(r.teacher, teacher_load, r, vocab, attention_backend, setting)
        teacher = OnlineTeacher(t_model, vocab, vocab)
        models = {name: _load(m, path, r, vocab, attention_backend, setting) for name, (m, path) in students.items()}
        sums = {name: {"ce": 0.0, "kl": 0.0} for name in ["teacher", *models]}
        count = 0
        for batch in loader(valid, num_samples, 0, micro_batch_size, 0, 1):
            ids, lp = teacher.topk(batch)
            sums["teacher"]["ce"] += _ce(t_model, batch, vocab).sum().item()
            for name, m in models.items():
                sums[name]["ce"] += _ce(m, batch, vocab).sum().item()
                sums[name]["kl"] += _per_position(m, batch, vocab, ids, lp).sum().item()
            count += batch["tokens"].numel()
    out = {name: {k: v / count for k, v in s.items()} for name, s in sums.items()}
    del out["teacher"]["kl"]
    return out


def _load(m: ModelConfig, path: str, r: Recipe, vocab: int, attention_backend: str | None = None,
          setting: str = "model.attention_backend={}"):
    """The model `m` (left as it is) with the weights of the checkpoint at `path`, frozen, built on the layer spec
    the checkpoint records; attention_backend (te, sdpa, local) chooses it for a checkpoint that records none.
    A checkpoint that cannot be built here or fails to load is refused in one sentence (RunError) naming `setting`
    (the value as {}), the setting that chooses the spec."""
    what = f"the checkpoint {path}"
    m = dataclasses.replace(m)
    ckpt.build_as_saved_at(path, m, attention_backend, what, setting)  # before the model is built
    model = build_gpt(m, r.parallel, vocab, r.data.seq_length, "fp32")
    ckpt.load_spec_weights(path, [model], what, setting)
    freeze(model)
    return model


# per position: the student's CE on the labels, or its KL to the teacher's full distribution
PER_POSITION_CE = LossOptions(kl_weight=0.0, ce_weight=1.0, reduction="none")
PER_POSITION_KL = LossOptions(reduction="none")


def _per_position(model, batch, vocab, ids=None, lp=None, ce=False):
    layout = VocabLayout(*output_layout(unwrap(model)), valid_vocab_size=vocab)
    labels = batch["labels"].transpose(0, 1)
    s, b = labels.shape
    if ids is None:
        ids = torch.empty((b, s, 0), dtype=torch.int64)
        lp = torch.empty((b, s, 0))

    def head(hidden, weight):
        return kd_loss(hidden, weight, ids.transpose(0, 1), lp.transpose(0, 1),
                       PER_POSITION_CE if ce else PER_POSITION_KL, layout, labels=labels if ce else None)

    return forward_with_head(model, head, batch["tokens"], batch["position_ids"], None)


def _ce(model, batch, vocab):
    return _per_position(model, batch, vocab, ce=True)
