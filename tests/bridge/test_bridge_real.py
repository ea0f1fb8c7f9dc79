"""megatron_kd.bridge against the REAL Megatron-Bridge 0.6.2 / megatron-core 0.19.2 classes, on CPU.

Run: PYTHONPATH=$PWD /work/venv312/bin/python -m pytest -q -m bridge tests/bridge
Bridge's own code runs wherever it can without CUDA: runtime_config_update, build_tokenizer, the dataset lines of
setup() (exec'd from its source), get_dataset_provider, build_train_valid_test_datasets,
build_pretraining_data_loader, ConfigContainer.to_yaml / from_yaml, GPTModelProvider.provide.
"""
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import GBS, ITERS, K, MBS, SEQ, VOCAB, bridge_build, run_bridge_setup_lines, tiny_cfg

pytestmark = pytest.mark.bridge
ROOT = Path(__file__).resolve().parents[2]


def build_cache_cmd(out, *overrides):
    from megatron_kd.bridge.cache import main
    argv = ["build", "--recipe", "helpers:tiny_cfg", "--teacher", "helpers:table_teacher", "--out", str(out),
            "--top-k", str(K), "--no-progress", "kd.cache_path=" + str(out), *overrides]
    assert main(argv) == 0


@pytest.fixture(scope="module")
def bridge_cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("bridge") / "cache"
    build_cache_cmd(out)
    return str(out)


def kd_cfg(bridge_cache, **kw):
    from megatron_kd.bridge import OfflineKDConfig, enable_offline_kd
    cfg = tiny_cfg(**kw)
    step = enable_offline_kd(cfg, OfflineKDConfig(cache_path=bridge_cache))
    return cfg, step


# --- defect 1: Bridge's setup writes tokenizer / token_dtype_code onto cfg.dataset -------------------------------

def test_setup_writes_reach_the_users_dataset_config(bridge_cache):
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer
    cfg, _ = kd_cfg(bridge_cache)
    runtime_config_update(cfg)
    tok = build_tokenizer(cfg.tokenizer)
    base = cfg.dataset.base
    assert base.tokenizer is None and base.token_dtype_code is None
    run_bridge_setup_lines(cfg, tok)  # Bridge's own statements
    assert base.tokenizer is tok and base.token_dtype_code == 8  # vocab 256 < 65536: uint16 code
    assert "tokenizer" not in vars(cfg.dataset) and "token_dtype_code" not in vars(cfg.dataset)
    cfg.dataset.num_workers = 3  # a dataloader field both have: both change
    assert cfg.dataset.num_workers == 3 and base.num_workers == 3


def test_datasets_build_through_bridges_data_path(bridge_cache):
    """Without the fix MockGPTDataset fails ('failed to build as a mock data generator': no tokenizer)."""
    cfg, _ = kd_cfg(bridge_cache)
    (train, valid, test), _ = bridge_build(cfg)
    assert len(train) == ITERS * GBS
    assert train[0]["topk_ids"].shape == (SEQ, K) and train[0]["tokens"].shape == (SEQ,)


# --- defect 2: the cache covers the samples the run consumes, not the split's epoch ------------------------------

def test_cache_row_i_is_bridges_sample_i(bridge_cache):
    from megatron_kd.cache import CacheReader
    from helpers import table_teacher
    cfg, _ = kd_cfg(bridge_cache)
    (train, _, _), _ = bridge_build(cfg)
    epoch = train.data.dataset  # TopKDataset(Head(Bridge's GPTDataset))
    assert len(epoch) > 10 * len(train)  # Bridge's split is far longer than what the run uses
    reader, teacher = CacheReader(bridge_cache), table_teacher()
    assert len(reader) == ITERS * GBS
    for i in range(len(train)):
        s = train[i]
        logp = torch.log_softmax(teacher.fn(s["tokens"]).float(), -1)
        want_lp, want_ids = logp.topk(K, -1)
        assert torch.equal(s["tokens"], torch.as_tensor(epoch[i]["tokens"]).long())
        assert torch.equal(s["topk_ids"], want_ids)
        torch.testing.assert_close(s["topk_logprobs"], want_lp, atol=2e-3, rtol=0)  # fp16 encoding


