"""Data mixtures: a weighted data.path blends sources with megatron-core's BlendedDataset; offline KD reads each
source's own cache (kd.cache/<source name>), so new weights reuse both caches: zero teacher calls (counted)."""
import json
import os

import numpy as np
import pytest

from megatron_kd.data.corpus import prepare, pydoc_documents
from train_harness import BASE, TEACHER_ARCH, train

pytestmark = pytest.mark.slow
ITERS = 2


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two sources of one tokenizer: the first and the second half of CPython's documentation topics."""
    d = tmp_path_factory.mktemp("mix")
    docs = pydoc_documents()
    a, b = str(d / "data" / "alpha"), str(d / "data" / "beta")
    prepare(docs[:40], a, vocab_size=300)
    prepare(docs[40:80], b, tokenizer=str(d / "data" / "alpha.tokenizer.json"))
    return d, a, b


def mixture(d, a, b, wa, wb):
    base = [o for o in BASE if not o.startswith(("data=", "data.vocab_size"))]
    return [*base, *TEACHER_ARCH, "data=pydoc", "data.vocab_size=null", f"data.path=[{wa},{a},{wb},{b}]",
            f"data.tokenizer={d / 'data' / 'alpha.tokenizer.json'}", f"data.index_cache={d / 'index'}",
            f"train.iters={ITERS}", "kd.build_cache=true", f"kd.cache={d / 'caches'}"]


@pytest.fixture(scope="module")
def counted(sources):
    """The teacher's calls in each of two runs: weights 0.5/0.5, then 0.8/0.2 (same caches)."""
    import megatron_kd.teacher.build as build
    d, a, b = sources
    calls, real = [], build._start_teacher_topk

    def counting(*args, **kw):
        calls[-1] += 1
        return real(*args, **kw)
    mp = pytest.MonkeyPatch()
    mp.setattr(build, "_start_teacher_topk", counting)
    try:
        runs = []
        for name, (wa, wb) in (("even", (0.5, 0.5)), ("skewed", (0.8, 0.2))):
            calls.append(0)
            stamps = {n: os.stat(d / "caches" / n / "manifest.json").st_mtime_ns
                      for n in ("alpha", "beta") if (d / "caches" / n / "manifest.json").exists()}
            runs.append((train(d / name, *mixture(d, a, b, wa, wb)), stamps))
    finally:
        mp.undo()
    return d, runs, calls


def test_a_mixture_trains_from_each_sources_cache(counted):
    d, runs, calls = counted
    summary, _ = runs[0]
    assert summary["iteration"] == ITERS and summary["mode"] == "offline"
    for n in ("alpha", "beta"):
        m = json.loads((d / "caches" / n / "manifest.json").read_text())
        assert m["num_samples"] == ITERS * 4  # the run's sample count, whatever the weights
    assert calls[0] > 0


def test_new_weights_reuse_both_caches_with_no_teacher_call(counted):
    d, runs, calls = counted
    summary, stamps = runs[1]
    assert summary["iteration"] == ITERS
    assert calls[1] == 0, calls
    assert set(stamps) == {"alpha", "beta"}
    for n, t in stamps.items():
        assert os.stat(d / "caches" / n / "manifest.json").st_mtime_ns == t


def test_each_mixture_sample_carries_its_source_samples_cache_rows(sources, counted):
    """Sample i of the mixture is source j's sample k (BlendedDataset's pairs), with row k of j's cache; other
    weights change the pairs, not the rows."""
    from megatron_kd.cache import CacheReader
    from megatron_kd.data.datasets import build_datasets, load_tokenizer, source_caches, with_cache
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import to_recipe
    from megatron_kd.runtime.dist import distributed
    d, a, b = sources
    pairs = {}
    for wa, wb in ((0.5, 0.5), (0.8, 0.2)):
        r = to_recipe(compose("tiny_cpu", [*mixture(d, a, b, wa, wb), f"train.save={d / 'x'}"]))
        tok = load_tokenizer(r.data)
        with distributed(r.parallel, r.train.seed, "cpu"):
            mix, _ = build_datasets(r.data, tok, ITERS * 4, 4)
            sets = [with_cache(src, CacheReader(kd.cache), kd) for kd, src in zip(source_caches(r.kd, mix),
                                                                               mix.sources)]
            full = mix.with_sources(sets)
            pairs[wa] = [mix.which(i) for i in range(len(mix))]
            readers = [CacheReader(kd.cache) for kd in source_caches(r.kd, mix)]
            for i in range(len(mix)):
                j, k = mix.which(i)
                s = full[i]
                assert np.array_equal(s["tokens"].numpy(), np.asarray(mix.sources[j][k]["tokens"]))
                assert np.array_equal(s["topk_ids"].numpy(), readers[j][k]["topk_ids"][:, :8])
        # a recipe of the source alone trains (and so builds a cache) on the same samples as its mixture source
        alone = to_recipe(compose("tiny_cpu", [*mixture(d, a, b, 0.5, 0.5), f"data.path={b}", f"train.save={d / 'y'}"]))
        with distributed(alone.parallel, alone.train.seed, "cpu"):
            single, _ = build_datasets(alone.data, tok, ITERS * 4, 4)
            for k in range(len(single)):
                assert np.array_equal(np.asarray(single[k]["tokens"]), np.asarray(mix.sources[1][k]["tokens"]))
    share = {w: sum(j == 0 for j, _ in p) / len(p) for w, p in pairs.items()}
    assert share[0.5] == pytest.approx(0.5, abs=0.13) and share[0.8] == pytest.approx(0.8, abs=0.13)
    assert pairs[0.5] != pairs[0.8]


def test_a_mixture_of_bf16_and_fp8_teachers_caches_is_told_so(sources, tmp_path, monkeypatch, capsys):
    """The second source's cache built by a teacher whose identity records FP8 (as a TE teacher under teacher.fp8
    records it; no TE on a CPU): the run names both precisions in one note; the same-precision runs above print
    none."""
    from megatron_kd.teacher.megatron import MegatronTeacher
    d, a, b = sources
    real, calls = MegatronTeacher.identity, []

    def identity(self):
        ident = real(self)
        calls.append(1)
        if len(calls) == 2:  # beta's build (alpha is built first)
            ident.update(backend="te+fp8", fp8="hybrid/tensorwise")
        return ident
    monkeypatch.setattr(MegatronTeacher, "identity", identity)
    caches = tmp_path / "caches"
    over = [o for o in mixture(d, a, b, 0.5, 0.5) if not o.startswith("kd.cache=")] + [f"kd.cache={caches}"]
    summary = train(tmp_path / "run", *over)
    assert summary["iteration"] == ITERS and len(calls) == 2
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "different precisions" in ln]
    assert len(notes) == 1, notes
    assert "alpha: bf16" in notes[0] and "beta: fp8 (hybrid/tensorwise)" in notes[0]
    assert json.loads((caches / "beta" / "manifest.json").read_text())["teacher"]["fp8"] == "hybrid/tensorwise"
    # both caches of one precision: no note
    monkeypatch.setattr(MegatronTeacher, "identity", real)
    summary = train(tmp_path / "run2", *[o for o in over if not o.startswith("kd.cache=")],
                    f"kd.cache={tmp_path / 'caches2'}")
    assert not [ln for ln in capsys.readouterr().out.splitlines() if "different precisions" in ln]
