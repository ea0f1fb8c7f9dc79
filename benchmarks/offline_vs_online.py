"""Offline top-K KD equals online full-vocabulary KD, on real text, on a CPU.

Reuses the demo's pipeline (megatron_kd.cli.demo): CPython's documentation (pydoc_data) tokenized with a byte-level
BPE into Megatron indexed data, a tiny teacher GPT trained with CE (`megatron-kd train`), its top-100 cache over the
students' training samples. Then the demo's 2-layer student is trained on the same samples, steps and seed, five
ways, each a `megatron-kd train` process (printed as it starts):

    offline_k100   offline KD from the cache, K = 100, tail none
    offline_k20    offline KD from the same cache, K = 20 (its 20 most probable entries), tail none
    online_full    online KD, teacher in memory, K = the whole vocabulary, tail none: the exact full KL
    ce             labels only (reference)

Every `--eval-every` steps each run saves a checkpoint; afterwards megatron_kd.training.evaluate.compare scores
every checkpoint on the same held-out samples: cross-entropy and full-vocabulary KL(teacher || student). Before
training, the script proves that online_full's targets are the full distribution (the teacher's top-V holds
probability mass 1 at every position) and that our loss with K = V, tail none equals a dense full-softmax KL.

    python benchmarks/offline_vs_online.py                  # ~5-7 min on 2 CPU cores; runs/offline_vs_online
    python benchmarks/offline_vs_online.py --small          # smoke test (~2 min)
    python benchmarks/offline_vs_online.py --lean-adam      # lean_adam (bf16) vs fp32 Adam, same data (~6 min more)

Writes benchmarks/results/offline_vs_online_cpu.json (settings, curves, finals, gaps, checks, environment) and
offline_vs_online_cpu.png (held-out CE and KL vs step, one line per mode); prints the table of final numbers and the
relative gaps of K=100 and K=20 against online full (bar: |gap| <= 2% at K=100 for CE and KL).
Exit status 0 when the bar is met, 1 otherwise. An interrupted run resumes (finished stages are kept).
"""
import argparse
import dataclasses
import json
import os
import sys
import time

# OpenMP threads that spin while waiting make small CPU steps many times slower when another process wants the
# cores (the demo sets this for its training processes; the cache build and evaluation run in this one)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from megatron_kd.cli.demo import Demo, Settings, prepare_out_dir, recipe_overrides  # noqa: E402

MODES = ("offline_k100", "offline_k20", "online_full", "ce")
LABELS = {"offline_k100": "offline top-K, K=100", "offline_k20": "offline top-K, K=20",
          "online_full": "online, full vocabulary", "ce": "CE only (no teacher)"}
COLORS = {"offline_k100": "tab:blue", "offline_k20": "tab:purple", "online_full": "tab:orange", "ce": "tab:green"}
BAR = 0.02


@dataclasses.dataclass
class BenchSettings(Settings):
    vocab_size: int = 512
    seq_length: int = 128
    teacher_iters: int = 400
    student_iters: int = 240
    top_k: int = 100             # the cache's K (K=20 reads its 20 most probable entries)
    small_k: int = 20
    eval_samples: int = 128
    eval_interval: int = 30      # checkpoint + held-out evaluation every this many student steps
    teacher_lr: float = 3e-3
    student_lr: float = 3e-3


SMALL = dict(teacher_iters=250, student_iters=60, eval_samples=32, eval_interval=20)

# --sweep: K x tail x divergence, every K read from the ONE K=100 cache (its K most probable entries)
SWEEP_K = (8, 20, 50, 100)
SWEEP_TAILS = ("none", "renormalize", "bucket")
SWEEP_DIVS = ("forward_kl", "reverse_kl", "jsd")
JSD_BETA = 0.5
SWEEP_BAR = 0.01  # offline K=100 forward KL (tail none) within 1% of online full on held-out CE and KL


def sweep_modes(ks=SWEEP_K, tails=SWEEP_TAILS, divs=SWEEP_DIVS) -> list:
    """References and the largest K first: an interrupted sweep has what the bar needs."""
    return ["online_full", "ce"] + [f"k{k}_{tail}_{div}" for k in sorted(ks, reverse=True) for tail in tails
                                    for div in divs]


def split_lr(mode: str):
    """(mode without its learning rate, the rate or None): `k100_none_jsd_lr0.01` -> (`k100_none_jsd`, 0.01)."""
    if "_lr" in mode:
        base, lr = mode.rsplit("_lr", 1)
        return base, float(lr)
    return mode, None


def sweep_mode(mode: str):
    k, tail, div = split_lr(mode)[0].split("_", 2)
    return int(k[1:]), tail, div


# --sweep-add: per divergence, K=100 tail none at each rate of this grid (same steps, samples and seed: equal
# compute); the online full-vocabulary run of that divergence then trains at the rate its offline run did best at
SWEEP_LRS = (1e-3, 3e-3, 1e-2)
SWEEP_LR_K, SWEEP_LR_TAIL = 100, "none"


def lr_mode(base: str, lr: float, default_lr: float) -> str:
    return base if abs(lr - default_lr) < 1e-12 else f"{base}_lr{lr:g}"


def online_mode(div: str, lr: float, default_lr: float) -> str:
    """online_full is forward KL at the default rate (the sweep's reference); other divergences online_{div}."""
    return lr_mode("online_full" if div == "forward_kl" else f"online_{div}", lr, default_lr)


