"""README's "Your own models" path end to end on CPU, with the commands README gives (called in-process):

a Llama-3-style HF teacher whose tokenizer ends documents with <|end_of_text|> -> `megatron-kd prune` -> a student
of half its layers -> `data prepare` of a JSONL and a text corpus with the teacher's tokenizer -> `cache build
--recipe --teacher-hf` -> offline `train` of the pruned student -> `export` -> transformers loads the export and
its logits equal megatron-kd's evaluation logits of the trained checkpoint.
"""
import json
import os

import pytest
import torch

import bridge_env_check  # noqa: F401

pytestmark = [pytest.mark.bridge, pytest.mark.slow]

V, SEQ = 128, 32
EOT = "<|end_of_text|>"


def cli(*argv):
    from megatron_kd.cli.main import main
    rc = main([str(a) for a in argv])
    assert rc == 0, f"megatron-kd {' '.join(map(str, argv))} -> exit {rc}"


def corpus(d):
    g = torch.Generator().manual_seed(0)

    def sentence():
        n = int(torch.randint(8, 30, (1,), generator=g))
        return " ".join(f"t{i}" for i in torch.randint(1, V - 1, (n,), generator=g).tolist())
    with open(d / "docs.jsonl", "w") as f:
        for _ in range(120):
            f.write(json.dumps({"text": sentence()}) + "\n")
    (d / "notes.txt").write_text("\n\n".join(sentence() + "\n" + sentence() for _ in range(40)) + "\n")


def test_own_teacher_pruned_student_and_corpus_to_a_transformers_export(tmp_path, monkeypatch, capsys):
    import tiny
    from test_user_path import megatron_logits
    monkeypatch.chdir(tmp_path)
    tiny.make_hf("teacher_hf", "llama", layers=4, hidden=64, seed=1, vocab_size=V, eod=EOT)
    corpus(tmp_path)
    # README: Your own models
    cli("prune", "--hf", "teacher_hf", "--out", "student_hf", "--keep-layers", "0,2")
    cli("data", "prepare", "--input", "docs.jsonl", "notes.txt", "--output-prefix", "data/mine",
        "--tokenizer", "teacher_hf")
    out = capsys.readouterr().out
    assert "docs.jsonl: 120 documents" in out and "notes.txt: 40 documents" in out
    meta = json.load(open("data/mine.json"))
    assert meta["eod_token"] == EOT and meta["documents"] == 160
    common = ["data=pydoc", "data.path=data/mine", "data.tokenizer=teacher_hf/tokenizer.json",
              f"data.seq_length={SEQ}", "train.iters=4", "train.micro_batch_size=2", "train.global_batch_size=4",
              "train.eval_iters=1"]
    cli("cache", "build", "--out", "cache", "--top-k", "8", "--micro-batch-size", "2", "--no-progress",
        "--recipe", "tiny_cpu", "--teacher-hf", "teacher_hf", *common)
    cli("train", "--config-name", "tiny_cpu", *common, "teacher.hf_path=teacher_hf", "model.hf_path=student_hf",
        "kd=offline", "kd.cache=cache", "kd.build_cache=false", "kd.top_k=8", "train.save=runs/mine",
        "train.lr=1e-2", "train.progress=false", "train.tensorboard=false")
    cli("export", "--checkpoint", "runs/mine", "--out", "student_kd_hf")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained("student_kd_hf", dtype=torch.float32).eval()
    assert hf.config.num_hidden_layers == 2
    tokens = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(tokens).logits.float()[..., :V]
    mine = megatron_logits("runs/mine", "student_hf", tokens, V)
    err = (ref - mine).abs().max().item()
    print(f"exported student: max |transformers - megatron-kd| logits = {err:.3g}")
    assert err <= 1e-5
    from safetensors.torch import load_file
    src, got = load_file("student_hf/model.safetensors"), load_file("student_kd_hf/model.safetensors")
    assert any(not torch.equal(src[k], got[k]) for k in src), "training changed nothing: the export is the source"
