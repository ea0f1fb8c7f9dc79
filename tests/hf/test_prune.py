"""`megatron-kd prune`: depth and MLP-width pruning of a Hugging Face checkpoint on its files; transformers loads
the result and computes what the pruned architecture computes."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_kd.cli.main import main


def fake_llama(d, layers=4, hidden=16, ffn=32, shards=1, **config):
    """A Llama-named safetensors checkpoint (no transformers needed), layer i's tensors filled with i."""
    os.makedirs(d, exist_ok=True)
    t = {"model.embed_tokens.weight": torch.randn(40, hidden), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": torch.randn(40, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": torch.full((hidden,), float(i)),
                  p + "self_attn.q_proj.weight": torch.full((hidden, hidden), float(i)),
                  p + "mlp.gate_proj.weight": torch.randn(ffn, hidden), p + "mlp.up_proj.weight": torch.randn(ffn, hidden),
                  p + "mlp.down_proj.weight": torch.randn(hidden, ffn)})
    names = sorted(t)
    if shards == 1:
        save_file(t, os.path.join(d, "model.safetensors"))
    else:
        wm = {}
        for s in range(shards):
            f = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: t[k] for k in names[s::shards]}
            save_file(part, os.path.join(d, f))
            wm.update({k: f for k in part})
        json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(d, "model.safetensors.index.json"), "w"))
    json.dump({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers, "hidden_size": hidden,
               "intermediate_size": ffn, "layer_types": [f"t{i}" for i in range(layers)], **config},
              open(os.path.join(d, "config.json"), "w"))
    open(os.path.join(d, "tokenizer.json"), "w").write("{}")
    return t


def loaded(d):
    out = {}
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


@pytest.mark.parametrize("shards", [1, 3])
def test_depth_keeps_and_renumbers_the_listed_layers(tmp_path, shards, capsys):
    src = fake_llama(tmp_path / "t", shards=shards)
    assert main(["prune", "--hf", str(tmp_path / "t"), "--out", str(tmp_path / "s"), "--keep-layers", "0,2-3"]) == 0
    assert "layers 4 -> 3 (kept [0, 2, 3])" in capsys.readouterr().out
    got, cfg = loaded(tmp_path / "s"), json.load(open(tmp_path / "s/config.json"))
    assert cfg["num_hidden_layers"] == 3 and cfg["layer_types"] == ["t0", "t2", "t3"]
    for new, old in enumerate([0, 2, 3]):
        for k in ("input_layernorm.weight", "self_attn.q_proj.weight", "mlp.down_proj.weight"):
            assert torch.equal(got[f"model.layers.{new}.{k}"], src[f"model.layers.{old}.{k}"])
    assert len(got) == len(src) - 5 and torch.equal(got["lm_head.weight"], src["lm_head.weight"])
    assert os.path.isfile(tmp_path / "s/tokenizer.json")
    if shards > 1:
        wm = json.load(open(tmp_path / "s/model.safetensors.index.json"))["weight_map"]
        assert sorted(wm) == sorted(got)


def test_width_keeps_the_most_important_channels_in_order(tmp_path):
    src = fake_llama(tmp_path / "t")
    with torch.no_grad():  # channels 5 and 9 of layer 1 carry nothing: the first to go
        for k in ("gate_proj", "up_proj"):
            src[f"model.layers.1.mlp.{k}.weight"][[5, 9]] = 0
        save_file(src, tmp_path / "t/model.safetensors")
    assert main(["prune", "--hf", str(tmp_path / "t"), "--out", str(tmp_path / "s"), "--ffn-size", "30"]) == 0
    got = loaded(tmp_path / "s")
    keep = [j for j in range(32) if j not in (5, 9)]
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"], src["model.layers.1.mlp.down_proj.weight"][:, keep])
    assert torch.equal(got["model.layers.1.mlp.up_proj.weight"], src["model.layers.1.mlp.up_proj.weight"][keep])
    assert json.load(open(tmp_path / "s/config.json"))["intermediate_size"] == 30


