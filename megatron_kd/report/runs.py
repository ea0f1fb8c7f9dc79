"""Reading finished runs (metrics.jsonl), the machine they ran on, and the demo's loss-curve plot."""
import json
import os

from ..recipe.targets import TargetSource


def machine() -> str:
    import platform
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = f", load average {os.getloadavg()[1]:.1f} (5 min)" if hasattr(os, "getloadavg") else ""
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}{load}"


def read_metrics(path: str) -> dict:
    """{kind: {iteration: record}} from metrics.jsonl; a resumed run's later record for an iteration wins."""
    out = {}
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if n == len(lines):  # unterminated: a record cut off by a kill (the resume drops it too)
                continue
            raise ValueError(f"{path} line {n} is not a JSON record (edited, or two writers?); fix or delete that "
                             "line") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path} line {n} is not a JSON object; fix or delete that line")
        out.setdefault(rec.get("kind"), {})[rec.get("iteration")] = rec
    return out


def plot_curves(out: str, png: str, rows: dict | None = None):
    """Left: train KL to the teacher top-K (offline solid circles, online dashed crosses, so neither hides the
    other) and each student's final held-out KL, CE-only included (stars; online's hollow and larger, so an equal
    offline value shows inside it). Right: train and held-out CE, with the teacher's held-out CE as a line.
    Returns the (closed) figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    style = {"offline": dict(color="tab:blue", linestyle="-", marker="o", markevery=0.1),
             "online": dict(color="tab:orange", linestyle="--", marker="x", markevery=(0.05, 0.1)),
             "ce": dict(color="tab:green", linestyle=":", marker="s", markevery=0.1)}
    last = 0
    for mode, st in style.items():
        m = read_metrics(os.path.join(out, f"student_{mode}", "metrics.jsonl"))
        train = sorted(m.get("train", {}).values(), key=lambda r: r["iteration"])
        ev = sorted(m.get("eval", {}).values(), key=lambda r: r["iteration"])
        last = max([last] + [r["iteration"] for r in train])
        if TargetSource(mode).distills:
            axes[0].plot([r["iteration"] for r in train], [r["kl"] for r in train], ms=4, **st,
                         label=f"{mode}: train KL to teacher top-K")
            kb = [r for r in train if r.get("kl_bucket") is not None]  # the monitor, a true KL (>= 0)
            if kb:
                axes[0].plot([r["iteration"] for r in kb], [r["kl_bucket"] for r in kb], color=st["color"],
                             linestyle=":", label=f"{mode}: bucket-tail KL (>= 0, train)")
        axes[1].plot([r["iteration"] for r in train], [r["ce"] for r in train], alpha=0.5, ms=3, **st,
                     label=f"{mode}: train CE")
        each_step = TargetSource(mode).teacher_each_step
        hollow = dict(mfc="none", ms=9, mew=2) if each_step else dict(ms=6)  # online rings offline's dots
        axes[1].plot([r["iteration"] for r in ev], [r["ce"] for r in ev], color=st["color"], lw=2,
                     marker="o", linestyle=st["linestyle"], label=f"{mode}: held-out CE", **hollow)
    for mode, st in style.items():
        if rows and mode in rows and "kl" in rows[mode]:
            hollow = dict(mfc="none", ms=18, mew=1.5) if TargetSource(mode).teacher_each_step else dict(ms=11)
            axes[0].plot([last], [rows[mode]["kl"]], marker="*", color=st["color"], linestyle="none",
                         label=f"{mode}: held-out KL (full teacher) {rows[mode]['kl']:.3f}", **hollow)
    if rows and "teacher" in rows:
        axes[1].axhline(rows["teacher"]["ce"], color="black", linestyle="-.", lw=1,
                        label=f"teacher: held-out CE {rows['teacher']['ce']:.3f}")
    axes[0].set(title="distillation loss: offline cache vs online teacher", xlabel="iteration", ylabel="nats/token")
    axes[1].set(title="cross-entropy", xlabel="iteration", ylabel="nats/token")
    for a in axes:
        a.grid(alpha=0.3)
        # below the axes, not inside: inside, "best" still put the teacher's line through its own legend entry
        a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return fig


def fmt_s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"
