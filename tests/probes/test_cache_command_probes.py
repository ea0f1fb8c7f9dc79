"""Adversarial `cache build` / `cache inspect`, top-P caches met during training, `teacher.load`, `demo`, `plan`:
ids outside the vocabulary, unknown factory keys, negative counts, a corrupt shard, empty or half-written
checkpoints, a top-K above the vocabulary, K = 0. One sentence naming the flag or key, before any work."""
import json
import os

import numpy as np
import pytest

from megatron_kd.cache.encoding import EncodingOptions
from megatron_kd.cli import cache as cache_cli
from megatron_kd.cli import demo as demo_cli
from megatron_kd.cli import plan as plan_cli
from megatron_kd.cli import train as train_cli
from probe import TINY, call, outcome, refuses

TOY = "test_cache_resume:make_teacher"  # tests/cache: V=300, a deterministic causal toy teacher
V = 300


@pytest.fixture(autouse=True)
def toy_teacher_importable(monkeypatch):
    import sys
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "cache"))
    yield sys


def tokens(tmp_path, data) -> str:
    p = tmp_path / "tokens.npy"
    np.save(p, np.asarray(data))
    return str(p)


def build(tmp_path, tok, *more):
    return ["build", "--out", str(tmp_path / "cache"), "--teacher", TOY, "--tokens", tok, "--top-k", "4",
            "--no-progress", *more]


@pytest.mark.parametrize("bad", [V, -2, 10**9])
def test_cache_build_tokens_outside_the_vocabulary(tmp_path, bad):
    data = np.zeros((3, 9), dtype=np.int64)
    data[1, 4] = bad
    refuses(cache_cli.main, build(tmp_path, tokens(tmp_path, data)), "--tokens")
    assert not (tmp_path / "cache" / "shards").exists() or not os.listdir(tmp_path / "cache" / "shards")


def test_cache_build_tokens_of_floats(tmp_path):
    refuses(cache_cli.main, build(tmp_path, tokens(tmp_path, np.full((3, 9), 0.5))), "--tokens")


def test_cache_build_tokens_not_npy(tmp_path):
    p = tmp_path / "tokens.npy"
    p.write_bytes(b"\x00\x01binary junk")
    refuses(cache_cli.main, build(tmp_path, str(p)), "--tokens")


def test_cache_build_unknown_teacher_args_key(tmp_path):
    tok = tokens(tmp_path, np.zeros((3, 9), dtype=np.int64))
    refuses(cache_cli.main, build(tmp_path, tok, "--teacher-args", '{"sede": 1}'), "--teacher-args", "sede")


@pytest.mark.parametrize("flag,value", [("--top-k", "0"), ("--top-k", "-3"), ("--num-samples", "-1"),
                                        ("--micro-batch-size", "0"), ("--samples-per-shard", "0"),
                                        ("--temperature", "nan"), ("--temperature", "-1"), ("--chunk-size", "0")])
def test_cache_build_a_count_that_is_none(tmp_path, flag, value):
    tok = tokens(tmp_path, np.zeros((3, 9), dtype=np.int64))
    args = [a for a in build(tmp_path, tok) if a not in ("--top-k", "4")] + [flag, value]
    if flag != "--top-k":
        args += ["--top-k", "4"]
    refuses(cache_cli.main, args, flag)


def test_cache_build_top_k_above_the_vocabulary(tmp_path):
    tok = tokens(tmp_path, np.zeros((3, 9), dtype=np.int64))
    args = [a for a in build(tmp_path, tok) if a not in ("--top-k", "4")] + ["--top-k", str(V + 1)]
    refuses(cache_cli.main, args, "--top-k")


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cache"))
    d = tmp_path_factory.mktemp("cache")
    np.save(d / "tokens.npy", np.random.default_rng(0).integers(0, V, size=(4, 9)))
    rc, _, err, exc = call(cache_cli.main, ["build", "--out", str(d / "cache"), "--teacher", TOY, "--tokens",
                                            str(d / "tokens.npy"), "--top-k", "4", "--no-progress"])
    assert rc == 0 and exc is None, err
    return d / "cache"


@pytest.mark.parametrize("n", ["-1", "0"])
def test_cache_inspect_max_samples_none(small_cache, n):
    refuses(cache_cli.main, ["inspect", str(small_cache), "--max-samples", n], "--max-samples")


def test_cache_inspect_of_no_cache(tmp_path):
    refuses(cache_cli.main, ["inspect", str(tmp_path)], str(tmp_path))


def test_cache_verify_of_a_missing_dir(tmp_path):
    refuses(cache_cli.main, ["verify", str(tmp_path / "nothing")], "nothing")


# --- a corrupt top-P shard met during training: the reader's message, no traceback -------------------------------

