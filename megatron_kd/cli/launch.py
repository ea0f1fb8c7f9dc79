"""`megatron-kd launch`: print or run the exact command for a recipe on this node, in docker, or on Slurm.

    megatron-kd launch --dry-run llama31_8b_to_3b_32k_1xh200 kd.top_k=64
    megatron-kd launch gpt_oss_20b_32k_8xh200 --gpus-per-node 8
    megatron-kd launch --dry-run gpt_oss_20b_32k_4node_online --nodes 4 --container registry#org/megatron-kd:0.1.0

One node without --container or --slurm runs launch/torchrun.sh here; --container on one node runs the
image with docker; --nodes > 1 (or --slurm) submits launch/slurm.sbatch. The per-node torchrun line shown
under a dry run comes from launch/torchrun.sh itself (DRY_RUN=1), so what is printed is what runs. The
scripts are the checkout's launch/ folder, or, installed from a wheel, <prefix>/share/megatron-kd/launch/.
The recipe is composed first: one that does not compose, or a key the schema lacks, stops here.
"""
import argparse
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..recipe.compose import add_recipe_arguments, named_recipe

# Recipe keys that point the train command at its checkpoint directory (save and load: resume when present).
# launch/slurm.sbatch uses the same defaults (CKPT_SAVE_KEY, CKPT_LOAD_KEY).
CKPT_KEYS = ("train.save", "train.load")
# Environment handed into a docker container when set here (the NCCL / NVLS settings of the host).
PASS_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_", "CUDA_DEVICE_MAX_CONNECTIONS",
                     "HF_", "WANDB_")


@dataclass
class Plan:
    """What to run: the user-facing command, its extra environment, and notes for a dry run."""
    argv: list
    env: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def shell(self) -> str:
        prefix = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in self.env.items())
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-kd launch", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    add_recipe_arguments(p, "a shipped recipe's name (e.g. tiny_cpu) or a path to a recipe .yaml")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1; more than one submits to Slurm)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="workers per node (default: all visible GPUs locally, 8 on Slurm)")
    p.add_argument("--container", metavar="IMAGE", default=None,
                   help="image built from docker/Dockerfile: a docker tag (one node) or a pyxis image "
                        "(Slurm), e.g. registry#org/megatron-kd:0.1.0 or a .sqsh file")
    p.add_argument("--mounts", default="", help="extra mounts src:dst[,src:dst]")
    p.add_argument("--slurm", action="store_true", help="submit with sbatch even for one node")
    p.add_argument("--partition", default=None, help="Slurm partition (sbatch --partition)")
    p.add_argument("--account", default=None, help="Slurm account (sbatch --account)")
    p.add_argument("--time", default=None, help="Slurm time limit per start, e.g. 04:00:00")
    p.add_argument("--job-name", default=None, help="Slurm job name (default: the recipe name); keys the run dir")
    p.add_argument("--run-dir", default=None, help="logs and checkpoints (default: runs/<job name>)")
    return p


def launch_script(name: str) -> Path:
    """launch/NAME: in the checkout the package is imported from, else where a wheel installs it (pyproject's
    data-files: <prefix>/share/megatron-kd/launch/); a missing one exits saying where it comes from."""
    import importlib.util
    from importlib import metadata
    checkout = Path(importlib.util.find_spec("megatron_kd").origin).parent.parent / "launch" / name
    if checkout.is_file():
        return checkout
    try:
        files = metadata.distribution("megatron-kd").files or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == name and f.parent.name == "launch" and Path(f.locate()).is_file():
            return Path(f.locate()).resolve()
    raise SystemExit(f"megatron-kd launch: launch/{name} is neither in a checkout beside the package nor installed "
                     "under <prefix>/share/megatron-kd/launch; reinstall megatron-kd from its wheel or run from a "
                     "checkout of the repository")


def composed(a):
    """The recipe composed with the overrides and checked as `megatron-kd train` checks it for another machine
    (recipe/checks.check_recipe with cuda=None: the same refusal in the same sentence); a recipe that does not
    compose or that training refuses on any machine exits in one sentence before any command runs. What only the
    machine that runs it can check (its GPU, TE, files) goes to a.skipped; refusal_here checks it for this node."""
    from ..recipe.checks import check_recipe
    from ..recipe.compose import compose, missing_keys
    from ..recipe.schema import RecipeError, to_recipe
    try:
        cfg = compose(a.recipe, a.overrides, save="/dev/null")
        a.skipped = check_recipe(to_recipe(cfg), None, None, missing_keys(cfg))
    except RecipeError as e:
        raise SystemExit(f"megatron-kd launch: {e}") from None
    return cfg


