"""Adversarial `megatron-kd export`: an --out that is (or holds) the run or its source, a non-empty --out the
export fails to replace, a checkpoint that is empty or no checkpoint. Nothing of the user's is deleted unless the
whole export succeeded (it is written beside --out, then swapped in)."""
import json

import pytest

from megatron_kd.cli import export as export_cli
from probe import call, outcome, refuses, snapshot


@pytest.fixture
def hf_src(tmp_path):
    """A directory check_hf_dir accepts (config.json naming an architecture, a weight file) whose weights no
    export can use: the export fails after its checks, as a real failure would."""
    d = tmp_path / "hf_src"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (d / "model.safetensors").write_bytes(b"not safetensors")
    return d


def test_out_is_the_run_itself_with_overwrite(finished_run, hf_src):
    before = snapshot(finished_run)
    refuses(export_cli.main, ["--checkpoint", finished_run, "--out", finished_run, "--hf-path", hf_src,
                              "--overwrite"], "--out", str(finished_run))
    assert snapshot(finished_run) == before


def test_out_holds_the_run_with_overwrite(finished_run, hf_src):
    parent = finished_run.parent
    before = snapshot(parent)
    refuses(export_cli.main, ["--checkpoint", finished_run, "--out", parent, "--hf-path", hf_src, "--overwrite"],
            "--out")
    assert snapshot(parent) == before


def test_out_holds_the_hf_source_with_overwrite(finished_run, hf_src):
    before = snapshot(hf_src.parent)
    refuses(export_cli.main, ["--checkpoint", finished_run, "--out", hf_src.parent, "--hf-path", hf_src,
                              "--overwrite"], "--out")
    assert snapshot(hf_src.parent) == before


def test_a_failed_export_keeps_the_non_empty_out_it_was_to_replace(finished_run, hf_src, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    rc, _, err, exc = call(export_cli.main, ["--checkpoint", finished_run, "--out", out, "--hf-path", hf_src,
                                             "--overwrite"])
    assert outcome(rc, err, exc) == "held", (rc, err)
    assert snapshot(out) == {"notes.txt": b"the user's"}, "the export failed, yet --out lost its files"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_src", "mine"], "a partial export was left beside"


@pytest.mark.parametrize("what", ["empty_dir", "missing", "a_file"])
def test_a_checkpoint_that_is_none(tmp_path, hf_src, what):
    ck = tmp_path / "ck"
    if what == "empty_dir":
        ck.mkdir()
    elif what == "a_file":
        ck.write_text("x")
    refuses(export_cli.main, ["--checkpoint", ck, "--out", tmp_path / "out", "--hf-path", hf_src], "--checkpoint")
    assert not (tmp_path / "out").exists()


def test_out_is_an_existing_file(finished_run, hf_src, tmp_path):
    f = tmp_path / "model.txt"
    f.write_text("keep")
    refuses(export_cli.main, ["--checkpoint", finished_run, "--out", f, "--hf-path", hf_src, "--overwrite"], "--out")
    assert f.read_text() == "keep"


def test_a_second_export_into_one_out_is_locked_out(finished_run, hf_src, tmp_path):
    import fcntl
    out = tmp_path / "hf_out"
    with open(tmp_path / ".hf_out.lock", "a+") as held:  # what a running export holds
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        refuses(export_cli.main, ["--checkpoint", finished_run, "--out", out, "--hf-path", hf_src], "another export")
    assert not out.exists()
