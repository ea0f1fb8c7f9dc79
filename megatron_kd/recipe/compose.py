"""Where recipes live, which names refer to one, and how one is composed: the `megatron-kd train` app, plan,
launch, the demo and tests all compose through Hydra with the schema registered here.

Recipes ship inside the package (megatron_kd/recipes/, Hydra's `pkg://megatron_kd.recipes`), so a wheel finds them
as a checkout does; $MEGATRON_KD_RECIPES names another directory instead. Every recipe lists `megatron_kd` first
in its defaults: the schema of recipe/schema.py as a ConfigStore node, which gives every key its default and
type, so that Hydra's struct mode refuses a key that does not exist (`kd.topk=3`) while any real key can be set
without `+`; it also holds the Hydra settings every recipe shares (run and sweep directories, no log files).
"""
import os
from pathlib import Path

RECIPES_PACKAGE = "megatron_kd.recipes"
SCHEMA_NODE = "megatron_kd"  # the ConfigStore name a recipe's defaults list starts with
SECTIONS = ("model", "teacher", "parallel", "data", "kd", "train", "quant")
# Free-form sections of the schema (any TransformerConfig field, yarn_* without the prefix): open to new keys.
OPEN_DICTS = ("megatron", "yarn")
# What every recipe shares: Hydra's run directory runs/<recipe>, a sweep's runs/<recipe>_sweep/<N>, the working
# directory left alone, and no log files (the run writes its own metrics.jsonl).
HYDRA_SETTINGS = {
    "defaults": [{"override hydra/job_logging": "none"}, {"override hydra/hydra_logging": "none"}, "_self_"],
    "hydra": {"run": {"dir": "runs/${hydra:job.config_name}"},
              "sweep": {"dir": "runs/${hydra.job.config_name}_sweep", "subdir": "${hydra.job.num}"},
              "job": {"chdir": False}},
}


def recipes_dir() -> Path:
    """$MEGATRON_KD_RECIPES, else the recipes shipped in the package."""
    env = os.environ.get("MEGATRON_KD_RECIPES")
    if env:
        return Path(env).resolve()
    from importlib import util
    return Path(util.find_spec(RECIPES_PACKAGE).origin).parent


def search_path() -> str:
    """Hydra's config path of the recipes: the package's (pkg://) unless $MEGATRON_KD_RECIPES names a directory."""
    env = os.environ.get("MEGATRON_KD_RECIPES")
    return str(Path(env).resolve()) if env else f"pkg://{RECIPES_PACKAGE}"


def config_dir(config_path: str) -> Path:
    """--config-path as a directory; Hydra's pkg://PACKAGE form names the directory of an importable package."""
    if not str(config_path).startswith("pkg://"):
        return Path(config_path)
    from importlib import util
    from .schema import RecipeError
    pkg = str(config_path)[len("pkg://"):].strip("/").replace("/", ".")
    try:
        spec = util.find_spec(pkg) if pkg else None
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError(f"--config-path {config_path}: no package {pkg!r} imports here; give the directory that "
                          "holds your recipe (--config-path DIR)")
    return Path(list(spec.submodule_search_locations)[0])


def recipe_target(name: str, config_path) -> str:
    """`--config-name NAME [--config-path DIR]` as compose() takes it: DIR/NAME.yaml, or NAME (a shipped recipe)."""
    if not config_path:
        return name
    d = config_dir(config_path)
    target = d / f"{name}.yaml"
    if str(config_path).startswith("pkg://") and not target.is_file():
        from .schema import RecipeError
        raise RecipeError(f"--config-name {name}: the package of --config-path {config_path} ({d}) holds no "
                          f"{name}.yaml (its recipes: {', '.join(known_recipes(d)) or 'none'}); a recipe of your "
                          f"own lives in a directory of its own: --config-path DIR --config-name {name}, with "
                          f"`hydra: {{searchpath: [{search_path()}]}}` in it to find the shipped group files")
    return str(target)


