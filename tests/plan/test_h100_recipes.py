"""The H100 recipes and the GPU kinds `megatron-kd plan` knows.

The 32K student recipes for one H100 80GB (bf16 and FP8) were chosen with the plan and run on the device's H100
(benchmarks/results/recipes_h100.json: `megatron-kd train` of each recipe on mock data, 8 iterations of one 32K
sample, torch.cuda.max_memory_allocated). Checked here, on a CPU: each plans to fit the H100 (and the bf16 one on
both layer specs, as `auto` builds either), the measured peaks lie within 5% above the plan of their own commands,
and the measured under-count, applied to the plan, still leaves the reserve: the arm one recomputed layer lighter
(FP8, 20 layers), which the plan alone counts as fitting, ran out of memory there, and that rule refuses it.
"""
import json
import os

import pytest

from megatron_kd.cli.plan import recipe_gpu, sibling_recipe
from megatron_kd.plan import GPU_KINDS, RESERVE_GIB
from test_plan_vs_measured import RESULTS_DIR, _overrides, _plan_gib

H100 = GPU_KINDS["h100"][1]
RECIPES = ["llama31_8b_to_3b_32k_1xh100", "llama31_8b_to_3b_32k_1xh100_fp8"]
MEASURED = os.path.join(RESULTS_DIR, "recipes_h100.json")
PLAIN = ["kd.cache=/x", "data.path=/y"]


def _cli(*args):
    import contextlib
    import io
    from megatron_kd.cli.main import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", *args])
    return rc, buf.getvalue()


@pytest.mark.parametrize("name,backend", [(RECIPES[0], "te"), (RECIPES[0], "sdpa"), (RECIPES[1], "te")])
def test_h100_recipes_plan_to_fit_80gb(name, backend):
    rc, out = _cli(name, *PLAIN, f"model.attention_backend={backend}", "--json")
    d = json.loads(out)
    assert rc == 0 and d["gpu"] == "h100" and d["gpu_gib"] == H100  # the kind the recipe's name says
    assert d["fits"] and d["fits_by_gpu"] == {"h100": True, "h200": True}
    assert d["peak_gib"] + RESERVE_GIB <= H100


def test_each_recipe_names_its_gpu():
    from megatron_kd.recipe.compose import recipe_file
    for name in RECIPES:
        assert recipe_gpu(name) == "h100"
        assert open(recipe_file(name)).readline().startswith("# GPU: one H100 80GB")
    assert recipe_gpu("llama31_8b_to_3b_32k_1xh200_fp8") == "h200" and recipe_gpu("tiny_cpu") is None
    assert sibling_recipe("llama31_8b_to_3b_32k_1xh200_fp8", "h100") == RECIPES[1]
    assert sibling_recipe("llama31_8b_to_3b_128k_1xh200", "h100") is None  # none shipped


def test_plan_names_the_gpu_kinds_and_the_recipe_for_the_h100():
    rc, out = _cli("llama31_8b_to_3b_32k_1xh200", *PLAIN, "--gpu", "h100")
    assert rc == 0 and "DOES NOT FIT" in out
    assert "H100 80GB (79.1 GiB): does not fit" in out and "H200 141GB (139.8 GiB): fits" in out
    assert f"the recipe {RECIPES[0]} is this one made for the H100 80GB" in out
    rc, out = _cli(RECIPES[1], *PLAIN, "--gpu", "h200", "--json")  # another kind on purpose: that kind's memory
    assert rc == 0 and json.loads(out)["gpu_gib"] == GPU_KINDS["h200"][1]
    rc, out = _cli(RECIPES[0], *PLAIN, "--gpu-gib", "60", "--json")  # a GPU plan does not know
    d = json.loads(out)
    assert d["gpu"] is None and d["gpu_gib"] == 60 and not d["fits"]


def _arms():
    arms = json.load(open(MEASURED))["arms"]
    return {k: v for k, v in arms.items() if v["rc"] == 0}, {k: v for k, v in arms.items() if v["rc"] != 0}


def _planned(run) -> float:
    return _plan_gib(run["recipe"], _overrides(run["command"]))


def test_measured_h100_peaks_within_five_percent_of_the_plan():
    ran, _ = _arms()
    assert {v["recipe"] for v in ran.values()} == set(RECIPES)
    for name, run in ran.items():
        assert 1.0 <= run["peak_gib"] / _planned(run) <= 1.05, (name, run["peak_gib"], _planned(run))


def test_the_recipes_leave_room_for_the_measured_under_count():
    ran, failed = _arms()
    gap = max(run["peak_gib"] / _planned(run) for run in ran.values())
    for run in ran.values():
        assert _planned(run) * gap + RESERVE_GIB <= H100
    assert failed, "the lighter FP8 arm is recorded"
    for name, run in failed.items():
        assert "out of memory" in run["error_tail"].lower() or "OutOfMemory" in run["error_tail"], name
        assert _planned(run) + RESERVE_GIB <= H100  # the plan alone counted it as fitting
        assert _planned(run) * gap + RESERVE_GIB > H100, name
