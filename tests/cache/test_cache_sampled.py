"""Sampled caches (encoding sampled): the counter hash against numpy, the draws against the float64 softmax
(chi-square and a float64 inverse-CDF on the same uniforms), the loss gradient's unbiasedness against the full
forward KL, the encoding round trip, a built cache through verify / inspect / the reader, the refusals, TP=1 vs
TP=2 byte-identical builds on real gloo groups, and kill -9 / resume through the CLI."""
import json
import os

import numpy as np
import pytest
import torch

from megatron_kd.cache import CacheReader, inspect_cache, verify_cache
from megatron_kd.cache.encoding import get_encoding
from megatron_kd.cache.encoding import EncodingOptions
from megatron_kd.cache.errors import CacheError
from megatron_kd.cache.format import make_settings
from megatron_kd.parallel.sample import (distinct_counts, log_frequencies, uniforms, uniforms_reference,
                                         vocab_parallel_sample)
from megatron_kd.teacher.protocol import CallableTeacher, TeacherOutput

from cache_options import encoding_kw
from dist_utils import run_ranks


def test_counter_hash_matches_numpy_uint64():
    sample = torch.tensor([0, 1, 2, 5, 1 << 40, (1 << 62) + 3])
    position = torch.tensor([0, 0, 7, 32767, 1, 1 << 20])
    for seed in (0, 1, (1 << 63) - 1):
        u = uniforms(seed, sample, position, 37)
        np.testing.assert_array_equal(u.numpy(), uniforms_reference(seed, sample.numpy(), position.numpy(), 37))
    u = uniforms(0, torch.arange(2000), torch.arange(2000) % 13, 64).numpy()
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert len(np.unique(u)) == u.size  # 53-bit values: no repeats among 128,000


def _softmax64(logits, T):
    x = logits.double() / T
    return torch.softmax(x, dim=-1).numpy()


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_draws_follow_the_float64_softmax(T):
    """64,000 draws from one 12-id distribution: a chi-square against the float64 softmax at T, and each draw
    equal to a float64 inverse CDF's on the same uniform (the integer weights move a boundary by ~1e-9 only)."""
    V, rows, N = 12, 4000, 16
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, -4.0, -6.0, 0.25]).float()
    x = logits.repeat(rows, 1)
    sample, position = torch.arange(rows) // 100, torch.arange(rows) % 100
    ids, lp = vocab_parallel_sample(x, N, sample, position, temperature=T)
    counts = np.rint(np.exp(lp.double().numpy()) * N).astype(np.int64)
    assert (counts.sum(1) == N).all()
    hist = np.zeros(V)
    np.add.at(hist, ids.numpy()[counts > 0], counts[counts > 0])
    p = _softmax64(logits, T)
    expected = p * rows * N
    chi2 = ((hist - expected) ** 2 / expected).sum()
    assert chi2 < 40.0, (chi2, hist, expected)  # df = 11: P(chi2 > 40) < 1e-4

    u = uniforms(0, sample, position, N).numpy()
    ref = np.searchsorted(np.cumsum(p), u, side="right")  # float64 inverse CDF, draw by draw
    ref_ids, ref_counts = distinct_counts(torch.from_numpy(ref))
    agree = (ref_ids.numpy() == ids.numpy()).all(1) & (ref_counts.numpy() == counts).all(1)
    assert agree.mean() > 0.999


def test_draws_do_not_depend_on_chunking_or_rows_around_them():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 97, generator=g) * 3
    sample, position = torch.arange(50) // 10, torch.arange(50) % 10
    a = vocab_parallel_sample(x, 8, sample, position)
    from megatron_kd.parallel.sample import start_sample
    b = start_sample(x, 8, sample, position, chunk_size=7).result()
    c = vocab_parallel_sample(x[20:35], 8, sample[20:35], position[20:35])
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert torch.equal(a[0][20:35], c[0]) and torch.equal(a[1][20:35], c[1])
    d = vocab_parallel_sample(x, 8, sample, position, seed=1)
    assert not torch.equal(a[0], d[0])  # another seed, other draws


