"""`megatron-kd data prepare` as a user meets it: any tokenizer's end-of-document token, every corpus format, and
probes of what goes wrong (each asserts what a careful user wants: one sentence naming the file or flag and a fix
that works, no traceback, nothing of theirs lost or replaced)."""
import contextlib
import gzip
import hashlib
import io
import json
import os
import sys

import numpy as np
import pytest

from megatron_kd.cli import data as data_cli
from megatron_kd.data import corpus
from megatron_kd.data.datasets import FileTokenizer


def run(*argv):
    """(exit code, stdout, stderr) of `megatron-kd data prepare ARGV` in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = data_cli.main(["prepare", *map(str, argv)])
    return rc, out.getvalue(), err.getvalue()


def refused(rc, out, err, *needles):
    """A refusal: exit 2, one line on stderr naming each needle, no traceback, nothing on stdout."""
    assert rc == 2 and not out, (rc, out, err)
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("megatron-kd data prepare: error: ")
    for n in needles:
        assert n in err, (n, err)
    return err


def words_tokenizer(folder, specials, eos=None, n=64):
    """A WordLevel tokenizer (w0..w{n-1} + specials) saved as folder/tokenizer.json the Hugging Face way, with a
    tokenizer_config.json naming eos when given."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    os.makedirs(folder, exist_ok=True)
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tk.save(os.path.join(folder, "tokenizer.json"))
    if eos is not None:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return str(folder)


def jsonl(path, n=40, key="text", opener=open):
    with opener(path, "wt") as f:
        for i in range(n):
            f.write(json.dumps({key: " ".join(f"w{(i * 7 + j) % 60}" for j in range(5 + i % 4))}) + "\n")
    return str(path)


def ids(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))]


def digest(*paths):
    return {str(p): hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}


# --- the end-of-document token ------------------------------------------------------------------------------------

@pytest.mark.parametrize("specials,eos,expect", [
    (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], "<|eot_id|>", "<|end_of_text|>"),  # Llama 3
    (["<|endoftext|>"], None, "<|endoftext|>"),                                                   # GPT-2, Qwen
    (["<s>", "</s>"], "</s>", "</s>"),                                                            # tokenizer_config
], ids=["llama3", "gpt2", "eos_token"])
def test_the_end_of_document_token_is_read_from_the_tokenizer(tmp_path, specials, eos, expect):
    tok = words_tokenizer(tmp_path / "tok", specials, eos)
    rc, out, err = run("--input", jsonl(tmp_path / "c.jsonl"), "--output-prefix", tmp_path / "d/c", "--tokenizer", tok)
    assert rc == 0, err
    meta = json.load(open(tmp_path / "d/c.json"))
    assert meta["eod_token"] == expect and f"ended by {expect}" in out
    docs = ids(tmp_path / "d/c")
    assert len(docs) == 40 and all(d[-1] == meta["eod_id"] for d in docs)
    assert sum(d.count(meta["eod_id"]) for d in docs) == 40
    assert not os.path.exists(tmp_path / "d/c.tokenizer.json"), "a given tokenizer is not copied"
    # training reads the same token from the same tokenizer, folder or file
    assert FileTokenizer(tok).eod == FileTokenizer(os.path.join(tok, "tokenizer.json")).eod == meta["eod_id"]


def test_a_tokenizer_without_an_end_token_is_refused_naming_the_flag_that_fixes_it(tmp_path):
    tok = words_tokenizer(tmp_path / "tok", ["<pad>", "<doc_end>"])
    c = jsonl(tmp_path / "c.jsonl")
    refused(*run("--input", c, "--output-prefix", tmp_path / "d/c", "--tokenizer", tok),
            "--eod-token TOKEN", "<doc_end>", "tokenizer.json")
    assert not os.path.exists(tmp_path / "d/c.bin")
    refused(*run("--input", c, "--output-prefix", tmp_path / "d/c", "--tokenizer", tok, "--eod-token", "<end>"),
            "'<end>' is not in the vocabulary", "<doc_end>")
    rc, out, err = run("--input", c, "--output-prefix", tmp_path / "d/c", "--tokenizer", tok, "--eod-token", "<doc_end>")
    assert rc == 0, err
    eod = json.load(open(tmp_path / "d/c.json"))["eod_id"]
    assert f"data.eod_id={eod}" in out, "the printed train command must carry the named token"
    assert all(d[-1] == eod for d in ids(tmp_path / "d/c"))


