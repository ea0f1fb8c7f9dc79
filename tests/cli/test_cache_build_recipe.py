"""`megatron-kd cache build` from the command line without factories: --recipe (+ overrides, --teacher-hf), and a
--dataset that is a path points to it."""
import pytest

from megatron_kd.cli import cache as cache_cli


def refusal(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        cache_cli.main(["build", "--out", "c", *argv])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "Traceback" not in msg and "\n" not in msg
    return msg


def test_a_prefix_given_as_dataset_points_to_the_recipe_flags(capsys):
    msg = refusal(capsys, "--teacher", "hf:t", "--dataset", "runs/x/data/x")
    assert "--recipe RECIPE data.kind=indexed data.path=runs/x/data/x data.tokenizer=" in msg
    assert "module:function" in msg


def test_no_teacher_and_no_recipe_names_both_ways(capsys):
    msg = refusal(capsys, "--tokens", "t.npy")
    assert "--teacher SPEC" in msg and "--recipe RECIPE" in msg and "--teacher-hf DIR" in msg


def test_overrides_without_a_recipe_are_refused(capsys):
    assert "add --recipe RECIPE" in refusal(capsys, "--teacher-hf", "t", "data.path=x")


def test_recipe_dataset_and_hf_teacher_reach_the_factories(monkeypatch):
    """--recipe R overrides + --teacher-hf D: both factories get R and the overrides with teacher.hf_path=D."""
    from megatron_kd.teacher import factories
    seen = {}

    def fake_dataset(recipe, overrides):
        seen["dataset"] = (recipe, list(overrides))
        raise ValueError("stop here")

    monkeypatch.setattr(factories, "recipe_dataset", fake_dataset)
    with pytest.raises(SystemExit) as e:
        cache_cli.main(["build", "--out", "c", "--recipe", "tiny_cpu", "--teacher-hf", "T", "data.path=P"])
    assert seen["dataset"] == ("tiny_cpu", ["data.path=P", "teacher.hf_path=T"])
    assert str(e.value.code) == "error: --recipe tiny_cpu: stop here"
