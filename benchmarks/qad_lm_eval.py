"""lm-evaluation-harness scores of `megatron-kd demo --recover --quantize FORMAT`'s models, before and after: each
exported to Hugging Face (`megatron-kd export`, through a Llama folder of the demo teacher's architecture) and
scored by lm-eval on the demo's held-out text (megatron_kd/cli/lm_eval_task.py, a local task). Python 3.12 venv
of tests/bridge_env/make_venv.sh (Megatron-Bridge, transformers, lm-eval):

    PYTHONPATH=$PWD:$PWD/tests/bridge_env $VENV/bin/python benchmarks/qad_lm_eval.py --demo runs/demo \\
        --formats fp8,int4_awq

--quantized is `megatron-kd export`'s: auto (default) writes the quantized models as compressed-tensors checkpoints
(activation quantization included; lm-eval's transformers backend needs compressed-tensors), folded as the plain
checkpoints of their weights on the grid (activation quantizers, as fp8's, not part of them), as the README's table
was measured. Writes DEMO/qad_lm_eval.json (folded; else qad_lm_eval_auto.json, ...) and prints a table.
"""
import argparse
import json
import logging
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--demo", required=True)
    p.add_argument("--formats", default="fp8,int4_awq")
    p.add_argument("--samples", type=int, default=None, help="held-out samples (default: the demo's eval samples)")
    p.add_argument("--quantized", choices=("auto", "compressed-tensors", "folded"), default="auto",
                   help="megatron-kd export --quantized for the quantized models")
    a = p.parse_args(argv)
    logging.disable(logging.INFO)
    import shims  # noqa: F401  (tests/bridge_env: Bridge imports on a machine without Transformer Engine)
    logging.disable(logging.NOTSET)
    import lm_eval
    from lm_eval.tasks import TaskManager
    from megatron_kd.cli.main import main as mkd
    from megatron_kd.cli.lm_eval_task import TASK, demo_heldout_texts, demo_hf_source, write_task
    demo = os.path.abspath(a.demo)
    work = os.path.join(demo, "lm_eval" if a.quantized == "folded" else f"lm_eval_{a.quantized}")
    src = os.path.join(work, "hf_source")
    if not os.path.isdir(src):
        demo_hf_source(demo, src)
    task_dir = os.path.join(work, "task")
    texts = demo_heldout_texts(demo, a.samples)
    write_task(texts, task_dir)
    models = {"teacher": "teacher"}
    for f in a.formats.split(","):
        models.update({f"ptq_{f}": f"ptq_{f}", **{f"{f}_{w}": f"recover_{f}_{w}" for w in ("ce", "offline", "online")}})
    res = {"documents": len(texts), "quantized": a.quantized, "scores": {}}
    for name, ckpt in models.items():
        out = os.path.join(work, name)
        if not os.path.isdir(out):
            how = [] if name == "teacher" else ["--quantized", a.quantized]  # the teacher is not quantized
            rc = mkd(["export", "--checkpoint", os.path.join(demo, ckpt), "--out", out, "--hf-path", src, *how])
            if rc:
                return rc
        r = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={out},dtype=float32", tasks=[TASK],
                                    device="cpu", batch_size=8, task_manager=TaskManager(include_path=task_dir))
        s = r["results"][TASK]
        res["scores"][name] = {k.split(",")[0]: s[k] for k in s if k.split(",")[0] in
                               ("bits_per_byte", "byte_perplexity", "word_perplexity")}
        print(name, res["scores"][name], flush=True)
    name = "qad_lm_eval.json" if a.quantized == "folded" else f"qad_lm_eval_{a.quantized}.json"
    with open(os.path.join(demo, name), "w") as f:
        json.dump(res, f, indent=2)
    print("\n| model | lm-eval bits_per_byte | word_perplexity |\n|---|---|---|")
    for name, s in res["scores"].items():
        print(f"| {name} | {s['bits_per_byte']:.4f} | {s['word_perplexity']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
