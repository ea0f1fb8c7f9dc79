"""`megatron-kd train`: distill a student from a Hydra recipe (offline / online / ce).

    megatron-kd train                                           # recipes/tiny_cpu.yaml
    megatron-kd train --config-name tiny_cpu kd=ce train.iters=50
    megatron-kd train --config-name RECIPE --cfg job            # print the full resolved recipe, run nothing
    megatron-kd train -m kd.cache=runs/tiny_cache kd.divergence=forward_kl,reverse_kl,jsd train.lr=1e-3,3e-3
                                                                # a sweep: 6 runs, one cache (Hydra multirun)
    NPROC_PER_NODE=2 launch/torchrun.sh train --config-name tiny_cpu parallel=tp2

A Hydra app over recipes/ (or $MEGATRON_KD_RECIPES; --config-path for a recipe elsewhere). Outputs go to
train.save (default: the Hydra run dir, runs/<recipe>): checkpoints, metrics.jsonl, summary.json. A run that
finds a checkpoint there resumes from it. `--cfg job` prints every key of the schema, with its default where
the recipe leaves it out; recipes/README.md documents every key. Hydra's own flags: --hydra-help.

-m (--multirun) runs one training per combination of the comma-separated values, one after the other, each in
its own directory hydra.sweep.dir/N (default runs/<recipe>_sweep/0, 1, ...; N: hydra.job.num), all reading one
kd.cache: it must lie outside the runs' directories (the first run builds it under kd.build_cache=true, the
others find it finished), and a run that would rebuild it is refused. `megatron-kd compare runs/<recipe>_sweep/*`
tables and plots the runs.
"""
import sys
from pathlib import Path

USAGE_ERROR = 2
PRINT_FLAGS = ("--cfg", "-c")


def _flag_value(argv: list, names: tuple):
    """The value of `--name VALUE` / `--name=VALUE` (last one wins), else None."""
    value = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(n + "="):
                value = a.split("=", 1)[1]
    return value


