"""megatron_kd.bridge glue: fake Bridge modules where a class must subclass Bridge's, and one test against the real
Bridge classes. Marked `bridge`: the Python 3.12 job of .ci/run runs them with real megatron-core 0.19.2 and
Megatron-Bridge 0.6.2 (until now they were collected by no job: the 3.11 suite has no Bridge and the 3.12 job
selects `-m bridge`)."""
import dataclasses
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_kd import topk_kl_loss
from megatron_kd.bridge import OfflineKDConfig, apply_kd_overrides, bridge_available, split_kd_overrides
from megatron_kd.bridge import data as kd_data
from megatron_kd.bridge.api import enable_offline_kd
from megatron_kd.bridge.run import read_config_file
from megatron_kd.bridge.step import OfflineKDForwardStep, kd_loss_func, kd_settings, slice_for_context_parallel

ROOT = Path(__file__).resolve().parents[2]
B, S, H, V, K = 2, 8, 16, 40, 5
pytestmark = pytest.mark.bridge  # the Python 3.12 job runs them (real megatron-core 0.19.2 + Bridge)


class TokenDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 3

    def __getitem__(self, i):
        t = torch.arange(S) + i
        return {"tokens": t, "labels": t + 1, "loss_mask": torch.ones(S), "position_ids": torch.arange(S)}


@pytest.fixture(scope="module")
def cache_path(tmp_path_factory):
    """A real teacher cache (megatron_kd.cache) over TokenDataset: 3 samples x S positions x K, vocab V."""
    from megatron_kd.cache.encoding import EncodingOptions
    from megatron_kd.teacher.protocol import CallableTeacher
    from megatron_kd.teacher.build import build_cache
    table = torch.randn(V + 8, V, generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("kd") / "cache"
    build_cache(CallableTeacher(lambda tokens: table[tokens], V), TokenDataset(), path,
                encoding=EncodingOptions(top_k=K), teacher_id="test", dataset_id="tokens", progress=False)
    return str(path)


# --- import hygiene and config -------------------------------------------------------------------------------

def test_import_never_pulls_bridge_or_megatron_core():
    code = ("import sys, megatron_kd, megatron_kd.bridge, megatron_kd.bridge.step, megatron_kd.bridge.data, "
            "megatron_kd.bridge.api, megatron_kd.bridge.run; from megatron_kd.bridge import enable_offline_kd; "
            "bad = [m for m in sys.modules if m.startswith(('megatron.bridge', 'megatron.core'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match="kd.cache is required"):
        OfflineKDConfig().validate()
    with pytest.raises(ValueError, match="kd: tail='oops'"):
        OfflineKDConfig(cache_path="/c", tail="oops").validate()
    with pytest.raises(ValueError, match="kd.top_k=0"):
        OfflineKDConfig(cache_path="/c", top_k=0).validate()
    with pytest.raises(ValueError, match=r"unknown kd key\(s\) \['topk'\]"):
        OfflineKDConfig.from_dict({"cache_path": "/c", "topk": 3})


def test_one_kd_schema_in_both_dialects():
    """A Bridge YAML's kd section and a recipe's share OfflineKD's names and defaults; cache_path is an alias."""
    from dataclasses import fields
    from megatron_kd.recipe.schema import KDConfig, OfflineKD
    shared = [f.name for f in fields(OfflineKD)]
    assert {f.name: f.default for f in fields(OfflineKDConfig) if f.name in shared} == \
        {f.name: f.default for f in fields(KDConfig) if f.name in shared}
    assert OfflineKDConfig(cache_path="/c").cache == "/c" == OfflineKDConfig.from_dict({"cache_path": "/c"}).cache
    assert OfflineKDConfig(cache="/c", cache_path="/c").cache == "/c"
    with pytest.raises(ValueError, match="name two caches"):
        OfflineKDConfig(cache="/a", cache_path="/b")
    assert apply_kd_overrides(OfflineKDConfig(cache="/a"), ["kd.cache_path=/b"]).cache == "/b"
    # two overrides naming two caches (the alias and the key) are refused, not settled by their order
    with pytest.raises(ValueError, match=r"^kd.cache=/a and kd.cache_path=/b set kd.cache twice"):
        apply_kd_overrides(OfflineKDConfig(), ["kd.cache=/a", "kd.cache_path=/b"])
    with pytest.raises(ValueError, match=r"^kd.top_k=4 and kd.top_k=8 set kd.top_k twice"):
        apply_kd_overrides(OfflineKDConfig(), ["kd.top_k=4", "kd.top_k=8"])
    assert apply_kd_overrides(OfflineKDConfig(), ["kd.cache=/a", "kd.cache_path=/a"]).cache == "/a"


def test_overrides_split_and_parse():
    ours, theirs = split_kd_overrides(["kd.top_k=64", "train.train_iters=10", "+kd.ce_weight=0.5", "model.x=1"])
    assert ours == ["kd.top_k=64", "+kd.ce_weight=0.5"] and theirs == ["train.train_iters=10", "model.x=1"]
    kd = apply_kd_overrides(OfflineKDConfig(cache_path="/c"), ours + ["kd.chunk_size=null"])
    assert kd.top_k == 64 and kd.ce_weight == 0.5 and kd.chunk_size is None
    with pytest.raises(ValueError, match="unknown kd key 'topk'"):
        apply_kd_overrides(kd, ["kd.topk=3"])


# --- the Bridge-style YAML example ---------------------------------------------------------------------------

BRIDGE_SECTIONS = {"model", "train", "dataset", "optimizer", "scheduler", "checkpoint", "logger", "tokenizer",
                   "ddp", "dist", "rng", "validation", "mixed_precision", "comm_overlap", "profiling",
                   "rerun_state_machine", "env_vars"}  # ConfigContainer's fields in Bridge 0.6


@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "bridge").glob("*.yaml")), ids=lambda p: p.name)
def test_bridge_yaml_examples_parse(path):
    bridge, kd = read_config_file(str(path))
    OfflineKDConfig.from_dict(kd).validate()
    assert set(bridge) <= BRIDGE_SECTIONS, set(bridge) - BRIDGE_SECTIONS
    assert bridge["model"]["seq_length"] == bridge["dataset"]["seq_length"]  # Bridge asserts they match


