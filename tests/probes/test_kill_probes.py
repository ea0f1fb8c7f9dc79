"""SIGTERM and SIGKILL in the middle of a write: `data prepare` over an earlier corpus, a training checkpoint save.
What was there before stays usable (or the next command finishes the write), nothing is mixed, and the user is
told what to do. Each command runs as its own process (only a process can be killed), stopped by a signal it
sends itself at the moment probed (a stand-in of one function, set up in the child before the command runs).
`cache build` has its own kill tests (tests/cache/test_cache_resume.py, tests/cache/test_probes.py).

Each case records its outcome (probe.record). Runs in a base install."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from probe import ROOT, TINY, call, outcome, record, refuses, snapshot

LIMIT_S = 300  # a hang detector only


def command(setup: str, *argv, cwd=None) -> subprocess.CompletedProcess:
    """`megatron-kd ARGV` in its own process, after the Python lines `setup` (the stand-in that sends the signal)."""
    code = f"import os, signal, sys\n{setup}\nfrom megatron_kd.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        return subprocess.run([sys.executable, "-c", code, *map(str, argv)], env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired as t:
        record("hang")
        pytest.fail(f"hang: {t.cmd}")


# --- data prepare -------------------------------------------------------------------------------------------------

def _text(path, n, word):
    path.write_text("\n\n".join(f"{word} {i}: the quick brown fox jumps over the lazy dog {i} times." for i in range(n)))
    return path


@pytest.fixture
def prepared(tmp_path, corpus):
    """A corpus prepared at out/c with the probes' tokenizer, and the arguments of a second prepare over it."""
    from megatron_kd.cli import data as data_cli
    prefix = tmp_path / "out" / "c"
    first = ["prepare", "--input", _text(tmp_path / "a.txt", 200, "Alpha"), "--output-prefix", prefix,
             "--tokenizer", corpus["tokenizer"]]
    rc, _, err, exc = call(data_cli.main, first)
    assert rc == 0 and exc is None, err
    again = ["data", "prepare", "--input", _text(tmp_path / "b.txt", 60, "Beta gamma delta"), "--output-prefix",
             prefix, "--tokenizer", corpus["tokenizer"], "--overwrite"]
    return prefix, again


# the child stops itself while the new corpus is being written (SIGTERM: a stop asked for, run as asked)
TERM_WHILE_WRITING = """
from megatron_kd.data import corpus
real = corpus.write_indexed
def write_indexed(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*a, **k)
corpus.write_indexed = write_indexed
"""

# the child is killed between moving its new .bin and its new .idx into place (SIGKILL: no cleanup at all)
KILL_BETWEEN_MOVES = """
real = os.replace
def replace(src, dst, *a, **k):
    real(src, dst, *a, **k)
    if str(dst).endswith(".bin") and ".tmp" in str(src):
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
"""


def test_data_prepare_stopped_by_sigterm_while_writing_keeps_the_corpus_and_says_so(prepared):
    prefix, again = prepared
    before = snapshot(prefix.parent)
    p = command(TERM_WHILE_WRITING, *again)
    got = record("raw" if "Traceback" in p.stderr else "silent" if p.returncode == 0 else
                 outcome(p.returncode, p.stderr, None, (str(prefix), "rerun")))
    assert got == "held", f"{got}: rc={p.returncode} {p.stderr[-2000:]}"
    assert p.returncode == 128 + signal.SIGTERM
    after = snapshot(prefix.parent)
    if before != after:
        record("silent")
    assert before == after, sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def _ids(prefix) -> list:
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(str(prefix), mmap=True)
    return [np.asarray(ds[i]).tolist() for i in range(len(ds))]


def test_data_prepare_killed_between_its_moves_is_refused_for_training_then_finished(prepared, tmp_path, corpus):
    """SIGKILL after the new .bin replaced the old one, before the new .idx did: a .bin of one prepare beside the
    .idx of another would read as documents cut anywhere. Training refuses the prefix naming what to do; rerunning
    the prepare finishes the killed one's move first, then writes its own."""
    from megatron_kd.cli import train as train_cli
    prefix, again = prepared
    p = command(KILL_BETWEEN_MOVES, *again)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    tok = corpus["tokenizer"]
    train = ["data=pydoc", f"data.path={prefix}", f"data.tokenizer={tok}", "data.seq_length=16", "kd=ce",
             f"data.index_cache={tmp_path / 'index'}", "data.split='90,10,0'", *TINY,
             f"hydra.run.dir={tmp_path / 'run'}"]
    refuses(train_cli.main, train, "data.path", str(prefix), "rerun")
    from megatron_kd.cli import data as data_cli
    rc, _, err, exc = call(data_cli.main, again[1:])
    assert rc == 0 and exc is None and "its move is finished" in err, err
    reference = tmp_path / "ref" / "c"  # the second prepare on its own
    rc, _, err, exc = call(data_cli.main, [*again[1:5], reference, *again[6:]])
    assert rc == 0 and exc is None, err
    assert _ids(prefix) == _ids(reference)
    summary = json.loads((prefix.parent / "c.json").read_text())
    assert summary["tokens"] == sum(len(d) for d in _ids(prefix))
    assert sorted(os.listdir(prefix.parent)) == [".c.prepare.lock", "c.bin", "c.idx", "c.json"]


# --- a training checkpoint save -----------------------------------------------------------------------------------

# the child is killed inside the save of iteration 2 (megatron-core's writer has started: files of it may exist)
KILL_IN_SECOND_SAVE = """
from megatron.core import dist_checkpointing
real, calls = dist_checkpointing.save, []
def save(state, path, *a, **k):
    calls.append(path)
    if len(calls) == 2:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
            f.write(b"cut off")
        os.kill(os.getpid(), signal.SIGKILL)
    return real(state, path, *a, **k)
dist_checkpointing.save = save
"""


@pytest.mark.slow
def test_train_killed_while_saving_resumes_from_the_checkpoint_before(tmp_path, monkeypatch):
    from megatron_kd.checkpoint import store
    save = tmp_path / "run"
    args = ["train", "data=mock", "data.vocab_size=250", "data.seq_length=16", "kd=ce", *TINY, "train.iters=2",
            "train.save_interval=1", "train.eval_iters=0", f"hydra.run.dir={save}"]
    p = command(KILL_IN_SECOND_SAVE, *args, cwd=tmp_path)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert store.latest_iteration(str(save)) == 1
    monkeypatch.chdir(tmp_path)
    from megatron_kd.cli import train as train_cli
    rc, stdout, err, exc = call(train_cli.main, args[1:])
    out = stdout + err
    got = "raw" if exc is not None or "Traceback" in out else "ok" if rc == 0 else "unclear"
    assert record(got) == "ok", f"{got}: rc={rc} {out[-3000:]}"
    assert "resuming from" in out and "at iteration 1" in out, out[-2000:]
    assert store.latest_iteration(str(save)) == 2
