"""When a plan does not fit: the smallest change of recompute (then the optimizer) that makes it fit, and the one
sentence `megatron-kd plan` prints about it."""
from dataclasses import dataclass, replace

from .memory import GIB, Plan, Training, plan_memory
from .shapes import Layout, ModelShape


@dataclass
class Fix:
    recompute_layers: int | None   # full recompute of this many layers per stage (block); None: no change
    lean_adam: bool                # train.optimizer=lean_adam needed as well
    plan: Plan                     # the plan with the change


def find_fix(shape: ModelShape, layout: Layout, tr: Training, gpu_gib: float, reserve_gib: float) -> Fix | None:
    """The fewest recomputed layers that fit on this layout with the run's optimizer, else with lean_adam (12 B per
    param); None when even every layer recomputed with lean_adam does not fit (the layout needs more GPUs)."""
    per_stage = shape.num_layers // layout.pp
    now = 0 if tr.recompute != "full" else (per_stage if tr.recompute_layers is None else tr.recompute_layers)
    options = [(tr, False)]
    if tr.optimizer != "lean_adam":
        options.append((replace(tr, optimizer="lean_adam", grad_fp32=False), True))
    for base, lean in options:
        if lean:
            p = plan_memory(shape, layout, base)
            if p.fits(gpu_gib, reserve_gib):
                return Fix(None, True, p)
        for n in range(min(now + 1, per_stage), per_stage + 1):
            p = plan_memory(shape, layout, replace(base, recompute="full", recompute_layers=n))
            if p.fits(gpu_gib, reserve_gib):
                return Fix(n, lean, p)
    return None


def largest_term(p: Plan):
    """The largest static / activation item of a plan (what to name in a refusal)."""
    return max((i for i in p.items if i.group in ("static", "activations")), key=lambda i: i.bytes)


def refusal(p: Plan, fix: Fix | None, gpu_gib: float, reserve_gib: float, recipe: bool) -> str:
    """One sentence: what does not fit and the change that fits (recipe keys for a recipe, flags for a shape)."""
    big = largest_term(p)
    head = (f"does not fit: {p.peak_gib:.1f} GiB in '{p.peak_phase}' + {reserve_gib:g} GiB reserve > {gpu_gib:g} GiB "
            f"per GPU, the largest part {big.group} '{big.name}' ({big.bytes / GIB:.1f} GiB)")
    if fix is None:
        split = "parallel.cp with TE attention, parallel.tp, parallel.pp" if recipe else "--cp with TE, --tp, --pp"
        return (head + "; nothing on this layout fits, not even every layer recomputed with lean_adam: split the "
                f"sequence or the model over more GPUs ({split})")
    keys = []
    if fix.recompute_layers is not None:
        keys += (["model.recompute_granularity=full", "model.recompute_method=block",
                  f"model.recompute_num_layers={fix.recompute_layers}"] if recipe else
                 ["--recompute full", f"--recompute-layers {fix.recompute_layers}"])
    if fix.lean_adam:
        keys.append("train.optimizer=lean_adam" if recipe else "--lean-adam")
    return head + f"; fix: {' '.join(keys)} (planned {fix.plan.peak_gib:.1f} GiB)"