def test_sampled_forward_kl_gradient_is_unbiased():
    """The gradient of the tail-none forward KL w.r.t. the student's logits with targets count / N, averaged over
    3,000 independent draws of N = 4, against the float64 full-vocabulary KL's (s - p); a top-K target of the same
    size is biased far beyond the tolerance, so the check can tell them apart."""
    from megatron_kd import topk_kl_loss
    V, M, N = 24, 3000, 4
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(V, generator=g, dtype=torch.float64) * 1.5
    student = torch.randn(V, generator=g, dtype=torch.float64)
    ids, lp = vocab_parallel_sample(teacher.float().repeat(M, 1), N, torch.zeros(M, dtype=torch.int64),
                                    torch.arange(M))
    eye = torch.eye(V, dtype=torch.float64)

    def grad(tids, tlp):
        h = student.repeat(len(tids), 1).requires_grad_(True)  # hidden @ I = the logits
        topk_kl_loss(h, eye, tids, tlp.double(), reduction="sum", impl="dense").backward()
        return h.grad.mean(0)

    p = torch.softmax(teacher, 0)
    full = torch.softmax(student, 0) - p
    est = grad(ids, lp)
    se = torch.sqrt(p * (1 - p) / (N * M))  # the standard error of the mean of count / N
    z = ((est - full).abs() / se.clamp(min=1e-12)).max().item()
    assert z < 4.5, z
    assert float((est - full).abs().sum()) < 0.05
    top = torch.log_softmax(teacher, 0).topk(N)
    biased = grad(top.indices.repeat(M, 1), top.values.float().repeat(M, 1))
    assert float((biased - full).abs().sum()) > 4 * float((est - full).abs().sum())


def _rows(S, V, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, V, generator=g) * torch.linspace(0.2, 6.0, S)[:, None]  # flat to peaked rows
    return vocab_parallel_sample(x, N, torch.zeros(S, dtype=torch.int64), torch.arange(S))


@pytest.mark.parametrize("V,N", [(2, 2), (300, 16), (201088, 8), (5000, 64)])
def test_encoding_round_trip_and_position_ranges(V, N):
    S = 41
    ids, lp = _rows(S, V, N)
    enc = get_encoding("sampled", V, N, S)
    buf = enc.encode(ids.numpy(), lp.numpy())
    assert enc.min_bytes <= buf.size <= enc.max_bytes and buf.size == enc.size_of((ids >= 0).sum(1).numpy())
    di, dl = enc.decode(buf)
    np.testing.assert_array_equal(di, ids.numpy())
    np.testing.assert_array_equal(dl, lp.numpy())
    for a, b in ((0, 1), (3, 17), (40, 41), (0, S)):
        pi, pl = enc.decode(buf, a, b)
        np.testing.assert_array_equal(pi, di[a:b])
        np.testing.assert_array_equal(pl, dl[a:b])
    # the input's column order does not matter: the same bytes
    perm = np.random.default_rng(0).permutation(N)
    assert np.array_equal(enc.encode(ids.numpy()[:, perm], lp.numpy()[:, perm]), buf)


def test_encoding_refuses_targets_that_are_not_draws():
    ids, lp = _rows(5, 100, 8)
    enc = get_encoding("sampled", 100, 8, 5)
    bad = lp.numpy().copy()
    bad[0, 0] -= 0.01
    with pytest.raises(ValueError, match="log\\(count / 8\\)"):
        enc.encode(ids.numpy(), bad)
    short = lp.numpy().copy()
    short[:, 1:] = -np.inf  # counts of the first id only: they no longer sum to N where a row had several ids
    with pytest.raises(ValueError, match="sum to samples=8|log\\(count"):
        enc.encode(ids.numpy(), short)


