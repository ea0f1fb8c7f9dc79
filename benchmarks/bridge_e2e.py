"""Offline KD through a REAL Megatron-Bridge 0.6.2 pretrain(), end to end on one H200.

In one call, every step its own process (Bridge's pretrain() owns the process group):
  1 models     a tiny random Llama teacher and student saved as Hugging Face checkpoints (transformers)
  2 cache      `python -m megatron_kd.bridge.cache build` (HF teacher) over the recipe's own train samples
  3 bridge_a   `megatron_kd.bridge.run` (recipe tiny student from the HF checkpoint, recipes/bridge/
               tiny_offline_kd.yaml): 24 iterations with offline KD, checkpoints at 12 and 24
  4 bridge_b   the same run into another checkpoint dir, SIGKILLed at the start of iteration 14 (after its
               checkpoint at 12); 5 bridge_c: the same command again: Bridge resumes from iteration 12
  6 mkd        `megatron-kd train` (megatron_kd.training.loop.run) on the same HF student weights, the same mock
               samples (its data section = the recipe's dataset) and the same cache: 2 iterations
Checks (summary["checks"]): the first iteration's KD loss equals megatron-kd train's (1e-4 relative); the loss
falls; resumed iterations 13..24 equal the uninterrupted run's; Bridge's run_config.yaml holds dataset.kd.

Device (H200; carry .whl-bridge), about 4-5 minutes:
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-bridge/*.whl && \
  PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bridge_e2e.py --out $OUT/bridge_e2e.json
CPU smoke (no Bridge pretrain: steps 1, 2, 6 and the config checks; Python 3.12 venv), about 1-2 minutes:
  PYTHONPATH=$PWD /work/venv312/bin/python benchmarks/bridge_e2e.py --smoke --out /tmp/bridge_e2e_smoke.json
The test shims for Transformer Engine / nvidia-resiliency-ext (tests/bridge/shims.py) are imported in every child.

--te: the same on Bridge's default layer spec (Transformer Engine's), TE installed by ../shared/te, no shims for TE:
steps 1, 2, 3 (bridge_a) and 6 (`megatron-kd train` with model.attention_backend=te); the check is the first
iteration's KD loss. The device has no apex, so the provider's gradient_accumulation_fusion is turned off for
Bridge's run (megatron-core's own output layer needs apex for it; NeMo containers have apex).
  source .whlte/device_install.sh && PYTHONPATH=$PYTHONPATH:$PWD python3 benchmarks/bridge_e2e.py --te \
      --out $OUT/bridge_e2e_te.json   (carry .whl-bridge and .whlte)
"""
import argparse
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common import fresh_workdir, run_child  # noqa: E402
YAML = os.path.join(ROOT, "recipes", "bridge", "tiny_offline_kd.yaml")
SEQ, VOCAB, ITERS, GBS, MBS, TOPK, SAVE_AT, KILL_AT = 128, 1024, 24, 4, 2, 16, 12, 14
STUDENT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=256, rope_theta=10000.0)
TEACHER = dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
               intermediate_size=384, rope_theta=10000.0)
STUDENT_DIR = None  # set in the child before the recipe is loaded


TE = "--te" in sys.argv  # Bridge's own (TE) layer spec, real TE: no stand-ins


def _shims():
    # under --te the shims leave the real TE alone; the nvidia_resiliency_ext stand-in is still needed (PyPI's
    # release breaks megatron-core's import)
    sys.path.insert(0, os.path.join(ROOT, "tests", "bridge"))
    import shims  # noqa: F401  (test/device-only stand-ins: see its docstring)


# --- the recipe: the tiny student, weights from its HF checkpoint ------------------------------------------------

def student_recipe():
    """megatron_kd.bridge.recipes.tiny_local_config with cfg.model from AutoBridge (the HF student's weights)."""
    import torch
    from megatron.bridge import AutoBridge
    from megatron_kd.bridge.recipes import tiny_local_config, use_local_layers
    cfg = tiny_local_config(seq_length=SEQ, vocab_size=VOCAB)
    model = AutoBridge.from_hf_pretrained(STUDENT_DIR).to_megatron_provider(load_weights=True)
    for k, v in dict(seq_length=SEQ, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                     calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0,
                     tensor_model_parallel_size=1, make_vocab_size_divisible_by=128).items():
        setattr(model, k, v)
    if TE:  # Bridge's default spec; without apex megatron-core's output layer cannot fuse its weight gradient
        model.gradient_accumulation_fusion = False
    else:
        use_local_layers(model)
    cfg.model = model
    return cfg


