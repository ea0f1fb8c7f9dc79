"""config.json's forward-pass fields that Megatron-Bridge 0.6.2's providers drop or hard-code, carried exactly
onto the provider (and, where megatron-core has no field for a value, onto the built model), or refused.

Bridge 0.6.2 builds GPT-OSS with YaRN factor 32 / original 4096 / beta 32 and 1 and a window on every second
layer whatever config.json says, and Llama 3 RoPE scaling with megatron-core's fixed low / high frequency
factors (1, 4) and original length (8192). A model built that way runs without error and gives other logits
than transformers (a depth-pruned GPT-OSS keeps its parent's layer_types, e.g. full / sliding / full). So:
- `settings(hf_config, where)` reads the fields the way transformers' forward uses them, before any work, and
  raises HFCheckpointError naming the field, its value and what is supported when megatron-core cannot run it
  (the family's record, megatron_kd/families, lists its fields and adds what its bridge drops);
- `apply(prov, s)` sets them on Bridge's provider after Bridge made it (before finalize);
- `fix_model(chunk, s)` sets the values megatron-core's RoPE module takes no field for (Llama 3 scaling).
"""
import copy
import math

from .. import families
from .checks import HFCheckpointError

# megatron-core's RotaryEmbedding._apply_scaling defaults: the only Llama 3 values its config can express
MCORE_LLAMA3 = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
MCORE_LLAMA3_FACTOR = 8.0  # RotaryEmbedding's rope_scaling_factor default
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope_parameters(hf_config) -> dict:
    """transformers' own view of the RoPE fields (rope_parameters after its standardisation: legacy
    rope_scaling / rope_theta keys moved in, original_max_position_embeddings filled)."""
    cfg = copy.deepcopy(hf_config)
    if hasattr(cfg, "standardize_rope_params"):
        cfg.standardize_rope_params()
    return dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})


def _refuse(where: str, field: str, value, supported: str):
    raise HFCheckpointError(f"{where}: config.json's {field}={value!r} cannot be built exactly in megatron-core "
                            f"(logits would differ from transformers'); supported: {supported}")


def yarn_concentration(factor: float, mscale, mscale_all_dim) -> float:
    """megatron-core's YaRN attention factor (cos/sin multiplier) for these values."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor
    return _yarn_get_concentration_factor(factor, mscale, mscale_all_dim)


def rope_settings(hf_config, where: str) -> tuple[dict, dict]:
    """(provider fields, model fixes) for config.json's RoPE."""
    rp = _rope_parameters(hf_config)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in ROPE_TYPES:
        _refuse(where, "rope_parameters.rope_type", kind, ", ".join(ROPE_TYPES))
    partial = rp.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        _refuse(where, "partial_rotary_factor", partial, "1.0 (RoPE over the whole head)")
    plain = dict(position_embedding_type="rope", rope_scaling=False, seq_len_interpolation_factor=None)
    if kind == "default":
        return plain, {}
    if kind == "linear":  # transformers divides inv_freq by factor, megatron-core the positions: same angles
        return {**plain, "seq_len_interpolation_factor": float(rp["factor"])}, {}
    if kind == "llama3":
        llama3 = {k: float(rp[k]) for k in MCORE_LLAMA3}
        fields = {**plain, "rope_scaling": True, "rope_scaling_factor": float(rp["factor"])}
        return fields, ({} if llama3 == MCORE_LLAMA3 else {"llama3": dict(factor=float(rp["factor"]), **llama3)})
    # yarn, as transformers' _compute_yarn_parameters reads it
    original = int(rp["original_max_position_embeddings"])
    factor = rp.get("factor")
    if factor is None:
        factor = hf_config.max_position_embeddings / original
    mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
    if not (mscale and mscale_all):  # transformers then uses factor alone; megatron-core does so on None
        mscale = mscale_all = None
    fields = dict(plain, position_embedding_type="yarn", yarn_rotary_scaling_factor=float(factor),
                  yarn_original_max_position_embeddings=original,
                  yarn_beta_fast=float(rp.get("beta_fast") or 32), yarn_beta_slow=float(rp.get("beta_slow") or 1),
                  yarn_mscale=mscale, yarn_mscale_all_dim=mscale_all,
                  yarn_correction_range_round_to_int=bool(rp.get("truncate", True)))
    given = rp.get("attention_factor")
    derived = yarn_concentration(float(factor), mscale, mscale_all)
    if given is not None and not math.isclose(float(given), derived, rel_tol=1e-12):
        _refuse(where, "rope_parameters.attention_factor", given,
                f"none, or the value YaRN derives from factor / mscale / mscale_all_dim ({derived!r})")
    return fields, {}