def test_bridge_yaml_example_exists():
    assert list((ROOT / "recipes" / "bridge").glob("*.yaml")), "recipes/bridge/ needs a YAML example"


# --- dataset glue --------------------------------------------------------------------------------------------

def test_build_kd_datasets_wraps_train_only_and_binds_context(cache_path):
    seen = {}

    def provider(sizes, config, tokenizer=None):
        seen.update(sizes=sizes, config=config, tokenizer=tokenizer)
        return TokenDataset(), TokenDataset(), None

    ctx = SimpleNamespace(train_samples=3, valid_samples=2, test_samples=0, tokenizer="tok", pg_collection=None)
    kd = OfflineKDConfig(cache_path=cache_path, top_k=K - 2)
    train, valid, test = kd_data.build_kd_datasets("base-cfg", kd, ctx, provider)
    assert isinstance(valid, TokenDataset) and test is None
    assert seen == {"sizes": [3, 2, 0], "config": "base-cfg", "tokenizer": "tok"}
    item = train[2]
    assert item["topk_ids"].shape == (S, K - 2) and torch.equal(item["tokens"], torch.arange(S) + 2)
    batch = torch.utils.data.default_collate([train[0], train[1]])  # what Bridge's DataLoader does
    assert batch["topk_ids"].shape == (2, S, K - 2) and batch["topk_logprobs"].dtype == torch.float32


