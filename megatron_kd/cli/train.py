"""`megatron-kd train`: distill a student from a Hydra recipe (offline / online / ce).

    megatron-kd train                                           # the tiny_cpu recipe
    megatron-kd train --config-name tiny_cpu kd=ce train.iters=50
    megatron-kd train --config-name RECIPE --cfg job            # print the full resolved recipe, run nothing
    megatron-kd train -m kd.cache=runs/tiny_cache kd.divergence=forward_kl,reverse_kl,jsd train.lr=1e-3,3e-3
                                                                # a sweep: 6 runs, one cache (Hydra multirun)
    NPROC_PER_NODE=2 launch/torchrun.sh train --config-name tiny_cpu parallel=tp2

A Hydra app over the recipes shipped in the package (megatron_kd/recipes/, Hydra's pkg://megatron_kd.recipes; or
$MEGATRON_KD_RECIPES; --config-path for a recipe elsewhere). Outputs go to
train.save (default: the Hydra run dir, runs/<recipe>): checkpoints, metrics.jsonl, summary.json. A run that
finds a checkpoint there resumes from it. `--cfg job` prints every key of the schema, with its default where
the recipe leaves it out; recipes/README.md documents every key. A key that is not in the schema (`kd.topk=3`)
is refused, naming the keys of its section. Hydra's own flags: --hydra-help.

-m (--multirun) runs one training per combination of the comma-separated values, one after the other, each in
its own directory hydra.sweep.dir/N (default runs/<recipe>_sweep/0, 1, ...; N: hydra.job.num), all reading one
kd.cache: it must lie outside the runs' directories (the first run builds it under kd.build_cache=true, the
others find it finished), and a run that would rebuild it is refused. `megatron-kd compare runs/<recipe>_sweep/*`
tables and plots the runs.
"""
import os
import sys

from ..recipe.targets import TargetSource

USAGE_ERROR = 2


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.rstrip())
        return 0
    from ..runtime.quiet import quiet_megatron_warnings
    quiet_megatron_warnings()
    from hydra._internal.utils import _run_hydra, get_args_parser
    from ..recipe.compose import search_path
    from ..runtime.interrupt import run_interruptible
    parser = get_args_parser()
    args = parser.parse_args(argv)
    from ..recipe.compose import sweep_refusal
    problem = (None if args.multirun else sweep_refusal(args.overrides)) or \
        preflight(args.config_name or "tiny_cpu", args.config_path, args.overrides, checks=not args.cfg)
    if not problem and args.multirun and not args.cfg:  # before Hydra writes multirun.yaml and each run's .hydra/
        problem = sweep_problem(args.config_name or "tiny_cpu", args.config_path, args.overrides)
    elif not problem and not args.cfg:  # before Hydra writes the run directory's .hydra/
        problem = save_problem(args.config_name or "tiny_cpu", args.config_path, args.overrides)
    if problem:
        print(f"megatron-kd train: error: {problem}", file=sys.stderr)
        return USAGE_ERROR
    if args.cfg:
        args.resolve = True  # print values, not interpolations
    box = {"rc": 0}
    records = HydraRecords()

    def app(cfg):
        # refused inside the run (not a RunError: no training happened), after Hydra wrote its records over the
        # earlier ones: those come back
        rc = run_config(cfg, on_refused=records.restore)
        box["rc"] = max(box["rc"], rc)  # a sweep: the worst of its runs

    def call() -> int:
        # what @hydra.main does with sys.argv, done with this argument list
        with records:
            _run_hydra(args=args, args_parser=parser, task_function=app, config_path=search_path(),
                       config_name="tiny_cpu")
        return box["rc"]
    return run_interruptible(call, "the last saved checkpoint is kept")