def test_a_teacher_padded_past_the_tokenizer_caches_the_tokenizers_ids(tmp_path):
    """A teacher whose output layer has 16 rows more than the recipe's tokenizer has ids (Qwen-style padding): the
    cache holds the tokenizer's vocabulary, its top-K and log-probs come from the softmax over those ids only."""
    from megatron_kd.cache import CacheReader
    from helpers import table_teacher
    out = tmp_path / "padded"
    build_cache_cmd(out, "--teacher-args", f'{{"vocab": {VOCAB + 16}}}')
    reader, teacher = CacheReader(str(out)), table_teacher(VOCAB + 16)
    assert reader.vocab_size == VOCAB
    cfg, _ = kd_cfg(str(out))
    (train, _, _), _ = bridge_build(cfg)
    for i in range(3):
        s = train[i]
        want_lp, want_ids = torch.log_softmax(teacher.fn(s["tokens"])[..., :VOCAB].float(), -1).topk(K, -1)
        assert torch.equal(s["topk_ids"], want_ids)
        torch.testing.assert_close(s["topk_logprobs"], want_lp, atol=2e-3, rtol=0)  # fp16 encoding


def test_a_cache_of_other_samples_is_refused(bridge_cache):
    cfg, _ = kd_cfg(bridge_cache, seed=99)  # other shuffle: other samples
    (train, _, _), _ = bridge_build(cfg)
    with pytest.raises(ValueError, match="token"):
        train[0]


def test_a_cache_shorter_than_the_run_is_refused_before_training(bridge_cache):
    cfg, _ = kd_cfg(bridge_cache, iters=ITERS + 1)
    with pytest.raises(ValueError, match=rf"holds {ITERS * GBS} samples, the run needs {(ITERS + 1) * GBS}"):
        bridge_build(cfg)


# --- defect 3: Bridge's saved run config keeps kd ------------------------------------------------------------------

def test_saved_run_config_keeps_kd_and_loads_back(bridge_cache, tmp_path):
    import yaml
    from megatron.bridge.training.config import ConfigContainer
    from megatron.bridge.training.utils.checkpoint_utils import read_run_config
    from megatron_kd.bridge.provider import OfflineKDDatasetProvider
    cfg, _ = kd_cfg(bridge_cache)
    bridge_build(cfg)  # as after setup: the tokenizer is on the dataset config
    path = tmp_path / "run_config.yaml"
    cfg.to_yaml(str(path))  # what checkpointing.save_checkpoint writes
    saved = yaml.safe_load(path.read_text())["dataset"]
    assert saved["_target_"] == "megatron_kd.bridge.provider.OfflineKDDatasetProvider"
    assert saved["kd"]["cache"] == bridge_cache and saved["kd"]["_target_"].endswith("OfflineKDConfig")
    assert saved["base"]["_target_"] == "megatron.bridge.training.config.MockGPTDatasetConfig"
    assert saved["base"]["random_seed"] == 1234 and saved["base"]["seq_length"] == SEQ
    loaded = read_run_config(str(path))  # what a resume reads
    assert loaded["dataset"]["kd"]["cache"] == bridge_cache
    # The tokenizer object Bridge attached at setup does not instantiate back (the same with Bridge's own plain
    # MockGPTDatasetConfig); everything else does.
    loaded["dataset"]["base"]["tokenizer"] = None
    back = ConfigContainer.from_dict(loaded)
    assert isinstance(back.dataset, OfflineKDDatasetProvider) and back.dataset.kd == cfg.dataset.kd
    assert type(back.dataset.base).__name__ == "MockGPTDatasetConfig" and back.dataset.seq_length == SEQ


