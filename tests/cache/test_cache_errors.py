"""Corrupt, truncated or incomplete caches and mismatched runs: each fails with an error that names the fix,
nothing already written is lost, and the named fix works."""
import json
import os

import numpy as np
import pytest
import torch

from megatron_kd.cache import CacheError, CacheReader, TopKDataset, verify_cache
from megatron_kd.cache.encoding import EncodingOptions
from megatron_kd.teacher.build import build_cache
from megatron_kd.cli.cache import main as cache_cli
from cache_options import encoding_kw
from test_cache_resume import N, S, V, make_teacher, snapshot

K = 8


def _data():
    return torch.from_numpy(np.random.default_rng(3).integers(0, V, size=(N, S + 1)))


def build(out, **kw):
    kw = {"top_k": K, "samples_per_shard": 2, "micro_batch_size": 2, "progress": False, **kw}
    return build_cache(make_teacher(), _data(), out, **encoding_kw(kw))


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_corrupt_shard(cache, cache_bytes, capsys):
    out = cache
    _flip_byte(out / "shards" / "000001.bin", 40)
    problems = verify_cache(out)
    assert len(problems) == 1
    assert "shards/000001.bin" in problems[0] and "corrupt" in problems[0] and "000001.json" in problems[0]
    assert cache_cli(["verify", str(out)]) == 1
    assert "shard shards/000001.bin fails its sha256 check" in capsys.readouterr().err
    r = CacheReader(out)
    r[0], r[1], r[4]  # other shards read fine
    with pytest.raises(CacheError, match=r"shards/000001.bin: sample 2 fails its crc32.*delete"):
        r[2]
    bad = snapshot(out)
    # The fix the message names: delete the shard and its sidecar, rerun the same build.
    os.remove(out / "shards" / "000001.bin")
    os.remove(out / "shards" / "000001.json")
    build(out)
    assert snapshot(out) == cache_bytes
    assert {k: v for k, v in bad.items() if k != "shards/000001.bin"} == \
        {k: v for k, v in cache_bytes.items() if k != "shards/000001.bin"}, "verify/read must not touch the cache"
    assert cache_cli(["verify", str(out)]) == 0


def test_truncated_shard(cache, cache_bytes):
    out = cache
    p = out / "shards" / "000002.bin"
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 10)
    with pytest.raises(CacheError, match=r"shard shards/000002.bin has \d+ bytes.*truncated"):
        CacheReader(out)
    assert any("shards/000002.bin" in x and "truncated" in x for x in verify_cache(out))
    build(out)  # a rerun recomputes just that shard (its size is wrong, so it is not done)
    assert snapshot(out) == cache_bytes


def test_missing_manifest(cache, cache_bytes):
    out = cache
    os.remove(out / "manifest.json")
    with pytest.raises(CacheError, match=r"no manifest.json: its build has not finished \(5 of 5 shards done\); "
                                         r"rerun the command that built"):
        CacheReader(out)
    assert cache_cli(["verify", str(out)]) == 1
    assert cache_cli(["inspect", str(out)]) == 0  # reports progress instead
    build(out)
    assert snapshot(out) == cache_bytes


def test_unreadable_manifest_and_not_a_cache(cache, tmp_path):
    out = cache
    with open(out / "manifest.json", "w") as f:
        f.write("{not json")
    with pytest.raises(CacheError, match="not valid JSON.*delete it"):
        CacheReader(out)
    with pytest.raises(CacheError, match="does not exist; build it"):
        CacheReader(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CacheError, match="not a cache directory"):
        CacheReader(tmp_path / "empty")
    m = json.loads((out / "settings.json").read_text())
    m["format_version"] = 99
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CacheError, match="format_version 99.*rebuild"):
        CacheReader(out)


def test_wrong_k_vocab_temperature_seq(cache):
    out = cache
    r = CacheReader(out)
    r.check_compatible(vocab_size=V, top_k=K, temperature=1.0, seq_length=S)
    r.check_compatible(top_k=K - 3)  # fewer entries than cached is fine
    cases = [({"top_k": K + 1}, r"top_k: .*K=9.*K=8.*--top-k 9"),
             ({"vocab_size": V + 5}, r"vocabulary: the teacher's is 300 ids, the student's is 305.*tokenizer"),
             ({"temperature": 2.0}, r"captured at T=1.0.*T=2.0.*--temperature 2.0"),
             ({"seq_length": S * 2}, r"seq_length: .*24 positions.*48")]
    for kw, pattern in cases:
        with pytest.raises(CacheError, match=pattern):
            r.check_compatible(**kw)
    with pytest.raises(CacheError, match="top_k"):
        TopKDataset(_data(), r, top_k=K + 1)
    ds = TopKDataset(_data(), r, top_k=3)
    assert ds[0]["topk_ids"].shape == (S, 3)


def test_token_mismatch(cache):
    out = cache
    r = CacheReader(out)
    data = _data()
    r.check_tokens(3, data[3, :-1])
    other = data.clone()
    other[3, 5] += 1
    with pytest.raises(CacheError, match=r"sample 3: token hash .* does not match.*data seed/shuffle.*rebuild"):
        r.check_tokens(3, other[3, :-1])
    with pytest.raises(CacheError, match="seq_length=24"):
        r.check_tokens(3, data[3])
    ds = TopKDataset(other, r)
    ds[2]
    with pytest.raises(CacheError, match="sample 3: token hash"):
        ds[3]
    shuffled = data[torch.tensor([1, 0] + list(range(2, N)))]  # another data order (seed)
    with pytest.raises(CacheError, match="sample 0: token hash"):
        TopKDataset(shuffled, r)[0]


def test_refuses_to_overwrite_with_other_settings(cache, cache_bytes):
    out = cache
    with pytest.raises(CacheError, match=r"(?s)finished cache built with different settings:\n  top_k: cache has 8, "
                                         r"this build asks for 4.*--overwrite"):
        build(out, top_k=4)
    with pytest.raises(CacheError, match=r"temperature: cache has 1.0, this build asks for 2.0"):
        build(out, temperature=2.0)
    with pytest.raises(CacheError, match=r"teacher: cache has"):
        build_cache(make_teacher(seed=1), _data(), out, encoding=EncodingOptions(top_k=K), samples_per_shard=2,
                    progress=False)
    assert snapshot(out) == cache_bytes, "a refused build must not change the cache"
    assert build(out)["top_k"] == K  # the same settings: already complete, nothing rewritten
    assert snapshot(out) == cache_bytes
    m = build(out, top_k=4, overwrite=True)
    assert m["top_k"] == 4 and CacheReader(out)[0]["topk_ids"].shape == (S, 4)


def test_refuses_to_continue_a_partial_build_with_other_settings(tmp_path):
    out = tmp_path / "cache"
    build(out, num_samples=4)  # finished with 4 samples
    os.remove(out / "manifest.json")
    os.remove(out / "shards" / "000001.json")  # now a partial build: 1 of 2 shards done
    before = snapshot(out)
    with pytest.raises(CacheError, match=r"(?s)partial build built with different settings.*num_samples: cache has 4"):
        build(out, num_samples=N)
    assert snapshot(out) == before
