"""Bridge recipes (ConfigContainer factories) for offline KD runs without Transformer Engine, and the layer spec
they use. `--recipe megatron_kd.bridge.recipes:tiny_local_config` in megatron_kd.bridge.run / .cache.

Bridge's own recipes build TE layers and may fetch a Hugging Face config from the Hub
(`llama32_3b_pretrain_config` calls AutoBridge.from_hf_pretrained("meta-llama/Llama-3.2-3B")). Where TE does
not import (megatron-core's HAVE_TE is False), `use_local_layers(cfg.model)` swaps in megatron-core's local layer
spec with megatron-kd's SDPA core attention (the layers `megatron-kd train` builds there: flash attention on GPU,
so 32K fits) and turns off the fusions that need TE or apex kernels.
"""
import inspect

# Fusions that need TE / apex / fused CUDA kernels that a machine without TE lacks.
NO_TE_OFF = ("gradient_accumulation_fusion", "masked_softmax_fusion", "bias_activation_fusion", "apply_rope_fusion",
             "persist_layer_norm", "cross_entropy_loss_fusion", "bias_dropout_fusion")


def sdpa_layer_spec(config, vp_stage=None):
    """A GPTModelProvider layer-spec function: megatron-core's local spec for the provider's architecture (what
    Bridge's local_layer_spec builds) with megatron-kd's SDPA core attention (megatron_kd.models.attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ..models.attention import SDPAttention
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                    qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def have_te() -> bool:
    """megatron-core's own verdict on Transformer Engine (HAVE_TE), not whether a module named so imports."""
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception:
        return False
    return bool(HAVE_TE)


def use_local_layers(model) -> list:
    """Make a GPTModelProvider build without TE: the SDPA local spec, TE-only fusions off. Returns what changed."""
    from megatron.core.transformer.enums import AttnBackend
    changed = []
    if model.transformer_layer_spec is not sdpa_layer_spec:
        model.transformer_layer_spec = sdpa_layer_spec
        changed.append("transformer_layer_spec=sdpa_layer_spec")
    # Bridge swaps core attention back to DotProductAttention when attention_backend is `local`
    if getattr(model, "attention_backend", None) in (AttnBackend.local, "local"):
        model.attention_backend = AttnBackend.auto
        changed.append("attention_backend=auto")
    if hasattr(model, "transformer_impl") and model.transformer_impl != "local":
        model.transformer_impl = "local"
        changed.append("transformer_impl=local")
    for name in NO_TE_OFF:
        if getattr(model, name, False):
            setattr(model, name, False)
            changed.append(f"{name}=False")
    return changed


def _common(seq_length: int, vocab_size: int, model):
    from megatron.bridge.recipes.common import _pretrain_common
    from megatron.bridge.training.config import MockGPTDatasetConfig
    cfg = _pretrain_common()
    cfg.model = model
    cfg.tokenizer.tokenizer_type = "NullTokenizer"
    cfg.tokenizer.tokenizer_model = None
    cfg.tokenizer.vocab_size = vocab_size
    cfg.dataset = MockGPTDatasetConfig(seq_length=seq_length, random_seed=1234, reset_attention_mask=False,
                                       reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                       num_workers=0, dataloader_type="single", split="9999,8,2")
    cfg.validation.eval_interval, cfg.validation.eval_iters = None, 0
    cfg.scheduler.lr_warmup_iters = 0
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.logger.log_interval, cfg.logger.tensorboard_dir = 1, None
    cfg.ddp.use_distributed_optimizer = cfg.optimizer.use_distributed_optimizer = False
    cfg.ddp.overlap_grad_reduce = cfg.ddp.overlap_param_gather = False
    cfg.ddp.data_parallel_sharding_strategy = "no_shard"
    cfg.ddp.average_in_collective = False  # required with calculate_per_token_loss (the KD loss is a token sum)
    return cfg


def _provider(**kw):
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    base = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                add_bias_linear=False, position_embedding_type="rope", bf16=True, params_dtype=torch.bfloat16,
                pipeline_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
                calculate_per_token_loss=True, transformer_layer_spec=sdpa_layer_spec)
    base.update(kw)
    model = GPTModelProvider(**{k: v for k, v in base.items()
                                if k in inspect.signature(GPTModelProvider).parameters})
    use_local_layers(model)
    return model


def tiny_local_config(seq_length: int = 128, vocab_size: int = 1024):
    """A 2-layer GQA Llama-style student (hidden 128), mock data, NullTokenizer, bf16, no TE: the e2e check's
    recipe (benchmarks/bridge_e2e.py) and the CPU tests'."""
    cfg = _common(seq_length, vocab_size, _provider(
        num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
        kv_channels=32, share_embeddings_and_output_weights=False, seq_length=seq_length, vocab_size=vocab_size,
        rotary_base=10000, layernorm_epsilon=1e-5, make_vocab_size_divisible_by=128))
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = 4, 2, 1
    return cfg


def llama32_3b_local_config(seq_length: int = 32768, vocab_size: int = 128256):
    """Llama-3.2-3B's shape (28 layers, hidden 3072, 24 heads / 8 KV groups of 128, SwiGLU 8192, tied
    embeddings, RoPE base 500000, vocabulary 128256) without the Hub download Bridge's llama32_3b recipe does;
    the same shape as megatron-kd's recipes/model/llama32_3b.yaml. Full recompute, one GPU, mock data."""
    cfg = _common(seq_length, vocab_size, _provider(
        num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24, num_query_groups=8,
        kv_channels=128, share_embeddings_and_output_weights=True, seq_length=seq_length, vocab_size=vocab_size,
        rotary_base=500000, layernorm_epsilon=1e-5, make_vocab_size_divisible_by=128,
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = 10, 1, 1
    return cfg
