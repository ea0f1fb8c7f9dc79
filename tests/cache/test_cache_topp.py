"""Top-P caches (encoding topp): the selection rule, the encoding against the selection and against compact, a
built cache read back by sample and position range, TP=1 vs TP=2 builds, kill and resume, and verify against a
corrupted count."""
import json
import os
import zlib

import numpy as np
import pytest
import torch

from megatron_kd.cache import CacheReader, inspect_cache, verify_cache
from megatron_kd.cache.encoding import get_encoding
from megatron_kd.cache.encoding import EncodingOptions
from megatron_kd.cache.errors import CacheError
from megatron_kd.cache.topp import select_top_p, top_p_counts
from megatron_kd.teacher.protocol import CallableTeacher, TeacherOutput

from cache_options import encoding_kw
from dist_utils import run_ranks


def llm_rows(S, K, V, seed=0, steep=(0.5, 3.0)):
    """Top-K of LLM-like distributions: Zipf logits of random steepness plus noise over a random id order."""
    rng = np.random.default_rng(seed)
    n = min(V, 4 * K)
    z = -rng.uniform(*steep, (S, 1)) * np.log(np.arange(1, n + 1))[None] + rng.normal(0, 0.3, (S, n))
    ids = np.stack([rng.choice(V, n, replace=False) for _ in range(S)])
    lp = z - np.log(np.exp(z).sum(1, keepdims=True) * rng.uniform(1.0, 1.3, (S, 1)))  # some mass beyond the n
    o = np.argsort(-lp, 1, kind="stable")[:, :K]
    return np.take_along_axis(ids, o, 1), np.take_along_axis(lp, o, 1).astype(np.float32)


def reference_counts(ids, lp, P, min_k):
    """Plain loops: the fewest entries in (log-prob desc, id asc) order whose fp64 mass reaches P."""
    out = []
    for row_i, row_l in zip(ids, lp):
        pairs = sorted((-float(l), int(i)) for i, l in zip(row_i, row_l) if i >= 0 and l > -np.inf)
        mass, n = 0.0, len(pairs)
        for j, (nl, _) in enumerate(pairs):
            mass += np.exp(np.float64(np.float32(-nl)))
            if mass >= P:
                n = j + 1
                break
        out.append(min(max(n, min_k), len(pairs)))
    return np.array(out)


@pytest.mark.parametrize("P,min_k", [(0.5, 1), (0.9, 1), (0.99, 3), (0.999, 1), (1.0, 1)])
def test_selection_against_plain_loops(P, min_k):
    ids, lp = llm_rows(64, 20, 1000, seed=int(P * 1000) + min_k)
    perm = np.random.default_rng(1).permutation(20)
    sel_ids, sel_lp, counts = select_top_p(ids[:, perm], lp[:, perm], P, min_k)  # column order must not matter
    np.testing.assert_array_equal(counts, reference_counts(ids, lp, P, min_k))
    np.testing.assert_array_equal(counts, top_p_counts(np.sort(lp, 1)[:, ::-1], P, min_k))
    for r in range(len(ids)):
        c = counts[r]
        np.testing.assert_array_equal(sel_ids[r, :c], ids[r, :c])  # llm_rows gives them in canonical order
        assert (sel_ids[r, c:] == -1).all() and np.isneginf(sel_lp[r, c:]).all()
    assert 1 <= counts.min() and counts.max() <= 20


