"""A local lm-evaluation-harness task over held-out text (no hub access), to score an exported Hugging Face
student before and after training with `lm-eval`.

    python -m megatron_kd.cli.lm_eval_task --demo runs/demo --out runs/demo/lm_eval_task
    lm-eval run --model hf --model_args pretrained=HF_DIR,dtype=float32 --device cpu \\
        --include_path runs/demo/lm_eval_task --tasks megatron_kd_heldout

The task is a rolling log-likelihood task (lm-eval's `loglikelihood_rolling`, as its wikitext task): every held-out
document scored whole, reported as word_perplexity, byte_perplexity and bits_per_byte. The documents are a
jsonl of {"text": ...} beside the task's YAML, read by the `datasets` json builder from the local file.
`--demo` takes the demo's validation samples (the held-out text its tables score), decoded with its tokenizer.
"""
import argparse
import json
import os
import sys

TASK = "megatron_kd_heldout"


def write_task(texts, out_dir: str, name: str = TASK) -> str:
    """texts as out_dir/NAME.jsonl and the lm-eval task NAME reading it (out_dir/NAME.yaml); returns the YAML's
    path. Pass out_dir to lm-eval as --include_path."""
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"no held-out text to write to {out_dir}")
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    data = os.path.join(out_dir, f"{name}.jsonl")
    with open(data + ".partial", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    os.replace(data + ".partial", data)
    yaml = os.path.join(out_dir, f"{name}.yaml")
    # JSON is YAML: no quoting rules to get wrong for the path
    task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
            "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "",
            "doc_to_target": "{{text}}", "should_decontaminate": False,
            "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
            "metadata": {"version": 1.0}}
    with open(yaml + ".partial", "w") as f:
        json.dump(task, f, indent=1)
    os.replace(yaml + ".partial", yaml)
    return yaml


def demo_heldout_texts(demo_out: str, n: int | None = None) -> list:
    """The demo's validation samples (its held-out text) decoded with its tokenizer; n: the first n."""
    from ..cli.demo import Demo, SETTINGS, Settings
    from ..data.datasets import build_datasets, load_tokenizer, samples_needed
    path = os.path.join(demo_out, SETTINGS)
    if not os.path.exists(path):
        raise ValueError(f"--demo {demo_out} holds no demo ({SETTINGS} missing); run `megatron-kd demo --out "
                         f"{demo_out}` first")
    demo = Demo(os.path.abspath(demo_out), Settings(**json.load(open(path))), progress=False)
    r = demo.student_recipe("ce")
    n = demo.s.eval_samples if n is None else n
    tok = load_tokenizer(r.data)
    _, valid = build_datasets(r.data, tok, samples_needed(r.train, r.data)[0], n)  # as the demo's scoring does
    return [tok.decode(valid[i]["tokens"].tolist()) for i in range(min(n, len(valid)))]


def demo_hf_source(demo_out: str, out: str) -> str:
    """A Hugging Face Llama folder with the demo teacher's architecture (random weights) and the demo's tokenizer:
    the --hf-path `megatron-kd export` writes the demo's teacher-sized models through (the teacher, and the
    models of `demo --recover --quantize`). Needs transformers."""
    import transformers
    from ..cli.demo import Demo, SETTINGS, Settings
    demo = Demo(os.path.abspath(demo_out), Settings(**json.load(open(os.path.join(demo_out, SETTINGS)))),
                progress=False)
    r = demo.student_recipe("ce")
    t = r.teacher
    if not (t.normalization == "RMSNorm" and t.activation == "swiglu" and t.position_embedding_type == "rope"
            and not t.add_bias_linear and not t.add_qkv_bias and not t.qk_layernorm):
        raise ValueError("the demo's teacher is no Llama architecture (RMSNorm, SwiGLU, RoPE, no biases)")
    from ..rules import padded_vocab_size
    vocab = padded_vocab_size(demo.s.vocab_size, t.make_vocab_size_divisible_by, 1)
    c = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=t.hidden_size, intermediate_size=t.ffn_hidden_size,
        num_hidden_layers=t.num_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_query_groups or t.num_attention_heads, rms_norm_eps=t.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(t.rotary_base)},
        tie_word_embeddings=t.tie_embeddings, max_position_embeddings=demo.s.seq_length, dtype="float32")
    transformers.LlamaForCausalLM(c).save_pretrained(out)
    eod = "<|endoftext|>"
    transformers.PreTrainedTokenizerFast(tokenizer_file=r.data.tokenizer, eos_token=eod, bos_token=eod
                                         ).save_pretrained(out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_kd.cli.lm_eval_task", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--demo", help="a finished `megatron-kd demo` directory: its validation samples")
    src.add_argument("--jsonl", help="a jsonl of {\"text\": ...} documents")
    p.add_argument("--out", required=True, help="the task's directory (lm-eval's --include_path)")
    p.add_argument("--samples", type=int, default=None, help="--demo: the first N validation samples (default: "
                                                             "the demo's eval samples)")
    p.add_argument("--name", default=TASK)
    a = p.parse_args(argv)
    try:
        texts = demo_heldout_texts(a.demo, a.samples) if a.demo else [json.loads(x)["text"] for x in open(a.jsonl)]
        yaml = write_task(texts, a.out, a.name)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"lm_eval_task: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {yaml} ({len(texts)} documents); score an exported student with:\n  lm-eval run --model hf "
          f"--model_args pretrained=HF_DIR,dtype=float32 --device cpu --include_path {os.path.dirname(yaml)} "
          f"--tasks {a.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
