"""A checkpoint records the layer spec that built its model (checkpoint/spec.py), and every load compares it with the
spec built here before any model is built: a resume, train.pretrained, teacher.load, `megatron-kd export`,
`megatron-kd compare` and `--teacher mkd:`. On CPU the runs save on the SDPA spec; Transformer Engine cannot build
here, so a TE machine is played by the builder's rule seeing TE import (runtime/features.te_available), and a
checkpoint saved on TE's spec by its common state recording te. A checkpoint of an older run (no record) whose load
fails on a weight the specs name differently is played by a spec that saves its norms under their module names
(megatron-core's keys map cleared): megatron-core's own load error, for a real name difference.
"""
import os

import pytest
from run_copies import copy_at, one_sentence

from megatron_kd.checkpoint import integrity as ckpt_integrity, spec as layer_spec, store as ckpt
from megatron_kd.models import builder
from megatron_kd.recipe.compose import compose
from megatron_kd.recipe.schema import RecipeError, to_recipe
from megatron_kd.runtime import features
from megatron_kd.training import loop as train_mod, resume
from megatron_kd.training.loop import preflight, run

BASE = ["kd=ce", "data.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4", "train.progress=false",
        "train.tensorboard=false", "train.log_interval=1", "train.eval_iters=1", "train.eval_interval=null"]
VOCAB = 2048  # data=mock's
STUDENT_AS_TEACHER = ["teacher.num_layers=2", "teacher.hidden_size=64", "teacher.ffn_hidden_size=192",
                      "teacher.num_query_groups=2"]


def recipe(save, *overrides):
    return to_recipe(compose("tiny_cpu", [*BASE, *overrides, f"train.save={save}"]))


def train(save, *overrides):
    return run(recipe(save, *overrides), str(save))



