"""Tests against the real Megatron-Bridge 0.6.2 + megatron-core 0.19.2 (Python 3.12): marked `bridge`, skipped
where megatron.bridge does not import. The test shims (shims.py here) stand in for Transformer Engine and
nvidia-resiliency-ext, which Bridge imports unconditionally; they are imported only when Bridge is installed."""
import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "bridge: needs the real Megatron-Bridge 0.6.2 and megatron-core 0.19.2 "
                            "(Python 3.12 job: /work/venv312/bin/python -m pytest -m bridge tests/bridge)")


def _bridge_importable():
    try:
        if importlib.util.find_spec("megatron.bridge") is None:
            return False, "megatron.bridge is not installed (Python 3.12 + megatron-bridge 0.6.2)"
    except (ImportError, ValueError):
        return False, "megatron.bridge is not installed"
    sys.path.insert(0, HERE)
    try:
        import shims  # noqa: F401  (before any megatron.bridge import)
        import megatron.bridge.training.pretrain  # noqa: F401
    except Exception as e:
        return False, f"megatron.bridge does not import here: {type(e).__name__}: {e}"
    return True, ""


def pytest_collection_modifyitems(config, items):
    marked = [it for it in items if it.get_closest_marker("bridge")]
    if not marked:
        return
    ok, why = _bridge_importable()
    if not ok:
        skip = pytest.mark.skip(reason=why)
        for it in marked:
            it.add_marker(skip)
