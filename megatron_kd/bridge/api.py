"""enable_offline_kd: the one call a Bridge user adds between building a recipe and pretrain()."""
from ..rules import vocab_problem
from .config import OfflineKDConfig
from .step import OfflineKDForwardStep


def open_cache(path: str):
    from ..cache import CacheReader  # reads the manifest; shards are memory-mapped on first use
    return CacheReader(path)


def check_cache_against_model(reader, kd: OfflineKDConfig, *, seq_length=None, vocab_size=None) -> None:
    """Fail before any work when the cache cannot serve this student: K, temperature, length, vocabulary."""
    reader.check_compatible(top_k=kd.top_k, temperature=kd.capture_temperature, seq_length=seq_length, tail=kd.tail,
                            divergence=kd.divergence, train_temperature=kd.temperature)
    # model.vocab_size counts the student's embedding rows, which may pad past the tokenizer (rules.vocab_problem)
    if vocab_size is not None and vocab_problem(reader.vocab_size, vocab_size, student_rows=True):
        raise ValueError(f"kd.cache {kd.cache!r}: the teacher's vocabulary ({reader.vocab_size}) is "
                         f"larger than the student's ({vocab_size}); teacher and student must share a tokenizer")


def enable_offline_kd(cfg, kd: OfflineKDConfig | dict, *, reader=None) -> OfflineKDForwardStep:
    """Turn a Bridge ConfigContainer into an offline-KD run and return its forward step:

        cfg = llama32_3b_pretrain_config()
        forward_step = enable_offline_kd(cfg, OfflineKDConfig(cache="/data/kd/llama31_8b_top100"))
        pretrain(cfg, forward_step)

    cfg.dataset is wrapped so the train split carries the cache rows; validation keeps the plain LM loss.
    """
    kd = (OfflineKDConfig.from_dict(kd) if isinstance(kd, dict) else kd).validate()
    reader = reader if reader is not None else open_cache(kd.cache)
    model = cfg.model
    check_cache_against_model(reader, kd, seq_length=getattr(model, "seq_length", None),
                              vocab_size=getattr(model, "vocab_size", None))
    if getattr(model, "use_mup", False):
        raise ValueError("offline KD does not apply MuP logit scaling; set model.use_mup=False")
    from ..runtime.te_compat import bias_activation_fusion_exact
    if getattr(model, "bias_activation_fusion", False) and not bias_activation_fusion_exact(model):
        # Bridge's GPT-OSS recipes turn it on; megatron-core's kernel clamps before adding the bias
        model.bias_activation_fusion = False
        print("megatron_kd.bridge: note: model.bias_activation_fusion set to False: megatron-core's fused bias + "
              "clamped GLU (GPT-OSS experts) clamps before adding the bias, unlike the model's own math", flush=True)
    from .provider import wrap_dataset_config  # imports Bridge
    cfg.dataset = wrap_dataset_config(cfg.dataset, kd)
    return OfflineKDForwardStep(kd, valid_vocab_size=int(reader.vocab_size))
