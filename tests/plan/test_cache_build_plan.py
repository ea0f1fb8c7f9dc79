"""`megatron-kd plan` of an offline recipe that builds its cache first also plans the cache build: the teacher's
bf16 weights on its TP shard plus one micro-batch's no-grad forward and top-K (checked against an H200 build in
benchmarks/README.md); no such line when the recipe reads a finished cache."""
import json

from megatron_kd.cli.plan import main
from megatron_kd.plan.memory import GIB, Training, cache_build_peak
from megatron_kd.plan.shapes import Layout, param_counts, preset


def test_plan_of_a_build_cache_recipe_counts_the_cache_build(capsys):
    assert main(["llama31_8b_to_3b_32k_1xh200", "kd.build_cache=true", "kd.cache=/tmp/x", "--json"]) == 0
    build = json.loads(capsys.readouterr().out)["cache_build_gib"]
    teacher = preset("llama-3.1-8b")
    assert abs(build["weights"] - 2 * param_counts(teacher, Layout(), 0).total / GIB) < 1e-6
    assert 2.5 < build["forward"] < 6 and build["total"] == build["weights"] + build["forward"]
    assert main(["llama31_8b_to_3b_32k_1xh200", "kd.build_cache=true", "kd.cache=/tmp/x", "parallel.tp=2"]) == 0
    assert "cache build first (kd.build_cache)" in capsys.readouterr().out
    assert main(["llama31_8b_to_3b_32k_1xh200", "kd.cache=/tmp/x", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cache_build_gib"] is None


def test_the_forward_grows_with_the_micro_batch_and_halves_with_tp():
    t = preset("llama-3.1-8b")
    one = cache_build_peak(t, Layout(), Training(seq_len=32768), 32768)
    two = cache_build_peak(t, Layout(), Training(seq_len=32768), 65536)
    tp2 = cache_build_peak(t, Layout(tp=2), Training(seq_len=32768), 32768)
    assert two["forward"] > 1.9 * one["forward"] and two["weights"] == one["weights"]
    assert abs(tp2["weights"] - one["weights"] / 2) / one["weights"] < 0.02


def test_only_a_bias_free_dense_swiglu_counts_the_fused_mlp():
    """The teacher's exact SwiGLU fusion runs only without fc1 bias (models/fusions.py); with one, eager's
    intermediates are planned."""
    from dataclasses import replace
    t = preset("llama-3.1-8b")
    fused = cache_build_peak(t, Layout(), Training(seq_len=32768), 32768)["forward"]
    biased = cache_build_peak(replace(t, add_bias_linear=True), Layout(), Training(seq_len=32768), 32768)["forward"]
    assert biased > 1.5 * fused


def test_plan_sizes_the_cache_on_disk_as_the_recipe_builds_it(tmp_path, capsys):
    """`megatron-kd plan` of a kd.build_cache recipe prints the cache's bytes on disk; a real CPU build of that
    recipe's cache (tiny_cpu: its random teacher over its mock samples) writes exactly those binary bytes."""
    import os
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import to_recipe
    from megatron_kd.teacher.build import build_cache_only
    for enc in ("fp16", "compact"):
        cache = tmp_path / enc
        ov = ["train.iters=2", "kd.build_cache=true", f"kd.cache={cache}", "kd.top_k=8", f"kd.cache_encoding={enc}",
              f"train.save={tmp_path}/run_{enc}"]
        assert main(["tiny_cpu", *ov, "--json"]) == 0
        disk = json.loads(capsys.readouterr().out)["cache_disk_bytes"]
        assert disk["encoding"] == enc and disk["top_k"] == 8 and disk["low"] == disk["high"]
        build_cache_only(to_recipe(compose("tiny_cpu", ov, save=str(tmp_path / f"run_{enc}"))))
        capsys.readouterr()  # the build's own notes
        binary = os.path.getsize(cache / "samples.idx") + sum(
            os.path.getsize(cache / "shards" / f) for f in os.listdir(cache / "shards") if f.endswith(".bin"))
        assert binary == disk["high"], (enc, binary, disk)
    assert main(["tiny_cpu", *ov]) == 0
    assert f"cache on disk (kd.cache={cache}): " in capsys.readouterr().out