# --- defect 4: the forward step leaves Bridge's [b, 1, s, s] attention_mask behind ---------------------------------

@pytest.fixture(scope="module")
def cpu_megatron():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron_kd.runtime.cpu_patches import apply_cpu_patches, seed_model_parallel_rng
    from dist_utils import free_port
    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    apply_cpu_patches()
    seed_model_parallel_rng(0)
    yield
    ps.destroy_model_parallel()
    if created:  # its store holds the port; a later test's subprocess must not find it taken
        dist.destroy_process_group()


def cpu_model(cfg):
    from megatron.core.process_groups_config import ProcessGroupCollection
    m = cfg.model
    m.bf16, m.params_dtype, m.pipeline_dtype, m.use_cpu_initialization = False, torch.float32, torch.float32, True
    m.finalize()
    m._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return m.provide()


def first_batch(cfg, train, consumed=0):
    from megatron.bridge.data.samplers import build_pretraining_data_loader
    loader = build_pretraining_data_loader(train, consumed, "single", MBS, 0, True, pin_memory=False,
                                           data_parallel_rank=0, data_parallel_size=1, global_batch_size=GBS)
    return iter(loader)


@pytest.mark.parametrize("skip_mask", [True, False])
def test_forward_step_on_a_cpu_model(bridge_cache, cpu_megatron, skip_mask):
    cfg, step = kd_cfg(bridge_cache)
    cfg.dataset.create_attention_mask = True  # Bridge's default: the dataset makes a [1, s, s] mask
    cfg.dataset.skip_getting_attention_mask_from_dataset = skip_mask
    (train, _, _), _ = bridge_build(cfg)
    model = cpu_model(cfg)
    seen = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(args[2]), with_kwargs=True)
    it = first_batch(cfg, train)
    batch = next(first_batch(cfg, train))
    assert batch["attention_mask"].shape == (MBS, 1, SEQ, SEQ)
    state = SimpleNamespace(cfg=cfg, timers=None)
    output, loss_func = step(state, it, model)
    loss, count, report = loss_func(output)
    if skip_mask:
        assert seen == [None]  # left on the host, as Bridge's get_batch does
    else:
        assert seen[0] is not None and seen[0].shape == (MBS, 1, SEQ, SEQ)
    # float64 reference from the model's own logits (no hook) on the same batch
    with torch.no_grad():
        logits = model(batch["tokens"], batch["position_ids"], None).double()  # [b, s, V]
    logq = torch.log_softmax(logits, -1)
    lp = batch["topk_logprobs"].double()
    kl = (lp.exp() * (lp - logq.gather(-1, batch["topk_ids"]))).sum(-1)
    ref = (kl * batch["loss_mask"].double()).sum()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    assert int(count) == int(batch["loss_mask"].sum()) and set(report) == {"kd loss", "kd kl"}
    loss.backward()
    assert model.output_layer.weight.grad.abs().sum() > 0


# --- resume: Bridge's sampler restarts at the consumed-sample count; the cache rows follow ------------------------

def test_resume_continues_the_kd_data_at_the_consumed_sample(bridge_cache):
    from megatron_kd.cache import CacheReader
    cfg, _ = kd_cfg(bridge_cache)
    (train, _, _), _ = bridge_build(cfg)
    reader = CacheReader(bridge_cache)
    consumed = 2 * GBS  # a checkpoint after iteration 2
    batch = next(first_batch(cfg, train, consumed))
    for j, i in enumerate(range(consumed, consumed + MBS)):
        assert torch.equal(batch["tokens"][j], train[i]["tokens"])
        assert torch.equal(batch["topk_ids"][j], torch.from_numpy(reader[i]["topk_ids"].copy()).long())


# --- defect 5: te_available follows megatron-core's HAVE_TE ---------------------------------------------------------