def refusal_here(cfg) -> str | None:
    """For a run on this node: the sentence the recipe's own checks (recipe/checks.check_recipe, with this
    machine's GPU and Transformer Engine) refuse it with, else None. Said before torchrun starts: otherwise every
    worker prints the sentence and torchrun adds its own traceback (ChildFailedError) after it."""
    from ..recipe.checks import check_recipe
    from ..recipe.schema import RecipeError, to_recipe
    from ..runtime.dist import use_cuda
    r = to_recipe(cfg)
    try:
        check_recipe(r, None, use_cuda(r.train.device))
    except (RecipeError, RuntimeError) as e:
        return str(e)
    return None


def recipe_args(recipe: str) -> list:
    """Hydra's flags for a recipe, as launch/slurm.sbatch builds them: a path gives --config-path too."""
    if recipe.endswith((".yaml", ".yml")):
        p = Path(recipe).absolute()  # Hydra reads a relative --config-path against its own module
        return ["--config-path", str(p.parent), "--config-name", p.stem]
    return ["--config-name", recipe]


def default_run_dir(a) -> str:
    return os.path.abspath(a.run_dir or os.path.join("runs", job_name(a)))


def job_name(a) -> str:
    return a.job_name or Path(a.recipe).stem


def script(path: Path) -> str:
    """The script path as the user would type it: relative when run from the checkout."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def torchrun_line(args: list, env: dict) -> str:
    """Ask launch/torchrun.sh for the exact torchrun command it would run (DRY_RUN=1)."""
    out = subprocess.run(["bash", str(launch_script("torchrun.sh")), *args], env={**os.environ, **env, "DRY_RUN": "1"},
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def plan_local(a) -> Plan:
    env = {"NPROC_PER_NODE": str(a.gpus_per_node)} if a.gpus_per_node else {}
    targs = ["train", *recipe_args(a.recipe), *a.overrides]
    plan = Plan(["bash", script(launch_script("torchrun.sh")), *targs], env)
    plan.notes.append("which runs: " + torchrun_line(targs, env))
    return plan


def plan_docker(a) -> Plan:
    run_dir = default_run_dir(a)
    argv = ["docker", "run", "--rm", "--gpus", "all", "--ipc=host", "--ulimit", "memlock=-1",
            "--ulimit", "stack=67108864", "-v", f"{run_dir}:{run_dir}"]
    if a.recipe.endswith((".yaml", ".yml")):  # a recipe outside the image: mount its folder read-only
        d = str(Path(a.recipe).absolute().parent)
        argv += ["-v", f"{d}:{d}:ro"]
    for m in filter(None, a.mounts.split(",")):
        argv += ["-v", m]
    for k in sorted(os.environ):
        if k.startswith(PASS_ENV_PREFIXES):
            argv += ["-e", k]  # docker copies the value from this environment
    if a.gpus_per_node:
        argv += ["-e", f"NPROC_PER_NODE={a.gpus_per_node}"]
    targs = ["train", *recipe_args(a.recipe), *a.overrides, *ckpt_overrides(run_dir)]
    plan = Plan(argv + [a.container, *targs])
    plan.notes.append("the image's entrypoint runs `train` through launch/torchrun.sh (one worker per GPU)")
    return plan


def ckpt_overrides(run_dir: str) -> list:
    """Checkpoints under run_dir/checkpoints (saved and resumed from), Hydra's run dir = run_dir."""
    return [f"{k}={run_dir}/checkpoints" for k in CKPT_KEYS] + [f"hydra.run.dir={run_dir}"]


