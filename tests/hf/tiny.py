"""Fresh random tiny Hugging Face checkpoints made with transformers (nothing downloaded), with a tokenizer."""
import os

import torch

EOD = "<|endoftext|>"


def tokenizer_files(out_dir, vocab_size: int, seed_text: str | None = None, eod: str = EOD):
    """A WordLevel tokenizer of exactly vocab_size ids (t0.. plus the end-of-document token `eod`, e.g. Llama 3's
    <|end_of_text|>) saved the HF way."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab[eod] = vocab_size - 1
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", eos_token=eod, bos_token=eod).save_pretrained(
        out_dir)


def make_hf(out_dir, arch: str = "llama", *, seed: int = 0, vocab_size: int = 256, layers: int = 2,
            hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128, tied: bool = False,
            experts: int = 4, dtype: str = "float32", tokenizer: bool = True, tokenizer_size: int | None = None,
            config: dict | None = None, eod: str = EOD):
    """A random tiny HF model of `arch` (llama | gptoss | qwen2 | qwen3 | qwen3_moe | mistral) saved in out_dir; returns the model (eval, fp32).
    tokenizer_size < vocab_size: an embedding padded beyond its tokenizer, as Qwen's (151,936 or 152,064 rows for
    151,665 tokens). config: more (or other) config fields, e.g. rope_parameters, layer_types."""
    from transformers import (AutoModelForCausalLM, GptOssConfig, LlamaConfig, MistralConfig, Qwen2Config,
                              Qwen3Config, Qwen3MoeConfig)
    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, intermediate_size=ffn, tie_word_embeddings=tied, dtype="float32",
              max_position_embeddings=512)
    if arch == "llama":
        kw = {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, **kw, **(config or {})}
        cfg = LlamaConfig(**kw)
    elif arch == "gptoss":
        kw = dict(kw, head_dim=hidden // heads, num_local_experts=experts, num_experts_per_tok=2, sliding_window=8)
        cfg = GptOssConfig(**{**kw, **(config or {})})
    elif arch in ("qwen2", "qwen3", "mistral"):
        cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
        cfg = cls(**{**kw, **({} if arch == "qwen2" else {"head_dim": hidden // heads}), **(config or {})})
    elif arch == "qwen3_moe":
        kw = dict(kw, head_dim=hidden // heads, num_experts=experts, num_experts_per_tok=2,
                  moe_intermediate_size=ffn // 2, norm_topk_prob=True)
        cfg = Qwen3MoeConfig(**{**kw, **(config or {})})
    else:
        raise ValueError(arch)
    hf = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # randomise everything incl. norms / biases / sinks / router
        for n, p in hf.named_parameters():
            sc = next((v for k, v in {"sinks": 1.0, "gate_up_proj": 0.4, "router": 0.2}.items() if k in n), 0.05)
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else sc * torch.randn_like(p))
    if dtype != "float32":
        hf = hf.to(getattr(torch, dtype))
    hf.save_pretrained(out_dir)
    if tokenizer:
        tokenizer_files(out_dir, tokenizer_size or vocab_size, eod=eod)
    return hf.float().eval()


def hf_logits(path_or_model, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    m = path_or_model
    if isinstance(m, (str, os.PathLike)):
        m = AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(tokens).logits.float()
