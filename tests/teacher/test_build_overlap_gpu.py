"""On CUDA: the teacher pass's device-side pieces that CPU tests cannot reach.

- the wide-row block prefilter gives the plain path's bits on a GPT-OSS-wide vocabulary (201,088 ids, bf16);
- PendingTopK's flags and copy_to_host's copies are queued behind the top-K, so host_result() waits for that top-K
  only: it returns while a long kernel queued after it still runs (what lets the builder queue the next forward
  first), and its host copies equal result();
- tied chunks are still redone (host_result then hands out the device tensors), non-finite logits still raise;
- tokens_to queues the token copy (no stream sync), which a pageable .to() does not;
- the builder queues a micro-batch's top-K on a side stream: a host sync of the current stream (what the next
  forward's MoE routing does) returns while that top-K still runs, and its result equals the plain top-K's;
- a build on the GPU writes the bytes of a build that encodes and writes each sample before the next.
"""
import hashlib
import os
import time

import numpy as np
import pytest
import torch

from megatron_kd.parallel import topk as topk_ops
from megatron_kd.parallel.topk import start_topk, start_topk_from_hidden, topk_from_hidden
from topk_refs import plain

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]



def test_block_prefilter_matches_the_plain_path_on_a_201k_vocab():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(700, 256, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(201_088, 256, device="cuda", generator=g) / 8).to(torch.bfloat16)
    for k in (1, 100, 400):
        ids, lp = topk_from_hidden(h, w, k, chunk_size=333, valid_vocab_size=201_000)
        p_ids, p_lp = plain(topk_from_hidden, h, w, k, chunk_size=333, valid_vocab_size=201_000)
        assert torch.equal(ids, p_ids) and torch.equal(lp, p_lp)
    x = torch.randint(0, 6, (64, 201_088), device="cuda", generator=g).to(torch.bfloat16)  # ties everywhere
    x[5] = 1.0
    x[9, 12_345] = 9.0
    for chunk in (1, 64):
        ids, lp = start_topk(x, 100, chunk_size=chunk).result()
        p_ids, p_lp = plain(lambda: start_topk(x, 100, chunk_size=chunk).result())
        assert torch.equal(ids, p_ids) and torch.equal(lp, p_lp)
    vals, cols = topk_ops._block_topk(x.float() * torch.rand_like(x.float()), 125)
    assert vals.shape == (64, 125)


