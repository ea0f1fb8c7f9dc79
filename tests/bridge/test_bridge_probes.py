"""The Bridge adapter (python -m megatron_kd.bridge.run / megatron_kd.bridge.cache) used as an adversarial user
would: a recipe that is not there, an override YAML that does not read or names sections Bridge would skip, kd
values of the wrong type, a cache path that is a file. Each is refused before any work in one sentence naming the
flag or key (the probes' judgement: tests/probes/probe.py), never a traceback, never a setting dropped in silence.

Run: PYTHONPATH=$PWD /work/venv312/bin/python -m pytest -q -m bridge --require-bridge tests/bridge"""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "probes"))
from probe import call, outcome, record  # noqa: E402

pytestmark = pytest.mark.bridge
RECIPE = ["--recipe", "helpers:tiny_cfg"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bridge_probes")
    made = {"bad_yaml": "kd: [unclosed\n", "a_list": "- a\n- b\n", "kd_a_list": "kd: [1, 2]\n",
            "unknown_section": "trainn:\n  train_iters: 3\n", "unknown_key": "train:\n  train_iterz: 3\n",
            "a_file": "not a cache"}
    for name, text in made.items():
        (d / name).write_text(text)
    return d


def probe(argv, *names):
    from megatron_kd.bridge import run
    rc, out, err, exc = call(run.main, argv)
    got = record(outcome(rc, err, exc, names))
    assert got == "held", f"{got}: rc={rc}\nstderr: {err[-3000:]}\nstdout: {out[-1000:]}"
    return err


CASES = {  # name: (argv with FILES standing for the fixture's folder, names the refusal must hold)
    "recipe_module_missing": (["--recipe", "no_such_module:f", "kd.cache=/c"], ("--recipe", "no_such_module")),
    "recipe_function_missing": (["--recipe", "helpers:no_such", "kd.cache=/c"], ("--recipe", "no_such")),
    "bridge_recipe_unknown": (["--recipe", "no_such_pretrain_config", "kd.cache=/c"], ("--recipe",)),
    "config_file_missing": ([*RECIPE, "--config-file", "FILES/none.yaml"], ("--config-file", "none.yaml")),
    "config_file_not_yaml": ([*RECIPE, "--config-file", "FILES/bad_yaml"], ("--config-file", "bad_yaml", "line")),
    "config_file_a_list": ([*RECIPE, "--config-file", "FILES/a_list"], ("--config-file",)),
    "config_file_kd_a_list": ([*RECIPE, "--config-file", "FILES/kd_a_list"], ("--config-file", "kd")),
    "config_file_unknown_section": ([*RECIPE, "--config-file", "FILES/unknown_section", "kd.cache=/c"],
                                    ("--config-file", "trainn")),
    "config_file_unknown_key": ([*RECIPE, "--config-file", "FILES/unknown_key", "kd.cache=/c"],
                                ("--config-file", "train_iterz")),
    "override_unknown_section": ([*RECIPE, "kd.cache=/c", "trainn.train_iters=3"], ("trainn.train_iters",)),
    "override_wrong_type": ([*RECIPE, "kd.cache=/c", "train.train_iters=abc"], ("train.train_iters",)),
    "no_cache": ([*RECIPE], ("kd.cache",)),
    "cache_missing": ([*RECIPE, "kd.cache=FILES/no_cache"], ("no_cache", "cache build")),
    "cache_a_file": ([*RECIPE, "kd.cache=FILES/a_file"], ("a_file", "is a file")),
    "top_k_zero": ([*RECIPE, "kd.cache=/c", "kd.top_k=0"], ("kd.top_k",)),
    "top_k_a_word": ([*RECIPE, "kd.cache=/c", "kd.top_k=abc"], ("kd.top_k",)),
    "kd_key_unknown": ([*RECIPE, "kd.cache=/c", "kd.topk=3"], ("topk",)),
    "kd_override_without_value": ([*RECIPE, "kd.cache"], ("kd.cache",)),
    "temperature_negative": ([*RECIPE, "kd.cache=/c", "kd.temperature=-1"], ("temperature",)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_refused_in_one_sentence_before_any_work(files, case):
    argv, names = CASES[case]
    probe([a.replace("FILES", str(files)) for a in argv], *names)