def online_div(mode: str) -> str | None:
    base = split_lr(mode)[0]
    if base == "online_full":
        return "forward_kl"
    return base[len("online_"):] if base.startswith("online_") else None


class Bench(Demo):
    """The demo's stages (data, teacher, cache, `megatron-kd train` processes) with this benchmark's students."""
    sweep = False

    def say(self, text: str) -> None:
        print(f"[offline_vs_online] {text}", flush=True)

    def student_overrides(self, mode: str) -> list:
        s = self.s
        teacher = f"teacher.load={os.path.join(self.out, 'teacher')}"
        if mode == "offline":  # the demo's cache stage composes its recipe from this: K = the cache's K
            mode = "offline_k100"
        lr = split_lr(mode)[1] or s.student_lr
        o = self.common(f"student_{mode}", s.student_iters, lr) + [f"train.save_interval={s.eval_interval}"]
        if self.sweep:  # the fidelity sweep: only the final checkpoint is evaluated
            o = self.common(f"student_{mode}", s.student_iters, lr)
            o = [x.replace(f"train.eval_interval={s.eval_interval}", f"train.eval_interval={s.student_iters}")
                 for x in o]
        if mode.startswith("k") and "_" in mode:  # k{K}_{tail}_{divergence}, all read from the one K=100 cache
            k, tail, div = sweep_mode(mode)
            return o + ["kd=offline", f"kd.top_k={k}", f"kd.tail={tail}", f"kd.divergence={div}",
                        f"kd.jsd_beta={JSD_BETA}", teacher, f"kd.cache={self.cache}", "kd.build_cache=false"]
        if mode.startswith("offline"):
            k = s.top_k if mode == "offline_k100" else s.small_k
            o += ["kd=offline", f"kd.top_k={k}", "kd.tail=none", teacher, f"kd.cache={self.cache}",
                  "kd.build_cache=false"]
        elif online_div(mode):  # the whole vocabulary: no truncation, only the divergence
            o += ["kd=online", f"kd.top_k={self.vocab}", "kd.tail=none", f"kd.divergence={online_div(mode)}",
                  f"kd.jsd_beta={JSD_BETA}", teacher]
        else:
            o += ["kd=ce"]
        return o

    @property
    def vocab(self) -> int:
        from megatron_kd.recipe.schema import DataConfig
        from megatron_kd.data.datasets import load_tokenizer
        return load_tokenizer(DataConfig(kind="indexed", path=self.data_prefix, tokenizer=self.tokenizer)).vocab_size

    def recipe(self, mode: str):
        from megatron_kd.recipe.schema import to_recipe
        from megatron_kd.recipe.compose import compose
        return to_recipe(compose("tiny_cpu", recipe_overrides(self.student_overrides(mode))))


def check_full_kl(bench: Bench, num_samples: int) -> dict:
    """online_full's targets are the whole distribution, and the loss on them is the exact full KL.

    On held-out samples: the teacher's top-V (the online mode's OnlineTeacher with K = V) holds mass 1; our loss
    (evaluate's per-position KL, tail none) equals KL computed from dense full-vocabulary logits of teacher and an
    untrained student. Also records how much mass the teacher's top-100 and top-20 hold.
    """
    import torch
    from megatron_kd.data.datasets import build_datasets, load_tokenizer, loader, samples_needed
    from megatron_kd.runtime.dist import distributed
    from megatron_kd.training.evaluate import _load, _per_position
    from megatron_kd.models.hook import forward_with_head
    from megatron_kd.models.builder import build_gpt
    from megatron_kd.teacher.megatron import OnlineTeacher

    r = bench.recipe("online_full")
    vocab = load_tokenizer(r.data).vocab_size
    assert r.kd.top_k == vocab and r.kd.tail == "none", (r.kd.top_k, vocab, r.kd.tail)

    def logits(model, batch):  # dense [b, s, V] full-vocabulary logits through the same hook
        out = {}

        def head(hidden, weight):
            out["z"] = (hidden @ weight.t())[..., :vocab].transpose(0, 1)
            return hidden.new_empty((hidden.shape[0], hidden.shape[1], 0))
        forward_with_head(model, head, batch["tokens"], batch["position_ids"], None)
        return out["z"].float()

    with torch.no_grad(), distributed(r.parallel, r.train.seed, r.train.device):
        _, valid = build_datasets(r.data, load_tokenizer(r.data), samples_needed(r.train, r.data)[0], num_samples)
        t_model = _load(r.teacher, os.path.join(bench.out, "teacher"), r, vocab)
        student = build_gpt(r.model, r.parallel, vocab, r.data.seq_length, "fp32")  # random init
        student.eval()
        teacher = OnlineTeacher(t_model, r.kd.top_k, vocab)
        masses, top100, top20, max_diff, ours_sum, dense_sum, n = [], [], [], 0.0, 0.0, 0.0, 0
        for batch in loader(valid, num_samples, 0, min(16, num_samples), 0, 1):
            ids, lp = teacher.topk(batch)
            mass = lp.exp().sum(-1)
            masses.append(mass.flatten())
            p_sorted = lp.exp().sort(-1, descending=True).values
            top100.append(p_sorted[..., :bench.s.top_k].sum(-1).flatten())
            top20.append(p_sorted[..., :bench.s.small_k].sum(-1).flatten())
            ours = _per_position(student, batch, vocab, ids, lp)
            lt = torch.log_softmax(logits(t_model, batch), -1)
            ls = torch.log_softmax(logits(student, batch), -1)
            dense = (lt.exp() * (lt - ls)).sum(-1)  # [b, s]
            if ours.shape != dense.shape:
                ours = ours.transpose(0, 1)
            max_diff = max(max_diff, (ours.reshape(dense.shape) - dense).abs().max().item())
            ours_sum += ours.sum().item()
            dense_sum += dense.sum().item()
            n += dense.numel()
        masses, top100, top20 = torch.cat(masses), torch.cat(top100), torch.cat(top20)
    out = {"vocab": vocab, "online_top_k": r.kd.top_k, "tail": r.kd.tail, "positions": n,
           "teacher_mass_covered_min": masses.min().item(), "teacher_mass_covered_max": masses.max().item(),
           f"teacher_top{bench.s.top_k}_mass_mean": top100.mean().item(),
           f"teacher_top{bench.s.top_k}_mass_min": top100.min().item(),
           f"teacher_top{bench.s.small_k}_mass_mean": top20.mean().item(),
           "loss_kl_vs_dense_kl_max_abs_diff": max_diff, "loss_kl_mean": ours_sum / n, "dense_kl_mean": dense_sum / n}
    out["is_full_kl"] = abs(out["teacher_mass_covered_min"] - 1) < 1e-4 and abs(out["teacher_mass_covered_max"] - 1) \
        < 1e-4 and max_diff < 1e-3
    return out


