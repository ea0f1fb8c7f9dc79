"""Probes of a training run as an adversarial user would try it, on the tiny CPU recipe: each asserts the outcome a
careful user wants: a refusal in one sentence naming the key and the fix (no traceback), an exact resume, or a
recovery with a message.

One finished offline run (6 iterations, checkpoints at 3 and 6) is shared by the module; most cases copy it or
check the validation functions in process. Cases that train a few iterations are marked slow.
"""
import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest
from run_copies import copy_at, one_sentence
import torch

from megatron_kd import rules
from megatron_kd.checkpoint import integrity as ckpt_integrity, store as ckpt
from megatron_kd.recipe.checks import check_recipe
from megatron_kd.recipe.compose import compose
from megatron_kd.recipe.schema import RecipeError, to_recipe
from megatron_kd.training import guards, loop as train_mod, resume, safety
from megatron_kd.training.loop import preflight, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["data.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4", "train.progress=false",
        "train.tensorboard=false", "train.log_interval=1", "train.eval_iters=1", "train.eval_interval=null"]


def recipe(save, *overrides):
    return to_recipe(compose("tiny_cpu", [*BASE, *overrides, f"train.save={save}"]))


def train(save, *overrides):
    return run(recipe(save, *overrides), str(save))


def records(save) -> dict:
    out = {}
    for line in open(os.path.join(save, "metrics.jsonl")):
        rec = json.loads(line)
        if rec["kind"] == "train":
            out[rec["iteration"]] = rec  # a resumed run's record wins
    return out



@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished offline run (cache built from the recipe's teacher): iterations 1-6, checkpoints at 3 and 6."""
    d = tmp_path_factory.mktemp("finished") / "run"
    train(d, "train.iters=6", "train.save_interval=3")
    return d



def no_model(monkeypatch):
    """Fail the test if any model is built (the refusal must come first)."""
    def boom(*a, **k):
        raise AssertionError("a model was built before the refusal")
    monkeypatch.setattr(train_mod, "build_model_chunks", boom)


# --- resume: settings ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ("train.lr=3e-2", "train.lr"),
    ("train.lr_warmup_iters=0", "train.lr_warmup_iters"),
    ("train.lr_decay_style=linear", "train.lr_decay_style"),
    ("kd.top_k=4", "kd.top_k"),
    ("kd.divergence=reverse_kl", "kd.divergence"),
    ("kd=ce", "kd.mode"),
    ("kd.ce_weight=1.0", "kd.ce_weight"),
    ("train.global_batch_size=8", "train.global_batch_size"),
    ("model.num_layers=3", "model.num_layers"),
])
def test_resume_with_other_settings_is_refused(finished, tmp_path, monkeypatch, override, key):
    d = copy_at(finished, tmp_path / "res", 3)
    no_model(monkeypatch)
    with pytest.raises(RecipeError) as e:
        train(d, "train.iters=6", override)
    msg = str(e.value)
    one_sentence(msg)
    assert key in msg
    if not key.startswith("model."):  # the architecture cannot be changed on purpose
        assert f"train.resume_changes=[{key}]" in msg and "another train.save" in msg


def test_resume_with_a_cache_of_another_teacher_is_refused(finished, tmp_path):
    d = copy_at(finished, tmp_path / "res", 3)
    other = tmp_path / "other_cache"
    shutil.copytree(d / "teacher_cache", other)
    m = json.loads((other / "manifest.json").read_text())
    m["teacher"] = {**m["teacher"], "name": "another-teacher"}  # same data, another teacher's identity
    (other / "manifest.json").write_text(json.dumps(m))
    r = recipe(d, "train.iters=6", f"kd.cache={other}", "kd.build_cache=false")
    with pytest.raises(RecipeError, match=r"kd\.cache_teacher.*train\.resume_changes=\[kd\.cache_teacher\]"):
        resume.check_resume_early(r, str(d))


def test_same_settings_and_a_moved_copy_resume(finished, tmp_path):
    d = copy_at(finished, tmp_path / "res", 3)  # kd.cache moved with train.save: not a change
    resume.check_resume_early(recipe(d, "train.iters=6", "train.stop_at=5"), str(d))