def test_host_result_waits_for_its_top_k_only():
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(2048, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(50_000, 128, device="cuda", generator=g).to(torch.bfloat16)
    ref_ids, ref_lp = topk_from_hidden(h, w, 50)
    torch.cuda.synchronize()
    pending = start_topk_from_hidden(h, w, 50).copy_to_host()
    torch.cuda._sleep(3_000_000_000)  # ~1.5 s of GPU time queued after the top-K: the next micro-batch's forward
    after = torch.cuda.Event()
    after.record()
    t = time.perf_counter()
    ids, lp, ready = pending.host_result()
    waited = time.perf_counter() - t
    assert not after.query(), "host_result waited for work queued after its top-K"
    assert waited < 0.5
    assert not ids.is_cuda and ids.is_pinned() and ids.dtype == torch.int32 and ready is not None
    ready.synchronize()
    assert torch.equal(ids.long(), ref_ids.cpu()) and torch.equal(lp, ref_lp.cpu())
    torch.cuda.synchronize()


def test_no_sync_while_queueing_and_the_flags_are_read_from_the_host_copy():
    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(1000, 64, device="cuda", generator=g)
    w = torch.randn(40_000, 64, device="cuda", generator=g)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = start_topk_from_hidden(h, w, 20, chunk_size=256).copy_to_host()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids, lp, ready = pending.host_result()
    ready.synchronize()
    e_ids, e_lp = topk_from_hidden(h, w, 20, chunk_size=256)
    assert torch.equal(ids.long(), e_ids.cpu()) and torch.equal(lp, e_lp.cpu())


def test_ties_are_redone_and_non_finite_logits_raise_on_the_host_path():
    x = torch.randn(12, 40_000, device="cuda")
    x[9] = 0.25  # a constant row: its chunk is redone over whole rows
    exact_ids, exact_lp = start_topk(x, 5, chunk_size=4).result()
    ids, lp, ready = start_topk(x, 5, chunk_size=4).copy_to_host().host_result()
    assert ready is None and ids.is_cuda  # the host copy went stale with the redo: the device tensors
    assert torch.equal(ids, exact_ids) and torch.equal(lp, exact_lp)
    assert ids[9].tolist() == [0, 1, 2, 3, 4]
    x[3, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        start_topk(x, 5, chunk_size=4).copy_to_host().host_result()


def test_tokens_to_queues_the_copy():
    from megatron_kd.teacher.protocol import tokens_to
    tokens = torch.randint(0, 1000, (1, 32768))
    torch.cuda._sleep(200_000_000)
    torch.cuda.set_sync_debug_mode("error")
    try:
        on = tokens_to(tokens, torch.device("cuda"))
        with pytest.raises(RuntimeError):  # the pageable copy this replaces: a stream sync (the test can fail)
            tokens.to("cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(on.cpu(), tokens)


def test_gpu_build_writes_the_sequential_bytes(tmp_path):
    from megatron_kd.cache.encoding import EncodingOptions
    from megatron_kd.cache.format import make_settings
    from megatron_kd.cache.writer import CacheWriter
    from megatron_kd.teacher.build import build_cache
    from megatron_kd.teacher.protocol import CallableTeacher, tokens_to
    V, H, S, N, K = 40_000, 32, 300, 7, 20
    ident = {"name": "t", "config_hash": "0", "weights_hash": "0"}
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(V, H, generator=g).cuda()
    out = (torch.randn(V, H, generator=g) * 2).cuda()

    def fn(t):
        return torch.tanh(emb[tokens_to(t, "cuda")]), out

    data = torch.from_numpy(np.random.default_rng(1).integers(0, V, size=(N, S + 1)))
    for enc in ("fp16", "compact"):
        build_cache(CallableTeacher(fn, V, identity=ident), data, str(tmp_path / enc),
                            encoding=EncodingOptions(enc, K), samples_per_shard=3, progress=False, dataset_id="d", chunk_size=128)
        seq = tmp_path / f"seq_{enc}"
        settings = make_settings(encoding=EncodingOptions(enc, K), vocab_size=V, temperature=1.0, seq_length=S, num_samples=N,
                                 teacher=ident, tokenizer="", dataset="d", samples_per_shard=3)
        w = CacheWriter(str(seq), settings)
        for j in range(w.num_shards):
            a, b = w.shard_range(j)
            sw = w.begin_shard(j)
            for i in range(a, b):
                tokens = data[i, :-1]
                ids, lp = topk_from_hidden(torch.tanh(emb[tokens.cuda()]), out, K, chunk_size=128)
                sw.add(ids.cpu(), lp.cpu(), tokens)
            sw.commit()
        w.finalize()
        w.close()
        for f in sorted(os.listdir(seq / "shards")):
            if f.endswith(".bin"):
                assert hashlib.sha256((seq / "shards" / f).read_bytes()).digest() == hashlib.sha256(
                    (tmp_path / enc / "shards" / f).read_bytes()).digest(), (enc, f)


def test_the_top_k_runs_beside_the_next_forward():
    from megatron_kd.teacher.build import _start_teacher_topk
    from megatron_kd.teacher.protocol import CallableTeacher
    V, H, N, K = 201_088, 512, 8192, 100
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(1024, H, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(V, H, generator=g).to("cuda", torch.bfloat16)

    def fn(t):
        # a forward still running on the current stream while the host queues the top-K: the top-K must wait for
        # it (its hidden states are made last), and is then still running when the sync below returns, unless that
        # sync also waited for the top-K (queued on the current stream). The sleep outlasts the host's queueing
        # of the top-K's chunks (checked below), else the top-K could end before the sync on either stream
        torch.cuda._sleep(2_000_000_000)
        return emb[t.reshape(-1)] * 1.0, w

    tokens = torch.randint(0, 1024, (1, N), generator=g).cuda()
    # four chunks: each queues about 70 kernels, and CUDA's command buffer holds about a thousand launches; a
    # top-K of the default 25 chunks fills it while its stream waits for the forward, and the host then blocks in
    # a launch until the forward ends, whichever stream the top-K is on (the profiler names it "Command Buffer
    # Full"), which is not what this test is after
    chunk = N // 4
    # once without the sleep: the first call compiles the top-K's Triton kernels on the host, which can outlast
    # any forward
    _start_teacher_topk(CallableTeacher(lambda t: (emb[t.reshape(-1)] * 1.0, w), V), tokens, K, 1.0, chunk,
                        None).result()
    torch.cuda.synchronize()
    p = _start_teacher_topk(CallableTeacher(fn, V), tokens, K, 1.0, chunk, None)
    assert not torch.cuda.current_stream().query(), "the forward ended before the top-K was queued: sleep longer"
    torch.cuda.current_stream().synchronize()  # what the next forward's host syncs do
    running = not p._flags_ready.query()
    ids, lp = p.result()
    ref_ids, ref_lp = topk_from_hidden(emb[tokens.reshape(-1)], w, K)
    assert torch.equal(ids, ref_ids) and torch.equal(lp, ref_lp)
    assert running, "the current stream's sync waited for the top-K: it was queued on the current stream"


def test_the_side_stream_check_fails_when_the_top_k_shares_the_stream(monkeypatch):
    """The test above against a builder that queues the top-K on the current stream: it must fail."""
    from megatron_kd.teacher import build
    monkeypatch.setattr(build, "_topk_stream", lambda x, group: None)
    with pytest.raises(AssertionError, match="queued on the current stream"):
        test_the_top_k_runs_beside_the_next_forward()