def test_te_available_follows_megatron_core(monkeypatch):
    import importlib.util
    import megatron.core.extensions.transformer_engine as mcore_te
    from megatron_kd.bridge.recipes import have_te
    from megatron_kd.runtime.features import te_available
    assert importlib.util.find_spec("transformer_engine") is not None  # the stand-in module answers
    assert mcore_te.HAVE_TE is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert te_available() is False and have_te() is False
    monkeypatch.setattr(mcore_te, "HAVE_TE", True)
    assert te_available() is True and have_te() is True


# --- run.py: recipe + YAML + overrides, KD wired, no-TE layers ------------------------------------------------------

def test_run_build_merges_the_yaml_and_wires_kd(bridge_cache, tmp_path):
    from megatron_kd.bridge.provider import OfflineKDDatasetProvider
    from megatron_kd.bridge.recipes import sdpa_layer_spec
    from megatron_kd.bridge.run import build
    from megatron_kd.bridge.step import OfflineKDForwardStep
    cfg, step, _ = build(["--recipe", "helpers:tiny_cfg", "--config-file",
                          str(ROOT / "recipes/bridge/tiny_offline_kd.yaml"), f"kd.cache_path={bridge_cache}",
                          f"kd.top_k={K}", f"model.seq_length={SEQ}", f"dataset.seq_length={SEQ}",
                          f"train.train_iters={ITERS}", f"checkpoint.save={tmp_path}", f"checkpoint.load={tmp_path}"])
    assert isinstance(step, OfflineKDForwardStep) and isinstance(cfg.dataset, OfflineKDDatasetProvider)
    assert cfg.dataset.kd.top_k == K and cfg.dataset.kd.cache == bridge_cache
    assert cfg.train.train_iters == ITERS and cfg.train.global_batch_size == 4 and cfg.checkpoint.save_interval == 12
    assert cfg.dataset.base.create_attention_mask is False and cfg.optimizer.lr == 1e-3
    assert cfg.model.transformer_layer_spec is sdpa_layer_spec and not cfg.model.gradient_accumulation_fusion
    (train, _, _), _ = bridge_build(cfg)
    assert len(train) == ITERS * GBS and train[ITERS * GBS - 1]["topk_ids"].shape == (SEQ, K)


@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "bridge").glob("*.yaml")), ids=lambda p: p.name)
def test_bridge_yaml_examples_fit_bridges_schema(path):
    """Every key of the example YAMLs is a field of Bridge's ConfigContainer (OmegaConf's struct merge)."""
    from omegaconf import OmegaConf
    from megatron.bridge.training.utils.omegaconf_utils import create_omegaconf_dict_config
    from megatron_kd.bridge import OfflineKDConfig
    from megatron_kd.bridge.run import read_config_file
    bridge_yaml, kd = read_config_file(str(path))
    OfflineKDConfig.from_dict(kd).validate()
    merged, _ = create_omegaconf_dict_config(tiny_cfg())
    OmegaConf.set_struct(merged, True)
    OmegaConf.merge(merged, OmegaConf.create(bridge_yaml))  # raises on an unknown key


# --- the cache command's refusals -----------------------------------------------------------------------------------

def test_cache_command_refuses_bad_input_before_any_work(tmp_path, capsys):
    from megatron_kd.bridge.cache import main
    base = ["build", "--recipe", "helpers:tiny_cfg", "--no-progress"]
    assert main(base + ["--teacher", "helpers:table_teacher"]) == 2  # no kd.cache_path, no --out
    assert "no cache directory" in capsys.readouterr().err
    out = tmp_path / "c"
    assert main(base + ["--teacher", "helpers:table_teacher", "--teacher-args", '{"vocab": 128}', "--out",
                        str(out)]) == 2  # the recipe's tokenizer has 256 ids
    assert "teacher and student must share a tokenizer" in capsys.readouterr().err
    assert not out.exists()  # nothing written
