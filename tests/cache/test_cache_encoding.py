"""Round trips of every encoding at V=201,088 (ids up to 201,087) and other vocabularies; measured bytes/token
and KL error against the fp32 values, asserted under the issue's targets where they apply."""
import numpy as np
import pytest
import torch

from megatron_kd.cache.bits import EliasFano, pack_uint, unpack_uint
from megatron_kd.cache.encoding import ENCODINGS, get_encoding
from megatron_kd.cache.encoding.base import id_bits

FIXED = tuple(e for e in ENCODINGS if e not in ("topp", "sampled"))  # K ids at every position; topp, sampled:
# test_cache_topp.py, test_cache_sampled.py (a variable number of ids per position)
from megatron_kd.cache.stats import kl_error

V_OSS = 201088
K = 100


def teacher_topk(n, vocab, k, seed=0, sharp=(0.7, 2.5)):
    """LLM-like next-token distributions: Zipf logits of random steepness over a random id order, plus noise.
    Returns fp32 top-K (ids, log-probs) and the full log-softmax (float64) for a student-side check."""
    g = torch.Generator().manual_seed(seed)
    alpha = torch.empty(n, 1).uniform_(*sharp, generator=g)
    z = -alpha * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))[None]
    z = z + 0.3 * torch.randn(n, vocab, generator=g)
    # A different id order per row, cheaply: rank r -> (a * r + b) mod V with a coprime to V.
    a = torch.tensor([next(x for x in range(int(s), int(s) + 10 * vocab) if np.gcd(x, vocab) == 1)
                      for s in torch.randint(1, 1 << 20, (n,), generator=g)])
    b = torch.randint(0, vocab, (n, 1), generator=g)
    perm = (a[:, None] * torch.arange(vocab)[None] + b) % vocab
    z = torch.empty_like(z).scatter_(1, perm, z)
    lsm = torch.log_softmax(z.double(), dim=1)
    lp, ids = lsm.topk(k, dim=1)
    return ids.numpy(), lp.float().numpy(), z


def student_error(ids, lp, dec_ids, dec_lp, student_logits):
    """Mean |change of the top-K KL loss| for a student that is not the teacher."""
    lq = torch.log_softmax(student_logits.double(), dim=1)
    def loss(i, l):
        l = torch.from_numpy(l).double()
        return (l.exp() * (l - lq.gather(1, torch.from_numpy(i)))).sum(1)
    return (loss(dec_ids, dec_lp) - loss(ids, lp)).abs().mean().item()


@pytest.fixture(scope="module")
def oss_rows():
    ids, lp, z = teacher_topk(96, V_OSS, K)
    assert ids.max() <= V_OSS - 1
    ids[0, 0], ids[1, 5] = V_OSS - 1, 0  # the extreme ids, in use
    student = z + torch.randn(z.shape, generator=torch.Generator().manual_seed(5))
    return ids, lp, student


# Measured on these rows (96 positions, K=100, V=201,088): bytes/token, mean KL error, mean student-loss error.
EXPECT = {"fp16": (425.0, 2e-4, 5e-4), "fp32": (625.0, 1e-12, 1e-12), "compact": (248.125, 1e-3, 1e-3)}


@pytest.mark.parametrize("name", FIXED)
def test_round_trip_gpt_oss_vocab(name, oss_rows):
    ids, lp, student = oss_rows
    s = ids.shape[0]
    enc = get_encoding(name, V_OSS, K, s)
    buf = enc.encode(ids, lp)
    assert buf.nbytes == enc.sample_bytes
    dec_ids, dec_lp = enc.decode(buf)
    assert dec_ids.dtype == np.int64 and dec_lp.dtype == np.float32 and dec_ids.shape == (s, K)
    # Ids are lossless; entries come back sorted by log-prob (the input's order, up to quantized ties).
    np.testing.assert_array_equal(np.sort(dec_ids, 1), np.sort(ids, 1))
    assert (np.diff(dec_lp, axis=1) <= 0).all()
    assert np.mean(dec_ids[:, 0] == ids[:, 0]) > 0.95

    bpt = get_encoding(name, V_OSS, K, 4096).bytes_per_token  # at a real sequence length (8-byte field padding)
    assert enc.bytes_per_token - bpt < 6 * 8 / s
    err = kl_error(ids, lp, dec_ids, dec_lp).mean()
    serr = student_error(ids, lp, dec_ids, dec_lp, student)
    print(f"\n{name}: {bpt:.3f} bytes/token, mean |KL error| {err:.2e} nats/token, "
          f"student-loss error {serr:.2e} nats/token")
    want_bpt, max_err, max_serr = EXPECT[name]
    assert bpt == want_bpt
    assert err < max_err and serr < max_serr
    if name == "compact":
        assert bpt <= 250  # the target at K=100 for V=201,088
        # renormalized to the stored covered mass
        np.testing.assert_allclose(np.exp(dec_lp.astype(np.float64)).sum(1), np.exp(lp.astype(np.float64)).sum(1),
                                   rtol=1e-5)
    # Positions [a, b) decode alone, identically.
    part_ids, part_lp = enc.decode(buf, 17, 60)
    np.testing.assert_array_equal(part_ids, dec_ids[17:60])
    np.testing.assert_array_equal(part_lp, dec_lp[17:60])