def test_resume_changes_must_name_compared_keys(tmp_path):
    with pytest.raises(RecipeError, match=r"train\.resume_changes names train\.bogus"):
        check_recipe(recipe(tmp_path, "train.resume_changes=[train.bogus]"), None)


@pytest.mark.slow
def test_an_intended_change_is_logged_and_applied(finished, tmp_path, capsys):
    d = copy_at(finished, tmp_path / "res", 3)
    train(d, "train.iters=6", "train.lr=3e-2", "train.resume_changes=[train.lr]")
    out = capsys.readouterr()
    assert "resuming with a changed setting on purpose (train.resume_changes): train.lr 0.003 -> 0.03" in \
        out.out + out.err
    before, after = records(finished), records(d)
    assert after[3]["lr"] == before[3]["lr"]
    assert after[4]["lr"] > 5 * before[4]["lr"]  # the recipe's schedule (max 0.03) replaced the checkpoint's


# --- checkpoints: checksums, fallback, tracker ----------------------------------------------------------------

def flip(path, offset: int = 4096, n: int = 1024):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = bytearray(f.read(n))
        f.seek(offset)
        f.write(bytes(x ^ 0xFF for x in b))


def distcp(d, it):
    return sorted(p for p in os.listdir(ckpt.iter_dir(str(d), it)) if p.endswith(".distcp"))


def test_every_saved_checkpoint_has_a_checksum_manifest(finished):
    for it in (3, 6):
        path = ckpt.iter_dir(str(finished), it)
        assert ckpt_integrity.has_manifest(path) and ckpt_integrity.problems(path) == []


@pytest.mark.slow
def test_bit_flips_in_the_latest_fall_back_and_resume_exactly(finished, tmp_path, capsys):
    d = copy_at(finished, tmp_path / "res")
    flip(os.path.join(ckpt.iter_dir(str(d), 6), distcp(d, 6)[0]))
    train(d, "train.iters=6")
    out = capsys.readouterr()
    assert "resuming from iteration 3, the newest intact checkpoint" in out.out + out.err
    assert "does not match its checksum" in out.out + out.err
    want, got = records(finished), records(d)
    for it in (4, 5, 6):  # the same run as the uninterrupted one
        assert got[it]["loss"] == pytest.approx(want[it]["loss"], rel=1e-6, abs=1e-7), it
    assert ckpt.latest_iteration(str(d)) == 6 and ckpt_integrity.problems(ckpt.iter_dir(str(d), 6)) == []