def test_build_kd_datasets_refuses_other_data(cache_path):
    class Shifted(TokenDataset):
        def __getitem__(self, i):
            return super().__getitem__(i + 1)

    ctx = SimpleNamespace(train_samples=3, valid_samples=0, test_samples=0)
    train, _, _ = kd_data.build_kd_datasets(None, OfflineKDConfig(cache_path=cache_path), ctx,
                                            lambda sizes, cfg: (Shifted(), None, None))
    with pytest.raises(ValueError, match="token"):
        train[0]


@pytest.fixture
def fake_bridge(monkeypatch):
    """Just enough of megatron.bridge for the DatasetProvider subclass: base classes and get_dataset_provider."""

    @dataclasses.dataclass(kw_only=True)
    class DataloaderConfig:
        dataloader_type: str | None = None
        num_workers: int = 2
        pin_memory: bool = True

        def finalize(self):
            self.finalized = True

    @dataclasses.dataclass
    class DatasetProvider(DataloaderConfig):
        def build_datasets(self, context):
            raise NotImplementedError

    calls = []

    def get_dataset_provider(config):
        def provider(sizes, cfg):
            calls.append((sizes, cfg))
            return TokenDataset(), None, None
        return provider

    mods = {name: types.ModuleType(name) for name in
            ("megatron.bridge", "megatron.bridge.data", "megatron.bridge.data.base", "megatron.bridge.data.utils",
             "megatron.bridge.utils", "megatron.bridge.utils.instantiate_utils")}
    mods["megatron.bridge.utils.instantiate_utils"].register_allowed_target_prefix = lambda prefix: None
    mods["megatron.bridge.data.base"].DatasetProvider = DatasetProvider
    mods["megatron.bridge.data.utils"].get_dataset_provider = get_dataset_provider
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "megatron_kd.bridge.provider", raising=False)  # re-import on the fakes
    yield SimpleNamespace(DatasetProvider=DatasetProvider, calls=calls)
    sys.modules.pop("megatron_kd.bridge.provider", None)


@dataclasses.dataclass
class UserDatasetConfig:  # stands in for Bridge's GPTDatasetConfig
    seq_length: int = S
    num_workers: int = 8
    pin_memory: bool = False
    finalized: bool = False

    def finalize(self):
        self.finalized = True


def test_dataset_provider_wraps_the_users_config(fake_bridge, cache_path):
    from megatron_kd.bridge.provider import wrap_dataset_config
    base = UserDatasetConfig()
    wrapped = wrap_dataset_config(base, OfflineKDConfig(cache_path=cache_path))
    assert isinstance(wrapped, fake_bridge.DatasetProvider)
    assert wrapped.seq_length == S and wrapped.num_workers == 8 and wrapped.pin_memory is False
    wrapped.finalize()
    assert base.finalized and wrapped.finalized
    ctx = SimpleNamespace(train_samples=3, valid_samples=0, test_samples=0)
    train, _, _ = wrapped.build_datasets(ctx)
    assert train[0]["topk_ids"].shape == (S, K) and fake_bridge.calls == [([3, 0, 0], base)]
    with pytest.raises(AttributeError):
        wrapped.no_such_field
    import copy
    clone = copy.deepcopy(wrapped)  # Bridge copies and serializes configs
    assert clone.seq_length == S and clone.kd == wrapped.kd and clone.base is not base
    assert type(wrapped).__module__ == "megatron_kd.bridge.provider"  # importable by Bridge's _target_


