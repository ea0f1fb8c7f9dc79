"""The schema owns each field's resume policy: every field of every recipe section declares one, and the resume
comparison is derived from them (a change to any architecture field is refused, naming the key)."""
import dataclasses
import typing

import pytest

from megatron_kd import field_policy as fp
from megatron_kd.errors import RecipeError
from megatron_kd.recipe.schema import ModelConfig, Recipe, TeacherConfig


def test_every_field_of_every_section_declares_its_resume_policy():
    assert fp.unclassified(Recipe) == []
    # the check itself sees a field declared without a policy
    Extra = dataclasses.make_dataclass("Extra", [("undeclared", int, dataclasses.field(default=0))],
                                       bases=(ModelConfig,))
    assert fp.unclassified(Extra) == ["undeclared"]


def _other(f: dataclasses.Field, value):
    """A value of field f's type other than `value`."""
    hint = typing.get_type_hints(ModelConfig)[f.name]
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = typing.get_origin(kinds[0]) or kinds[0]
    if kind is bool:
        return not value
    if kind is int:
        return 3 if value is None else value + 1
    if kind is float:
        return 0.5 if value is None else value * 2 + 1
    if kind is str:
        return "other" if value is None else value + "_other"
    if kind is list:
        return [3, 0] if value is None else [*value, 1]
    if kind is dict:
        return {**(value or {}), "other": 1}
    raise AssertionError(f"no other value for {f.name}: {hint}")


ARCH = [f for f in dataclasses.fields(ModelConfig) if fp.policy(f) == fp.ARCHITECTURE]


def test_the_architecture_fields_are_read_from_the_schema():
    assert len(ARCH) > 19 and {"rotary_base", "softmax_type", "window_size", "yarn", "moe_router_topk"} <= {
        f.name for f in ARCH}


@pytest.mark.parametrize("f", ARCH, ids=[f.name for f in ARCH])
def test_a_resume_that_changes_an_architecture_field_is_refused_naming_it(f):
    from megatron_kd.training.resume import check_resume
    r = Recipe()
    saved = dataclasses.asdict(r)
    setattr(r.model, f.name, _other(f, getattr(r.model, f.name)))
    with pytest.raises(RecipeError, match=rf"another model \(model\.{f.name}: "):
        check_resume(r, "RUN", {"recipe": saved, "iteration": 3})
    r.train.resume_changes = [f"model.{f.name}"]  # never a change made on purpose
    with pytest.raises(RecipeError, match=rf"model\.{f.name}: "):
        check_resume(r, "RUN", {"recipe": saved, "iteration": 3})


TEACHER = [f for f in dataclasses.fields(TeacherConfig) if fp.policy(f) in (fp.ARCHITECTURE, fp.WEIGHTS)]


@pytest.mark.parametrize("f", TEACHER, ids=[f.name for f in TEACHER])
def test_a_resume_that_changes_the_teachers_model_or_weights_is_refused_naming_it(f):
    from megatron_kd.training.resume import check_resume
    r = Recipe()
    r.kd.mode = "online"
    saved = dataclasses.asdict(r)
    setattr(r.teacher, f.name, _other(f, getattr(r.teacher, f.name)) if f.name != "load" else "/elsewhere")
    with pytest.raises(RecipeError, match=rf"set teacher\.{f.name}="):
        check_resume(r, "RUN", {"recipe": saved, "iteration": 3})


def test_free_fields_are_not_compared():
    from megatron_kd.training.resume import resume_differences
    r = Recipe()
    saved = dataclasses.asdict(r)
    r.model.attention_backend, r.train.log_interval, r.parallel.tp = "sdpa", 1, 2
    assert resume_differences(saved, r) == []


def test_a_resume_with_another_rotary_base_is_refused_end_to_end(tmp_path):
    """`train --config-name tiny_cpu train.iters=5 train.stop_at=3 train.save=RUN` (a checkpoint at iteration 3,
    the cache built for all 5), then the rest of it with another model.rotary_base."""
    from train_harness import train
    run = tmp_path / "RUN"
    train(run, "train.iters=5", "train.stop_at=3")
    with pytest.raises(RecipeError, match=r"model\.rotary_base: 10000 there, 500 here"):
        train(run, "train.iters=5", "model.rotary_base=500")
