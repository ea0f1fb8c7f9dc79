"""The FP8 settings a model section runs with, in megatron-core's field names: one home for the builder (which
passes them to TransformerConfig) and the planner (which counts their buffers)."""

MEGATRON_FP8_KEYS = ("fp8", "fp8_recipe", "fp8_dot_product_attention")


def fp8_kwargs(m) -> dict:
    """TE's FP8 for the transformer layers (and TE's attention if asked) from the section's own keys; the output
    layer and the fused loss stay in bf16. Both the recipe builder and Bridge's provider (HF checkpoints) take
    these fields, and then the section's `megatron:` pass-through, which may set them too."""
    if not m.fp8:
        return {}
    return dict(fp8=m.fp8, fp8_recipe=m.fp8_recipe, fp8_dot_product_attention=bool(m.fp8_attention))


def fp8_fields(m) -> dict:
    """What megatron-core ends up with: fp8_kwargs with `megatron:`'s FP8 keys on top, and the FP8 recipe (and
    FP8 attention) megatron-core's TransformerConfig defaults to where neither names them. {} when no FP8."""
    kw = {**fp8_kwargs(m), **{k: v for k, v in (m.megatron or {}).items() if k in MEGATRON_FP8_KEYS}}
    if not kw.get("fp8"):
        return {}
    missing = [k for k in MEGATRON_FP8_KEYS if k not in kw]
    if missing:
        from dataclasses import fields
        from megatron.core.transformer.transformer_config import TransformerConfig
        defaults = {f.name: f.default for f in fields(TransformerConfig)}
        kw |= {k: defaults[k] for k in missing}
    return kw


def fp8_keys(m, section: str) -> dict:
    """The recipe key each of fp8_fields' values comes from ({} when no FP8): `{section}.megatron.X` where the
    pass-through sets it, else the section's own key (fp8_dot_product_attention: `{section}.fp8_attention`), so
    that a check of the FP8 megatron-core runs with names the key the user set."""
    own = {"fp8": "fp8", "fp8_recipe": "fp8_recipe", "fp8_dot_product_attention": "fp8_attention"}
    meg = m.megatron or {}
    return {k: f"{section}.megatron.{k}" if k in meg else f"{section}.{own[k]}" for k in fp8_fields(m)}