@pytest.mark.parametrize("damage", ["truncate", "remove", "no_manifest", "flip"])
def test_a_broken_latest_is_named_and_the_previous_one_chosen(finished, tmp_path, damage):
    d = copy_at(finished, tmp_path / "res")
    path = ckpt.iter_dir(str(d), 6)
    f = os.path.join(path, distcp(d, 6)[-1])
    if damage == "truncate":
        os.truncate(f, os.path.getsize(f) // 2)
    elif damage == "remove":
        os.remove(f)
    elif damage == "no_manifest":  # killed between the files and the manifest (written last)
        os.remove(os.path.join(path, ckpt_integrity.MANIFEST))
    else:
        flip(f)
    it, notes = ckpt_integrity.newest_intact(str(d))
    assert it == 3 and len(notes) == 1
    one_sentence(notes[0])
    assert "iteration 6 is damaged" in notes[0]


def test_a_tracker_naming_a_missing_iteration(finished, tmp_path):
    d = copy_at(finished, tmp_path / "res", 9)
    it, notes = ckpt_integrity.newest_intact(str(d))
    assert it == 6 and "names iteration 9, but" in notes[0] and "does not exist" in notes[0]
    shutil.rmtree(d / "iter_0000003")
    shutil.rmtree(d / "iter_0000006")
    with pytest.raises(RecipeError) as e:
        resume.check_resume_early(recipe(d, "train.iters=12"), str(d))
    one_sentence(str(e.value))
    assert "names iteration 9" in str(e.value) and "no intact checkpoint" in str(e.value)


def test_a_damaged_teacher_checkpoint_is_refused(finished, tmp_path):
    d = copy_at(finished, tmp_path / "t")
    flip(os.path.join(ckpt.iter_dir(str(d), 6), distcp(d, 6)[0]))
    with pytest.raises(RecipeError, match=r"is damaged \(__0_\d\.distcp does not match its checksum"):
        ckpt_integrity.require_intact(str(d))


# --- weights-only checkpoints of another shape ------------------------------------------------------------------

def test_online_teacher_of_another_shape_is_refused(finished, tmp_path):
    r = recipe(tmp_path / "s", "kd=online", f"teacher.load={finished}")  # finished holds the student's shape
    with pytest.raises(RecipeError) as e:
        preflight(r, 1, False)
    one_sentence(str(e.value))
    assert "teacher.load=" in str(e.value) and "another shape" in str(e.value) and "teacher.num_layers" in str(e.value)


def test_pretrained_of_another_shape_is_refused(finished, tmp_path):
    r = recipe(tmp_path / "s", "kd=ce", f"train.pretrained={finished}", "model.num_layers=3")
    with pytest.raises(RecipeError, match=r"train\.pretrained=.*another shape \(num_layers: \d there, "
                                          r"model\.num_layers=3 here"):
        preflight(r, 1, False)


def test_a_missing_teacher_checkpoint_is_named(tmp_path):
    r = recipe(tmp_path / "s", "kd=online", f"teacher.load={tmp_path / 'nowhere'}")
    with pytest.raises(RecipeError, match=r"teacher\.load=.*nowhere"):
        preflight(r, 1, False)


# --- the train section's numbers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ("train.lr=-1", "train.lr"), ("train.global_batch_size=0", "train.global_batch_size"),
    ("train.log_interval=0", "train.log_interval"), ("train.min_lr=1.0", "train.min_lr"),
    ("train.lr_decay_style=bogus", "train.lr_decay_style"), ("train.adam_beta1=1.5", "train.adam_beta1"),
    ("train.adam_beta2=-0.1", "train.adam_beta2"), ("train.adam_eps=0", "train.adam_eps"),
    ("train.clip_grad=-1", "train.clip_grad"), ("train.save_interval=0", "train.save_interval"),
    ("train.nonfinite=maybe", "train.nonfinite"), ("train.lr_warmup_iters=-1", "train.lr_warmup_iters"),
])
def test_bad_train_numbers_are_refused_naming_the_key(tmp_path, override, key):
    with pytest.raises(RecipeError) as e:
        check_recipe(recipe(tmp_path, override), None)
    one_sentence(str(e.value))
    assert str(e.value).startswith(key + "="), str(e.value)


@pytest.mark.slow
def test_the_cli_says_one_sentence_for_a_bad_number(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megatron_kd", "train", "train.lr=-1", f"train.save={tmp_path / 's'}",
                        f"hydra.run.dir={tmp_path / 'h'}"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "megatron-kd train: error: train.lr=-1.0 must be a number >= 0" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("content, expect", [
    (b"kd:\n  top_k: [1, 2\n  x: : y\n", "YAML syntax error at line 3"),
    (bytes(range(200, 256)) * 4, "is not UTF-8 text"),
])
def test_a_broken_recipe_file_is_named(tmp_path, capsys, content, expect):
    from megatron_kd.cli.train import main
    (tmp_path / "mine.yaml").write_bytes(content)
    rc = main(["--config-path", str(tmp_path), "--config-name", "mine", f"train.save={tmp_path / 's'}"])
    err = capsys.readouterr().err
    assert rc == 2
    one_sentence(err)
    assert f"recipe file {tmp_path / 'mine.yaml'}" in err and expect in err


# --- train.save: a file, read-only, in use --------------------------------------------------------------------

def test_train_save_that_is_a_file_is_refused(tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("x")
    no_model(monkeypatch)
    with pytest.raises(RecipeError, match=r"train\.save=.*file is a file, not a directory"):
        train(f, "kd=ce", "train.iters=1")


def test_train_save_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                             capture_output=True).returncode == 0
    target = ro / "save" if mounted else "/sys/megatron-kd-probe"  # sysfs: no directories can be made there
    no_model(monkeypatch)
    try:
        with pytest.raises(RecipeError, match=r"train\.save=.*(not writable|cannot be written)"):
            train(target, "kd=ce", "train.iters=1")
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)])


