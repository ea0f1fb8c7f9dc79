"""Where the loss's targets come from is decided once (recipe/targets.py), from a recipe's kd section or a
checkpoint's copy of it; the checks, the resume comparison, the preflight and the step ask it."""
import pytest

from megatron_kd.recipe.schema import KDConfig
from megatron_kd.recipe.targets import TargetSource


@pytest.mark.parametrize("kd,reads_cache,each_step,needs_teacher,distills", [
    (dict(mode="offline"), True, False, False, True),
    (dict(mode="offline", build_cache=True), True, False, True, True),
    (dict(mode="online"), False, True, True, True),
    (dict(mode="online", build_cache=True), False, True, True, True),  # build_cache means nothing online
    (dict(mode="ce"), False, False, False, False),
    (dict(mode="ce", build_cache=True), False, False, False, False),
])
def test_the_questions_a_target_source_answers(kd, reads_cache, each_step, needs_teacher, distills):
    for src in (TargetSource.of(KDConfig(**kd)), TargetSource.of(kd)):  # a recipe, a checkpoint's dict
        assert (src.reads_cache, src.teacher_each_step, src.needs_teacher, src.distills) == \
            (reads_cache, each_step, needs_teacher, distills)
        assert src.known
    assert not TargetSource.of(dict(mode="offlin")).known


def test_the_resume_comparison_asks_the_target_source(monkeypatch):
    """teacher.* keys are compared only when both runs load a teacher (the one rule, not a copy of it)."""
    from dataclasses import asdict
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import to_recipe
    from megatron_kd.training.resume import resume_differences
    r = to_recipe(compose("tiny_cpu", ["data=mock", "data.vocab_size=64", "kd=online", "teacher.load=/t"]))
    saved = asdict(r)
    saved["teacher"]["num_layers"] = r.teacher.num_layers + 1
    assert [d[0] for d in resume_differences(saved, r)] == ["teacher.num_layers"]
    monkeypatch.setattr(TargetSource, "needs_teacher", property(lambda self: False))
    assert resume_differences(saved, r) == []


def test_the_planner_and_the_demo_ask_the_target_source(monkeypatch):
    """The planner's teacher terms and the demo's student overrides follow the object's answers, not the names."""
    from megatron_kd.cli.demo import Demo, Settings
    from megatron_kd.cli.train import summary_line
    from megatron_kd.plan.memory import Training, plan_memory
    from megatron_kd.plan.shapes import Layout, preset
    student, teacher = preset("llama-3.2-1b"), preset("llama-3.2-3b")
    tr = Training(seq_len=1024, mode="online", teacher=teacher)
    demo = Demo("/nonexistent/demo", Settings(), progress=False)
    run = dict(iteration=2, iters=2, mode="offline", save="/s", eval={"ce": 1.0}, step_s=1.0)
    assert "teacher forward" in plan_memory(student, Layout(), tr).phases
    assert any(o.startswith("kd.cache=") for o in demo.student_overrides("offline"))
    assert "eval kl: not computed" in summary_line(run)
    monkeypatch.setattr(TargetSource, "teacher_each_step", property(lambda self: False))
    monkeypatch.setattr(TargetSource, "reads_cache", property(lambda self: False))
    assert "teacher forward" not in plan_memory(student, Layout(), tr).phases
    assert not any(o.startswith("kd.cache=") for o in demo.student_overrides("offline"))
    assert "eval kl: not computed" not in summary_line(run)
