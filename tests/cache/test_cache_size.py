"""The disk size a cache's settings predict (cache/space.py, printed by `megatron-kd cache build --dry-run`) against
the bytes a real CPU build writes: the binary files exactly for the fixed-size encodings (and for topp when every
position keeps K ids), within the predicted [low, high] for the variable-size ones; the JSON files beside them
within a stated allowance."""
import os
import re

import numpy as np
import pytest
import torch

from megatron_kd.cache.encoding import EncodingOptions
from megatron_kd.cache.format import MANIFEST, SAMPLE_INDEX, SHARD_DIR
from megatron_kd.cache.reader import load_manifest
from megatron_kd.cache.space import estimate_bytes
from megatron_kd.cli import cache as cache_cli
from megatron_kd.teacher.build import build_cache
from megatron_kd.teacher.protocol import CallableTeacher
from cache_options import encoding_kw

V, H, S, N, K = 300, 16, 24, 7, 12
JSON_ALLOWANCE = 16 << 10  # bytes of JSON per shard, plus the same once for settings.json and manifest.json


def make_teacher(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    emb, out = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 2

    def forward(tokens):
        e = emb[tokens]
        return torch.tanh(e + e.cumsum(1) / torch.arange(1, tokens.shape[1] + 1)[None, :, None]), out

    return CallableTeacher(forward, V, name="toy", identity={"name": "toy", "config_hash": "0", "weights_hash": "0"})


def tokens():
    return torch.randint(0, V, (N, S + 1), generator=torch.Generator().manual_seed(5))


def written(path):
    """(binary bytes: shards' .bin + samples.idx, JSON bytes: everything else)."""
    binary = os.path.getsize(os.path.join(path, SAMPLE_INDEX))
    shard_dir = os.path.join(path, SHARD_DIR)
    binary += sum(os.path.getsize(os.path.join(shard_dir, f)) for f in os.listdir(shard_dir) if f.endswith(".bin"))
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return binary, total - binary


BUILDS = {
    "fp16": dict(top_k=K),
    "fp32": dict(top_k=K),
    "compact": dict(top_k=K),
    "topp_all_k": dict(top_k=K, top_p=0.5, min_k=K),  # every position keeps K: the largest sample, exactly
    "topp": dict(top_k=K, top_p=0.9),
    "sampled": dict(samples=16),
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_estimate_matches_the_bytes_a_build_writes(tmp_path, name):
    out = tmp_path / "c"
    build_cache(make_teacher(), tokens(), out, samples_per_shard=3, micro_batch_size=2, progress=False,
                **encoding_kw(BUILDS[name]))
    m = load_manifest(out)
    est = estimate_bytes(m)
    binary, json_bytes = written(out)
    assert est["tokens"] == N * S and est["shards"] == 3
    if m["encoding"] in ("fp16", "fp32", "compact") or name == "topp_all_k":
        assert binary == est["high"], (name, binary, est)
    if m["encoding"] in ("fp16", "fp32", "compact"):
        assert est["low"] == est["high"]
    assert est["low"] <= binary <= est["high"], (name, binary, est)
    assert json_bytes <= JSON_ALLOWANCE * (est["shards"] + 1), json_bytes
    assert os.path.isfile(out / MANIFEST)


def test_fp16_estimate_is_the_documented_formula():
    """docs/choosing-a-cache.md: fp16 takes 2K + K * ceil(log2 V) / 8 bytes per token (each stream padded to 8 bytes
    per sample) plus 16 bytes per sample; fp32 4K instead of 2K."""
    from megatron_kd.cache.format import make_settings
    for enc, width in (("fp16", 2), ("fp32", 4)):
        for v, k, s, n in ((128256, 100, 4096, 10), (201088, 64, 1000, 3), (300, 12, 24, 7)):
            st = make_settings(encoding=EncodingOptions(enc, k), vocab_size=v, temperature=1.0, seq_length=s, num_samples=n,
                               teacher="t")
            bits = int(np.ceil(np.log2(v)))
            pad8 = lambda b: -(-b // 8) * 8  # noqa: E731
            per_sample = pad8(width * s * k) + pad8(-(-s * k * bits // 8))
            assert estimate_bytes(st)["high"] == n * (per_sample + 16)


def cli_build(tmp_path, *extra):
    return cache_cli.main(["build", "--out", str(tmp_path / "c"), "--tokens", str(tmp_path / "t.npy"),
                           "--samples-per-shard", "3", "--micro-batch-size", "2", "--no-progress", *extra])


@pytest.mark.parametrize("flags", [["--top-k", str(K)], ["--top-k", str(K), "--encoding", "compact"],
                                   ["--samples", "8"]])
def test_dry_run_prints_what_the_build_then_writes(tmp_path, capsys, flags):
    np.save(tmp_path / "t.npy", tokens().numpy())
    assert cli_build(tmp_path, "--teacher", "test_cache_size:make_teacher", "--vocab-size", str(V), "--dry-run",
                     *flags) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "c").exists(), "a dry run wrote the cache directory"
    disk = next(line for line in out.splitlines() if line.startswith("disk"))
    m = re.match(r"disk\s+(?:between ([\d,]+) and )?([\d,]+) bytes", disk)
    nums = [int(x.replace(",", "")) for x in m.groups() if x]
    assert cli_build(tmp_path, "--teacher", "test_cache_size:make_teacher", *flags) == 0
    binary, _ = written(tmp_path / "c")
    if len(nums) == 2:  # variable size: between low and high
        assert nums[0] <= binary <= nums[1], (out, binary)
    else:
        assert nums[0] == binary, (out, binary)


def test_dry_run_refuses_what_the_build_refuses(tmp_path, capsys):
    np.save(tmp_path / "t.npy", tokens().numpy())
    for extra in (["--top-k", str(V + 1)], ["--num-samples", str(N + 1)]):
        msgs = []
        for dry in (["--dry-run", "--vocab-size", str(V)], []):
            try:
                rc = cli_build(tmp_path, "--teacher", "test_cache_size:make_teacher", *extra, *dry)
                msgs.append(capsys.readouterr().err.strip() if rc else f"rc {rc}")
            except SystemExit as e:
                msgs.append(str(e.code))
        assert msgs[0] == msgs[1] and msgs[0].startswith("error: "), msgs
    with pytest.raises(SystemExit, match="--vocab-size V"):
        cli_build(tmp_path, "--teacher", "test_cache_size:make_teacher", "--dry-run")
    with pytest.raises(SystemExit, match="add --dry-run"):
        cli_build(tmp_path, "--teacher", "test_cache_size:make_teacher", "--vocab-size", str(V))


def test_dry_run_of_a_recipe_checks_its_teacher_and_counts_its_samples(tmp_path, capsys):
    from megatron_kd.teacher.factories import recipe_dataset
    ov = ["train.iters=2", f"train.save={tmp_path}/run"]
    with pytest.raises(SystemExit, match="teacher.load is not set"):
        cache_cli.main(["build", "--out", str(tmp_path / "c"), "--recipe", "tiny_cpu", "--dry-run", *ov])
    assert cache_cli.main(["build", "--out", str(tmp_path / "c"), "--recipe", "tiny_cpu", "--dry-run", "--top-k", "4",
                           *ov, "teacher.load=nowhere"]) == 0
    ds = recipe_dataset("tiny_cpu", ov)
    n_tokens = len(ds) * int(ds[0]["tokens"].numel())
    assert f"= {n_tokens:,} tokens; K=4" in capsys.readouterr().out
    assert not (tmp_path / "c").exists()
