"""The cache's probe suite: kills at every file operation of the writer, corruptions of every file and manifest
field, mismatches of data / teacher / tokenizer / K / T / length, concurrency (bad loss inputs: tests/loss/test_input_probes.py).

Every probe ends in a loud outcome (an error whose message names the problem, or a resume that is byte-identical
to an uninterrupted build); none is silent. Each records (probe, outcome, message) for the outcome table
(PROBE_TABLE=path.json writes it)."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import PROBES
from megatron_kd.cache import CacheError, CacheReader, CacheWriter, TopKDataset, fsio, verify_cache
from megatron_kd.cache.encoding import EncodingOptions
from megatron_kd.teacher.build import build_cache
from megatron_kd.cache.format import SETTINGS_KEYS
from megatron_kd.cache.verify import QUICK_CHECKS
from megatron_kd.cli.cache import main as cache_cli
from cache_options import encoding_kw
from test_cache_resume import HERE as TESTS, N, S, V, make_teacher, snapshot

K = 8


def data(seed=3):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, V, size=(N, S + 1)))


def build(out, teacher_seed=0, **kw):
    kw = {"top_k": K, "samples_per_shard": 2, "micro_batch_size": 2, "progress": False, "dataset_id": "d3", **kw}
    ds = kw.pop("dataset", None)
    return build_cache(make_teacher(teacher_seed), data() if ds is None else ds, out, **encoding_kw(kw))


def record(probe, outcome, message):
    assert outcome != "silent", f"{probe}: silent outcome"
    PROBES.append((probe, outcome, " ".join(str(message).split())[:300]))


def refused(probe, fn, *must_name, exc=CacheError):
    """fn() raises exc whose one-line message names every word of must_name."""
    with pytest.raises(exc) as e:
        fn()
    msg = str(e.value)
    for word in must_name:
        assert word in msg, f"{probe}: {word!r} not named in: {msg}"
    record(probe, f"refused ({exc.__name__})", msg)
    return msg


def edit_json(path, fn):
    with open(path) as f:
        obj = json.load(f)
    fn(obj)
    with open(path, "w") as f:
        json.dump(obj, f)


def flip(path, offset=0):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


# ---------------------------------------------------------------------------------------------------------------
# 1. kills at every file operation of the writer (the disk a SIGKILL there leaves, then the build resumed)
#    (real SIGKILLs of the CLI at these points: tests/test_cache_resume.py)

def _events_of_a_build(tmp_path):
    seen = []
    prev = fsio.set_fault_hook(seen.append)
    try:
        build(tmp_path / "rec")
        build(tmp_path / "rec", teacher_seed=1, overwrite=True)  # the overwrite path's operations too
    finally:
        fsio.set_fault_hook(prev)
    return seen


KILL_POINTS = ["lock", "temp_removed", "settings:written", "settings:committed", "sample", "shard:written",
               "shard:committed", "sidecar:written", "sidecar:committed", "index:written", "index:committed",
               "manifest:written", "manifest:committed", "overwrite:shards_removed", "overwrite:removed"]


def test_kill_points_cover_every_writer_event(tmp_path):
    events = set(_events_of_a_build(tmp_path))
    assert events == set(KILL_POINTS), events ^ set(KILL_POINTS)


class _Crash(BaseException):
    pass


def _killed_child(out, event, nth, **kw):
    """The disk as a SIGKILL at the n-th `event` leaves it: the hook copies the directory at that instant (what a
    dead process leaves: the OS's file contents, Python's unflushed buffers lost, the lock free) and stops the
    build; then out is replaced by that copy. Returns whether the event was reached."""
    seen, crash = [0], str(out) + ".crash"

    def hook(ev):
        if ev == event:
            seen[0] += 1
            if seen[0] == nth:
                shutil.copytree(out, crash)
                raise _Crash()

    prev = fsio.set_fault_hook(hook)
    try:
        build(out, **kw)
    except _Crash:
        pass
    finally:
        fsio.set_fault_hook(prev)
    if not os.path.exists(crash):
        return False
    shutil.rmtree(out)
    os.rename(crash, out)
    return True


@pytest.mark.parametrize("event,nth", [(e, 1) for e in KILL_POINTS if not e.startswith("overwrite")]
                         + [("sample", 4), ("shard:written", 3), ("sidecar:committed", 5)])
def test_kill_then_resume_is_byte_identical(cache_bytes, tmp_path, event, nth):
    out = tmp_path / "cache"
    assert _killed_child(out, event, nth), f"the build never reached {event} #{nth}"
    if event != "manifest:committed":
        with pytest.raises(CacheError, match="has not finished|no manifest"):
            CacheReader(out)
    build(out)
    assert snapshot(out) == cache_bytes and verify_cache(out) == []
    record(f"kill at {event} #{nth}, resume", "resumed byte-identical", "verify ok, same bytes as uninterrupted")


@pytest.mark.parametrize("event", ["overwrite:shards_removed", "overwrite:removed", "shard:committed"])
def test_overwrite_killed_then_resumed_keeps_no_old_rows(cache_bytes, tmp_path, event):
    out = tmp_path / "cache"
    build(out, teacher_seed=1)
    assert _killed_child(out, event, 1, overwrite=True)
    build(out, overwrite=True)
    assert snapshot(out) == cache_bytes and verify_cache(out) == []
    record(f"--overwrite killed at {event}, rerun", "resumed byte-identical", "no shard of the old teacher kept")


# ---------------------------------------------------------------------------------------------------------------
# 2. corruptions of every manifest field and every file

def _other(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 3
    if isinstance(v, dict):
        return {**v, "weights_hash": "other"}
    return "other" if v != "other" else "x"


@pytest.mark.parametrize("field", SETTINGS_KEYS)
def test_manifest_field_edit_is_named(cache, field):
    edit_json(cache / "manifest.json", lambda m: m.__setitem__(field, _other(m[field])))
    msg = refused(f"manifest.json {field} edited: reader", lambda: CacheReader(cache), field)
    problems = verify_cache(cache, checksums=False)
    assert problems and field in problems[0], problems
    record(f"manifest.json {field} edited: verify --quick", "FAIL", problems[0])
    assert "\n" not in msg


@pytest.mark.parametrize("field,new", [("top_k", 9), ("vocab_size", 301), ("temperature", 3.0), ("seq_length", 25),
                                       ("encoding", "compact")])
def test_manifest_and_settings_edited_together_are_named(cache, field, new):
    for name in ("manifest.json", "settings.json"):
        edit_json(cache / name, lambda m: m.__setitem__(field, new))
    refused(f"{field} edited in manifest.json and settings.json: reader", lambda: CacheReader(cache), field)
    problems = verify_cache(cache)
    assert problems and field in problems[0], problems
    record(f"{field} edited in manifest and settings: verify", "FAIL", problems[0])


SHARD_ENTRY_EDITS = [("first", 1), ("count", 3), ("bytes", 7), ("file", "shards/000009.bin"), ("settings_hash", "0"),
                     ("shard", 4)]


@pytest.mark.parametrize("field,new", SHARD_ENTRY_EDITS)
def test_manifest_shard_entry_edit_is_named(cache, field, new):
    edit_json(cache / "manifest.json", lambda m: m["shards"][1].__setitem__(field, new))
    refused(f"manifest shards[1].{field} edited: reader", lambda: CacheReader(cache), field)


def test_manifest_shard_sha_edit_fails_verify(cache):
    edit_json(cache / "manifest.json", lambda m: m["shards"][2].__setitem__("sha256", "0" * 64))
    problems = verify_cache(cache)
    assert any("000002" in p and "sha256" in p for p in problems), problems
    record("manifest shards[2].sha256 edited: verify", "FAIL", problems[0])


@pytest.mark.parametrize("what,edit,name", [
    ("empty shard list", lambda m: m.__setitem__("shards", []), "lists 0 shards"),
    ("settings_hash edited", lambda m: m.__setitem__("settings_hash", "0"), "settings_hash"),
    ("sample_index sha256 edited", lambda m: m["sample_index"].__setitem__("sha256", "0"), "samples.idx"),
    ("field deleted", lambda m: m.pop("top_k"), "top_k"),
    ("top_k not an integer", lambda m: m.__setitem__("top_k", "8"), "top_k"),
    ("temperature infinite", lambda m: m.__setitem__("temperature", math.inf), "temperature"),
])
def test_manifest_structure_edit_is_named(cache, what, edit, name):
    edit_json(cache / "manifest.json", edit)
    refused(f"manifest {what}: reader", lambda: CacheReader(cache), name)
    problems = verify_cache(cache)
    assert problems and name in problems[0], problems


def test_manifest_not_json(cache):
    (cache / "manifest.json").write_text("{not json")
    refused("manifest.json not JSON: reader", lambda: CacheReader(cache), "manifest.json", "not valid JSON")


def test_settings_missing_or_edited(cache, tmp_path):
    os.remove(cache / "settings.json")
    refused("settings.json deleted: reader", lambda: CacheReader(cache), "settings.json is missing")
    other = tmp_path / "other"
    shutil.copytree(cache, other)
    (cache / "settings.json").write_text("[")
    refused("settings.json not JSON: reader", lambda: CacheReader(cache), "settings.json")


def test_shard_byte_flip(cache):
    flip(cache / "shards" / "000003.bin", 5)
    assert verify_cache(cache, checksums=False) == []  # quick mode does not read shards, and says so:
    assert "NOT read" in _cli_out(["verify", "--quick", str(cache)])[1]
    record("shard byte flip: verify --quick", "ok, stating shard contents were not read", QUICK_CHECKS)
    problems = verify_cache(cache)
    assert len(problems) == 1 and "000003.bin" in problems[0] and "sha256" in problems[0], problems
    record("shard byte flip: verify", "FAIL", problems[0])
    msg = refused("shard byte flip: TopKDataset before the first step",
                  lambda: TopKDataset(data(), CacheReader(cache)), "000003.bin", "sample 6", "delete")
    assert "\n" not in msg
    r = CacheReader(cache)
    refused("shard byte flip: read of that sample", lambda: r[6], "000003.bin", "sample 6")


@pytest.mark.parametrize("how,name", [("truncate", "truncated"), ("extend", "too long"), ("delete", "missing")])
def test_shard_size(cache, how, name):
    p = cache / "shards" / "000001.bin"
    if how == "delete":
        os.remove(p)
    else:
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) + (-3 if how == "truncate" else 3))
    refused(f"shard {how}d: reader", lambda: CacheReader(cache), "000001.bin", name)
    problems = verify_cache(cache)
    assert problems and name in problems[0]


def test_samples_idx_flip_blames_the_index(cache):
    flip(cache / "samples.idx", 20)
    msg = refused("samples.idx byte flip: reader", lambda: CacheReader(cache), "samples.idx")
    assert ".bin" not in msg.split(";")[0]
    problems = verify_cache(cache, checksums=False)
    assert problems and "samples.idx" in problems[0]


def test_samples_idx_truncated(cache):
    with open(cache / "samples.idx", "r+b") as f:
        f.truncate(16)
    refused("samples.idx truncated: reader", lambda: CacheReader(cache), "samples.idx")


@pytest.mark.parametrize("edit,name", [
    ("delete", "000002.json"),
    ("token_hashes", "token hashes"),
    ("settings", "temperature"),
    ("sha256", "sha256"),
])
def test_sidecar_corruption_fails_verify(cache, edit, name):
    p = cache / "shards" / "000002.json"
    if edit == "delete":
        os.remove(p)
    elif edit == "token_hashes":
        edit_json(p, lambda s: s["token_hashes"].__setitem__(0, "0" * 16))
    elif edit == "settings":
        edit_json(p, lambda s: s["settings"].__setitem__("temperature", 3.0))
    else:
        edit_json(p, lambda s: s.__setitem__("sha256", "0" * 64))
    problems = verify_cache(cache)
    assert problems and name in problems[0], problems
    record(f"sidecar {edit} edited: verify", "FAIL", problems[0])


# ---------------------------------------------------------------------------------------------------------------
# 3. mismatches: data, teacher, tokenizer, K, T, length

def test_resume_with_other_data_is_refused(tmp_path):
    out = tmp_path / "cache"
    assert _killed_child(out, "sidecar:committed", 2)  # shards 0, 1 done from data seed 3
    refused("partial build resumed with other data (same dataset id)",
            lambda: build(out, dataset=data(seed=4)), "sample 0", "other tokens")


def test_finished_cache_reused_for_other_data_is_refused(cache):
    refused("finished cache reused for other data (same dataset id)", lambda: build(cache, dataset=data(seed=4)),
            "other tokens")


def test_dataset_without_id_gets_a_content_id(tmp_path):
    m = build(tmp_path / "a", dataset_id=None)
    assert m["dataset"].startswith("content:")
    msg = refused("--dataset without id, other data", lambda: build(tmp_path / "a", dataset_id=None,
                                                                    dataset=data(seed=4)), "dataset")
    assert "content:" in msg


def test_other_teacher_resume_is_refused_naming_both(cache):
    refused("build with another teacher into a finished cache", lambda: build(cache, teacher_seed=1),
            "teacher", "'weights_hash': '0'", "'weights_hash': '1'")


def test_stale_shards_are_never_adopted(cache_bytes, tmp_path):
    out = tmp_path / "cache"
    build(out, teacher_seed=1)
    os.remove(out / "manifest.json")
    os.remove(out / "settings.json")
    build(out)  # seed 0: every shard must be recomputed
    assert snapshot(out) == cache_bytes
    record("rm manifest+settings, build with another teacher", "every stale shard recomputed",
           "byte-identical to a fresh build with the new teacher")


@pytest.mark.parametrize("kw,name", [({"top_k": 4}, "top_k"), ({"temperature": 2.0}, "temperature"),
                                     ({"tokenizer_id": "other@1"}, "tokenizer"), ({"encoding": "compact"}, "encoding"),
                                     ({"dataset_id": "d4"}, "dataset")])
def test_build_with_other_settings_is_refused(cache, kw, name):
    refused(f"rebuild into a finished cache with other {name}", lambda: build(cache, **kw), name, "--overwrite")


def test_length_mismatch_is_refused(cache, tmp_path):
    short = torch.from_numpy(np.random.default_rng(3).integers(0, V, size=(N, S)))
    refused("rebuild with another sequence length", lambda: build(cache, dataset=short), "seq_length")
    r = CacheReader(cache)
    refused("train with another sequence length", lambda: r.check_compatible(seq_length=S * 2), "seq_length")


@pytest.mark.parametrize("kw,name", [({"top_k": 16}, "top_k"), ({"temperature": 2.0}, "temperature"),
                                     ({"vocab_size": V + 1}, "vocabulary")])
def test_training_settings_mismatch(cache, kw, name):
    r = CacheReader(cache)
    refused(f"train with other {name}", lambda: r.check_compatible(**kw), name)


def test_training_with_other_data_tokens(cache):
    ds = TopKDataset(data(seed=4), CacheReader(cache))
    refused("train on other tokens", lambda: ds[0], "token hash", exc=CacheError)


@pytest.mark.parametrize("expected", ["teacher-b", "toy@1", {"weights_hash": "7"}])
def test_training_refuses_another_teachers_cache(cache, expected):
    msg = refused(f"train expecting teacher {expected!r}", lambda: CacheReader(cache, expected_teacher=expected),
                  "teacher", "'toy'")
    assert str(expected.get("weights_hash") if isinstance(expected, dict) else expected.split("@")[-1]) in msg
    assert CacheReader(cache, expected_teacher="toy@0").top_k == K
    with pytest.raises(CacheError, match="teacher"):
        TopKDataset(data(), str(cache), expected_teacher="teacher-b")


# ---------------------------------------------------------------------------------------------------------------
# 4. concurrency

def _cli_out(argv):
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cache_cli(argv)
    return rc, out.getvalue() + err.getvalue()


def test_second_builder_is_refused_with_one_line_exit_2(tmp_path):
    out = tmp_path / "cache"
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, data().numpy())
    first = CacheWriter(out, _settings())  # holds the lock
    try:
        env = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run([sys.executable, "-m", "megatron_kd.cli.main", "cache", "build", "--out", str(out),
                            "--teacher", "test_cache_resume:make_teacher", "--tokens", str(tokens), "--top-k", "8",
                            "--no-progress"], env=env, capture_output=True, text=True)
    finally:
        first.close()
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "another cache build is writing" in lines[0], r.stderr
    record("second builder into one directory (CLI)", "refused, exit 2, one line", lines[0])
    holder = CacheWriter(out, _settings())
    try:
        refused("second builder into one directory (API)", lambda: CacheWriter(out, _settings()),
                "another cache build")
    finally:
        holder.close()


def _settings():
    from megatron_kd.cache.format import make_settings
    return make_settings(encoding=EncodingOptions("fp16", K), vocab_size=V, temperature=1.0, seq_length=S, num_samples=N,
                         teacher={"name": "toy"}, dataset="d3", samples_per_shard=2)


def test_temp_names_are_unique_per_process_and_never_reused(tmp_path):
    p = str(tmp_path / "x.bin")
    names = {fsio.temp_name(p) for _ in range(100)}
    assert len(names) == 100 and all(f".{os.getpid()}-" in n for n in names)
    f, tmp = fsio.open_temp(p)
    f.close()
    with pytest.raises(FileExistsError):
        open(tmp, "xb")
    record("temp file names", "unique per process and call, opened exclusively", tmp)


# ---------------------------------------------------------------------------------------------------------------
# 5. SIGTERM / SIGINT of `cache build`: children ended, build resumes

@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_build_cleanly_and_it_resumes(tmp_path, sig):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, data().numpy())
    out = tmp_path / "cache"
    cmd = [sys.executable, "-m", "megatron_kd.cli.main", "cache", "build", "--out", str(out), "--teacher",
           "test_cache_resume:make_teacher", "--tokens", str(tokens), "--top-k", "8", "--samples-per-shard", "2",
           "--micro-batch-size", "2", "--no-progress", "--dataset-id", "d3"]
    env = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd + ["--teacher-args", '{"seed": 0, "delay": 0.3}'], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (out / "shards" / "000000.json").exists():  # no deadline: a loaded machine is slow, not wrong
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate()
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert "rerun the same command to resume" in err
    assert not any(n.endswith(".tmp") for n in os.listdir(out / "shards"))
    r = subprocess.run(cmd + ["--teacher-args", '{"seed": 0}'], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ref = tmp_path / "ref"
    build(ref)
    assert snapshot(out) == snapshot(ref)
    record(f"{sig.name} of cache build, rerun", "exit 128+sig, temp files removed, resumed byte-identical",
           err.strip())
