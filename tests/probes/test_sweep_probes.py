"""Adversarial sweeps and `megatron-kd compare`: a finished sweep rerun with other values (refused before Hydra
rewrites any of its files), a sweep whose run was killed (named as incomplete, exit non-zero), --out an existing
file, a run dir that is none."""
import shutil

import pytest

from megatron_kd.cli import compare as compare_cli
from megatron_kd.cli import train as train_cli
from probe import TINY, call, made_in, outcome, refuses, snapshot

SWEEP = ["data=mock", "data.vocab_size=250", "data.seq_length=16", "kd.top_k=4", *TINY, "kd.cache=runs/cache",
         "hydra.sweep.dir=runs/sweep"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A finished two-run sweep (train.lr=1e-3,2e-3) over one cache it built; a copy whose run 1 was killed."""
    work = tmp_path_factory.mktemp("sweep")
    made_in(work, train_cli.main, ["-m", *SWEEP, "train.lr=1e-3,2e-3"])
    killed = work / "runs" / "killed"
    shutil.copytree(work / "runs" / "sweep", killed)
    (killed / "1" / "summary.json").unlink()  # a run killed mid-way has no summary
    return work


def test_rerun_of_a_finished_sweep_with_other_values_rewrites_nothing(sweep, monkeypatch):
    monkeypatch.chdir(sweep)
    before = snapshot(sweep / "runs" / "sweep")
    refuses(train_cli.main, ["-m", *SWEEP, "kd.top_k=3", "train.lr=1e-3,2e-3"], "kd.top_k", "kd.cache")
    assert snapshot(sweep / "runs" / "sweep") == before, "a refused sweep rewrote files of the finished one"


def test_compare_of_a_sweep_with_a_killed_run_names_it(sweep):
    rc, out, err, exc = call(compare_cli.main, [sweep / "runs" / "killed", "--no-eval"])
    assert exc is None and "Traceback" not in err, err
    assert rc != 0, "a sweep missing a run compared with exit 0"
    assert "1" in err and "incomplete" in err, err
    assert "| 0 |" in out  # the finished run is still tabled


def test_compare_out_an_existing_file(sweep, tmp_path):
    f = tmp_path / "report.md"
    f.write_text("mine")
    refuses(compare_cli.main, [sweep / "runs" / "sweep", "--no-eval", "--out", f], "--out", str(f))
    assert f.read_text() == "mine"


@pytest.mark.parametrize("what", ["missing", "empty_dir", "a_file"])
def test_compare_of_no_run(tmp_path, what):
    p = tmp_path / "run"
    if what == "empty_dir":
        p.mkdir()
    elif what == "a_file":
        p.write_text("x")
    refuses(compare_cli.main, [p, "--no-eval"], str(p))


def test_compare_of_a_run_with_no_checkpoint(sweep, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(sweep / "runs" / "sweep" / "0", run)
    for d in run.glob("iter_*"):
        shutil.rmtree(d)
    (run / "latest_checkpointed_iteration.txt").unlink()
    refuses(compare_cli.main, [run, "--no-eval"], str(run))
