"""SIGTERM / SIGINT of `megatron-kd train`: exit 128 + signal with a line saying what is kept, no child
process left behind (data-loader workers, multiprocessing's resource_tracker), and the rerun resumes."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train_records(save):
    path = os.path.join(save, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    recs = [json.loads(x) for x in open(path) if x.strip()]
    return [r["iteration"] for r in recs if r.get("kind") == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_signal_ends_train_and_its_children_and_the_rerun_resumes(tmp_path, sig):
    save = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "megatron_kd", "train", "kd=ce", "train.iters=400", "train.save_interval=4",
           "data.num_workers=1", "train.eval_interval=null", "train.tensorboard=false", "train.progress=false",
           f"train.save={save}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not any(i > 4 for i in _train_records(save)):  # a checkpoint (every 4) is on disk, training goes on
        assert proc.poll() is None, proc.communicate()  # no deadline: a loaded machine is slow, not wrong
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "expected a data-loader worker / resource_tracker under train.num_workers=1"
    proc.send_signal(sig)
    _, err = proc.communicate()
    assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
    assert "the last saved checkpoint is kept; rerun the same command to resume" in err
    # the limit only bounds the failing case (a child left behind never ends); passing returns once they end
    _, alive = psutil.wait_procs(children, timeout=600)
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    done = max(_train_records(save))
    r = subprocess.run(cmd[:5] + ["train.iters=" + str(done + 3)] + cmd[6:], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming from" in r.stdout + r.stderr
    assert max(_train_records(save)) == done + 3
