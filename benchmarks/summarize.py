"""Render benchmarks/results/*.json (loss benchmarks) as markdown tables and PNG plots.

  python benchmarks/summarize.py benchmarks/results/loss_*.json
"""
import json
import sys
from collections import defaultdict


def table(res):
    env = res["env"]
    lines = [f"GPU {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"liger {env.get('liger_kernel')}, cce {env.get('cut_cross_entropy')}, run {env.get('date')}", "",
             "| variant | tokens N | ms (median) | peak GiB (inputs incl.) | GiB above inputs | x GEMM floor |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        ms = "OOM" if r.get("error") == "OOM" else (f"{r['ms']:.1f}" if r.get("ms") else r.get("error", "")[:40])
        pk = f"{r['peak_gib']:.2f}" if r.get("peak_gib") else ""
        ab = f"{r['above_inputs_gib']:.2f}" if r.get("above_inputs_gib") is not None else ""
        xf = f"{r['x_floor']:.2f}" if r.get("x_floor") else ""
        lines.append(f"| {r['variant']} | {r['tokens']} | {ms} | {pk} | {ab} | {xf} |")
    return "\n".join(lines)


def plot(res, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by = defaultdict(list)
    for r in res["rows"]:
        if r.get("ms"):
            by[r["variant"]].append((r["tokens"], r["ms"], r["peak_gib"]))
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, pts in by.items():
        pts.sort()
        n = [p[0] for p in pts]
        ax[0].plot(n, [p[1] for p in pts], "o-", label=name)
        ax[1].plot(n, [p[2] for p in pts], "o-", label=name)
    a = res["args"]
    for x, yl in zip(ax, ("fwd+bwd ms (median)", "peak GiB (inputs included)")):
        x.set_xscale("log", base=2)
        x.set_yscale("log")
        x.set_xlabel("tokens N")
        x.set_ylabel(yl)
        x.grid(alpha=0.3)
    ax[0].set_title(f"V={a['vocab']} H={a['hidden']} K={a['topk']} bf16")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(paths):
    for p in paths:
        res = json.load(open(p))
        print(f"### {p}\n\n{table(res)}\n")
        plot(res, p.replace(".json", ".png"))


if __name__ == "__main__":
    main(sys.argv[1:])
