"""encode_sample over position blocks in parallel (the cache builder's workers) gives the whole-sample path's bytes,
statistics, checksum and token hash, for every fixed-size encoding, at lengths that are and are not multiples of
the block and of 8, with vocabularies whose ids need different bit widths."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from megatron_kd.cache.encoding import get_encoding
from megatron_kd.cache.writer import encode_sample, row_chunks


def _sample(g, seq, k, vocab, empties):
    ids = np.stack([g.choice(vocab, k, replace=False) for _ in range(seq)]).astype(np.int64)
    x = np.sort(g.standard_normal((seq, k)) * 3, axis=1)[:, ::-1]
    lp = (x - np.log(np.exp(x).sum(axis=1, keepdims=True)) - g.random((seq, 1)) * 0.5).astype(np.float32)
    if empties:  # fp16 stores empty slots (id -1) at the end of a row
        n = g.integers(0, k // 2, size=seq)
        for r in range(seq):
            if n[r]:
                ids[r, -n[r]:], lp[r, -n[r]:] = -1, -np.inf
    return ids, lp, g.integers(0, vocab, size=seq)


@pytest.mark.parametrize("encoding", ["fp16", "compact"])
@pytest.mark.parametrize("seq,block,k,vocab", [(1000, 64, 7, 300), (517, 16, 20, 70_000), (4096, 1024, 100, 128_256),
                                               (203, 40, 3, 201_088)])
def test_blocks_in_parallel_equal_the_whole_sample(encoding, seq, block, k, vocab, monkeypatch):
    from megatron_kd.cache import writer
    monkeypatch.setattr(writer, "ROW_BLOCK", block)
    g = np.random.default_rng(seq + k)
    enc = get_encoding(encoding, vocab, k, seq)
    ids, lp, tok = _sample(g, seq, k, vocab, empties=encoding == "fp16")
    chunks = writer.row_chunks(enc, seq, block)
    assert chunks is not None and len(chunks) >= 2 and all(a % 8 == 0 for a, _ in chunks)
    calls = []

    def run(fs):
        calls.append(len(fs))
        return list(pool.map(lambda f: f(), fs))
    with ThreadPoolExecutor(3) as pool:
        par = encode_sample(enc, seq, ids, lp, tok, run=run)
    assert calls == [len(chunks)] * 2  # the blocks were encoded, then checked
    ser = encode_sample(enc, seq, ids, lp, tok)
    assert par.buf.tobytes() == ser.buf.tobytes()
    assert par.stats == ser.stats and par.crc == ser.crc and par.token_hash == ser.token_hash


def test_variable_size_and_short_samples_are_one_block():
    assert row_chunks(get_encoding("topp", 1000, 10, 4096, top_p=0.9), 4096) is None
    assert row_chunks(get_encoding("fp16", 1000, 10, 100), 100) is None


def test_a_broken_block_placement_is_caught(monkeypatch):
    """If a block's bytes landed one byte off, the check decodes different ids and the sample is refused."""
    from megatron_kd.cache import writer
    monkeypatch.setattr(writer, "ROW_BLOCK", 64)
    g = np.random.default_rng(0)
    seq, k, vocab = 256, 5, 1000
    enc = get_encoding("fp16", vocab, k, seq)
    ids, lp, tok = _sample(g, seq, k, vocab, empties=False)
    real = writer._encode_rows

    def shifted(encoding, buf, ids, logp, a, b):
        real(encoding, buf, ids, logp, a, b)
        if a:
            at = encoding.fields.offset["ids"] + a * k * 10 // 8
            buf[at:at + 40] = np.roll(buf[at:at + 40], 1)
    monkeypatch.setattr(writer, "_encode_rows", shifted)
    with pytest.raises(AssertionError, match="decoded ids differ"):
        encode_sample(enc, seq, ids, lp, tok, run=lambda fs: [f() for f in fs])


def test_the_block_path_refuses_what_the_whole_path_refuses():
    """A sample with more positions than seq_length is refused in blocks too (the blocks slice rows, so the extra
    rows would otherwise be dropped); a block that is not a multiple of 8 positions is refused."""
    g = np.random.default_rng(1)
    seq, k, vocab = 4096, 4, 500
    enc = get_encoding("fp16", vocab, k, seq)
    ids, lp, tok = _sample(g, seq + 3, k, vocab, empties=False)
    for run in (None, lambda fs: [f() for f in fs]):
        with pytest.raises(ValueError, match=r"shape \[S, K\] = \[4096, 4\]"):
            encode_sample(enc, seq, ids, lp, tok[:seq], run=run)
    with pytest.raises(ValueError, match="multiple of 8"):
        row_chunks(enc, seq, 1020)
