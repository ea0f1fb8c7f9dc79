"""The whole user path of docs/hf.md on CPU with tiny random HF checkpoints.

HF teacher + HF student -> `data prepare` with the teacher's tokenizer -> `cache build` from teacher.hf_path ->
offline `train` of the student from model.hf_path -> `export` -> transformers loads the student, its logits equal
megatron-kd's evaluation logits of the trained checkpoint (fp32, 1e-5), and it generates. Each step is the
documented `megatron-kd` command, called in-process (one Bridge import).
"""
import contextlib
import json
import os

import numpy as np
import pytest
import torch

import bridge_env_check  # noqa: F401

pytestmark = [pytest.mark.bridge, pytest.mark.slow]

V, SEQ = 256, 32


def _docs(path, n=160, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ids = torch.randint(1, vocab - 1, (int(torch.randint(10, 40, (1,), generator=g)),), generator=g)
            f.write(json.dumps({"text": " ".join(f"t{i}" for i in ids.tolist())}) + "\n")


def _cli(*argv):
    from megatron_kd.cli.main import main
    rc = main(list(argv))
    assert rc == 0, f"megatron-kd {' '.join(argv)} -> exit {rc}"


@contextlib.contextmanager
def trained_student(checkpoint):
    """The student of a train checkpoint rebuilt on one process (fp32, eval), inside its process group."""
    from megatron_kd.checkpoint import store as ckpt
    from megatron_kd.recipe.schema import ParallelConfig, to_recipe
    from megatron_kd.runtime.dist import distributed
    from megatron_kd.models.builder import build_hf_chunks
    r = to_recipe(ckpt.read_common(checkpoint)["recipe"])
    p = ParallelConfig()
    with distributed(p, 0, "cpu"):
        chunks, _ = build_hf_chunks(r.model, p, SEQ, "fp32", load_weights=False)
        ckpt.load_weights(checkpoint, chunks)
        yield chunks[0].eval()


def logits_of(m, tokens, vocab=V):
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return m(input_ids=tokens, position_ids=pos, attention_mask=None)[..., :vocab].float()


def megatron_logits(checkpoint, student_hf, tokens, vocab=V):
    """megatron-kd's evaluation logits of a train checkpoint: the student rebuilt from the checkpoint."""
    with trained_student(checkpoint) as m:
        return logits_of(m, tokens, vocab)


# (tokenizer ids, teacher embedding rows, student embedding rows): one size; and Qwen-style embeddings padded past
# the tokenizer, differently in teacher and student (Qwen2.5: 152,064 rows at 7B, 151,936 at 1.5B, 151,665 tokens)
@pytest.mark.parametrize("tok,t_rows,s_rows", [(V, V, V), (250, 272, 264)], ids=["same", "padded"])
def test_hf_teacher_and_student_to_exported_student(tmp_path, tok, t_rows, s_rows):
    import tiny
    teacher, student = str(tmp_path / "teacher_hf"), str(tmp_path / "student_hf")
    tiny.make_hf(teacher, "llama", layers=3, hidden=64, seed=1, vocab_size=t_rows, tokenizer_size=tok)
    tiny.make_hf(student, "llama", layers=2, hidden=48, heads=4, kv_heads=2, seed=2, vocab_size=s_rows, tied=True,
                 tokenizer_size=tok)
    _docs(tmp_path / "docs.jsonl", vocab=tok)
    data, cache, run, out = (str(tmp_path / x) for x in ("data/corpus", "cache", "run", "student_kd_hf"))
    # docs/hf.md, step 1: the corpus in the teacher's tokenizer
    _cli("data", "prepare", "--input", str(tmp_path / "docs.jsonl"), "--output-prefix", data,
         "--tokenizer", os.path.join(teacher, "tokenizer.json"))
    common = ["data.kind=indexed", "data.vocab_size=null", f"data.path={data}", f"data.tokenizer={teacher}/tokenizer.json",
              f"data.seq_length={SEQ}", "data.split='90,10,0'", f"teacher.hf_path={teacher}", f"kd.cache={cache}",
              "kd.top_k=8", "train.iters=4", "train.micro_batch_size=2", "train.global_batch_size=4",
              "train.eval_iters=1", "train.device=cpu"]
    # step 2: the teacher's top-K cache over the run's training samples
    args = json.dumps({"recipe": "tiny_cpu", "overrides": common})
    _cli("cache", "build", "--out", cache, "--top-k", "8", "--micro-batch-size", "2", "--no-progress",
         "--teacher", "megatron_kd.teacher.factories:recipe_teacher", "--teacher-args", args,
         "--dataset", "megatron_kd.teacher.factories:recipe_dataset", "--dataset-args", args)
    # step 3: offline KD of the HF student
    auto = str(tmp_path / "student_kd_hf_at_end")  # train.export_hf: the same export at the end of train
    _cli("train", "--config-name", "tiny_cpu", *common, f"model.hf_path={student}", "kd.build_cache=false",
         f"train.save={run}", "train.progress=false", "train.tensorboard=false", "train.lr=1e-2",
         f"train.export_hf={auto}")
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["iteration"] == 4 and summary["loss"] > 0
    from megatron_kd.cache import CacheReader
    reader = CacheReader(cache)
    ids = np.stack([reader[i]["topk_ids"] for i in range(len(reader))])
    assert reader.vocab_size == tok and 0 <= ids.min() and ids.max() < tok, "a padding row became a KD target"
    # step 4: export; step 5: transformers loads it
    _cli("export", "--checkpoint", run, "--out", out)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert {p.dtype for p in hf.parameters()} == {torch.float32}
    from safetensors.torch import load_file
    src, got = load_file(os.path.join(student, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert sorted(src) == sorted(got)
    assert any(not torch.equal(src[k], got[k]) for k in src), "training changed nothing: the export is the source"
    at_end = load_file(os.path.join(auto, "model.safetensors"))
    assert sorted(at_end) == sorted(got) and all(torch.equal(at_end[k], got[k]) for k in got)
    assert sorted(os.listdir(auto)) == sorted(os.listdir(out))
    assert hf.config.vocab_size == s_rows, "the export changed the embedding's rows"
    tokens = torch.randint(0, tok, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(tokens).logits.float()[..., :tok]
    mine = megatron_logits(run, student, tokens, tok)
    err = (ref - mine).abs().max().item()
    print(f"exported student: max |transformers - megatron-kd| logits = {err:.3g}")
    assert err <= 1e-5
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok("t5 t6 t7", return_tensors="pt")
    gen = hf.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == prompt["input_ids"].shape[1] + 5
    # an existing export is not silently replaced
    from megatron_kd.cli.main import main
    assert main(["export", "--checkpoint", run, "--out", out]) == 2
    # --overwrite never reaches the source checkpoint: refused before anything is deleted
    assert main(["export", "--checkpoint", run, "--out", student, "--overwrite"]) == 2
    assert os.path.isfile(os.path.join(student, "model.safetensors"))
    # an unquantized student has no quantized export: refused, and --out is left as it was
    assert main(["export", "--checkpoint", run, "--out", out, "--overwrite", "--quantized", "compressed-tensors"]) == 2
    assert sorted(load_file(os.path.join(out, "model.safetensors"))) == sorted(src)
