"""A base install: the optional extras' modules absent (as if not installed), training and the commands that need
no extra still run, and a feature that needs one refuses in one sentence naming the key and the extra's install.
(.ci/base_install.sh does the same from a wheel in a venv without them; this runs in every test environment.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kd.runtime import extras

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = ("modelopt", "transformer_engine", "megatron.bridge", "pyarrow", "lm_eval", "compressed_tensors")
FAST = ["train.iters=1", "train.eval_interval=1", "train.progress=false", "train.tensorboard=false",
        "data.seq_length=16", "data.vocab_size=250"]


@pytest.fixture(scope="module")
def hide(tmp_path_factory):
    """An environment in which importing any optional extra raises ModuleNotFoundError."""
    d = tmp_path_factory.mktemp("no_extras")
    (d / "sitecustomize.py").write_text(
        "import sys\nfor _n in %r:\n    sys.modules[_n] = None\n" % (HIDDEN,))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(d), str(ROOT)]))
    return env


def megatron_kd(env, cwd, *args):
    return subprocess.run([sys.executable, "-m", "megatron_kd", *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_training_runs_without_any_extra(hide, tmp_path):
    p = megatron_kd(hide, tmp_path, "train", "--config-name", "tiny_cpu", "kd=ce", *FAST, f"train.save={tmp_path}/r")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "modelopt" not in p.stderr


@pytest.mark.slow
def test_a_quantized_student_without_modelopt_names_the_extra(hide, tmp_path):
    p = megatron_kd(hide, tmp_path, "train", "--config-name", "tiny_cpu", "kd=ce", "quant.format=int8", *FAST,
                    f"train.save={tmp_path}/q")
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert "quant.format=int8" in out and "pip install 'megatron-kd[quant]'" in out, out[-3000:]
    assert not (tmp_path / "q").exists(), "refused after starting work"


def test_missing_names_feature_key_and_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    why = extras.missing("parquet", "Parquet corpora", "--input c.parquet")
    assert why.startswith("--input c.parquet: Parquet corpora need pyarrow")
    assert "pip install 'megatron-kd[parquet]'" in why


def test_a_package_that_is_installed_but_does_not_import_is_missing(monkeypatch, tmp_path):
    """ModelOpt installed without one of its own dependencies: find_spec finds it, its import fails."""
    pkg = tmp_path / "broken_extra_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import a_dependency_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(extras.EXTRAS, "quant", ("broken_extra_pkg", "NVIDIA ModelOpt"))
    why = extras.missing("quant", "fake-quantized students", "quant.format=fp8")
    assert why and "a_dependency_nobody_installed" in why and "megatron-kd[quant]" in why


def test_every_extra_is_declared_in_pyproject():
    import tomllib
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras.EXTRAS) <= set(declared), set(extras.EXTRAS) - set(declared)
    # ModelOpt's import needs requests, which nvidia-modelopt does not declare
    assert any(d.startswith("requests") for d in declared["quant"]), declared["quant"]
