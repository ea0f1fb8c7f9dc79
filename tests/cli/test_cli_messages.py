"""What a new user meets at the command line: fast --help with help for every flag, one-line errors
that name the fix, `--cfg job` with every schema key, the launch dry run's warnings, next-step hints."""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kd.cli import compare as compare_cli, data as data_cli, demo, export as export_cli, launch, loss_demo
from megatron_kd.cli import main as cli_main, plan
from megatron_kd.cli import train as train_cli

ROOT = Path(__file__).resolve().parents[2]
LIGHT = list(cli_main.COMMANDS)


def py(*code_and_args, env=None):
    return subprocess.run([sys.executable, *code_and_args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_help_imports_neither_torch_nor_hydra():
    """--help of every light command loads no heavy module (what made --help take 4-8 s)."""
    code = ("import sys, contextlib, io\nfrom megatron_kd.cli.main import main\n"
            f"for c in {LIGHT!r}:\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n            main([c, '--help'])\n        except SystemExit:\n            pass\n"
            "heavy = sorted(m for m in ('torch', 'hydra', 'omegaconf', 'matplotlib', 'megatron.core') "
            "if m in sys.modules)\nprint('HEAVY', heavy)\n")
    p = py("-c", code)
    assert p.returncode == 0, p.stderr
    assert "HEAVY []" in p.stdout, p.stdout


def test_package_import_is_lazy_but_topk_kl_loss_still_imports():
    p = py("-c", "import sys, megatron_kd; assert 'torch' not in sys.modules; "
                 "from megatron_kd import topk_kl_loss; assert callable(topk_kl_loss); print('ok')")
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr


@pytest.mark.parametrize("name,parser", [("demo", demo.build_parser), ("data", None), ("launch", launch.build_parser),
                                         ("plan", plan.build_parser), ("loss-demo", loss_demo.build_parser),
                                         ("compare", compare_cli.build_parser)])
def test_every_flag_has_help(name, parser):
    if parser is None:  # data's flags live on its `prepare` sub-parser
        p = data_cli.build_parser()
        parser = lambda: p._subparsers._group_actions[0].choices["prepare"]  # noqa: E731
    actions = [a for a in parser()._actions if a.option_strings and a.dest != "help"]
    assert actions and all(a.help for a in actions), [a.dest for a in actions if not a.help]


@pytest.mark.parametrize("module", [demo, data_cli, launch, loss_demo, plan, export_cli, compare_cli])
def test_help_prints_the_description_once(module, capsys):
    with pytest.raises(SystemExit):
        module.build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert out.count(module.__doc__.splitlines()[0]) == 1


def test_demo_help_states_the_run_time_and_stages(capsys):
    with pytest.raises(SystemExit):
        demo.build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "3 minutes idle, 10 at load average 8" in out and "[demo i/7 STAGE]" in out


def test_train_help_without_hydra(capsys):
    assert train_cli.main(["--help"]) == 0
    assert "--cfg job" in capsys.readouterr().out


def test_train_unknown_recipe_lists_the_recipes(capsys):
    assert train_cli.main(["--config-name", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no recipe 'nope'" in err and "tiny_cpu" in err and "gpt_oss_20b_32k_8xh200" in err


def test_train_wrong_type_is_one_line_naming_key_and_type(capsys, tmp_path):
    assert train_cli.main(["train.iters=abc", f"train.save={tmp_path}", f"hydra.run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'train.iters'" in err and "Integer" in err and "abc" in err, err


@pytest.mark.parametrize("bad", ["model.fp8=fp4", "kd.top_k=0", "kd.cache=???"])
def test_a_refused_train_leaves_the_run_directory_as_it_was(capsys, tmp_path, bad):
    """A recipe the checks refuse is refused before Hydra writes the run directory's .hydra/: the record of the
    run already there stays (a refused run used to replace it with its own recipe)."""
    record = tmp_path / ".hydra" / "config.yaml"
    record.parent.mkdir()
    record.write_text("the finished run's recipe\n")
    assert train_cli.main([bad, f"hydra.run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-kd train: error: ") and "\n" not in err, err
    assert record.read_text() == "the finished run's recipe\n"
    assert sorted(p.name for p in (tmp_path / ".hydra").iterdir()) == ["config.yaml"]


def test_cfg_job_prints_every_schema_key_and_keeps_required_ones(capsys):
    from omegaconf import OmegaConf
    from megatron_kd.recipe.schema import TrainConfig
    assert train_cli.main(["--config-name", "gpt_oss_20b_32k_8xh200", "--cfg", "job", "train.iters=7"]) == 0
    cfg = OmegaConf.create(capsys.readouterr().out)
    assert set(cfg.train) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert cfg.train.optimizer == "adam" and cfg.train.exp_avg_dtype == "bf16" and cfg.train.iters == 7
    assert OmegaConf.is_missing(cfg.data, "path") and OmegaConf.is_missing(cfg.kd, "cache")


def test_a_run_past_its_iters_says_nothing_was_trained():
    s = {"iteration": 320, "iters": 50, "save": "runs/x", "mode": "ce", "step_s": None}
    line = train_cli.summary_line(s)
    assert "320/50" not in line and "nothing trained" in line and "train.iters=50" in line
    assert "train.pretrained=runs/x" in line and "train.load" not in line  # a load would resume at 320 again
    done = train_cli.summary_line({**s, "iteration": 50})
    assert "nothing to do" in done and "finished" in done


def test_offline_summary_says_why_there_is_no_eval_kl():
    s = {"iteration": 5, "iters": 5, "save": "r", "mode": "offline", "step_s": 0.1, "loss": 1.0,
         "eval": {"ce": 4.0}, "tokens_per_s": 10.0, "tflops_per_gpu": 0.1, "peak_mem_gib": 0.5}
    assert "eval kl: not computed" in train_cli.summary_line(s)
    online = train_cli.summary_line({**s, "mode": "online", "eval": {"ce": 4.0, "kl": 1.0}})
    assert "eval kl 1.0000" in online and "not computed" not in online


def test_launch_dry_run_warns_on_layout_and_required_keys(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert launch.main(["--dry-run", "gpt_oss_20b_32k_8xh200", "--gpus-per-node", "1"]) == 0
    out = capsys.readouterr().out
    assert "data.path" in out and "kd.cache" in out and "`???`" in out
    assert "1 worker(s) do not fit" in out and "multiple of 8" in out
    ok = ["gpt_oss_20b_32k_8xh200", "--gpus-per-node", "8", "data.path=/d", "kd.cache=/c"]
    assert launch.main(["--dry-run", *ok]) == 0
    assert "warning" not in capsys.readouterr().out


def test_data_prepare_suggests_the_next_command():
    line = data_cli.next_step("out/my_text_document", "out/tokenizer.json")
    assert "megatron-kd train" in line and "data.path=out/my_text_document" in line


def test_loss_demo_says_fused_needs_a_gpu():
    p = py("-m", "megatron_kd", "loss-demo", "--tokens", "64", "--vocab", "256", "--hidden", "16", "--topk", "4",
           "--device", "cpu")
    assert p.returncode == 0, p.stderr
    fused = [line for line in p.stdout.splitlines() if line.startswith("fused")]
    assert len(fused) == 1 and "needs a CUDA GPU with Triton" in fused[0]


def test_cache_verify_of_a_run_dir_points_at_its_cache(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "manifest.json").write_text("{}")
    p = py("-m", "megatron_kd", "cache", "verify", str(tmp_path))
    assert p.returncode == 1 and f"megatron-kd cache verify {tmp_path / 'cache'}" in p.stderr, p.stderr


# --- refusals: one sentence naming the key and the fix, before any work ------------------------------------------

def assert_one_sentence(err: str) -> str:
    """stderr is one line, one sentence (no full stop before a capital inside), and no traceback."""
    line = err.strip()
    assert line and "\n" not in line and "Traceback" not in line, err
    assert not re.search(r"\w[.!?] +[A-Z]", line), line
    return line


def test_a_gpu_recipe_on_a_cpu_names_every_problem_at_once(capsys, monkeypatch, tmp_path):
    import torch
    monkeypatch.chdir(tmp_path)  # the recipe's Hydra run dir is relative: runs/<recipe>
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train_cli.main(["--config-name", "gpt_oss_20b_32k_8xh200"]) == 2
    line = assert_one_sentence(capsys.readouterr().err)
    assert "data.path" in line and "kd.cache" in line and "`???`" in line, line
    assert "train.device=cuda" in line and "no GPU" in line and "train.device=auto or cpu" in line, line


def test_a_misspelt_section_names_the_sections(capsys):
    assert train_cli.main(["trian.iters=5"]) == 2
    line = assert_one_sentence(capsys.readouterr().err)
    assert "'trian'" in line and "model, teacher, parallel, data, kd, train" in line, line
    assert "train.iters=5" in line and "+trian" not in line, line


def test_kd_impl_fused_is_refused_where_it_cannot_run(capsys, monkeypatch, tmp_path):
    args = ["kd.impl=fused", "train.iters=1", f"train.save={tmp_path}", f"hydra.run.dir={tmp_path}"]
    try:  # imported whole first, so that monkeypatch restores a triton whose submodules match it (importing it
        import triton  # noqa: F401  again beside cached triton.* leaves triton.backends unset, which torch reads)
    except ImportError:
        pass
    monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed: `import triton` raises ImportError
    assert train_cli.main(args) == 2
    line = assert_one_sentence(capsys.readouterr().err)
    assert "kd.impl=fused needs Triton" in line and "kd.impl=auto" in line, line
    monkeypatch.delitem(sys.modules, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import importlib.util
    import torch
    # Triton present (`.[kernels-cpu]`), but no GPU and no interpreter: "0 active drivers" before. Without
    # Triton installed the first half is the whole case.
    if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        assert train_cli.main(args) == 2
        line = assert_one_sentence(capsys.readouterr().err)
        assert "kd.impl=fused needs a CUDA GPU" in line and "kd.impl=auto" in line, line
    assert not list(tmp_path.glob("iter_*")), "refused before any step"


def test_topk_kl_loss_fused_without_triton_raises_valueerror(monkeypatch):
    import torch
    from megatron_kd import topk_kl_loss
    monkeypatch.setitem(sys.modules, "triton", None)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 8, generator=g), torch.randn(32, 8, generator=g)
    ids = torch.stack([torch.randperm(32, generator=g)[:3] for _ in range(4)])
    logp = torch.log_softmax(torch.randn(4, 3, generator=g), -1)
    with pytest.raises(ValueError, match='impl="fused" needs Triton.*impl="auto"'):
        topk_kl_loss(h, w, ids, logp, impl="fused")


def test_demo_checks_its_arguments_before_any_stage(capsys, tmp_path):
    out = tmp_path / "demo"
    assert demo.main(["--top-k", "0", "--out", str(out)]) == 2
    line = assert_one_sentence(capsys.readouterr().err)
    assert "--top-k" in line and "kd.top_k=0 must be >= 1" in line, line
    assert not out.exists(), "nothing was started"
    assert demo.main(["--teacher-iters", "0", "--out", str(out)]) == 2
    assert "--teacher-iters" in assert_one_sentence(capsys.readouterr().err)


@pytest.mark.slow  # two processes that import torch
def test_cache_build_hf_teacher_without_transformers(tmp_path):
    """The other arguments are checked first; then one sentence naming the package, no traceback."""
    import numpy as np
    (tmp_path / "hf").mkdir()
    np.save(tmp_path / "tokens.npy", np.zeros((2, 9), dtype=np.int64))
    code = ("import sys; sys.modules['transformers'] = None\nfrom megatron_kd.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))")
    base = ["-c", code, "cache", "build", "--out", str(tmp_path / "c"), "--teacher", f"hf:{tmp_path / 'hf'}"]
    p = py(*base)
    assert p.returncode != 0 and "--tokens" in assert_one_sentence(p.stderr), p.stderr
    p = py(*base, "--tokens", str(tmp_path / "tokens.npy"))
    line = assert_one_sentence(p.stderr)
    assert p.returncode != 0 and "--teacher hf:" in line and "pip install transformers" in line, line
    assert not (tmp_path / "c").exists()


def test_cache_progress_bar_prints_one_rate(capsys):
    from megatron_kd.teacher.progress import Progress
    bar = Progress(4, 16)
    bar.update(2)
    bar.update(2)
    bar.close()
    err = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "samples/s" in err and "tokens/s" in err and err.count("/s") == 2, err  # ours, not tqdm's as well


def test_the_printed_commands_write_floats_shortly(tmp_path):
    d = demo.Demo(str(tmp_path), demo.Settings())
    overrides = d.teacher_overrides()
    assert "train.lr=0.003" in overrides and "train.min_lr=0.0003" in overrides, overrides