class KillAt:
    """SIGKILL this process when iteration `at` starts (a crash: no cleanup, no checkpoint)."""

    def __init__(self, at):
        self.at = at

    def on_train_step_start(self, context):
        if context.state.train_state.step + 1 >= self.at:
            print(f"bridge_e2e: SIGKILL at the start of iteration {context.state.train_state.step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def bridge_argv(w, ckpt, log):
    return ["--recipe", "bridge_e2e:student_recipe", "--config-file", YAML, f"kd.cache={w}/cache",
            f"kd.top_k={TOPK}", f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}",
            f"checkpoint.save_interval={SAVE_AT}", f"train.train_iters={ITERS}", f"train.global_batch_size={GBS}",
            f"train.micro_batch_size={MBS}", "--loss-log", log]


# --- children ------------------------------------------------------------------------------------------------

def child(a):
    global STUDENT_DIR
    _shims()
    sys.path.insert(0, HERE)
    import bridge_e2e  # the module the recipe name points at
    bridge_e2e.STUDENT_DIR = STUDENT_DIR = os.path.join(a.work, "student")
    w = a.work
    if a.child == "cache":
        from megatron_kd.bridge.cache import main
        return main(["build", "--recipe", "bridge_e2e:student_recipe", "--config-file", YAML,
                     "--teacher", f"hf:{w}/teacher", "--top-k", str(TOPK), "--no-progress",
                     f"kd.cache={w}/cache", f"train.train_iters={ITERS}", f"train.global_batch_size={GBS}"])
    if a.child == "config":  # CPU: the run's config as run.py builds it, and its saved form
        from megatron_kd.bridge.run import build
        cfg, _, _ = build(bridge_argv(w, f"{w}/ck_cfg", f"{w}/cfg.jsonl"))
        d = cfg.to_dict()["dataset"]
        print(json.dumps({"dataset_target": d["_target_"], "kd": d["kd"]}))
        return 0
    if a.child in ("bridge_a", "bridge_b", "bridge_c"):
        from megatron_kd.bridge.run import main
        ck, log = (f"{w}/ck_a", f"{w}/a.jsonl") if a.child == "bridge_a" else (f"{w}/ck_b", f"{w}/b.jsonl")
        return main(bridge_argv(w, ck, log), callbacks=[KillAt(KILL_AT)] if a.child == "bridge_b" else None)
    if a.child == "mkd":
        import torch
        from megatron_kd.recipe.schema import (DataConfig, KDConfig, ModelConfig, ParallelConfig, Recipe,
                                                 TrainConfig)
        from megatron_kd.training.loop import run
        s = STUDENT
        r = Recipe(
            model=ModelConfig(name="tiny-student", num_layers=s["num_hidden_layers"], hidden_size=s["hidden_size"],
                              ffn_hidden_size=s["intermediate_size"], num_attention_heads=s["num_attention_heads"],
                              num_query_groups=s["num_key_value_heads"], kv_channels=32, rotary_base=int(s["rope_theta"]),
                              tie_embeddings=False, attention_backend="te" if TE else "sdpa", hf_path=STUDENT_DIR),
            parallel=ParallelConfig(use_distributed_optimizer=False),
            data=DataConfig(kind="mock", vocab_size=VOCAB, seq_length=SEQ, split="9999,8,2", seed=1234),
            kd=KDConfig(mode="offline", cache=f"{w}/cache", top_k=TOPK, log_ce=False),
            train=TrainConfig(iters=a.mkd_iters, micro_batch_size=MBS, global_batch_size=GBS, lr=1e-3, min_lr=1e-4,
                              precision="bf16" if torch.cuda.is_available() else "fp32", save=f"{w}/mkd", eval_iters=0, log_interval=1, progress=False,
                              tensorboard=False))
        run(r, r.train.save)
        return 0
    raise SystemExit(f"unknown child {a.child}")


# --- the parent ----------------------------------------------------------------------------------------------

def make_models(w):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    for name, shape, seed in (("student", STUDENT, 1), ("teacher", TEACHER, 2)):
        torch.manual_seed(seed)
        kw = {k: v for k, v in shape.items() if k != "rope_theta"}
        cfg = LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, max_position_embeddings=SEQ, rms_norm_eps=1e-5,
                          **kw,
                          rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]})
        hf = AutoModelForCausalLM.from_config(cfg).float()
        with torch.no_grad():
            for n, p in hf.named_parameters():
                p.copy_(1 + 0.05 * torch.randn_like(p) if "norm" in n else 0.05 * torch.randn_like(p))
        hf.save_pretrained(os.path.join(w, name))


