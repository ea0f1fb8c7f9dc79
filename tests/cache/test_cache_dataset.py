"""TopKDataset alignment and batching, reader access patterns, inspect, the loss on cached targets, HF teachers."""
import json
import pickle

import numpy as np
import pytest
import torch

from megatron_kd import topk_kl_loss
from megatron_kd.cache import CacheReader, TopKDataset, collate_topk, inspect_cache
from megatron_kd.cache.encoding import EncodingOptions
from megatron_kd.teacher.protocol import CallableTeacher
from megatron_kd.teacher.build import build_cache
from megatron_kd.cli.cache import main as cache_cli

V, H, S, N, K = 40, 8, 10, 6, 4


def successor_teacher():
    """Puts most mass on (token + 1) % V: the top-1 of row t must equal labels[t] on successor data."""
    def forward(tokens):
        return torch.nn.functional.one_hot((tokens + 1) % V, V).float() * 6.0
    return CallableTeacher(forward, V, name="successor", identity={"name": "successor"})


def successor_data():
    starts = torch.arange(N) * 7
    return (starts[:, None] + torch.arange(S + 1)[None]) % V


class GPTStyleDataset:
    """Megatron GPTDataset-like samples: dicts with tokens, labels, loss_mask, position_ids, attention_mask."""
    unique_description_hash = "gpt-style-demo"

    def __init__(self, windows):
        self.w = windows

    def __len__(self):
        return len(self.w)

    def __getitem__(self, i):
        x = self.w[i]
        mask = torch.ones(S)
        mask[-2:] = 0
        return {"tokens": x[:-1], "labels": x[1:], "loss_mask": mask, "position_ids": torch.arange(S),
                "attention_mask": torch.ones(1, S, S, dtype=torch.bool)}


@pytest.fixture(scope="module")
def successor_cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds") / "cache"
    build_cache(successor_teacher(), GPTStyleDataset(successor_data()), out, encoding=EncodingOptions(top_k=K),
                samples_per_shard=4, progress=False, tokenizer_id="toy-tokenizer")
    return out


def test_rows_align_with_labels(successor_cache):
    ds = TopKDataset(successor_data(), successor_cache)  # plain [S + 1] windows
    for i in range(N):
        x = ds[i]
        assert torch.equal(x["topk_ids"][:, 0], x["labels"]), "row t must describe the token after tokens[t]"
        assert x["topk_ids"].dtype == torch.int64 and x["topk_logprobs"].dtype == torch.float32
        assert torch.equal(x["position_ids"], torch.arange(S)) and torch.equal(x["loss_mask"], torch.ones(S))
    r = CacheReader(successor_cache)
    assert r.manifest["dataset"] == "gpt-style-demo" and r.manifest["tokenizer"] == "toy-tokenizer"


def test_gpt_dict_samples_and_collate(successor_cache):
    ds = TopKDataset(GPTStyleDataset(successor_data()), successor_cache)
    batch = collate_topk([ds[i] for i in (4, 1, 5)])
    assert batch["tokens"].shape == (3, S) and batch["labels"].shape == (3, S)
    assert batch["topk_ids"].shape == (3, S, K) and batch["topk_logprobs"].shape == (3, S, K)
    assert batch["attention_mask"].shape == (3, 1, S, S)  # extra keys pass through
    assert batch["loss_mask"][:, -2:].sum() == 0
    assert torch.equal(batch["topk_ids"][:, :, 0], batch["labels"])
    # DataLoader workers get a pickled dataset: the reader reopens its maps there.
    ds2 = pickle.loads(pickle.dumps(ds))
    assert torch.equal(ds2[3]["topk_logprobs"], ds[3]["topk_logprobs"])
    loader = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=collate_topk)
    assert sum(b["tokens"].shape[0] for b in loader) == N


def test_reader_random_access_and_position_ranges(successor_cache):
    r = CacheReader(successor_cache)
    assert len(r) == N
    full = r[5]
    part = r.read(5, 3, 7)
    np.testing.assert_array_equal(part["topk_ids"], full["topk_ids"][3:7])
    np.testing.assert_array_equal(part["topk_logprobs"], full["topk_logprobs"][3:7])
    np.testing.assert_array_equal(r[-1]["topk_ids"], full["topk_ids"])
    with pytest.raises(IndexError, match="out of range"):
        r[N]
    with pytest.raises(IndexError):
        r.read(0, 5, S + 1)


def test_inspect_reports_size_error_and_mass(successor_cache, capsys):
    info = inspect_cache(successor_cache)
    assert info["complete"] and info["num_samples"] == N and info["top_k"] == K
    assert info["bytes_per_token"] == CacheReader(successor_cache).sample_bytes / S
    assert info["tokens"] == N * S and 0 <= info["kl_error_mean"] < 1e-3
    p_top = 1 / (1 + (V - 1) * np.exp(-6.0))  # the successor teacher's top-1 probability
    mass = p_top + (K - 1) * (1 - p_top) / (V - 1)
    assert info["mean_mass_covered"] == pytest.approx(mass, rel=1e-6)
    assert sum(info["mass_covered_histogram"].values()) == N * S
    assert info["read_samples_per_s"] > 0
    assert cache_cli(["inspect", str(successor_cache)]) == 0
    text = capsys.readouterr().out
    assert "bytes/token" in text and "kl error" in text and "mass covered" in text
    assert cache_cli(["inspect", "--json", str(successor_cache)]) == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == N


@pytest.mark.parametrize("encoding", ["fp16", "fp32", "compact"])
def test_loss_on_cached_targets(tmp_path, encoding):
    """A student equal to the teacher sees a top-K KL of about zero from the cache (the encoding's error; none for
    fp32)."""
    g = torch.Generator().manual_seed(0)
    emb, w = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    teacher = CallableTeacher(lambda t: (emb[t], w), V, identity={"name": "lin"})
    data = torch.randint(0, V, (N, S + 1), generator=g)
    build_cache(teacher, data, tmp_path / "c", encoding=EncodingOptions(encoding, K), progress=False)
    batch = collate_topk([TopKDataset(data, tmp_path / "c")[i] for i in range(N)])
    loss = topk_kl_loss(emb[batch["tokens"]], w, batch["topk_ids"], batch["topk_logprobs"],
                        loss_mask=batch["loss_mask"])
    assert abs(loss.item()) < (1e-6 if encoding == "fp32" else 1e-3)
    other = topk_kl_loss(emb[batch["tokens"]] * 0.5, w, batch["topk_ids"], batch["topk_logprobs"])
    assert other.item() > 10 * abs(loss.item())


def test_hf_teacher_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megatron_kd.teacher.protocol import HFTeacher
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=S)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "hf")
    data = successor_data()
    build_cache(HFTeacher(tmp_path / "hf"), data, tmp_path / "c", encoding=EncodingOptions(top_k=K), progress=False)
    with torch.no_grad():
        logits = model(data[:, :-1]).logits
    want_lp, want_ids = torch.log_softmax(logits.double(), -1).topk(K)
    r = CacheReader(tmp_path / "c")
    got = np.stack([r[i]["topk_ids"] for i in range(N)])
    np.testing.assert_array_equal(got, want_ids.numpy())