def _overrides(argv: list) -> list:
    """Hydra overrides: the words that are not flags or flag values."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a.startswith("-"):
            skip = "=" not in a and a in ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd",
                                          "--cfg", "-c", "--package", "-p")
        else:
            out.append(a)
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.rstrip())
        return 0
    from ..runtime.quiet import quiet_megatron_warnings
    from ..recipe.compose import recipes_dir, schema_overrides
    quiet_megatron_warnings()
    from ..recipe.compose import missing_recipe
    name = _flag_value(argv, ("--config-name", "-cn")) or "tiny_cpu"
    config_path = _flag_value(argv, ("--config-path", "-cp"))
    if config_path is None:
        problem = missing_recipe(name, recipes_dir())
        if problem:
            print(f"megatron-kd train: error: {problem}", file=sys.stderr)
            return USAGE_ERROR
    problem = unknown_section(_overrides(argv))
    if problem:
        print(f"megatron-kd train: error: {problem}", file=sys.stderr)
        return USAGE_ERROR
    if _flag_value(argv, PRINT_FLAGS) == "job" and "--package" not in argv and "-p" not in argv:
        return print_job(name, config_path, _overrides(argv))
    from ..recipe.checks import recipe_file_error
    problem = recipe_file_error(name, config_path, _overrides(argv), recipes_dir())
    if problem:  # before Hydra, which prints the YAML parser's traceback (and no file name for binary content)
        print(f"megatron-kd train: error: {problem}", file=sys.stderr)
        return USAGE_ERROR
    if any(a in ("-m", "--multirun") for a in argv) and not any(a in PRINT_FLAGS or a.startswith("--cfg=")
                                                               for a in argv):
        problem = sweep_problem(str(Path(config_path) / f"{name}.yaml") if config_path else name, _overrides(argv))
        if problem:  # before Hydra writes the sweep's multirun.yaml and each run's .hydra/ files
            print(f"megatron-kd train: error: {problem}", file=sys.stderr)
            return USAGE_ERROR
    if any(a in PRINT_FLAGS or a.startswith("--cfg=") for a in argv) and "--resolve" not in argv:
        argv.append("--resolve")  # print values, not interpolations
    import hydra

    box = {"rc": 0}

    @hydra.main(config_path=str(recipes_dir()), config_name="tiny_cpu", version_base="1.3")
    def app(cfg):
        box["rc"] = max(box["rc"], run_config(cfg))  # a sweep: the worst of its runs

    saved = sys.argv
    sys.argv = ["megatron-kd train"] + schema_overrides(argv)
    from ..runtime.interrupt import run_interruptible

    def call() -> int:
        app()
        return box["rc"]
    try:
        return run_interruptible(call, "the last saved checkpoint is kept")
    finally:
        sys.argv = saved


def sweep_problem(target: str, overrides: list) -> str | None:
    """-m: every run of the sweep checked as the run itself will check it (its recipe, and the sweep's one cache),
    before any run starts; the first problem as one sentence naming the run, else None."""
    from ..recipe.checks import check_sweep_run, checked_recipe
    from ..recipe.compose import sweep_jobs
    from ..recipe.schema import RecipeError
    try:
        jobs = sweep_jobs(target, overrides)
    except Exception:  # noqa: BLE001  Hydra reports an override it cannot parse or compose itself, as before
        return None
    swept = [i for i in range(len(jobs[0][1])) if len({j[1][i] for j in jobs}) > 1] if jobs else []
    for num, job, cfg in jobs:
        try:
            check_sweep_run(checked_recipe(cfg))
        except RecipeError as e:
            which = f" ({' '.join(job[i] for i in swept)})" if swept else ""
            return f"sweep run {num}{which}: {e}; no run of the sweep was started"
    return None


def unknown_section(overrides: list) -> str | None:
    """An override whose first word is no recipe section, named with the valid ones. Hydra's own answer for
    `trian.iters=5` is to append it as `+trian.iters=5`, which the schema then refuses."""
    import difflib
    from ..recipe.compose import SECTIONS
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        top = key.split(".", 1)[0].split("/", 1)[0].split("@", 1)[0]
        if top in SECTIONS or top == "hydra":
            continue
        close = difflib.get_close_matches(top, SECTIONS, n=1)
        hint = f" (did you mean {o.replace(top, close[0], 1)}?)" if close else ""
        return f"{o!r} names no recipe section: {top!r} is none of {', '.join(SECTIONS)}{hint}"
    return None


def print_job(name: str, config_path, overrides: list) -> int:
    """`--cfg job`: the recipe merged onto the schema (every key the run reads, defaults included), resolved;
    `???` marks a value the user must give. Hydra's own `--cfg job` prints only the keys the yaml files set."""
    from pathlib import Path
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from ..recipe.schema import Recipe, RecipeError, _schema_error
    from ..recipe.compose import compose
    target = str(Path(config_path) / f"{name}.yaml") if config_path else name
    try:
        cfg = compose(target, overrides)
        if "hydra" in cfg:
            cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
        try:
            merged = OmegaConf.merge(OmegaConf.structured(Recipe), cfg)
        except OmegaConfBaseException as e:
            raise _schema_error(e) from None
        _keep_missing(cfg, merged)
    except RecipeError as e:
        print(f"megatron-kd train: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    print(OmegaConf.to_yaml(merged, resolve=True), end="")
    return 0


def _keep_missing(src, dst) -> None:
    """OmegaConf's merge lets a schema default win over `???`; put the recipe's `???` back (a required value)."""
    from omegaconf import DictConfig, OmegaConf
    for k in src.keys():
        if OmegaConf.is_missing(src, k):
            dst[k] = "???"
        elif isinstance(src[k], DictConfig) and isinstance(dst.get(k), DictConfig):
            _keep_missing(src[k], dst[k])


def run_config(cfg) -> int:
    """Train from a composed recipe; a recipe problem prints one line naming the key and returns 2."""
    from omegaconf import OmegaConf, open_dict
    from ..recipe.schema import RecipeError
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
    if s["mode"] == "offline" and s.get("eval") and "kl" not in s["eval"]:
        parts.append("eval kl: not computed (offline runs hold no teacher and the cache covers training samples "
                     "only; `megatron-kd demo` compares held-out KL)")
    if s.get("tokens_per_s"):
        parts.append(f"{s['tokens_per_s']:.0f} tokens/s, {s['tflops_per_gpu']:.3g} TFLOP/s per device, "
                     f"peak {s['peak_mem_gib']:.2f} GiB")
    if s.get("export_hf"):
        parts.append(f"the student as a Hugging Face checkpoint in {s['export_hf']}")
    return "megatron-kd train: " + "; ".join(parts) + f"; outputs in {s['save']}"
