"""Real weights from a Hugging Face checkpoint on local disk, through Megatron-Bridge's AutoBridge.

Used by `megatron-kd train` when `model.hf_weights` (student) is set: the recipe builds the Megatron model
(any TP/PP layout), then AutoBridge maps the HF tensors onto its shards. Without Bridge: a clear error
before any work (random initialization stays the default).
"""
import importlib.util
import os


def bridge_available() -> bool:
    """True when Megatron-Bridge is installed (its import also needs Transformer Engine and a GPU stack)."""
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):
        return False


def require_bridge(key: str) -> None:
    if not bridge_available():
        raise ValueError(f"{key} needs Megatron-Bridge (its AutoBridge converts Hugging Face weights): run inside "
                         "the NeMo container (docker/Dockerfile) or `pip install megatron-bridge`; or unset "
                         f"{key} to start from random weights")


def check_hf_dir(path: str, key: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{key}={path!r} is not a Hugging Face model directory (no config.json): give the local "
                         "directory holding config.json and the *.safetensors files")


def load_hf_weights(chunks, hf_path: str, key: str = "model.hf_weights") -> None:
    """Copy the HF checkpoint's weights into this rank's model chunks (unwrapped or DDP/Float16-wrapped)."""
    require_bridge(key)
    check_hf_dir(hf_path, key)
    from megatron.bridge import AutoBridge
    bridge = AutoBridge.from_hf_pretrained(hf_path)
    bridge.load_hf_weights(list(chunks), hf_path)
