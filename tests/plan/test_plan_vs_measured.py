"""The planner against peaks measured on an H200 (torch.cuda.max_memory_allocated of `megatron-kd train`, the
commands and figures in benchmarks/results/).

long_context_h200.json (the 128K and 32K recipes, 4 iterations each, their exact overrides): within 10%. Partial
block recompute is where the plan used to miss (1.16x at 128K), keeping the recompute working set beside the
unrecomputed layers' saved tensors, which backward frees before it reaches the recomputed layers. Those runs had
no Transformer Engine, so `auto` built the local spec with SDPA: planned with model.attention_backend=sdpa.

te_stack_user_*_h200.json (the 32K recipe with lean_adam, global batch 1, R = model.recompute_num_layers layers
recomputed, the other 28 - R keeping their activations; TE 2.20.2, megatron-core 0.19.2): the local spec without
TE, TE's spec in bf16, FP8 with tensorwise (current) and delayed scaling, delayed with FP8 attention. Three checks,
each a different tolerance for a different reason:

- Per unrecomputed layer (two R of one spec: the slope of the peak in R), within 1%. What is not per layer
  cancels, so this checks the layer terms alone. The same arm measured in two calls differs by 0.013 GiB, about
  0.1% of a 4-layer slope; 1% of a layer (about 35 MiB at 32K) is the size of the smallest layer term a
  measurement can see (a [T, H] FP8 tensor is 96 MiB); smaller terms (rstd, softmax stats) are pinned by
  tests/plan/test_plan.py instead.
- Between specs at one R (TE - SDPA, FP8 - bf16, delayed - tensorwise, FP8 attention - none), within 0.3 GiB:
  the common part of both plans cancels, what is left is the spec's own terms times the unrecomputed layers plus
  FP8's weight copies. TE's arms peak 0.17-0.19 GiB above what the layer terms predict over SDPA's, the same at
  R=8 and R=12 (so not per layer: a TE workspace or working set the plan does not count); 0.3 GiB covers it.
- The peak itself, plan / measured in [0.97, 1.0]: the plan of the local spec is 1.9-2.2% under its own SDPA
  measurements here by about 2.3 GiB whatever R (transients of the step the plan does not count, not a layer
  term), and every spec inherits it; measured below the plan, or more than 3% above it, fails.
"""
import json
import os

import pytest

from megatron_kd.plan import plan_memory
from megatron_kd.plan.recipe import from_recipe, load_recipe

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
RESULTS = os.path.join(RESULTS_DIR, "long_context_h200.json")
GIB = 2 ** 30


def _overrides(command: str) -> list:
    """The recipe overrides of a recorded `megatron-kd train --config-name RECIPE ...` / `megatron-kd plan RECIPE`
    command (Hydra's own hydra.* keys dropped: no recipe key)."""
    return [a for a in command.split() if "=" in a and not a.startswith(("--", "hydra."))]


def _plan_gib(recipe: str, overrides) -> float:
    rp = from_recipe(load_recipe(recipe, overrides))
    return plan_memory(rp.shape, rp.layout, rp.training_for(rp.layout)).peak_bytes / GIB


@pytest.mark.parametrize("key", ["128k", "32k"])
def test_plan_within_ten_percent_of_the_h200_peak(key):
    run = json.load(open(RESULTS))["runs"][key]
    got = _plan_gib(run["recipe"], _overrides(run["plan_command"]) + ["model.attention_backend=sdpa"])
    ratio = got / run["peak_gib"]
    assert 0.9 <= ratio <= 1.1, (key, got, run["peak_gib"])


