"""train.optimizer=lean_adam trains as well as Megatron's fp32 Adam: offline KD on real text, on a CPU.

The offline_vs_online pipeline (pydoc text, tiny teacher, its top-100 cache; shared work directory, finished
stages are kept), then the same K=100 offline student twice on the same samples, steps and seed:
    adam_fp32    train.precision=fp32, Megatron's FP32Optimizer around torch AdamW (fp32 weights and moments)
    lean_bf16    train.precision=bf16, train.optimizer=lean_adam (bf16 weights + int16 master remainder,
                 bf16 exp_avg, fp32 exp_avg_sq; bf16 gradients)
Each checkpoint is scored on the same held-out samples (CE, full-vocabulary KL to the teacher). The difference
includes bf16 compute in the model, not only the optimizer. Bar: final CE and KL within 2% of adam_fp32.

    python benchmarks/lean_adam_quality.py        # ~6 min on 2 CPU cores after offline_vs_online's stages
Writes benchmarks/results/lean_adam_quality_cpu.json and .png.
"""
import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from offline_vs_online import SMALL, Bench, BenchSettings  # noqa: E402

from megatron_kd.cli.demo import prepare_out_dir  # noqa: E402

MODES = {"adam_fp32": ["train.precision=fp32"],
         "lean_bf16": ["train.precision=bf16", "train.optimizer=lean_adam"]}
BAR = 0.02


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/offline_vs_online", help="work directory shared with offline_vs_online")
    p.add_argument("--results", default=os.path.join(HERE, "results", "lean_adam_quality_cpu"))
    p.add_argument("--small", action="store_true")
    a = p.parse_args(argv)
    from megatron_kd.megatron import quiet_megatron_warnings
    quiet_megatron_warnings()
    s = BenchSettings(**(SMALL if a.small else {}))
    out = os.path.abspath(a.out)
    prepare_out_dir(out, s, False)
    bench = Bench(out, s)
    t0 = time.time()
    bench.stage_data()
    if bench.stage_train("teacher", bench.teacher_overrides()):
        return 2
    bench.stage_cache()
    commands = {}
    for m, extra in MODES.items():
        o = [x.replace("student_offline_k100", f"student_lean_{m}") for x in bench.student_overrides("offline_k100")]
        o += extra
        commands[m] = "megatron-kd train " + " ".join(o)
        if bench.stage_train(f"student_lean_{m}", o):
            return 2
    from megatron_kd.megatron.checkpoint import iter_dir
    from megatron_kd.megatron.evaluate import compare
    r = bench.recipe("offline_k100")
    its = list(range(s.eval_interval, s.student_iters + 1, s.eval_interval))
    curves = {m: [] for m in MODES}
    for it in its:
        students = {m: (r.model, iter_dir(os.path.join(out, f"student_lean_{m}"), it)) for m in MODES}
        met = compare(r, os.path.join(out, "teacher"), students, s.eval_samples, min(s.micro_batch_size, s.eval_samples))
        for m in MODES:
            curves[m].append({"iteration": it, **met[m]})
        print(f"[lean_adam_quality] eval @ {it}: " + ", ".join(f"{m} CE {met[m]['ce']:.4f} KL {met[m]['kl']:.4f}"
                                                         for m in MODES), flush=True)
    final = {m: {k: curves[m][-1][k] for k in ("ce", "kl")} for m in MODES}
    gap = {k: (final["lean_bf16"][k] - final["adam_fp32"][k]) / final["adam_fp32"][k] for k in ("ce", "kl")}
    from common import environment
    res = {"benchmark": "lean_adam (bf16) vs fp32 Adam, offline K=100 KD on pydoc text", "device": "CPU",
           "command": "python benchmarks/lean_adam_quality.py" + (" --small" if a.small else ""),
           "environment": environment(), "settings": dataclasses.asdict(s), "student_commands": commands,
           "final": final, "gap_lean_vs_fp32": gap, "curves": curves, "bar": f"|gap| <= {BAR:.0%}",
           "bar_met": all(abs(v) <= BAR for v in gap.values()), "total_s": time.time() - t0}
    with open(a.results + ".json", "w") as f:
        json.dump(res, f, indent=2)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for m, style in (("adam_fp32", "-"), ("lean_bf16", "--")):
        its_ = [c["iteration"] for c in curves[m]]
        for ax, k in zip(axes, ("ce", "kl")):
            ax.plot(its_, [c[k] for c in curves[m]], style, marker="o", markersize=3, label=m)
    for ax, t in zip(axes, ("held-out CE", "held-out KL(teacher || student)")):
        ax.set(title=t, xlabel="student step", ylabel="nats/token")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"lean_adam (bf16) vs fp32 Adam: final gap CE {gap['ce'] * 100:+.2f}%, KL {gap['kl'] * 100:+.2f}%",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(a.results + ".png", dpi=110)
    print(json.dumps({"final": final, "gap": gap, "bar_met": res["bar_met"]}, indent=1))
    return 0 if res["bar_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