def recipe_rope_scaling(hf_config) -> dict:
    """config.json's Llama 3 RoPE scaling in the recipe's ModelConfig keys (rope_scaling, rope_scaling_factor,
    rope_low_freq_factor, ...); off (at megatron-core's values, the keys' defaults) for any other RoPE."""
    rp = _rope_parameters(hf_config)
    on = rp.get("rope_type", rp.get("type", "default")) == "llama3"
    vals = {k: float(rp[k]) for k in MCORE_LLAMA3} if on else dict(MCORE_LLAMA3)
    return dict(rope_scaling=on, rope_scaling_factor=float(rp["factor"]) if on else MCORE_LLAMA3_FACTOR,
                rope_low_freq_factor=vals["low_freq_factor"], rope_high_freq_factor=vals["high_freq_factor"],
                rope_original_max_position_embeddings=int(vals["original_max_position_embeddings"]))


def window_settings(hf_config, where: str) -> dict:
    """Provider fields for config.json's per-layer attention (layer_types, sliding_window); empty when the config
    has no layer_types (the architecture's bridge maps its window, e.g. none for Llama)."""
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        return {}
    types = list(types)
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        _refuse(where, "layer_types", bad, ", ".join(LAYER_TYPES))
    window = getattr(hf_config, "sliding_window", None)
    sliding = [t == "sliding_attention" and window is not None for t in types]
    if not any(sliding):
        return dict(window_size=None, window_attn_skip_freq=None)
    # transformers' sliding layers see the last `window` keys (the query's own included): megatron-core's
    # (window - 1, 0); window_attn_skip_freq as a list marks each 1-based layer, 1 = windowed
    return dict(window_size=(int(window) - 1, 0),
                window_attn_skip_freq=None if all(sliding) else [int(s) for s in sliding])


def every_layer_window(hf_config, where: str) -> dict:
    """Provider fields for a config.json whose sliding_window applies to every layer (Mistral, Qwen3-MoE: no
    layer_types); no window when it is null."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return dict(window_size=None, window_attn_skip_freq=None)
    return dict(window_size=(int(window) - 1, 0), window_attn_skip_freq=None)


def settings(hf_config, where: str) -> dict:
    """Everything to carry for this config: {"provider": {field: value}, "model": {...}}; refuses first. The
    family (megatron_kd/families, by config.json's model_type; an unregistered one is refused by name) adds what
    its bridge drops; its config.json field rules ran in hf/checks.check_hf_dir, before Bridge is imported."""
    fam = families.for_model_type(getattr(hf_config, "model_type", None), where)
    fields, model = rope_settings(hf_config, where)
    fields.update(window_settings(hf_config, where))
    fields.update(fam.provider_extra(hf_config, where))
    return {"provider": fields, "model": model}


def apply(prov, s: dict) -> None:
    for k, v in s["provider"].items():
        setattr(prov, k, v)


def fix_model(chunk, s: dict) -> None:
    """Values megatron-core's modules take no config field for, set on a built GPTModel chunk."""
    llama3 = s["model"].get("llama3")
    if llama3 is not None:
        set_llama3_rope(chunk, **llama3)


def set_llama3_rope(chunk, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) -> None:
    """A built GPTModel chunk's RoPE frequencies scaled by Llama 3's rule with these four values: megatron-core's
    RotaryEmbedding._apply_scaling (transformers' llama3 formula, same operations in fp32) on the unscaled
    frequencies. GPTModel passes only `factor` on (rope_scaling_factor); the other three stay at MCORE_LLAMA3."""
    rope = getattr(chunk, "rotary_pos_emb", None)
    if rope is None:
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    # GPTModel's own copies: a recipe's TransformerConfig has no rotary fields (Bridge's provider has)
    plain = RotaryEmbedding(kv_channels=chunk.config.kv_channels, rotary_percent=chunk.rotary_percent,
                            rotary_base=chunk.rotary_base, use_cpu_initialization=True).inv_freq
    rope.inv_freq = rope._apply_scaling(plain, factor=float(factor), low_freq_factor=float(low_freq_factor),
                                        high_freq_factor=float(high_freq_factor),
                                        original_max_position_embeddings=int(original_max_position_embeddings)
                                        ).to(rope.inv_freq.device)
    rope.forward.cache_clear()  # cos/sin of the old frequencies may be cached per sequence length
