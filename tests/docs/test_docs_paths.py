"""README.md and docs/*.md stay true: every repository file path they name exists, and every `megatron-kd ...`
command they show parses: its subcommand's argparse accepts the flags (parsing stops there, nothing runs), and the
Hydra overrides of a recipe compose into the schema (recipe keys that exist, groups that exist)."""
import argparse
import glob
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# Top-level folders of the repository: a path starting with one of these names a file of the checkout; other
# paths in the docs (runs/demo/..., data/mine, /models/...) are the user's outputs or inputs.
REPO_DIRS = ("megatron_kd", "tests", "docs", "benchmarks", "recipes", "launch", "docker", ".ci")
# Where a relative path may be anchored: the repository root, the document's folder, benchmarks/ (its results/).
ANCHORS = (ROOT, ROOT / "docs", ROOT / "benchmarks")
PATH_RE = re.compile(r"(?<![\w./$-])((?:\.?[\w-]+/)+[\w.*{},\[\]-]*[\w*}\]/])")
# Command placeholders the docs use, and a value of the right type for each.
PLACEHOLDERS = {"RECIPE": "tiny_cpu", "R": "tiny_cpu", "N": "4", "P": "0.9", "K": "8", "V": "1000", "T": "2.0",
                "G": "8", "FORMAT": "fp8", "EXTRA": "quant", "IMAGE": "image:tag"}


def _expand_braces(path: str) -> list:
    """a{b,c} -> ab, ac; a[b] (an optional part) -> a, ab."""
    m = re.search(r"\[([^\[\]]*)\]", path)
    if m:
        return _expand_braces(path[:m.start()] + path[m.end():]) + _expand_braces(path[:m.start()] + m.group(1)
                                                                                    + path[m.end():])
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand_braces(path[:m.start()] + alt + path[m.end():])]


def doc_paths(text: str) -> list:
    out = []
    for m in PATH_RE.finditer(text):
        p = m.group(1).rstrip(".,")
        while p.endswith("]") and p.count("]") > p.count("["):  # a Markdown link's [text] around the path
            p = p[:-1]
        first = p.split("/", 1)[0]
        if first in REPO_DIRS or (first == "results" and "/" in p):
            if re.search(r"<|(^|/)[A-Z_]{1,}(/|$|\.)(?!md)", p):  # a placeholder: tests/<folder>/, X.json, NNNNNN.bin
                continue
            out.append(p)
    # Markdown links to files, relative to the document: [loss.md](loss.md)
    out += [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if not re.match(r"[a-z]+:", t)]
    return sorted(set(out))


def path_exists(p: str, doc: Path) -> bool:
    for q in _expand_braces(p):
        if not any(glob.glob(str(a / q)) for a in (doc.parent, *ANCHORS)):
            return False
    return True


def _logical_lines(text: str):
    """(command text, shown in part) of code lines with their backslash continuations joined, the first lines of
    fenced synopses, and inline `...` spans."""
    lines, buf, fenced = [], "", False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:  # a synopsis block: its first line of each command, its flags checked (an excerpt)
            if line.startswith("megatron-kd "):
                lines.append((line.split("  #")[0], True))
            continue
        if line.startswith("    ") or line.startswith("\t"):
            s = line.strip()
            if s.endswith("\\"):
                buf += s[:-1] + " "
                continue
            lines.append((buf + s, False))
            buf = ""
        else:
            if buf:
                lines.append((buf, False))
                buf = ""
            lines += [(c, True) for c in re.findall(r"`(megatron-kd [^`]+)`", line)]
    return lines


def doc_commands(text: str) -> list:
    common = dict(re.findall(r'^\s*([A-Z_]+)="([^"]*)"', text.replace("\\\n", " "), re.M))
    cmds = []
    for line, inline in _logical_lines(text):
        line = re.sub(r"^\$ |^time\s+", "", line.strip())
        if not line.startswith("megatron-kd ") or line.split()[1].endswith(":"):  # not a command's own output
            continue
        line = re.split(r"\s+#|\s\||\s&&|\s2>|\s>", line)[0]  # comments, pipes, redirections
        for name, value in common.items():
            line = line.replace(f"${name}", value)
        cmds.append(line + (" ..." if inline and not line.endswith("...") else ""))
    return sorted(set(cmds))


class Parsed(Exception):
    def __init__(self, ns):
        self.ns = ns


def _tokens(cmd: str) -> list:
    out = []
    for t in shlex.split(cmd)[1:]:
        t = t if "=" in t else t.strip("[]")  # [--flag VALUE]: an optional part, shown with its placeholders
        if t in ("", "...", "overrides"):
            continue
        out.append("x" if t.startswith("$") else PLACEHOLDERS.get(t, t))
    return out


class Refused(Exception):
    pass