def preflight(name: str, config_path, overrides: list, checks: bool = True) -> str | None:
    """Why the recipe NAME (in --config-path, else the recipes) with these overrides does not compose or does not
    pass the schema, in one sentence; None when it does. A sweep is checked with the first value of each swept key.
    Hydra would otherwise print its own multi-line report (or the YAML parser's traceback) and exit 1.
    checks: also the recipe's own checks (recipe/checks.check_recipe) and its `???` values, before Hydra writes the
    run directory's .hydra/ (a refused run would replace the record of the run already there); off for --cfg,
    which prints a recipe that may run elsewhere: it is checked as `megatron-kd plan` checks one (check_recipe
    with cuda=None: what needs the machine that runs it, and the `???` values, are left to it, said on stderr).
    A model or teacher from a Hugging Face checkpoint is checked in the run, once its architecture is read from
    config.json."""
    from ..recipe.checks import check_recipe, checked_recipe, recipe_file_error, skipped_line
    from ..recipe.compose import compose, first_of_each_sweep, missing_keys, recipe_target, recipes_dir
    from ..recipe.schema import RecipeError, to_recipe
    from ..runtime.dist import use_cuda
    try:
        target = recipe_target(name, config_path)
        overrides = first_of_each_sweep(overrides)
        cfg = compose(target, overrides)
        r = checked_recipe(cfg) if checks else to_recipe(cfg)
        if not checks:
            skipped = check_recipe(r, None, None, missing_keys(cfg))
            if skipped:
                print(f"megatron-kd train: note: {skipped_line(skipped)}", file=sys.stderr)
        elif not (r.model.hf_path or r.teacher.hf_path):
            check_recipe(r, int(os.environ.get("WORLD_SIZE", "1")), use_cuda(r.train.device))
    except RecipeError as e:
        return recipe_file_error(name, config_path, overrides, recipes_dir()) or str(e)
    except Exception as e:  # noqa: BLE001  a recipe file that does not read, or an override Hydra's parser refuses
        return (recipe_file_error(name, config_path, overrides, recipes_dir())
                or (str(e).strip().splitlines() or [repr(e)])[0])
    return None


def sweep_problem(name: str, config_path, overrides: list) -> str | None:
    """-m: every run of the sweep checked as the run itself will check it (its recipe, the sweep's one cache, the
    checkpoints already in its directory), before any run starts; the first problem as one sentence naming the run, else None."""
    from ..recipe.checks import check_sweep_run, checked_recipe
    from ..recipe.compose import recipe_target, sweep_jobs
    from ..recipe.schema import RecipeError
    try:
        jobs = sweep_jobs(recipe_target(name, config_path), overrides)
    except Exception:  # noqa: BLE001  what does not compose, preflight (first values) or Hydra itself reports
        return None
    swept = [i for i in range(len(jobs[0][1])) if len({j[1][i] for j in jobs}) > 1] if jobs else []
    from ..training.resume import check_against_save
    for num, job, cfg in jobs:
        try:
            r = checked_recipe(cfg)
            check_sweep_run(r)
            check_against_save(r, r.train.save)
            run_preflight(r)
        except RecipeError as e:
            which = f" ({' '.join(job[i] for i in swept)})" if swept else ""
            return f"sweep run {num}{which}: {e}; no run of the sweep was started"
    return None


def save_problem(name: str, config_path, overrides: list) -> str | None:
    """A single run checked against the checkpoints already in its train.save (training/resume.check_against_save)
    and as the run itself checks it before any work (run_preflight), before Hydra writes the run directory's
    records; the problem in one sentence, else None."""
    from ..recipe.checks import checked_recipe
    from ..recipe.compose import recipe_target, run_job
    from ..recipe.schema import RecipeError
    from ..training.resume import check_against_save
    try:
        cfg = run_job(recipe_target(name, config_path), overrides)
    except Exception:  # noqa: BLE001  what does not compose, preflight or Hydra itself reports
        return None
    try:
        r = checked_recipe(cfg)
        check_against_save(r, r.train.save)
        run_preflight(r)
    except RecipeError as e:
        return str(e)
    return None


def run_preflight(r) -> None:
    """What training.loop.run refuses before any work (training/preflight: the Hugging Face checkpoints, the
    recipe's checks with their architecture, the tokenizer, the corpus, the checkpoints loaded as weights), checked
    before Hydra writes the run directory's .hydra/: a refusal there would replace the records of the run already
    in it. On a copy: the preflight fills in the architecture of a Hugging Face checkpoint."""
    import copy
    from ..runtime.dist import use_cuda
    from ..training.preflight import preflight
    r = copy.deepcopy(r)
    preflight(r, int(os.environ.get("WORLD_SIZE", "1")), use_cuda(r.train.device))


