"""SIGKILL the build (as a subprocess) at several points, restart it with the same command, and compare the cache
byte for byte with an uninterrupted build."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron_kd.cache import CacheReader, fsio, verify_cache
from megatron_kd.teacher.protocol import CallableTeacher

HERE = os.path.dirname(os.path.abspath(__file__))
V, H, S, N = 300, 16, 24, 9


def install_kill(spec: str) -> None:
    """The writer's test seam: SIGKILL this process at the n-th fault point named event ("event:n")."""
    event, _, n = spec.rpartition(":")
    seen = [0]

    def hook(ev):
        if ev == event:
            seen[0] += 1
            if seen[0] == int(n):
                os.kill(os.getpid(), signal.SIGKILL)

    fsio.set_fault_hook(hook)


def make_teacher(seed: int = 0, delay: float = 0.0, kill_at: str | None = None):
    """A small deterministic causal teacher: hidden_t mixes token t's embedding with the mean of tokens <= t.
    kill_at="event:n" installs the writer's fault hook in this (build) process (not part of the identity)."""
    if kill_at:
        install_kill(kill_at)
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


def run(cmd, **kw):
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, **kw)


def teacher_args(seed=0, kill_at=None, delay=None):
    a = {"seed": seed}
    if kill_at:
        a["kill_at"] = kill_at
    if delay is not None:
        a["delay"] = delay
    return ["--teacher-args", json.dumps(a)]


def is_tmp(name):
    return name.endswith(fsio.TMP_SUFFIX)


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
    r = run(build_cmd(d / "cache", tokens, *teacher_args(0)))
    assert r.returncode == 0, r.stderr
    assert "cache complete" in r.stdout
    return tokens, snapshot(d / "cache")


def test_reference_build_is_complete(reference):
    tokens, files = reference
    assert "manifest.json" in files and "samples.idx" in files and "build.lock" in files
    assert sum(f.endswith(".bin") for f in files) == 5  # 9 samples, 2 per shard
    assert not any(is_tmp(f) for f in files)


# Each restart dies at the next point (events count from the restart); then a last restart finishes.
# (where to die, what the disk then holds: committed sidecars, a .bin without sidecar or None, temp files left)
KILLS = [
    ("sample:3", "mid-shard", 1, None, True),              # shard 0 done, shard 1 half written in its temp file
    ("shard:written:2", "shard 2 written and fsynced, not renamed", 2, None, True),  # 1 redone; 2's temp complete
    ("shard:committed:1", "data committed, sidecar not", 2, 2, False),  # shard 2 redone from a fresh temp file
    ("sidecar:written:1", "sidecar written, not renamed", 2, 2, True),
    ("sidecar:committed:1", "a shard fully committed", 3, None, False),
    ("index:written:1", "samples.idx written, not renamed", 5, None, True),
    ("index:committed:1", "samples.idx committed, manifest not", 5, None, False),
    ("manifest:written:1", "manifest written, not renamed", 5, None, True),
]


def _check_killed(r, out, what, sidecars, bare_bin, tmp_left, ref_files):
    assert r.returncode == -signal.SIGKILL, (what, r.returncode, r.stderr[-2000:])
    files = snapshot(out)
    for name, data in files.items():  # whatever is committed is already the uninterrupted build's bytes
        if name.endswith(".bin"):
            assert data == ref_files[name], f"{what}: committed {name} differs from the uninterrupted build"
    assert sum(f.endswith(".json") and f.startswith("shards") for f in files) == sidecars, what
    if bare_bin is not None:
        assert f"shards/{bare_bin:06d}.bin" in files and f"shards/{bare_bin:06d}.json" not in files, what
    assert any(is_tmp(f) for f in files) == tmp_left, what
    assert "manifest.json" not in files, what
    with pytest.raises(ValueError, match="has not finished"):
        CacheReader(out)


def _check_identical(out, ref_files):
    files = snapshot(out)
    assert sorted(files) == sorted(ref_files)
    for name in files:
        assert files[name] == ref_files[name], f"{name} differs from the uninterrupted build"
    assert verify_cache(out) == []
    assert len(CacheReader(out)) == N


@pytest.mark.slow
def test_sigkill_at_each_point_then_resume_is_byte_identical(tmp_path, reference):
    """Fails on a writer that appends to (or reuses) a leftover temp file: the kill between a shard's write and
    its rename leaves a complete temp file, and the restart must not build on it."""
    tokens, ref_files = reference
    out = tmp_path / "cache"
    for kill_at, what, sidecars, bare_bin, tmp_left in KILLS:
        r = run(build_cmd(out, tokens, *teacher_args(0, kill_at)))
        _check_killed(r, out, what, sidecars, bare_bin, tmp_left, ref_files)
    r = run(build_cmd(out, tokens, *teacher_args(0)))  # the same command once more
    assert r.returncode == 0, r.stderr[-2000:]
    _check_identical(out, ref_files)


# A first run killed at one point, then the same command finishes it.
FIRST_KILLS = ["lock:1", "temp_removed:1", "settings:written:1", "settings:committed:1", "sample:1",
               "shard:written:1", "manifest:committed:1"]


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", FIRST_KILLS)
def test_first_run_killed_then_resumed_is_byte_identical(tmp_path, reference, kill_at):
    tokens, ref_files = reference
    out = tmp_path / "cache"
    r = run(build_cmd(out, tokens, *teacher_args(0, kill_at)))
    assert r.returncode == -signal.SIGKILL, (kill_at, r.returncode, r.stderr[-2000:])
    r = run(build_cmd(out, tokens, *teacher_args(0)))
    assert r.returncode == 0, r.stderr[-2000:]
    _check_identical(out, ref_files)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["overwrite:shards_removed:1", "overwrite:removed:1", "sample:5"])
def test_overwrite_killed_then_rerun_never_keeps_old_rows(tmp_path, reference, kill_at):
    """--overwrite of another teacher's cache (seed 1) killed midway, then rerun: every row is the new teacher's."""
    tokens, ref_files = reference
    out = tmp_path / "cache"
    assert run(build_cmd(out, tokens, *teacher_args(1))).returncode == 0
    r = run(build_cmd(out, tokens, "--overwrite", *teacher_args(0, kill_at)))
    assert r.returncode == -signal.SIGKILL, (kill_at, r.returncode, r.stderr[-2000:])
    r = run(build_cmd(out, tokens, "--overwrite", *teacher_args(0)))
    assert r.returncode == 0, r.stderr[-2000:]
    _check_identical(out, ref_files)


@pytest.mark.slow
def test_external_sigkill_at_a_random_moment(tmp_path, reference):
    """A slow teacher, killed by the test once a shard is committed and the next is being written."""
    tokens, ref_files = reference
    out = tmp_path / "cache"
    cmd = build_cmd(out, tokens, *teacher_args(0, delay=0.2))
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (out / "shards" / "000001.json").exists():  # then at least 3 batches (0.6 s) remain
            assert proc.poll() is None, "the build ended before it could be killed"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists()
    r = run(build_cmd(out, tokens, *teacher_args(0, delay=0.0)))
    # delay is not part of the teacher's identity: same settings, so the restart resumes.
    assert r.returncode == 0, r.stderr[-2000:]
    assert snapshot(out) == ref_files
