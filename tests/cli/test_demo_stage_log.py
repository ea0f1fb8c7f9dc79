"""A demo training stage given log= writes its process's output to that file, not to this process's output, and a
failure names the file (what benchmarks that run stages side by side rely on)."""
from megatron_kd.cli import demo as demo_cli


def test_a_logged_stage_writes_its_output_to_its_log(tmp_path, capfd):
    d = demo_cli.Demo(str(tmp_path), demo_cli.Settings())
    log = tmp_path / "logs" / "student_ce.log"
    rc = d.stage_train("student_ce", ["train.iters=1", "--this-flag-fails"], log=str(log))  # exits non-zero at once
    out, err = capfd.readouterr()
    assert rc != 0
    text = log.read_text()
    assert text.startswith("$ megatron-kd train train.iters=1 --this-flag-fails\n")
    assert "unrecognized arguments: --this-flag-fails" in text
    assert "unrecognized arguments" not in out + err
    assert f"student_ce failed (exit {rc}); its output is in {log}" in out
