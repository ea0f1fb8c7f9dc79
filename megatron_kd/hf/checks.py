"""Checks of a Hugging Face checkpoint directory made from its config.json and tokenizer files, before any model
is built: no Megatron-Bridge and no megatron-core needed (only `require_bridge` / `check_architecture` import
Bridge). Every error names the recipe key and the fix."""
import json
import os

from .. import families
from ..errors import HFCheckpointError

WEIGHT_SUFFIXES = (".safetensors", ".bin")
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
BRIDGE_INSTALL = ("Megatron-Bridge 0.6.2 (run in the NeMo container, docker/Dockerfile; or, on a CUDA machine "
                  "with torch installed and Python >= 3.12, `pip install --no-build-isolation 'megatron-kd[bridge]'`)")


def bridge_available() -> bool:
    """True when Megatron-Bridge is installed (whether it imports here is require_bridge's question)."""
    import importlib.util
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):
        return False


def require_bridge(key: str):
    """Megatron-Bridge's AutoBridge, or an error naming what to install (its import needs Transformer Engine)."""
    try:
        from megatron.bridge import AutoBridge
    except Exception as e:  # ImportError, or TE/CUDA failures inside Bridge's own imports
        raise HFCheckpointError(f"{key} needs {BRIDGE_INSTALL}; importing megatron.bridge failed here "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Unset {key} "
                                "to run without Hugging Face checkpoints.") from None
    return AutoBridge


def check_hf_dir(path, key: str) -> None:
    """A local directory with config.json (model_type, architectures) and weight files."""
    if not path or not os.path.isdir(path):
        raise HFCheckpointError(f"{key}={path!r} is not a directory: give the local Hugging Face model directory "
                                "(config.json + *.safetensors), e.g. from `huggingface-cli download`")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise HFCheckpointError(f"{key}={path!r} is not a Hugging Face checkpoint (no config.json): give the "
                                "directory holding config.json and the *.safetensors files")
    c = read_hf_config(path, key)
    if not c.get("architectures"):
        raise HFCheckpointError(f"{key}={path!r}: config.json names no `architectures` (e.g. "
                                "[\"LlamaForCausalLM\"]); save the model with transformers' save_pretrained")
    # a registered family (else refused by name), whose rules map each config.json field exactly or refuse it
    families.for_config(c, f"{key}={path!r}").check_config(c, f"{key}={path!r}")
    if not any(f.endswith(WEIGHT_SUFFIXES) for f in os.listdir(path)):
        raise HFCheckpointError(f"{key}={path!r} holds no weights (*.safetensors / *.bin): a config-only "
                                "directory; download the weights too")


def read_hf_config(path, key: str = "hf_path") -> dict:
    try:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"{key}={path!r}: cannot read config.json ({e})") from None
    text = c.get("text_config")  # multimodal wrappers keep the language model's fields here
    return {**text, "architectures": c.get("architectures"), "model_type": c.get("model_type")} \
        if isinstance(text, dict) and "num_hidden_layers" not in c else c


def quantization_note(path, key: str = "hf_path"):
    """What megatron-kd reads and writes of a quantized checkpoint (config.json's quantization_config), in its
    family's words (GPT-OSS's MXFP4: read dequantized, exported unquantized); None for an unquantized one.
    Methods the family does not read were refused by check_hf_dir."""
    c = read_hf_config(path, key)
    q = c.get("quantization_config")
    if not isinstance(q, dict):
        return None
    fam = families.for_config(c, f"{key}={path!r}")
    method = q.get("quant_method")
    return f"{path} stores its {fam.name} weights in {method}: {fam.quantized.get(method, 'not read')}"


def check_architecture(path, key: str) -> None:
    """Bridge maps this architecture (a registered model bridge), else name the ones it maps."""
    AutoBridge = require_bridge(key)
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    try:
        AutoBridge._validate_config(config, str(path))
    except ValueError:
        arch = getattr(config, "architectures", None)
        supported = ", ".join(AutoBridge.list_supported_models())
        raise HFCheckpointError(f"{key}={path!r}: Megatron-Bridge has no mapping for architecture {arch}; it maps "
                                f"{supported}. Convert the model to one of these, or register a MegatronModelBridge "
                                "for it (Bridge's models/ show how)") from None


def _experts(c: dict):
    return next((int(c[k]) for k in EXPERT_KEYS if c.get(k)), None)


