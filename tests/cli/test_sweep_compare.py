"""`megatron-kd train -m` (a Hydra multirun sweep) over one teacher cache, and `megatron-kd compare` of its runs.

The sweep's first run builds the cache; the others read it with no teacher call (counted); a cache inside a run's
own directory, or a run that would rebuild the sweep's finished cache, is refused in one sentence."""
import json
import os

import pytest

from megatron_kd.cli import compare as compare_cli
from megatron_kd.cli import train as train_cli
from megatron_kd.recipe.compose import compose
from megatron_kd.recipe.checks import check_sweep_run
from megatron_kd.recipe.schema import RecipeError, to_recipe
from train_harness import BASE, TEACHER_ARCH

pytestmark = pytest.mark.slow

ITERS = 2


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Two divergences x two learning rates from one cache, in one process; teacher calls counted per run."""
    import megatron_kd.teacher.build as build
    work = tmp_path_factory.mktemp("sweep")
    calls, real = [], build._start_teacher_topk

    def counting(*a, **k):
        calls[-1] += 1
        return real(*a, **k)

    import megatron_kd.training.loop as loop
    real_run = loop.run

    def run(*a, **k):
        calls.append(0)
        return real_run(*a, **k)
    mp = pytest.MonkeyPatch()
    mp.chdir(work)
    mp.setattr(build, "_start_teacher_topk", counting)
    mp.setattr(loop, "run", run)
    try:
        rc = train_cli.main(["-m", *BASE, *TEACHER_ARCH, f"train.iters={ITERS}", "kd.cache=runs/shared_cache",
                             "kd.divergence=forward_kl,jsd", "train.lr=1e-3,3e-3"])
    finally:
        mp.undo()
    return work, rc, calls


def test_a_sweep_runs_each_value_in_its_own_directory_from_one_cache(sweep):
    work, rc, calls = sweep
    assert rc == 0
    root = work / "runs" / "tiny_cpu_sweep"
    runs = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert runs == ["0", "1", "2", "3"]
    for r in runs:
        s = json.loads((root / r / "summary.json").read_text())
        assert s["iteration"] == ITERS and s["mode"] == "offline"
    assert not (root / "0" / "teacher_cache").exists()
    assert (work / "runs" / "shared_cache" / "manifest.json").is_file()
    # the first run builds the cache (one teacher call per micro-batch), the other three read it: none
    assert len(calls) == 4 and calls[0] > 0 and calls[1:] == [0, 0, 0], calls


def test_compare_tables_the_settings_that_differ_and_plots(sweep, capsys):
    work, _, _ = sweep
    root = work / "runs" / "tiny_cpu_sweep"
    # a glob of the sweep directory holds its multirun.yaml: passed over
    assert compare_cli.main([*sorted(str(p) for p in root.iterdir()), "--no-eval"]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    assert head == "| run | kd.divergence | train.lr | held-out CE | held-out KL | tokens/s | steps |", head
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4 and rows[0].startswith("| 0 | forward_kl | 0.001 |") and rows[3].startswith("| 3 | jsd | 0.003 |")
    own = json.loads((root / "0" / "summary.json").read_text())["eval"]["ce"]
    assert f"{own:.4f}" in rows[0]
    assert (root / "compare.png").stat().st_size > 20_000 and (root / "compare.md").is_file()


def test_compare_scores_every_run_against_a_teacher(sweep, capsys):
    """Run 0 as its own teacher: its full-vocabulary KL to itself is 0 and its CE is the teacher's (a wrong
    pairing of runs and checkpoints, or a KL not over the full vocabulary, breaks both)."""
    work, _, _ = sweep
    root = work / "runs" / "tiny_cpu_sweep"
    assert compare_cli.main([str(root), "--teacher", str(root / "0"), "--eval-samples", "4",
                             "--out", str(work / "cmp")]) == 0
    res = json.loads((work / "cmp" / "compare.json").read_text())
    rows = {r["run"]: r for r in res["rows"]}
    assert rows["0"]["kl"] == pytest.approx(0.0, abs=1e-5)
    assert all(rows[k]["kl"] > 1e-6 for k in ("1", "2", "3"))
    assert len({round(r["ce"], 6) for r in rows.values()}) == 4


def test_compare_refuses_a_directory_without_a_run(tmp_path, capsys):
    assert compare_cli.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-kd compare: error: ") and "summary.json" in err and len(err.splitlines()) == 1


def _recipe(*overrides):
    return to_recipe(compose("tiny_cpu", [*BASE, *overrides]))


def test_a_sweep_cache_inside_a_run_directory_is_refused(tmp_path):
    r = _recipe(f"train.save={tmp_path}/sweep/0")  # tiny_cpu: kd.cache=${train.save}/teacher_cache
    with pytest.raises(RecipeError, match=r"kd.cache=.* lies in this sweep run's own directory"):
        check_sweep_run(r)
    check_sweep_run(_recipe(f"train.save={tmp_path}/sweep/0", f"kd.cache={tmp_path}/cache"))


def test_a_sweep_run_that_would_rebuild_the_finished_cache_is_refused(sweep):
    work, _, _ = sweep
    cache = str(work / "runs" / "shared_cache")
    save = str(work / "runs" / "other")
    check_sweep_run(_recipe(f"train.save={save}", f"kd.cache={cache}", f"train.iters={ITERS}"))  # same settings
    with pytest.raises(RecipeError) as e:
        check_sweep_run(_recipe(f"train.save={save}", f"kd.cache={cache}", f"train.iters={ITERS}", "kd.top_k=4"))
    msg = str(e.value)
    assert "kd.top_k=4 (the cache: 8)" in msg and "kd.build_cache=false" in msg and "\n" not in msg
    # reading it as it is (a smaller K) is what a sweep over kd.top_k does
    check_sweep_run(_recipe(f"train.save={save}", f"kd.cache={cache}", "kd.top_k=4", "kd.build_cache=false"))
    assert os.path.isfile(os.path.join(cache, "manifest.json"))


def test_a_sweep_with_the_recipes_per_run_cache_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """tiny_cpu's kd.cache is ${train.save}/teacher_cache: in a sweep, one cache per run. The sweep is refused in
    one sentence naming its first run before any run starts: nothing trained, no file written."""
    monkeypatch.chdir(tmp_path)
    assert train_cli.main(["-m", *BASE, "train.iters=1", "kd.divergence=forward_kl,jsd"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megatron-kd train: error:")]
    assert len(err) == 1 and "sweep run 0 (kd.divergence=forward_kl)" in err[0], err
    assert "lies in this sweep run's own directory" in err[0] and "no run of the sweep was started" in err[0]
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "a refused sweep wrote files"