def evaluate_curves(bench: Bench) -> dict:
    """{mode: [{"iteration", "ce", "kl"}, ...]} from every saved checkpoint, all on the same held-out samples."""
    from megatron_kd.checkpoint.store import iter_dir
    from megatron_kd.training.evaluate import compare
    s = bench.s
    r = bench.recipe("online_full")  # data, layout, teacher architecture (the students share one architecture)
    curves = {m: [] for m in MODES}
    teacher_ce = None
    its = list(range(s.eval_interval, s.student_iters + 1, s.eval_interval))
    if its[-1] != s.student_iters:
        its.append(s.student_iters)
    for it in its:
        students = {m: (r.model, iter_dir(os.path.join(bench.out, f"student_{m}"), it)) for m in MODES}
        metrics = compare(r, os.path.join(bench.out, "teacher"), students, s.eval_samples,
                          min(s.micro_batch_size, s.eval_samples))
        teacher_ce = metrics["teacher"]["ce"]
        for m in MODES:
            curves[m].append({"iteration": it, **metrics[m]})
        bench.say(f"eval @ {it}: " + ", ".join(f"{m} CE {metrics[m]['ce']:.4f} KL {metrics[m]['kl']:.4f}"
                                               for m in MODES))
    return {"curves": curves, "teacher_ce": teacher_ce}


def gaps(final: dict) -> dict:
    ref = final["online_full"]
    return {m: {k: (final[m][k] - ref[k]) / ref[k] for k in ("ce", "kl")} for m in ("offline_k100", "offline_k20")}


def format_table(res: dict) -> str:
    final, g = res["final"], res["gaps_vs_online_full"]
    lines = ["| student | held-out CE | KL to teacher | CE gap vs online full | KL gap vs online full | train time |",
             "|---|---|---|---|---|---|"]
    for m in MODES:
        f = final[m]
        cg = f"{g[m]['ce'] * 100:+.2f}%" if m in g else ("-" if m == "online_full" else "")
        kg = f"{g[m]['kl'] * 100:+.2f}%" if m in g else ("-" if m == "online_full" else "")
        t = res["stage_s"].get(f"student_{m}")
        lines.append(f"| {LABELS[m]} | {f['ce']:.4f} | {f['kl']:.4f} | {cg} | {kg} | "
                     f"{'-' if t is None else f'{t:.0f} s'} |")
    lines.append(f"| teacher (reference) | {res['teacher_ce']:.4f} | - | | | "
                 f"{res['stage_s'].get('teacher', 0):.0f} s |")
    return "\n".join(lines)