def test_a_corrupt_topp_shard_met_in_training(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mock = ["data=mock", "data.vocab_size=250", "data.seq_length=16", "kd.top_k=4", *TINY,
            "kd.cache_encoding=topp", "kd.cache_top_p=0.9", f"kd.cache={tmp_path / 'cache'}"]
    rc, _, err, exc = call(train_cli.main, [*mock, f"train.save={tmp_path / 'first'}"])
    assert rc == 0 and exc is None, err
    shard = sorted((tmp_path / "cache" / "shards").glob("*.bin"))[0]
    raw = bytearray(shard.read_bytes())
    for i in range(len(raw) // 3, len(raw) - 64):  # the rows past the header: counts and entries
        raw[i] = 0xFF
    shard.write_bytes(bytes(raw))
    args = [*mock, "kd.build_cache=false", "kd.check_tokens=false", f"train.save={tmp_path / 'second'}"]
    line = refuses(train_cli.main, args, "kd.cache")
    assert str(shard.name) in line or "shard" in line


# --- teacher.load: empty or half-written checkpoints ------------------------------------------------------------

def online(load):
    return ["data=mock", "data.vocab_size=250", "data.seq_length=16", "kd=online", "kd.top_k=4", *TINY,
            f"teacher.load={load}"]


@pytest.mark.parametrize("what", ["empty_dir", "tracker_only", "half_written", "a_file"])
def test_teacher_load_of_no_checkpoint(tmp_path, monkeypatch, finished_run, what):
    import shutil
    monkeypatch.chdir(tmp_path)
    ck = tmp_path / "teacher"
    if what == "a_file":
        ck.write_text("x")
    else:
        ck.mkdir()
    if what == "tracker_only":
        (ck / "latest_checkpointed_iteration.txt").write_text("1")
    if what == "half_written":
        shutil.copytree(finished_run, ck, dirs_exist_ok=True)
        for f in (ck / "iter_0000001").rglob("*"):
            if f.is_file() and f.suffix in (".distcp", ".pt") and f.name != "common.pt":
                f.write_bytes(f.read_bytes()[: max(1, f.stat().st_size // 3)])
    refuses(train_cli.main, online(ck), "teacher.load")


# --- demo and plan: refused before any stage ---------------------------------------------------------------------

@pytest.mark.parametrize("args,flag", [(["--top-k", "100000"], "--top-k"), (["--top-k", "0"], "--top-k"),
                                       (["--vocab-size", "1"], "--vocab-size"),
                                       (["--seq-length", "-4"], "--seq-length")])
def test_demo_arguments_refused_before_any_stage(tmp_path, args, flag):
    out = tmp_path / "demo"
    refuses(demo_cli.main, ["--out", str(out), "--no-progress", *args], flag)
    assert not out.exists() or not any(p for p in out.rglob("*") if p.suffix in (".bin", ".idx", ".json")
                                       and p.name != "demo_settings.json")


@pytest.mark.parametrize("flag,value", [("--topk", "0"), ("--topk", "-1"), ("--seq", "0"), ("--mbs", "0"),
                                        ("--gpus", "0")])
def test_plan_counts_that_are_none(flag, value):
    refuses(plan_cli.main, ["tiny_cpu", flag, value], flag)


def test_plan_of_a_missing_recipe():
    refuses(plan_cli.main, ["no_such_recipe"], "no_such_recipe")


def test_cache_build_concurrent_into_one_dir_is_locked_out(tmp_path):
    from megatron_kd.cache.format import make_settings
    from megatron_kd.cache.writer import CacheWriter
    tok = tokens(tmp_path, np.zeros((3, 9), dtype=np.int64))
    s = make_settings(encoding=EncodingOptions("fp16", 4), vocab_size=V, temperature=1.0, seq_length=8, num_samples=3,
                      teacher={"name": "toy"}, dataset="d", samples_per_shard=2)
    holder = CacheWriter(tmp_path / "cache", s)
    try:
        refuses(cache_cli.main, build(tmp_path, tok), "another cache build")
    finally:
        holder.close()
    json.dumps({})


def test_cache_build_out_is_an_existing_file(tmp_path):
    tok = tokens(tmp_path, np.zeros((3, 9), dtype=np.int64))
    (tmp_path / "cache").write_text("mine")
    refuses(cache_cli.main, build(tmp_path, tok), "--out")
    assert (tmp_path / "cache").read_text() == "mine"


def test_train_against_a_cache_of_other_settings_suggests_recipe_keys(tmp_path, monkeypatch):
    """train's refusal names what train takes (kd.cache, kd.build_cache), not `cache build`'s --out / --overwrite."""
    monkeypatch.chdir(tmp_path)
    mock = ["data=mock", "data.vocab_size=250", "data.seq_length=16", *TINY, f"kd.cache={tmp_path / 'cache'}"]
    rc, _, err, exc = call(train_cli.main, [*mock, "kd.top_k=4", f"train.save={tmp_path / 'first'}"])
    assert rc == 0 and exc is None, err
    line = refuses(train_cli.main, [*mock, "kd.top_k=4", "kd.temperature=2.0", f"train.save={tmp_path / 'second'}"],
                   "kd.cache")
    assert "--out" not in line and "--overwrite" not in line, line
