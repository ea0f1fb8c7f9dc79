"""`megatron-kd train` with kd.divergence / kd.cache_temperature, and the kl_bucket monitor in its log."""
import pytest

from train_harness import TEACHER_ARCH, losses, train


def test_bucket_forward_kl_training_divergence_is_the_monitor(tmp_path):
    """With tail bucket and forward KL the training divergence is the monitored one: kl == kl_bucket."""
    train(tmp_path / "run", "train.iters=2", "kd=offline", f"kd.cache={tmp_path / 'cache'}", "kd.build_cache=true",
          "kd.tail=bucket", "kd.temperature=1.5", *TEACHER_ARCH)
    recs = losses(tmp_path / "run")
    for it, rec in recs.items():
        assert rec["kl_bucket"] == pytest.approx(rec["kl"], rel=1e-5), it


@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_other_divergences_train_and_log_a_non_negative_monitor(tmp_path, divergence):
    cache = ["kd=offline", f"kd.cache={tmp_path / 'cache'}", "kd.build_cache=true", *TEACHER_ARCH]
    train(tmp_path / "fkl", "train.iters=2", *cache)
    train(tmp_path / "other", "train.iters=2", *cache, f"kd.divergence={divergence}")
    fkl, other = losses(tmp_path / "fkl"), losses(tmp_path / "other")
    assert sorted(other) == [1, 2]
    assert all(r["kl_bucket"] >= 0 for r in other.values())
    assert other[1]["kl_bucket"] == pytest.approx(fkl[1]["kl_bucket"], rel=1e-6)  # same start, same monitor
    assert abs(other[1]["kl"] - fkl[1]["kl"]) > 1e-4  # a different training divergence


def test_cache_temperature_re_tempers_a_cache_built_at_another_temperature(tmp_path):
    cache = ["kd=offline", f"kd.cache={tmp_path / 'cache'}", *TEACHER_ARCH]
    train(tmp_path / "t1", "train.iters=1", *cache, "kd.build_cache=true")  # cache captured at T = 1
    with pytest.raises(Exception, match="temperature"):
        train(tmp_path / "t2_refused", "train.iters=1", *cache, "kd.temperature=2.0")
    train(tmp_path / "t2", "train.iters=1", *cache, "kd.temperature=2.0", "kd.cache_temperature=1.0")
    assert losses(tmp_path / "t2")[1]["kl_bucket"] >= 0
