"""One reading of a teacher spec (teacher/spec.py) for `megatron-kd cache build` and Bridge's cache command."""
import pytest

from megatron_kd.cli.cache import main as cache_cli
from megatron_kd.teacher.protocol import CallableTeacher
from megatron_kd.teacher.spec import factory, make_teacher


def table(vocab_size: int = 8):
    return CallableTeacher(lambda tokens: None, vocab_size=vocab_size, name="table")


def test_module_function_specs_and_their_errors():
    assert factory("test_spec:table") is table
    assert make_teacher("test_spec:table", {"vocab_size": 5}).vocab_size == 5
    with pytest.raises(ValueError, match=r"^'nocolon' is not `module:function`"):
        make_teacher("nocolon", {})
    with pytest.raises(ValueError, match=r"^cannot load 'no_such_module:f' .*PYTHONPATH"):
        make_teacher("no_such_module:f", {})
    with pytest.raises(ValueError, match=r"^--teacher mkd:/x needs the run's vocab_size and seq_length"):
        make_teacher("mkd:/x", {})


def test_the_cli_reads_specs_the_same_way(tmp_path, capsys):
    import numpy as np
    with pytest.raises(SystemExit, match=r"^error: --tokens .*t.npy cannot be read as a .npy array \(No such file or directory\); give a .npy"):
        cache_cli(["build", "--out", str(tmp_path / "c"), "--teacher", "nocolon", "--tokens", str(tmp_path / "t.npy")])
    np.save(tmp_path / "t.npy", np.zeros((2, 5), dtype=np.int64))
    with pytest.raises(SystemExit, match=r"^error: 'nocolon' is not `module:function`"):
        cache_cli(["build", "--out", str(tmp_path / "c"), "--teacher", "nocolon", "--tokens", str(tmp_path / "t.npy")])
