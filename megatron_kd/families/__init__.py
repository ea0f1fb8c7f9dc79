"""Model families: one record per family, in one file each, looked up by name or by config.json's model_type.

A family's record says everything megatron-kd knows about it, so no other module names a family:
- `model_types` / `architectures`: config.json's model_type values and transformers' class names;
- `fields`: how each config.json field reaches the Megatron model: `mapped` (Megatron-Bridge's provider or
  hf/exact.py carries it exactly), `not_forward` (no part of the forward: ids, caches, training-only settings),
  or `only(...)` (a value megatron-core cannot run is refused naming the field). With `strict`, a config.json field
  the record does not list is refused by name too, so a field added to the family later cannot be silently dropped;
- `provider_fields`: a callable (hf_config, where) -> provider fields the family's bridge drops (e.g. a window on
  every layer), "module:function", imported when used;
- `hooks`: a module with the family's layer-spec fix-ups for recipe models (config_kwargs, apply_yarn,
  activation, fix_local_moe_spec; each a no-op when the recipe does not use the feature);
- `recipe_checks`: "module:function" (ModelConfig, section) -> None, raising RecipeError;
- `weights`: its Hugging Face weight names, for prune;
- `shapes`: its public architectures for the planner (ModelShape keyword arguments) and their aliases.

Adding a family: a file here defining FAMILY, and its module name in REGISTERED. This package imports only
megatron_kd.errors, so recipe/, models/, hf/ and plan/ may all read it.
"""
import importlib
from dataclasses import dataclass, field

from ..errors import HFCheckpointError

# one line per family: the module (this folder) that defines its FAMILY record
REGISTERED = (
    "llama",
    "gpt_oss",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
)


@dataclass(frozen=True)
class Rule:
    """How one config.json field is used: kind mapped | not_forward | only (allowed values)."""
    kind: str
    why: str = ""
    allowed: tuple = ()

    def check(self, name: str, value, where: str) -> None:
        if self.kind == "only" and not any(_same(value, a) for a in self.allowed):
            raise HFCheckpointError(f"{where}: config.json's {name}={value!r} cannot be built exactly in "
                                    f"megatron-core (logits would differ from transformers'); supported: {self.why}")


def _same(value, allowed) -> bool:
    if callable(allowed):
        return bool(allowed(value))
    return value == allowed and type(value) is not bool or value is allowed


def mapped(why: str = "") -> Rule:
    return Rule("mapped", why)


def not_forward(why: str = "") -> Rule:
    return Rule("not_forward", why)


def only(*allowed, why: str) -> Rule:
    return Rule("only", why, tuple(allowed))


# config.json fields no forward pass reads (every family): ids, caching, bookkeeping, initialisation
COMMON = {
    "architectures": not_forward("transformers' class name"),
    "model_type": not_forward("the family's name"),
    "transformers_version": not_forward("bookkeeping"),
    "dtype": not_forward("the stored tensors' dtype; the run's precision decides the compute dtype"),
    "torch_dtype": not_forward("older name of dtype"),
    "bos_token_id": not_forward("token ids (the tokenizer's)"),
    "eos_token_id": not_forward("token ids (the tokenizer's)"),
    "pad_token_id": not_forward("token ids (the tokenizer's)"),
    "use_cache": not_forward("generation's KV cache"),
    "initializer_range": not_forward("random initialisation only"),
    "max_position_embeddings": mapped("the RoPE length (YaRN derives its factor from it)"),
    "vocab_size": mapped(), "hidden_size": mapped(), "num_hidden_layers": mapped(),
    "num_attention_heads": mapped(), "num_key_value_heads": mapped(), "rms_norm_eps": mapped(),
    "tie_word_embeddings": mapped(),
    # RoPE: hf/exact.py carries every rope_type megatron-core runs and refuses the others by name
    "rope_parameters": mapped("hf/exact.py"), "rope_scaling": mapped("hf/exact.py (older name)"),
    "rope_theta": mapped("hf/exact.py (older name)"), "partial_rotary_factor": mapped("hf/exact.py (1.0 only)"),
    "hidden_act": only("silu", why="silu (a SwiGLU MLP)"),
    "attention_dropout": only(0, 0.0, why="0.0 (megatron-kd runs attention without dropout)"),
}