def test_a_tokenizer_path_that_is_not_one_is_refused(tmp_path):
    c = jsonl(tmp_path / "c.jsonl")
    (tmp_path / "empty").mkdir()
    refused(*run("--input", c, "--output-prefix", tmp_path / "d/c", "--tokenizer", tmp_path / "empty"),
            "has no tokenizer.json")
    (tmp_path / "bad.json").write_text("{}")
    refused(*run("--input", c, "--output-prefix", tmp_path / "d/c", "--tokenizer", tmp_path / "bad.json"),
            "is not a `tokenizers` JSON file")


# --- corpus formats -----------------------------------------------------------------------------------------------

def test_jsonl_gz_parquet_and_text_give_the_same_documents(tmp_path):
    tok = words_tokenizer(tmp_path / "tok", ["<|endoftext|>"])
    ref = jsonl(tmp_path / "c.jsonl")
    texts = [json.loads(line)["text"] for line in open(ref)]
    jsonl(tmp_path / "c.jsonl.gz", opener=gzip.open)
    jsonl(tmp_path / "gz_inside.jsonl", opener=gzip.open)  # gzipped content under a plain name
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": list(range(40)), "text": texts}), tmp_path / "c.parquet")
    (tmp_path / "c.txt").write_text("\n\n".join(texts) + "\n")
    (tmp_path / "lines.txt").write_text("\n".join(texts) + "\n")
    with gzip.open(tmp_path / "c.txt.gz", "wt") as f:
        f.write("\n\n\n".join(texts))
    want = None
    for name, extra in [("c.jsonl", []), ("c.jsonl.gz", []), ("gz_inside.jsonl", []), ("c.parquet", []),
                        ("c.txt", []), ("lines.txt", ["--text-documents", "line"]), ("c.txt.gz", [])]:
        rc, out, err = run("--input", tmp_path / name, "--output-prefix", tmp_path / "d" / name.replace(".", "_"),
                           "--tokenizer", tok, *extra)
        assert rc == 0, (name, err)
        assert f"{tmp_path / name}: 40 documents" in out
        got = ids(tmp_path / "d" / name.replace(".", "_"))
        want = want or got
        assert got == want, name


def test_several_files_in_one_corpus_keep_their_order_and_counts(tmp_path):
    tok = words_tokenizer(tmp_path / "tok", ["<|endoftext|>"])
    a, b = jsonl(tmp_path / "a.jsonl", n=30), tmp_path / "b.txt"
    b.write_text("w1 w2\nw3\n\nw4 w5\n")
    rc, out, err = run("--input", a, b, "--output-prefix", tmp_path / "d/ab", "--tokenizer", tok)
    assert rc == 0, err
    assert f"{a}: 30 documents" in out and f"{b}: 2 documents" in out
    docs = ids(tmp_path / "d/ab")
    assert len(docs) == 32 and docs[-1][:-1] == [4, 5] and docs[-2][:-1] == [1, 2, 3]


def test_text_document_rules(tmp_path):
    t = tmp_path / "t.txt"
    t.write_text("w1 w2\nw3\n\n\nw4\n  \nw5 w6\n")
    for rule, n in (("blank-line", 3), ("line", 4), ("file", 1)):
        assert len(corpus.read_documents([str(t)], text_documents=rule)) == n, rule


def test_parquet_without_pyarrow_names_the_install(tmp_path, monkeypatch):
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    refused(*run("--input", tmp_path / "c.parquet", "--output-prefix", tmp_path / "d/c"),
            str(tmp_path / "c.parquet"), "pip install 'megatron-kd[parquet]'")


def test_parquet_without_the_column_names_the_flag(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"content": ["w1 w2"] * 30}), tmp_path / "c.parquet")
    refused(*run("--input", tmp_path / "c.parquet", "--output-prefix", tmp_path / "d/c"),
            "no column 'text'", "'content'", "--json-key")
    rc, _, err = run("--input", tmp_path / "c.parquet", "--output-prefix", tmp_path / "d/c", "--json-key", "content",
                     "--vocab-size", "300")
    assert rc == 0, err


