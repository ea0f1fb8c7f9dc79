"""Sampled caches against top-K, top-P and online KD: students trained from each cache of one teacher, on a CPU.

Reuses topp_fidelity.py's stages (offline_vs_online.py's pydoc text, BPE tokenizer, tiny teacher). From the teacher
over the students' training samples it builds K=100 fp16 and compact caches, top-P caches (--top-p) and sampled
caches (--draws: N draws per position from the teacher's whole distribution); trains the demo's student from each
(same samples, steps and seed) with forward KL (tail none; a sampled cache is read with kd.top_k = N), beside online
KD over the whole vocabulary and CE only; and with reverse KL: online, and the top-K / top-P caches with tail bucket
(the proper divergence there). A sampled cache is not trained with reverse KL: the loss refuses it, because reverse
KL's gradient is not linear in the teacher's probabilities, so count / N gives no unbiased estimate of it.

Each final checkpoint is scored on the same held-out samples with dense full-vocabulary logits: CE, KL(teacher ||
student), expected calibration error (ECE: 15 equal-width bins of the top-1 probability, |accuracy - confidence|
weighted by the bin's share of positions). The teacher's top-1 probability and entropy (whole vocabulary, held-out
and training samples) are reported beside. Bytes/token are measured from each cache's shards.

    python benchmarks/sampled_fidelity.py                    # the demo teacher (400 steps); runs/sampled_fidelity
    python benchmarks/sampled_fidelity.py --peaked           # a teacher trained 4x longer; runs/sampled_fidelity_peaked
    python benchmarks/sampled_fidelity.py --small            # smoke sizes (topp_fidelity's --small)
    python benchmarks/sampled_fidelity.py --device cuda --jobs 6 --budget-s 390 --results results/sampled_fidelity_h200

--device runs every stage there (teacher, cache builds, students, evaluation: train.device). --jobs N trains N
students at a time, each `megatron-kd train` process's output in <out>/logs/student_<mode>.log; the caches are
built meanwhile, in this process, in the order their students come. Students start in this order: online KD (the
reference), the --seed-check pairs, the sampled caches' students, then the rest. --budget-s S starts no student (and
no cache build) after S seconds: the results hold the students that finished, list the others under
"unfinished", and the verdict is over the finished ones; rerunning the same command trains the rest.

Writes benchmarks/results/sampled_fidelity[_peaked][_small]_cpu.{json,md,png} (on a GPU give --results); prints
the table. Acceptance (the issue's): a sampled cache at <= 40 bytes/token within 0.5% of online KD's held-out CE and
KL. Exit 0 when one meets it, 1 otherwise, 2 when a stage failed. An interrupted run resumes (finished caches and
students are kept). Two runs of distinct --out can run side by side on one machine.
"""
import argparse
import dataclasses
import json
import os
import shlex
import sys
import threading
import time

STARTED = time.time()  # --budget-s counts from here
SAY_LOCK = threading.Lock()

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see offline_vs_online.py
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from offline_vs_online import SMALL, BenchSettings  # noqa: E402
from topp_fidelity import TopPBench, cache_name, cache_overrides, redraw, save  # noqa: E402
from megatron_kd.cli.demo import TIMES, prepare_out_dir  # noqa: E402

TOP_PS = (0.99, 0.9)
DRAWS = (8, 16, 32, 64)
BAR_REL = 0.005    # held-out CE and KL within 0.5% of online KD's
BAR_BYTES = 40.0   # bytes/token
ECE_BINS = 15


def split_div(mode: str):
    """(cache or student kind, divergence) of a mode: 'rkl_' prefixes the reverse-KL students; '@S' suffixes a
    student trained with train.seed S (the run-to-run spread)."""
    mode = mode.split("@")[0]
    return (mode[4:], "reverse_kl") if mode.startswith("rkl_") else (mode, "forward_kl")