def check_layout(path, key: str, *, tp: int = 1, pp: int = 1, vpp=None, ep: int = 1, etp=None) -> None:
    """The parallel layout splits this checkpoint: heads and query groups by TP, experts by EP, layers by PP."""
    c = read_hf_config(path, key)
    heads = int(c.get("num_attention_heads") or 0)
    groups = int(c.get("num_key_value_heads") or heads)
    layers = int(c.get("num_hidden_layers") or 0)
    name = f"{key}={path!r}"
    if heads % tp:
        raise HFCheckpointError(f"{name} has {heads} attention heads, which do not divide by parallel.tp={tp}: each "
                                f"TP rank holds whole heads; use a parallel.tp that divides {heads}")
    if groups % tp:
        raise HFCheckpointError(f"{name} has {groups} query groups (num_key_value_heads), which do not divide by "
                                f"parallel.tp={tp}; use a parallel.tp that divides {groups}")
    experts = _experts(c)
    if ep > 1 and not experts:
        raise HFCheckpointError(f"{name} is not a mixture of experts; set parallel.ep=1")
    if experts and experts % ep:
        raise HFCheckpointError(f"{name} has {experts} experts, which do not divide by parallel.ep={ep}; use a "
                                f"parallel.ep that divides {experts}")
    stages = pp * (vpp or 1)
    if layers % stages:
        raise HFCheckpointError(f"{name} has {layers} layers, which do not divide into parallel.pp={pp}"
                                + (f" x parallel.vpp={vpp}" if vpp else "") + " equal pipeline stages; pick "
                                f"pipeline sizes whose product divides {layers}")
    if etp and experts:
        ffn = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)
        if ffn % etp:
            raise HFCheckpointError(f"{name}: the experts' hidden size {ffn} does not divide by parallel.etp={etp}")


def hf_vocab_size(path, key: str = "hf_path") -> int:
    return int(read_hf_config(path, key)["vocab_size"])


def _vocab(path):
    """token -> id of a tokenizers JSON file, or of a directory's tokenizer.json; None when there is none."""
    f = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(f):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(f).get_vocab(with_added_tokens=True)


def check_same_tokenizer(a, a_key: str, b, b_key: str) -> None:
    """Two HF checkpoints, or an HF checkpoint and a tokenizers JSON file (data.tokenizer), tokenize alike: where
    both have a tokenizer.json, the same token -> id map; otherwise the same vocabulary size. A checkpoint's
    embedding may have more rows than its tokenizer has ids (Qwen pads 151,665 tokens to 151,936 or 152,064 rows,
    differently per model size): the rows past the tokenizer are padding, never a KD target."""
    va, vb = _vocab(a), _vocab(b)
    sizes = []
    for p, k, v in ((a, a_key, va), (b, b_key, vb)):
        rows = hf_vocab_size(p, k) if os.path.isdir(p) else None
        if v is not None and rows is not None and rows < len(v):
            raise HFCheckpointError(f"{k}={p!r}: config.json has vocab_size={rows} but its tokenizer.json has "
                                    f"{len(v)} ids: the embedding has no row for the ids past {rows}; fix the "
                                    "checkpoint's config.json or its tokenizer")
        sizes.append(len(v) if v is not None else rows)  # the tokenizer's ids; config.json's rows without one
    if None not in sizes and sizes[0] != sizes[1]:
        raise HFCheckpointError(f"{a_key}={a!r} has a vocabulary of {sizes[0]} ids and {b_key}={b!r} one of "
                                f"{sizes[1]}: distillation needs one tokenizer; use a teacher and student of one "
                                "tokenizer family, and tokenize the data with it (`megatron-kd data prepare "
                                "--tokenizer TEACHER_DIR/tokenizer.json`)"
                                + ("" if va is not None and vb is not None else
                                   " (a checkpoint without tokenizer.json is compared by config.json's vocab_size; "
                                   "add its tokenizer.json if only the embedding padding differs)"))
    if va is not None and vb is not None and va != vb:
        diff = next(t for t in sorted(set(va) | set(vb)) if va.get(t) != vb.get(t))
        raise HFCheckpointError(f"{a_key}={a!r} and {b_key}={b!r} have different tokenizers (token {diff!r}: id "
                                f"{va.get(diff)} vs {vb.get(diff)}): distillation compares the same ids; tokenize "
                                "the data with the teacher's tokenizer.json and use a student of that tokenizer")


def tokenizer_size(path) -> int | None:
    """Ids of an HF checkpoint's tokenizer.json (None without one)."""
    v = _vocab(path)
    return None if v is None else len(v)
