"""Adversarial use of the newer commands and surfaces: export into its own inputs, data prepare on a full disk and
after a killed prepare, packaged and user recipes, the sampled / top-P cache flags, compare of runs cut off while
writing, reruns of a finished run or sweep with other values, plan and launch against train. Each case records its
outcome (probe.record; the counts are printed at the end of the session).

Runs in a base install: nothing here imports an optional extra (ModelOpt, pyarrow, Bridge, TE); the export cases
stand the model work in with a few functions, since the check they probe comes before it."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from megatron_kd.cli import cache as cache_cli
from megatron_kd.cli import compare as compare_cli
from megatron_kd.cli import data as data_cli
from megatron_kd.cli import export as export_cli
from megatron_kd.cli import plan as plan_cli
from megatron_kd.cli import train as train_cli
from probe import ROOT, TINY, call, kept, outcome, record, refuses, snapshot

MOCK = ["data=mock", "data.vocab_size=250", "data.seq_length=16", "kd=ce", *TINY]


def works(rc, err, exc) -> None:
    """A valid (if unusual) input: exit 0, no traceback."""
    got = "raw" if exc is not None or "Traceback" in err else "ok" if rc == 0 else "unclear"
    assert record(got) == "ok", f"{got}: rc={rc} {err[-2000:]}"


# --- export: an --out inside (or holding) what it reads ----------------------------------------------------------

@pytest.fixture
def hf_src(tmp_path):
    d = tmp_path / "hf src"  # a space in the path, as users have
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (d / "model.safetensors").write_bytes(b"stand-in")
    return d


@pytest.fixture
def cheap_export(monkeypatch):
    """The export's model work stood in (build, load, write one config.json): what is probed is where the export
    goes, which is decided before that work. Returns the list the stand-in appends to when the work starts."""
    import contextlib
    from megatron_kd.checkpoint import spec, store
    from megatron_kd.export import to_hf
    from megatron_kd.hf import model as hf_model
    from megatron_kd.models import builder
    from megatron_kd.runtime import dist
    started = []

    class FakeHF:
        def export(self, chunks, out, dtype=None):
            with open(os.path.join(out, "config.json"), "w") as f:
                f.write("{}")

    def build(*a, **k):
        started.append("build")
        return [object()], None
    monkeypatch.setattr(builder, "build_hf_chunks", build)
    monkeypatch.setattr(spec, "build_as_saved", lambda *a, **k: None)
    monkeypatch.setattr(store, "load_spec_weights", lambda *a, **k: 1)
    monkeypatch.setattr(hf_model, "open_hf", lambda *a, **k: FakeHF())
    monkeypatch.setattr(dist, "distributed", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(to_hf, "_quant_format", lambda chunks: None)
    return started


@pytest.fixture
def run_copy(finished_run, tmp_path):
    run = tmp_path / "my run"
    shutil.copytree(finished_run, run)
    return run


def test_export_over_an_iteration_of_the_checkpoint_with_overwrite(run_copy, hf_src, cheap_export):
    """`--checkpoint RUN --out RUN/iter_0000001 --overwrite` swapped the export in for the checkpoint iteration."""
    before = snapshot(run_copy)
    refuses(export_cli.main, ["--checkpoint", run_copy, "--out", run_copy / "iter_0000001", "--hf-path", hf_src,
                              "--overwrite"], "--out", "--checkpoint")
    kept(before, snapshot(run_copy))
    assert not cheap_export, "the refusal came after the export's work started"


def test_export_of_an_iteration_into_its_run(run_copy, hf_src, cheap_export):
    before = snapshot(run_copy)
    refuses(export_cli.main, ["--checkpoint", run_copy / "iter_0000001", "--out", run_copy / "hf", "--hf-path",
                              hf_src], "--out", str(run_copy))
    kept(before, snapshot(run_copy))


def test_export_into_its_hf_source(run_copy, hf_src, cheap_export):
    before = snapshot(hf_src)
    refuses(export_cli.main, ["--checkpoint", run_copy, "--out", hf_src / "export", "--hf-path", hf_src],
            "--out", str(hf_src))
    kept(before, snapshot(hf_src))


def test_export_beside_the_run_with_spaces_works(run_copy, hf_src, cheap_export, tmp_path):
    out = tmp_path / "my export"
    works(*[call(export_cli.main, ["--checkpoint", run_copy, "--out", out, "--hf-path", hf_src])[i] for i in (0, 2, 3)])
    assert (out / "config.json").is_file() and sorted(os.listdir(tmp_path)) == ["hf src", "my export", "my run"]


def test_train_export_hf_inside_train_save_is_refused_before_training(tmp_path, hf_src):
    from megatron_kd.recipe.checks import check_export
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import RecipeError, to_recipe
    save = tmp_path / "run"
    r = to_recipe(compose("tiny_cpu", [*MOCK, f"train.save={save}", f"train.export_hf={save / 'hf'}"]))
    r.model.hf_path = str(hf_src)
    with pytest.raises(RecipeError) as e:
        check_export(r)
    assert record(outcome(2, str(e.value), None, ("train.export_hf", "train.save"))) == "held", e.value


# --- data prepare: a full disk, a killed prepare, odd paths ------------------------------------------------------

def _text(tmp_path, paragraphs=300):
    p = tmp_path / "corpus.txt"
    p.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i} times."
                             for i in range(paragraphs)))
    return p


def _prepare_limited(args, limit: int) -> subprocess.CompletedProcess:
    """`megatron-kd data prepare ARGS` in a process whose files may not grow past `limit` bytes (RLIMIT_FSIZE: a
    write past it fails with EFBIG, "File too large", as a full disk fails with ENOSPC)."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({0}, {0})); "
            "from megatron_kd.cli.main import main; sys.exit(main(sys.argv[1:]))").format(limit)
    import megatron_kd
    pkg_root = os.path.dirname(os.path.dirname(megatron_kd.__file__))  # the package this session imports
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([pkg_root, os.environ.get("PYTHONPATH", "")]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", code, "data", "prepare", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=600)


def test_data_prepare_on_a_full_disk_keeps_the_previous_outputs(tmp_path, corpus):
    prefix = tmp_path / "out" / "my corpus"
    args = ["--input", _text(tmp_path), "--output-prefix", prefix, "--tokenizer", corpus["tokenizer"]]
    rc, _, err, exc = call(data_cli.main, ["prepare", *args])
    assert rc == 0 and exc is None, err
    before = snapshot(prefix.parent)
    p = _prepare_limited([*args, "--overwrite"], 2048)
    got = record(outcome(p.returncode, p.stderr, None, (str(prefix),)))
    assert got == "held", f"{got}: rc={p.returncode} {p.stderr[-3000:]}"
    assert "space" in p.stderr or "room" in p.stderr, p.stderr
    kept(before, snapshot(prefix.parent))


def test_data_prepare_after_a_killed_prepare_leaves_no_temporary_files(tmp_path, corpus):
    prefix = tmp_path / "c"
    for ext in (".bin", ".idx", ".json"):  # what a prepare killed by SIGKILL / SIGTERM mid-write leaves
        (tmp_path / f"c.tmp12345{ext}").write_bytes(b"partial")
    rc, _, err, exc = call(data_cli.main, ["prepare", "--input", _text(tmp_path, 20), "--output-prefix", prefix,
                                           "--tokenizer", corpus["tokenizer"]])
    works(rc, err, exc)
    left = sorted(p.name for p in tmp_path.iterdir() if ".tmp" in p.name)
    if left:
        record("silent")
    assert not left, f"a killed prepare's temporary files stay forever: {left}"


def test_data_prepare_while_another_prepare_writes_the_prefix(tmp_path, corpus):
    from megatron_kd.cache.fsio import try_lock
    fd = try_lock(str(tmp_path / ".c.prepare.lock"))
    try:
        refuses(data_cli.main, ["prepare", "--input", _text(tmp_path, 20), "--output-prefix", tmp_path / "c", "--tokenizer",
                                corpus["tokenizer"]], "another data prepare")
    finally:
        os.close(fd)


@pytest.mark.parametrize("what", ["a_directory", "empty", "missing", "binary"])
def test_data_prepare_inputs_that_are_no_text(tmp_path, corpus, what):
    p = tmp_path / ("in" if what == "a_directory" else "in.txt")
    if what == "a_directory":
        p.mkdir()
    elif what == "empty":
        p.write_text("")
    elif what == "binary":
        p.write_bytes(bytes(range(256)) * 4)
    refuses(data_cli.main, ["prepare", "--input", p, "--output-prefix", tmp_path / "o", "--tokenizer", corpus["tokenizer"]],
            "in")
    assert not list(tmp_path.glob("o.*"))


def test_data_prepare_jsonl_without_the_json_key(tmp_path, corpus):
    p = tmp_path / "docs.jsonl"
    p.write_text('{"body": "some text"}\n{"body": "more text"}\n')
    refuses(data_cli.main, ["prepare", "--input", p, "--output-prefix", tmp_path / "o", "--tokenizer", corpus["tokenizer"]],
            "--json-key")


@pytest.mark.parametrize("split", ["abc", "0,0,0", "-1,1,0"])
def test_data_prepare_split_that_is_no_split(tmp_path, corpus, split):
    refuses(data_cli.main, ["prepare", "--input", _text(tmp_path, 20), "--output-prefix", tmp_path / "o", "--tokenizer",
                            corpus["tokenizer"], "--split", split], "--split")


@pytest.mark.parametrize("size", ["1", "-5"])
def test_data_prepare_vocab_size_that_is_none(tmp_path, size):
    refuses(data_cli.main, ["prepare", "--input", _text(tmp_path, 20), "--output-prefix", tmp_path / "o", "--vocab-size",
                            size], "--vocab-size")


def test_data_prepare_output_prefix_over_the_input(tmp_path, corpus):
    """--output-prefix naming the input file itself (its .bin / .idx go beside it): the input is kept."""
    src = _text(tmp_path, 20)
    before = src.read_bytes()
    rc, _, err, exc = call(data_cli.main, ["prepare", "--input", src, "--output-prefix", src, "--tokenizer",
                                           corpus["tokenizer"]])
    assert exc is None and "Traceback" not in err, err
    kept({"": before}, {"": src.read_bytes()})
    record("ok" if rc == 0 else outcome(rc, err, exc, ("--output-prefix",)))


# --- cache: the sampled / top-P flags -----------------------------------------------------------------------------

TOY = "test_cache_resume:make_teacher"  # tests/cache: V=300, a deterministic causal toy teacher


@pytest.fixture
def toy_teacher(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "cache"))