class SampledBench(TopPBench):
    def __init__(self, out: str, s, device: str = "cpu", resume: str = ""):
        super().__init__(out, s, progress=False)
        self.device = device      # train.device of every stage
        self.resume = resume      # the command that resumes this run (said when a stage fails)
        self.threads = None       # OMP_NUM_THREADS of each student process while several train at once
        self.times_lock = threading.Lock()
        # the in-process cache builds set and unset the process group's variables while the students' threads
        # copy the environment: one at a time
        self.env_lock = threading.Lock()

    def say(self, text: str) -> None:
        with SAY_LOCK:  # whole lines while students finish in several threads
            print(f"[sampled_fidelity] {text}", flush=True)

    def common(self, stage: str, iters: int, lr: float) -> list:
        return super().common(stage, iters, lr) + [f"train.device={self.device}"]

    def finish(self, stage: str, seconds: float) -> None:
        with self.times_lock:  # students finish in several threads
            self.times[stage] = seconds
            times = dict(self.times)
            with open(os.path.join(self.out, TIMES), "w") as f:
                json.dump(times, f, indent=2)

    def child_env(self) -> dict:
        with self.env_lock:
            env = super().child_env()
        if self.threads and "OMP_NUM_THREADS" not in env:  # students side by side share the cores
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env

    def resume_command(self) -> str:
        return self.resume or super().resume_command()

    def offline(self, mode: str) -> list:
        s = self.s
        base, div = split_div(mode)
        o = self.common(f"student_{mode}", s.student_iters, s.student_lr)
        o = [x.replace(f"train.eval_interval={s.eval_interval}", f"train.eval_interval={s.student_iters}") for x in o]
        if "@" in mode:
            o = [x.replace(f"train.seed={s.seed}", f"train.seed={mode.split('@')[1]}") for x in o]
        teacher = f"teacher.load={os.path.join(self.out, 'teacher')}"
        if base == "online_full":
            return o + ["kd=online", f"kd.top_k={self.vocab}", "kd.tail=none", f"kd.divergence={div}", teacher]
        if base == "ce":
            return o + ["kd=ce"]
        cache = [f"kd.cache={os.path.join(self.out, cache_name(base))}", "kd.build_cache=false", teacher,
                 f"kd.divergence={div}"]
        if base.startswith("sampled_"):
            n = int(base.split("_")[1])
            return o + ["kd=offline", f"kd.top_k={n}", "kd.tail=none", "kd.cache_encoding=sampled",
                        f"kd.cache_samples={n}"] + cache
        tail = "bucket" if div == "reverse_kl" else "none"
        return o + ["kd=offline", f"kd.top_k={s.top_k}", f"kd.tail={tail}"] + cache + cache_overrides(base)


