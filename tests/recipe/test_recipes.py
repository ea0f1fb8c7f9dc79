"""Bad recipes fail before any work (no model built, nothing saved) with a message naming the key."""
import shutil

import pytest
from omegaconf import OmegaConf

from megatron_kd.cli import train as train_cli
from megatron_kd.recipe.schema import RecipeError, to_recipe
from megatron_kd.recipe.compose import compose, recipes_dir
from megatron_kd.teacher.build import build_cache_only
from megatron_kd.training.loop import run

FAST = ["data=mock", "data.vocab_size=250", "data.seq_length=32", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.progress=false", "train.iters=2", "kd.top_k=8",
        "model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.make_vocab_size_divisible_by=8",
        "teacher.num_layers=1", "teacher.hidden_size=32", "teacher.ffn_hidden_size=64",
        "teacher.make_vocab_size_divisible_by=8"]


def recipe(tmp_path, *overrides):
    return to_recipe(compose("tiny_cpu", [*FAST, *overrides, f"train.save={tmp_path / 'run'}"]))


def fails(tmp_path, match, *overrides):
    with pytest.raises(RecipeError, match=match):
        run(recipe(tmp_path, *overrides), str(tmp_path / "run"))
    assert not (tmp_path / "run" / "latest_checkpointed_iteration.txt").exists()
    assert not list((tmp_path / "run").glob("iter_*")) if (tmp_path / "run").exists() else True


def test_unknown_key_in_a_recipe_file(tmp_path):
    rdir = tmp_path / "recipes"
    shutil.copytree(recipes_dir(), rdir)
    (rdir / "typo.yaml").write_text("defaults:\n  - tiny_cpu\n  - _self_\nkd:\n  topk: 3\n")
    with pytest.raises(RecipeError, match=r"unknown recipe key 'kd\.topk'.*kd takes: .*cache, top_k, .*mode"):
        to_recipe(compose(str(rdir / "typo.yaml"), ["train.save=x"]))  # refused as Hydra composes it