def test_ties_at_the_boundary_keep_the_smaller_id():
    # mass 0.5 + 0.25 + 0.25: P = 0.7 is reached by 0.5 and one of the two tied 0.25s; the smaller id (3) is kept
    lp = np.log(np.array([[0.25, 0.5, 0.25, 0.0001]], dtype=np.float32))
    for ids in (np.array([[9, 4, 3, 7]]), np.array([[3, 4, 9, 7]])):
        sel_ids, _, counts = select_top_p(ids, lp, 0.7)
        assert counts.tolist() == [2]
        assert sel_ids[0, :2].tolist() == [4, 3]
        # the order of the input columns does not matter either
        sel2, _, _ = select_top_p(ids[:, ::-1], lp[:, ::-1], 0.7)
        np.testing.assert_array_equal(sel2, sel_ids)
    # a tie that straddles the boundary: the cumulative mass in fp64, in canonical order
    lp = np.log(np.full((1, 4), 0.25, dtype=np.float32))
    sel_ids, _, counts = select_top_p(np.array([[8, 2, 6, 4]]), lp, 0.49)
    assert counts.tolist() == [2] and sel_ids[0, :2].tolist() == [2, 4]
    # empty input slots are never kept, and a row of fewer valid entries than min_k keeps what it has
    sel_ids, _, counts = select_top_p(np.array([[5, -1, -1, -1]]), np.log(np.array([[0.3, 1, 1, 1]], np.float32)),
                                      0.99, min_k=3)
    assert counts.tolist() == [1] and sel_ids[0].tolist() == [5, -1, -1, -1]


@pytest.mark.parametrize("V,K,P", [(201088, 100, 0.99), (201088, 100, 0.9), (300, 16, 0.999), (2, 2, 0.9)])
def test_encoding_round_trip(V, K, P):
    S = 96
    ids, lp = llm_rows(S, K, V, seed=K)
    enc = get_encoding("topp", V, K, S, top_p=P)
    buf = enc.encode(ids, lp)
    assert buf.size == enc.size_of(enc.counts(buf)) and enc.min_bytes <= buf.size <= enc.sample_bytes
    dec_ids, dec_lp = enc.decode(buf)
    sel_ids, sel_lp, counts = select_top_p(ids, lp, P)
    np.testing.assert_array_equal(enc.counts(buf), counts)
    np.testing.assert_array_equal((dec_ids >= 0).sum(1), counts)
    assert (np.isneginf(dec_lp) == (dec_ids < 0)).all()
    np.testing.assert_array_equal(np.sort(dec_ids, 1), np.sort(sel_ids, 1))
    # the decoded entries hold exactly the kept mass (what the tails need), in float64 to fp32 rounding
    kept = np.where(sel_ids >= 0, np.exp(sel_lp.astype(np.float64)), 0).sum(1)
    got = np.where(dec_ids >= 0, np.exp(dec_lp.astype(np.float64)), 0).sum(1)
    np.testing.assert_allclose(got, kept, rtol=2e-6)
    # each decoded log-prob within the quantization's reach of its fp32 value (grid step R / 31 / 126 refined)
    order = np.argsort(np.where(sel_ids >= 0, sel_ids, 1 << 40), 1)
    d_order = np.argsort(np.where(dec_ids >= 0, dec_ids, 1 << 40), 1)
    a = np.take_along_axis(sel_lp, order, 1)
    b = np.take_along_axis(dec_lp, d_order, 1)
    live = np.take_along_axis(sel_ids, order, 1) >= 0
    assert np.abs(np.where(live, a, 0) - np.where(live, b, 0)).max() < 0.25
    # sorted by log-prob, unused slots last; any position range decodes alone to the same rows
    assert (np.diff(np.where(np.isneginf(dec_lp), -1e30, dec_lp), axis=1) <= 0).all()
    for a_, b_ in ((0, S), (5, 6), (17, 60), (S - 1, S), (30, 30)):
        ri, rl = enc.decode(buf, a_, b_)
        np.testing.assert_array_equal(ri, dec_ids[a_:b_])
        np.testing.assert_array_equal(rl, dec_lp[a_:b_])