def evaluate(bench: SampledBench, modes, num_samples: int) -> dict:
    """Held-out CE, KL(teacher || student) and ECE of each student's final checkpoint (dense logits, whole
    vocabulary), and the teacher's CE, ECE, top-1 probability and entropy on the held-out and training samples."""
    import torch
    from megatron_kd.checkpoint.store import iter_dir
    from megatron_kd.data.datasets import build_datasets, load_tokenizer, loader, samples_needed
    from megatron_kd.models.hook import forward_with_head
    from megatron_kd.runtime.dist import distributed
    from megatron_kd.training.evaluate import _load

    r = bench.recipe("online_full")
    vocab = load_tokenizer(r.data).vocab_size
    s = bench.s

    def logits(model, batch):
        out = {}

        def head(hidden, weight):
            out["z"] = (hidden @ weight.t())[..., :vocab].transpose(0, 1)
            return hidden.new_empty((hidden.shape[0], hidden.shape[1], 0))
        forward_with_head(model, head, batch["tokens"], batch["position_ids"], None)
        return out["z"].double()

    def acc(dev):
        z = dict(dtype=torch.float64, device=dev)
        return {"n": 0, "ce": 0.0, "kl": 0.0, "conf": torch.zeros(ECE_BINS, **z), "hit": torch.zeros(ECE_BINS, **z),
                "cnt": torch.zeros(ECE_BINS, **z)}

    def add(a, lq, labels, lt=None):
        a["n"] += labels.numel()
        a["ce"] += float(-lq.gather(-1, labels[..., None]).sum())
        if lt is not None:
            a["kl"] += float((lt.exp() * (lt - lq)).sum())
        conf, pred = lq.exp().max(-1)
        b = (conf * ECE_BINS).long().clamp(max=ECE_BINS - 1).flatten()
        a["conf"].index_add_(0, b, conf.flatten())
        a["hit"].index_add_(0, b, (pred == labels).double().flatten())
        a["cnt"].index_add_(0, b, torch.ones_like(conf).flatten())

    def done(a, kl=True):
        ece = float(((a["hit"] - a["conf"]).abs()).sum() / a["n"])
        out = {"ce": a["ce"] / a["n"], "ece": ece, "positions": a["n"]}
        if kl:
            out["kl"] = a["kl"] / a["n"]
        return out

    def teacher_stats(lt):
        p = lt.exp()
        ent = -(p * lt).sum(-1)
        return p.max(-1).values.flatten(), ent.flatten()

    with torch.no_grad(), distributed(r.parallel, r.train.seed, r.train.device) as cuda:
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

        def batches(dataset):  # on the models' device
            for batch in loader(dataset, num_samples, 0, min(16, num_samples), 0, 1):
                yield {k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()}
        train, valid = build_datasets(r.data, load_tokenizer(r.data), samples_needed(r.train, r.data)[0], num_samples)
        t_model = _load(r.teacher, os.path.join(bench.out, "teacher"), r, vocab)
        models = {m: _load(r.model, iter_dir(os.path.join(bench.out, f"student_{m}"), s.student_iters), r, vocab)
                  for m in modes}
        sums = {m: acc(dev) for m in ["teacher", *modes]}
        top1, ent = [], []
        for batch in batches(valid):
            labels = batch["labels"]
            lt = torch.log_softmax(logits(t_model, batch), -1)
            add(sums["teacher"], lt, labels)
            a, b = teacher_stats(lt)
            top1.append(a)
            ent.append(b)
            for m, model in models.items():
                add(sums[m], torch.log_softmax(logits(model, batch), -1), labels, lt)
        tr_top1, tr_ent = [], []
        for batch in batches(train):  # what the caches were built from
            a, b = teacher_stats(torch.log_softmax(logits(t_model, batch), -1))
            tr_top1.append(a)
            tr_ent.append(b)
    out = {m: done(sums[m]) for m in modes}
    out["teacher"] = done(sums["teacher"], kl=False)

    def stats(t1, e):
        t1, e = torch.cat(t1), torch.cat(e)
        return {"top1_prob_mean": float(t1.mean()), "top1_prob_median": float(t1.median()),
                "top1_prob_p90": float(t1.quantile(0.9)), "entropy_mean": float(e.mean()),
                "entropy_median": float(e.median()), "positions": int(t1.numel())}
    out["teacher_distribution"] = {"held_out": stats(top1, ent), "train": stats(tr_top1, tr_ent)}
    return out


LABELS = {"fp16": "top-K 100, fp16", "compact": "top-K 100, compact", "online_full": "online KD, full vocabulary",
          "ce": "CE only (no teacher)"}


def label(mode: str) -> str:
    base, div = split_div(mode)
    if base.startswith("topp_"):
        text = f"top-P {base[5:]} (K<=100)"
    elif base.startswith("sampled_"):
        text = f"sampled N={base[8:]}"
    else:
        text = LABELS[base]
    seed = f" (train.seed {mode.split('@')[1]})" if "@" in mode else ""
    return text + (", reverse KL" if div == "reverse_kl" else "") + seed