# name: (results file, arm, TE importable in that arm). Arms without TE ran `auto`, which then builds the SDPA spec.
ARMS = {
    "sdpa_r8": ("te_stack_user_r8_h200.json", "sdpa_no_te_r8", False),
    "sdpa_r12": ("te_stack_user_h200.json", "sdpa_no_te", False),
    "te_r8": ("te_stack_user_fp8_h200.json", "te_bf16_r8", True),
    "te_r12": ("te_stack_user_h200.json", "te_bf16", True),
    "tensorwise_r12": ("te_stack_user_h200.json", "te_fp8", True),
    "tensorwise_r8": ("te_stack_user_r8_h200.json", "te_fp8_r8", True),
    "tensorwise_r6": ("te_stack_user_r8_h200.json", "te_fp8_r6", True),
    "tensorwise_r4": ("te_stack_user_fp8_h200.json", "te_fp8_r4_exp", True),   # expandable segments: same allocated
    "tensorwise_r2": ("te_stack_user_fp8_2_h200.json", "te_fp8_r2_exp", True),
    "tensorwise_r1": ("te_stack_user_fp8_2_h200.json", "te_fp8_r1_exp", True),
    "delayed_r6": ("te_stack_user_fp8_h200.json", "te_fp8_delayed_r6", True),
    "delayed_r2": ("te_stack_user_fp8_2_h200.json", "te_fp8_delayed_r2_exp", True),
    "delayed_attention_r6": ("te_stack_user_fp8_h200.json", "te_fp8_delayed_r6_dpa", True),
}


def _arm(name) -> tuple[float, float, int]:
    """(measured peak, planned peak, R) of one arm, the plan read from the arm's own command."""
    path, arm, te = ARMS[name]
    run = json.load(open(os.path.join(RESULTS_DIR, path)))["arms"][arm]
    assert run["rc"] == 0, (name, run.get("error_tail", "")[-500:])
    over = _overrides(run["command"]) + ([] if te else ["model.attention_backend=sdpa"])
    rc = next(int(a.split("=")[1]) for a in over if a.startswith("model.recompute_num_layers="))
    return run["peak_gib"], _plan_gib("llama31_8b_to_3b_32k_1xh200", over), rc


@pytest.mark.parametrize("more,fewer", [("sdpa_r8", "sdpa_r12"), ("te_r8", "te_r12"),
                                        ("tensorwise_r8", "tensorwise_r12"), ("tensorwise_r6", "tensorwise_r8"),
                                        ("tensorwise_r4", "tensorwise_r6"), ("tensorwise_r2", "tensorwise_r4"),
                                        ("tensorwise_r1", "tensorwise_r2")])
def test_per_unrecomputed_layer_within_one_percent(more, fewer):
    """The peak's slope in R: one layer's saved tensors less its checkpoint, per spec."""
    m1, p1, r1 = _arm(more)
    m2, p2, r2 = _arm(fewer)
    measured, planned = (m1 - m2) / (r2 - r1), (p1 - p2) / (r2 - r1)
    assert abs(planned / measured - 1) <= 0.01, (more, fewer, planned, measured)


@pytest.mark.parametrize("arm,base", [("te_r8", "sdpa_r8"), ("te_r12", "sdpa_r12"),          # TE's layers
                                      ("tensorwise_r8", "te_r8"), ("tensorwise_r12", "te_r12"),  # FP8
                                      ("delayed_r6", "tensorwise_r6"),                         # delayed scaling
                                      ("delayed_r2", "tensorwise_r2"),
                                      ("delayed_attention_r6", "delayed_r6")])                 # FP8 attention
def test_between_specs_within_a_third_of_a_gib(arm, base):
    m1, p1, r1 = _arm(arm)
    m2, p2, r2 = _arm(base)
    assert r1 == r2
    assert abs((p1 - p2) - (m1 - m2)) <= 0.3, (arm, base, p1 - p2, m1 - m2)


@pytest.mark.parametrize("name", sorted(ARMS))
def test_peak_within_three_percent_below_the_measured(name):
    measured, planned, _ = _arm(name)
    assert 0.97 <= planned / measured <= 1.0, (name, planned, measured)


def test_the_fp8_recipe_is_the_measured_fp8_arm():
    """llama31_8b_to_3b_32k_1xh200_fp8 is the FP8 configuration measured on the H200 (tensorwise, 2 layers
    recomputed, lean_adam): planned from the recipe file alone it is the plan of that arm's command, and the
    plan is within 3% below the arm's measured peak."""
    path, arm, _ = ARMS["tensorwise_r2"]
    run = json.load(open(os.path.join(RESULTS_DIR, path)))["arms"][arm]
    over = [o for o in _overrides(run["command"]) if not o.startswith(("model.", "train.optimizer="))]
    recipe = _plan_gib("llama31_8b_to_3b_32k_1xh200_fp8", over)
    assert recipe == _plan_gib("llama31_8b_to_3b_32k_1xh200", _overrides(run["command"]))
    assert 0.97 <= recipe / run["peak_gib"] <= 1.0, (recipe, run["peak_gib"])