def recipe_file(name: str, directory: Path | None = None) -> Path | None:
    """The recipe a name refers to: the file itself for a path ending in .yaml/.yml, else DIRECTORY/NAME.yaml
    (DIRECTORY: recipes_dir()) for a bare name; None when there is none."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        return p if p.is_file() else None
    if "/" in name or "\\" in name:
        return None
    cand = Path(directory or recipes_dir()) / f"{name}.yaml"
    return cand if cand.is_file() else None


def known_recipes(directory: Path | None = None) -> list:
    d = Path(directory or recipes_dir())
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def missing_recipe(name: str, directory: Path | None = None) -> str | None:
    """None when `name` refers to a recipe (recipe_file), else the one-line error listing the known ones."""
    if recipe_file(name, directory) is not None:
        return None
    if Path(name).suffix in (".yaml", ".yml"):
        return f"recipe file {name!r} does not exist"
    d = Path(directory or recipes_dir())
    return f"no recipe {name!r} in {d}; known: {', '.join(known_recipes(d)) or 'none'}"


def missing_keys(cfg) -> list:
    """`section.key` of every value a composed recipe leaves `???` (the user must give it)."""
    from omegaconf import OmegaConf
    return [f"{sec}.{k}" for sec in cfg if sec != "hydra" and OmegaConf.is_dict(cfg[sec])
            for k in cfg[sec] if OmegaConf.is_missing(cfg[sec], k)]


def schema_node():
    """The recipe schema as Hydra composes it: every key with its type and default (`???` for a key each recipe
    states, schema.RECIPE_SETS), the free-form dicts open, and the shared Hydra settings."""
    from dataclasses import fields
    from omegaconf import OmegaConf
    from .schema import Recipe
    node = OmegaConf.structured(Recipe)
    for sec in fields(Recipe):
        for f in fields(sec.default_factory()):
            if f.metadata.get("recipe_sets"):
                node[sec.name][f.name] = "???"
            elif f.name in OPEN_DICTS:
                OmegaConf.set_struct(node[sec.name][f.name], False)
    return OmegaConf.merge(OmegaConf.create(HYDRA_SETTINGS), node)


def register_schema() -> None:
    """Store the schema in Hydra's ConfigStore under SCHEMA_NODE (once per process)."""
    from hydra.core.config_store import ConfigStore
    store = ConfigStore.instance()
    if f"{SCHEMA_NODE}.yaml" not in store.repo:
        store.store(name=SCHEMA_NODE, node=schema_node())


def first_of_each_sweep(overrides) -> list:
    """A sweep's overrides (`kd.divergence=forward_kl,jsd`) as its first run sets them, for a check before any
    run starts; other overrides as given."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    out = []
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        if o.is_sweep_override():
            out.append(f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}")
        else:
            out.append(o.input_line)
    return out


def sweep_refusal(overrides) -> str | None:
    """An override that gives several values (`kd.top_k=4,8`) outside `train -m`, in one sentence (Hydra's own
    report is several); None when there is none (or the overrides do not parse: composing reports that)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001  Hydra's parser error is reported where the recipe is composed
        return None
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            return (f"{o.input_line} gives several values, a sweep that only `megatron-kd train -m` runs (one "
                    f"training per value); give one value here, or a list as {key}=[...]")
    return None


def composition_error(e, overrides=()):
    """Hydra's or OmegaConf's exception of a recipe that does not compose, as a RecipeError of one sentence that
    names the key (and the valid keys of its section, or the valid sections) or the group option."""
    import difflib
    import re
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException
    from .schema import RecipeError, _schema_error
    # an override's error is Hydra's cause; a recipe file's is its context, the file named as "In 'NAME':"
    cause = e if isinstance(e, OmegaConfBaseException) else e.__cause__ or e.__context__
    if isinstance(cause, OmegaConfBaseException):
        found = re.match(r"In '([^']+)': ", str(e)) if cause is e.__context__ else None
        where = f"recipe file {found.group(1)}: " if found else ""
        key = getattr(cause, "full_key", None) or ""
        if isinstance(cause, ConfigKeyError) and key and "." not in key and key not in SECTIONS:
            given = [o for o in overrides if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] == key]
            close = difflib.get_close_matches(key, SECTIONS, n=1)
            hint = f" (did you mean {given[0].lstrip('+~').replace(key, close[0], 1)}?)" if close and given else ""
            what = f"{given[0]!r} names" if given else f"the key {key!r} names"
            return RecipeError(f"{where}{what} no recipe section: {key!r} is none of {', '.join(SECTIONS)}{hint}")
        return RecipeError(f"{where}{_schema_error(cause)}")
    options = getattr(e, "options", None)
    text = str(e).split("\nConfig search path", 1)[0].split("\nAvailable options", 1)[0]
    text = "; ".join(line.strip().rstrip(".") for line in text.splitlines() if line.strip())
    if options:
        text += f"; the options are {', '.join(options)}"
    return RecipeError(f"recipe: {text}")


