"""config.json's forward-pass fields reach the Megatron model exactly, or are refused before any work.

Each case: a fresh random tiny checkpoint with one non-default value of a field Megatron-Bridge 0.6.2 drops or
hard-codes (GPT-OSS YaRN and layer_types, Llama 3 RoPE scaling). megatron-kd builds it through HFModel with the
default attention backend at TP=1 and TP=2 (real gloo ranks); its fp32 logits must equal transformers' to 1e-5.
Measured: 0 .. 2.3e-6 at TP=1 and TP=2; without megatron_kd/hf/exact.py's carrying (Bridge's values) every case
but linear (which Bridge maps itself) fails, by 3.7e-4 (Llama 3 frequency factors) to 1.87 (layer_types full /
sliding / full) at both TP sizes.
"""
import json
import os

import pytest
import torch

import bridge_env_check  # noqa: F401
from dist_utils import run_ranks

pytestmark = pytest.mark.bridge

SEQ, TOL = 32, 1e-5
GPTOSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
               "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
FULL, SLIDING = "full_attention", "sliding_attention"

# name: (arch, layers, config.json fields)
CASES = {
    "yarn_factor_8": ("gptoss", 2, {"rope_parameters": {**GPTOSS_YARN, "factor": 8.0}}),
    "yarn_beta_fast_16": ("gptoss", 2, {"rope_parameters": {**GPTOSS_YARN, "beta_fast": 16.0}}),
    "yarn_truncate": ("gptoss", 2, {"rope_parameters": {**GPTOSS_YARN, "truncate": True}}),
    "yarn_mscale_1_0.5": ("gptoss", 2, {"rope_parameters": {**GPTOSS_YARN, "mscale": 1.0, "mscale_all_dim": 0.5}}),
    "layer_types_full_sliding_full": ("gptoss", 3, {"layer_types": [FULL, SLIDING, FULL]}),
    "layer_types_sliding_only": ("gptoss", 2, {"layer_types": [SLIDING, SLIDING]}),
    "llama3_original_1024": ("llama", 2, {"rope_parameters": {**LLAMA3, "original_max_position_embeddings": 1024}}),
    "llama3_freq_factors_2_8": ("llama", 2, {"rope_parameters": {**LLAMA3, "low_freq_factor": 2.0,
                                                                 "high_freq_factor": 8.0}}),
    # Bridge maps linear scaling itself; megatron-kd sets the same value (seq_len_interpolation_factor)
    "linear_factor_2": ("llama", 2, {"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}),
    # Qwen2's sliding window on the layers from max_window_layers on (layer_types full, sliding)
    "qwen2_sliding_window": ("qwen2", 2, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    # the families registered with strict field rules, each on non-default values (GQA 4:1, head_dim 24 != 64 / 4,
    # RoPE scaling, tied embeddings, windows, MoE top-2 / top-3 with and without renormalised top-k)
    "qwen3_gqa4_head_dim_24_yarn": ("qwen3", 2, {
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 24, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 128}}),
    "qwen3_tied_sliding_window": ("qwen3", 2, {"tie_word_embeddings": True, "use_sliding_window": True,
                                               "sliding_window": 8, "max_window_layers": 1}),
    "qwen3_moe_top2_head_dim_24": ("qwen3_moe", 2, {"head_dim": 24, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
        "original_max_position_embeddings": 64}}),
    "qwen3_moe_top3_softmax_sliding": ("qwen3_moe", 2, {"num_experts_per_tok": 3, "norm_topk_prob": False,
                                                        "use_sliding_window": True, "sliding_window": 8}),
    "mistral_window_8_head_dim_24": ("mistral", 2, {"sliding_window": 8, "head_dim": 24, "num_attention_heads": 8,
                                                    "num_key_value_heads": 2}),
    "mistral_no_window_tied_linear": ("mistral", 2, {"sliding_window": None, "tie_word_embeddings": True,
                                                     "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                                         "factor": 2.0}}),
}


# one case per family whose student is also exported (after its tensors changed) and read back by transformers
EXPORTED = {"llama3_freq_factors_2_8", "layer_types_full_sliding_full", "qwen2_sliding_window",
            "qwen3_gqa4_head_dim_24_yarn", "qwen3_moe_top3_softmax_sliding", "mistral_window_8_head_dim_24"}


def _worker(rank, world, cases, tp):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron_kd.recipe.schema import ModelConfig, ParallelConfig
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches, seed_model_parallel_rng
    from megatron_kd.runtime.dist import init_model_parallel
    from megatron_kd.models.builder import build_hf_chunks
    apply_cpu_patches()
    for hf_dir, out, case in cases:
        moe = "gptoss" in os.path.basename(hf_dir)
        p = ParallelConfig(tp=tp, etp=1 if moe else None)
        init_model_parallel(p, cuda=False)
        seed_model_parallel_rng(0)
        chunks, _ = build_hf_chunks(ModelConfig(hf_path=hf_dir), p, SEQ, "fp32")  # attention_backend: auto
        m = chunks[0].eval()
        tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(11))
        pos = torch.arange(SEQ).expand_as(tokens)
        with torch.no_grad():
            logits = gather_from_tensor_model_parallel_region(m(input_ids=tokens, position_ids=pos,
                                                                attention_mask=None))[..., :256]
        export_err = None
        if case in EXPORTED:
            # the student after training: each tensor changed (same factors on every rank), exported through
            # Bridge from this layout; transformers' logits of the export must be this model's
            from megatron_kd.hf.model import open_hf
            with torch.no_grad():
                for i, prm in enumerate(m.parameters()):
                    prm.mul_(1 + 0.02 * (i % 5 - 2))
                trained = gather_from_tensor_model_parallel_region(m(input_ids=tokens, position_ids=pos,
                                                                     attention_mask=None))[..., :256]
            open_hf(hf_dir, "model.hf_path").export(chunks, out + ".export")
            torch.distributed.barrier()
            if rank == 0:
                import tiny
                export_err = (trained - tiny.hf_logits(out + ".export", tokens)).abs().max().item()
        if rank == 0:
            import tiny
            err = (logits - tiny.hf_logits(hf_dir, tokens)).abs().max().item()
            with open(out, "w") as f:
                f.write(f"{err} {export_err}")
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def logit_errors(tmp_path_factory):
    """{tp: {case: max |megatron-kd - transformers| logit}}: one gloo launch per TP size for all cases (Bridge
    imports once per rank), run on first use."""
    import tiny
    root = tmp_path_factory.mktemp("exact")
    errs = {}

    def get(tp):
        if tp not in errs:
            cases = []
            for name, (arch, layers, config) in CASES.items():
                hf_dir = str(root / f"{arch}_{name}")
                if not os.path.isdir(hf_dir):
                    tiny.make_hf(hf_dir, arch, layers=layers, seed=4, config=config)
                cases.append((hf_dir, str(root / f"err_{name}_tp{tp}.txt"), name))
            run_ranks(tp, _worker, cases, tp)
            errs[tp] = {n: [float(x) for x in open(c[1]).read().split() if x != "None"]
                        for n, c in zip(CASES, cases)}
            print(f"TP={tp} max |logit - transformers'|:", errs[tp])
        return errs[tp]
    return get


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_field_reaches_the_model(logit_errors, case, tp):
    err = logit_errors(tp)[case][0]
    assert err <= TOL, f"{case} at TP={tp}: logits differ from transformers' by {err:.3g} > {TOL}"


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", sorted(EXPORTED))
def test_exported_student_gives_transformers_the_same_logits(logit_errors, case, tp):
    """Every registered family's student exported from TP=1 and TP=2 after its tensors changed: transformers'
    logits of the export equal megatron-kd's of the model it came from."""
    err = logit_errors(tp)[case][1]
    assert err <= TOL, f"{case} exported at TP={tp}: transformers' logits differ by {err:.3g} > {TOL}"


# name: (arch, config.json fields, words the refusal names)
REFUSALS = {
    "rope_type_dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}},
                          ["rope_parameters.rope_type='dynamic'", "llama3", "yarn"]),
    "partial_rotary_factor": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                            "partial_rotary_factor": 0.5}},
                              ["partial_rotary_factor=0.5", "1.0"]),
    "yarn_attention_factor": ("gptoss", {"rope_parameters": {**GPTOSS_YARN, "attention_factor": 1.5}},
                              ["rope_parameters.attention_factor=1.5", "derives"]),
    "layer_types_chunked": ("gptoss", {"layer_types": [SLIDING, "chunked_attention"]},
                            ["layer_types=['chunked_attention']", "sliding_attention"]),
    "gptoss_attention_bias_false": ("gptoss", {"attention_bias": False}, ["attention_bias=False", "true"]),
    "gptoss_quant_method_fp8": ("gptoss", {"quantization_config": {"quant_method": "fp8"}},
                                ["quant_method='fp8'", "mxfp4"]),
    # every field of the strictly registered families that megatron-core cannot run, one case each
    "qwen3_attention_bias": ("qwen3", {"attention_bias": True}, ["attention_bias=True", "false"]),
    "qwen3_hidden_act": ("qwen3", {"hidden_act": "gelu"}, ["hidden_act='gelu'", "silu"]),
    "qwen3_attention_dropout": ("qwen3", {"attention_dropout": 0.1}, ["attention_dropout=0.1", "0.0"]),
    "qwen3_unknown_field": ("qwen3", {"mlp_bias": True}, ["mlp_bias=True", "families/qwen3.py"]),
    "qwen3_moe_attention_bias": ("qwen3_moe", {"attention_bias": True}, ["attention_bias=True", "false"]),
    "qwen3_moe_hidden_act": ("qwen3_moe", {"hidden_act": "gelu"}, ["hidden_act='gelu'", "silu"]),
    "qwen3_moe_attention_dropout": ("qwen3_moe", {"attention_dropout": 0.1}, ["attention_dropout=0.1", "0.0"]),
    "qwen3_moe_decoder_sparse_step": ("qwen3_moe", {"decoder_sparse_step": 2}, ["decoder_sparse_step=2", "1"]),
    "qwen3_moe_mlp_only_layers": ("qwen3_moe", {"mlp_only_layers": [1]}, ["mlp_only_layers=[1]", "[]"]),
    "qwen3_moe_unknown_field": ("qwen3_moe", {"shared_expert_intermediate_size": 64},
                                ["shared_expert_intermediate_size=64", "families/qwen3_moe.py"]),
    "mistral_hidden_act": ("mistral", {"hidden_act": "gelu"}, ["hidden_act='gelu'", "silu"]),
    "mistral_attention_dropout": ("mistral", {"attention_dropout": 0.1}, ["attention_dropout=0.1", "0.0"]),
    "mistral_layer_types": ("mistral", {"layer_types": [SLIDING, FULL]}, ["layer_types=", "Ministral"]),
    "mistral_yarn": ("mistral", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                     "original_max_position_embeddings": 128}},
                     ["rope_parameters=", "yarn", "Megatron-Bridge 0.6.2"]),
    "mistral_unknown_field": ("mistral", {"attention_bias": True}, ["attention_bias=True", "families/mistral.py"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_field_megatron_cannot_run_is_refused_by_name(tmp_path, case):
    """Refused when the checkpoint is opened (before any model is built), in one sentence naming the field, its
    value and what is supported."""
    import tiny
    from megatron_kd.hf.checks import HFCheckpointError
    from megatron_kd.hf.model import HFModel
    arch, config, words = REFUSALS[case]
    config = dict(config)
    quant = config.pop("quantization_config", None) if "quantization_config" in config else None
    tiny.make_hf(str(tmp_path / case), arch, seed=4, config=dict(config))
    if quant:  # written into config.json afterwards (transformers would quantize while making the model)
        cfg = json.load(open(tmp_path / case / "config.json"))
        json.dump({**cfg, "quantization_config": quant}, open(tmp_path / case / "config.json", "w"))
    with pytest.raises(HFCheckpointError) as e:
        HFModel(str(tmp_path / case), key="teacher.hf_path")
    msg = str(e.value)
    assert "teacher.hf_path=" in msg and all(w in msg for w in words), msg
    assert "\n" not in msg and "Traceback" not in msg


def _etp_worker(rank, world, hf_dir):
    from megatron.core import parallel_state as ps
    from megatron_kd.hf.checks import HFCheckpointError
    from megatron_kd.hf.model import HFModel
    from megatron_kd.recipe.schema import ParallelConfig
    from megatron_kd.runtime.cpu_patches import seed_model_parallel_rng
    from megatron_kd.runtime.dist import init_model_parallel
    hf = HFModel(hf_dir, key="teacher.hf_path")
    for groups_etp, asked in ((None, None), (None, 1)):  # groups of expert TP 2 (Megatron's default: TP)
        init_model_parallel(ParallelConfig(tp=2, etp=groups_etp), cuda=False)
        seed_model_parallel_rng(0)
        with pytest.raises(HFCheckpointError) as e:
            hf.build(ParallelConfig(tp=2, etp=asked), seq_length=SEQ)
        msg = str(e.value)
        assert "parallel.etp" in msg and "\n" not in msg, msg
        ps.destroy_model_parallel()


def test_expert_tp_of_the_process_groups_is_checked(tmp_path):
    """GPT-OSS's experts have biases (expert TP 1 only). Under Megatron groups of expert TP 2, a build with
    parallel.etp unset or 1 is refused naming parallel.etp (it was Bridge's "Unexpected gate_up_proj shape")."""
    import tiny
    tiny.make_hf(str(tmp_path / "gptoss"), "gptoss", seed=4)
    run_ranks(2, _etp_worker, str(tmp_path / "gptoss"))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mistral"])
def test_every_field_transformers_writes_is_classified(tmp_path, family):
    """The strictly registered families list every field transformers' config class writes to config.json (its
    defaults), so a field transformers adds later is refused by name until it is classified."""
    from transformers import AutoConfig
    from megatron_kd import families
    fam = families.get(family)
    AutoConfig.for_model(family).save_pretrained(tmp_path)
    written = set(json.load(open(tmp_path / "config.json")))
    missing = sorted(written - set(fam.rules()))
    assert not missing, f"{family}: config.json fields not classified in megatron_kd/families: {missing}"
