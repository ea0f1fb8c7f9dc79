"""`megatron-kd plan RECIPE_OR_SHAPE [overrides] [flags]`: predicted per-GPU peak memory of a KD layout.

    megatron-kd plan llama-3.2-3b --seq 32768
    megatron-kd plan gpt-oss-20b --seq 32768 --ep 8 --dp 8
    megatron-kd plan gpt-oss-20b --seq 32768 --search 8          # every layout of 8 GPUs, fitting ones first
    megatron-kd plan gpt-oss-20b --seq 32768 --online gpt-oss-120b --teacher-loss dense --search 8,16,32,64
    megatron-kd plan gpt_oss_20b_32k_8xh200 parallel.ep=4       # a shipped recipe, Hydra overrides
    megatron-kd plan --config-name gpt_oss_20b_32k_4node_online --gpus 32    # as `megatron-kd train` names it
    megatron-kd plan my_recipes/my_recipe.yaml --top-k 64
    megatron-kd plan llama31_8b_to_3b_32k_1xh200 --gpu h100     # another GPU kind: fits? which recipe is for it

A recipe is composed as `megatron-kd train` composes it and read as training reads it (megatron_kd.plan.recipe).
The world size is not a recipe key: --gpus gives it (default: the smallest world the layout runs on), and the
micro-batches per step are train.global_batch_size / (micro_batch_size x dp) at that size.
Flags override the recipe. The table is one rank of the worst pipeline stage; `fits` leaves RESERVE_GIB for
the CUDA context and allocator slack (torch.cuda.max_memory_allocated excludes them), on the GPU kind --gpu names
(default: the kind a recipe's name ends with, else the H200), and a line per known kind says where it fits.
"""
import argparse
import itertools
import json
import os
import sys
from dataclasses import replace

from ..plan.memory import GIB, GPU_KINDS, H200_GIB, RESERVE_GIB, Training, plan_memory
from ..plan.recipe import from_recipe, load_recipe, recipe_path
from ..recipe.compose import add_recipe_arguments, named_recipe
from ..plan.shapes import Layout, ModelShape, PRESETS, active_params, preset, total_params


def build_parser():
    p = argparse.ArgumentParser(prog="megatron-kd plan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    add_recipe_arguments(p, f"recipe name/path, or a model shape: {', '.join(PRESETS)}")
    g = p.add_argument_group("layout")
    names = {"tp": "tensor", "pp": "pipeline", "ep": "expert", "etp": "expert tensor", "cp": "context",
             "dp": "data"}
    for k, what in names.items():
        g.add_argument(f"--{k}", type=int, help=f"{what}-parallel size (default: the recipe's or shape's layout; dp from --gpus)")
    g.add_argument("--gpus", type=int, help="total GPUs (sets dp = gpus / (tp*pp*cp))")
    g.add_argument("--no-sp", action="store_true", help="sequence parallel off (default on when tp > 1)")
    t = p.add_argument_group("step")
    t.add_argument("--seq", type=int, help="tokens per sequence")
    t.add_argument("--mbs", type=int, help="micro-batch size")
    t.add_argument("--micro-batches", type=int, help="micro-batches per step per DP rank (PP in flight)")
    t.add_argument("--recompute", choices=("full", "selective", "none"), help="activation recompute granularity")
    t.add_argument("--recompute-layers", type=int, help="full recompute of only this many layers per stage")
    t.add_argument("--loss", choices=("fused", "chunked", "forward_chunked", "dense"), help="KD loss impl (kd.impl)")
    t.add_argument("--top-k", type=int, help="teacher top-K slots per position (kd.top_k)")
    t.add_argument("--online", nargs="?", const="", metavar="TEACHER",
                   help="online KD with a teacher shape in memory (default: the recipe's teacher)")
    t.add_argument("--teacher-loss", choices=("topk", "dense"), help="online: teacher top-K or dense logits")
    t.add_argument("--ce", action="store_true", help="cross-entropy only (no teacher)")
    t.add_argument("--grad-bf16", action="store_true", help="bf16 DDP grad buffer (grad_reduce_in_fp32 off)")
    t.add_argument("--no-dist-opt", action="store_true", help="no distributed optimizer")
    t.add_argument("--lean-adam", action="store_true", help="train.optimizer=lean_adam (bf16 grads, 12 B/param)")
    t.add_argument("--adam", choices=("fused", "foreach", "for_loop"), help="Adam implementation (its temporaries)")
    t.add_argument("--swiglu-fusion", action="store_true", help="Megatron's bias_activation_fusion")
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, help="override the student's depth")
    o = p.add_argument_group("output")
    o.add_argument("--gpu", choices=sorted(GPU_KINDS), type=str.lower,
                   help="the GPU kind to fit: " + ", ".join(f"{k} ({n}, {g:g} GiB usable)" for k, (n, g) in
                                                             GPU_KINDS.items())
                   + "; default: the kind a recipe's name ends with (..._1xh100), else h200")
    o.add_argument("--gpu-gib", type=float, default=None,
                   help="usable memory per GPU (default: the --gpu kind's); for a GPU plan does not know")
    o.add_argument("--reserve-gib", type=float, default=RESERVE_GIB,
                   help="left for CUDA context and allocator slack (default %(default)s)")
    o.add_argument("--stage", type=int, help="pipeline stage (default: the worst)")
    o.add_argument("--search", help="GPU counts (comma list): print every layout, fitting ones first")
    o.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def cache_disk(r) -> dict | None:
    """The disk the cache kd.build_cache writes (cache/space.py's estimate of the settings the build makes for the
    run's training samples); None for a mixture, whose sources each get a cache of their own samples."""
    from ..cache.space import estimate_bytes
    from ..data.datasets import mixture_sources, samples_needed
    from ..plan.recipe import vocab_size
    from ..teacher.build import recipe_cache_args, settings_for
    if mixture_sources(r.data):
        return None
    settings = settings_for(vocab_size(r), r.data.seq_length, samples_needed(r.train, r.data)[0],
                            **recipe_cache_args(r.kd))
    return {"path": r.kd.cache, "encoding": settings["encoding"], "top_k": settings["top_k"], **estimate_bytes(settings)}


