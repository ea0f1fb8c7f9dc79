"""SIGKILL the build (as a subprocess) at several points, restart it with the same command, and compare the cache
byte for byte with an uninterrupted build."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron_kd.cache import CacheReader, CallableTeacher, verify_cache

HERE = os.path.dirname(os.path.abspath(__file__))
V, H, S, N = 300, 16, 24, 9


def make_teacher(seed: int = 0, delay: float = 0.0):
    """A small deterministic causal teacher: hidden_t mixes token t's embedding with the mean of tokens <= t."""
    g = torch.Generator().manual_seed(seed)
    emb, out = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 2

    def forward(tokens):
        time.sleep(delay)
        e = emb[tokens]
        ctx = e.cumsum(1) / torch.arange(1, tokens.shape[1] + 1)[None, :, None]
        return torch.tanh(e + ctx), out

    return CallableTeacher(forward, V, name="toy", identity={"name": "toy", "config_hash": "0", "weights_hash": str(seed)})


def write_tokens(path):
    data = np.random.default_rng(3).integers(0, V, size=(N, S + 1)).astype(np.int64)
    np.save(path, data)
    return data


def build_cmd(out, tokens, *extra):
    return [sys.executable, "-m", "megatron_kd.cli.main", "cache", "build", "--out", str(out),
            "--teacher", "test_cache_resume:make_teacher", "--tokens", str(tokens), "--top-k", "8",
            "--samples-per-shard", "2", "--micro-batch-size", "2", "--no-progress", *extra]


def run(cmd, kill_at=None, **kw):
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MEGATRON_KD_CACHE_KILL_AT", None)
    if kill_at:
        env["MEGATRON_KD_CACHE_KILL_AT"] = kill_at
    return subprocess.run(cmd, env=env, capture_output=True, text=True, **kw)


def snapshot(path):
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = f.read()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    tokens = d / "tokens.npy"
    write_tokens(tokens)
    r = run(build_cmd(d / "cache", tokens, "--teacher-args", '{"seed": 0}'))
    assert r.returncode == 0, r.stderr
    assert "cache complete" in r.stdout
    return tokens, snapshot(d / "cache")


def test_reference_build_is_complete(reference):
    tokens, files = reference
    assert "manifest.json" in files and "samples.idx" in files
    assert sum(f.endswith(".bin") for f in files) == 5  # 9 samples, 2 per shard
    assert not any(f.endswith(".tmp") for f in files)


# Each restart dies at the next point (events count from the restart); then a last restart finishes.
# (where to die, what the disk then holds: committed sidecars, a .bin without sidecar or None, .tmp files)
KILLS = [
    ("sample:3", "mid-shard", 1, None, True),              # shard 0 done, shard 1 half written in its .tmp
    ("shard_data:2", "data committed, sidecar not", 2, 2, False),  # shards 1, 2 redone/done; 2's sidecar missing
    ("shard:1", "a shard fully committed", 3, None, False),  # shard 2 redone
    ("finalize:1", "samples.idx written, manifest not", 5, None, False),
]


@pytest.mark.slow
def test_sigkill_at_each_point_then_resume_is_byte_identical(tmp_path, reference):
    tokens, ref_files = reference
    out = tmp_path / "cache"
    cmd = build_cmd(out, tokens, "--teacher-args", '{"seed": 0}')
    for kill_at, what, sidecars, bare_bin, tmp_left in KILLS:
        r = run(cmd, kill_at=kill_at)
        assert r.returncode == -signal.SIGKILL, (what, r.returncode, r.stderr[-2000:])
        files = snapshot(out)
        assert sum(f.endswith(".json") and f.startswith("shards") for f in files) == sidecars, what
        if bare_bin is not None:
            assert f"shards/{bare_bin:06d}.bin" in files and f"shards/{bare_bin:06d}.json" not in files, what
        assert any(f.endswith(".bin.tmp") for f in files) == tmp_left, what
        assert "manifest.json" not in files, what
        with pytest.raises(ValueError, match="has not finished"):
            CacheReader(out)
    r = run(cmd)  # the same command once more
    assert r.returncode == 0, r.stderr[-2000:]
    files = snapshot(out)
    assert sorted(files) == sorted(ref_files)
    for name in files:
        assert files[name] == ref_files[name], f"{name} differs from the uninterrupted build"
    assert verify_cache(out) == []
    assert len(CacheReader(out)) == N


@pytest.mark.slow
def test_external_sigkill_at_a_random_moment(tmp_path, reference):
    """A slow teacher, killed by the test once a shard is committed and the next is being written."""
    tokens, ref_files = reference
    out = tmp_path / "cache"
    cmd = build_cmd(out, tokens, "--teacher-args", '{"seed": 0, "delay": 0.2}')
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (out / "shards" / "000001.json").exists():  # then at least 3 batches (0.6 s) remain
            assert proc.poll() is None and time.monotonic() < deadline, "the build ended before it could be killed"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists()
    r = run(build_cmd(out, tokens, "--teacher-args", '{"seed": 0, "delay": 0.0}'))
    # delay is not part of the teacher's identity: same settings, so the restart resumes.
    assert r.returncode == 0, r.stderr[-2000:]
    assert snapshot(out) == ref_files
