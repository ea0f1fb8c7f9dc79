"""`megatron-kd train`: distill a student from a Hydra recipe (offline / online / ce).

    megatron-kd train                                           # recipes/tiny_cpu.yaml
    megatron-kd train --config-name tiny_cpu kd=ce train.iters=50
    megatron-kd train --config-name RECIPE --cfg job            # print the resolved config, run nothing
    NPROC_PER_NODE=2 launch/torchrun.sh train --config-name tiny_cpu parallel=tp2

A Hydra app over recipes/ (or $MEGATRON_KD_RECIPES; --config-path for a recipe elsewhere). Outputs go to
train.save (default: the Hydra run dir, runs/<recipe>): checkpoints, metrics.jsonl, summary.json. A run that
finds a checkpoint there resumes from it. recipes/README.md documents every key.
"""
import sys

from ..megatron import quiet_megatron_warnings
from ..megatron.recipes import recipes_dir, schema_overrides

USAGE_ERROR = 2


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_megatron_warnings()
    if any(a == "--cfg" or a.startswith("--cfg=") or a == "-c" for a in argv) and "--resolve" not in argv:
        argv.append("--resolve")  # print values, not interpolations
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
    import hydra

    box = {"rc": 0}

    @hydra.main(config_path=str(recipes_dir()), config_name="tiny_cpu", version_base="1.3")
    def app(cfg):
        box["rc"] = run_config(cfg)

    saved = sys.argv
    sys.argv = ["megatron-kd train"] + schema_overrides(argv)
    try:
        app()
    finally:
        sys.argv = saved
    return box["rc"]


def run_config(cfg) -> int:
    """Train from a composed recipe; a recipe problem prints one line naming the key and returns 2."""
    from omegaconf import OmegaConf, open_dict
    from ..megatron.config import RecipeError, to_recipe
    try:
        if cfg.train.get("save") is None:
            from hydra.core.hydra_config import HydraConfig
            with open_dict(cfg):
                cfg.train.save = HydraConfig.get().runtime.output_dir
        OmegaConf.resolve(cfg)
        recipe = to_recipe(cfg)
        from ..megatron.train import run
        summary = run(recipe, recipe.train.save)
    except RecipeError as e:
        print(f"megatron-kd train: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    from ..megatron.dist import is_rank0
    if is_rank0():
        _print_summary(summary)
    return 0


def _print_summary(s: dict) -> None:
    parts = [f"done: {s['iteration']}/{s['iters']} iterations ({s['mode']})"]
    if s.get("loss") is not None:
        parts.append(f"train loss {s['loss']:.4f}")
    for k, v in (s.get("eval") or {}).items():
        parts.append(f"eval {k} {v:.4f}")
    if s.get("tokens_per_s"):
        parts.append(f"{s['tokens_per_s']:.0f} tokens/s, {s['tflops_per_gpu']:.3g} TFLOP/s per device, "
                     f"peak {s['peak_mem_gib']:.2f} GiB")
    print("megatron-kd train: " + "; ".join(parts) + f"; outputs in {s['save']}")
