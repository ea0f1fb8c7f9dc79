"""Adversarial `megatron-kd train` inputs: mixtures, data.path and data.split, loss weights, a run dir held by
another run. Each is refused before any model is built, in one sentence naming the key and a fix."""
import os

import pytest

from megatron_kd.cli import train as train_cli
from probe import TINY, indexed, proc_outcome, refuses, run_cli

MOCK = ["data=mock", "data.vocab_size=250", "data.seq_length=16", "kd.top_k=4", *TINY]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Hydra's run dir (runs/<recipe>) lands here
    return tmp_path


def train(corpus, path, *more):
    return ["kd=ce", *indexed(corpus, path, *more)]


@pytest.mark.parametrize("weight", ["inf", "nan", "-1", "0", "-inf"])
def test_a_mixture_weight_that_is_no_positive_number(corpus, in_tmp, weight):
    a, b = corpus["alpha"], corpus["beta"]
    line = refuses(train_cli.main, train(corpus, f"[{weight},{a},1,{b}]"), "data.path")
    assert weight.lstrip("-") in line.lower()
    assert not (in_tmp / "runs" / "tiny_cpu" / "iter_0000001").exists()


@pytest.mark.parametrize("shape", ["odd", "misordered", "prefix_first_weight_last"])
def test_a_mixture_list_of_the_wrong_shape(corpus, in_tmp, shape):
    a, b = corpus["alpha"], corpus["beta"]
    path = {"odd": f"[0.5,{a},0.5]", "misordered": f"[{a},0.5,{b},0.5]",
            "prefix_first_weight_last": f"[0.5,{a},{b},0.5]"}[shape]
    line = refuses(train_cli.main, train(corpus, path), "data.path")
    assert "[0.7," in line or "weight" in line  # the fix shows the shape a mixture takes


@pytest.mark.parametrize("where", ["single", "mixture"])
def test_a_prefix_with_no_bin_idx(corpus, in_tmp, where):
    missing = str(in_tmp / "nowhere" / "text_document")
    path = missing if where == "single" else f"[0.5,{corpus['alpha']},0.5,{missing}]"
    line = refuses(train_cli.main, train(corpus, path), "data.path", missing)
    assert "data prepare" in line


def test_a_prefix_given_with_its_bin_suffix(corpus, in_tmp):
    line = refuses(train_cli.main, train(corpus, corpus["alpha"] + ".bin"), "data.path")
    assert corpus["alpha"] in line


def test_a_mixture_naming_one_source_twice(corpus, in_tmp):
    a = corpus["alpha"]
    refuses(train_cli.main, train(corpus, f"[0.5,{a},0.5,{a}]"), "data.path")


@pytest.mark.parametrize("split", ["abc", "0,0,0", "-5,5,0", "0,100,0", "1,2,3,4"])
def test_a_data_split_that_is_no_split(corpus, in_tmp, split):
    refuses(train_cli.main, train(corpus, None, f"data.split='{split}'"), "data.split")


@pytest.mark.parametrize("key,value", [("kd.kl_weight", "-1"), ("kd.kl_weight", "nan"), ("kd.kl_weight", "inf"),
                                       ("kd.ce_weight", "-0.5"), ("kd.ce_weight", "nan"), ("kd.temperature", "-1"),
                                       ("kd.temperature", "nan"), ("kd.jsd_beta", "nan")])
def test_a_negative_or_nan_loss_weight(in_tmp, key, value):
    extra = ["kd.divergence=jsd"] if key == "kd.jsd_beta" else []
    refuses(train_cli.main, [*MOCK, f"{key}={value}", *extra], key)


def test_ce_and_kl_weights_both_zero_train_nothing(in_tmp):
    refuses(train_cli.main, [*MOCK, "kd.kl_weight=0", "kd.ce_weight=0"],
            "kd.kl_weight", "kd.ce_weight")


def test_a_corpus_too_small_for_the_split_is_refused_not_hung(corpus, tmp_path):
    """A split that gets no document made megatron-core's epoch count loop forever (only SIGKILL ended it)."""
    args = ["train", "kd=ce", *indexed(corpus, corpus["small"], "data.split='969,30,1'")]
    p = run_cli(*args, cwd=tmp_path)
    assert proc_outcome(p, ["data.split"]) == "held", (p.returncode, p.stderr[-3000:])
    assert "documents" in p.stderr


def test_a_second_run_into_a_held_save_dir_is_locked_out(in_tmp):
    from megatron_kd.training.safety import save_lock
    save = in_tmp / "held"
    os.makedirs(save)
    with save_lock(str(save)):
        refuses(train_cli.main, [*MOCK, "kd=ce", f"train.save={save}"], "train.save")


def test_kd_cache_that_is_a_file(in_tmp):
    f = in_tmp / "cache.bin"
    f.write_bytes(b"\x00" * 8)
    refuses(train_cli.main, [*MOCK, f"kd.cache={f}"], "kd.cache")
    assert f.read_bytes() == b"\x00" * 8