@pytest.mark.parametrize("name,content,needles", [
    ("c.bin", b"\x00\x01", ["c.bin", "unknown corpus format", "Parquet", ".txt"]),
    ("c.txt", b"w1 \xb0\xff w2", ["c.txt", "line 1 is not UTF-8", "Parquet"]),
    ("c.jsonl.gz", b"\x1f\x8b\x08\x00broken", ["c.jsonl.gz", "cannot be read", "gzipped"]),
    ("c.parquet", b"not parquet at all", ["c.parquet", "not a readable Parquet file"]),
    ("c.jsonl", b'{"text": 5}\n', ["c.jsonl", "line 1", "'text' is a JSON int, not a string"]),
    ("c.jsonl", b'{"text": "w1"}\n["w1", "w2"]\n', ["c.jsonl", "line 2 is a JSON list"]),
    ("c.jsonl", b'{"text": "w1"}\n{"text": "w2"\n', ["c.jsonl", "line 2 is not JSON"]),
    ("c.jsonl", b'{"body": "w1"}\n', ["line 1 has no 'text' key", "'body'", "--json-key KEY"]),
], ids=["unknown", "binary_txt", "broken_gz", "not_parquet", "text_is_a_number", "line_is_an_array",
        "broken_json", "other_key"])
def test_bad_corpus_files_are_refused_naming_file_and_fix(tmp_path, name, content, needles):
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    (tmp_path / name).write_bytes(content)
    refused(*run("--input", tmp_path / name, "--output-prefix", tmp_path / "d/c"), *needles)
    assert not os.path.exists(tmp_path / "d/c.bin")


def test_missing_or_folder_inputs_are_refused_before_reading_any(tmp_path):
    a = jsonl(tmp_path / "a.jsonl")
    refused(*run("--input", a, tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "d/c"), "nope.jsonl: no such file")
    refused(*run("--input", tmp_path, "--output-prefix", tmp_path / "d/c"), "is a folder")


# --- too few documents for the split --------------------------------------------------------------------------

def test_a_text_that_is_one_document_is_refused_with_its_count_and_a_fix_that_works(tmp_path):
    t = tmp_path / "book.txt"
    t.write_text("".join(f"w{i % 60} w{(i * 3) % 60} w5\n" for i in range(50)))  # no blank line: one document
    err = refused(*run("--input", t, "--output-prefix", tmp_path / "d/b", "--vocab-size", "300"),
                  "1 document found", "split 95,5,0", "valid part 0", "--text-documents line", "--split")
    assert not os.listdir(tmp_path / "d") or os.listdir(tmp_path / "d") == [".b.prepare.lock"]
    rc, out, err = run("--input", t, "--output-prefix", tmp_path / "d/b", "--vocab-size", "300",
                       "--text-documents", "line")
    assert rc == 0, err
    assert "50 documents (train/valid/test 48/2/- at split 95,5,0)" in out


def test_split_counts_follow_megatron_cores_builder():
    # megatron-core's builder: part i holds documents [round(lo_i x N), round(hi_i x N))
    assert corpus.split_documents(40, "95,5,0") == [38, 2, None]
    assert corpus.split_documents(499, "969,30,1") == [484, 15, 0]
    assert corpus.split_documents(1, "100,0,0") == [1, None, None]
    corpus.check_split(1, "100,0,0")
    with pytest.raises(corpus.CorpusError, match="test part 0"):
        corpus.check_split(400, "969,30,1")
    with pytest.raises(corpus.CorpusError, match="three non-negative weights"):
        corpus.split_documents(10, "a,b")


def test_another_split_is_carried_into_the_printed_train_command(tmp_path):
    rc, out, err = run("--input", jsonl(tmp_path / "c.jsonl", n=3), "--output-prefix", tmp_path / "d/c",
                       "--vocab-size", "300", "--split", "100,0,0")
    assert rc == 0, err
    assert "data.split=100,0,0" in out and "3/-/-" in out


# --- several prefixes, concurrency, overwrite ---------------------------------------------------------------------

def test_two_datasets_in_one_folder_each_keep_their_tokenizer(tmp_path):
    a, b = jsonl(tmp_path / "a.jsonl"), jsonl(tmp_path / "b.jsonl", n=50)
    assert run("--input", a, "--output-prefix", tmp_path / "d/a", "--vocab-size", "300")[0] == 0
    kept = digest(*(tmp_path / f"d/a{x}" for x in (".bin", ".idx", ".json", ".tokenizer.json")))
    rc, out, err = run("--input", b, "--output-prefix", tmp_path / "d/b", "--vocab-size", "280")
    assert rc == 0, err
    assert f"data.tokenizer={tmp_path / 'd/b.tokenizer.json'}" in out
    # --overwrite of b rewrites b alone
    rc, _, err = run("--input", a, "--output-prefix", tmp_path / "d/b", "--vocab-size", "260", "--overwrite")
    assert rc == 0, err
    assert digest(*kept) == kept
    assert FileTokenizer(str(tmp_path / "d/b.tokenizer.json")).vocab_size == 260
    assert FileTokenizer(str(tmp_path / "d/a.tokenizer.json")).vocab_size == 300


