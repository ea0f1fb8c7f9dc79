"""lm-evaluation-harness on a local task (megatron_kd/cli/lm_eval_task.py: held-out documents in a jsonl, no hub
access) scores an exported HF checkpoint: its bits_per_byte and perplexities equal the document log-likelihoods
transformers gives directly (float64 sum over each document's tokens, each after the ones before it and the
end-of-document token lm-eval conditions the first on)."""
import json
import math
import os

import pytest
import torch

import bridge_env_check  # noqa: F401

pytestmark = [pytest.mark.bridge, pytest.mark.slow]
pytest.importorskip("lm_eval")

V = 128


def reference(hf_dir, texts):
    """(sum of log-likelihoods, bytes, words) over the documents, computed with transformers alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_dir)
    m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    ll = 0.0
    for t in texts:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        x = torch.tensor([[tok.eos_token_id, *ids]])
        with torch.no_grad():
            lp = torch.log_softmax(m(x).logits[0, :-1].double(), -1)
        ll += lp.gather(1, torch.tensor(ids).view(-1, 1)).sum().item()
    return ll, sum(len(t.encode()) for t in texts), sum(len(t.split()) for t in texts)


def test_lm_eval_scores_an_export_on_a_local_task(tmp_path, monkeypatch):
    import tiny
    import lm_eval
    from lm_eval.tasks import TaskManager
    from megatron_kd.cli.lm_eval_task import TASK, main
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf_dir = str(tmp_path / "student_hf")
    tiny.make_hf(hf_dir, "llama", layers=2, hidden=64, seed=4, vocab_size=V)
    g = torch.Generator().manual_seed(1)
    texts = [" ".join(f"t{i}" for i in torch.randint(0, V - 1, (int(n),), generator=g).tolist())
             for n in torch.randint(5, 40, (6,), generator=g)]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    task_dir = str(tmp_path / "task")
    assert main(["--jsonl", str(tmp_path / "heldout.jsonl"), "--out", task_dir]) == 0
    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf_dir},dtype=float64", tasks=[TASK],
                                  device="cpu", batch_size=1, task_manager=TaskManager(include_path=task_dir))
    got = res["results"][TASK]
    ll, n_bytes, n_words = reference(hf_dir, texts)
    want = {"bits_per_byte,none": -ll / n_bytes / math.log(2), "byte_perplexity,none": math.exp(-ll / n_bytes),
            "word_perplexity,none": math.exp(-ll / n_words)}
    print("lm-eval:", {k: got[k] for k in want}, "reference:", want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k
