"""`megatron-kd demo --small` end to end (CPU): table, PNG and JSON; offline top-K KD beats CE-only on KL to the
teacher; a finished demo is not overwritten without --overwrite; an interrupted one resumes."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def demo(out, *args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "megatron_kd", "demo", "--small", "--no-progress", "--out", str(out),
                           *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    p = demo(out)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return out, p.stdout


def test_demo_runs_end_to_end(finished):
    out, stdout = finished
    res = json.loads((out / "results.json").read_text())
    rows = res["rows"]
    assert set(rows) == {"teacher", "offline", "online", "ce"}
    for key in ("offline", "online", "ce"):
        assert rows[key]["kl"] > 0 and rows[key]["ce"] > 0 and rows[key]["tokens_per_s"] > 0
        assert rows[key]["peak_mem_gib"] > 0
    # the point of the demo: distilling from the cached top-K brings the student closer to the teacher
    assert res["offline_beats_ce_on_kl"] and rows["offline"]["kl"] < rows["ce"]["kl"]
    # offline (cache, fp16 log-probs) and online (teacher in memory) train the same student
    assert rows["offline"]["kl"] == pytest.approx(rows["online"]["kl"], rel=1e-2)
    table = (out / "results.md").read_text()
    assert table.count("\n") == 6 and "| student: offline top-K KD |" in table and "held-out CE" in table
    assert "| student: CE only |" in stdout
    png = out / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    for stage in ("teacher", "student_offline", "student_online", "student_ce"):
        assert (out / stage / "latest_checkpointed_iteration.txt").exists()
    assert (out / "cache" / "manifest.json").exists()


def test_a_finished_demo_is_not_overwritten(finished):
    out, _ = finished
    before = (out / "results.json").read_bytes()
    p = demo(out, timeout=60)
    assert p.returncode == 2 and "holds a finished demo" in p.stderr and "--overwrite" in p.stderr
    assert (out / "results.json").read_bytes() == before


def test_an_interrupted_demo_resumes(finished, tmp_path):
    """As if killed before the comparison: a rerun skips every finished stage and only compares."""
    import shutil
    src, _ = finished
    out = tmp_path / "run"
    shutil.copytree(src, out)
    (out / "results.json").unlink()
    p = demo(out, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for stage in ("teacher", "student_offline", "student_online", "student_ce"):
        assert f"{stage}: already trained" in p.stdout
    assert "data: " in p.stdout and "present" in p.stdout and "megatron-kd train" not in p.stdout
    assert json.loads((out / "results.json").read_text())["offline_beats_ce_on_kl"]
