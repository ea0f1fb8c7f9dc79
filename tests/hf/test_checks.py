"""Bad Hugging Face input fails before any work with an error naming the fix (no Bridge needed, except where
marked): not a checkpoint, an architecture Bridge does not map, different tokenizers / vocabularies, a layout the
checkpoint cannot be split into; and without Bridge an HF path names what to install."""
import json
import os
import sys

import pytest

from megatron_kd.hf import HFCheckpointError, check_hf_dir, check_layout, check_same_tokenizer, require_bridge
from megatron_kd.recipe.hf import check_cache_tokenizer


def fake_hf(d, vocab=64, heads=8, kv=4, layers=4, experts=None, arch="LlamaForCausalLM", tok_shift=0, tok_size=None):
    os.makedirs(d, exist_ok=True)
    cfg = {"architectures": [arch], "model_type": "llama", "vocab_size": vocab, "num_attention_heads": heads,
           "num_key_value_heads": kv, "num_hidden_layers": layers, "hidden_size": 64, "intermediate_size": 128}
    if experts:
        cfg["num_local_experts"] = experts
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    open(os.path.join(d, "model.safetensors"), "wb").close()
    write_tokenizer(os.path.join(d, "tokenizer.json"), tok_size or vocab, tok_shift)
    return str(d)


