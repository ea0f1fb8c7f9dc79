"""Llama-3.2-3B shape at 32K with offline KD: a REAL Megatron-Bridge 0.6.2 pretrain() beside `megatron-kd train`
on the same model, samples and cache, one H200, one call.

  cache    `python -m megatron_kd.bridge.cache build` over the recipe's train samples (--iters x 1 samples of
           32768 tokens) with a synthetic teacher (random [V, 64] output layer: top-100 of real 128256-way
           softmaxes, no teacher model to carry); both runs read this cache
  bridge   `megatron_kd.bridge.run --recipe megatron_kd.bridge.recipes:llama32_3b_local_config --config-file
           recipes/bridge/llama32_3b_offline_kd.yaml` (local layers + SDPA attention: no TE here; full recompute,
           bf16, Megatron DDP + Adam, micro/global batch 1); a callback times each step (cuda-synchronized) and
           reads torch.cuda.max_memory_allocated
  mkd      megatron_kd.training.loop.run with megatron_kd/recipes/model/llama32_3b.yaml, the same recompute /
           optimizer / batch, mock data = the recipe's samples (token hashes checked against the cache)
Model TFLOP/s = megatron_kd.training.metrics.train_flops_per_step (6 x params x tokens + 6 L s^2 h, no
recompute counted) / median step time after the first --warmup steps, the same formula for both.

Device (H200; carry .whl-bridge), about 5 minutes:
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-bridge/*.whl && \
  PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bridge_3b_bench.py --out $OUT/bridge_3b_32k.json
CPU smoke (tiny shapes through the same code: --smoke; Python 3.12 venv; Bridge's pretrain needs CUDA, so the
bridge row is skipped on CPU):
  PYTHONPATH=$PWD /work/venv312/bin/python benchmarks/bridge_3b_bench.py --smoke --out /tmp/bridge_3b_smoke.json
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common import fresh_workdir, run_child  # noqa: E402
YAML = os.path.join(ROOT, "recipes", "bridge", "llama32_3b_offline_kd.yaml")
STUDENT_YAML = os.path.join(ROOT, "megatron_kd", "recipes", "model", "llama32_3b.yaml")
TOPK = 100


def _shims():
    sys.path.insert(0, os.path.join(ROOT, "tests", "bridge"))
    import shims  # noqa: F401  (test/device-only stand-ins for TE / nvidia-resiliency-ext)


def synthetic_teacher(vocab: int, hidden: int = 64, seed: int = 0):
    """Random token embeddings [V, h] and output layer: hidden = emb[token]; the cache stores real top-K."""
    import torch
    from megatron_kd.teacher.protocol import CallableTeacher
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device="cpu").manual_seed(seed)
    emb = torch.randn(vocab, hidden, generator=g).to(dev)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dev)
    return CallableTeacher(lambda tokens: (emb[tokens.to(dev)], w), vocab,
                           identity={"name": "synthetic", "vocab": vocab, "hidden": hidden, "seed": seed})


def tiny_recipe():  # --smoke
    from megatron_kd.bridge.recipes import tiny_local_config
    return tiny_local_config(seq_length=128, vocab_size=1024)


class StepMeter:
    """Per-step wall time (CUDA-synchronized) and peak allocated memory of a Bridge run, to a JSON file."""

    def __init__(self, path):
        self.path, self.t, self.steps = path, None, []

    def on_train_step_start(self, context):
        import torch
        torch.cuda.synchronize()
        self.t = time.perf_counter()

    def on_train_step_end(self, context):
        import torch
        torch.cuda.synchronize()
        self.steps.append(time.perf_counter() - self.t)
        loss = {k: float(v) for k, v in (context.loss_dict or {}).items()}
        with open(self.path, "w") as f:
            json.dump({"step_s": self.steps, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
                       "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30, "last_losses": loss}, f)


def overrides(a, w):
    o = [f"kd.cache={w}/cache", f"kd.top_k={TOPK}", f"train.train_iters={a.iters}",
         "train.global_batch_size=1", "train.micro_batch_size=1", "checkpoint.save=null", "checkpoint.load=null",
         "dataset.num_workers=0", f"model.seq_length={a.seq}", f"dataset.seq_length={a.seq}",
         # no tokenizer files or token data on the device: Bridge's NullTokenizer and mock data (the recipe's)
         "tokenizer.tokenizer_type=NullTokenizer", "tokenizer.tokenizer_model=null", f"tokenizer.vocab_size={a.vocab}",
         "dataset.data_path=null"]
    return o


def child(a):
    _shims()
    sys.path.insert(0, HERE)
    w = a.work
    recipe = "bridge_3b_bench:tiny_recipe" if a.smoke else "megatron_kd.bridge.recipes:llama32_3b_local_config"
    if a.child == "cache":
        from megatron_kd.bridge.cache import main
        return main(["build", "--recipe", recipe, "--config-file", YAML, "--teacher",
                     "bridge_3b_bench:synthetic_teacher", "--teacher-args", json.dumps({"vocab": a.vocab}),
                     "--top-k", str(TOPK), "--no-progress", *overrides(a, w)])
    if a.child == "bridge":
        from megatron_kd.bridge.run import main
        return main(["--recipe", recipe, "--config-file", YAML, *overrides(a, w)],
                    callbacks=[StepMeter(f"{w}/bridge_steps.json")])
    if a.child == "mkd":
        import torch
        from omegaconf import OmegaConf
        from megatron_kd.recipe.schema import (DataConfig, KDConfig, ModelConfig, ParallelConfig, Recipe,
                                                 TrainConfig)
        from megatron_kd.training.loop import run
        m = ModelConfig(**OmegaConf.to_container(OmegaConf.load(STUDENT_YAML)))
        if a.smoke:
            m = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                            num_query_groups=2, kv_channels=32, tie_embeddings=False)
        m.attention_backend = "sdpa"
        if torch.cuda.is_available():  # megatron-core's recompute needs the CUDA RNG tracker (CPU smoke: none)
            m.recompute_granularity, m.recompute_method, m.recompute_num_layers = "full", "uniform", 1
        r = Recipe(model=m, parallel=ParallelConfig(use_distributed_optimizer=False),
                   data=DataConfig(kind="mock", vocab_size=a.vocab, seq_length=a.seq, split="9999,8,2", seed=1234),
                   kd=KDConfig(mode="offline", cache=f"{w}/cache", top_k=TOPK, log_ce=False),
                   train=TrainConfig(iters=a.iters, micro_batch_size=1, global_batch_size=1,
                                     precision="bf16" if torch.cuda.is_available() else "fp32", save=f"{w}/mkd",
                                     eval_iters=0, log_interval=1, progress=False, tensorboard=False))
        s = run(r, r.train.save)
        with open(f"{w}/mkd_summary.json", "w") as f:
            json.dump({"summary": s, "flops_per_step": _flops(a, m)}, f)
        return 0
    raise SystemExit(a.child)


def _flops(a, m=None):
    from omegaconf import OmegaConf
    from megatron_kd.recipe.schema import ModelConfig
    from megatron_kd.training.metrics import train_flops_per_step
    if m is None:
        m = ModelConfig(**OmegaConf.to_container(OmegaConf.load(STUDENT_YAML)))
        if a.smoke:
            m = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                            num_query_groups=2, kv_channels=32, tie_embeddings=False)
    return train_flops_per_step(m, a.vocab, a.seq, 1)


def launch(a, name, torchrun, timeout):
    argv = ["--work", a.work, "--iters", str(a.iters), "--seq", str(a.seq), "--vocab", str(a.vocab)] + \
        (["--smoke"] if a.smoke else [])
    return run_child(__file__, name, argv, a.logs, torchrun=torchrun, timeout=timeout, port=29300 + len(name))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bridge_3b_32k_h200.json"))
    p.add_argument("--work", default="/tmp/mkd_bridge_3b")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--child", default=None)
    a = p.parse_args()
    if a.smoke and a.seq == 32768:
        a.seq, a.vocab, a.iters, a.warmup = 128, 1024, 3, 1
    if a.child:
        sys.exit(child(a))
    a.logs = fresh_workdir(a.work, a.out, "bridge_3b_logs")
    import torch
    cuda = torch.cuda.is_available()
    steps = {"cache": launch(a, "cache", False, 200)}
    if cuda:
        steps["bridge"] = launch(a, "bridge", True, 290)
    steps["mkd"] = launch(a, "mkd", True, 290)
    flops = _flops(a)
    rows = {}
    if os.path.exists(f"{a.work}/bridge_steps.json"):
        b = json.load(open(f"{a.work}/bridge_steps.json"))
        st = statistics.median(b["step_s"][a.warmup:] or b["step_s"])
        rows["bridge"] = {"step_s": st, "tflops_per_gpu": flops / st / 1e12, "peak_mem_gib": b["peak_mem_gib"],
                          "peak_reserved_gib": b["peak_reserved_gib"], "steps": len(b["step_s"]),
                          "kd_loss_last": b["last_losses"].get("kd loss")}
    if os.path.exists(f"{a.work}/mkd_summary.json"):
        s = json.load(open(f"{a.work}/mkd_summary.json"))["summary"]
        rows["megatron_kd_train"] = {"step_s": s["step_s"], "tflops_per_gpu": s["tflops_per_gpu"],
                                     "peak_mem_gib": s["peak_mem_gib"], "kd_loss_last": s["loss"]}
    res = {"seq": a.seq, "vocab": a.vocab, "top_k": TOPK, "iters": a.iters, "warmup": a.warmup,
           "flops_per_step": flops, "rows": rows, "steps": steps, "smoke": a.smoke}
    if "bridge" in rows and "megatron_kd_train" in rows:
        res["bridge_over_mkd"] = {k: rows["bridge"][k] / rows["megatron_kd_train"][k]
                                  for k in ("step_s", "peak_mem_gib")}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