def plan_slurm(a) -> Plan:
    job, gpus, run_dir = job_name(a), a.gpus_per_node or 8, default_run_dir(a)
    recipe = str(Path(a.recipe).absolute()) if a.recipe.endswith((".yaml", ".yml")) else a.recipe
    env = {"RUN_DIR": run_dir}
    if a.container:
        env["CONTAINER_IMAGE"] = a.container
    if a.mounts:
        env["CONTAINER_MOUNTS"] = a.mounts
    argv = ["sbatch", f"--job-name={job}", f"--nodes={a.nodes}", f"--gpus-per-node={gpus}"]
    argv += [f"--{k}={v}" for k, v in (("partition", a.partition), ("account", a.account), ("time", a.time)) if v]
    plan = Plan(argv + [script(launch_script("slurm.sbatch")), recipe, *a.overrides], env)
    # What each node runs: torchrun.sh's own dry run, with the values slurm.sbatch derives there as words.
    ckpt = f"{run_dir}/checkpoints"
    targs = ["train", *recipe_args(recipe), *a.overrides, *ckpt_overrides(run_dir)]
    node_env = {"NNODES": str(a.nodes), "NPROC_PER_NODE": str(gpus), "NODE_RANK": "NODE_ID",
                "MASTER_ADDR": "FIRST_HOST", "MASTER_PORT": "JOB_PORT"}
    where = "inside the container " if a.container else ""
    plan.notes.append(f"each node then runs {where}(NODE_ID = its index, FIRST_HOST = the first host, "
                      f"JOB_PORT = 20000 + job id % 20000):")
    plan.notes.append(torchrun_line(targs, node_env))
    plan.notes.append(f"requeue-safe: checkpoints in {ckpt}; a requeued or resubmitted job named {job} resumes")
    return plan


def make_plan(a) -> Plan:
    if a.nodes < 1 or (a.gpus_per_node is not None and a.gpus_per_node < 1):
        raise SystemExit("megatron-kd launch: --nodes and --gpus-per-node must be >= 1")
    cfg = composed(a)
    if a.nodes > 1 or a.slurm:
        plan = plan_slurm(a)
        workers = a.gpus_per_node or 8
    elif a.container:
        plan = plan_docker(a)
        workers = a.gpus_per_node  # None: every GPU the container sees, unknown here
    else:
        plan = plan_local(a)
        m = re.search(r"--nproc-per-node (\d+)", plan.notes[-1])
        workers = int(m.group(1)) if m else None
    plan.notes += recipe_warnings(cfg, None if workers is None else workers * a.nodes)
    if a.skipped and (a.dry_run or a.nodes > 1 or a.slurm or a.container):  # else refusal_here checks them here
        from ..recipe.checks import skipped_line
        plan.notes.append(skipped_line(a.skipped))
    return plan


def recipe_warnings(cfg, world: int | None) -> list:
    """What the command would stop on, said before it runs: values the composed recipe leaves to the user (`???`)
    and a world size its layout does not divide into."""
    from omegaconf import OmegaConf
    from ..recipe.schema import Recipe
    from ..recipe.compose import missing_keys
    missing = missing_keys(cfg)
    par = OmegaConf.merge(OmegaConf.structured(Recipe).parallel, cfg.get("parallel", {}))
    notes = []
    if missing:
        notes.append(f"warning: required, the recipe leaves them `???`: {', '.join(missing)}; pass them as "
                     f"overrides, e.g. {' '.join(k + '=...' for k in missing)}")
    mp = par.tp * par.pp * par.cp
    unit = math.lcm(mp, (par.etp or 1) * par.ep * par.pp)
    if world is not None and world % unit:
        notes.append(f"warning: {world} worker(s) do not fit the recipe's layout (parallel.tp={par.tp} x pp={par.pp}"
                     f" x cp={par.cp}, ep={par.ep}): it needs a multiple of {unit} GPUs; pass --gpus-per-node "
                     f"(and --nodes) for the machine it will run on, or change parallel.*")
    return notes


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_intermixed_args(argv)
    named_recipe(parser, a)
    plan = make_plan(a)
    print(plan.shell())
    for note in plan.notes:
        print(f"# {note}")
    if a.dry_run:
        return 0
    if a.nodes == 1 and not (a.slurm or a.container):  # it runs here: checked here first
        why = refusal_here(composed(a))
        if why:
            print(f"megatron-kd launch: error: {why}", file=sys.stderr)
            return 2
    sys.stdout.flush()
    return subprocess.run(plan.argv, env={**os.environ, **plan.env}).returncode
