"""What a user sees when `megatron-kd train` trains a Hugging Face student through Megatron-Bridge: progress, loss
and throughput; not megatron-core's INFO logs (its DDP lists every parameter) nor its deprecation notices."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bridge, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_a_bridge_train_prints_progress_not_the_libraries_logs(tmp_path):
    import tiny
    tiny.make_hf(str(tmp_path / "student_hf"), "llama", layers=2, hidden=48, heads=4, kv_heads=2, seed=2,
                 vocab_size=256, tied=True, tokenizer_size=256)
    env = dict(os.environ, MEGATRON_KD_VENV312=sys.prefix)
    p = subprocess.run(["bash", str(ROOT / "tests/bridge_env/megatron-kd"), "train", "--config-name", "tiny_cpu",
                        "kd=ce", f"model.hf_path={tmp_path}/student_hf", "data.vocab_size=256", "train.iters=1",
                        "train.progress=false", "train.tensorboard=false", f"train.save={tmp_path}/run"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "iter 1 | loss" in out and "megatron-kd train: done" in out, out[-3000:]
    for noise in ("main_grad.dtype", "INFO:megatron.core", "IS DEPRECATED", "is deprecated and will be removed"):
        assert noise not in out, f"{noise!r} printed:\n{out[-3000:]}"
