"""Throughput, model FLOPs, peak memory, and where they are written (console bar, JSON lines, TensorBoard)."""
import json
import os
import resource
import sys

import torch

from ..recipe.schema import GATED_ACTIVATIONS, ModelConfig


def gpt_params(m: ModelConfig, vocab: int, active: bool = False) -> int:
    """Parameter count of an architecture (active = MoE experts actually used per token)."""
    h, heads = m.hidden_size, m.num_attention_heads
    hd = m.kv_channels or h // heads
    groups = m.num_query_groups or heads
    attn = h * heads * hd + 2 * h * groups * hd + heads * hd * h
    ffn = m.ffn_hidden_size or 4 * h
    gated = 2 if m.activation in GATED_ACTIVATIONS else 1
    if m.num_moe_experts:
        e_ffn = m.moe_ffn_hidden_size or ffn
        n_exp = m.moe_router_topk if active else m.num_moe_experts
        mlp = n_exp * (gated * h * e_ffn + e_ffn * h) + h * m.num_moe_experts
    else:
        mlp = gated * h * ffn + ffn * h
    layer = attn + mlp + 2 * h
    emb = vocab * h * (1 if m.tie_embeddings else 2)
    return m.num_layers * layer + emb + h


def train_flops_per_step(m: ModelConfig, vocab: int, seq: int, sequences: int) -> float:
    """Model FLOPs of one forward+backward (the baseline's formula): 6 x params x tokens + 6 x L x s^2 x h per
    sequence (causal attention)."""
    return 6.0 * gpt_params(m, vocab, active=True) * seq * sequences + 6.0 * m.num_layers * seq * seq * \
        m.hidden_size * sequences


def forward_flops_per_step(m: ModelConfig, vocab: int, seq: int, sequences: int) -> float:
    return train_flops_per_step(m, vocab, seq, sequences) / 3.0


def peak_memory_gib(device_cuda: bool) -> float:
    """Peak allocated GPU memory; on CPU the process's peak resident set."""
    if device_cuda:
        return torch.cuda.max_memory_allocated() / 2 ** 30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2 ** 20


def drop_partial_line(path: str) -> None:
    """A run killed while appending a record leaves its last line unfinished; a resume appending after it would
    join its first record to that line. The unfinished line (never a whole record) is cut off."""
    try:
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            f.seek(max(0, size - (1 << 20)))
            tail = f.read()
            cut = tail.rfind(b"\n")
            f.truncate(size - len(tail) + cut + 1 if cut >= 0 else max(0, size - len(tail)))
    except FileNotFoundError:
        pass


class Sink:
    """Rank 0's outputs: metrics.jsonl (appended across resumes), TensorBoard if installed, a tqdm bar."""

    def __init__(self, out_dir: str, total: int, start: int, progress: bool, tensorboard: bool, enabled: bool):
        self.enabled = enabled
        self.bar = self.tb = self.file = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "metrics.jsonl")
        drop_partial_line(path)
        self.file = open(path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
            except ImportError:  # say so once, instead of dropping the logs silently
                self.tb = None
                print("note: train.tensorboard=true but tensorboard is not installed (pip install tensorboard); "
                      "metrics go to metrics.jsonl only. train.tensorboard=false silences this.", file=sys.stderr,
                      flush=True)
            except Exception as e:  # noqa: BLE001  a writer that cannot start must not stop training
                self.tb = None
                print(f"note: TensorBoard writer not started ({e}); metrics go to metrics.jsonl only", file=sys.stderr,
                      flush=True)
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, unit="it", dynamic_ncols=True, file=sys.stderr,
                            desc="train", mininterval=0.5)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            step = record.get("iteration", 0)
            for k, v in record.items():
                if k not in ("iteration", "kind") and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, step)

    def progress(self, n: int, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()
