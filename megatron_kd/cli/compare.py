"""`megatron-kd compare RUN_DIR...`: finished training runs side by side (a sweep's, or any).

    megatron-kd compare runs/tiny_cpu_sweep                     # a `megatron-kd train -m` sweep: its runs
    megatron-kd compare runs/tiny_cpu_sweep/0 runs/tiny_cpu_sweep/3
    megatron-kd compare runs/demo/student_* --teacher runs/demo/teacher

Prints one table (held-out CE and KL, tokens/s, steps, the recipe keys whose values differ between the runs) and
writes it with a plot of the loss curves to --out (default: the runs' common parent directory) as compare.md,
compare.json and compare.png.

Held-out numbers: with a teacher checkpoint (--teacher, or the teacher.load every run names), every run is
scored on the same held-out samples of the runs' data: cross-entropy and KL(teacher || student) over the
teacher's full vocabulary. Without one (or with --no-eval), each run's own final evaluation is shown (CE; KL
only where the run computed it). The teacher and each run are built on the layer spec their checkpoints record
(a run's model.attention_backend=auto would pick Transformer Engine's or not by what imports here);
--attention-backend chooses it for checkpoints of older runs, which record none.
"""
import argparse
import json
import os
import sys

USAGE_ERROR = 2


def build_parser():
    p = argparse.ArgumentParser(prog="megatron-kd compare", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="train.save directories of finished runs")
    p.add_argument("--out", default=None, help="where compare.md/.json/.png go (default: the runs' common parent)")
    p.add_argument("--teacher", default=None, metavar="SAVE_DIR",
                   help="the teacher's `megatron-kd train` save dir (default: the teacher.load all runs name)")
    p.add_argument("--eval-samples", type=int, default=None, metavar="N",
                   help="held-out samples to score (default: the first run's data.eval_samples, else "
                        "train.eval_iters x train.global_batch_size)")
    p.add_argument("--no-eval", action="store_true", help="show each run's own final evaluation; load no model")
    p.add_argument("--attention-backend", choices=("te", "sdpa", "local"), default=None,
                   help="the layer spec to build the teacher and every run on (default: the one each checkpoint "
                        "records; a checkpoint of an older run records none, and its model.attention_backend "
                        "applies)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return compare(args)
    except ValueError as e:
        print(f"megatron-kd compare: error: {e}", file=sys.stderr)
        return USAGE_ERROR


def read_recipe(path: str) -> dict:
    """The recipe a run trained with, from its checkpoint's common state."""
    from ..checkpoint.layout import latest_iteration
    from ..checkpoint.store import read_common
    if latest_iteration(path) is None:
        raise ValueError(f"{path} holds no checkpoint (latest_checkpointed_iteration.txt); compare reads the recipe "
                         "a run trained with from it")
    try:
        recipe = read_common(path).get("recipe")
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ValueError(f"{path}: its checkpoint cannot be read ({type(e).__name__}); is the run complete?") from None
    if not recipe:
        raise ValueError(f"{path}: its checkpoint records no recipe (not a `megatron-kd train` run)")
    return recipe


SWEEP_FILES = ("multirun.yaml", "compare.md", "compare.json", "compare.png")  # a sweep dir's files (a glob's)


def run_dirs(args: list, incomplete: list | None = None) -> list:
    """The run directories the arguments name: a sweep directory (Hydra's multirun.yaml in it) stands for its
    numbered runs; the files a sweep directory holds beside them (RUN_DIR/* globs them) are passed over. A sweep's
    run without summary.json (killed, failed or still running) is appended to `incomplete`."""
    out = []
    incomplete = [] if incomplete is None else incomplete
    for a in args:
        p = a.rstrip(os.sep) or a
        if os.path.basename(p) in SWEEP_FILES and os.path.isfile(p):
            continue
        if not os.path.isdir(p):
            raise ValueError(f"RUN_DIR {a} is not a directory; give the train.save directories of finished runs")
        if os.path.isfile(os.path.join(p, "multirun.yaml")) and not os.path.isfile(os.path.join(p, "summary.json")):
            subs = sorted((d for d in os.listdir(p) if os.path.isdir(os.path.join(p, d)) and not d.startswith(".")),
                          key=lambda d: (not d.isdigit(), int(d) if d.isdigit() else 0, d))
            out += [os.path.join(p, d) for d in subs if os.path.isfile(os.path.join(p, d, "summary.json"))]
            incomplete += [os.path.join(p, d) for d in subs if d.isdigit()
                           and not os.path.isfile(os.path.join(p, d, "summary.json"))]
            continue
        out.append(p)
    if not out:
        raise ValueError(f"{' '.join(args)} holds no finished run (summary.json)" + (
            f"; {', '.join(incomplete)} did not finish: rerun them (a run resumes from its last checkpoint)"
            if incomplete else ""))
    return out


def compare(args) -> int:
    from ..report import compare as report
    from ..runtime.quiet import quiet_megatron_warnings
    quiet_megatron_warnings()
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file; give a directory (compare.md, compare.json and compare.png "
                         "are written into it)")
    incomplete = []
    paths = run_dirs(args.runs, incomplete)
    if args.out:
        from ..recipe.checks import _inside
        inside = [p for p in paths if _inside(args.out, p)]
        if inside:
            raise ValueError(f"--out {args.out} lies inside the run {inside[0]}, which compare reads; give a directory "
                             "outside the runs for compare.md, compare.json and compare.png (default: the runs' "
                             "common parent)")
    for p in paths:
        report.run_summary(p)
    recipes = [read_recipe(p) for p in paths]
    teacher = None if args.no_eval else (args.teacher or shared_teacher(recipes))
    heldout, note = None, "each run's own final evaluation (no teacher checkpoint: --teacher SAVE_DIR scores all " \
        "runs on the same held-out samples, with KL)"
    if teacher:
        n = args.eval_samples or eval_samples(recipes[0])
        heldout = evaluate(paths, recipes, teacher, n, args.attention_backend)
        note = f"{n} held-out samples, the same for every run; KL(teacher || student) over the full vocabulary " \
               f"of the teacher {teacher}"
    elif args.no_eval:
        note = "each run's own final evaluation (--no-eval)"
    rows = report.rows_of(paths, recipes, heldout)
    table = report.format_table(rows)
    out = args.out or os.path.commonpath([os.path.abspath(p) for p in paths])
    if out in [os.path.abspath(p) for p in paths]:  # one run: beside it, not inside
        out = os.path.dirname(out)
    os.makedirs(out, exist_ok=True)
    png, md = os.path.join(out, "compare.png"), os.path.join(out, "compare.md")
    report.plot(rows, png)
    with open(md, "w") as f:
        f.write(f"{table}\n\nHeld-out: {note}. tokens/s: median training step.\n")
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump({"rows": rows, "heldout": note, "teacher": teacher}, f, indent=2)
    print(table)
    print(f"\nheld-out: {note}\nwrote {md}, {png}, {os.path.join(out, 'compare.json')}")
    if incomplete:
        print(f"megatron-kd compare: incomplete: {', '.join(incomplete)} (no summary.json: killed, failed or still "
              "running) left out of the table; rerun the sweep's command to finish them (a run resumes from its "
              "last checkpoint)", file=sys.stderr)
        return 1
    return 0


def shared_teacher(recipes: list) -> str | None:
    loads = {(r.get("teacher") or {}).get("load") for r in recipes}
    if len(loads) == 1:
        load = loads.pop()
        return load if load and os.path.isdir(load) else None
    return None


def eval_samples(recipe: dict) -> int:
    d, t = recipe["data"], recipe["train"]
    return int(d.get("eval_samples") or t["eval_iters"] * t["global_batch_size"])


def evaluate(paths: list, recipes: list, teacher: str, n: int, attention_backend: str | None = None) -> dict:
    """{run name: {"ce", "kl"}} on the first n held-out samples of the runs' data (which must be the same), each
    model built on the layer spec its checkpoint records (attention_backend: for checkpoints that record none)."""
    from ..report.compare import differing, short_names
    data = [k for k in differing(recipes) if k.startswith("data.")]
    if data:
        raise ValueError(f"the runs differ in {', '.join(data)}: their held-out samples differ, so one scoring "
                         "cannot hold for all; compare runs of one data section, or pass --no-eval")
    from ..recipe.schema import ModelConfig, TeacherConfig, to_recipe
    from ..training.evaluate import compare as score
    from dataclasses import fields
    r = to_recipe(recipes[0])
    saved = (read_recipe(teacher).get("model")) or {}
    known = {f.name for f in fields(TeacherConfig)}
    r.teacher = TeacherConfig(**{k: v for k, v in saved.items() if k in known})
    r.train.device = "auto"
    names = short_names(paths)
    mfields = {f.name for f in fields(ModelConfig)}
    students = {name: (ModelConfig(**{k: v for k, v in rec["model"].items() if k in mfields}), path)
                for name, path, rec in zip(names, paths, recipes)}
    print(f"megatron-kd compare: scoring {len(students)} runs and the teacher on {n} held-out samples", flush=True)
    out = score(r, teacher, students, n, min(n, r.train.micro_batch_size), attention_backend, "--attention-backend {}")
    return {name: out[name] for name in names}