@dataclass(frozen=True)
class Weights:
    """A family's Hugging Face weight names: `layer` the prefix of decoder layer N's tensors (N where {} is), `mlp`
    the dense gated MLP's (gate, up, down) projections under a layer (None: no dense MLP to prune by width),
    `experts` the name part of a layer's MoE expert tensors (width pruning of experts is refused)."""
    layer: str = "model.layers.{}."
    mlp: tuple | None = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    experts: str | None = None
    width_key: str = "intermediate_size"   # config.json's MLP width


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple
    architectures: tuple
    fields: dict = field(default_factory=dict)
    strict: bool = False
    provider_fields: str | None = None
    hooks: str | None = None
    recipe_checks: str | None = None
    weights: Weights = Weights()
    shapes: dict = field(default_factory=dict)
    aliases: dict = field(default_factory=dict)
    quantized: dict = field(default_factory=dict)  # quant_method -> how it is read and exported

    def rules(self) -> dict:
        return {**COMMON, **self.fields} if self.strict else dict(self.fields)

    def check_config(self, raw: dict, where: str) -> None:
        """config.json's fields (the file's dict), each mapped or refused by name."""
        rules = self.rules()
        for name in sorted(set(raw) - {"quantization_config"}):  # that one below: by its quant_method
            rule = rules.get(name)
            if rule is None:
                if self.strict:
                    raise HFCheckpointError(
                        f"{where}: config.json's {name}={raw[name]!r} is a field megatron-kd does not know for "
                        f"{self.name} checkpoints, so it cannot say the model is built exactly; remove it if "
                        "transformers ignores it too, or register the field in "
                        f"megatron_kd/families/{self.name}.py")
                continue
            rule.check(name, raw[name], where)
        q = raw.get("quantization_config")
        if isinstance(q, dict):
            method = q.get("quant_method")
            if method not in self.quantized:
                known = ", ".join(self.quantized) or "none"
                raise HFCheckpointError(f"{where}: config.json's quantization_config.quant_method={method!r} is "
                                        f"not read for {self.name} checkpoints (supported: {known}); give the "
                                        "unquantized checkpoint")

    def provider_extra(self, hf_config, where: str) -> dict:
        return load(self.provider_fields)(hf_config, where) if self.provider_fields else {}

    def hooks_module(self):
        return importlib.import_module(self.hooks) if self.hooks else None


def load(spec: str):
    """'module:function' -> the function (imported now)."""
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)


_FAMILIES: dict = {}


def all_families() -> list:
    """Every registered family's record, in REGISTERED order."""
    if not _FAMILIES:
        for mod in REGISTERED:
            fam = importlib.import_module(f"{__name__}.{mod}").FAMILY
            _FAMILIES[fam.name] = fam
    return list(_FAMILIES.values())


def names() -> list:
    return [f.name for f in all_families()]


def get(name: str) -> Family:
    for f in all_families():
        if f.name == name:
            return f
    raise KeyError(f"unknown model family {name!r}; registered: {', '.join(names())}")


def model_types() -> list:
    return [t for f in all_families() for t in f.model_types]


def for_model_type(model_type, where: str) -> Family:
    """The family of config.json's model_type, or refused naming it and the registered ones."""
    for f in all_families():
        if model_type in f.model_types:
            return f
    raise HFCheckpointError(f"{where}: config.json's model_type={model_type!r} is not a registered model family, "
                            f"so megatron-kd cannot check that it builds exactly; registered: "
                            f"{', '.join(model_types())} (megatron_kd/families/ adds one)")


def for_config(cfg: dict, where: str) -> Family:
    """The family of a config.json dict: by its model_type, else (a config without one) by its architectures."""
    if cfg.get("model_type") is None:
        archs = cfg.get("architectures") or []
        for f in all_families():
            if any(a in f.architectures for a in archs):
                return f
    return for_model_type(cfg.get("model_type"), where)


def hooks() -> list:
    """The layer-spec fix-up modules of every family that has them (recipe models name no family)."""
    return [m for m in (f.hooks_module() for f in all_families()) if m is not None]


def recipe_checks(m, section: str) -> None:
    for f in all_families():
        if f.recipe_checks:
            load(f.recipe_checks)(m, section)
