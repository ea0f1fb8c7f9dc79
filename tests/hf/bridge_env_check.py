"""Whether real Megatron-Bridge imports here, after the test-only shims of tests/bridge_env/ (TE and
nvidia-resiliency-ext stand-ins; CPU machines only). Importing this module applies them when Bridge is installed."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ERR = ["not checked"]


def _check():
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron's jit_fuser is torch.compile: slow on tiny CPU tests
    try:
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
            return "megatron.bridge is not installed"
    except (ImportError, ValueError) as e:
        return str(e)
    sys.path.insert(0, os.path.join(ROOT, "tests", "bridge_env"))
    try:
        import shims  # noqa: F401
        import megatron.bridge  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def bridge_import_error():
    if _ERR[0] == "not checked":
        _ERR[0] = _check()
    return _ERR[0]


bridge_import_error()