def table(res: dict) -> str:
    f = res["final"]
    lines = ["| student | divergence (tail) | cache bytes/token | ids/position | held-out CE | KL to teacher | ECE | "
             "CE vs online (same seed) | KL vs online (same seed) |", "|---|---|---|---|---|---|---|---|---|"]
    for m in res["modes"]:
        base, div = split_div(m)
        seed = "@" + m.split("@")[1] if "@" in m else ""  # against online KD of the same train.seed (paired)
        ref = f.get(("rkl_online_full" if div == "reverse_kl" and "rkl_online_full" in f else "online_full") + seed)
        c = res["caches"].get(base)
        b = f"{c['bytes_per_token']:.2f}" if c else "-"
        k = f"{c['ids_per_position']:.1f}" if c else ("V" if base == "online_full" else "-")
        tail = "-" if base == "ce" else ("bucket" if div == "reverse_kl" and c else "none")
        dname = "-" if base == "ce" else ("reverse KL" if div == "reverse_kl" else "forward KL")
        rel = [f"{(f[m][key] - ref[key]) / ref[key] * 100:+.2f}%" if ref else "-" for key in ("ce", "kl")]
        lines.append(f"| {label(m)} | {dname} ({tail}) | {b} | {k} | {f[m]['ce']:.4f} | {f[m]['kl']:.4f} | "
                     f"{f[m]['ece']:.4f} | {rel[0]} | {rel[1]} |")
    t = res["final"]["teacher"]
    lines.append(f"| teacher (reference) | | | | {t['ce']:.4f} | - | {t['ece']:.4f} | | |")
    if res.get("unfinished"):
        lines.append("")
        lines.append(f"Not trained in this run (--budget-s {res.get('budget_s')}, or failed): "
                     + "; ".join(label(m) for m in res["unfinished"]) + ".")
    d = res["teacher_distribution"]
    lines.append("")
    lines.append(f"Teacher ({res['settings']['teacher_iters']} steps): held-out top-1 probability mean "
                 f"{d['held_out']['top1_prob_mean']:.3f} (median {d['held_out']['top1_prob_median']:.3f}), entropy "
                 f"mean {d['held_out']['entropy_mean']:.3f} nats; on the training samples the caches hold: top-1 "
                 f"{d['train']['top1_prob_mean']:.3f}, entropy {d['train']['entropy_mean']:.3f} nats.")
    return "\n".join(lines)