def test_enable_offline_kd_checks_the_cache_first(fake_bridge, cache_path):
    model = SimpleNamespace(seq_length=S, vocab_size=64)
    cfg = SimpleNamespace(model=model, dataset=UserDatasetConfig())
    step = enable_offline_kd(cfg, {"cache_path": cache_path, "top_k": K})
    assert isinstance(step, OfflineKDForwardStep) and step.valid_vocab_size == V
    assert isinstance(cfg.dataset, fake_bridge.DatasetProvider) and cfg.dataset.kd.top_k == K
    bad = [(dict(seq_length=S, vocab_size=V - 1), {}, "vocabulary"),
           (dict(seq_length=2 * S, vocab_size=V), {}, "seq_length"),
           (dict(seq_length=S, vocab_size=V), {"top_k": K + 1}, "top_k"),
           (dict(seq_length=S, vocab_size=V), {"temperature": 2.0}, "temperature"),
           (dict(seq_length=S, vocab_size=V, use_mup=True), {}, "MuP")]
    for model_keys, kd_keys, msg in bad:
        cfg = SimpleNamespace(model=SimpleNamespace(**model_keys), dataset=UserDatasetConfig())
        with pytest.raises(ValueError, match=msg):
            enable_offline_kd(cfg, OfflineKDConfig(cache_path=cache_path, **kd_keys))
        assert isinstance(cfg.dataset, UserDatasetConfig)  # nothing changed


@pytest.mark.parametrize("clamp, kept", [(7.0, False), (None, True)])
def test_enable_offline_kd_keeps_the_fused_bias_activation_off_for_a_clamped_glu(fake_bridge, cache_path, capsys,
                                                                                  clamp, kept):
    """Bridge's GPT-OSS provider fuses bias + clamped GLU, which megatron-core computes with the clamp before the
    bias: offline KD turns that fusion off (with a note) for clamped activations only."""
    import torch.nn.functional as F
    model = SimpleNamespace(seq_length=S, vocab_size=64, bias_activation_fusion=True, activation_func=F.silu,
                            gated_linear_unit=True, activation_func_clamp_value=clamp)
    enable_offline_kd(SimpleNamespace(model=model, dataset=UserDatasetConfig()), {"cache_path": cache_path})
    assert model.bias_activation_fusion is kept
    assert ("bias_activation_fusion set to False" in capsys.readouterr().out) is not kept


# --- forward step glue ---------------------------------------------------------------------------------------

