"""A rerun refused in a directory that holds a finished run leaves that run's records as they were: Hydra writes
.hydra/config.yaml, hydra.yaml and overrides.yaml (a sweep also multirun.yaml) before the task runs, so every
refusal the run makes before any work is made before Hydra writes (cli/train: save_problem, sweep_problem), and a
refusal met later inside training gives the earlier records back (cli/train.HydraRecords).

Each case records its outcome (probe.record). Runs in a base install."""
import shutil

import pytest

from megatron_kd.cli import train as train_cli
from probe import TINY, made_in, refuses, snapshot
from probe import kept as probe_kept

MOCK = ["data=mock", "data.vocab_size=250", "data.seq_length=16", "kd=ce", *TINY]


def kept(before: dict, after: dict) -> None:
    probe_kept(before, after, "the finished run's records, rewritten by a refused rerun:")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished one-step run (runs/one) and a finished two-run sweep (runs/sweep), made by `megatron-kd train`."""
    d = tmp_path_factory.mktemp("records")
    made_in(d, train_cli.main, [*MOCK, "hydra.run.dir=runs/one"],
            ["-m", *MOCK, "hydra.sweep.dir=runs/sweep", "train.lr=1e-3,2e-3"])
    return d / "runs"


@pytest.fixture
def runs(finished, tmp_path, monkeypatch):
    shutil.copytree(finished, tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs"


# refused by the run's own preflight (training/preflight: Hugging Face checkpoints, weights to start from)
PREFLIGHT = [("model.hf_path=/nonexistent/model", "model.hf_path"),
             ("train.pretrained=/nonexistent/ckpt", "train.pretrained")]


@pytest.mark.parametrize("override,key", PREFLIGHT, ids=[k for _, k in PREFLIGHT])
def test_a_rerun_refused_by_the_runs_preflight_keeps_the_records(runs, override, key):
    before = snapshot(runs / "one")
    refuses(train_cli.main, [*MOCK, "hydra.run.dir=runs/one", override], key)
    kept(before, snapshot(runs / "one"))


@pytest.mark.parametrize("override,key", PREFLIGHT, ids=[k for _, k in PREFLIGHT])
def test_a_sweep_rerun_refused_by_the_runs_preflight_keeps_the_records(runs, override, key):
    before = snapshot(runs / "sweep")
    refuses(train_cli.main, ["-m", *MOCK, "hydra.sweep.dir=runs/sweep", "train.lr=1e-3,2e-3", override], key,
            "sweep run 0")
    kept(before, snapshot(runs / "sweep"))


def test_a_refusal_inside_training_gives_the_records_back(runs, monkeypatch):
    """A refusal only the training itself can make (a cache read once the process group is up, say): stood in by
    run() refusing, after Hydra wrote its records."""
    from megatron_kd.recipe.schema import RecipeError
    from megatron_kd.training import loop

    def refused(r, save):
        raise RecipeError("kd.cache=/c: a stand-in refusal met inside the run; set kd.cache")
    monkeypatch.setattr(loop, "run", refused)
    before = snapshot(runs / "one")
    refuses(train_cli.main, [*MOCK, "hydra.run.dir=runs/one", "train.iters=2"], "kd.cache")
    kept(before, snapshot(runs / "one"))
    fresh = runs / "fresh"  # a directory with no records before: the refused run leaves none
    refuses(train_cli.main, [*MOCK, f"hydra.run.dir={fresh}"], "kd.cache")
    assert not (fresh / ".hydra").exists()


def test_a_run_stopped_while_training_keeps_the_records_of_what_ran(runs, monkeypatch):
    """A RunError is met while training (a full disk, a corrupt cache shard): the run did train under the new
    values, so Hydra's records of them stay."""
    from megatron_kd.recipe.schema import RunError
    from megatron_kd.training import loop

    def stopped(r, save):
        raise RunError("kd.cache=/c: a stand-in problem met while training; rebuild it")
    monkeypatch.setattr(loop, "run", stopped)
    refuses(train_cli.main, [*MOCK, "hydra.run.dir=runs/one", "train.iters=2"], "kd.cache")
    assert "train.iters=2" in (runs / "one" / ".hydra" / "overrides.yaml").read_text()