def compose(name: str = "tiny_cpu", overrides=(), save: str | None = None):
    """The recipe `name` (a recipe name or a .yaml path) with Hydra overrides, as `megatron-kd train --config-name
    name ...` sees it; a recipe or override that does not compose raises RecipeError (one sentence).

    train.save defaults to runs/<name> (the app's hydra.run.dir) since there is no Hydra run here.
    """
    import yaml
    from hydra import compose as hydra_compose
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException
    from .schema import RecipeError
    overrides = list(overrides)
    problem = missing_recipe(name) or sweep_refusal(overrides)
    if problem:
        raise RecipeError(problem)
    cfg_name, context = _hydra_context(name)
    try:
        with context:
            cfg = hydra_compose(config_name=cfg_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as e:
        err = composition_error(e, overrides)
        raise RecipeError(f"{err}{search_path_hint(name, str(e))}") from None
    if "train" in cfg and (save is not None or not any(o.split("=", 1)[0].lstrip("+") == "train.save"
                                                      for o in overrides)):
        with open_dict(cfg):
            cfg.train.save = save or f"runs/{cfg_name}"
    OmegaConf.resolve(cfg)
    return cfg


def search_path_hint(name: str, error: str) -> str:
    """A recipe file outside the recipes' directory that names a shipped group option Hydra could not find (its
    `hydra.searchpath` line is missing): the line to add, as a clause; '' otherwise."""
    import re
    found = re.search(r"Could not find '([\w-]+)/([\w.-]+)'", error)
    path = Path(name)
    if not found or path.suffix not in (".yaml", ".yml") or path.resolve().parent == recipes_dir():
        return ""
    group, option = found.groups()
    if not (recipes_dir() / group / f"{option}.yaml").is_file():
        return ""
    return (f"; {group}/{option} is a group file of the shipped recipes, which a recipe elsewhere finds through "
            f"Hydra's search path: add `hydra: {{searchpath: [{search_path()}]}}` to {name}")


def _hydra_context(name: str, job_name: str | None = None):
    """(config name, Hydra's initialize context) of the recipe `name`: a .yaml path, a name in
    $MEGATRON_KD_RECIPES, or one of the package's recipes; the schema registered."""
    from hydra import initialize_config_dir, initialize_config_module
    register_schema()
    kw = {"version_base": "1.3", **({"job_name": job_name} if job_name else {})}
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        return path.stem, initialize_config_dir(config_dir=str(path.parent.resolve()), **kw)
    if os.environ.get("MEGATRON_KD_RECIPES"):
        return name, initialize_config_dir(config_dir=str(recipes_dir()), **kw)
    return name, initialize_config_module(config_module=RECIPES_PACKAGE, **kw)


def run_job(name: str, overrides):
    """The recipe config of a single `train` run (no -m), with train.save set as the app sets it (Hydra's run
    directory where the recipe leaves it null), composed without running or writing anything."""
    from hydra import compose as hydra_compose
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict
    cfg_name, context = _hydra_context(name, "megatron-kd train")
    with context:
        cfg = hydra_compose(config_name=cfg_name, overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    hc = cfg.hydra
    job_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    with open_dict(job_cfg):
        if job_cfg.train.get("save") is None:
            job_cfg.train.save = hc.run.dir
    OmegaConf.resolve(job_cfg)
    return job_cfg


def sweep_jobs(name: str, overrides) -> list:
    """[(job number, its overrides, its recipe config with train.save set as the app sets it)] of a `train -m`
    sweep, composed as Hydra's basic sweeper will compose each run, without running or writing anything."""
    from hydra import compose as hydra_compose
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    out = []
    for num, job in enumerate(j for batch in BasicSweeper.split_arguments(parsed, None) for j in batch):
        cfg_name, context = _hydra_context(name, "megatron-kd train")
        with context:
            cfg = hydra_compose(config_name=cfg_name, overrides=[*job, f"hydra.job.num={num}"],
                                return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)  # ${hydra:...} resolves as in the run (the app sets its own)
        hc = cfg.hydra
        job_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
        with open_dict(job_cfg):
            if job_cfg.train.get("save") is None or job_cfg.train.save == hc.run.dir:
                job_cfg.train.save = os.path.join(hc.sweep.dir, str(hc.sweep.subdir))
        OmegaConf.resolve(job_cfg)
        out.append((num, [o.lstrip("+") for o in job], job_cfg))
    return out


def add_recipe_arguments(parser, target_help: str) -> None:
    """The recipe arguments of every command that takes one (plan, launch): a first word, or `--config-name NAME
    [--config-path DIR]` as `megatron-kd train` takes them; then Hydra overrides."""
    parser.add_argument("recipe", nargs="?", help=target_help)
    parser.add_argument("overrides", nargs="*", help="recipe overrides (Hydra syntax), e.g. kd.top_k=64 parallel.tp=2")
    parser.add_argument("--config-name", "-cn", help="the recipe, as `megatron-kd train --config-name` takes it")
    parser.add_argument("--config-path", "-cp", help="the directory of --config-name (default: the shipped recipes)")


def named_recipe(parser, a) -> None:
    """Set a.recipe (a recipe name or .yaml path) and a.overrides from add_recipe_arguments' arguments; argparse
    gives the first override to `recipe` when --config-name names the recipe."""
    if a.config_name:
        if a.recipe is not None:
            a.overrides.insert(0, a.recipe)
        from .schema import RecipeError
        try:
            a.recipe = recipe_target(a.config_name, a.config_path)
        except RecipeError as e:
            parser.error(str(e))
    elif a.recipe is None or a.config_path:
        parser.error("name the recipe: RECIPE (a name or a .yaml path), or --config-name NAME [--config-path DIR]")