class HydraRecords:
    """The files Hydra writes into a run's directory before the run starts (.hydra/config.yaml, hydra.yaml,
    overrides.yaml), as they were before: a run refused inside training (a check that needs the process group,
    the cache or the model) gives the earlier run's records back instead of leaving its own refused values in them.
    Most refusals come before Hydra writes (preflight, save_problem, sweep_problem); this covers the rest."""

    def __init__(self):
        self.before = {}  # path -> its bytes before this command wrote it (None: it did not exist)

    def __enter__(self):
        from hydra.core import utils
        self.real, module = utils._save_config, utils

        def save_config(cfg, filename, output_dir):
            path = os.path.join(str(output_dir), filename)
            if path not in self.before:
                self.before[path] = open(path, "rb").read() if os.path.isfile(path) else None
            self.real(cfg, filename, output_dir)
        module._save_config = save_config
        return self

    def __exit__(self, *exc):
        from hydra.core import utils
        utils._save_config = self.real

    def restore(self, cfg) -> None:
        """The records of the run `cfg` (Hydra's current job) as they were before it (write beside, then swap)."""
        from hydra.core.hydra_config import HydraConfig
        out = os.path.join(os.path.abspath(HydraConfig.get().runtime.output_dir), "")
        for path, old in self.before.items():
            if not os.path.abspath(path).startswith(out):
                continue
            if old is None:
                if os.path.isfile(path):
                    os.remove(path)
                if os.path.isdir(os.path.dirname(path)) and not os.listdir(os.path.dirname(path)):
                    os.rmdir(os.path.dirname(path))
                continue
            tmp = f"{path}.restore-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(old)
            os.replace(tmp, path)


def run_config(cfg, on_refused=None) -> int:
    """Train from a composed recipe; a recipe problem prints one line naming the key and returns 2.
    on_refused(cfg): called when the run was refused before it trained (a RecipeError that is not a RunError)."""
    from omegaconf import OmegaConf, open_dict
    from ..recipe.schema import RecipeError, RunError
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    try:
        # a sweep's runs each get their own directory (hydra.sweep.dir/N), also where the recipe's train.save
        # is the single-run default (hydra.run.dir, one directory for every run)
        if cfg.train.get("save") is None or (sweep and cfg.train.save == hc.run.dir):
            with open_dict(cfg):
                cfg.train.save = hc.runtime.output_dir
        OmegaConf.resolve(cfg)
        from ..recipe.checks import check_sweep_run, checked_recipe
        recipe = checked_recipe(cfg)
        if sweep:
            given = " ".join(o.lstrip("+") for o in hc.overrides.task)
            print(f"megatron-kd train: sweep run {hc.job.num}: {given} -> {recipe.train.save}", flush=True)
            check_sweep_run(recipe)
        from ..training.loop import run
        summary = run(recipe, recipe.train.save)
    except RecipeError as e:
        print(f"megatron-kd train: error: {e}", file=sys.stderr)
        if on_refused is not None and not isinstance(e, RunError):
            on_refused(cfg)
        return USAGE_ERROR
    from ..runtime.dist import is_rank0
    if is_rank0():
        print(summary_line(summary))
    return 0


def summary_line(s: dict) -> str:
    if s["iteration"] > s["iters"]:
        return (f"megatron-kd train: nothing trained: {s['save']} already holds iteration {s['iteration']}, past "
                f"train.iters={s['iters']}. A shorter run needs its own train.save (train.pretrained={s['save']} "
                "train.save=NEW_DIR starts one from these weights); raise train.iters to train on")
    if not s.get("step_s") and s["iteration"] == s["iters"]:
        return (f"megatron-kd train: nothing to do: {s['save']} already holds the finished run "
                f"({s['iters']} iterations); raise train.iters to train on, or use another train.save")
    parts = [f"done: {s['iteration']}/{s['iters']} iterations ({s['mode']})"]
    if s.get("loss") is not None:
        parts.append(f"train loss {s['loss']:.4f}")
    for k, v in (s.get("eval") or {}).items():
        parts.append(f"eval {k} {v:.4f}")
    if TargetSource.of(s).reads_cache and s.get("eval") and "kl" not in s["eval"]:
        parts.append("eval kl: not computed (offline runs hold no teacher and the cache covers training samples "
                     "only; `megatron-kd demo` compares held-out KL)")
    if s.get("tokens_per_s"):
        parts.append(f"{s['tokens_per_s']:.0f} tokens/s, {s['tflops_per_gpu']:.3g} TFLOP/s per device, "
                     f"peak {s['peak_mem_gib']:.2f} GiB")
    if s.get("export_hf"):
        parts.append(f"the student as a Hugging Face checkpoint in {s['export_hf']}")
    return "megatron-kd train: " + "; ".join(parts) + f"; outputs in {s['save']}"