class FakeGPT(torch.nn.Module):
    """GPTModel's contract for this adapter (megatron-core 0.19): [s, b, h] hidden states into the
    output_processor hook on the last stage, or per-token CE [b, s] when given labels and no hook."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(V + 8, H)
        self.output_layer = torch.nn.Linear(H, V, bias=False)
        self.output_layer.tp_group = SimpleNamespace(size=lambda: 1)  # ColumnParallelLinear's, at TP=1
        self.output_layer.sequence_parallel = False
        self.config = SimpleNamespace(sequence_parallel=False, mtp_num_layers=None)
        self.post_process = True
        self.seen = {}

    def forward(self, input_ids, position_ids, attention_mask, labels=None, output_processor=None):
        hidden = self.embedding(input_ids).transpose(0, 1)  # Megatron's [s, b, h]
        self.seen = dict(hidden=hidden)
        if not self.post_process:  # an earlier pipeline stage: hidden states go to the next one
            return hidden
        if output_processor is not None:
            return output_processor(hidden_states=hidden, output_layer=self.output_layer, output_weight=None,
                                    labels=labels, config=self.config)
        logits = self.output_layer(hidden).float()
        return torch.nn.functional.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")


def make_batch(cache_path=None):
    from megatron_kd.cache import TopKDataset
    ds = TopKDataset(TokenDataset(), cache_path) if cache_path else TokenDataset()
    batch = torch.utils.data.default_collate([ds[0], ds[1]])
    batch["loss_mask"][0, -3:] = 0
    return batch


def test_settings_map_onto_the_recipe_kd_section():
    kd = kd_settings(OfflineKDConfig(cache_path="/c", top_k=64, ce_weight=0.5, temperature=2.0, log_ce=True))
    assert (kd.mode, kd.cache, kd.top_k, kd.ce_weight, kd.temperature, kd.log_ce) == \
        ("offline", "/c", 64, 0.5, 2.0, True)
    # every loss key reaches the step (a Bridge YAML's divergence once trained forward KL silently)
    from dataclasses import fields
    from megatron_kd.loss.options import KDLoss
    src = OfflineKDConfig(cache_path="/c", divergence="jsd", jsd_beta=0.25, cache_temperature=3.0, tail="bucket",
                          kl_weight=0.7, impl="chunked", chunk_size=64)
    kd = kd_settings(src)
    assert {f.name: getattr(kd, f.name) for f in fields(KDLoss)} == {f.name: getattr(src, f.name) for f in fields(KDLoss)}


def test_loss_func_masks_sums_and_reports():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    loss, n, report = kd_loss_func(mask, None, losses)
    assert loss.item() == 13.0 and n.item() == 4
    torch.testing.assert_close(report["kd loss"], torch.tensor([13.0, 4.0]))


@pytest.mark.parametrize("log_ce", [False, True])
def test_forward_step_trains_on_kd_loss(cache_path, log_ce):
    model = FakeGPT()
    batch = make_batch(cache_path)
    step = OfflineKDForwardStep(OfflineKDConfig(cache_path=cache_path, ce_weight=0.25, log_ce=log_ce),
                                valid_vocab_size=V)
    output, loss_func = step.step(batch, model)
    loss, n, report = loss_func(output)
    hidden = model.seen["hidden"].transpose(0, 1)
    ref = topk_kl_loss(hidden, model.output_layer.weight, batch["topk_ids"], batch["topk_logprobs"],
                       labels=batch["labels"], ce_weight=0.25, reduction="none")
    assert output.shape == (B, S)
    torch.testing.assert_close(loss, (ref * batch["loss_mask"]).sum())
    assert n.item() == B * S - 3
    assert set(report) == ({"kd loss", "kd kl", "kd ce", "kd kl_bucket"} if log_ce else {"kd loss"})
    loss.backward()
    assert model.output_layer.weight.grad is not None and model.output_layer.weight.grad.abs().sum() > 0


def test_forward_step_eval_batches_use_the_lm_loss():
    model = FakeGPT()
    output, loss_func = OfflineKDForwardStep(OfflineKDConfig(cache_path="/c")).step(make_batch(), model)
    _, _, report = loss_func(output)
    assert set(report) == {"lm loss"} and output.shape == (B, S)
    strict = OfflineKDForwardStep(OfflineKDConfig(cache_path="/c", eval_with_lm_loss=False))
    with pytest.raises(ValueError, match="without cache rows"):
        strict.step(make_batch(), model)


def test_earlier_pipeline_stages_send_hidden_states(cache_path):
    model = FakeGPT()
    model.post_process = False
    output, _ = OfflineKDForwardStep(OfflineKDConfig(cache_path=cache_path)).step(make_batch(cache_path), model)
    assert output.shape == (S, B, H)  # hidden states for the next stage; the loss runs on the last


class Timers:
    def __init__(self):
        self.log = []

    def __call__(self, name, log_level=None):
        log = self.log
        return SimpleNamespace(start=lambda **_: log.append(("start", name)), stop=lambda **_: log.append(("stop", name)))


def test_forward_step_call_convention(cache_path):
    """Bridge injects state when the first parameter is named `state`; the data iterator yields collated batches."""
    step = OfflineKDForwardStep(OfflineKDConfig(cache_path="/c"), valid_vocab_size=V)
    import inspect
    assert list(inspect.signature(step).parameters)[:3] == ["state", "data_iterator", "model"]
    state = SimpleNamespace(timers=Timers(), cfg=SimpleNamespace(
        rerun_state_machine=SimpleNamespace(check_for_nan_in_loss=False)))
    output, loss_func = step(state, iter([make_batch(cache_path)]), FakeGPT())
    assert loss_func(output)[0].isfinite()
    assert state.timers.log == [("start", "batch-generator"), ("stop", "batch-generator")]


class ColumnLinear(torch.nn.Linear):
    """Megatron's ColumnParallelLinear returns (output, bias)."""

    def forward(self, x, weight=None):
        return torch.nn.functional.linear(x, self.weight if weight is None else weight), None


