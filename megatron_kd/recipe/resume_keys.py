"""The recipe keys a resumed run compares with its checkpoint's (a change is refused unless
train.resume_changes names it)."""


# The keys a resumed run must share with its checkpoint for the continuation to be the run it claims to be.
# The architecture is compared always; paths (train.save, kd.cache) may move with a copied run, and the cache's
# teacher is compared by the identity its manifest records, not by its path.
ARCH_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
             "kv_channels", "normalization", "activation", "position_embedding_type", "tie_embeddings",
             "num_moe_experts", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "rope_scaling",
             "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "rope_original_max_position_embeddings")

# Architecture keys newer than some checkpoints: a checkpoint whose recipe lacks one was made at the key's schema
# default (plain RoPE), so it is compared at that default instead of being skipped.
DEFAULTED_ARCH_KEYS = ("rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                       "rope_original_max_position_embeddings")


SCHEDULE_KEYS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "lr_decay_iters")


RESUME_KEYS = {
    "train": (*SCHEDULE_KEYS, "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
              "global_batch_size", "optimizer", "precision"),
    "kd": ("mode", "top_k", "divergence", "jsd_beta", "temperature", "cache_temperature", "kl_weight", "ce_weight",
           "tail", "teacher_id"),
    "data": ("kind", "path", "tokenizer", "vocab_size", "seq_length", "split", "seed", "eod_id", "eod_mask_loss"),
}


TEACHER_KEYS = (*ARCH_KEYS, "load", "hf_path")


CACHE_TEACHER = "kd.cache teacher"


def resume_keys_all() -> list:
    out = [f"{s}.{k}" for s, keys in RESUME_KEYS.items() for k in keys]
    return out + [f"teacher.{k}" for k in TEACHER_KEYS] + [CACHE_TEACHER.replace(" ", "_")]
