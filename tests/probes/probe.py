"""The adversarial probes' one judgement of an outcome, and how they run a command.

Each probe runs a command (in this process: its `main(argv)`, or as a subprocess where only a process can show
it: a hang, a lock held by another process) and asks what a careful user wants: a refusal in one sentence that
names the key or file and a fix, a non-zero exit, no traceback, nothing of the user's deleted or rewritten.
`outcome` names what happened instead: raw (a traceback), silent (exit 0 though the input was bad, or a user's
file lost), hang (the subprocess outlived its generous limit: a hang detector, not a speed check), unclear
(refused without naming the key / file, or in more than one sentence)."""
import contextlib
import io
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
HANG_S = 900  # only a hang reaches this (a refusal takes seconds, a loaded machine minutes)


def one_sentence(err: str) -> bool:
    """stderr is one line of one sentence (argparse's usage lines before its `error:` line aside)."""
    line = err.strip()
    if line.startswith("usage:"):
        line = line.splitlines()[-1]
    return bool(line) and "\n" not in line and not re.search(r"\w[.!?] +[A-Z]", line)


def outcome(rc, err: str, exc: BaseException | None = None, names=(), ok_rc=False) -> str:
    """held | raw | silent | unclear for a command that must refuse (ok_rc: exit 0 that says so is fine)."""
    if exc is not None or "Traceback (most recent call last)" in err:
        return "raw"
    if rc == 0 and not ok_rc:
        return "silent"
    if not one_sentence(err) or any(n.lower() not in err.lower() for n in names):
        return "unclear"
    return "held"


def call(main, argv) -> tuple:
    """(rc, stdout, stderr, exception) of `main(argv)` in this process; SystemExit is its exit status."""
    out, err, exc, rc = io.StringIO(), io.StringIO(), None, None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException as e:  # noqa: BLE001  a raw traceback is what the probe reports
            exc = e
            traceback.print_exc(file=err)
    return rc, out.getvalue(), err.getvalue(), exc


# test id -> outcome of every probe judged in this session (conftest prints the counts at the end)
OUTCOMES = {}


def record(got: str) -> str:
    """Note the running test's outcome (held, ok, silent, raw, hang, unclear) and return it."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    OUTCOMES[test] = got if OUTCOMES.get(test, "held") in ("held", "ok") else OUTCOMES[test]
    return got


def refuses(main, argv, *names, ok_rc=False) -> str:
    """Run and assert a one-sentence refusal naming `names`; returns stderr's line."""
    rc, out, err, exc = call(main, argv)
    got = record(outcome(rc, err, exc, names, ok_rc))
    assert got == "held", f"{got}: rc={rc}\nstderr: {err[-3000:]}\nstdout: {out[-1500:]}"
    return err.strip()


def kept(before: dict, after: dict, what: str = "files of the user's") -> None:
    """The user's files after the command are the ones before it, byte for byte (else: silent)."""
    if before != after:
        record("silent")
        import pytest
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        pytest.fail(f"silent: {what} changed or went missing: {changed[:10]}")


def made_in(work, main, *argvs) -> None:
    """main(argv) for each argv, run in the directory `work`, each required to succeed (a fixture's runs)."""
    import pytest
    mp = pytest.MonkeyPatch()
    mp.chdir(work)
    try:
        for argv in argvs:
            rc, _, err, exc = call(main, argv)
            assert rc == 0 and exc is None, err
    finally:
        mp.undo()


def run_cli(*args, cwd=None, env=None, timeout=HANG_S) -> subprocess.CompletedProcess:
    """`python -m megatron_kd ARGS` as its own process; a hang (past HANG_S) comes back with returncode None."""
    e = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS / "cache")]), **(env or {})}
    try:
        return subprocess.run([sys.executable, "-m", "megatron_kd", *map(str, args)], cwd=cwd, env=e,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as t:
        return subprocess.CompletedProcess(t.cmd, None, t.stdout or "", t.stderr or "")


def proc_outcome(p, names=()) -> str:
    if p.returncode is None:
        return record("hang")
    return record(outcome(p.returncode, p.stderr, None, names))


def snapshot(path) -> dict:
    """{relative path: bytes} of every file under path (what must survive a refused or failed command)."""
    path = Path(path)
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


SMALL_ARCH = ["num_layers=1", "hidden_size=32", "ffn_hidden_size=64", "num_attention_heads=4", "num_query_groups=2",
              "make_vocab_size_divisible_by=8"]
TINY = ["train.global_batch_size=2", "train.micro_batch_size=2", "train.log_interval=1", "train.progress=false",
        "train.eval_interval=null", "train.eval_iters=1", "train.tensorboard=false", "train.lr_warmup_iters=0",
        "train.iters=1", *[f"model.{a}" for a in SMALL_ARCH], *[f"teacher.{a}" for a in SMALL_ARCH]]


def indexed(corpus, path=None, *more) -> list:
    """Overrides of a tiny run over the prepared corpus (data.path: `path`, default the alpha source)."""
    return ["data=pydoc", f"data.path={path or corpus['alpha']}", f"data.tokenizer={corpus['tokenizer']}",
            "data.seq_length=16", f"data.index_cache={corpus['dir'] / 'index'}", "data.split='90,10,0'", *TINY, *more]