def plot(res: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    f = res["final"]
    if "online_full" not in f:  # the panels are relative to it
        print(f"[sampled_fidelity] no plot: online KD (the reference) did not finish; {png} not written", flush=True)
        return
    fwd = [m for m in res["modes"] if split_div(m)[1] == "forward_kl" and m != "ce"]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8))
    ref = f["online_full"]
    colors = ["tab:orange" if m == "online_full" else "tab:green" if m.startswith("sampled") else "tab:blue"
              for m in fwd]
    for ax, key, title in ((axes[0], "ce", "held-out CE"), (axes[1], "kl", "held-out KL to the teacher")):
        for m, c in zip(fwd, colors):
            b = res["caches"].get(m, {}).get("bytes_per_token")
            x = b if b else 1.0
            ax.scatter([x], [(f[m][key] - ref[key]) / ref[key] * 100], color=c)
            ax.annotate(label(m).replace(" (K<=100)", ""), (x, (f[m][key] - ref[key]) / ref[key] * 100), fontsize=7)
        ax.axhline(BAR_REL * 100, color="tab:red", linestyle="--", label="+0.5% of online KD")
        ax.axvline(BAR_BYTES, color="tab:gray", linestyle=":", label="40 bytes/token")
        ax.set(xscale="log", xlabel="cache bytes/token (online: plotted at 1)", ylabel="% vs online KD",
               title=f"{title}, forward KL")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    x = list(range(len(fwd)))
    axes[2].bar(x, [f[m]["ece"] for m in fwd], color=colors)
    axes[2].axhline(f["teacher"]["ece"], color="k", linestyle=":", label="teacher")
    axes[2].set_xticks(x)
    axes[2].set_xticklabels([label(m).replace(" (K<=100)", "") for m in fwd], rotation=35, fontsize=7, ha="right")
    axes[2].set(title="expected calibration error (15 bins)", ylabel="ECE")
    axes[2].legend(fontsize=7)
    rkl = [m for m in res["modes"] if split_div(m)[1] == "reverse_kl"]
    if rkl:
        x = list(range(len(rkl)))
        axes[3].bar(x, [f[m]["kl"] for m in rkl], color="tab:purple")
        axes[3].set_xticks(x)
        axes[3].set_xticklabels([label(m).replace(", reverse KL", "").replace(" (K<=100)", "") for m in rkl],
                                rotation=35, fontsize=7, ha="right")
        axes[3].set(title="reverse-KL students: held-out KL(teacher || student)\n(top-K / top-P: tail bucket; "
                          "sampled: refused)", ylabel="nats/token")
    d = res["teacher_distribution"]["held_out"]
    s = res["settings"]
    fig.suptitle(f"Sampled caches vs top-K / top-P / online KD (pydoc text, vocab {s['vocab_size']}, "
                 f"{s['student_iters']} steps x {s['global_batch_size']}x{s['seq_length']} tokens, one seed; teacher "
                 f"{s['teacher_iters']} steps: held-out top-1 {d['top1_prob_mean']:.2f}, entropy "
                 f"{d['entropy_mean']:.2f} nats)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def student_order(modes, seed_check, seed: int) -> list:
    """The order students start in: online KD (the reference), each --seed-check mode beside its train.seed + 1
    twin, the sampled caches' students, then the rest in table order; a run cut short by --budget-s holds what the
    verdict and the run-to-run spread need first."""
    first = ["online_full"]
    for m in seed_check:
        first += [m, f"{m}@{seed + 1}"]
    first += [m for m in modes if split_div(m)[0].startswith("sampled_")]
    head = [m for m in dict.fromkeys(first) if m in modes]
    return head + [m for m in modes if m not in head]


def build_indices(bench: SampledBench) -> None:
    """The students' dataset index files, built here before students start side by side: megatron-core's
    GPTDataset writes them on first use with no lock, so a student could read one another is writing."""
    from megatron_kd.data.datasets import build_datasets, load_tokenizer, samples_needed
    r = bench.recipe("online_full")  # every student has the same data and sample counts
    build_datasets(r.data, load_tokenizer(r.data), *samples_needed(r.train, r.data))


def run_students(bench: SampledBench, order, overrides: dict, caches, build, jobs: int, deadline: float) -> dict:
    """Trains the students of `order` (finished ones are kept), `jobs` `megatron-kd train` processes at a time (each
    one's output in <out>/logs/student_<mode>.log when jobs > 1), starting none after `deadline` (time.time()).
    build(cache) builds a cache in this thread (or reads a finished one), in the order its first student comes:
    with jobs > 1 while the students that need no unbuilt cache train; with one job all caches first. No build
    starts after the deadline either; students and caches an earlier run finished are taken all the same.
    Returns {"finished": [...], "failed": {mode: log}, "not_started": [...]}."""
    from megatron_kd.cache.format import is_finished
    from megatron_kd.checkpoint.store import latest_iteration
    need = {m: split_div(m)[0] if split_div(m)[0] in caches else None for m in order}
    to_build = list(dict.fromkeys([need[m] for m in order if need[m]] + list(caches)))
    cond = threading.Condition()
    pending, ready, finished, failed = list(order), set(), [], {}
    state = {"building": True, "stop": False}

    def trained(m):
        d = os.path.join(bench.out, f"student_{m}")
        return latest_iteration(d) == bench.s.student_iters and os.path.exists(os.path.join(d, "summary.json"))

    def startable(m):
        return (need[m] is None or need[m] in ready) and (time.time() < deadline or trained(m))

    def worker():
        while True:
            with cond:
                while True:
                    if state["stop"]:
                        return
                    m = next((m for m in pending if startable(m)), None)
                    if m is not None:
                        pending.remove(m)
                        break
                    if not state["building"]:  # what is left is past the deadline or waits for an unbuilt cache
                        return
                    cond.wait(1.0)
            log = os.path.join(bench.out, "logs", f"student_{m}.log") if jobs > 1 else None
            t, earlier = time.time(), trained(m)
            try:
                rc = bench.stage_train(f"student_{m}", overrides[m], log=log)
            except Exception as e:  # the process could not be started: the others go on
                bench.say(f"student_{m}: {type(e).__name__}: {e}")
                rc = 1
            with cond:
                if rc:
                    failed[m] = log
                else:
                    finished.append(m)
                if jobs > 1 and not earlier:
                    bench.say(f"student_{m} {'FAILED' if rc else 'done'} after {time.time() - t:.0f} s "
                              f"({len(finished)} done, {len(failed)} failed, {len(pending)} waiting)")
                cond.notify_all()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(jobs if jobs > 1 else 0)]
    for t in threads:
        t.start()
    try:
        for c in to_build:
            if time.time() >= deadline and not is_finished(os.path.join(bench.out, cache_name(c))):
                bench.say(f"--budget-s: cache {c} not built")
                continue
            with bench.env_lock:
                build(c)
            with cond:
                ready.add(c)
                cond.notify_all()
        with cond:
            state["building"] = False
            cond.notify_all()
        if threads:
            for t in threads:
                t.join()
        else:
            worker()
    except BaseException as e:
        with cond:  # start no more students
            state["stop"] = True
            cond.notify_all()
        if not isinstance(e, KeyboardInterrupt):  # (an interrupt reaches the students too)
            for t in threads:  # a failed cache build: the running students end before this process does
                t.join()
        raise
    return {"finished": finished, "failed": failed, "not_started": pending}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="work directory (default runs/sampled_fidelity[_peaked][_small])")
    p.add_argument("--results", default=None, help="results path without extension (default results/"
                   "sampled_fidelity[_peaked][_small]_cpu; required with a GPU)")
    p.add_argument("--top-p", default=",".join(map(str, TOP_PS)), help="the P values, comma-separated")
    p.add_argument("--draws", default=",".join(map(str, DRAWS)), help="the N of the sampled caches")
    p.add_argument("--peaked", action="store_true", help="train the teacher --peaked-factor times longer")
    p.add_argument("--peaked-factor", type=float, default=4.0)
    p.add_argument("--no-reverse", action="store_true", help="skip the reverse-KL students")
    p.add_argument("--seed-check", default="", help="modes to train again with train.seed + 1 (comma-separated, "
                   "e.g. online_full,sampled_32): the run-to-run spread the differences compare with")
    p.add_argument("--small", action="store_true", help="smoke-test sizes")
    p.add_argument("--teacher-iters", type=int, default=None)
    p.add_argument("--student-iters", type=int, default=None)
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="where every stage runs (train.device; auto: cuda when a GPU is visible); default cpu")
    p.add_argument("--jobs", type=int, default=1, help="students trained at a time (default 1)")
    p.add_argument("--budget-s", type=float, default=None, help="start no student after this many seconds; "
                   "evaluate the finished ones (a rerun trains the rest)")
    p.add_argument("--overwrite", action="store_true", help="discard a previous run in --out")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG and table from the results JSON")
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    tag = "_peaked" * args.peaked + "_small" * args.small
    args.out = args.out or f"runs/sampled_fidelity{tag}"
    default_results = os.path.join(HERE, "results", f"sampled_fidelity{tag}_cpu")
    if args.plot_only:
        return redraw(args.results or default_results, plot, table)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: give at least 1")
    import torch
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible to torch; use --device cpu")
    if args.results is None and device != "cpu":
        p.error("--device cuda: give --results PATH (without extension, named after the GPU, e.g. "
                "benchmarks/results/sampled_fidelity_h200)")
    args.results = args.results or default_results
    from megatron_kd.runtime.quiet import quiet_megatron_warnings
    quiet_megatron_warnings()
    top_ps = [float(x) for x in args.top_p.split(",") if x]
    draws = [int(x) for x in args.draws.split(",") if x]
    kw = dict(SMALL) if args.small else {}
    s0 = BenchSettings(**kw)
    if args.peaked:
        kw["teacher_iters"] = int(s0.teacher_iters * args.peaked_factor)
    if args.teacher_iters:
        kw["teacher_iters"] = args.teacher_iters
    if args.student_iters:
        kw["student_iters"] = args.student_iters
    s = BenchSettings(**kw)
    caches = ["fp16", "compact"] + [f"topp_{P}" for P in top_ps] + [f"sampled_{n}" for n in draws]
    modes = caches + ["online_full", "ce"]
    if not args.no_reverse:
        modes += ["rkl_online_full"] + [f"rkl_{c}" for c in caches if not c.startswith("sampled_")]
    seed_check = [m for m in args.seed_check.split(",") if m]
    if any(m not in modes for m in seed_check):
        p.error(f"--seed-check {args.seed_check}: {', '.join(m for m in seed_check if m not in modes)} is no "
                f"student of this run; give some of {','.join(modes)}")
    modes += [f"{m}@{s.seed + 1}" for m in seed_check]
    out = os.path.abspath(args.out)
    prepare_out_dir(out, s, args.overwrite)
    command = "python benchmarks/sampled_fidelity.py " + shlex.join(argv)
    bench = SampledBench(out, s, device, command.replace(" --overwrite", ""))
    t0 = time.time()
    deadline = STARTED + args.budget_s if args.budget_s is not None else float("inf")
    bench.stage_data()
    if bench.stage_train("teacher", bench.teacher_overrides()):
        return 2
    from megatron_kd.cache import inspect_cache
    info = {}

    def build(m):
        bench.build(m)
        i = inspect_cache(os.path.join(out, cache_name(m)), max_samples=8)
        info[m] = {k: i[k] for k in ("bytes_per_token", "mean_mass_covered", "kl_error_mean", "total_bytes",
                                     "kept_k_quantiles") if k in i}
        info[m]["ids_per_position"] = i.get("kept_k_mean", i["top_k"])
        bench.say(f"{m}: {json.dumps(info[m])}")
    order = student_order(modes, seed_check, s.seed)
    overrides = {m: bench.offline(m) for m in modes}
    commands = {m: "megatron-kd train " + " ".join(o) for m, o in overrides.items()}
    if args.jobs > 1:
        build_indices(bench)
        if "OMP_NUM_THREADS" not in os.environ:
            bench.threads = max(1, (os.cpu_count() or 1) // args.jobs)
    t = time.time()
    got = run_students(bench, order, overrides, caches, build, args.jobs, deadline)
    bench.times["students_wall"] = time.time() - t
    done = [m for m in modes if m in got["finished"]]
    unfinished = [m for m in modes if m not in done]
    if unfinished:
        bench.say(f"not trained: {', '.join(unfinished)}"
                  + "".join(f"; {m} failed, its output: {log or 'above'}" for m, log in got["failed"].items()))
    t = time.time()
    metrics = evaluate(bench, done, s.eval_samples)
    bench.times["evaluate"] = time.time() - t
    final = {m: metrics[m] for m in done + ["teacher"]}
    verdict = {}
    ref = final.get("online_full")
    for n in draws:
        m = f"sampled_{n}"
        if ref is None or m not in final:
            continue
        rel = {k: (final[m][k] - ref[k]) / ref[k] for k in ("ce", "kl")}
        verdict[m] = {"rel_vs_online": rel, "bytes_per_token": info[m]["bytes_per_token"],
                      "within_0.5pct": all(v <= BAR_REL for v in rel.values()),
                      "at_most_40_bytes": info[m]["bytes_per_token"] <= BAR_BYTES}
        verdict[m]["meets_bar"] = verdict[m]["within_0.5pct"] and verdict[m]["at_most_40_bytes"]
    from common import environment
    res = {"benchmark": "students from top-K / top-P / sampled caches of one teacher vs online full-vocabulary KD",
           "command": command, "device": torch.cuda.get_device_name(0) if device == "cuda" else "CPU",
           "cpu_cores": os.cpu_count(), "jobs": args.jobs, "budget_s": args.budget_s,
           "environment": environment(), "settings": dataclasses.asdict(s), "top_ps": top_ps, "draws": draws,
           "modes": done, "unfinished": unfinished, "failed": got["failed"], "student_order": order,
           "labels": {m: label(m) for m in modes}, "student_commands": commands, "final": final, "caches": info,
           "teacher_distribution": metrics["teacher_distribution"], "ece_bins": ECE_BINS,
           "reverse_kl_sampled": "refused by the loss: reverse KL's gradient is not linear in the teacher's "
                                 "probabilities, so count / N gives no unbiased estimate of it",
           "verdict": verdict, "bar": f"a sampled cache at <= {BAR_BYTES} bytes/token with held-out CE and KL within "
                                      f"{BAR_REL:.1%} of online KD's",
           "bar_met": any(v["meets_bar"] for v in verdict.values()), "stage_s": bench.times,
           "total_s": time.time() - t0}
    save(res, args.results, plot, table)
    left = f"; {len(unfinished)} students not trained (rerun the same command for them)" if unfinished else ""
    bench.say(f"bar ({res['bar']}): {'MET' if res['bar_met'] else 'MISSED'} over {len(verdict)} sampled caches"
              f"{left}; total {res['total_s']:.0f} s")
    if got["failed"]:
        return 2
    return 0 if res["bar_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