def test_a_second_run_into_the_same_save_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "s"
    d.mkdir()
    no_model(monkeypatch)
    with safety.save_lock(str(d)):  # the first run holds train.save
        with pytest.raises(RecipeError, match=r"train\.save=.* is in use by another megatron-kd train \(pid \d+"):
            train(d, "kd=ce", "train.iters=1")
    assert not (d / "metrics.jsonl").exists()


# --- NaN / inf -------------------------------------------------------------------------------------------------

@pytest.fixture
def saves(monkeypatch):
    """[(iteration, all weights finite)] of every checkpoint written."""
    seen, real = [], ckpt.save_checkpoint

    def spy(root, iteration, chunks, *a, **k):
        seen.append((iteration, all(bool(torch.isfinite(p).all()) for c in chunks for p in c.parameters())))
        return real(root, iteration, chunks, *a, **k)
    monkeypatch.setattr(ckpt, "save_checkpoint", spy)
    return seen


NAN_RUN = ["kd=ce", "train.iters=6", "train.save_interval=2", "train.lr=1e6", "train.clip_grad=0",
           "train.lr_warmup_iters=0"]


@pytest.mark.slow
def test_nan_stops_the_run_and_no_nan_weights_are_saved(tmp_path, saves):
    with pytest.raises(RecipeError) as e:
        train(tmp_path / "s", *NAN_RUN)
    one_sentence(str(e.value))
    assert "not finite" in str(e.value) or "NaN" in str(e.value)
    assert "train.nonfinite=skip" in str(e.value)
    assert all(finite for _, finite in saves), saves


@pytest.mark.slow
def test_nan_skip_policy_says_so_and_saves_finite_weights(tmp_path, saves, capsys):
    s = train(tmp_path / "s", *NAN_RUN, "train.nonfinite=skip")
    out = capsys.readouterr()
    assert s["iteration"] == 6
    assert "update skipped (train.nonfinite=skip)" in out.out + out.err
    assert saves and all(finite for _, finite in saves), saves


def test_nonfinite_step_policy(tmp_path):
    t = recipe(tmp_path, "kd=ce").train
    assert guards.nonfinite_step({"total": 1.0}, [], t, 1) is None
    with pytest.raises(RecipeError, match=r"iteration 7: loss total = nan; the run stops"):
        guards.nonfinite_step({"total": math.nan}, [], t, 7)
    t.nonfinite = "skip"
    assert guards.nonfinite_step({"total": math.inf}, [], t, 7) == "loss total = inf"