class OldGPT(FakeGPT):
    """megatron-core 0.16's GPTModel: no output_processor; logits [b, s, V] from the output layer."""

    def __init__(self):
        super().__init__()
        self.output_layer = ColumnLinear(H, V, bias=False)
        self.output_layer.tp_group, self.output_layer.sequence_parallel = SimpleNamespace(size=lambda: 1), False

    def forward(self, input_ids, position_ids, attention_mask, labels=None):
        hidden = self.embedding(input_ids).transpose(0, 1)
        self.seen = dict(hidden=hidden)
        logits, _ = self.output_layer(hidden)
        return logits.transpose(0, 1).contiguous()


def test_forward_step_on_megatron_core_without_output_processor(cache_path):
    model, batch = OldGPT(), make_batch(cache_path)
    output, loss_func = OfflineKDForwardStep(OfflineKDConfig(cache_path=cache_path), V).step(batch, model)
    hidden = model.seen["hidden"].transpose(0, 1)
    ref = topk_kl_loss(hidden, model.output_layer.weight, batch["topk_ids"], batch["topk_logprobs"],
                       reduction="none")
    torch.testing.assert_close(loss_func(output)[0], (ref * batch["loss_mask"]).sum())
    assert "forward" not in vars(model.output_layer)  # the swap is undone after the call


def test_packed_batches_are_refused(cache_path):
    from megatron_kd.bridge.step import next_batch
    batch = make_batch(cache_path)
    batch["cu_seqlens"] = torch.tensor([0, S])
    with pytest.raises(ValueError, match="packed sequences"):
        next_batch(iter([batch]), "cpu")


def test_context_parallel_split_follows_megatron():
    """Cache rows [b, s, K] are split like tokens [b, s]: chunks r and 2*cp-1-r of 2*cp (two gloo ranks, the CP
    group their world: megatron-core 0.19 asks the real group for its rank)."""
    pytest.importorskip("megatron.core")
    from dist_utils import run_ranks
    run_ranks(2, _cp_split_worker)


def _cp_split_worker(rank, world):
    import torch.distributed as dist
    cp = world
    batch = {"tokens": torch.arange(B * S).view(B, S), "topk_ids": torch.arange(B * S * K).view(B, S, K)}
    part = slice_for_context_parallel(dict(batch), dist.group.WORLD)
    chunk = S // (2 * cp)
    keep = list(range(rank * chunk, (rank + 1) * chunk)) + \
        list(range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk))
    assert torch.equal(part["tokens"], batch["tokens"][:, keep])
    assert torch.equal(part["topk_ids"], batch["topk_ids"][:, keep])
    assert slice_for_context_parallel(batch, None) is batch


# --- against the real Megatron-Bridge ------------------------------------------------------------------------

def test_with_real_bridge():
    from megatron.bridge.data.base import DatasetProvider
    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.bridge.training.config import MockGPTDatasetConfig
    from megatron.bridge.training.utils.train_utils import needs_global_state_injection

    step = OfflineKDForwardStep(OfflineKDConfig(cache_path="/c"))
    assert needs_global_state_injection(step)
    base = MockGPTDatasetConfig(random_seed=1, seq_length=S, reset_position_ids=False, reset_attention_mask=False,
                                eod_mask_loss=False)
    from megatron_kd.bridge.provider import wrap_dataset_config
    wrapped = wrap_dataset_config(base, OfflineKDConfig(cache_path="/c"))
    assert isinstance(wrapped, DatasetProvider) and wrapped.seq_length == S
    assert callable(get_dataset_provider(wrapped))


def test_load_recipe_accepts_module_paths():
    from megatron_kd.bridge.run import load_recipe
    assert load_recipe("collections:OrderedDict") == {}