def test_min_k_at_k_decodes_as_compact():
    """min_k = K keeps every entry: the same codes as compact, so the same decoded rows."""
    V, K, S = 201088, 100, 40
    ids, lp = llm_rows(S, K, V, seed=3)
    topp = get_encoding("topp", V, K, S, top_p=0.5, min_k=K)
    compact = get_encoding("compact", V, K, S)
    a, b = topp.decode(topp.encode(ids, lp)), compact.decode(compact.encode(ids, lp))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_encoding_refuses_bad_settings():
    with pytest.raises(ValueError, match="top_p"):
        get_encoding("topp", 100, 10, 8)
    with pytest.raises(ValueError, match="topp"):
        get_encoding("compact", 100, 10, 8, top_p=0.9)
    with pytest.raises(ValueError, match="top_p=1.5"):
        get_encoding("topp", 100, 10, 8, top_p=1.5)
    with pytest.raises(ValueError, match="min_k=11"):
        get_encoding("topp", 100, 10, 8, top_p=0.9, min_k=11)


# --- built caches -----------------------------------------------------------------------------------------

V, H, S, N, K = 300, 16, 24, 9, 16


def toy_teacher(tp_group=None):
    """fp32 logits computed alike on every rank; TP rank r returns its half of the vocabulary."""
    g = torch.Generator().manual_seed(0)
    emb, out = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 3

    def forward(tokens):
        e = emb[tokens]
        z = torch.tanh(e + e.cumsum(1) / torch.arange(1, tokens.shape[1] + 1)[None, :, None]) @ out.t()
        if tp_group is None:
            return z
        r, n = torch.distributed.get_rank(tp_group), torch.distributed.get_world_size(tp_group)
        w = V // n
        return TeacherOutput(logits=z[..., r * w:(r + 1) * w].contiguous(), vocab_start_index=r * w)

    return CallableTeacher(forward, V, name="toy", identity={"name": "toy"}, tp_group=tp_group)


def tokens():
    return torch.randint(0, V, (N, S + 1), generator=torch.Generator().manual_seed(7))


def build(path, **kw):
    from megatron_kd.teacher.build import build_cache
    args = dict(top_k=K, encoding="topp", top_p=0.9, samples_per_shard=2, micro_batch_size=2, progress=False)
    args.update(kw)
    return build_cache(toy_teacher(), tokens(), path, **encoding_kw(args))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("topp")
    build(d / "topp")
    build(d / "fp16", encoding="fp16", top_p=None)
    return d


def test_built_cache_reads_the_selection_of_the_fp16_cache(built):
    r, ref = CacheReader(built / "topp"), CacheReader(built / "fp16")
    assert r.encoding == "topp" and r.top_p == 0.9 and len(r) == N
    m = r.manifest
    assert m["min_k"] == 1 and m["stats"]["kept_sum"] < N * S * K  # peaked rows: fewer than K kept
    kept = 0
    for i in range(N):
        x, y = r[i], ref[i]
        sel_ids, _, counts = select_top_p(y["topk_ids"], y["topk_logprobs"], 0.9)
        # the fp16 cache's rounding can move a boundary entry; the same ids almost everywhere
        same = (np.sort(x["topk_ids"], 1) == np.sort(sel_ids, 1)).all(1)
        assert same.mean() > 0.9
        kept += (x["topk_ids"] >= 0).sum()
        for a, b in ((0, 5), (7, S), (11, 12)):  # context-parallel reads
            part = r.read(i, a, b)
            np.testing.assert_array_equal(part["topk_ids"], x["topk_ids"][a:b])
            np.testing.assert_array_equal(part["topk_logprobs"], x["topk_logprobs"][a:b])
    assert kept == m["stats"]["kept_sum"]
    assert verify_cache(built / "topp") == []
    info = inspect_cache(built / "topp")
    total = sum(s["bytes"] for s in m["shards"])
    assert info["bytes_per_token"] == total / (N * S) < info["bytes_per_token_max"]
    assert info["kept_k_mean"] == kept / (N * S)
    # the preview from the fp16 cache predicts the top-P cache's kept count
    pv = inspect_cache(built / "fp16", top_p=(0.9,))["top_p_preview"]["per_top_p"]["0.9"]
    assert abs(pv["kept_k_mean"] - info["kept_k_mean"]) < 0.1