def test_a_corrupt_multiplicity_bitmap_is_detected():
    ids, lp = _rows(9, 100, 8)
    enc = get_encoding("sampled", 100, 8, 9)
    buf = enc.encode(ids.numpy(), lp.numpy())
    a = enc.header.offset["mult"]
    k0 = int((ids[0] >= 0).sum())
    bits = np.unpackbits(buf[a:a + 1], bitorder="little")
    flip = int(np.flatnonzero(bits == (0 if k0 < 8 else 1))[0])  # one more (or one fewer) id end in position 0
    buf[a] ^= np.uint8(1 << flip)
    with pytest.raises(ValueError, match="multiplicity bitmap"):
        enc.decode(buf)


V, H, S, NS, DRAWS = 300, 16, 24, 9, 8


def toy_teacher(tp_group=None, hidden_path=False):
    """fp32 logits alike on every rank; TP rank r returns its half of the vocabulary (logits or hidden + weight)."""
    g = torch.Generator().manual_seed(0)
    emb, out = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 3

    def forward(tokens):
        e = emb[tokens]
        h = torch.tanh(e + e.cumsum(1) / torch.arange(1, tokens.shape[1] + 1)[None, :, None])
        n = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        r = 0 if tp_group is None else torch.distributed.get_rank(tp_group)
        w = V // n
        if hidden_path:
            return h, out[r * w:(r + 1) * w]
        return TeacherOutput(logits=(h @ out.t())[..., r * w:(r + 1) * w].contiguous(), vocab_start_index=r * w)

    return CallableTeacher(forward, V, name="toy", identity={"name": "toy", "config_hash": "0", "weights_hash": "0"},
                           tp_group=tp_group)


def tokens():
    return torch.randint(0, V, (NS, S + 1), generator=torch.Generator().manual_seed(7))


def build(path, teacher=None, **kw):
    from megatron_kd.teacher.build import build_cache
    args = dict(samples=DRAWS, samples_per_shard=2, micro_batch_size=2, progress=False)
    args.update(kw)
    return build_cache(teacher or toy_teacher(), tokens(), path, **encoding_kw(args))


def test_built_cache_reads_verifies_and_inspects(tmp_path):
    m = build(tmp_path / "c")
    assert m["encoding"] == "sampled" and m["top_k"] == DRAWS and m["samples"] == DRAWS and m["sample_seed"] == 0
    assert verify_cache(tmp_path / "c") == []
    r = CacheReader(tmp_path / "c")
    teacher = toy_teacher()
    for i in (0, 4, 8):
        row = r[i]
        q = np.where(row["topk_ids"] >= 0, np.exp(row["topk_logprobs"].astype(np.float64)), 0.0)
        np.testing.assert_allclose(q.sum(1), 1.0, atol=1e-6)
        # the same draws as the sampler on this sample's logits, keyed by its index
        t = tokens()[i, :S][None]
        ids, lp = vocab_parallel_sample(teacher(t).logits[0], DRAWS, torch.full((S,), i), torch.arange(S))
        np.testing.assert_array_equal(row["topk_ids"], ids.numpy())
        np.testing.assert_array_equal(row["topk_logprobs"], lp.numpy())
        part = r.read(i, 5, 11)
        np.testing.assert_array_equal(part["topk_ids"], row["topk_ids"][5:11])
    info = inspect_cache(tmp_path / "c")
    assert info["samples"] == DRAWS and 1 <= info["kept_k_mean"] <= DRAWS
    assert info["bytes_per_token"] <= info["bytes_per_token_max"] and info["kl_error_max"] == 0.0
    # another micro-batch size and the hidden-state path: the same bytes
    build(tmp_path / "d", toy_teacher(hidden_path=True), micro_batch_size=3, chunk_size=5)
    from test_cache_resume import snapshot
    a, b = snapshot(tmp_path / "c"), snapshot(tmp_path / "d")
    assert [k for k in a if k.endswith(".bin")] and all(a[k] == b[k] for k in a if k.endswith(".bin"))
    # and another seed, other bytes
    m2 = build(tmp_path / "e", sample_seed=5)
    assert m2["sample_seed"] == 5 and m2["shards"][0]["sha256"] != m["shards"][0]["sha256"]