# --- signals during a save, disk space ----------------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_during_a_save_ends_the_run_after_the_save(tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing
    from megatron_kd.runtime.interrupt import run_interruptible
    real = dist_checkpointing.save

    def save_with_signal(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # lands while the checkpoint is being written
        return real(*a, **k)
    monkeypatch.setattr(dist_checkpointing, "save", save_with_signal)
    d = tmp_path / "s"
    rc = run_interruptible(lambda: train(d, "kd=ce", "train.iters=6", "train.save_interval=2") and 0, "kept")
    assert rc == 128 + signal.SIGTERM
    assert ckpt.latest_iteration(str(d)) == 2  # the save it landed in completed
    assert ckpt_integrity.problems(ckpt.iter_dir(str(d), 2)) == []
    assert max(records(d)) == 2  # and the run ended there


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_named(tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing
    real, calls = dist_checkpointing.save, []

    def full(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)
    monkeypatch.setattr(dist_checkpointing, "save", full)
    d = tmp_path / "s"
    with pytest.raises(RecipeError) as e:
        train(d, "kd=ce", "train.iters=4", "train.save_interval=1")
    one_sentence(str(e.value))
    assert "no space left on the device of train.save=" in str(e.value)
    assert ckpt.latest_iteration(str(d)) == 1 and not os.path.exists(ckpt.iter_dir(str(d), 2))


def test_too_little_free_space_is_refused_before_the_save(tmp_path, monkeypatch):
    class Usage:
        free = 1 << 20
    monkeypatch.setattr(rules.shutil, "disk_usage", lambda p: Usage)
    with pytest.raises(RecipeError, match=r"train\.save=.* has 0\.00 GiB free, the checkpoint of iteration 3 needs"):
        safety.check_free_space(str(tmp_path), 2 << 30, 3)


@pytest.mark.slow
def test_a_full_disk_while_building_the_cache_is_named(tmp_path):
    from megatron_kd.cache import fsio

    def full(event):
        if event.startswith("shard"):
            raise OSError(errno.ENOSPC, "No space left on device")
    previous = fsio.set_fault_hook(full)
    try:
        with pytest.raises(RecipeError) as e:
            train(tmp_path / "s", "train.iters=2")
    finally:
        fsio.set_fault_hook(previous)
    one_sentence(str(e.value))
    assert "no space left on the device of" in str(e.value) and "the build resumes" in str(e.value)


# --- data ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small indexed corpus tokenized with tokenizer A, and tokenizer B of the same vocabulary size."""
    from megatron_kd.data.corpus import prepare, train_tokenizer
    d = tmp_path_factory.mktemp("corpus")
    docs = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7} times." for i in range(40)]
    other = [f"another text {i}, quite unlike the first; numbers {i * 13} and words." for i in range(40)]
    a = train_tokenizer(docs, 300, str(d / "a.json"))
    b = train_tokenizer(other, 300, str(d / "b.json"))
    s = prepare(docs, str(d / "text"), tokenizer=a)
    return d, a, b, s["tokens"]


def data_recipe(tmp_path, d, tok, *o):
    # 40 documents: the default split (969,30,1) would leave the test split none, which preflight refuses
    return recipe(tmp_path / "s", "kd=ce", "data.kind=indexed", f"data.path={d / 'text'}", f"data.tokenizer={tok}",
                  "data.vocab_size=null", "data.split='90,10,0'", *o)


def test_data_of_another_tokenizer_is_refused(corpus, tmp_path):
    d, a, b, _ = corpus
    preflight(data_recipe(tmp_path, d, a), 1, False)
    with pytest.raises(RecipeError) as e:
        preflight(data_recipe(tmp_path, d, b), 1, False)
    one_sentence(str(e.value))
    assert "was tokenized with another tokenizer" in str(e.value) and "data.tokenizer=" in str(e.value)


@pytest.mark.parametrize("sidecar", [True, False])
def test_seq_length_beyond_the_corpus_is_refused(corpus, tmp_path, sidecar):
    d, a, _, tokens = corpus
    if not sidecar:
        d2 = tmp_path / "nosidecar"
        d2.mkdir()
        for ext in (".bin", ".idx"):
            shutil.copy(d / f"text{ext}", d2 / f"text{ext}")
        d = d2
    with pytest.raises(RecipeError, match=rf"data\.seq_length=300000 is longer than the whole corpus \({tokens} "):
        preflight(data_recipe(tmp_path, d, a, "data.seq_length=300000"), 1, False)


# --- cache and loss arguments ------------------------------------------------------------------------------------

def test_a_cache_of_a_newer_format_is_refused(finished, tmp_path, capsys):
    from megatron_kd.cache import CacheError, CacheReader
    from megatron_kd.cache.format import FORMAT_VERSION
    from megatron_kd.cli.cache import main
    c = tmp_path / "cache"
    shutil.copytree(finished / "teacher_cache", c)
    m = json.loads((c / "manifest.json").read_text())
    m["format_version"] = FORMAT_VERSION + 1
    (c / "manifest.json").write_text(json.dumps(m))
    assert main(["verify", str(c)]) != 0
    assert f"format_version {FORMAT_VERSION + 1}" in capsys.readouterr().err
    with pytest.raises(CacheError, match=f"format_version {FORMAT_VERSION + 1}"):
        CacheReader(str(c))


@pytest.mark.parametrize("key, value", [("jsd_beta", "half"), ("cache_temperature", "warm"),
                                        ("kl_weight", "lots")])
def test_non_numeric_loss_arguments_name_the_argument(key, value):
    from megatron_kd.loss.options import KDLoss, LossOptions
    with pytest.raises(ValueError, match=f"{key}='{value}' must be a number"):
        KDLoss(divergence="jsd", **{key: value}).loss_options()
    with pytest.raises(ValueError, match=f"{key}='{value}' must be a number"):
        LossOptions(divergence="jsd", **{key: value})


@pytest.mark.slow
def test_kill_9_leaves_no_process_behind(tmp_path):
    import time
    import psutil
    save = tmp_path / "s"
    cmd = [sys.executable, "-m", "megatron_kd", "train", "kd=ce", "train.iters=400", "train.save_interval=1",
           "train.eval_interval=null", "train.tensorboard=false", "train.progress=false", f"train.save={save}",
           f"hydra.run.dir={tmp_path / 'h'}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        while ckpt.latest_iteration(str(save)) is None:  # a checkpoint was written: the writer's helpers exist
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.2)
        children = psutil.Process(proc.pid).children(recursive=True)
    finally:
        proc.kill()
        proc.wait()
    assert children, "expected the checkpoint writer's Manager / resource_tracker"
    _, alive = psutil.wait_procs(children, timeout=300)  # PDEATHSIG acts at once; generous for a loaded machine
    assert not alive, f"left behind: {[(p.pid, p.name(), p.cmdline()[:3]) for p in alive]}"


@pytest.mark.parametrize("hooked", [True, False], ids=["children_die_with_run", "without"])
def test_forked_children_die_with_a_killed_run(tmp_path, hooked):
    """A process forked after children_die_with_run() (as megatron-core forks its checkpoint writer) ends when the
    run is killed with kill -9; without the hook it lives on under init (the control, which this test kills)."""
    import time
    import psutil
    code = ("import os, sys, time\n"
            "from megatron_kd.training import safety\n"
            f"{'safety.children_die_with_run()' if hooked else 'pass'}\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    time.sleep(600); os._exit(0)\n"
            "print(pid, flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    child = psutil.Process(int(proc.stdout.readline()))
    proc.kill()
    proc.wait()
    try:
        _, alive = psutil.wait_procs([child], timeout=120 if hooked else 3)
        assert bool(alive) is not hooked, f"hooked={hooked}: child alive={bool(alive)}"
    finally:
        if child.is_running():
            child.kill()


def test_a_cache_build_that_cannot_fit_is_refused_before_the_teacher_runs(tmp_path, monkeypatch):
    class Usage:
        free = 1024
    monkeypatch.setattr(rules.shutil, "disk_usage", lambda p: Usage)
    with pytest.raises(RecipeError) as e:
        train(tmp_path / "s", "train.iters=2")
    one_sentence(str(e.value))
    assert "GiB free, the cache's remaining shards need about" in str(e.value)


@pytest.mark.slow
def test_an_unverifiable_damaged_checkpoint_is_one_sentence(finished, tmp_path):
    d = copy_at(finished, tmp_path / "res")
    for it in (3, 6):  # a run saved before checksum manifests existed
        os.remove(os.path.join(ckpt.iter_dir(str(d), it), ckpt_integrity.MANIFEST))
    f = os.path.join(ckpt.iter_dir(str(d), 6), distcp(d, 6)[0])
    os.truncate(f, os.path.getsize(f) // 2)
    with pytest.raises(RecipeError) as e:
        train(d, "train.iters=6")
    one_sentence(str(e.value))
    assert "iteration 6's checkpoint cannot be loaded" in str(e.value) and "move" in str(e.value)
