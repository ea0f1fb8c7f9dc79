"""`megatron-kd demo --small` end to end (CPU): table, PNG and JSON; offline top-K KD beats CE-only on KL to the
teacher; a finished demo is not overwritten without --overwrite; an interrupted one resumes."""
import json
import os
import subprocess
import sys

import pytest

from megatron_kd.cli import demo as demo_cli

pytestmark = pytest.mark.slow


def demo(out, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "megatron_kd", "demo", "--small", "--no-progress", "--out", str(out),
                           *args], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    p = demo(out)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    # torch's "deprecating ShardedTensor" notice from megatron-core's checkpoint loads is dropped at the source
    assert "ShardedTensor" not in p.stderr and "FutureWarning" not in p.stderr, p.stderr[-3000:]
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
    md = (out / "results.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 6 and "held-out CE" in table[0] and table[2].startswith("| teacher (reference) |")
    assert res["date"] in md.splitlines()[0] and res["machine"] in md.splitlines()[0]
    offline = next(line for line in table if line.startswith("| student: offline top-K KD |"))
    times = res["stage_s"]
    assert f"{times['cache']:.0f} s cache + {times['student_offline']:.0f} s = " in offline  # cache counted
    assert "| student: CE only |" in stdout and "\n".join(table) in stdout
    assert res["total_s"] == pytest.approx(sum(times[k] for k in demo_cli.STAGES))
    # one counter over the seven stages, with an estimate of what is left once a stage is timed
    for i, stage in enumerate(demo_cli.STAGES, 1):
        assert f"[demo {i}/7 {stage}]" in stdout
    assert "left" in stdout.split("[demo 3/7 cache]", 1)[1].splitlines()[0]
    # every student's held-out CE and KL on the final lines, the offline one included
    final = [line for line in stdout.splitlines() if "held-out offline CE" in line]
    assert final and all(f"{k} CE {rows[k]['ce']:.4f} KL {rows[k]['kl']:.4f}" in final[0]
                         for k in ("offline", "online", "ce"))
    png = out / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    for stage in ("teacher", "student_offline", "student_online", "student_ce"):
        assert (out / stage / "latest_checkpointed_iteration.txt").exists()
    assert (out / "cache" / "manifest.json").exists()


def test_a_finished_demo_is_not_overwritten(finished):
    out, _ = finished
    before = (out / "results.json").read_bytes()
    p = demo(out)
    assert p.returncode == 2 and "holds a finished demo" in p.stderr and "--overwrite" in p.stderr
    assert (out / "results.json").read_bytes() == before


def test_an_interrupted_demo_resumes(finished, tmp_path):
    """As if killed before the comparison: a rerun skips every finished stage and only compares."""
    import shutil
    src, _ = finished
    out = tmp_path / "run"
    shutil.copytree(src, out)
    (out / "results.json").unlink()
    p = demo(out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for stage in ("teacher", "student_offline", "student_online", "student_ce"):
        assert f"{stage}] already trained" in p.stdout
    assert "data] " in p.stdout and "present" in p.stdout and "megatron-kd train" not in p.stdout
    before, after = (json.loads((d / "results.json").read_text()) for d in (src, out))
    assert after["offline_beats_ce_on_kl"]
    # the resumed table keeps the earlier start's stage times and reports the whole demo's total
    for stage in ("data", "teacher", "cache", "student_offline", "student_online", "student_ce"):
        assert after["stage_s"][stage] == before["stage_s"][stage]
        assert after["rows"].get(stage.replace("student_", ""), {}).get("train_s") == \
            before["rows"].get(stage.replace("student_", ""), {}).get("train_s")
    assert after["total_s"] == pytest.approx(sum(after["stage_s"][k] for k in demo_cli.STAGES))
    assert after["total_s"] > after["stage_s"]["teacher"] > after["this_start_s"]
    assert "s cache + " in (out / "results.md").read_text()


def test_an_interrupted_training_stage_keeps_its_time(tmp_path):
    """A stage that failed part-way keeps the time it ran, added to the rerun's (stage_times.json)."""
    d = demo_cli.Demo(str(tmp_path), demo_cli.Settings())
    d.times["student_ce_partial"] = 7.0
    d.stage_train("student_ce", ["train.iters=1", "--this-flag-fails"])  # exits non-zero at once
    assert d.times["student_ce_partial"] > 7.0 and "student_ce" not in d.times
    saved = json.loads((tmp_path / demo_cli.TIMES).read_text())
    assert saved["student_ce_partial"] == d.times["student_ce_partial"]


def test_recover_prunes_the_teacher_and_wins_it_back_three_ways(finished):
    """--recover on a finished demo: the demo is kept as it is; the pruned model holds the teacher's layers 0 and
    2 (and its embedding, norm and output layer); three short runs from it, the offline one from the demo's cache
    (not rebuilt); a table of held-out CE and KL."""
    out, _ = finished
    manifest = out / "cache" / "manifest.json"
    before = (manifest.stat().st_mtime_ns, (out / "results.json").stat().st_mtime_ns)
    p = demo(out, "--recover")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert (manifest.stat().st_mtime_ns, (out / "results.json").stat().st_mtime_ns) == before
    res = json.loads((out / "recover.json").read_text())
    rows = res["rows"]
    assert res["kept_layers"] == [0, 2] and res["teacher_layers"] == 4
    assert rows["pruned"]["ce"] > rows["teacher"]["ce"] and rows["pruned"]["kl"] > 0
    for way in ("ce", "offline", "online"):
        assert rows[way]["ce"] < rows["pruned"]["ce"], (way, rows)
    table = [line for line in (out / "recover.md").read_text().splitlines() if line.startswith("|")]
    assert len(table) == 7 and table[3].startswith("| pruned teacher, before training |")
    import torch
    from megatron_kd.cli.recover import pruned_layers
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import ModelConfig, to_recipe
    from megatron_kd.data.datasets import load_tokenizer
    from megatron_kd.runtime.dist import distributed
    from megatron_kd.training.evaluate import _load
    d = demo_cli.Demo(str(out), demo_cli.Settings(**demo_cli.SMALL), progress=False)
    r = to_recipe(compose("tiny_cpu", demo_cli.recipe_overrides(d.student_overrides("online"))))
    vocab = load_tokenizer(r.data).vocab_size
    with distributed(r.parallel, r.train.seed, "cpu"):
        t = _load(r.teacher, str(out / "teacher"), r, vocab).state_dict()
        small = ModelConfig(**{**{f: getattr(r.teacher, f) for f in ModelConfig.__dataclass_fields__},
                               "num_layers": 2})
        s = _load(small, str(out / "pruned"), r, vocab).state_dict()
    assert pruned_layers(4) == [0, 2]
    for k, v in s.items():
        src = k.replace("decoder.layers.1.", "decoder.layers.2.")
        if torch.is_tensor(v):
            assert torch.equal(v, t[src]), k


def test_recover_quantize_wins_a_quantized_teacher_back_three_ways(finished):
    """--recover --quantize: a format the CPU cannot run is refused naming the flag, before any stage; fp8 PTQ of
    the teacher (ModelOpt state in its checkpoint), then QAT, QAD offline (the demo's samples' cache again with fp32
    log-probs; the demo's own cache untouched) and online; QAD lowers the KL to the teacher below CE only's, and
    offline QAD ends within 0.5% of online in CE and KL (from the fp16 cache: 0.95% off in KL)."""
    out, _ = finished
    p = demo(out, "--recover", "--quantize", "nvfp4")
    assert p.returncode == 2 and p.stderr.strip().startswith("megatron-kd demo: error: --quantize=nvfp4 needs a CUDA")
    assert not (out / "ptq_nvfp4").exists()
    manifest = out / "cache" / "manifest.json"
    before = manifest.stat().st_mtime_ns
    p = demo(out, "--recover", "--quantize", "fp8")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert manifest.stat().st_mtime_ns == before
    from megatron_kd.checkpoint.store import read_common
    from megatron_kd.models.quant import FORMAT_KEY, STATE_KEY
    common = read_common(str(out / "ptq_fp8"))
    assert common[FORMAT_KEY] == "fp8" and STATE_KEY in common
    res = json.loads((out / "recover_fp8.json").read_text())
    rows = res["rows"]
    assert res["format"] == "fp8" and rows["pruned"]["kl"] > 0
    assert rows["offline"]["kl"] < rows["ce"]["kl"] and rows["online"]["kl"] < rows["ce"]["kl"], rows
    assert json.loads((out / "cache_fp32" / "manifest.json").read_text())["encoding"] == "fp32"
    assert all(abs(v) < 0.005 for v in res["offline_vs_online"].values()), res["offline_vs_online"]
    table = [line for line in (out / "recover_fp8.md").read_text().splitlines() if line.startswith("|")]
    assert len(table) == 7 and table[3].startswith("| PTQ: teacher quantized as fp8 + calibrated |")


def test_an_lm_eval_task_of_the_demos_held_out_text(finished, tmp_path):
    """python -m megatron_kd.cli.lm_eval_task --demo: the demo's validation samples (those its tables score), decoded
    with its tokenizer, one document each, and the lm-eval task reading them (docs/hf.md; lm-eval itself runs in
    tests/hf/test_lm_eval.py)."""
    from megatron_kd.cli.demo import Demo, Settings
    from megatron_kd.cli.lm_eval_task import TASK, main
    from megatron_kd.data.datasets import build_datasets, load_tokenizer, samples_needed
    from megatron_kd.runtime.dist import distributed
    out, _ = finished
    assert main(["--demo", str(out), "--out", str(tmp_path / "task")]) == 0
    task = json.loads((tmp_path / "task" / f"{TASK}.yaml").read_text())
    docs = [json.loads(x)["text"] for x in open(task["dataset_kwargs"]["data_files"]["test"])]
    demo = Demo(str(out), Settings(**json.loads((out / "demo_settings.json").read_text())), progress=False)
    r = demo.student_recipe("online")
    tok = load_tokenizer(r.data)
    with distributed(r.parallel, r.train.seed, "cpu"):  # the samples training/evaluate.compare scores
        _, valid = build_datasets(r.data, tok, samples_needed(r.train, r.data)[0], demo.s.eval_samples)
    assert len(docs) == demo.s.eval_samples
    for i, d in enumerate(docs):
        assert tok.encode(d)[:8] == valid[i]["tokens"].tolist()[:8], i