def write_tokenizer(path, vocab, shift=0):
    from tokenizers import Tokenizer, models
    ids = {f"t{i}": (i + shift) % vocab for i in range(vocab)}
    Tokenizer(models.WordLevel(ids, unk_token="t0")).save(str(path))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(HFCheckpointError, match=r"teacher.hf_path=.*is not a directory"):
        check_hf_dir(str(tmp_path / "nope"), "teacher.hf_path")
    with pytest.raises(HFCheckpointError, match=r"model.hf_path=.*not a Hugging Face checkpoint \(no config.json\)"):
        check_hf_dir(str(tmp_path), "model.hf_path")
    d = fake_hf(tmp_path / "a")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="holds no weights"):
        check_hf_dir(d, "model.hf_path")
    json.dump({"model_type": "llama"}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(HFCheckpointError, match="names no `architectures`"):
        check_hf_dir(d, "model.hf_path")


@pytest.mark.parametrize("kw,layout,match", [
    (dict(heads=6, kv=6), dict(tp=4), r"6 attention heads, which do not divide by parallel.tp=4"),
    (dict(heads=8, kv=2), dict(tp=4), r"2 query groups .* do not divide by parallel.tp=4"),
    (dict(experts=6), dict(ep=4), r"6 experts, which do not divide by parallel.ep=4"),
    (dict(), dict(ep=2), r"not a mixture of experts; set parallel.ep=1"),
    (dict(layers=6), dict(pp=4), r"6 layers, which do not divide into parallel.pp=4"),
    (dict(layers=8), dict(pp=2, vpp=3), r"parallel.pp=2 x parallel.vpp=3"),
])
def test_layout_the_checkpoint_cannot_split_into(tmp_path, kw, layout, match):
    d = fake_hf(tmp_path / "m", **kw)
    with pytest.raises(HFCheckpointError, match=match):
        check_layout(d, "teacher.hf_path", **layout)


def test_layouts_that_split(tmp_path):
    check_layout(fake_hf(tmp_path / "m", heads=8, kv=4, layers=4, experts=8), "x", tp=4, pp=2, ep=8)


def test_different_vocabularies_and_tokenizers(tmp_path):
    a = fake_hf(tmp_path / "t", vocab=64)
    with pytest.raises(HFCheckpointError, match="vocabulary of 64 ids .* one of 128"):
        check_same_tokenizer(a, "teacher.hf_path", fake_hf(tmp_path / "s", vocab=128), "model.hf_path")
    with pytest.raises(HFCheckpointError, match="different tokenizers"):
        check_same_tokenizer(a, "teacher.hf_path", fake_hf(tmp_path / "s2", vocab=64, tok_shift=1), "model.hf_path")
    check_same_tokenizer(a, "teacher.hf_path", fake_hf(tmp_path / "s3", vocab=64), "model.hf_path")
    write_tokenizer(tmp_path / "data_tok.json", 64, shift=3)
    with pytest.raises(HFCheckpointError, match="data.tokenizer.*different tokenizers"):
        check_same_tokenizer(a, "teacher.hf_path", str(tmp_path / "data_tok.json"), "data.tokenizer")


def test_embeddings_padded_past_one_tokenizer_are_one_vocabulary(tmp_path):
    """Qwen-style: one 60-id tokenizer, embeddings of 64 and 72 rows (Qwen2.5: 151,665 tokens, 151,936 / 152,064
    rows): accepted, with the data's tokenizer file too; an embedding with fewer rows than its tokenizer is refused,
    and without tokenizer.json the config sizes must agree (the message says what to add)."""
    t = fake_hf(tmp_path / "t", vocab=72, tok_size=60)
    s = fake_hf(tmp_path / "s", vocab=64, tok_size=60)
    check_same_tokenizer(t, "teacher.hf_path", s, "model.hf_path")
    write_tokenizer(tmp_path / "data_tok.json", 60)
    check_same_tokenizer(s, "model.hf_path", str(tmp_path / "data_tok.json"), "data.tokenizer")
    with pytest.raises(HFCheckpointError, match="vocabulary of 60 ids .* one of 64"):
        check_same_tokenizer(t, "teacher.hf_path", fake_hf(tmp_path / "s64", vocab=64), "model.hf_path")
    short = fake_hf(tmp_path / "short", vocab=56, tok_size=60)
    with pytest.raises(HFCheckpointError, match="vocab_size=56 but its tokenizer.json has 60 ids"):
        check_same_tokenizer(t, "teacher.hf_path", short, "model.hf_path")
    os.remove(os.path.join(s, "tokenizer.json"))
    t2 = fake_hf(tmp_path / "t2", vocab=72)
    os.remove(os.path.join(t2, "tokenizer.json"))
    with pytest.raises(HFCheckpointError, match="vocabulary of 72 ids .* one of 64.*add its tokenizer.json"):
        check_same_tokenizer(t2, "teacher.hf_path", s, "model.hf_path")


def test_cache_of_another_tokenizer(tmp_path):
    from types import SimpleNamespace
    write_tokenizer(tmp_path / "tok.json", 64)
    (tmp_path / "cache").mkdir()
    json.dump({"tokenizer": "0123456789abcdef"}, open(tmp_path / "cache" / "manifest.json", "w"))
    r = SimpleNamespace(kd=SimpleNamespace(cache=str(tmp_path / "cache")),
                        data=SimpleNamespace(tokenizer=str(tmp_path / "tok.json")))
    with pytest.raises(HFCheckpointError, match="built with another tokenizer"):
        check_cache_tokenizer(r)


def test_without_bridge_the_error_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.bridge", None)  # import fails as when not installed
    with pytest.raises(HFCheckpointError, match=r"model.hf_path needs Megatron-Bridge 0.6.2 .*NeMo container.*"
                                                r"pip install --no-build-isolation 'megatron-kd\[bridge\]'"):
        require_bridge("model.hf_path")


def test_recipe_with_bad_hf_path_fails_before_work(tmp_path):
    from megatron_kd.recipe.schema import RecipeError, to_recipe
    from megatron_kd.recipe.compose import compose
    from megatron_kd.training.loop import preflight
    r = to_recipe(compose("tiny_cpu", [f"model.hf_path={tmp_path}", "train.device=cpu"], save=str(tmp_path / "r")))
    with pytest.raises(RecipeError, match=r"model.hf_path=.*no config.json"):
        preflight(r, 1, False)


@pytest.mark.bridge
def test_architecture_bridge_does_not_map(tmp_path):
    import bridge_env_check  # noqa: F401
    from transformers import OPTConfig
    from megatron_kd.hf.checks import check_architecture
    d = tmp_path / "opt"
    OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
              architectures=["OPTForCausalLM"]).save_pretrained(d)
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(HFCheckpointError, match=r"no mapping for architecture \['OPTForCausalLM'\]; it maps .*Llama"):
        check_architecture(str(d), "teacher.hf_path")


@pytest.mark.bridge
@pytest.mark.parametrize("arch, config, unverified", [
    ("gptoss", {}, True),  # learned sinks and sliding windows
    ("llama", {}, False),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, True),
    ("qwen2", {}, False)], ids=["gptoss", "llama", "qwen2_window", "qwen2"])