@pytest.mark.parametrize("typo", ["kd.topk=3", "+kd.topk=3"])
def test_unknown_key_on_the_command_line(tmp_path, capsys, typo):
    rc = train_cli.main([typo, f"train.save={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown recipe key 'kd.topk'" in err and "top_k" in err
    assert not (tmp_path / "run" / "latest_checkpointed_iteration.txt").exists()


def test_a_schema_key_the_group_file_leaves_out_can_be_set(tmp_path):
    cfg = compose("tiny_cpu", ["train.save=x", "model.megatron.apply_query_key_layer_scaling=true"])
    assert to_recipe(cfg).model.megatron == {"apply_query_key_layer_scaling": True}


def test_wrong_type_names_the_key(tmp_path):
    with pytest.raises(RecipeError, match=r"^recipe key 'train\.iters': .*'many'.*Integer"):
        compose("tiny_cpu", [*FAST, "train.save=x", "train.iters=many"])  # Hydra's typed composition
    cfg = OmegaConf.create(OmegaConf.to_container(compose("tiny_cpu", [*FAST, "train.save=x"])))  # untyped, a dict
    cfg.train.iters = "many"
    with pytest.raises(RecipeError, match=r"train\.iters"):
        to_recipe(cfg)


def test_tp_not_dividing_heads(tmp_path):
    fails(tmp_path, r"model\.num_attention_heads=4 must divide by parallel\.tp=3", "parallel.tp=3")


def test_tp_not_dividing_query_groups(tmp_path):
    fails(tmp_path, r"model\.num_query_groups=2 must divide by parallel\.tp=4",
          "parallel.tp=4", "model.num_attention_heads=8")


def test_tp_not_dividing_an_unpadded_vocabulary(tmp_path):
    fails(tmp_path, r"does not divide by parallel\.tp=2, and model\.make_vocab_size_divisible_by=1",
          "parallel.tp=2", "data.vocab_size=251", "model.make_vocab_size_divisible_by=1")


def test_world_size_not_fitting_the_layout(tmp_path):
    fails(tmp_path, r"1 processes do not divide into parallel\.tp x parallel\.pp x parallel\.cp = 2", "parallel.tp=2")


def test_a_moe_student_under_tp_needs_sequence_parallel(tmp_path):
    fails(tmp_path, r"model\.num_moe_experts=4 with parallel\.tp=2: .*set parallel\.sequence_parallel=true",
          "parallel.tp=2", "model.num_moe_experts=4")


def test_offline_without_cache(tmp_path):
    fails(tmp_path, r"kd\.cache is required in offline mode", "kd=offline", "kd.cache=null")


@pytest.fixture(scope="module")
def mock_data_cache(tmp_path_factory):
    """A top-8 cache (random tiny teacher) for the mock data with seed 1234."""
    d = tmp_path_factory.mktemp("cache")
    r = to_recipe(compose("tiny_cpu", [*FAST, f"kd.cache={d / 'c'}", f"train.save={d / 'run'}"]))
    build_cache_only(r)
    return d / "c"


@pytest.mark.parametrize("override,error", [
    ("data.seed=99", r"kd\.cache=.* was built for another dataset.*data\.seed"),
    ("kd.top_k=16", r"kd\.top_k: the run asks for K=16, the cache stores K=8"),
    ("data.seq_length=16", r"data\.seq_length: the cache rows have 32 positions"),
    ("train.iters=4", r"holds 8 samples, the run needs 16 \(train\.iters"),
], ids=["another_dataset", "smaller_k", "another_sequence_length", "too_short_for_the_run"])
def test_a_cache_that_does_not_fit_the_run(tmp_path, mock_data_cache, override, error):
    fails(tmp_path, error, f"kd.cache={mock_data_cache}", "kd.build_cache=false", override)


def test_a_good_cache_passes(tmp_path, mock_data_cache):
    s = run(recipe(tmp_path, f"kd.cache={mock_data_cache}", "kd.build_cache=false", "train.eval_interval=null"),
            str(tmp_path / "run"))
    assert s["iteration"] == 2


def _recipe_names():
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


@pytest.mark.parametrize("name", _recipe_names())
def test_every_recipe_composes_and_passes_the_schema(name):
    from megatron_kd.recipe.schema import Recipe
    assert isinstance(to_recipe(compose(name, ["train.save=x"])), Recipe)


def test_one_recipe_name_lookup(tmp_path, monkeypatch):
    """train, launch and plan find recipes by one rule (recipe.compose.recipe_file), in $MEGATRON_KD_RECIPES too."""
    from megatron_kd.plan.recipe import recipe_path
    from megatron_kd.recipe.compose import missing_recipe, recipe_file
    (tmp_path / "mine.yaml").write_text("defaults: []\n")
    monkeypatch.setenv("MEGATRON_KD_RECIPES", str(tmp_path))
    assert recipe_file("mine") == recipe_path("mine") == tmp_path / "mine.yaml"
    assert missing_recipe("mine") is None
    assert recipe_path("tiny_cpu") is None
    assert missing_recipe("tiny_cpu") == f"no recipe 'tiny_cpu' in {tmp_path}; known: mine"
    assert missing_recipe(str(tmp_path / "gone.yaml")) == f"recipe file {str(tmp_path / 'gone.yaml')!r} does not exist"
    assert recipe_path(str(tmp_path / "mine.yaml")) == tmp_path / "mine.yaml"


def test_online_mode_refuses_cache_temperature():
    """Online targets are the teacher at kd.temperature already; re-tempering them from kd.cache_temperature would
    train on a distribution neither temperature describes."""
    from megatron_kd.recipe.checks import check_recipe
    base = ["data=mock", "data.vocab_size=64", "kd=online", "kd.temperature=2.0", "teacher.load=/t"]
    check_recipe(to_recipe(compose("tiny_cpu", base)), None, False)
    r = to_recipe(compose("tiny_cpu", [*base, "kd.cache_temperature=1.0"]))
    with pytest.raises(RecipeError, match=r"^kd.cache_temperature=1.0 .* set kd.cache_temperature=null$"):
        check_recipe(r, None, False)


def test_top_k_null_takes_the_caches_k_where_a_cache_is_read():
    """kd.top_k=null (the shared default with Bridge's kd section) reads the cache's K; modes that compute the
    teacher's top-K themselves need a number, refused by name before any work."""
    from megatron_kd.recipe.checks import check_recipe
    base = ["data=mock", "data.vocab_size=64", "kd.top_k=null"]
    check_recipe(to_recipe(compose("tiny_cpu", [*base, "kd.cache=/some/cache", "kd.build_cache=false"])), None, False)
    for extra, mode in ((["kd=online"], "online"), (["kd.cache=/c", "kd.build_cache=true"], "offline with")):
        with pytest.raises(RecipeError, match=rf"^kd.top_k=null takes a cache's K; kd.mode={mode}.*set kd.top_k"):
            check_recipe(to_recipe(compose("tiny_cpu", [*base, *extra])), None, False)


def test_cache_top_p_keys_are_checked_by_name():
    """kd.cache_encoding=topp needs kd.cache_top_p, and kd.cache_top_p / kd.cache_min_k need topp: refused by name
    before any work; a good pair passes."""
    from megatron_kd.recipe.checks import check_recipe
    base = ["data=mock", "data.vocab_size=64", "kd.cache=/c", "kd.build_cache=true", "kd.top_k=16"]
    check_recipe(to_recipe(compose("tiny_cpu", [*base, "kd.cache_encoding=topp", "kd.cache_top_p=0.99"])), None, False)
    check_recipe(to_recipe(compose("tiny_cpu", [*base, "kd.cache_encoding=sampled", "kd.cache_samples=16"])), None,
                 False)
    for extra, match in ((["kd.cache_encoding=topp"], r"^kd.cache_encoding=topp .* set kd.cache_top_p"),
                         (["kd.cache_top_p=0.9"], r"^kd.cache_top_p / kd.cache_min_k need kd.cache_encoding=topp"),
                         (["kd.cache_encoding=topp", "kd.cache_top_p=1.5"], r"^kd.cache_top_p=1.5 must be a number"),
                         (["kd.cache_encoding=topp", "kd.cache_top_p=0.9", "kd.cache_min_k=17"],
                          r"^kd.cache_min_k=17 must be an integer in \[1, top_k=16\]"),
                         (["kd.cache_encoding=fp8"], r"^kd.cache_encoding='fp8': use one of"),
                         (["kd.cache_encoding=sampled"], r"^kd.cache_encoding=sampled .* set kd.cache_samples"),
                         (["kd.cache_samples=8"], r"^kd.cache_samples / kd.cache_sample_seed need kd.cache_encoding="
                                                  "sampled"),
                         (["kd.cache_encoding=sampled", "kd.cache_samples=8"], r"^kd.top_k=16: a sampled cache"),
                         (["kd.cache_encoding=sampled", "kd.cache_samples=0"], r"^kd.cache_samples=0 must be")):
        with pytest.raises(RecipeError, match=match):
            check_recipe(to_recipe(compose("tiny_cpu", [*base, *extra])), None, False)


@pytest.mark.parametrize("section", ["model", "teacher"])
def test_te_backend_without_transformer_engine_is_refused_before_any_work(tmp_path, monkeypatch, section):
    """attention_backend=te where TE does not import: one sentence naming the section's key, before the cache build
    or the student's build (the teacher's used to fail inside the cache build, naming the student's key); the fix
    it gives (auto) passes."""
    from megatron_kd.recipe.checks import check_recipe
    from megatron_kd.runtime import features
    monkeypatch.setattr(features, "te_available", lambda: False)
    fails(tmp_path, rf"^{section}\.attention_backend=te needs Transformer Engine.*set {section}\.attention_backend=auto",
          f"{section}.attention_backend=te")
    check_recipe(recipe(tmp_path, f"{section}.attention_backend=auto"), None, False)


def test_the_fp8_recipe_needs_transformer_engine(monkeypatch):
    """llama31_8b_to_3b_32k_1xh200_fp8 without TE: refused before any work naming model.fp8; where TE imports it
    passes the same checks as its bf16 recipe."""
    from megatron_kd.recipe.checks import check_recipe
    from megatron_kd.runtime import features
    over = ["data.path=/data/x_text_document", "kd.cache=/data/kd"]
    r = to_recipe(compose("llama31_8b_to_3b_32k_1xh200_fp8", over, save="/tmp/unused"))
    monkeypatch.setattr(features, "te_available", lambda: False)
    with pytest.raises(RecipeError, match=r"^model\.fp8=hybrid needs Transformer Engine.*set model\.fp8=null"):
        check_recipe(r, None, True)
    monkeypatch.setattr(features, "te_available", lambda: True)
    check_recipe(r, None, True)


@pytest.mark.parametrize("te", [False, True])
def test_fp8_set_through_megatron_is_refused_by_its_key_before_any_work(tmp_path, monkeypatch, te):
    """model.megatron.fp8 reaches megatron-core as model.fp8 does: without TE it is refused before any work (it
    trained in bf16 on the local spec with no word), and with quant.format it is refused like model.fp8, naming
    the key that set it; the fix given passes."""
    from megatron_kd.recipe.checks import check_recipe
    from megatron_kd.runtime import features
    monkeypatch.setattr(features, "te_available", lambda: te)
    if not te:
        fails(tmp_path, r"^model\.megatron\.fp8=hybrid needs Transformer Engine.*set model\.megatron\.fp8=null",
              "model.megatron.fp8=hybrid", "model.fp8_recipe=delayed")  # megatron-core's default recipe
        check_recipe(recipe(tmp_path, "model.megatron.fp8=null"), None, False)
        return
    with pytest.raises(RecipeError, match=r"^quant\.format=int8 with model\.megatron\.fp8=hybrid: .*"
                                          r"set model\.megatron\.fp8=null"):
        check_recipe(recipe(tmp_path, "model.megatron.fp8=hybrid", "model.fp8_recipe=delayed", "quant.format=int8"),
                     None, False)
    check_recipe(recipe(tmp_path, "model.megatron.fp8=null", "quant.format=int8"), None, False)