def plot(res: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in MODES:
        c = res["curves"][m]
        its = [p["iteration"] for p in c]
        style = dict(color=COLORS[m], marker="o", markersize=3, label=LABELS[m],
                     linestyle="--" if m == "online_full" else "-")
        axes[0].plot(its, [p["ce"] for p in c], **style)
        axes[1].plot(its, [p["kl"] for p in c], **style)
    axes[0].axhline(res["teacher_ce"], color="gray", linestyle=":", label="teacher")
    s = res["settings"]
    axes[0].set(title="held-out cross-entropy", xlabel="student step", ylabel="nats/token")
    axes[1].set(title="held-out KL(teacher || student), full vocabulary", xlabel="student step", ylabel="nats/token")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    g = res["gaps_vs_online_full"]["offline_k100"]
    fig.suptitle(f"Offline top-K vs online full-vocabulary KD (pydoc text, vocab {s['vocab_size']}, "
                 f"{s['student_iters']} steps x {s['global_batch_size']}x{s['seq_length']} tokens; "
                 f"K=100 gap: CE {g['ce'] * 100:+.2f}%, KL {g['kl'] * 100:+.2f}%)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)

# --- the fidelity sweep ----------------------------------------------------------------------------

def _hidden_and_weight(model, batch):
    """The student's final hidden states [s, b, H] and output weight through the training hook (no logits)."""
    from megatron_kd.models.hook import forward_with_head
    out = {}

    def head(hidden, weight):
        out["h"], out["w"] = hidden, weight
        return hidden.new_empty((hidden.shape[0], hidden.shape[1], 0))
    forward_with_head(model, head, batch["tokens"], batch["position_ids"], None)
    return out["h"], out["w"]


def retemper_check(bench: Bench, student_dir: str, num_samples: int, ks=(20, 100), temps=(0.5, 2.0, 4.0)) -> dict:
    """Re-tempering a cache captured at T0 = 1 to T (K ids + one rest class) against re-tempering the teacher's
    full distribution, on the demo teacher's real held-out distributions. Per (K, T): mean |delta log p| over the
    K ids, mean total variation over the K+1 classes, and the relative error of the mean training loss (T^2
    forward KL, tails none and bucket) of a trained student (student_dir) between the two caches."""
    import torch
    from megatron_kd import topk_kl_loss
    from megatron_kd.loss.temper import retemper_logprobs
    from megatron_kd.checkpoint.store import iter_dir
    from megatron_kd.data.datasets import build_datasets, load_tokenizer, loader, samples_needed
    from megatron_kd.runtime.dist import distributed
    from megatron_kd.training.evaluate import _load
    r = bench.recipe("online_full")
    vocab = load_tokenizer(r.data).vocab_size
    acc = {}
    with torch.no_grad(), distributed(r.parallel, r.train.seed, r.train.device):
        _, valid = build_datasets(r.data, load_tokenizer(r.data), samples_needed(r.train, r.data)[0], num_samples)
        t_model = _load(r.teacher, os.path.join(bench.out, "teacher"), r, vocab)
        student = _load(r.model, iter_dir(student_dir, bench.s.student_iters), r, vocab)
        for batch in loader(valid, num_samples, 0, min(16, num_samples), 0, 1):
            th, tw = _hidden_and_weight(t_model, batch)
            z = (th @ tw.t())[..., :vocab].float()  # [s, b, V] teacher logits
            sh, sw = _hidden_and_weight(student, batch)
            for k in ks:
                lp0, ids = torch.log_softmax(z, -1).topk(k, dim=-1)
                flat = lp0.reshape(-1, k)
                ok = torch.ones_like(flat, dtype=torch.bool)
                for T in temps:
                    approx = retemper_logprobs(flat.double(), ok, 1.0 / T).float().reshape(lp0.shape)
                    exact = torch.log_softmax(z / T, -1).gather(-1, ids)
                    pa, pe = approx.exp(), exact.exp()
                    tv = 0.5 * ((pa - pe).abs().sum(-1) + ((1 - pa.sum(-1)) - (1 - pe.sum(-1))).abs())
                    a = acc.setdefault(f"K={k},T={T}", {"dlogp": 0.0, "tv": 0.0, "n": 0, "slots": 0})
                    a["dlogp"] += (approx - exact).abs().sum().item()
                    a["slots"] += approx.numel()
                    a["tv"] += tv.sum().item()
                    a["n"] += tv.numel()
                    for tail in ("none", "bucket"):
                        kw = dict(temperature=T, tail=tail, reduction="sum", impl="chunked", valid_vocab_size=vocab)
                        la = topk_kl_loss(sh, sw, ids, lp0, cache_temperature=1.0, **kw).item()
                        le = topk_kl_loss(sh, sw, ids, exact, **kw).item()
                        a[f"loss_{tail}_approx"] = a.get(f"loss_{tail}_approx", 0.0) + la
                        a[f"loss_{tail}_exact"] = a.get(f"loss_{tail}_exact", 0.0) + le
    out = {}
    for key, a in acc.items():
        row = {"mean_abs_dlogp_topk": a["dlogp"] / a["slots"], "mean_tv_k_plus_rest": a["tv"] / a["n"]}
        for tail in ("none", "bucket"):
            ex = a[f"loss_{tail}_exact"]
            row[f"loss_{tail}_exact_per_token"] = ex / a["n"]
            row[f"loss_{tail}_rel_err"] = (a[f"loss_{tail}_approx"] - ex) / abs(ex)
        out[key] = row
    return out


def div_name(div: str) -> str:
    return div if div != "jsd" else f"jsd({JSD_BETA})"


def sweep_row(mode: str, default_lr: float):
    """(K, tail, divergence, lr) of a sweep mode, as the table shows them."""
    lr = split_lr(mode)[1] or default_lr
    if online_div(mode):
        return "V (online)", "-", div_name(online_div(mode)), lr
    if mode == "ce":
        return "-", "-", "CE only", lr
    k, tail, div = sweep_mode(mode)
    return k, tail, div_name(div), lr


def sweep_table(res: dict) -> str:
    final, ref = res["final"], res["final"]["online_full"]
    default_lr = res["settings"]["student_lr"]
    lines = ["| student | K | tail | divergence | lr | held-out CE | KL to teacher | CE vs online | KL vs online |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in res["modes"]:
        f = final[m]
        k, tail, div, lr = sweep_row(m, default_lr)
        cg = (f["ce"] - ref["ce"]) / ref["ce"] * 100
        kg = (f["kl"] - ref["kl"]) / ref["kl"] * 100
        lines.append(f"| {m} | {k} | {tail} | {div} | {lr:g} | {f['ce']:.4f} | {f['kl']:.4f} | {cg:+.2f}% | "
                     f"{kg:+.2f}% |")
    lines.append(f"| teacher (reference) | | | | | {res['teacher_ce']:.4f} | - | | |")
    if res.get("per_divergence"):
        lines += ["", per_divergence_table(res)]
    return "\n".join(lines)


def per_divergence_table(res: dict) -> str:
    """Per divergence: the rate its offline K=100 (tail none) run did best at, that run, and the online
    full-vocabulary run of the same divergence at the same rate: offline - online is what truncation costs."""
    lines = [f"| divergence | lr chosen (of {', '.join(f'{x:g}' for x in res['lr_grid'])}) | offline K={SWEEP_LR_K}, "
             f"tail {SWEEP_LR_TAIL}: CE / KL | online full vocabulary: CE / KL | offline - online: CE / KL |",
             "|---|---|---|---|---|"]
    final = res["final"]
    for div, d in res["per_divergence"].items():
        off, on = final[d["offline"]], final[d["online"]]
        lines.append(f"| {div_name(div)} | {d['lr']:g} | {off['ce']:.4f} / {off['kl']:.4f} | {on['ce']:.4f} / "
                     f"{on['kl']:.4f} | {off['ce'] - on['ce']:+.4f} / {off['kl'] - on['kl']:+.4f} |")
    return "\n".join(lines)


def sweep_plot(res: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    final = res["final"]
    grid = [m for m in res["modes"] if m != "ce" and not online_div(m) and split_lr(m)[1] is None]
    ks = sorted({sweep_mode(m)[0] for m in grid})
    divs = [d for d in SWEEP_DIVS if any(m.endswith("_" + d) for m in grid)]
    per_div = res.get("per_divergence") or {}
    fig, axes = plt.subplots(3 if per_div else 2, len(divs), figsize=(5 * len(divs), 12 if per_div else 8),
                             squeeze=False)
    colors = {"none": "tab:blue", "renormalize": "tab:purple", "bucket": "tab:red"}
    for j, div in enumerate(divs):
        for i, metric in enumerate(("kl", "ce")):
            ax = axes[i][j]
            for tail in SWEEP_TAILS:
                ms = [f"k{k}_{tail}_{div}" for k in ks]
                if all(m in final for m in ms):
                    ax.plot(ks, [final[m][metric] for m in ms], "o-", color=colors[tail], label=f"tail {tail}")
            ax.axhline(final["online_full"][metric], color="tab:orange", linestyle="--", label="online full (fwd KL)")
            ax.axhline(final["ce"][metric], color="tab:green", linestyle=":", label="CE only")
            name = div if div != "jsd" else f"JSD({JSD_BETA})"
            ax.set(xscale="log", xticks=ks, xticklabels=[str(k) for k in ks], xlabel="K (from one K=100 cache)",
                   ylabel="nats/token", title=f"{name}: held-out {'KL(teacher || student)' if metric == 'kl' else 'CE'}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        if div in per_div:  # the learning-rate sweep of K=100, tail none, and the online run at the chosen rate
            ax = axes[2][j]
            lrs = res["lr_grid"]
            ms = [lr_mode(f"k{SWEEP_LR_K}_{SWEEP_LR_TAIL}_{div}", lr, res["settings"]["student_lr"]) for lr in lrs]
            ax.plot(lrs, [final[m]["kl"] for m in ms], "o-", color="tab:blue", label=f"offline K={SWEEP_LR_K}, "
                    f"tail {SWEEP_LR_TAIL}")
            on = final[per_div[div]["online"]]
            ax.plot([per_div[div]["lr"]], [on["kl"]], "*", ms=14, color="tab:orange",
                    label="online, full vocabulary, same divergence (at the chosen lr)")
            ax.axhline(final["online_full"]["kl"], color="tab:orange", linestyle="--", lw=1,
                       label="online full, forward KL, lr 0.003")
            name = div if div != "jsd" else f"JSD({JSD_BETA})"
            ax.set(xscale="log", xticks=lrs, xticklabels=[f"{x:g}" for x in lrs], xlabel="learning rate (same steps)",
                   ylabel="nats/token", title=f"{name}: held-out KL(teacher || student) vs learning rate")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    s = res["settings"]
    fig.suptitle(f"Fidelity sweep: pydoc text, vocab {s['vocab_size']}, {s['student_iters']} steps x "
                 f"{s['global_batch_size']}x{s['seq_length']} tokens, same seed; final held-out metrics", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def train_students(bench: Bench, modes, overrides=None) -> dict | None:
    """One `megatron-kd train` process per mode (finished ones are kept); {mode: command}, None on a failure.
    overrides: mode -> the run's overrides (default bench.student_overrides)."""
    commands = {}
    for m in modes:
        o = (overrides or bench.student_overrides)(m)
        commands[m] = "megatron-kd train " + " ".join(o)
        if bench.stage_train(f"student_{m}", o):
            return None
    return commands


def run_sweep(bench: Bench, args, t0: float) -> int:
    from megatron_kd.training.evaluate import compare
    from megatron_kd.checkpoint.store import iter_dir
    s = bench.s
    ks = tuple(int(k) for k in args.sweep_k.split(","))
    divs = tuple(args.sweep_div.split(","))
    modes = sweep_modes(ks, SWEEP_TAILS, divs)
    commands = train_students(bench, modes)
    if commands is None:
        return 2
    t = time.time()
    r = bench.recipe("online_full")
    students = {m: (r.model, iter_dir(os.path.join(bench.out, f"student_{m}"), s.student_iters)) for m in modes}
    metrics = compare(r, os.path.join(bench.out, "teacher"), students, s.eval_samples,
                      min(s.micro_batch_size, s.eval_samples))
    bench.times["evaluate"] = time.time() - t
    t = time.time()
    retemper = retemper_check(bench, os.path.join(bench.out, "student_ce"), min(64, s.eval_samples))
    bench.times["retemper_check"] = time.time() - t
    final = {m: {k: metrics[m][k] for k in ("ce", "kl")} for m in modes}
    from common import environment
    res = {"benchmark": "fidelity sweep: K x tail x divergence from one K=100 cache vs online full KD",
           "command": "python benchmarks/offline_vs_online.py --sweep" + (" --small" if args.small else ""),
           "device": "CPU", "cpu_cores": os.cpu_count(), "environment": environment(),
           "settings": dataclasses.asdict(s), "jsd_beta": JSD_BETA, "modes": modes, "student_commands": commands,
           "teacher_ce": metrics["teacher"]["ce"], "final": final, "retemper_error": retemper,
           "stage_s": bench.times}
    key = f"k{max(ks)}_none_forward_kl"
    ref = final["online_full"]
    gap = {m: (final[key][m] - ref[m]) / ref[m] for m in ("ce", "kl")} if key in final else None
    res["gap_k100_forward_kl_vs_online"] = gap
    res["bar"] = f"|gap| <= {SWEEP_BAR:.0%} for offline K=100 forward KL (tail none) vs online full, CE and KL"
    res["bar_met"] = bool(gap) and max(ks) == 100 and all(abs(v) <= SWEEP_BAR for v in gap.values())
    res["total_s"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    sweep_plot(res, args.results + ".png")
    table = sweep_table(res)
    with open(args.results + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(args.results + ".md", "w") as f:
        f.write(table + "\n")
    print("\n" + table + "\n", flush=True)
    print(json.dumps(retemper, indent=1), flush=True)
    bench.say(f"bar ({res['bar']}): {'MET' if res['bar_met'] else 'MISSED'} {gap}; total {res['total_s']:.0f} s")
    return 0 if res["bar_met"] else 1


def run_sweep_add(bench: Bench, args, t0: float) -> int:
    """--sweep-add: per divergence, K=100 tail none at each --sweep-lr rate (same samples, steps and seed: equal
    compute) and the online full-vocabulary run of that divergence at the rate its offline run did best at, with
    online_full (forward KL, the default rate) as the reference; every row trained and scored here, on one
    machine (rows of another machine's run differ by about 0.02 nats: README, how far the figures vary). Writes
    args.results (default results/divergence_lr_cpu) .json/.md/.png, after the rate sweep and again at the end."""
    from megatron_kd.training.evaluate import compare
    from megatron_kd.checkpoint.store import iter_dir
    from common import environment
    s = bench.s
    divs = tuple(args.sweep_div.split(","))
    grid = tuple(sorted(float(x) for x in args.sweep_lr.split(",")))
    base = {div: f"k{SWEEP_LR_K}_{SWEEP_LR_TAIL}_{div}" for div in divs}
    lr_modes = [lr_mode(base[d], lr, s.student_lr) for d in divs for lr in grid]
    r = bench.recipe("online_full")
    final, commands = {}, {}
    res = {"benchmark": "per-divergence learning rates (offline K=100, tail none) and online full-vocabulary KD per "
                        "divergence", "command": "python benchmarks/offline_vs_online.py --sweep-add"
           + (" --small" if args.small else ""), "device": "CPU", "cpu_cores": os.cpu_count(),
           "environment": environment(), "settings": dataclasses.asdict(s), "jsd_beta": JSD_BETA,
           "lr_grid": list(grid), "final": final, "student_commands": commands,
           "lr_choice": "lowest held-out KL of offline K=100, tail none (the table's held-out samples: the demo "
                        "data has no third split to choose on)"}

    def evaluate(modes):
        if train_students(bench, modes) is None:
            return None
        t = time.time()
        students = {m: (r.model, iter_dir(os.path.join(bench.out, f"student_{m}"), s.student_iters)) for m in modes}
        met = compare(r, os.path.join(bench.out, "teacher"), students, s.eval_samples,
                      min(s.micro_batch_size, s.eval_samples))
        bench.times["evaluate"] = bench.times.get("evaluate", 0.0) + time.time() - t
        res["teacher_ce"] = met["teacher"]["ce"]
        commands.update({m: "megatron-kd train " + " ".join(bench.student_overrides(m)) for m in modes})
        return {m: {k: met[m][k] for k in ("ce", "kl")} for m in modes}

    def write():
        res["modes"] = list(final)
        res["stage_s"] = dict(bench.times)
        res["total_s"] = time.time() - t0
        os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
        lr_plot(res, args.results + ".png")
        table = lr_table(res)
        with open(args.results + ".json", "w") as f:
            json.dump(res, f, indent=2)
        with open(args.results + ".md", "w") as f:
            f.write(table + "\n")
        print("\n" + table + "\n", flush=True)

    got = evaluate(["online_full"] + lr_modes)
    if got is None:
        return 2
    final.update(got)
    stored = os.path.join(HERE, "results", "divergence_sweep_cpu.json")
    if os.path.exists(stored):
        with open(stored) as f:
            old = json.load(f)["final"]
        res["online_full_here_minus_divergence_sweep"] = {k: got["online_full"][k] - old["online_full"][k]
                                                          for k in ("ce", "kl")}
    chosen = {d: min(grid, key=lambda lr: got[lr_mode(base[d], lr, s.student_lr)]["kl"]) for d in divs}
    res["per_divergence"] = {d: {"lr": chosen[d], "offline": lr_mode(base[d], chosen[d], s.student_lr),
                                 "online": online_mode(d, chosen[d], s.student_lr)} for d in divs}
    bench.say("chosen rates: " + ", ".join(f"{d} {lr:g}" for d, lr in chosen.items()))
    write()
    todo = [online_mode(d, chosen[d], s.student_lr) for d in divs]
    got2 = evaluate([m for m in todo if m not in final])
    if got2 is None:
        return 2
    final.update(got2)
    write()
    bench.say(f"total {res['total_s']:.0f} s; {args.results}.json, .md, .png")
    return 0


def lr_table(res: dict) -> str:
    final, default_lr = res["final"], res["settings"]["student_lr"]
    lines = ["| student | K | tail | divergence | lr | held-out CE | KL to teacher |", "|---|---|---|---|---|---|---|"]
    for m in res["modes"]:
        k, tail, div, lr = sweep_row(m, default_lr)
        lines.append(f"| {m} | {k} | {tail} | {div} | {lr:g} | {final[m]['ce']:.4f} | {final[m]['kl']:.4f} |")
    lines.append(f"| teacher (reference) | | | | | {res['teacher_ce']:.4f} | - |")
    per = {d: v for d, v in (res.get("per_divergence") or {}).items() if v["online"] in final}
    if per:
        lines += ["", per_divergence_table({**res, "per_divergence": per})]
    return "\n".join(lines)


def lr_plot(res: dict, png: str) -> None:
    """Per divergence: held-out KL and CE of offline K=100 (tail none) against the learning rate, the online
    full-vocabulary run of that divergence at the chosen rate (star), online forward KL at the default rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    final, per, lrs = res["final"], res.get("per_divergence") or {}, res["lr_grid"]
    default_lr = res["settings"]["student_lr"]
    divs = list(per)
    fig, axes = plt.subplots(2, len(divs), figsize=(5 * len(divs), 8), squeeze=False)
    for j, div in enumerate(divs):
        for i, metric in enumerate(("kl", "ce")):
            ax = axes[i][j]
            ms = [lr_mode(f"k{SWEEP_LR_K}_{SWEEP_LR_TAIL}_{div}", lr, default_lr) for lr in lrs]
            ax.plot(lrs, [final[m][metric] for m in ms], "o-", color="tab:blue",
                    label=f"offline K={SWEEP_LR_K}, tail {SWEEP_LR_TAIL}")
            if per[div]["online"] in final:
                ax.plot([per[div]["lr"]], [final[per[div]["online"]][metric]], "*", ms=15, color="tab:orange",
                        label=f"online, full vocabulary, {div_name(div)}, lr {per[div]['lr']:g}")
            ax.axhline(final["online_full"][metric], color="tab:orange", linestyle="--", lw=1,
                       label=f"online, full vocabulary, forward KL, lr {default_lr:g}")
            if metric == "ce":
                ax.axhline(res["teacher_ce"], color="gray", linestyle=":", label="teacher")
            ax.set(xscale="log", xticks=lrs, xticklabels=[f"{x:g}" for x in lrs], xlabel="learning rate (same steps)",
                   ylabel="nats/token", title=f"{div_name(div)}: held-out "
                   + ("KL(teacher || student)" if metric == "kl" else "CE"))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    s = res["settings"]
    fig.suptitle(f"Per-divergence learning rate at equal compute ({s['student_iters']} steps x "
                 f"{s['global_batch_size']}x{s['seq_length']} tokens, one seed) and the online run of each divergence",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


LEAN_MODES = {"adam_fp32": ["train.precision=fp32"],
         "lean_bf16": ["train.precision=bf16", "train.optimizer=lean_adam"]}


def lean_adam_quality(a, s, out, bench, t0) -> int:
    """--lean-adam: train.optimizer=lean_adam trains as well as Megatron's fp32 Adam. After the shared stages (data,
    teacher, cache), the K=100 offline student twice on the same samples, steps and seed:
        adam_fp32    train.precision=fp32, Megatron's FP32Optimizer around torch AdamW (fp32 weights and moments)
        lean_bf16    train.precision=bf16, train.optimizer=lean_adam (bf16 weights + int16 master remainder,
                     bf16 exp_avg, fp32 exp_avg_sq; bf16 gradients)
    Each checkpoint is scored on the same held-out samples; the difference includes bf16 compute in the model.
    Bar: final CE and KL within 2% of adam_fp32. Writes results/lean_adam_quality_cpu.json and .png."""
    commands = {}
    for m, extra in LEAN_MODES.items():
        o = [x.replace("student_offline_k100", f"student_lean_{m}") for x in bench.student_overrides("offline_k100")]
        o += extra
        commands[m] = "megatron-kd train " + " ".join(o)
        if bench.stage_train(f"student_lean_{m}", o):
            return 2
    from megatron_kd.checkpoint.store import iter_dir
    from megatron_kd.training.evaluate import compare
    r = bench.recipe("offline_k100")
    its = list(range(s.eval_interval, s.student_iters + 1, s.eval_interval))
    curves = {m: [] for m in LEAN_MODES}
    for it in its:
        students = {m: (r.model, iter_dir(os.path.join(out, f"student_lean_{m}"), it)) for m in LEAN_MODES}
        met = compare(r, os.path.join(out, "teacher"), students, s.eval_samples,
                      min(s.micro_batch_size, s.eval_samples))
        for m in LEAN_MODES:
            curves[m].append({"iteration": it, **met[m]})
        print(f"[lean-adam] eval @ {it}: " + ", ".join(f"{m} CE {met[m]['ce']:.4f} KL {met[m]['kl']:.4f}"
                                                         for m in LEAN_MODES), flush=True)
    final = {m: {k: curves[m][-1][k] for k in ("ce", "kl")} for m in LEAN_MODES}
    gap = {k: (final["lean_bf16"][k] - final["adam_fp32"][k]) / final["adam_fp32"][k] for k in ("ce", "kl")}
    from common import environment
    res = {"benchmark": "lean_adam (bf16) vs fp32 Adam, offline K=100 KD on pydoc text", "device": "CPU",
           "command": "python benchmarks/offline_vs_online.py --lean-adam" + (" --small" if a.small else ""),
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



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/offline_vs_online", help="work directory (data, checkpoints, cache)")
    p.add_argument("--results", default=None, help="results path without extension (.json and .png are written; "
                   "default results/offline_vs_online_cpu, with --lean-adam results/lean_adam_quality_cpu)")
    p.add_argument("--lean-adam", action="store_true", help="instead: lean_adam (bf16) vs fp32 Adam on the same "
                   "offline K=100 student (lean_adam_quality)")
    p.add_argument("--small", action="store_true", help="smoke-test sizes")
    p.add_argument("--overwrite", action="store_true", help="discard a previous run in --out")
    p.add_argument("--progress", action="store_true", help="tqdm bars instead of log lines")
    p.add_argument("--sweep", action="store_true", help="the fidelity sweep: K x tail x divergence from one "
                   "K=100 cache, against online full KD and CE only (results default: divergence_sweep_cpu)")
    p.add_argument("--sweep-k", default=",".join(map(str, SWEEP_K)), help="--sweep: the K values")
    p.add_argument("--sweep-div", default=",".join(SWEEP_DIVS), help="--sweep: the divergences")
    p.add_argument("--sweep-add", action="store_true", help=f"per divergence, K={SWEEP_LR_K} tail {SWEEP_LR_TAIL} at "
                   "each --sweep-lr rate, and the online full-vocabulary run of that divergence at its best rate "
                   "(results default: divergence_lr_cpu)")
    p.add_argument("--sweep-lr", default=",".join(f"{x:g}" for x in SWEEP_LRS), help="--sweep-add: the rates")
    args = p.parse_args(argv)
    args.sweep = args.sweep or args.sweep_add
    if args.sweep_add and not args.results:
        args.results = os.path.join(HERE, "results", "divergence_lr_cpu" + ("_small" if args.small else ""))
    if args.sweep and not args.results:
        args.results = os.path.join(HERE, "results", "divergence_sweep_cpu" + ("_small" if args.small else ""))
    args.results = args.results or os.path.join(HERE, "results", "lean_adam_quality_cpu" if args.lean_adam
                                                else "offline_vs_online_cpu")
    from megatron_kd.runtime.quiet import quiet_megatron_warnings
    quiet_megatron_warnings()
    s = BenchSettings(**(SMALL if args.small else {}))
    out = os.path.abspath(args.out)
    prepare_out_dir(out, s, args.overwrite)
    bench = Bench(out, s, progress=args.progress)
    bench.sweep = args.sweep
    t0 = time.time()
    bench.stage_data()
    if bench.stage_train("teacher", bench.teacher_overrides()):
        return 2
    bench.stage_cache()
    if args.lean_adam:
        return lean_adam_quality(args, s, out, bench, t0)
    if args.sweep_add:
        return run_sweep_add(bench, args, t0)
    if args.sweep:
        return run_sweep(bench, args, t0)
    t = time.time()
    check = check_full_kl(bench, min(32, s.eval_samples))
    bench.times["check_full_kl"] = time.time() - t
    bench.say(f"full-KL check: {json.dumps(check)}")
    if not check["is_full_kl"]:
        bench.say("online_full is NOT the full KL; stopping")
        return 2
    commands = train_students(bench, MODES)
    if commands is None:
        return 2
    t = time.time()
    ev = evaluate_curves(bench)
    bench.times["evaluate"] = time.time() - t
    final = {m: {k: ev["curves"][m][-1][k] for k in ("ce", "kl")} for m in MODES}
    from common import environment
    summaries = {m: json.load(open(os.path.join(out, f"student_{m}", "summary.json"))) for m in MODES}
    res = {"benchmark": "offline top-K KD vs online full-vocabulary KD",
           "command": "python benchmarks/offline_vs_online.py" + (" --small" if args.small else ""),
           "device": "CPU", "cpu_cores": os.cpu_count(), "environment": environment(),
           "settings": dataclasses.asdict(s), "student_commands": commands, "full_kl_check": check,
           "teacher_ce": ev["teacher_ce"], "final": final, "gaps_vs_online_full": gaps(final),
           "curves": ev["curves"], "tokens_per_s": {m: summaries[m]["tokens_per_s"] for m in MODES},
           "stage_s": bench.times, "bar": f"|gap| <= {BAR:.0%} at K=100 (CE and KL)"}
    g100 = res["gaps_vs_online_full"]["offline_k100"]
    res["bar_met"] = abs(g100["ce"]) <= BAR and abs(g100["kl"]) <= BAR
    res["total_s"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    plot(res, args.results + ".png")
    with open(args.results + ".json", "w") as f:
        json.dump(res, f, indent=2)
    print("\n" + format_table(res) + "\n", flush=True)
    bench.say(f"bar (K=100 within {BAR:.0%} of online full on CE and KL): {'MET' if res['bar_met'] else 'MISSED'}; "
              f"total {res['total_s']:.0f} s; {args.results}.json, {args.results}.png")
    return 0 if res["bar_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