def check_command(cmd: str, monkeypatch) -> str | None:
    """None when the command parses and its recipe overrides compose; else why not. A command shown in part
    (ending in `...`: an inline mention or an excerpt) may leave out required arguments; its flags must exist."""
    from megatron_kd.cli import main as cli_main
    argv = _tokens(cmd)
    excerpt = cmd.endswith("...")
    if not argv or argv[0] in ("-h", "--help"):
        return None
    if argv[0] not in cli_main.COMMANDS:
        return f"unknown subcommand {argv[0]!r}"
    if "--help" in argv or "-h" in argv:
        return None
    real = {m: getattr(argparse.ArgumentParser, m) for m in ("parse_args", "parse_intermixed_args", "error")}

    def stopper(method):
        def stop(self, *a, **kw):
            raise Parsed(real[method](self, *a, **kw))
        return stop

    def error(self, message):
        raise Refused(message)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stopper("parse_args"))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_intermixed_args", stopper("parse_intermixed_args"))
    monkeypatch.setattr(argparse.ArgumentParser, "error", error)
    try:
        cli_main.main(argv)
    except Parsed as p:
        ns = p.ns
    except Refused as e:
        if excerpt and str(e).startswith("the following arguments are required"):
            return None
        return f"argparse refused it: {e}"
    else:
        return "no argument parser was reached"
    finally:
        for m, f in real.items():
            monkeypatch.setattr(argparse.ArgumentParser, m, f)
    overrides = [o for o in getattr(ns, "overrides", None) or [] if "=" in o]
    recipe = getattr(ns, "config_name", None) or getattr(ns, "recipe", None)
    if argv[0] == "train":
        recipe = recipe or "tiny_cpu"
    if recipe and recipe in {r.stem for r in (ROOT / "megatron_kd/recipes").glob("*.yaml")}:
        from megatron_kd.cli.train import preflight
        ov = [o for o in overrides if not re.search(r"^[A-Z_]+=|=[A-Z_]+$|=\.\.\.$", o)]  # KEY=VALUE, data.path=...
        return preflight(recipe, None, ov, checks=False)
    return None


PATH_CASES = [(d, p) for d in DOCS for p in doc_paths(d.read_text())]
COMMAND_CASES = [(d, c) for d in DOCS for c in doc_commands(d.read_text())]
# Commands a document shows failing on purpose (a transcript of the error a user sees).
SHOWN_FAILING = {"megatron-kd train --config-name nope", "megatron-kd train train.iters=abc",
                 "megatron-kd train trian.iters=5"}


@pytest.mark.parametrize("doc,path", PATH_CASES, ids=[f"{d.name}:{p}" for d, p in PATH_CASES])
def test_named_path_exists(doc, path):
    assert path_exists(path, doc), f"{doc.relative_to(ROOT)} names {path}, which is not in the repository"


@pytest.mark.parametrize("doc,cmd", COMMAND_CASES, ids=[f"{d.name}:{c[:60]}" for d, c in COMMAND_CASES])
def test_named_command_parses(doc, cmd, monkeypatch):
    if cmd in SHOWN_FAILING:
        pytest.skip("shown failing on purpose")
    problem = check_command(cmd, monkeypatch)
    assert problem is None, f"{doc.relative_to(ROOT)}: `{cmd}`: {problem}"


def test_the_checks_see_the_docs():
    assert len(PATH_CASES) > 50 and len(COMMAND_CASES) > 20
    readme = ROOT / "README.md"
    assert any(c.startswith("megatron-kd demo") for d, c in COMMAND_CASES if d == readme)


def test_a_broken_path_and_a_broken_command_fail(tmp_path, monkeypatch):
    doc = tmp_path / "x.md"
    text = ("See `megatron_kd/cache/no_such_file.py` and docs/guide.md.\n\n"
            "    megatron-kd cache build --out c --no-such-flag\n"
            "    megatron-kd train --config-name tiny_cpu kd.no_such_key=1\n"
            "    megatron-kd train --config-name tiny_cpu kd.top_k=4\n")
    doc.write_text(text)
    paths = doc_paths(text)
    assert paths == ["docs/guide.md", "megatron_kd/cache/no_such_file.py"]
    assert [path_exists(p, doc) for p in paths] == [True, False]
    cmds = doc_commands(text)
    results = {c: check_command(c, monkeypatch) for c in cmds}
    assert "--no-such-flag" in results["megatron-kd cache build --out c --no-such-flag"]
    assert "no_such_key" in results["megatron-kd train --config-name tiny_cpu kd.no_such_key=1"]
    assert results["megatron-kd train --config-name tiny_cpu kd.top_k=4"] is None


def readme_block(name: str) -> list:
    """The command lines of README's fenced block after <!-- ci:NAME --> (what .ci/run reads and runs)."""
    lines, armed, inside = [], False, False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line == f"<!-- ci:{name} -->":
            armed = True
        elif armed and line.startswith("```"):
            if inside:
                break
            inside = True
        elif inside:
            lines.append(line)
    return lines


def test_readme_has_the_commands_ci_runs():
    """CI runs README's own set-up and test commands: every block .ci/run reads (readme_block NAME) is in README;
    a .ci/run that names its pytest commands itself finds each in README's Test section."""
    ci = (ROOT / ".ci" / "run").read_text()
    names = re.findall(r"readme_block ([\w-]+)", ci)
    if names:
        empty = [n for n in names if not readme_block(n)]
        assert not empty, f"README.md has no command block after <!-- ci:NAME --> for {empty}"
        assert any("pytest" in line for line in readme_block("test"))
        return
    runs = [line.split("-m pytest", 1)[1].strip() for line in ci.splitlines()
            if "-m pytest" in line and not line.lstrip().startswith("#")]
    assert runs, ".ci/run runs no pytest command"
    section = (ROOT / "README.md").read_text().split("\n## Test", 1)[1].split("\n## ", 1)[0]
    shown = [line.split("-m pytest", 1)[1].strip() for line in section.splitlines() if "-m pytest" in line]
    missing = [r for r in runs if r not in shown]
    assert not missing, f"README's Test section lacks the pytest command(s) .ci/run runs: {missing}"

