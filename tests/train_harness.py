"""The tiny `megatron-kd train` runs the training tests share: one gloo process, mock data, small shapes."""
import json

from megatron_kd.recipe.compose import compose
from megatron_kd.recipe.schema import to_recipe
from megatron_kd.training.loop import run

SMALL_ARCH = ["num_layers=1", "hidden_size=32", "ffn_hidden_size=64", "num_attention_heads=4", "num_query_groups=2",
              "make_vocab_size_divisible_by=8"]
BASE = ["data=mock", "data.vocab_size=250", "data.seq_length=32", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.log_interval=1", "train.progress=false", "train.eval_interval=null",
        "train.eval_iters=1", "train.tensorboard=false", "train.lr_warmup_iters=1", "kd.top_k=8",
        *[f"model.{a}" for a in SMALL_ARCH]]
TEACHER_ARCH = [f"teacher.{a}" for a in ["num_layers=2", "hidden_size=48", "ffn_hidden_size=96",
                                          "num_attention_heads=4", "num_query_groups=4",
                                          "make_vocab_size_divisible_by=8"]]


def train(save, *overrides):
    r = to_recipe(compose("tiny_cpu", [*BASE, *overrides, f"train.save={save}"]))
    return run(r, str(save))


def losses(save) -> dict:
    out = {}
    for line in open(save / "metrics.jsonl"):
        rec = json.loads(line)
        if rec["kind"] == "train":
            out[rec["iteration"]] = rec  # a resumed run's record wins
    return out
