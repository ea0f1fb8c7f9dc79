"""The commands that only plan a run refuse what `megatron-kd train` refuses, in the same sentence: `megatron-kd plan`,
`launch --dry-run` (and a launch for other nodes) and `train --cfg job` check a recipe with the function training
checks it with (recipe/checks.check_recipe, cuda=None: for another machine). What only the machine that runs the
recipe can check (its GPU, Transformer Engine, ModelOpt, the files a key names there) is left to it, and each of
those commands names it in one printed line instead of refusing or passing it in silence.

Each case records its outcome (probe.record). Runs in a base install: no optional extra is imported."""
import re

import pytest

from megatron_kd.cli import launch as launch_cli
from megatron_kd.cli import plan as plan_cli
from megatron_kd.cli import train as train_cli
from probe import TINY, call, outcome, record, refuses

# tiny_cpu as the tests run it: offline KD from a cache it builds under train.save, mock data
BASE = ["data=mock", "data.vocab_size=250", "data.seq_length=16", *TINY]

# (overrides, the key the refusal names): refused on every machine
BAD = [
    (["quant.format=fp9"], "quant.format"),
    (["kd.cache_encoding=topp", "kd.cache_samples=8"], "kd.cache_samples"),
    (["kd.cache_encoding=sampled"], "kd.cache_samples"),
    (["model.fp8=fp4"], "model.fp8"),
    (["model.num_layers=0"], "model.num_layers"),
    (["teacher.num_layers=0"], "teacher.num_layers"),
    (["parallel.tp=0"], "parallel.tp"),
    (["parallel.ep=0"], "parallel.ep"),
    (["parallel.etp=0"], "parallel.etp"),
    (["kd.mode=bogus"], "kd.mode"),
    (["kd.top_k=0"], "kd.top_k"),
    (["kd.top_k=300"], "kd.top_k"),
    (["kd.kl_weight=0", "kd.ce_weight=0"], "kd.kl_weight"),
    (["kd.temperature=0"], "kd.temperature"),
    (["kd.divergence=bogus"], "kd.divergence"),
    (["kd.impl=bogus"], "kd.impl"),
    (["data.seq_length=1"], "data.seq_length"),
    (["data.kind=bogus"], "data.kind"),
    (["data.vocab_size=null"], "data.vocab_size"),
    (["train.iters=0"], "train.iters"),
    (["train.lr=-1"], "train.lr"),
    (["train.micro_batch_size=0"], "train.micro_batch_size"),
    (["train.optimizer=sgd"], "train.optimizer"),
    (["train.precision=fp8"], "train.precision"),
    (["train.device=tpu"], "train.device"),
    (["train.device=cpu", "train.precision=bf16"], "train.precision"),
    (["train.stop_at=5"], "train.stop_at"),
    (["train.export_hf=/tmp/x"], "train.export_hf"),
    (["model.activation=relu"], "model.activation"),
    (["model.attention_backend=bogus"], "model.attention_backend"),
    (["model.rope_scaling_factor=2"], "model.rope_scaling_factor"),
    (["model.megatron.bogus_key=1"], "model.megatron.bogus_key"),
    (["model.recompute_granularity=bogus"], "model.recompute_granularity"),
    (["model.recompute_granularity=full"], "model.recompute_method"),
    (["model.recompute_granularity=full", "model.recompute_method=block"], "model.recompute_num_layers"),
    (["model.num_moe_experts=4", "parallel.tp=2"], "model.num_moe_experts"),
    (["kd.mode=online", "teacher.load=/t", "parallel.pp=2"], "parallel.pp"),
    (["kd.top_k=4,8"], "kd.top_k=4,8"),  # a sweep outside train -m
    (["parallel.pp=2"], "kd.build_cache"),  # the cache build inside the run is not pipelined
]


def sentence(line: str) -> str:
    """A refusal without the command's own prefix (`megatron-kd plan: `, `megatron-kd train: error: `)."""
    return re.sub(r"^megatron-kd \w+: (error: )?", "", line.strip().splitlines()[-1])


def planners(args) -> dict:
    """{command: argv} of every command that only plans the run `megatron-kd train ARGS`."""
    return {"plan": (plan_cli.main, ["tiny_cpu", *args]),
            "launch --dry-run": (launch_cli.main, ["--dry-run", "tiny_cpu", "--gpus-per-node", "1", *args]),
            "launch --nodes 2 --dry-run": (launch_cli.main, ["--dry-run", "tiny_cpu", "--nodes", "2", *args]),
            "train --cfg job": (train_cli.main, ["--cfg", "job", *args])}


@pytest.mark.parametrize("bad,key", BAD, ids=[" ".join(b) for b, _ in BAD])
def test_planning_commands_refuse_what_train_refuses_in_its_words(tmp_path, monkeypatch, bad, key):
    monkeypatch.chdir(tmp_path)
    args = [*BASE, *bad]
    want = sentence(refuses(train_cli.main, args, key))
    for what, (main, argv) in planners(args).items():
        got = sentence(refuses(main, argv, key))
        if got != want:
            record("unclear")
        assert got == want, f"{what} refuses in other words than train:\n  train: {want}\n  {what}: {got}"
    assert not (tmp_path / "runs").exists(), "a refused run wrote its run directory"


@pytest.fixture
def no_te(monkeypatch):
    from megatron_kd.runtime import features
    monkeypatch.setattr(features, "te_available", lambda: False)


# (overrides, the key train names here, the key the planning commands name as left to the machine that runs it):
# refused on this CPU machine without Transformer Engine, fine on a GPU machine with it
MACHINE = [
    (["train.precision=bf16"], "train.precision", "train.device=auto"),
    (["kd.impl=fused"], "kd.impl=fused", "kd.impl=fused"),
    (["model.attention_backend=te"], "model.attention_backend=te", "model.attention_backend=te"),
    (["quant.format=nvfp4"], "quant.format=nvfp4", "quant.format=nvfp4"),
    (["kd.mode=online"], "teacher.load", "teacher.load"),
]


@pytest.mark.parametrize("more,key,left", MACHINE, ids=[" ".join(m) for m, _, _ in MACHINE])
def test_what_the_machine_decides_is_named_not_refused(tmp_path, monkeypatch, no_te, more, key, left):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the fused kernels' CPU interpreter (tests only)
    args = [*BASE, *more]
    refuses(train_cli.main, args, key)
    for what, (main, argv) in planners(args).items():
        rc, out, err, exc = call(main, argv)
        got = "raw" if exc is not None or "Traceback" in err else "ok" if rc == 0 else "unclear"
        if got == "ok" and not any("not checked here" in line and left in line for line in (out + err).splitlines()):
            got = "silent"  # accepted without a word of what it left unchecked
        assert record(got) == "ok", f"{what}: {got} rc={rc}\n{err[-2000:]}\n{out[-1500:]}"


def test_a_cache_path_that_is_a_file_is_left_to_the_machine_that_reads_it(tmp_path, monkeypatch):
    """kd.cache names a file here: train refuses it; a plan for another machine (whose kd.cache is a path there)
    says it did not look at it."""
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "cache.json"
    f.write_text("{}")
    args = [*BASE, f"kd.cache={f}", "kd.build_cache=false"]
    refuses(train_cli.main, args, "kd.cache")
    rc, out, err, exc = call(plan_cli.main, ["tiny_cpu", *args])
    named = any("not checked here" in line and f"kd.cache={f}" in line for line in err.splitlines())
    got = "raw" if exc is not None else "silent" if rc == 0 and not named else "ok" if rc == 0 else "unclear"
    assert record(got) == "ok", f"{got}: rc={rc} {err[-2000:]}"
