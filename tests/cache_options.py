"""Cache-building tests name a build's encoding settings as keywords beside the others (top_k=, encoding=,
top_p=, samples=, ...); build_cache, cache_settings and make_settings take them as one EncodingOptions."""
from megatron_kd.cache.encoding import EncodingOptions, setting_keys


def encoding_kw(kw: dict) -> dict:
    """kw with its encoding keys (encoding, top_k and each encoding's own settings) as one `encoding` option."""
    kw = dict(kw)
    name, top_k = kw.pop("encoding", None), kw.pop("top_k", None)
    own = {k: kw.pop(k) for k in setting_keys() if k in kw}
    return {**kw, "encoding": EncodingOptions.of(name, top_k, **own)}