def test_tokens_dataset_reads_empty_slots(built):
    from megatron_kd.cache import TopKDataset
    ds = TopKDataset(tokens(), built / "topp")
    x = ds[3]
    assert x["topk_ids"].shape == (S, K) and (x["topk_ids"] == -1).any()
    assert torch.isneginf(x["topk_logprobs"][x["topk_ids"] < 0]).all()


def _reseal(path, i, buf):
    """Put new bytes for sample i and update every checksum (as if the encoder had written them)."""
    from megatron_kd.rules import file_sha256
    m = json.load(open(path / "manifest.json"))
    r = CacheReader(path)
    j, row = divmod(i, m["samples_per_shard"])
    off = r.shard_offsets(j)
    assert buf.size == off[row + 1] - off[row]
    shard = path / m["shards"][j]["file"]
    data = bytearray(shard.read_bytes())
    data[off[row]:off[row + 1]] = buf.tobytes()
    shard.write_bytes(bytes(data))
    idx = np.fromfile(path / "samples.idx", dtype=np.dtype([("h", "<u8"), ("c", "<u4"), ("r", "<u4")]))
    idx["c"][i] = zlib.crc32(buf.tobytes())
    idx.tofile(path / "samples.idx")
    side = json.load(open(path / "shards" / f"{j:06d}.json"))
    side["crc32"][row] = int(idx["c"][i])
    side["sha256"] = m["shards"][j]["sha256"] = file_sha256(shard)
    json.dump(side, open(path / "shards" / f"{j:06d}.json", "w"))
    m["sample_index"]["sha256"] = file_sha256(path / "samples.idx")
    json.dump(m, open(path / "manifest.json", "w"))


def test_verify_catches_a_count_that_disagrees_with_its_ids(tmp_path):
    """Two positions' counts swapped (the sample keeps its size and every checksum is redone): only decoding the
    sample against its counts can see it."""
    from megatron_kd.cache.bits import pack_uint
    build(tmp_path / "c")
    path = tmp_path / "c"
    r = CacheReader(path)
    enc = r._enc
    buf = np.array(r.raw(4))
    counts = enc.counts(buf)
    t = int(np.flatnonzero(np.diff(counts) != 0)[0])
    counts[t], counts[t + 1] = counts[t + 1], counts[t]
    bad = buf.copy()
    enc.header.view(bad, "counts")[:] = pack_uint(counts, enc.count_bits)
    _reseal(path, 4, bad)
    assert verify_cache(path, checksums=True) != []
    problems = verify_cache(path)
    assert len(problems) == 1 and "sample 4" in problems[0] and "does not decode" in problems[0], problems
    assert "000002.bin" in problems[0]
    with pytest.raises(CacheError, match="does not decode"):
        CacheReader(path)[4]
    assert CacheReader(path)[5]["topk_ids"].shape == (S, K)  # the other samples still read


def test_verify_catches_a_count_that_changes_the_sample(tmp_path):
    from megatron_kd.cache.bits import pack_uint
    build(tmp_path / "c")
    path = tmp_path / "c"
    r = CacheReader(path)
    buf = np.array(r.raw(2))
    counts = r._enc.counts(buf)
    counts[0] = counts[0] % K + 1
    bad = buf.copy()
    r._enc.header.view(bad, "counts")[:] = pack_uint(counts, r._enc.count_bits)
    _reseal(path, 2, bad)
    problems = verify_cache(path)
    assert len(problems) == 1 and "sample 2" in problems[0] and "does not decode" in problems[0], problems
    # a plain flipped byte (checksums not redone) fails the sha256 and the read's crc32
    build(tmp_path / "d")
    shard = tmp_path / "d" / "shards" / "000001.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0x10
    shard.write_bytes(bytes(data))
    assert any("sha256" in p for p in verify_cache(tmp_path / "d"))
    with pytest.raises(CacheError, match="crc32"):
        CacheReader(tmp_path / "d")[2]


