"""The builder's host side (teacher.sink: encoding on worker threads, appends in sample order, shards committed
after their last sample) writes the bytes of a build that encodes and writes each sample before the next: checked
against such a build made here with the cache writer alone, for both encodings, several micro-batch sizes and
shards. A failure on a worker thread stops the build with the worker's error, leaves no temporary file and no
half shard, and the rerun finishes byte-identical."""
import hashlib
import os

import numpy as np
import pytest
import torch

from megatron_kd.cache.encoding import EncodingOptions
from megatron_kd.cache.encoding.fp16 import Fp16Encoding
from megatron_kd.cache.errors import CacheError
from megatron_kd.cache.format import make_settings
from megatron_kd.cache.writer import CacheWriter
from megatron_kd.parallel.topk import topk_from_hidden
from megatron_kd.teacher import sink as sink_mod
from megatron_kd.teacher.build import build_cache
from megatron_kd.teacher.protocol import CallableTeacher

V, H, S, N, K = 300, 16, 24, 7, 12
IDENT = {"name": "t", "config_hash": "0", "weights_hash": "0"}


def teacher():
    g = torch.Generator().manual_seed(0)
    emb, out = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 2
    return CallableTeacher(lambda t: (torch.tanh(emb[t]), out), V, name="t", identity=IDENT), emb, out


def data():
    return torch.from_numpy(np.random.default_rng(1).integers(0, V, size=(N, S + 1)))


def digest(path):
    out = {}
    for d, _, files in os.walk(path):
        for f in sorted(files):
            if not f.endswith(".lock"):
                out[os.path.relpath(os.path.join(d, f), path)] = hashlib.sha256(
                    open(os.path.join(d, f), "rb").read()).hexdigest()
    return out


def sequential(path, enc, sps, emb, out):
    """Each sample's top-K encoded and written before the next one is computed (the cache writer alone)."""
    tokens = data()[:, :-1]
    settings = make_settings(encoding=EncodingOptions(enc, K), vocab_size=V, temperature=1.0, seq_length=S, num_samples=N,
                             teacher=IDENT, tokenizer="", dataset="d", samples_per_shard=sps)
    w = CacheWriter(path, settings)
    for j in range(w.num_shards):
        a, b = w.shard_range(j)
        sw = w.begin_shard(j)
        for i in range(a, b):
            ids, lp = topk_from_hidden(torch.tanh(emb[tokens[i]]), out, K)
            sw.add(ids, lp, tokens[i])
        sw.commit()
    w.finalize()
    w.close()


@pytest.mark.parametrize("enc", ["fp16", "compact"])
@pytest.mark.parametrize("mbs,sps,workers", [(1, 3, 1), (2, 2, 3), (3, 7, 2)])
def test_pipelined_build_writes_the_sequential_bytes(tmp_path, monkeypatch, enc, mbs, sps, workers):
    monkeypatch.setattr(sink_mod, "_workers", lambda: workers)
    t, emb, out = teacher()
    build_cache(t, data(), tmp_path / "built", encoding=EncodingOptions(enc, K), samples_per_shard=sps, micro_batch_size=mbs,
                progress=False, dataset_id="d")
    sequential(tmp_path / "ref", enc, sps, emb, out)
    assert digest(tmp_path / "built") == digest(tmp_path / "ref")


def test_a_worker_error_stops_the_build_and_the_rerun_is_identical(tmp_path, monkeypatch):
    monkeypatch.setattr(sink_mod, "_workers", lambda: 2)
    t, emb, out = teacher()
    real = Fp16Encoding.encode
    calls = []

    def failing(self, ids, logp):
        calls.append(1)
        if len(calls) == 4:  # sample 3: shard 1 (samples 2, 3) fails, shard 0 is kept
            raise CacheError("disk said no")
        return real(self, ids, logp)

    monkeypatch.setattr(Fp16Encoding, "encode", failing)
    with pytest.raises(CacheError, match="disk said no"):
        build_cache(t, data(), tmp_path / "c", encoding=EncodingOptions(top_k=K), samples_per_shard=2, progress=False,
                    dataset_id="d")
    files = sorted(os.listdir(tmp_path / "c" / "shards"))
    assert not [f for f in files if f.endswith(".tmp")]
    assert "000000.bin" in files and "000001.bin" not in files and "manifest.json" not in os.listdir(tmp_path / "c")
    monkeypatch.setattr(Fp16Encoding, "encode", real)
    build_cache(t, data(), tmp_path / "c", encoding=EncodingOptions(top_k=K), samples_per_shard=2, progress=False,
                    dataset_id="d")
    build_cache(t, data(), tmp_path / "clean", encoding=EncodingOptions(top_k=K), samples_per_shard=2,
                progress=False, dataset_id="d")
    assert digest(tmp_path / "c") == digest(tmp_path / "clean")
