"""plan/fit.py: the change `megatron-kd plan` names when a plan does not fit is the smallest one that fits."""
from dataclasses import replace

from megatron_kd.plan import Layout, Training, plan_memory, preset
from megatron_kd.plan.fit import find_fix, refusal

GPU, RESERVE = 139.8, 3.0


def fits(shape, tr):
    return plan_memory(shape, Layout(), tr).fits(GPU, RESERVE)


def test_fewest_recomputed_layers_that_fit():
    shape = preset("llama-3.2-3b")
    tr = Training(seq_len=131072, recompute="full", recompute_layers=16)
    assert not fits(shape, tr)
    fix = find_fix(shape, Layout(), tr, GPU, RESERVE)
    assert fix is not None and not fix.lean_adam
    assert fits(shape, replace(tr, recompute_layers=fix.recompute_layers))
    assert not fits(shape, replace(tr, recompute_layers=fix.recompute_layers - 1))  # the fewest
    msg = refusal(plan_memory(shape, Layout(), tr), fix, GPU, RESERVE, recipe=True)
    assert msg.startswith("does not fit: ") and f"model.recompute_num_layers={fix.recompute_layers} " in msg
    assert "unrecomputed layers" in msg and msg.count(";") == 1


def test_lean_adam_when_recompute_alone_does_not_fit():
    shape = preset("llama-3.2-3b")
    tr = Training(seq_len=131072 * 2, recompute="full")
    assert not fits(shape, tr)
    fix = find_fix(shape, Layout(), tr, GPU, RESERVE)
    assert fix is not None and fix.lean_adam
    assert fix.plan.fits(GPU, RESERVE)
    assert "--lean-adam" in refusal(plan_memory(shape, Layout(), tr), fix, GPU, RESERVE, recipe=False)


def test_nothing_fits_names_more_gpus():
    shape = preset("llama-3.2-3b")
    tr = Training(seq_len=1 << 21, recompute="full")
    assert find_fix(shape, Layout(), tr, GPU, RESERVE) is None
    msg = refusal(plan_memory(shape, Layout(), tr), None, GPU, RESERVE, recipe=True)
    assert "nothing on this layout fits" in msg and "parallel.cp" in msg
