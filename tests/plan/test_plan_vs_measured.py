"""The planner against peaks measured on an H200 (benchmarks/results/long_context_h200.json: the 128K and 32K
recipes, 4 iterations each, their exact overrides): within 10%. Partial block recompute is where the plan used to
miss (1.16x at 128K), keeping the recompute working set beside the unrecomputed layers' saved tensors, which
backward frees before it reaches the recomputed layers."""
import json
import os

import pytest

from megatron_kd.plan import plan_memory
from megatron_kd.plan.recipe import from_recipe, load_recipe

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "long_context_h200.json")


@pytest.mark.parametrize("key", ["128k", "32k"])
def test_plan_within_ten_percent_of_the_h200_peak(key):
    run = json.load(open(RESULTS))["runs"][key]
    args = run["plan_command"].split()[3:]
    overrides = [a for a in args if "=" in a and not a.startswith("--")]
    rp = from_recipe(load_recipe(run["recipe"], overrides))
    layout = rp.layout
    p = plan_memory(rp.shape, layout, rp.training_for(layout))
    ratio = p.peak_bytes / 2**30 / run["peak_gib"]
    assert 0.9 <= ratio <= 1.1, (key, p.peak_bytes / 2**30, run["peak_gib"])