def test_settings_of_another_top_p_are_refused_on_resume(tmp_path):
    build(tmp_path / "c")
    with pytest.raises(CacheError, match="top_p: cache has 0.9, this build asks for 0.99"):
        build(tmp_path / "c", top_p=0.99)
    with pytest.raises(CacheError, match="encoding 'topp'"):
        build(tmp_path / "e", encoding="compact", top_p=0.9)


def _tp_build(rank, world, out):
    from megatron_kd.teacher.build import build_cache
    build_cache(toy_teacher(tp_group=torch.distributed.group.WORLD), tokens(), os.path.join(out, f"tp{world}"),
                encoding=EncodingOptions.of("topp", K, top_p=0.9), samples_per_shard=2, micro_batch_size=2, progress=False)


@pytest.mark.slow
def test_tp1_and_tp2_builds_are_byte_identical(tmp_path):
    run_ranks(2, _tp_build, str(tmp_path))
    run_ranks(1, _tp_build, str(tmp_path))
    from test_cache_resume import snapshot
    a, b = snapshot(tmp_path / "tp1"), snapshot(tmp_path / "tp2")
    assert sorted(a) == sorted(b) and len([f for f in a if f.endswith(".bin")]) == 5
    for name in a:
        assert a[name] == b[name], f"{name} differs between TP=1 and TP=2"
    assert verify_cache(tmp_path / "tp2") == []
    assert json.loads(a["manifest.json"])["stats"]["kept_sum"] < N * S * K


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["sample:3", "shard:written:2", "shard:committed:1", "sidecar:committed:2"])
def test_killed_then_resumed_is_byte_identical(tmp_path, kill_at):
    """The top-P cache through the CLI (`cache build --top-p`), SIGKILLed then rerun with the same command."""
    import signal
    from test_cache_resume import _check_identical, build_cmd, run, snapshot, teacher_args, write_tokens
    tok = tmp_path / "tokens.npy"
    write_tokens(tok)
    ref = run(build_cmd(tmp_path / "ref", tok, "--top-p", "0.9", *teacher_args(0)))
    assert ref.returncode == 0, ref.stderr
    assert "encoding" not in ref.stderr and "top-P 0.9" in ref.stdout
    ref_files = snapshot(tmp_path / "ref")
    assert json.loads(ref_files["manifest.json"])["encoding"] == "topp"
    r = run(build_cmd(tmp_path / "c", tok, "--top-p", "0.9", *teacher_args(0, kill_at)))
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    r = run(build_cmd(tmp_path / "c", tok, "--top-p", "0.9", *teacher_args(0)))
    assert r.returncode == 0, r.stderr[-2000:]
    _check_identical(tmp_path / "c", ref_files)


def test_cli_refuses_top_p_with_a_fixed_encoding(tmp_path):
    from test_cache_resume import build_cmd, run, write_tokens
    tok = tmp_path / "tokens.npy"
    write_tokens(tok)
    r = run(build_cmd(tmp_path / "c", tok, "--encoding", "compact", "--top-p", "0.9"))
    assert r.returncode != 0 and "--top-p / --min-k need --encoding topp" in r.stderr
    assert not (tmp_path / "c").exists()


def test_inspect_and_verify_print_the_top_p_figures(built, capsys):
    from megatron_kd.cli.cache import main
    assert main(["inspect", str(built / "topp")]) == 0
    out = capsys.readouterr().out
    assert "encoding        topp:" in out and "top-P           P=0.9, min_k=1: kept ids per position mean" in out
    assert "dropped mass    mean" in out and "kept histogram  1:" in out
    assert main(["inspect", str(built / "fp16"), "--top-p", "0.9,0.99"]) == 0
    out = capsys.readouterr().out
    assert "top-1 probability mean" in out and "if --top-p 0.9 " in out and "if --top-p 0.99 " in out
    assert main(["verify", str(built / "topp")]) == 0
    assert "every sample's per-position counts" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--top-p '2': every P must be in"):
        main(["inspect", str(built / "fp16"), "--top-p", "2"])
