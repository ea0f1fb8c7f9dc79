"""Several finished `megatron-kd train` runs side by side: one table (held-out CE and KL, tokens/s, steps, the
settings that differ) and one plot of their loss curves. `megatron-kd compare` (cli/compare.py) feeds it.

A run is read from its save dir: summary.json (the end of a run), metrics.jsonl (its curves) and the recipe it
ran with (the checkpoint's, given here as a dict).
"""
import json
import os

from .runs import read_metrics

# keys that differ between any two runs without being a setting of the experiment
IGNORED = ("train.save", "train.load", "train.progress", "train.tensorboard", "train.log_interval",
           "train.eval_interval", "train.save_interval", "train.stop_at", "train.export_hf", "train.resume_changes",
           "data.num_workers", "data.index_cache")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def differing(recipes: list) -> list:
    """The recipe keys (section.key) whose values are not all equal, in recipe order; IGNORED left out."""
    flats = [flatten(r) for r in recipes]
    keys = []
    for f in flats:
        keys += [k for k in f if k not in keys]
    return [k for k in keys if k not in IGNORED and len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1]


def run_summary(path: str) -> dict:
    """summary.json of a finished run; ValueError (one sentence) when there is none."""
    p = os.path.join(path, "summary.json")
    if not os.path.isfile(p):
        raise ValueError(f"{path} holds no summary.json: not a finished `megatron-kd train` run directory (a sweep's "
                         "runs are its numbered subdirectories, e.g. runs/tiny_cpu_sweep/*)")
    try:
        with open(p, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError: a run killed while writing it, or edited
        raise ValueError(f"{p} is not valid JSON ({str(e).splitlines()[0]}): the run was killed while writing it, "
                         f"or it was edited; rerun that run to rewrite it (it resumes from its last checkpoint), or "
                         f"leave {path} out of the comparison") from None


def short_names(paths: list) -> list:
    """Each run's name: its path without the prefix all share (a sweep's runs: 0, 1, ...)."""
    parts = [os.path.abspath(p).rstrip(os.sep).split(os.sep) for p in paths]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    names = ["/".join(p[common:]) for p in parts]
    return names if len(set(names)) == len(names) else [os.path.abspath(p) for p in paths]


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "null" if v is None else str(v)


def rows_of(paths: list, recipes: list, heldout: dict | None = None) -> list:
    """One row per run: name, settings that differ, held-out CE/KL, tokens/s, steps. heldout: {name: {"ce", "kl"}}
    measured on one set of held-out samples for every run (else each run's own final evaluation)."""
    names = short_names(paths)
    keys = differing(recipes)
    rows = []
    for name, path, r in zip(names, paths, recipes):
        s = run_summary(path)
        flat = flatten(r)
        ev = (heldout or {}).get(name) or s.get("eval") or {}
        rows.append({"run": name, "path": path, "settings": {k: flat.get(k) for k in keys},
                     "ce": ev.get("ce"), "kl": ev.get("kl"), "tokens_per_s": s.get("tokens_per_s"),
                     "iteration": s.get("iteration"), "iters": s.get("iters"), "mode": s.get("mode")})
    return rows


def format_table(rows: list) -> str:
    keys = list(rows[0]["settings"]) if rows else []
    head = ["run", *keys, "held-out CE", "held-out KL", "tokens/s", "steps"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["run"], *[fmt(r["settings"][k]) for k in keys],
                 "-" if r["ce"] is None else f"{r['ce']:.4f}", "-" if r["kl"] is None else f"{r['kl']:.4f}",
                 "-" if not r["tokens_per_s"] else f"{r['tokens_per_s']:.0f}", f"{r['iteration']}/{r['iters']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def label(row: dict) -> str:
    text = ", ".join(f"{k.split('.', 1)[1]}={fmt(v)}" for k, v in row["settings"].items())
    return f"{row['run']}: {text}" if text else row["run"]


def plot(rows: list, png: str) -> None:
    """Left: each run's training loss (its own objective: not comparable across divergences or tails). Middle:
    training CE (lines) and held-out CE (markers). Right: the bucket-tail KL to the teacher's top-K (>= 0, one
    measure for every divergence and tail; KD runs only)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    cmap = plt.get_cmap("tab10" if len(rows) <= 10 else "tab20")
    for i, row in enumerate(rows):
        color, lab = cmap(i % cmap.N), label(row)
        m = read_metrics(os.path.join(row["path"], "metrics.jsonl"))
        train = sorted(m.get("train", {}).values(), key=lambda r: r["iteration"])
        ev = sorted(m.get("eval", {}).values(), key=lambda r: r["iteration"])
        its = [r["iteration"] for r in train]
        axes[0].plot(its, [r.get("loss") for r in train], color=color, label=lab)
        ce = [(r["iteration"], r["ce"]) for r in train if r.get("ce") is not None]
        if ce:
            axes[1].plot(*zip(*ce), color=color, alpha=0.6)
        evc = [(r["iteration"], r["ce"]) for r in ev if r.get("ce") is not None]
        if evc:
            axes[1].plot(*zip(*evc), color=color, marker="o", linestyle="none", ms=6)
        kb = [(r["iteration"], r["kl_bucket"]) for r in train if r.get("kl_bucket") is not None]
        if kb:
            axes[2].plot(*zip(*kb), color=color)
    axes[0].set(title="training loss (each run's own objective)", xlabel="iteration", ylabel="nats/token")
    axes[1].set(title="CE: training (lines), held-out (dots)", xlabel="iteration", ylabel="nats/token")
    axes[2].set(title="KL to the teacher's top-K, bucket tail (>= 0), training", xlabel="iteration",
                ylabel="nats/token")
    for a in axes:
        a.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, max(1, len(rows))), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, -0.02 - 0.035 * ((len(rows) + 2) // 3)))
    fig.tight_layout()
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
