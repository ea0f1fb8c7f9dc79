"""GPT-OSS: Bridge's GPTOSSBridge maps config.json but hard-codes YaRN and the window pattern (hf/exact.py
carries config.json's); attention sinks, clamped GLU and expert biases for recipe models in models/gpt_oss.py.

Published checkpoints keep their experts in MXFP4 (`quantization_config.quant_method: mxfp4`, tensors
`*_blocks` / `*_scales`): Bridge reads them dequantized (transformers' own dequantization), so the teacher and
the student compute with the dequantized weights, and an export writes them unquantized."""
from ..errors import RecipeError
from . import Family, Weights, only
from .llama import shape

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
YARN_KEYS = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "correction_range_round_to_int")
MXFP4 = ("its experts (*_blocks / *_scales) are read dequantized, as transformers dequantizes them; an export "
         "writes them unquantized in the export's dtype")


def check_recipe_fields(m, section: str) -> None:
    """The GPT-OSS fields of a recipe's model section: sinks, window, YaRN (models/gpt_oss.py maps them)."""
    if m.softmax_type not in SOFTMAX_TYPES:
        raise RecipeError(f"{section}.softmax_type={m.softmax_type!r}: use one of {SOFTMAX_TYPES} (learnable: "
                          "GPT-OSS's per-head attention sinks)")
    if m.window_size is not None:
        w = list(m.window_size)
        if len(w) != 2 or int(w[1]) != 0 or int(w[0]) < 0:
            raise RecipeError(f"{section}.window_size={w}: give [left, 0] (keys i - left .. i; Hugging Face's "
                              "sliding_window W is [W - 1, 0]); causal layers see no future keys")
    if m.window_attn_skip_freq is not None and int(m.window_attn_skip_freq) < 1:
        raise RecipeError(f"{section}.window_attn_skip_freq={m.window_attn_skip_freq} must be >= 1 (2: every "
                          "second layer full attention, as GPT-OSS), or null (every layer windowed)")
    bad = sorted(set(m.yarn or {}) - set(YARN_KEYS))
    if bad:
        raise RecipeError(f"{section}.yarn has unknown key(s) {bad}; it takes {list(YARN_KEYS)}")
    if m.position_embedding_type == "yarn" and not m.yarn:
        raise RecipeError(f"{section}.position_embedding_type=yarn needs {section}.yarn (GPT-OSS: "
                          "{rotary_scaling_factor: 32, original_max_position_embeddings: 4096, beta_fast: 32, "
                          "beta_slow: 1})")


_OSS = dict(add_bias_linear=True, activation="quick_geglu", add_qkv_bias=True, moe_router_topk=4,
            moe_ffn_hidden_size=2880, attention_sinks=True)

FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    architectures=("GptOssForCausalLM",),
    fields={"attention_bias": only(True, why="true (GPT-OSS's attention has biases; Bridge maps them)")},
    hooks="megatron_kd.models.gpt_oss",
    recipe_checks="megatron_kd.families.gpt_oss:check_recipe_fields",
    weights=Weights(mlp=None, experts="mlp.experts."),
    # attention / router / expert biases, sink attention (its 64 sink parameters a layer are not counted)
    shapes={"gpt-oss-20b": shape(24, 2880, 64, 8, 64, 2880, 201088, num_moe_experts=32, **_OSS),
            "gpt-oss-120b": shape(36, 2880, 64, 8, 64, 2880, 201088, num_moe_experts=128, **_OSS)},
    aliases={"gpt_oss_20b": "gpt-oss-20b", "gptoss20b": "gpt-oss-20b", "gpt_oss_120b": "gpt-oss-120b"},
    quantized={"mxfp4": MXFP4},
)