def launch(a, name, torchrun, timeout):
    return run_child(__file__, name, ["--work", a.work, "--mkd-iters", str(a.mkd_iters), *["--te"] * a.te], a.logs,
                     torchrun=torchrun,
                     timeout=timeout, port=29400 + sum(map(ord, name)) % 500)


def read_losses(path, key="kd loss"):
    out = {}
    if os.path.exists(path):
        for line in open(path):
            rec = json.loads(line)
            if key in rec["losses"]:
                out[rec["iteration"]] = rec["losses"][key]
    return out


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bridge_e2e_h200.json"))
    p.add_argument("--work", default="/tmp/mkd_bridge_e2e")
    p.add_argument("--smoke", action="store_true", help="CPU: no Bridge pretrain (it needs CUDA)")
    p.add_argument("--child", default=None)
    p.add_argument("--mkd-iters", type=int, default=2)
    p.add_argument("--te", action="store_true", help="Bridge's TE layer spec and real TE (steps 1, 2, 3, 6)")
    a = p.parse_args()
    if a.child:
        sys.exit(child(a))
    a.logs = fresh_workdir(a.work, a.out, "bridge_e2e_logs")
    t0 = time.time()
    make_models(a.work)
    steps = {"cache": launch(a, "cache", False, 240)}
    if a.smoke:  # on the device the saved run_config.yaml of bridge_a is checked instead
        steps["config"] = launch(a, "config", False, 120)
    else:
        for name in ("bridge_a",) if a.te else ("bridge_a", "bridge_b", "bridge_c"):
            steps[name] = launch(a, name, True, 200)
    steps["mkd"] = launch(a, "mkd", True, 200)
    w = a.work
    res = {"steps": steps, "wall_s": round(time.time() - t0, 1), "smoke": a.smoke, "te": a.te,
           "settings": dict(seq=SEQ, vocab=VOCAB, iters=ITERS, gbs=GBS, mbs=MBS, top_k=TOPK, save_at=SAVE_AT,
                            kill_at=KILL_AT)}
    mkd = {}
    if os.path.exists(f"{w}/mkd/metrics.jsonl"):
        for line in open(f"{w}/mkd/metrics.jsonl"):
            rec = json.loads(line)
            if rec.get("kind") == "train":
                mkd[rec["iteration"]] = rec["loss"]
    res["mkd_losses"] = mkd
    checks = {}
    if not a.smoke:
        la, lb = read_losses(f"{w}/a.jsonl"), read_losses(f"{w}/b.jsonl")
        res["bridge_losses"], res["bridge_killed_then_resumed_losses"] = la, lb
        if la and mkd:
            checks["first_iteration_vs_megatron_kd_train"] = {"bridge": la.get(1), "megatron_kd": mkd.get(1),
                                                             "rel": rel(la[1], mkd[1]), "ok": rel(la[1], mkd[1]) <= 1e-4}
        if len(la) >= ITERS:
            checks["loss_falls"] = {"first": la[1], "last": la[ITERS], "ok": la[ITERS] < la[1]}
        resumed = [i for i in range(SAVE_AT + 1, ITERS + 1) if i in la]
        # b.jsonl holds the killed run's 1..13 then the resumed run's 13..24: the last record of each iteration
        if "bridge_b" in steps and steps["bridge_b"]["rc"] != 0 and resumed and all(i in lb for i in resumed):
            d = max(rel(lb[i], la[i]) for i in resumed)
            checks["resume_matches_uninterrupted"] = {"iterations": [resumed[0], resumed[-1]], "max_rel": d,
                                                      "killed_rc": steps["bridge_b"]["rc"], "ok": d <= 1e-6}
        cfgs = sorted(x for x in os.listdir(f"{w}/ck_a") if x.startswith("iter_")) if os.path.isdir(f"{w}/ck_a") else []
        if cfgs:
            import yaml
            rc = yaml.safe_load(open(f"{w}/ck_a/{cfgs[0]}/run_config.yaml"))["dataset"]
            checks["saved_config_holds_kd"] = {"file": f"ck_a/{cfgs[0]}/run_config.yaml", "target": rc["_target_"],
                                               "kd_cache": rc.get("kd", {}).get("cache"),
                                               "ok": rc.get("kd", {}).get("cache") == f"{w}/cache"}
    else:
        checks["cache_built"] = {"ok": os.path.exists(f"{w}/cache/manifest.json")}
        checks["megatron_kd_train_on_the_bridge_cache"] = {"ok": 1 in mkd, "loss": mkd.get(1)}
    res["checks"] = checks
    res["ok"] = bool(checks) and all(c["ok"] for c in checks.values())
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("ok", "checks", "wall_s")}, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