def resolve(a):
    """(shape, layout, training) from the target and flags; recipe notes go to stderr."""
    rp, skipped = None, []
    if recipe_path(a.recipe) is not None:
        r = load_recipe(a.recipe, a.overrides, skipped)
        rp = from_recipe(r)
        shape, layout, tr, teacher = rp.shape, rp.layout, rp.training, rp.teacher
        a.cache_teacher = rp.cache_teacher
        a.cache_disk = cache_disk(r) if rp.cache_teacher is not None else None
    else:
        if a.overrides:
            raise SystemExit(f"megatron-kd plan: overrides {a.overrides} need a recipe, not a shape")
        try:
            shape = preset(a.recipe)
        except KeyError as e:
            raise SystemExit(f"megatron-kd plan: {e.args[0]} (and no recipe {a.recipe!r} among the recipes)") from None
        layout, tr, teacher = Layout(), Training(), None
    if a.layers:
        shape = shape.with_(num_layers=a.layers, name=f"{shape.name} ({a.layers} layers)")
    lk = {k: getattr(a, k) for k in ("tp", "pp", "ep", "etp", "cp", "dp") if getattr(a, k) is not None}
    layout = replace(layout, **lk)
    if a.no_sp:
        layout = replace(layout, sequence_parallel=False)
    if a.gpus:
        mp = layout.tp * layout.pp * layout.cp
        if a.gpus % mp:
            raise ValueError(f"--gpus {a.gpus} does not divide into tp x pp x cp = {mp}")
        layout = replace(layout, dp=a.gpus // mp)
    elif rp is not None and a.dp is None:
        # the world size is not a recipe key (torchrun's): take the smallest one the layout runs on
        layout = replace(layout, dp=replace(rp, layout=layout).min_world() // (layout.tp * layout.pp * layout.cp))
    if rp is not None and a.micro_batches is None:
        # micro-batches per step = global batch / (micro-batch x dp): counted once dp is final
        tr = replace(rp, training=replace(tr, micro_batch=a.mbs or tr.micro_batch)).training_for(layout)
    tk = {}
    for k, f in (("seq", "seq_len"), ("mbs", "micro_batch"), ("micro_batches", "num_microbatches"),
                 ("recompute", "recompute"), ("recompute_layers", "recompute_layers"), ("loss", "loss"),
                 ("top_k", "topk"), ("teacher_loss", "teacher_loss"), ("adam", "adam_impl")):
        if getattr(a, k) is not None:
            tk[f] = getattr(a, k)
    if a.recompute is not None and a.recompute != "full" and a.recompute_layers is None:
        tk["recompute_layers"] = None
    if a.ce:
        tk["mode"] = "ce"
    if a.online is not None:
        tk["mode"] = "online"
        tk["teacher"] = preset(a.online) if a.online else (teacher or tr.teacher)
        if tk["teacher"] is None:
            raise SystemExit("megatron-kd plan: --online needs a teacher shape (e.g. --online llama-3.1-8b)")
    if a.grad_bf16:
        tk["grad_fp32"] = False
    if a.lean_adam:
        tk.update(optimizer="lean_adam", grad_fp32=False)
    if a.no_dist_opt:
        tk["distributed_optimizer"] = False
    if a.swiglu_fusion:
        tk["swiglu_fusion"] = True
    for n in rp.notes if rp is not None else ():  # once nothing above refused the plan
        print(f"megatron-kd plan: note: {n}", file=sys.stderr)
    if skipped:
        from ..recipe.checks import skipped_line
        print(f"megatron-kd plan: note: {skipped_line(skipped)}", file=sys.stderr)
    return shape, layout, replace(tr, **tk)


def format_plan(p, gpu_gib=H200_GIB, reserve_gib=RESERVE_GIB) -> str:
    s, lay, tr = p.shape, p.layout, p.training
    rc = tr.recompute + (f" ({min(tr.recompute_layers, s.num_layers // lay.pp)} of {s.num_layers // lay.pp} layers"
                         f"{' per stage' if lay.pp > 1 else ''}, block)"
                         if tr.recompute == "full" and tr.recompute_layers is not None else "")
    mode = tr.mode + (f" (teacher {tr.teacher.name}, {tr.teacher_loss})" if tr.targets.teacher_each_step else "")
    lines = [
        f"model     {s.name}: {total_params(s) / 1e9:.3f} B params ({active_params(s) / 1e9:.3f} B active), "
        f"{s.num_layers} layers, hidden {s.hidden_size}, vocab {s.vocab_size}" + (", MoE" if s.is_moe else ""),
        f"layout    tp={lay.tp} pp={lay.pp} ep={lay.ep} etp={lay.expert_tp} cp={lay.cp} dp={lay.dp} "
        f"(world {lay.world}, sp={'on' if lay.sp else 'off'}), stage {p.stage}",
        f"step      seq {tr.seq_len} x mbs {tr.micro_batch} ({p.tokens_local} tokens/rank), {tr.num_microbatches} "
        f"micro-batches, recompute {rc}, KD {mode}, loss {tr.loss}, top-{tr.topk}",
        ("optimizer lean_adam (bf16 params + int16 master remainder, moments {} + {} B), grads bf16".format(
            *tr.moment_bytes) if tr.optimizer == "lean_adam" else
         f"optimizer Megatron {'distributed ' if tr.distributed_optimizer else ''}Adam ({tr.adam_impl}), grads "
         f"{'fp32' if tr.grad_fp32 else 'bf16'}, bf16 params + fp32 main params"),
        "",
        f"{'component':<34}{'GiB':>9}  note",
        f"{'-' * 34}{'-' * 9}  {'-' * 40}",
    ]
    for grp in ("static", "activations", "loss", "transient"):
        for it in p.items:
            if it.group == grp and (it.bytes or grp == "static"):
                lines.append(f"{grp + ': ' + it.name:<34}{it.bytes / GIB:>9.2f}  {it.note}")
    lines += ["", f"{'phase':<34}{'GiB':>9}"]
    for k, v in p.phases.items():
        lines.append(f"{k:<34}{v / GIB:>9.2f}" + ("  <- peak" if k == p.peak_phase else ""))
    fit = "fits" if p.fits(gpu_gib, reserve_gib) else "DOES NOT FIT"
    lines += ["", f"peak {p.peak_gib:.2f} GiB ({p.peak_bytes / 1e9:.1f} GB) per GPU in '{p.peak_phase}'; "
                  f"+ {reserve_gib:g} GiB reserve vs {gpu_gib:g} GiB: {fit}"]
    return "\n".join(lines)


def recipe_gpu(recipe) -> str | None:
    """The GPU kind a recipe's name ends with (llama31_8b_to_3b_32k_1xh100[_fp8] -> h100), or None."""
    import re
    stem = os.path.splitext(os.path.basename(str(recipe or "")))[0]
    m = re.search(r"_\d+x(" + "|".join(GPU_KINDS) + r")(?:_|$)", stem)
    return m.group(1) if m else None


def sibling_recipe(recipe, kind: str) -> str | None:
    """The shipped recipe of the same family made for GPU kind `kind` (the name with its _NxKIND part swapped),
    or None."""
    import re
    from ..recipe.compose import recipe_file
    stem = os.path.splitext(os.path.basename(str(recipe or "")))[0]
    other = re.sub(r"_(\d+)x(" + "|".join(GPU_KINDS) + r")(?=_|$)", lambda m: f"_{m.group(1)}x{kind}", stem)
    if other != stem and recipe_file(other) is not None:
        return other
    return None


def gpu_lines(p, reserve_gib) -> list:
    """Whether the plan fits each GPU kind plan knows, one line each."""
    return [f"  {name} ({gib:g} GiB): {'fits' if p.fits(gib, reserve_gib) else 'does not fit'}"
            for name, gib in GPU_KINDS.values()]


def layouts(shape: ModelShape, gpus: int, allow_cp: bool = False):
    """Every (tp, pp, ep, cp, dp) of `gpus` GPUs valid for `shape` (tp within a node of 8)."""
    divs = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for tp, pp in itertools.product([d for d in divs if d <= 8], divs):
        for cp in ([d for d in divs] if allow_cp else [1]):
            if gpus % (tp * pp * cp):
                continue
            dp = gpus // (tp * pp * cp)
            for ep in (divs if shape.is_moe else [1]):
                for etp in (sorted({1, tp}) if shape.is_moe else [None]):
                    lay = Layout(tp=tp, pp=pp, ep=ep, cp=cp, dp=dp, etp=etp)
                    try:
                        lay.check(shape)
                    except ValueError:
                        continue
                    yield lay


def search(shape, tr, counts, gpu_gib, reserve_gib):
    rows = []
    for n in counts:
        for lay in layouts(shape, n):
            try:
                p = plan_memory(shape, lay, tr)
            except ValueError:
                continue
            rows.append((n, lay, p))
    return rows


def _config_errors() -> tuple:
    """Hydra / OmegaConf errors of a bad recipe or override (reported like any other plan error)."""
    try:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException
        return HydraException, OmegaConfBaseException
    except ImportError:
        return ()


# flags that count something: (smallest value, what it counts)
COUNTS = {"tp": 1, "pp": 1, "ep": 1, "etp": 1, "cp": 1, "dp": 1, "gpus": 1, "seq": 1, "mbs": 1, "micro_batches": 1,
          "recompute_layers": 0, "topk": 1, "layers": 1, "stage": 0}


def count_problem(a) -> str | None:
    """A counting flag below its smallest value, or a memory size that is no positive number (None: all fine)."""
    import math
    for k, least in COUNTS.items():
        v = getattr(a, k, None)
        if v is not None and v < least:
            return f"--{k.replace('_', '-')} {v} must be >= {least}"
    if not (math.isfinite(a.gpu_gib) and a.gpu_gib > 0):
        return f"--gpu-gib {a.gpu_gib} must be a number > 0 (GiB of memory per GPU)"
    if not (math.isfinite(a.reserve_gib) and 0 <= a.reserve_gib < a.gpu_gib):
        return f"--reserve-gib {a.reserve_gib} must be in [0, --gpu-gib {a.gpu_gib})"
    return None


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_intermixed_args(argv)
    named_recipe(parser, a)
    if a.gpu is None:
        a.gpu = recipe_gpu(a.recipe) if a.gpu_gib is None else None
    if a.gpu_gib is None:
        a.gpu_gib = GPU_KINDS[a.gpu or "h200"][1]
    problem = count_problem(a)
    if problem:
        print(f"megatron-kd plan: {problem}", file=sys.stderr)
        return 2
    try:
        shape, layout, tr = resolve(a)
        if a.search:
            counts = [int(x) for x in a.search.split(",")]
            rows = search(shape, tr, counts, a.gpu_gib, a.reserve_gib)
            if a.json:
                print(json.dumps([dict(gpus=n, layout=vars(l), peak_gib=p.peak_gib, phase=p.peak_phase,
                                       fits=p.fits(a.gpu_gib, a.reserve_gib)) for n, l, p in rows], indent=1))
                return 0
            print(f"{shape.name}, seq {tr.seq_len}, KD {tr.mode}, loss {tr.loss}, recompute {tr.recompute}")
            print(f"{'gpus':>5} {'tp':>3} {'pp':>3} {'ep':>3} {'etp':>3} {'dp':>4} {'peak GiB':>9}  fits  phase")
            for n in counts:
                sub = sorted([r for r in rows if r[0] == n], key=lambda r: (not r[2].fits(a.gpu_gib, a.reserve_gib),
                                                                            r[1].tp * r[1].pp, r[2].peak_bytes))
                for _, lay, p in sub:
                    ok = "yes" if p.fits(a.gpu_gib, a.reserve_gib) else "no"
                    print(f"{n:>5} {lay.tp:>3} {lay.pp:>3} {lay.ep:>3} {lay.expert_tp:>3} {lay.dp:>4} "
                          f"{p.peak_gib:>9.1f}  {ok:<4}  "
                          f"{p.peak_phase}")
                fit = [r for r in sub if r[2].fits(a.gpu_gib, a.reserve_gib)]
                print(f"  -> {n} GPUs: " + (f"{len(fit)} layouts fit" if fit else "nothing fits"))
            return 0
        p = plan_memory(shape, layout, tr, stage=a.stage)
    except (ValueError, KeyError, FileNotFoundError, *_config_errors()) as e:
        print(f"megatron-kd plan: {e}", file=sys.stderr)
        return 2
    fits = p.fits(a.gpu_gib, a.reserve_gib)
    why = None
    if not fits:
        from ..plan.fit import find_fix, refusal
        fix = find_fix(shape, layout, p.training, a.gpu_gib, a.reserve_gib)
        why = refusal(p, fix, a.gpu_gib, a.reserve_gib, recipe=recipe_path(a.recipe) is not None)
    build = None
    if getattr(a, "cache_teacher", None) is not None:
        from ..plan.memory import GIB, cache_build_peak
        build = {k: v / GIB for k, v in cache_build_peak(a.cache_teacher, layout, p.training,
                                                         p.training.seq_len * p.training.micro_batch).items()}
    kind = a.gpu or ("h200" if a.gpu_gib == H200_GIB else None)
    other = None
    if not fits and kind and recipe_gpu(a.recipe) not in (None, kind):
        other = sibling_recipe(a.recipe, kind)
    if a.json:
        print(json.dumps(p.as_dict() | dict(fits=fits, refusal=why, cache_build_gib=build,
                                            cache_disk_bytes=getattr(a, "cache_disk", None), gpu=kind,
                                            gpu_gib=a.gpu_gib, recipe_for_gpu=other,
                                            fits_by_gpu={k: p.fits(g, a.reserve_gib) for k, (_, g) in
                                                         GPU_KINDS.items()}), indent=1))
    else:
        print(format_plan(p, a.gpu_gib, a.reserve_gib))
        print("GPU kinds:")
        print("\n".join(gpu_lines(p, a.reserve_gib)))
        if why:
            print(f"megatron-kd plan: {why}")
        if other:
            print(f"megatron-kd plan: the recipe {other} is this one made for the {GPU_KINDS[kind][0]}")
        if build:
            print(f"cache build first (kd.build_cache): {build['total']:.2f} GiB per GPU = {a.cache_teacher.name} "
                  f"weights {build['weights']:.2f} + one micro-batch's forward and top-K {build['forward']:.2f}")
        disk = getattr(a, "cache_disk", None)
        if disk:
            size = (f"{disk['high'] / 2**30:.3f} GiB" if disk["low"] == disk["high"] else
                    f"{disk['low'] / 2**30:.3f} to {disk['high'] / 2**30:.3f} GiB")
            print(f"cache on disk (kd.cache={disk['path']}): {size} for {disk['tokens']:,} tokens, K={disk['top_k']}, "
                  f"{disk['encoding']} (docs/choosing-a-cache.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