def test_sizes_per_vocabulary():
    assert id_bits(201088) == 18 and id_bits(128256) == 17 and id_bits(2) == 1 and id_bits(1) == 1
    assert id_bits(65536) == 16 and id_bits(65537) == 17
    assert get_encoding("fp16", 128256, 100, 4096).bytes_per_token == 100 * 2 + 100 * 17 / 8
    assert get_encoding("fp16", 201088, 100, 4096).bytes_per_token == 100 * 2 + 100 * 18 / 8
    assert get_encoding("compact", 128256, 100, 4096).bytes_per_token < 250


@pytest.mark.parametrize("name", FIXED)
@pytest.mark.parametrize("vocab,k", [(2, 1), (3, 3), (5, 2), (16, 16), (17, 4), (300, 7), (128256, 100)])
def test_round_trip_small_and_odd_shapes(name, vocab, k):
    ids, lp, _ = teacher_topk(9, vocab, k, seed=vocab + k)
    enc = get_encoding(name, vocab, k, 9)
    dec_ids, dec_lp = enc.decode(enc.encode(ids, lp))
    np.testing.assert_array_equal(np.sort(dec_ids, 1), np.sort(ids, 1))
    if name in ("fp16", "fp32"):
        np.testing.assert_array_equal(dec_ids, ids)
        np.testing.assert_array_equal(dec_lp, lp.astype(name.replace("fp", "float")).astype(np.float32))
    assert kl_error(ids, lp, dec_ids, dec_lp).mean() < 2e-3


@pytest.mark.parametrize("name", ["fp16", "fp32"])
def test_fp16_empty_slots_and_extreme_values(name):
    enc = get_encoding(name, 1000, 4, 3)
    ids = np.array([[5, 999, -1, -1], [0, 1, 2, 3], [7, 8, 9, -1]])
    lp = np.array([[-0.1, -2.5, 0, 0], [-1e-8, -70000.0, -1e5, -3.0], [-1, -2, -3, 0]], np.float32)
    dec_ids, dec_lp = enc.decode(enc.encode(ids, lp))
    np.testing.assert_array_equal(dec_ids, ids)  # empty stays empty; huge negatives keep their ids
    assert np.isneginf(dec_lp[ids < 0]).all() and np.isfinite(dec_lp[ids >= 0]).all()


def test_encoder_rejects_bad_rows():
    enc = get_encoding("compact", 50, 3, 2)
    good_ids = np.array([[1, 2, 3], [4, 5, 6]])
    good_lp = -np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="use encoding 'fp16'"):
        enc.encode(np.array([[1, 2, -1], [4, 5, 6]]), good_lp)
    with pytest.raises(ValueError, match="distinct"):
        enc.encode(np.array([[1, 1, 3], [4, 5, 6]]), good_lp)
    with pytest.raises(ValueError, match=r"\[-1, 49\]"):
        enc.encode(np.array([[1, 2, 50], [4, 5, 6]]), good_lp)
    with pytest.raises(ValueError, match="not logits"):
        enc.encode(good_ids, -good_lp)
    with pytest.raises(ValueError, match="shape"):
        enc.encode(good_ids[:1], good_lp[:1])
    with pytest.raises(ValueError, match="unknown cache encoding"):
        get_encoding("zstd", 50, 3, 2)


def test_bit_packing_every_width():
    rng = np.random.default_rng(0)
    for bits in range(1, 58):
        v = rng.integers(0, 1 << bits, size=37, dtype=np.uint64) if bits < 57 else rng.integers(0, 1 << 56, 37)
        v[0] = (1 << bits) - 1
        buf = pack_uint(v, bits)
        assert buf.nbytes == (37 * bits + 7) // 8
        np.testing.assert_array_equal(unpack_uint(buf, bits, 37), v.astype(np.int64))
        np.testing.assert_array_equal(unpack_uint(buf, bits, 5, 30), v[30:35].astype(np.int64))


def test_elias_fano_rows():
    rng = np.random.default_rng(1)
    for universe, k in ((201088, 100), (7, 7), (1000, 1), (64, 10)):
        rows = np.sort(np.stack([rng.choice(universe, k, replace=False) for _ in range(11)]), axis=1)
        ef = EliasFano(universe, k)
        low, up = ef.encode(rows)
        np.testing.assert_array_equal(ef.decode(low, up, 0, 11), rows)
        np.testing.assert_array_equal(ef.decode(low, up, 4, 3), rows[4:7])
    assert EliasFano(201088, 100).bits_per_row == 1297  # 12.97 bits per id, against 18 packed