def test_checkpoints_with_sinks_or_windows_take_te_layers_and_refuse_fp8(tmp_path, arch, config, unverified):
    """Sinks / sliding windows read from config.json: `attention_backend=te` passes (TE's layers, megatron-kd's core
    attention: build_hf_chunks), FP8 and context parallel are refused before any work naming the key; other
    checkpoints pass all three."""
    import bridge_env_check  # noqa: F401
    import tiny
    from megatron_kd.hf.model import open_hf
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import RecipeError, to_recipe
    from megatron_kd.recipe.hf import resolve_hf
    d = str(tmp_path / arch)
    tiny.make_hf(d, arch, config=config)
    assert open_hf(d, "model.hf_path").te_attention_unverified() is unverified
    for extra in (["model.attention_backend=te"], ["model.fp8=hybrid"], ["parallel.cp=2"]):
        r = to_recipe(compose("tiny_cpu", [f"model.hf_path={d}", "data.vocab_size=256", *extra],
                              save=str(tmp_path / "r")))
        if unverified and "fp8" in extra[0]:
            with pytest.raises(RecipeError, match=r"model.hf_path=.*: model\.fp8=hybrid: .*set model\.fp8=null"):
                resolve_hf(r)
        elif unverified and "cp" in extra[0]:  # their core attention has no context-parallel exchange
            with pytest.raises(RecipeError, match=r"model.hf_path=.*: parallel\.cp=2: model has attention sinks "
                                                  r".*set parallel\.cp=1"):
                resolve_hf(r)
        else:
            resolve_hf(r)


@pytest.mark.bridge
def test_auto_builds_hf_checkpoints_on_te_layers_where_te_imports(tmp_path, monkeypatch):
    """With TE importable, `attention_backend=auto` asks for TE's layer spec for a GPT-OSS checkpoint (biased experts,
    sinks, windows) as for a Llama one; `sdpa` builds megatron-kd's SDPA spec. `te_available` is faked and TE's spec
    (which cannot build here) replaced by one that raises when asked for."""
    import bridge_env_check  # noqa: F401
    import tiny
    from megatron_kd.models import builder
    from megatron_kd.models.attention import SDPAttention
    from megatron_kd.recipe.schema import ModelConfig, ParallelConfig
    from megatron_kd.runtime import features
    from megatron_kd.runtime.dist import distributed
    monkeypatch.setattr(features, "te_available", lambda: True)

    def te_spec(*a, **k):
        raise LookupError("TE's layer spec asked for")
    monkeypatch.setattr(builder, "te_spec", te_spec)
    for arch in ("gptoss", "llama"):
        d = str(tmp_path / arch)
        tiny.make_hf(d, arch, layers=2, hidden=64, heads=4, kv_heads=2)
        p = ParallelConfig(etp=1 if arch == "gptoss" else None)
        with distributed(p, 0, "cpu"):
            for backend in ("auto", "te"):
                with pytest.raises(LookupError, match="TE's layer spec asked for"):
                    builder.build_hf_chunks(ModelConfig(hf_path=d, attention_backend=backend), p, 64, "fp32",
                                            load_weights=False)
            chunks, _ = builder.build_hf_chunks(ModelConfig(hf_path=d, attention_backend="sdpa"), p, 64, "fp32",
                                                load_weights=False)
        assert type(chunks[0].decoder.layers[0].self_attention.core_attention) is SDPAttention


@pytest.mark.bridge
def test_bridge_maps_the_weights_of_te_sequential_experts(tmp_path, monkeypatch):
    """Sequential experts on TE's spec get megatron-kd's own fc2 class (runtime/te_compat); Megatron-Bridge reads
    a module's parallelism from its class name, so opening a checkpoint registers it as row-parallel (without, its
    loaders raise for the expert fc2 bias). TE cannot load here: a stand-in TERowParallelLinear takes its place."""
    import sys
    import types
    import bridge_env_check  # noqa: F401
    import tiny
    import torch
    from megatron.bridge.models.conversion.param_mapping import AutoMapping
    from megatron_kd.hf.model import HFModel
    from megatron_kd.runtime import te_compat
    fake = types.ModuleType("megatron.core.extensions.transformer_engine")
    fake.TERowParallelLinear = type("TERowParallelLinear", (torch.nn.Module,), {})
    monkeypatch.setattr(te_compat, "_EXPERT_TE_FC2", [])
    with monkeypatch.context() as m:  # the stand-in only while the class is made
        m.setitem(sys.modules, "megatron.core.extensions.transformer_engine", fake)
        fc2 = te_compat._expert_te_row_linear()()
    # the registry is class-wide: an HFModel opened by an earlier test has registered the name already
    registry = {k: set(v) - {te_compat.EXPERT_TE_FC2_NAME} for k, v in AutoMapping._MODULE_TYPE_REGISTRY.items()}
    monkeypatch.setattr(AutoMapping, "_MODULE_TYPE_REGISTRY", registry)
    mapping = AutoMapping("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.bias", "model.layers.0.x")
    with pytest.raises(ValueError, match="Cannot determine parallelism type"):
        mapping._detect_parallelism_type(fc2)
    d = str(tmp_path / "gptoss")
    tiny.make_hf(d, "gptoss")
    HFModel(d, "model.hf_path")
    assert mapping._detect_parallelism_type(fc2) == "row"
