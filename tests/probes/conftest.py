"""The adversarial probes' tiny inputs, built once per session (the judgement of an outcome: probe.py)."""
import pytest

from probe import OUTCOMES, TINY


def pytest_terminal_summary(terminalreporter):
    """The probes' outcomes by kind: held (refused in one sentence naming the key / file), ok (a valid input that
    worked), silent, raw, hang, unclear."""
    if OUTCOMES:
        from collections import Counter
        counts = Counter(OUTCOMES.values())
        terminalreporter.write_line("probe outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))

# --- tiny inputs, built once -------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Two prepared sources of one tokenizer (40 and 30 of CPython's documentation topics) and a prefix of a
    corpus too small for the default data.split (its valid and test splits get no document)."""
    from megatron_kd.data.corpus import prepare, pydoc_documents
    d = tmp_path_factory.mktemp("probe_data")
    docs = pydoc_documents()
    a, b, small = str(d / "alpha"), str(d / "beta"), str(d / "small")
    prepare(docs[:40], a, vocab_size=300)
    tok = a + ".tokenizer.json"
    prepare(docs[40:70], b, tokenizer=tok)
    prepare(docs[70:79], small, tokenizer=tok)
    return {"dir": d, "alpha": a, "beta": b, "small": small, "tokenizer": tok}


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A finished one-step CE run (mock data): a `megatron-kd train` save dir with a checkpoint."""
    from megatron_kd.recipe.compose import compose
    from megatron_kd.recipe.schema import to_recipe
    from megatron_kd.training.loop import run
    save = tmp_path_factory.mktemp("probe_run") / "run"
    r = to_recipe(compose("tiny_cpu", ["data=mock", "data.vocab_size=250", "data.seq_length=16", "kd=ce", *TINY,
                                       f"train.save={save}"]))
    run(r, str(save))
    return save