@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A CE run on the SDPA spec (auto without TE), checkpoints at 2 and 4."""
    d = tmp_path_factory.mktemp("spec") / "run"
    train(d, "train.iters=4", "train.save_interval=2")
    return d


def no_model(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a model was built before the refusal")
    monkeypatch.setattr(train_mod, "build_model_chunks", boom)
    monkeypatch.setattr(builder, "build_gpt", boom)
    monkeypatch.setattr(builder, "build_hf_chunks", boom)


def te_imports(monkeypatch):
    """The builder's rule as in a NeMo container: attention_backend=auto builds TE's spec."""
    monkeypatch.setattr(features, "te_available", lambda: True)


def records(monkeypatch, value):
    """Checkpoints read as recording `value` (None: recording nothing, as an older run's)."""
    real = ckpt.read_common

    def common(d):
        c = dict(real(d))
        c.pop(layer_spec.SPEC_KEY, None)
        return c if value is None else {**c, layer_spec.SPEC_KEY: value}
    monkeypatch.setattr(ckpt, "read_common", common)
    monkeypatch.setattr(resume, "read_common_at", lambda root, it: common(ckpt.iter_dir(root, it)))


def module_names_spec(monkeypatch):
    """A layer spec that saves its norms as input_layernorm.weight / pre_mlp_layernorm.weight, where the SDPA spec
    saves linear_qkv's / linear_fc1's layer_norm_weight: another spec's names for the same weights."""
    real = builder.layer_spec

    def spec(m):
        s = real(m)
        s.submodules.sharded_state_dict_keys_map = {}
        return s
    monkeypatch.setattr(builder, "layer_spec", spec)


def damage(d, it, keep=lambda size: 64):
    """A checkpoint of a run from before checksum manifests, its data files cut short (to keep(size) bytes):
    damaged, not verifiable."""
    path = ckpt.iter_dir(str(d), it)
    os.remove(os.path.join(path, ckpt_integrity.MANIFEST))
    for f in (os.path.join(path, p) for p in os.listdir(path) if p.endswith(".distcp")):
        os.truncate(f, keep(os.path.getsize(f)))


# --- the record -------------------------------------------------------------------------------------------------

def test_every_checkpoint_records_the_spec_that_built_it(finished):
    for it in (2, 4):
        assert ckpt.read_common(ckpt.iter_dir(str(finished), it))[layer_spec.SPEC_KEY] == "sdpa"


def test_a_quantized_te_model_is_recorded_as_te():
    """ModelOpt replaces each quantized module's class by one made at runtime (module modelopt.torch.opt.dynamic)
    on top of the layer's class: a quantized student on TE's layers must still record TE's spec."""
    from types import SimpleNamespace
    import torch
    te_linear = type("Linear", (torch.nn.Module,), {"__module__": "transformer_engine.pytorch.module.linear"})
    quantized = type("QuantLinear", (te_linear,), {"__module__": "modelopt.torch.opt.dynamic"})
    model = torch.nn.Sequential(quantized())
    model.config = SimpleNamespace(fp8=None)
    assert builder.layer_backend(model) == "te"


@pytest.mark.parametrize("value, loads", [("te+fp8", True), ("te+fp8+fp8_attention", True), ("te", True),
                                          ("sdpa", False), ("local", False)])
def test_fp8_on_te_loads_into_te_and_nothing_else_does(monkeypatch, value, loads):
    te_imports(monkeypatch)
    m = recipe("/nowhere").model  # auto: TE's spec here
    assert (layer_spec.refusal({layer_spec.SPEC_KEY: value}, m, "c", "model.attention_backend={}") is None) is loads


# --- resume ----------------------------------------------------------------------------------------------------

def test_resuming_a_run_without_te_where_te_imports_is_refused_before_any_build(finished, tmp_path, monkeypatch):
    d = copy_at(finished, tmp_path / "res", 2)
    te_imports(monkeypatch)
    no_model(monkeypatch)
    with pytest.raises(RecipeError) as e:
        train(d, "train.iters=4")
    msg = str(e.value)
    one_sentence(msg)
    assert msg.startswith(f"train.load={d}: iteration 2's checkpoint was saved on the SDPA layer spec and "
                          "model.attention_backend=auto (Transformer Engine imports here) builds Transformer "
                          "Engine's layer spec; set model.attention_backend=sdpa to load it"), msg


def test_resuming_on_the_local_spec_is_refused(finished, tmp_path, monkeypatch):
    d = copy_at(finished, tmp_path / "res", 2)
    no_model(monkeypatch)
    with pytest.raises(RecipeError, match=r"saved on the SDPA layer spec and model\.attention_backend=local builds "
                                          r"megatron-core's local layer spec; set model\.attention_backend=sdpa"):
        train(d, "train.iters=4", "model.attention_backend=local")


def test_a_te_checkpoint_where_te_does_not_import_is_refused(finished, tmp_path, monkeypatch):
    d = copy_at(finished, tmp_path / "res", 2)
    records(monkeypatch, "te+fp8")
    no_model(monkeypatch)
    with pytest.raises(RecipeError) as e:
        train(d, "train.iters=4")
    one_sentence(str(e.value))
    assert "saved on Transformer Engine's layer spec, which cannot be built here (Transformer Engine does not " \
           "import); load it where Transformer Engine imports" in str(e.value)
    assert "model.attention_backend=te" in str(e.value)


def test_the_same_spec_resumes(finished, tmp_path):
    d = copy_at(finished, tmp_path / "res", 2)
    assert train(d, "train.iters=4")["iteration"] == 4


@pytest.mark.parametrize("text, key", [
    # megatron-core's shape check (a tensor), torch's planner (an object), load_state_dict: as they word it
    ('KeyError: "decoder.layers.pre_mlp_layernorm.weight from model not in state dict: '
     "['decoder.layers.mlp.linear_fc1.layer_norm_weight']\"", "decoder.layers.pre_mlp_layernorm.weight"),
    ("RuntimeError: Missing key in checkpoint state_dict: decoder.layers.self_attention.linear_qkv.layer_norm_weight.",
     "decoder.layers.self_attention.linear_qkv.layer_norm_weight"),
    ('Error(s) in loading state_dict for GPTModel:\n\tMissing key(s) in state_dict: '
     '"decoder.layers.0.input_layernorm.weight".', "decoder.layers.0.input_layernorm.weight"),
    ('KeyError: "decoder.layers.mlp.linear_fc2.weight from model not in state dict: []"', None),  # not a spec name
    ("EOFError: Ran out of input", None),
])
def test_only_a_missing_weight_the_specs_name_differently_hints_at_the_spec(text, key):
    assert layer_spec.missing_spec_weight(Exception(text)) == key


@pytest.mark.parametrize("built", ["sdpa", "te"])
def test_an_older_checkpoint_of_another_spec_is_named_not_damaged(finished, tmp_path, monkeypatch, built):
    """No record: the load fails inside megatron-core on a norm's name, and the message names the spec and the
    setting instead of calling the checkpoint damaged (moving it aside would throw a good one away)."""
    d = copy_at(finished, tmp_path / "res", 2)
    records(monkeypatch, None)
    module_names_spec(monkeypatch)
    if built == "te":  # the model built here reported as TE's (its load fails the same way)
        monkeypatch.setattr(builder, "layer_backend", lambda model: "te")
    with pytest.raises(RecipeError) as e:
        train(d, "train.iters=4")
    msg = str(e.value)
    one_sentence(msg)
    assert "damaged" not in msg and "aside" not in msg
    assert f"train.load={d}: iteration 2's checkpoint" in msg and "layernorm.weight" in msg
    if built == "te":
        assert "likely saved on the SDPA layer spec" in msg and msg.endswith("set model.attention_backend=sdpa to load it")
    else:
        assert "likely saved on Transformer Engine's layer spec" in msg and "model.attention_backend=te" in msg


def test_a_damaged_older_checkpoint_is_still_called_damaged(finished, tmp_path):
    d = copy_at(finished, tmp_path / "res")
    os.remove(os.path.join(ckpt.iter_dir(str(d), 2), ckpt_integrity.MANIFEST))
    damage(d, 4, keep=lambda size: size // 2)  # its common state readable (megatron-core 0.19 keeps it there too)
    with pytest.raises(RecipeError) as e:
        train(d, "train.iters=6")
    one_sentence(str(e.value))
    assert "iteration 4's checkpoint cannot be loaded" in str(e.value) and "damaged or incomplete: move" in str(e.value)


# --- weights only: train.pretrained, teacher.load ---------------------------------------------------------------

def test_pretrained_of_another_spec_is_refused(finished, tmp_path, monkeypatch):
    te_imports(monkeypatch)
    r = recipe(tmp_path / "s", f"train.pretrained={finished}")
    with pytest.raises(RecipeError) as e:
        preflight(r, 1, False)
    one_sentence(str(e.value))
    assert str(e.value).startswith(f"train.pretrained={finished} was saved on the SDPA layer spec")
    assert "set model.attention_backend=sdpa" in str(e.value)


def test_an_online_teacher_of_another_spec_is_refused(finished, tmp_path, monkeypatch):
    te_imports(monkeypatch)
    r = recipe(tmp_path / "s", "kd=online", f"teacher.load={finished}", *STUDENT_AS_TEACHER)
    with pytest.raises(RecipeError) as e:
        preflight(r, 1, False)
    one_sentence(str(e.value))
    assert str(e.value).startswith(f"teacher.load={finished} was saved on the SDPA layer spec and "
                                   "teacher.attention_backend=auto")
    assert "set teacher.attention_backend=sdpa" in str(e.value)


def test_a_cache_teacher_of_another_spec_is_refused_before_it_is_built(finished, tmp_path, monkeypatch):
    """kd.build_cache's teacher (no preflight of teacher.load): refused in build_teacher, before its build."""
    from megatron_kd.runtime.dist import distributed
    from megatron_kd.teacher.megatron import build_teacher
    r = recipe(tmp_path / "s", "kd=offline", f"teacher.load={finished}", *STUDENT_AS_TEACHER,
               "teacher.attention_backend=local")
    no_model(monkeypatch)
    with distributed(r.parallel, 0, "cpu"), pytest.raises(RecipeError) as e:
        build_teacher(r, VOCAB)
    one_sentence(str(e.value))
    assert "set teacher.attention_backend=sdpa" in str(e.value)


@pytest.mark.parametrize("case", ["damaged", "older_spec"])
def test_a_teacher_checkpoint_that_fails_to_load_is_one_sentence(finished, tmp_path, monkeypatch, case):
    """torch's CheckpointException derives from BaseException: without the catch it is a raw traceback."""
    from megatron_kd.runtime.dist import distributed
    from megatron_kd.teacher.megatron import build_teacher
    d = copy_at(finished, tmp_path / "t")
    if case == "damaged":
        damage(d, 4)
    else:
        records(monkeypatch, None)
        module_names_spec(monkeypatch)
    r = recipe(tmp_path / "s", "kd=offline", f"teacher.load={d}", *STUDENT_AS_TEACHER)
    with distributed(r.parallel, 0, "cpu"), pytest.raises(RecipeError) as e:
        build_teacher(r, VOCAB)
    msg = str(e.value)
    one_sentence(msg)
    assert msg.startswith(f"teacher.load={d}")
    if case == "damaged":
        assert "cannot be loaded" in msg and "damaged or incomplete" in msg
    else:
        assert "likely saved on Transformer Engine's layer spec" in msg and "teacher.attention_backend=te" in msg


def test_a_pretrained_checkpoint_that_fails_to_load_is_one_sentence(finished, tmp_path):
    from megatron_kd.runtime.dist import distributed
    d = copy_at(finished, tmp_path / "p")
    damage(d, 4)
    r = recipe(tmp_path / "s", f"train.pretrained={d}")
    with distributed(r.parallel, 0, "cpu"):
        chunks = [builder.build_gpt(r.model, r.parallel, VOCAB, r.data.seq_length)]
        with pytest.raises(RecipeError) as e:
            resume.load_state(r, str(tmp_path / "s"), chunks, None, None, True)
    one_sentence(str(e.value))
    assert str(e.value).startswith(f"train.pretrained={d} cannot be loaded") and "damaged" in str(e.value)


# --- megatron-kd export -----------------------------------------------------------------------------------------

def hf_dir(tmp_path):
    """What export checks of --hf-path before it builds (a config naming an architecture, a weights file)."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    (d / "model.safetensors").write_bytes(b"")
    return d


def export_cli(finished, tmp_path, *extra):
    from megatron_kd.cli.export import main
    return main(["--checkpoint", str(finished), "--out", str(tmp_path / "out"), "--hf-path", str(hf_dir(tmp_path)),
                 "--device", "cpu", *extra])


def test_export_of_a_te_checkpoint_where_te_does_not_import_is_refused(finished, tmp_path, monkeypatch, capsys):
    records(monkeypatch, "te")
    no_model(monkeypatch)
    assert export_cli(finished, tmp_path) == 2
    err = capsys.readouterr().err
    one_sentence(err)
    assert f"--checkpoint {finished} was saved on Transformer Engine's layer spec, which cannot be built here" in err
    assert not (tmp_path / "out").exists()


def test_export_on_another_spec_than_recorded_is_refused(finished, tmp_path, monkeypatch, capsys):
    no_model(monkeypatch)
    assert export_cli(finished, tmp_path, "--attention-backend", "local") == 2
    err = capsys.readouterr().err
    one_sentence(err)
    assert "saved on the SDPA layer spec and --attention-backend local builds megatron-core's local layer spec; " \
           "set --attention-backend sdpa" in err


def local_hf_chunks(monkeypatch, seen):
    """build_hf_chunks without Megatron-Bridge: the recipe's GPT on the spec export asks for (Bridge maps the
    same layers; only the load is under test)."""
    def build(m, p, seq_length, precision, load_weights=True):
        seen.append(m.attention_backend)
        return [builder.build_gpt(m, p, VOCAB, seq_length, precision)], None
    monkeypatch.setattr(builder, "build_hf_chunks", build)


def test_export_builds_the_recorded_spec_where_auto_would_build_another(finished, tmp_path, monkeypatch):
    """The run's recipe says auto, which would build TE's spec here; export builds the SDPA spec its checkpoint
    records (and gets as far as writing the HF checkpoint, the Bridge step this test stops at)."""
    from megatron_kd.export import to_hf
    from megatron_kd.hf import model as hf_model
    te_imports(monkeypatch)
    seen = []
    local_hf_chunks(monkeypatch, seen)

    class Stop(Exception):
        pass

    def open_hf(*a, **k):
        raise Stop
    monkeypatch.setattr(hf_model, "open_hf", open_hf)
    with pytest.raises(Stop):
        to_hf.export(str(finished), str(tmp_path / "out"), hf_path=str(hf_dir(tmp_path)), device="cpu")
    assert seen == ["sdpa"]


def broken_copy(finished, tmp_path, monkeypatch, case):
    """A copy of the run whose load fails: its data files damaged, or saved before the spec was recorded (on
    TE's layers, by its module names)."""
    d = copy_at(finished, tmp_path / "c")
    if case == "damaged":
        damage(d, 4)
    else:
        records(monkeypatch, None)
        module_names_spec(monkeypatch)
    return d


@pytest.mark.parametrize("case", ["damaged", "older_spec"])
def test_an_export_whose_load_fails_is_one_sentence(finished, tmp_path, monkeypatch, capsys, case):
    d = broken_copy(finished, tmp_path, monkeypatch, case)
    local_hf_chunks(monkeypatch, [])
    assert export_cli(d, tmp_path) == 2
    err = capsys.readouterr().err
    one_sentence(err)
    if case == "damaged":  # megatron-core 0.19 keeps the common state in the data files: unreadable first
        assert f"--checkpoint {d} cannot be loaded" in err and "damaged or incomplete" in err or \
            f"--checkpoint {d}: its checkpoint cannot be read" in err
    else:
        assert "likely saved on Transformer Engine's layer spec" in err and "--attention-backend te" in err
    assert not (tmp_path / "out").exists()


# --- --teacher mkd: ---------------------------------------------------------------------------------------------

def test_a_mkd_teacher_of_a_te_checkpoint_where_te_does_not_import_is_refused(finished, monkeypatch):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron_kd.teacher.spec import make_teacher
    records(monkeypatch, "te")
    no_model(monkeypatch)
    try:
        with pytest.raises(ValueError) as e:
            make_teacher(f"mkd:{finished}", {"device": "cpu"}, vocab_size=VOCAB, seq_length=32)
        assert not dist.is_initialized(), "refused after the teacher's process group was set up"
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    one_sentence(str(e.value))
    assert str(e.value).startswith(f"--teacher mkd:{finished} was saved on Transformer Engine's layer spec, which "
                                   "cannot be built here")
    assert "--teacher-args '{\"attention_backend\": \"te\"}'" in str(e.value)


def test_a_mkd_teacher_builds_the_recorded_spec_where_auto_would_build_another(finished, monkeypatch):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron_kd.teacher.spec import make_teacher
    te_imports(monkeypatch)
    try:
        teacher = make_teacher(f"mkd:{finished}", {"device": "cpu", "precision": "fp32"}, vocab_size=VOCAB,
                               seq_length=32)
        assert builder.layer_backend(teacher.model) == "sdpa"
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


# --- megatron-kd compare ----------------------------------------------------------------------------------------

def compare_cli(finished, tmp_path, *extra, teacher=None):
    """The finished run scored against a teacher (itself by default) on 2 held-out samples."""
    from megatron_kd.cli.compare import main
    return main([str(finished), "--teacher", str(teacher or finished), "--eval-samples", "2",
                 "--out", str(tmp_path / "cmp"), *extra])


def no_compare_model(monkeypatch):
    """no_model, and for compare too: it builds with the build_gpt it imported by name."""
    from megatron_kd.training import evaluate
    no_model(monkeypatch)
    monkeypatch.setattr(evaluate, "build_gpt", builder.build_gpt)


def test_compare_builds_the_recorded_spec_where_auto_would_build_another(finished, tmp_path, monkeypatch):
    """The run's recipe says auto, which would build TE's spec here; compare builds the SDPA spec its checkpoint
    records for the teacher and the run (the run as its own teacher: KL 0)."""
    import json
    te_imports(monkeypatch)
    assert compare_cli(finished, tmp_path) == 0
    rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["kl"] == pytest.approx(0.0, abs=1e-5)


def test_compare_of_a_te_checkpoint_where_te_does_not_import_is_refused(finished, tmp_path, monkeypatch, capsys):
    records(monkeypatch, "te")
    no_compare_model(monkeypatch)
    assert compare_cli(finished, tmp_path) == 2
    err = capsys.readouterr().err
    one_sentence(err)
    assert f"the checkpoint {finished} was saved on Transformer Engine's layer spec, which cannot be built here" in err
    assert "--attention-backend te" in err


def test_compare_on_another_spec_than_recorded_is_refused(finished, tmp_path, monkeypatch, capsys):
    no_compare_model(monkeypatch)
    assert compare_cli(finished, tmp_path, "--attention-backend", "local") == 2
    err = capsys.readouterr().err
    one_sentence(err)
    assert f"the checkpoint {finished} was saved on the SDPA layer spec and --attention-backend local builds " \
           "megatron-core's local layer spec; set --attention-backend sdpa" in err


@pytest.mark.parametrize("case", ["damaged", "older_spec"])
def test_a_compare_whose_load_fails_is_one_sentence(finished, tmp_path, monkeypatch, capsys, case):
    """torch's CheckpointException derives from BaseException: without the catch it is a raw traceback."""
    d = broken_copy(finished, tmp_path, monkeypatch, case)
    assert compare_cli(finished, tmp_path, teacher=d) == 2
    err = capsys.readouterr().err
    one_sentence(err)
    assert f"the checkpoint {d}" in err
    if case == "damaged":
        assert "cannot be loaded" in err and "damaged or incomplete" in err
    else:
        assert "likely saved on Transformer Engine's layer spec" in err and "--attention-backend te" in err


@pytest.mark.parametrize("cli", ["compare", "export"])
def test_attention_backend_te_for_an_older_checkpoint_where_te_does_not_import_is_one_sentence(
        finished, tmp_path, monkeypatch, capsys, cli):
    """A checkpoint that records no spec, --attention-backend te, Transformer Engine not importing: one sentence
    naming the option and the fix before any model (it was the builder's raw RuntimeError traceback); the fix it
    gives (sdpa, the spec this checkpoint was saved on) passes."""
    records(monkeypatch, None)
    main = compare_cli if cli == "compare" else export_cli
    with monkeypatch.context() as mp:
        no_compare_model(mp)
        assert main(finished, tmp_path, "--attention-backend", "te") == 2
    err = capsys.readouterr().err
    one_sentence(err)
    assert "--attention-backend te" in err and "Transformer Engine does not import" in err
    assert "set --attention-backend sdpa" in err
    assert not (tmp_path / "out").exists()
    (tmp_path / "fix").mkdir()
    rc = main(finished, tmp_path / "fix", "--attention-backend", "sdpa")
    if cli == "compare":
        assert rc == 0
    else:  # export writes through Megatron-Bridge: where it is missing the spec is no longer what stops it
        assert rc == 0 or "Transformer Engine" not in capsys.readouterr().err