def test_verify_names_a_flipped_shard_byte(tmp_path):
    build(tmp_path / "c")
    f = tmp_path / "c" / "shards" / "000001.bin"
    data = bytearray(f.read_bytes())
    data[3] ^= 0x10
    f.write_bytes(bytes(data))
    problems = verify_cache(tmp_path / "c")
    assert problems and "000001" in problems[0]


def test_settings_refuse_what_makes_no_sense(tmp_path):
    base = dict(vocab_size=V, temperature=1.0, seq_length=S, num_samples=4, teacher={"name": "t"})
    with pytest.raises(CacheError, match="give samples"):
        make_settings(encoding=EncodingOptions("sampled", 8), **base)
    with pytest.raises(CacheError, match="use encoding 'sampled'"):
        make_settings(encoding=EncodingOptions.of("compact", 8, samples=8), **base)
    with pytest.raises(CacheError, match="top_k=8 cannot differ"):
        make_settings(encoding=EncodingOptions.of("sampled", 8, samples=16), **base)
    with pytest.raises(CacheError, match="sample_seed"):
        make_settings(encoding=EncodingOptions.of("fp16", 8, sample_seed=3), **base)
    with pytest.raises(CacheError, match=r"samples=0 must be an integer"):
        make_settings(encoding=EncodingOptions.of("sampled", 0, samples=0), **base)
    with pytest.raises(CacheError, match="top_k=100 cannot differ"):
        build(tmp_path / "x", top_k=100)
    build(tmp_path / "c")
    with pytest.raises(CacheError, match="samples: cache has 8, this build asks for 16"):
        build(tmp_path / "c", samples=16)


def test_training_refuses_losses_the_draws_do_not_estimate(tmp_path):
    build(tmp_path / "c")
    r = CacheReader(tmp_path / "c")
    r.check_compatible(top_k=DRAWS, tail="none", divergence="forward_kl", train_temperature=1.0, temperature=1.0)
    r.check_compatible(top_k=None)
    for kw, what in [({"top_k": 4}, "top_k: the run asks for K=4"), ({"tail": "bucket"}, "use tail none"),
                     ({"tail": "renormalize"}, "use tail none"), ({"divergence": "reverse_kl"}, "use forward_kl"),
                     ({"divergence": "jsd"}, "use forward_kl"), ({"train_temperature": 2.0}, "re-tempering")]:
        with pytest.raises(CacheError, match=what):
            r.check_compatible(**kw)


def test_recipe_check_names_the_kd_key(tmp_path):
    from megatron_kd.data.datasets import check_cache
    from megatron_kd.recipe.schema import DataConfig, KDConfig, RecipeError
    build(tmp_path / "c")
    kd = KDConfig(cache=str(tmp_path / "c"), divergence="reverse_kl", tail="bucket")
    with pytest.raises(RecipeError, match="kd.tail: the run uses tail='bucket'") as e:
        check_cache(CacheReader(tmp_path / "c"), kd, DataConfig(seq_length=S), None, V, 1)
    assert "kd.divergence: the run uses reverse_kl" in str(e.value)


def test_cli_refuses_conflicting_flags(tmp_path):
    from test_cache_resume import build_cmd, run, teacher_args, write_tokens
    tok = tmp_path / "tokens.npy"
    write_tokens(tok)
    r = run(build_cmd(tmp_path / "a", tok, "--samples", "8", *teacher_args(0)))  # build_cmd passes --top-k 8
    assert r.returncode != 0 and "--top-k does not apply to --samples" in r.stderr and "Traceback" not in r.stderr
    r = run(_sampled_cmd(tmp_path / "b", tok, "--encoding", "compact", *teacher_args(0)))
    assert r.returncode != 0 and "need --encoding sampled" in r.stderr and "Traceback" not in r.stderr


