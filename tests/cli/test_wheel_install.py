"""megatron-kd as a user gets it from a wheel: built from this tree, installed into a fresh venv, run outside the
checkout. The recipes (package data, Hydra's pkg://) and the launch scripts (data files) must come with it.

No network: the wheel is built with the setuptools already installed and installed with --no-index --no-deps; the
venv sees this environment's packages (torch, megatron-core, hydra) through a .pth line, but imports
megatron_kd from its own site-packages (checked), not from the checkout or an editable install."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "megatron_kd", "launch")


def run(cmd, cwd, env):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(bin directory, working directory outside the checkout, environment) of a venv holding the built wheel."""
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy, so that the build writes nothing into the checkout
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "MEGATRON_KD_RECIPES")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src),
                 "-w", tmp / "whl"], tmp, env)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp / "whl").glob("megatron_kd-*.whl")
    made = run([sys.executable, "-m", "venv", "--without-pip", tmp / "venv"], tmp, env)
    assert made.returncode == 0, made.stderr
    bin_dir = tmp / "venv" / "bin"
    # the dependencies (torch, megatron-core, hydra) from the environment running the tests, not from the machine's
    # own Python (--system-site-packages would read that one, which a clean-room CI leaves empty): a .pth line
    # puts its site-packages after the venv's own, and its own .pth files (an editable megatron_kd) are not run
    own = run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env)
    assert own.returncode == 0, own.stderr
    import sysconfig
    parent = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(own.stdout.strip(), "test_env_packages.pth").write_text("".join(f"{p}\n" for p in sorted(parent)))
    installed = run([sys.executable, "-m", "pip", "--python", bin_dir / "python", "install", "--no-deps",
                     "--no-index", "--force-reinstall", wheel], tmp, env)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    work = tmp / "elsewhere"
    work.mkdir()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return bin_dir, work, env


def test_the_venv_imports_the_installed_package(venv):
    bin_dir, work, env = venv
    p = run([bin_dir / "python", "-c", "import megatron_kd; print(megatron_kd.__file__)"], work, env)
    assert p.returncode == 0, p.stderr
    where = Path(p.stdout.strip()).resolve()
    site = (bin_dir.parent / "lib").resolve()
    assert site in where.parents and "site-packages" in where.parts, where


def test_plan_finds_a_shipped_recipe(venv):
    bin_dir, work, env = venv
    p = run([bin_dir / "megatron-kd", "plan", "gpt_oss_20b_32k_8xh200"], work, env)
    assert p.returncode == 0, p.stderr
    assert "model     gpt-oss-20b" in p.stdout and "per GPU in" in p.stdout, p.stdout


def test_train_prints_the_composed_recipe(venv):
    from omegaconf import OmegaConf
    bin_dir, work, env = venv
    p = run([bin_dir / "megatron-kd", "train", "--config-name", "tiny_cpu", "--cfg", "job", "train.iters=2"], work, env)
    assert p.returncode == 0, p.stderr
    cfg = OmegaConf.create(p.stdout)
    assert cfg.train.iters == 2 and cfg.kd.top_k == 16 and cfg.kd.cache == "runs/tiny_cpu/teacher_cache"
    assert not (work / "runs").exists()  # --cfg job runs nothing


def test_a_misspelt_key_is_refused_from_the_wheel(venv):
    bin_dir, work, env = venv
    p = run([bin_dir / "megatron-kd", "train", "--config-name", "tiny_cpu", "kd.topk=3"], work, env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "unknown recipe key 'kd.topk'; kd takes: " in p.stderr and "top_k" in p.stderr, p.stderr
    assert not (work / "runs").exists()


def test_launch_runs_the_installed_scripts(venv):
    bin_dir, work, env = venv
    p = run([bin_dir / "megatron-kd", "launch", "--dry-run", "tiny_cpu"], work, env)
    assert p.returncode == 0, p.stderr
    script = (bin_dir.parent / "share" / "megatron-kd" / "launch" / "torchrun.sh").resolve()
    assert p.stdout.startswith(f"bash {script} train --config-name tiny_cpu"), p.stdout
    assert "-m megatron_kd train --config-name tiny_cpu" in p.stdout  # torchrun.sh's own dry run answered


def test_train_runs_a_few_iterations_from_the_wheel(venv):
    """Last in this file: the tests above check that nothing was written to the working directory."""
    bin_dir, work, env = venv
    p = run([bin_dir / "megatron-kd", "train", "--config-name", "tiny_cpu", "train.iters=2",
             "train.tensorboard=false", "train.progress=false"], work, env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "done: 2/2 iterations" in p.stdout + p.stderr, p.stdout[-2000:]
    assert (work / "runs" / "tiny_cpu" / "summary.json").is_file()
