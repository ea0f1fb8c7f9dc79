"""Which layer spec built a checkpoint's model, recorded in its common state, and whether a model built here can
load it: compared before any model is built.

megatron-core's local layer spec (also the SDPA spec: the local layers with torch SDPA core attention) and
Transformer Engine's spec name some weights differently in a checkpoint (an MoE layer's pre-MLP norm is
`mlp.linear_fc1.layer_norm_weight` on the local spec, `pre_mlp_layernorm.weight` on TE's) and compute in other
kernels. `attention_backend=auto` builds TE's spec where TE imports and the SDPA spec elsewhere, so one recipe builds
other layers on another machine: a run started without TE and resumed in a NeMo container, or the reverse, would
fail inside dist_checkpointing, or continue on other kernels than it trained on. So every checkpoint records
layer_backend (SPEC_KEY), and a load compares it with the spec the builder will build (runtime/features.spec_backend,
the rule the builder builds by) and refuses in one sentence naming the setting and the value that loads it.

Checkpoints saved before the record existed are told apart only by a failed load: spec_hint names the spec when
the weight the load missed is one of the names the specs disagree on; otherwise the checkpoint is called damaged.
"""
import re

from ..errors import RunError

SPEC_KEY = "layer_spec"

NAMES = {"te": "Transformer Engine's layer spec", "sdpa": "the SDPA layer spec",
         "local": "megatron-core's local layer spec"}


def base(spec: str | None) -> str | None:
    """te, sdpa or local: FP8 (te+fp8, te+fp8+fp8_attention) runs on TE's layers and saves TE's weight names, so a
    checkpoint trained in FP8 loads into TE's spec in bf16."""
    return spec.split("+")[0] if spec else None


def record(chunks) -> dict:
    """The common-state entry that records which spec built `chunks`."""
    from ..models.builder import layer_backend, unwrap
    return {SPEC_KEY: layer_backend(unwrap(chunks[0]))}


def saved(common: dict) -> str | None:
    """The base spec a checkpoint's common state records (None: saved before the record existed)."""
    return base(common.get(SPEC_KEY))


def _te_here() -> bool:
    from ..runtime import features
    return features.te_available()


def _builds(m) -> str:
    """The spec the builder builds for `m` here; te where it asks for TE's and TE does not import (the build would
    refuse; named as what it asks for)."""
    from ..runtime import features
    try:
        return features.spec_backend(m)
    except RuntimeError:  # attention_backend=te without TE: the recipe checks and the builder say so themselves
        return "te"


def _te_elsewhere(what: str, setting: str, likely: bool = False) -> str:
    return (f"{what} was {'likely ' if likely else ''}saved on {NAMES['te']}, which cannot be built here (Transformer "
            "Engine does not import); load it where Transformer Engine imports (a NeMo or Megatron-Bridge "
            f"container), with {setting.format('te')}")


def _why(a: str, b: str) -> str:
    if "te" in (a, b):
        return ("TE's spec names some weights differently, e.g. an MoE layer's pre-MLP norm, and computes in other "
                "kernels")
    return "the two compute attention in other kernels"


def refusal(common: dict, m, what: str, setting: str) -> str | None:
    """The sentence refusing to load a checkpoint (its common state) into the model `m` (a ModelConfig) builds here;
    None when its recorded spec is the one built, or it records none. what: the checkpoint as the user named it
    ("train.load=runs/x: iteration 100's checkpoint"); setting: the setting that chooses the spec, with {} for the
    value ("model.attention_backend={}")."""
    s = saved(common)
    if s is None:
        return None
    if s == "te" and not _te_here():
        return _te_elsewhere(what, setting)
    now = _builds(m)
    if s == now:
        return None
    how = setting.format(m.attention_backend)
    if m.attention_backend == "auto":
        how += f" ({'Transformer Engine imports' if now == 'te' else 'Transformer Engine does not import'} here)"
    return (f"{what} was saved on {NAMES[s]} and {how} builds {NAMES[now]}; set {setting.format(s)} to load it on "
            f"the layers it was saved on ({_why(s, now)})")