def _sampled_cmd(out, tok, *extra):
    from test_cache_resume import build_cmd
    cmd = build_cmd(out, tok, *extra)
    i = cmd.index("--top-k")
    return cmd[:i] + ["--samples", "8"] + cmd[i + 2:]


def test_cli_builds_verifies_and_inspects(tmp_path):
    from test_cache_resume import run, teacher_args, write_tokens
    tok = tmp_path / "tokens.npy"
    write_tokens(tok)
    r = run(_sampled_cmd(tmp_path / "c", tok, *teacher_args(0)))
    assert r.returncode == 0, r.stderr
    assert "8 draws per position" in r.stdout and "sampled" in r.stdout
    v = run([*_sampled_cmd("x", tok)[:3], "cache", "verify", str(tmp_path / "c")])
    assert v.returncode == 0 and "per-position" in v.stdout, v.stdout + v.stderr
    i = run([*_sampled_cmd("x", tok)[:3], "cache", "inspect", str(tmp_path / "c")])
    assert i.returncode == 0 and "N=8 draws per position" in i.stdout, i.stdout + i.stderr


def _tp_build(rank, world, out, hidden_path):
    from megatron_kd.teacher.build import build_cache
    build_cache(toy_teacher(torch.distributed.group.WORLD, hidden_path), tokens(),
                os.path.join(out, f"tp{world}"), encoding=EncodingOptions.of(samples=DRAWS), samples_per_shard=2, micro_batch_size=2,
                progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("hidden_path", [False, True])
def test_tp1_and_tp2_builds_are_byte_identical(tmp_path, hidden_path):
    run_ranks(2, _tp_build, str(tmp_path), hidden_path)
    run_ranks(1, _tp_build, str(tmp_path), hidden_path)
    from test_cache_resume import snapshot
    a, b = snapshot(tmp_path / "tp1"), snapshot(tmp_path / "tp2")
    assert sorted(a) == sorted(b) and len([f for f in a if f.endswith(".bin")]) == 5
    for name in a:
        assert a[name] == b[name], f"{name} differs between TP=1 and TP=2"
    assert verify_cache(tmp_path / "tp2") == []
    assert json.loads(a["manifest.json"])["stats"]["kept_sum"] < NS * S * DRAWS  # some draws repeat an id


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["sample:3", "shard:written:2", "sidecar:committed:2"])
def test_killed_then_resumed_is_byte_identical(tmp_path, kill_at):
    """`cache build --samples 8`, SIGKILLed then rerun with the same command: the draws are keyed by sample index
    and position, so the resumed shards hold the uninterrupted build's bytes."""
    import signal
    from test_cache_resume import _check_identical, run, snapshot, teacher_args, write_tokens
    tok = tmp_path / "tokens.npy"
    write_tokens(tok)
    ref = run(_sampled_cmd(tmp_path / "ref", tok, *teacher_args(0)))
    assert ref.returncode == 0, ref.stderr
    ref_files = snapshot(tmp_path / "ref")
    assert json.loads(ref_files["manifest.json"])["encoding"] == "sampled"
    r = run(_sampled_cmd(tmp_path / "c", tok, *teacher_args(0, kill_at)))
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    r = run(_sampled_cmd(tmp_path / "c", tok, *teacher_args(0)))
    assert r.returncode == 0, r.stderr[-2000:]
    _check_identical(tmp_path / "c", ref_files)


def test_log_frequencies_match_the_encodings():
    counts = torch.tensor([[3, 2, 2, 1, 0, 0, 0, 0]])
    enc = get_encoding("sampled", 50, 8, 1)
    np.testing.assert_array_equal(log_frequencies(counts, 8).numpy(), enc.log_frequencies(counts.numpy()))