def test_existing_outputs_are_kept_without_overwrite(tmp_path):
    a = jsonl(tmp_path / "a.jsonl")
    assert run("--input", a, "--output-prefix", tmp_path / "d/a", "--vocab-size", "300")[0] == 0
    kept = digest(*(tmp_path / f"d/a{x}" for x in (".bin", ".idx", ".json", ".tokenizer.json")))
    refused(*run("--input", a, "--output-prefix", tmp_path / "d/a", "--vocab-size", "280"), "--overwrite",
            "another --output-prefix")
    assert digest(*kept) == kept


def test_a_second_prepare_of_the_same_prefix_is_locked_out(tmp_path):
    a = jsonl(tmp_path / "a.jsonl")
    os.makedirs(tmp_path / "d")
    with corpus._prefix_lock(str(tmp_path / "d/a")):  # as a first prepare holds it while it writes
        refused(*run("--input", a, "--output-prefix", tmp_path / "d/a", "--vocab-size", "300"),
                "another data prepare is writing", "wait for it")
        assert sorted(os.listdir(tmp_path / "d")) == [".a.prepare.lock"]
    assert run("--input", a, "--output-prefix", tmp_path / "d/a", "--vocab-size", "300")[0] == 0


def test_concurrent_prepares_of_one_prefix_leave_one_whole_dataset(tmp_path):
    import subprocess
    a = jsonl(tmp_path / "a.jsonl", n=400)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    cmd = [sys.executable, "-m", "megatron_kd", "data", "prepare", "--input", a, "--output-prefix",
           str(tmp_path / "d/a"), "--vocab-size", "300"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    res = [(p.wait(), *p.communicate()) for p in procs]
    assert sorted(r[0] for r in res) == [0, 2], res
    loser = next(r for r in res if r[0] == 2)
    assert "Traceback" not in loser[2] and ("another data prepare" in loser[2] or "already exist" in loser[2])
    assert len(ids(tmp_path / "d/a")) == 400


def test_an_interrupted_overwrite_leaves_the_previous_outputs(tmp_path, monkeypatch):
    a = jsonl(tmp_path / "a.jsonl")
    assert run("--input", a, "--output-prefix", tmp_path / "d/a", "--vocab-size", "300")[0] == 0
    kept = digest(*(tmp_path / f"d/a{x}" for x in (".bin", ".idx", ".json", ".tokenizer.json")))

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus, "write_indexed", killed)
    with pytest.raises(KeyboardInterrupt):
        run("--input", a, "--output-prefix", tmp_path / "d/a", "--vocab-size", "280", "--overwrite")
    assert digest(*kept) == kept
    assert sorted(os.listdir(tmp_path / "d")) == sorted([".a.prepare.lock", *(os.path.basename(p) for p in kept)])


def test_an_output_prefix_with_an_extension_or_a_folder_is_refused(tmp_path):
    a = jsonl(tmp_path / "a.jsonl")
    refused(*run("--input", a, "--output-prefix", tmp_path / "d/a.bin"), "without .bin / .idx")
    refused(*run("--input", a, "--output-prefix", f"{tmp_path}/"), "is a folder", "corpus")
    refused(*run("--input", a, "--output-prefix", tmp_path), "is a folder")
    assert not os.path.exists(f"{tmp_path}/.bin") and not os.path.exists(tmp_path / "d")


def test_empty_inputs_are_refused(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    (tmp_path / "e.txt").write_text("  \n")
    refused(*run("--input", tmp_path / "e.jsonl", tmp_path / "e.txt", "--output-prefix", tmp_path / "d/e"),
            "every input is empty")


def test_prepared_corpus_counts_and_ids_are_consistent(tmp_path):
    """The .json summary agrees with what was written."""
    rc, _, err = run("--input", jsonl(tmp_path / "a.jsonl"), "--output-prefix", tmp_path / "d/a", "--vocab-size", "300")
    assert rc == 0, err
    meta, docs = json.load(open(tmp_path / "d/a.json")), ids(tmp_path / "d/a")
    assert meta["documents"] == len(docs) and meta["tokens"] == sum(map(len, docs))
    assert np.max([max(d) for d in docs]) < meta["vocab_size"]
