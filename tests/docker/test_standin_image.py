"""The image of docker/Dockerfile built and run, on the stand-in base of make_standin_base.sh (the NeMo base cannot
be pulled without registry access). Opt-in, since it needs a Docker daemon and minutes: MEGATRON_KD_DOCKER=1
(and the base, made once: bash tests/docker/make_standin_base.sh)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE, IMAGE = "megatron-kd-base:standin", "megatron-kd:standin"

pytestmark = pytest.mark.slow


def docker(*args, **kw):
    return subprocess.run(["docker", *args], capture_output=True, text=True, cwd=ROOT, **kw)


@pytest.fixture(scope="module")
def image():
    if os.environ.get("MEGATRON_KD_DOCKER") != "1":
        pytest.skip("opt-in: MEGATRON_KD_DOCKER=1 builds and runs the image (tests/docker/README.md)")
    if shutil.which("docker") is None or docker("info").returncode != 0:
        pytest.skip("no Docker daemon here")
    if docker("image", "inspect", BASE).returncode != 0:
        pytest.skip(f"no {BASE}: bash tests/docker/make_standin_base.sh")
    out = docker("build", "-f", "docker/Dockerfile", "--build-arg", f"BASE_IMAGE={BASE}", "-t", IMAGE, ".")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "megatron-kd 0.1.0" in out.stdout + out.stderr
    return IMAGE


def test_the_image_routes_commands(image):
    out = docker("run", "--rm", image)
    assert out.returncode == 0 and "usage: megatron-kd" in out.stdout
    out = docker("run", "--rm", image, "prune", "--hf", "/nope", "--out", "/tmp/x", "--keep-layers", "0")
    assert out.returncode == 2 and "megatron-kd prune: error: /nope has no config.json" in out.stderr


def test_the_small_demo_runs_in_the_image(image):
    out = docker("run", "--rm", image, "demo", "--small")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[demo 7/7" in out.stdout and "offline top-" in out.stdout