def _build(tmp_path, *more):
    tok = tmp_path / "tokens.npy"
    np.save(tok, np.random.default_rng(0).integers(0, 300, size=(4, 9)))
    return ["build", "--out", tmp_path / "cache", "--teacher", TOY, "--tokens", tok, "--no-progress", *more]


def test_cache_build_topp_with_samples_names_the_flag_to_drop(tmp_path, toy_teacher):
    line = refuses(cache_cli.main, _build(tmp_path, "--encoding", "topp", "--samples", "8"), "--samples")
    assert "drop" in line and "add --top-p" not in line, line


def test_recipe_topp_with_samples_names_the_key_to_drop(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refuses(train_cli.main, ["data=mock", "data.vocab_size=250", "data.seq_length=16", "kd.top_k=4", *TINY,
                                    "kd.cache_encoding=topp", "kd.cache_samples=8"], "kd.cache_samples")
    assert "drop" in line, line


@pytest.fixture(scope="module")
def k4_cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("k4")
    sys.path.insert(0, str(ROOT / "tests" / "cache"))
    try:
        rc, _, err, exc = call(cache_cli.main, [*_build(d, "--top-k", "4")])
    finally:
        sys.path.remove(str(ROOT / "tests" / "cache"))
    assert rc == 0 and exc is None, err
    return d / "cache"


def test_cache_inspect_min_k_above_the_caches_k(k4_cache):
    line = refuses(cache_cli.main, ["inspect", k4_cache, "--top-p", "0.9", "--min-k", "9"], "--min-k")
    assert "4" in line


def test_cache_verify_of_a_truncated_manifest(k4_cache, tmp_path):
    c = tmp_path / "c"
    shutil.copytree(k4_cache, c)
    m = c / "manifest.json"
    m.write_bytes(m.read_bytes()[:40])
    rc, _, err, exc = call(cache_cli.main, ["verify", c])
    assert record(outcome(rc, err, exc, ("manifest",))) == "held", err


def test_cache_build_out_a_directory_of_the_users(tmp_path, toy_teacher):
    """--out a non-empty directory that is no cache (the user's files in it): refused, the files kept."""
    out = tmp_path / "cache"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    rc, _, err, exc = call(cache_cli.main, _build(tmp_path, "--top-k", "4"))
    got = record(outcome(rc, err, exc, (str(out),)))
    kept(before, {k: v for k, v in snapshot(out).items() if k in before})
    assert got == "held", f"{got}: {err}"


# --- compare: runs cut off while writing --------------------------------------------------------------------------

def test_compare_of_a_truncated_summary_names_the_file(run_copy):
    s = run_copy / "summary.json"
    s.write_text(s.read_text()[:25])
    refuses(compare_cli.main, [run_copy, "--no-eval"], str(s))


def test_compare_of_metrics_cut_off_mid_record_tables_the_run(run_copy, tmp_path):
    m = run_copy / "metrics.jsonl"
    m.write_text(m.read_text() + '{"kind": "train", "iterat')
    rc, out, err, exc = call(compare_cli.main, [run_copy, "--no-eval", "--out", tmp_path / "report"])
    works(rc, err, exc)


def test_compare_of_metrics_with_a_broken_line_names_it(run_copy, tmp_path):
    m = run_copy / "metrics.jsonl"
    m.write_text("not json\n" + m.read_text())
    refuses(compare_cli.main, [run_copy, "--no-eval", "--out", tmp_path / "report"], str(m))


def test_compare_out_inside_the_run(run_copy):
    before = snapshot(run_copy)
    refuses(compare_cli.main, [run_copy, "--no-eval", "--out", run_copy / "iter_0000001"], "--out")
    kept(before, snapshot(run_copy))


# --- train: recipes of the user's, reruns with other values -------------------------------------------------------

USER_RECIPE = """defaults:
  - megatron_kd
  - model: tiny_student
  - teacher: tiny_teacher
  - parallel: single
  - data: mock
  - kd: ce
  - train: tiny_cpu
  - _self_
"""


def test_user_recipe_with_a_pkg_config_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refuses(train_cli.main, ["--config-path", "pkg://megatron_kd.recipes", "--config-name", "my_recipe",
                                    *MOCK], "--config-path", "my_recipe")
    assert "pkg:/megatron_kd" not in line.replace("pkg://", ""), line


def test_user_recipe_without_its_searchpath(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "my_recipe.yaml").write_text(USER_RECIPE)
    line = refuses(train_cli.main, ["--config-path", tmp_path / "mine", "--config-name", "my_recipe", *MOCK],
                   "searchpath", "my_recipe.yaml")
    assert not (tmp_path / "runs").exists()
    assert "pkg://megatron_kd.recipes" in line


def test_plan_of_a_user_recipe_without_its_searchpath(tmp_path):
    (tmp_path / "my_recipe.yaml").write_text(USER_RECIPE)
    refuses(plan_cli.main, [tmp_path / "my_recipe.yaml"], "searchpath")


def test_user_recipe_with_its_searchpath_in_a_dir_with_spaces_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "my recipes"
    d.mkdir()
    (d / "my_recipe.yaml").write_text(USER_RECIPE + "hydra:\n  searchpath: [pkg://megatron_kd.recipes]\n")
    works(*[call(train_cli.main, ["--config-path", d, "--config-name", "my_recipe", *MOCK,
                                  f"train.save={tmp_path / 'a run'}"])[i] for i in (0, 2, 3)])
    assert (tmp_path / "a run" / "summary.json").is_file()


def test_rerun_of_a_finished_run_with_other_values_keeps_its_records(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err, exc = call(train_cli.main, [*MOCK, "hydra.run.dir=runs/one", "train.lr=1e-3"])
    assert rc == 0 and exc is None, err
    before = snapshot(tmp_path / "runs" / "one")
    refuses(train_cli.main, [*MOCK, "hydra.run.dir=runs/one", "train.lr=5e-3"], "train.lr")
    kept(before, snapshot(tmp_path / "runs" / "one"))


def test_rerun_of_a_finished_sweep_with_other_values_keeps_its_records(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = [*MOCK, "hydra.sweep.dir=runs/sweep"]
    rc, _, err, exc = call(train_cli.main, ["-m", *sweep, "train.lr=1e-3,2e-3"])
    assert rc == 0 and exc is None, err
    before = snapshot(tmp_path / "runs" / "sweep")
    refuses(train_cli.main, ["-m", *sweep, "train.lr=5e-3,6e-3"], "train.lr", "sweep run 0")
    kept(before, snapshot(tmp_path / "runs" / "sweep"))


@pytest.mark.parametrize("override,key", [("train.iters=abc", "train.iters"), ("train.iters=-1", "train.iters"),
                                          ("train.lr=-1", "train.lr"), ("data.seq_length=0", "data.seq_length"),
                                          ("train.global_batch_size=3", "train.global_batch_size"),
                                          ("train.save=", "train.save")])
def test_train_values_of_the_wrong_type_or_range(tmp_path, monkeypatch, override, key):
    monkeypatch.chdir(tmp_path)
    refuses(train_cli.main, [*MOCK, override], key)
    assert not (tmp_path / "runs").exists(), "a refused run wrote its run directory"


# --- plan refuses what train refuses ------------------------------------------------------------------------------

@pytest.mark.parametrize("override,key", [("train.micro_batch_size=0", "train.micro_batch_size"),
                                          ("train.global_batch_size=3", "train.global_batch_size")])
def test_plan_refuses_what_train_refuses(tmp_path, monkeypatch, override, key):
    monkeypatch.chdir(tmp_path)
    args = [*MOCK, override]
    refuses(train_cli.main, args, key)
    refuses(plan_cli.main, ["tiny_cpu", *args], key)