@pytest.mark.parametrize("argv,needle", [
    (["--keep-layers", "0,9"], "from 0 to 3 (the model has 4 layers)"),
    (["--keep-layers", "2,1"], "increasing layer numbers"),
    (["--keep-layers", "a"], "layer numbers such as"),
    (["--ffn-size", "32"], "between 1 and 31"),
    ([], "nothing to prune"),
])
def test_bad_settings_are_refused_before_writing(tmp_path, capsys, argv, needle):
    fake_llama(tmp_path / "t")
    assert main(["prune", "--hf", str(tmp_path / "t"), "--out", str(tmp_path / "s"), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["t"]


def test_an_existing_out_and_the_source_are_kept(tmp_path, capsys):
    fake_llama(tmp_path / "t")
    (tmp_path / "s").mkdir()
    (tmp_path / "s/mine.txt").write_text("keep")
    assert main(["prune", "--hf", str(tmp_path / "t"), "--out", str(tmp_path / "s"), "--keep-layers", "0"]) == 2
    assert "--overwrite" in capsys.readouterr().err and (tmp_path / "s/mine.txt").read_text() == "keep"
    assert main(["prune", "--hf", str(tmp_path / "t"), "--out", str(tmp_path / "t"), "--keep-layers", "0",
                 "--overwrite"]) == 2
    assert "is the source" in capsys.readouterr().err
    assert json.load(open(tmp_path / "t/config.json"))["num_hidden_layers"] == 4


def fake_opt(d, layers=4, hidden=16):
    """OPT's names (model.decoder.layers.N, fc1 / fc2): a family megatron-kd does not register."""
    os.makedirs(d, exist_ok=True)
    t = {"model.decoder.embed_tokens.weight": torch.randn(40, hidden)}
    for i in range(layers):
        p = f"model.decoder.layers.{i}."
        t.update({p + "fc1.weight": torch.randn(32, hidden), p + "fc2.weight": torch.randn(hidden, 32)})
    save_file(t, os.path.join(d, "model.safetensors"))
    json.dump({"architectures": ["OPTForCausalLM"], "model_type": "opt", "num_hidden_layers": layers,
               "hidden_size": hidden, "ffn_dim": 32}, open(os.path.join(d, "config.json"), "w"))


def _refused(capsys, argv, *needles):
    assert main(["prune", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_an_unregistered_family_is_refused_by_name(tmp_path, capsys):
    """OPT (model.decoder.layers.N): prune wrote config.json with 2 layers beside weights of 4 and exited 0."""
    fake_opt(tmp_path / "t")
    _refused(capsys, ["--hf", tmp_path / "t", "--out", tmp_path / "s", "--keep-layers", "0,2"],
             "model_type='opt'", "llama", "qwen3_moe", "mistral")
    assert sorted(os.listdir(tmp_path)) == ["t"]


def test_weights_not_named_as_the_family_are_refused(tmp_path, capsys):
    """config.json says llama, the tensors are OPT's: refused rather than written half-pruned."""
    fake_opt(tmp_path / "t")
    cfg = json.load(open(tmp_path / "t/config.json"))
    json.dump({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
              open(tmp_path / "t/config.json", "w"))
    _refused(capsys, ["--hf", tmp_path / "t", "--out", tmp_path / "s", "--keep-layers", "0,2"],
             "config.json says 4 layers (llama)", "model.layers.N.")
    assert sorted(os.listdir(tmp_path)) == ["t"]


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_moe"])
def test_expert_width_is_refused_by_name(tmp_path, capsys, model_type):
    fake_llama(tmp_path / "t", model_type=model_type)
    _refused(capsys, ["--hf", tmp_path / "t", "--out", tmp_path / "s", "--ffn-size", "16"],
             f"{model_type} checkpoint", "mlp.experts.", "--keep-layers")


def _truncate(path, keep=0.5):
    b = open(path, "rb").read()
    open(path, "wb").write(b[:int(len(b) * keep)])


@pytest.mark.parametrize("damage,needles", [
    ("config", ["config.json is not readable JSON", "JSONDecodeError"]),
    ("safetensors", ["model.safetensors is not a complete safetensors file", "download it again"]),
    ("missing_shard", ["names shard(s) ['model-00002-of-00003.safetensors']", "download the missing"]),
])
def test_a_damaged_checkpoint_is_refused_in_one_sentence(tmp_path, capsys, damage, needles):
    fake_llama(tmp_path / "t", shards=3 if damage == "missing_shard" else 1)
    if damage == "config":
        _truncate(tmp_path / "t/config.json")
    elif damage == "safetensors":
        _truncate(tmp_path / "t/model.safetensors")
    else:
        os.remove(tmp_path / "t/model-00002-of-00003.safetensors")
    _refused(capsys, ["--hf", tmp_path / "t", "--out", tmp_path / "s", "--keep-layers", "0,2"], *needles)
    assert sorted(os.listdir(tmp_path)) == ["t"]


def test_disk_full_during_the_write_keeps_the_previous_out(tmp_path, capsys, monkeypatch):
    """The write goes beside --out and is swapped in at the end: a full disk leaves the previous --out as it was
    and no partial folder."""
    import errno
    import safetensors.torch
    fake_llama(tmp_path / "t")
    assert main(["prune", "--hf", str(tmp_path / "t"), "--out", str(tmp_path / "s"), "--keep-layers", "0,1"]) == 0
    before = {f: open(tmp_path / "s" / f, "rb").read() for f in os.listdir(tmp_path / "s")}

    def full(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    _refused(capsys, ["--hf", tmp_path / "t", "--out", tmp_path / "s", "--keep-layers", "0", "--overwrite"],
             "the disk is full", "nothing was changed at --out")
    assert {f: open(tmp_path / "s" / f, "rb").read() for f in os.listdir(tmp_path / "s")} == before
    assert sorted(os.listdir(tmp_path)) == ["s", "t"]


@pytest.mark.bridge
def test_transformers_loads_the_pruned_model_and_computes_the_pruned_architecture(tmp_path):
    """Depth: the layers deleted from the loaded teacher in transformers give the same logits; width: channels that
    carry nothing are the ones dropped, so the logits stay the teacher's."""
    import tiny
    from transformers import AutoModelForCausalLM
    t = tiny.make_hf(str(tmp_path / "t"), "llama", layers=4, hidden=64, ffn=128, seed=3)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert main(["prune", "--hf", str(tmp_path / "t"), "--out", str(tmp_path / "d"), "--keep-layers", "0,3"]) == 0
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "d", dtype=torch.float32).eval()
    t.model.layers = torch.nn.ModuleList([t.model.layers[0], t.model.layers[3]])
    t.config.num_hidden_layers = 2
    for i, layer in enumerate(t.model.layers):
        layer.self_attn.layer_idx = i
    with torch.no_grad():
        assert torch.allclose(pruned(tokens).logits, t(tokens).logits, atol=1e-5, rtol=0)
    # width: zero 16 channels of every layer's MLP, prune to 112: the logits do not move
    w = tiny.make_hf(str(tmp_path / "w"), "llama", layers=2, hidden=64, ffn=128, seed=4)
    from safetensors.torch import load_file as lf
    sd = lf(str(tmp_path / "w/model.safetensors"))
    for i in range(2):
        sd[f"model.layers.{i}.mlp.up_proj.weight"][torch.arange(16) * 8] = 0
    save_file(sd, str(tmp_path / "w/model.safetensors"))
    w = AutoModelForCausalLM.from_pretrained(tmp_path / "w", dtype=torch.float32).eval()
    assert main(["prune", "--hf", str(tmp_path / "w"), "--out", str(tmp_path / "n"), "--ffn-size", "112"]) == 0
    narrow = AutoModelForCausalLM.from_pretrained(tmp_path / "n", dtype=torch.float32).eval()
    assert narrow.config.intermediate_size == 112
    with torch.no_grad():
        assert torch.allclose(narrow(tokens).logits, w(tokens).logits, atol=1e-5, rtol=0)


@pytest.mark.bridge
@pytest.mark.parametrize("arch", ["llama", "gptoss", "qwen2", "qwen3", "qwen3_moe", "mistral"])
def test_depth_for_every_registered_family_loads_in_transformers(tmp_path, arch):
    """Every registered family prunes by depth: transformers loads the result with no missing or unexpected
    tensor, each kept layer's tensors are the parent's, and layer_types follows the kept layers."""
    import tiny
    from transformers import AutoModelForCausalLM
    config = {"layer_types": ["sliding_attention", "full_attention"] * 2} if arch == "gptoss" else {}
    parent = tiny.make_hf(str(tmp_path / "t"), arch, layers=4, seed=2, config=config)
    assert main(["prune", "--hf", str(tmp_path / "t"), "--out", str(tmp_path / "d"), "--keep-layers", "0,3"]) == 0
    pruned, info = AutoModelForCausalLM.from_pretrained(tmp_path / "d", dtype=torch.float32,
                                                        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert pruned.config.num_hidden_layers == 2
    if arch == "gptoss":
        assert pruned.config.layer_types == ["sliding_attention", "full_attention"]
    want, got = parent.state_dict(), pruned.state_dict()
    for name, t in got.items():
        old = name.replace("layers.1.", "layers.3.") if ".layers.1." in name else name
        assert torch.equal(t, want[old]), name