def build_as_saved(common: dict, m, chosen: str | None, what: str, setting: str) -> None:
    """For a model rebuilt from its checkpoint alone (export, compare, a mkd: teacher), whose saved recipe says
    attention_backend=auto (which picks a spec by what imports here): `m` (its ModelConfig) is set to build `chosen`
    (te, sdpa or local: the user's, for a checkpoint that records no spec), else the spec the checkpoint records,
    else its own. RunError where that cannot load it or cannot be built here (TE's spec recorded, TE not
    importable)."""
    if chosen is not None and chosen not in NAMES:
        raise RunError(f"{setting.format(chosen)}: use one of {', '.join(NAMES)}, or leave it out to build the spec "
                       "the checkpoint records")
    m.attention_backend = chosen or saved(common) or m.attention_backend
    why = refusal(common, m, what, setting)
    if why:
        raise RunError(why)
    if m.attention_backend == "te" and not _te_here():  # no record: the builder's RuntimeError, a raw traceback
        how = setting.format("te") if chosen else "its recipe's attention_backend=te"
        raise RunError(f"{what}: {how} builds {NAMES['te']}, which cannot be built here (Transformer Engine does "
                       f"not import); set {setting.format('sdpa')} for a checkpoint saved without it, or load it "
                       "where Transformer Engine imports (a NeMo or Megatron-Bridge container)")


# Weight names that one spec saves and the other does not: the norms TE fuses into its linears (saved as
# linear_qkv / linear_fc1's layer_norm_weight) and the ones it keeps as modules of their own (an MoE layer's
# pre_mlp_layernorm, where the local spec maps its pre-MLP norm to linear_fc1's name).
_SPEC_WEIGHTS = ("layer_norm_weight", "layer_norm_bias", "input_layernorm.", "pre_mlp_layernorm.")
# How megatron-core (a tensor: KeyError from its shape check), torch's checkpoint planner (an object) and
# load_state_dict name a weight the checkpoint does not hold.
_MISSING = (re.compile(r"""["']?([\w./]+) from model not in state dict"""),
            re.compile(r"Missing key in checkpoint state_dict: ([\w./]+)"),
            re.compile(r"""(?:Missing|Unexpected) key\(s\) in state_dict: ["']([\w./]+)"""))


def missing_spec_weight(e: BaseException) -> str | None:
    """The weight a failed load missed, where it is a name the specs disagree on (None otherwise)."""
    text = str(e)
    for rx in _MISSING:
        for key in rx.findall(text):
            if any(n in key for n in _SPEC_WEIGHTS):
                return key.rstrip(".")
    return None


def summary(e: BaseException) -> str:
    """`Type: first line` of an exception, or of the innermost error a traceback it carries ends with (torch's
    CheckpointException holds each rank's traceback); at most 200 characters."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if len(lines) > 1 and any(ln.startswith("Traceback") for ln in lines):
        return lines[-1][:200]
    return (f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__)[:200]


def spec_hint(e: BaseException, chunks, what: str, setting: str) -> str | None:
    """For a checkpoint that records no spec: the sentence naming the spec as the likely cause of the failed load
    `e` into `chunks` (the model built), or None when what it missed is not a name the specs disagree on."""
    from ..models.builder import layer_backend, unwrap
    key = missing_spec_weight(e)
    if key is None or chunks is None:
        return None
    built = base(layer_backend(unwrap(chunks[0])))
    other = "sdpa" if built == "te" else "te"
    if other == "te" and not _te_here():
        return _te_elsewhere(what, setting, likely=True) + f" (it holds no {key}, which {NAMES[built]} built here " \
            "asks for; checkpoints of older runs do not record their spec)"
    return (f"{what} holds no {key}, which {NAMES[built]} built here asks for: it was likely saved on {NAMES[other]} "
            f"(checkpoints of older runs do not record their spec); set {setting.format(other)} to load it")
