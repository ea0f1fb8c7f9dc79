"""`megatron-kd demo`: the whole pipeline on a laptop CPU in a few minutes, on real English text.

    megatron-kd demo                    # ~3-4 minutes on 2 cores; results in runs/demo
    megatron-kd demo --small            # CI size (about a minute)
    megatron-kd demo --out DIR --overwrite

1. tokenizes the documentation CPython ships (pydoc_data) with a byte-level BPE trained on it (megatron-kd data prepare)
2. trains a tiny teacher GPT (megatron-kd train, CE)
3. builds the teacher's top-K cache over the students' training samples
4. distills a smaller student three ways on the same data and steps: offline (cache), online (teacher in
   memory), CE only (no teacher)
5. prints a table (held-out CE, KL to the teacher, tokens/s, peak memory), writes results.json, results.md
   and loss_curves.png

Each training stage is a `megatron-kd train` process (printed as it starts, so it can be rerun by hand);
peak memory is that process's. An interrupted demo resumes where it stopped; a finished one is kept unless
--overwrite.
"""
import argparse
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

RESULTS = "results.json"
SETTINGS = "demo_settings.json"


@dataclasses.dataclass
class Settings:
    vocab_size: int = 512        # small BPE: a tiny teacher gets sharp enough for top-K to hold most of its mass
    seq_length: int = 128
    teacher_iters: int = 400
    student_iters: int = 150
    global_batch_size: int = 16
    micro_batch_size: int = 16
    top_k: int = 32
    teacher_lr: float = 3e-3
    student_lr: float = 3e-3
    eval_samples: int = 64
    eval_interval: int = 50
    seed: int = 1234


SMALL = dict(seq_length=64, teacher_iters=250, student_iters=60, eval_samples=32, eval_interval=20)


def build_parser():
    p = argparse.ArgumentParser(prog="megatron-kd demo", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--small", action="store_true", help="CI size: smaller vocabulary, sequences and step counts")
    p.add_argument("--overwrite", action="store_true", help="discard a previous demo's results in --out")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of progress bars")
    p.add_argument("--teacher-iters", type=int, default=None)
    p.add_argument("--student-iters", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=None)
    return p


def settings_from(args) -> Settings:
    s = Settings(**(SMALL if args.small else {}))
    for name in ("teacher_iters", "student_iters", "top_k", "vocab_size", "seq_length"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    return s


def main(argv=None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from ..megatron import quiet_megatron_warnings
    quiet_megatron_warnings()
    s = settings_from(args)
    out = os.path.abspath(args.out)
    try:
        prepare_out_dir(out, s, args.overwrite)
    except FileExistsError as e:
        print(f"megatron-kd demo: {e}", file=sys.stderr)
        return 2
    return Demo(out, s, progress=not args.no_progress).run()


def prepare_out_dir(out: str, s: Settings, overwrite: bool) -> None:
    """Refuse to replace a finished demo (or resume one with other settings) unless overwrite."""
    done = os.path.exists(os.path.join(out, RESULTS))
    settings_path = os.path.join(out, SETTINGS)
    prev = json.load(open(settings_path)) if os.path.exists(settings_path) else None
    if (done or (prev is not None and prev != dataclasses.asdict(s))) and not overwrite:
        why = "holds a finished demo" if done else "holds a demo started with other settings"
        raise FileExistsError(f"{out} {why} ({RESULTS if done else SETTINGS}); pass --overwrite to replace it, "
                              "or --out DIR for a new one")
    if overwrite and os.path.isdir(out):
        if not os.path.exists(settings_path) and os.listdir(out):
            raise FileExistsError(f"{out} is not empty and holds no demo ({SETTINGS}); not deleting it. Choose "
                                  "another --out")
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)
    with open(settings_path, "w") as f:
        json.dump(dataclasses.asdict(s), f, indent=2)


class Demo:
    def __init__(self, out: str, s: Settings, progress: bool = True):
        self.out, self.s, self.progress = out, s, progress
        self.data_prefix = os.path.join(out, "data", "pydoc_text_document")
        self.tokenizer = os.path.join(out, "data", "tokenizer.json")
        self.cache = os.path.join(out, "cache")
        self.times = {}

    def say(self, text: str) -> None:
        print(f"[demo] {text}", flush=True)

    # --- stages ------------------------------------------------------------------------------------------

    def run(self) -> int:
        t0 = time.time()
        self.stage_data()
        rc = self.stage_train("teacher", self.teacher_overrides())
        if rc:
            return rc
        self.stage_cache()
        for mode in ("offline", "online", "ce"):
            rc = self.stage_train(f"student_{mode}", self.student_overrides(mode))
            if rc:
                return rc
        results = self.stage_compare()
        results["total_s"] = time.time() - t0
        self.report(results)
        return 0

    def stage_data(self) -> None:
        if os.path.exists(self.data_prefix + ".json"):
            self.say(f"data: {self.data_prefix}.bin present")
            return
        from ..megatron.corpus import prepare, pydoc_documents
        t = time.time()
        self.say("data: tokenizing pydoc_data (CPython's documentation) with a byte-level BPE of "
                 f"{self.s.vocab_size} ids  [megatron-kd data prepare --pydoc --output-prefix {self.data_prefix} "
                 f"--vocab-size {self.s.vocab_size}]")
        info = prepare(pydoc_documents(), self.data_prefix, vocab_size=self.s.vocab_size)
        self.times["data"] = time.time() - t
        self.say(f"data: {info['documents']} documents, {info['tokens']} tokens ({self.times['data']:.1f} s)")

    def common(self, stage: str, iters: int, lr: float) -> list:
        s = self.s
        d = os.path.join(self.out, stage)
        return ["--config-name", "tiny_cpu", "data=pydoc", f"data.path={self.data_prefix}",
                f"data.tokenizer={self.tokenizer}", f"data.seq_length={s.seq_length}", f"data.seed={s.seed}",
                f"train.iters={iters}", f"train.global_batch_size={s.global_batch_size}",
                f"train.micro_batch_size={s.micro_batch_size}", f"train.lr={lr}", f"train.min_lr={lr / 10}",
                f"train.lr_warmup_iters={max(1, iters // 20)}", f"train.eval_interval={s.eval_interval}",
                f"train.eval_iters={max(1, s.eval_samples // s.global_batch_size)}", "train.save_interval=null",
                f"train.log_interval={max(1, iters // 40)}", f"train.progress={str(self.progress).lower()}",
                f"train.seed={s.seed}", f"train.save={d}", f"hydra.run.dir={d}"]

    def teacher_overrides(self) -> list:
        return self.common("teacher", self.s.teacher_iters, self.s.teacher_lr) + ["model=tiny_teacher", "kd=ce"]

    def student_overrides(self, mode: str) -> list:
        o = self.common(f"student_{mode}", self.s.student_iters, self.s.student_lr) + [f"kd={mode}"]
        if mode != "ce":
            o += [f"kd.top_k={self.s.top_k}", f"teacher.load={os.path.join(self.out, 'teacher')}"]
        if mode == "offline":
            o += [f"kd.cache={self.cache}", "kd.build_cache=false"]
        return o

    def stage_train(self, stage: str, overrides: list) -> int:
        from ..megatron.checkpoint import latest_iteration
        iters = int(next(o.split("=", 1)[1] for o in overrides if o.startswith("train.iters=")))
        d = os.path.join(self.out, stage)
        if latest_iteration(d) == iters and os.path.exists(os.path.join(d, "summary.json")):
            self.say(f"{stage}: already trained ({d})")
            return 0
        cmd = ["megatron-kd", "train", *overrides]
        self.say(f"{stage}: $ {shlex.join(cmd)}")
        t = time.time()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                 "MASTER_PORT")}
        # OpenMP threads that spin while waiting make small CPU steps many times slower whenever another
        # process wants the cores; sleeping waiters cost almost nothing on an idle machine.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        rc = subprocess.call([sys.executable, "-m", "megatron_kd", "train", *overrides], env=env)
        self.times[stage] = time.time() - t
        if rc:
            self.say(f"{stage}: failed (exit {rc}); rerun `megatron-kd demo --out {self.out}` to resume")
        return rc

    def stage_cache(self) -> None:
        if os.path.exists(os.path.join(self.cache, "manifest.json")):
            self.say(f"cache: {self.cache} present")
            return
        from ..megatron.config import to_recipe
        from ..megatron.recipes import compose
        from ..megatron.train import build_cache_only
        t = time.time()
        self.say(f"cache: teacher top-{self.s.top_k} over the students' {self.s.student_iters * self.s.global_batch_size}"
                 f" training samples -> {self.cache}")
        r = to_recipe(compose("tiny_cpu", recipe_overrides(self.student_overrides("offline"))))
        r.train.progress = self.progress
        m = build_cache_only(r)
        self.times["cache"] = time.time() - t
        self.say(f"cache: {m['num_samples']} samples, {m['bytes_per_token']:.1f} bytes/token "
                 f"({self.times['cache']:.1f} s)")

    def stage_compare(self) -> dict:
        from ..megatron.config import to_recipe
        from ..megatron.evaluate import compare
        from ..megatron.recipes import compose
        t = time.time()
        r = to_recipe(compose("tiny_cpu", recipe_overrides(self.student_overrides("online"))))
        students = {mode: (r.model, os.path.join(self.out, f"student_{mode}")) for mode in ("offline", "online", "ce")}
        self.say(f"compare: held-out CE and KL(teacher || student) over {self.s.eval_samples} validation samples")
        metrics = compare(r, os.path.join(self.out, "teacher"), students, self.s.eval_samples,
                          min(self.s.micro_batch_size, self.s.eval_samples))
        self.times["compare"] = time.time() - t
        rows = {}
        for stage in ("teacher", "student_offline", "student_online", "student_ce"):
            summary = json.load(open(os.path.join(self.out, stage, "summary.json")))
            key = "teacher" if stage == "teacher" else stage.split("_", 1)[1]
            rows[key] = {**metrics[key], "tokens_per_s": summary["tokens_per_s"],
                         "peak_mem_gib": summary["peak_mem_gib"], "train_s": self.times.get(stage),
                         "iters": summary["iters"]}
        return {"settings": dataclasses.asdict(self.s), "rows": rows, "stage_s": self.times,
                "offline_beats_ce_on_kl": rows["offline"]["kl"] < rows["ce"]["kl"]}

    # --- outputs -----------------------------------------------------------------------------------------

    def report(self, results: dict) -> None:
        table = format_table(results)
        print("\n" + table + "\n", flush=True)
        png = os.path.join(self.out, "loss_curves.png")
        plot_curves(self.out, png)
        results["loss_curves"] = png
        with open(os.path.join(self.out, "results.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(self.out, RESULTS), "w") as f:
            json.dump(results, f, indent=2)
        verdict = "beats" if results["offline_beats_ce_on_kl"] else "does NOT beat"
        self.say(f"offline top-{self.s.top_k} KD {verdict} CE-only on KL to the teacher; "
                 f"total {results['total_s']:.0f} s; {png}, {os.path.join(self.out, RESULTS)}")


def recipe_overrides(argv: list) -> list:
    """The recipe overrides of a `megatron-kd train` argument list (no --config-name, no hydra.*)."""
    return [a for a in argv[2:] if not a.startswith("hydra.")]


def format_table(results: dict) -> str:
    rows = results["rows"]
    head = "| model | held-out CE | KL to teacher | tokens/s | peak memory | train time |"
    lines = [head, "|---|---|---|---|---|---|"]
    names = {"teacher": "teacher (reference)", "offline": "student: offline top-K KD", "online":
             "student: online KD (teacher in memory)", "ce": "student: CE only"}
    for key in ("teacher", "offline", "online", "ce"):
        r = rows[key]
        kl = "-" if "kl" not in r else f"{r['kl']:.4f}"
        tt = "-" if r.get("train_s") is None else f"{r['train_s']:.0f} s"
        lines.append(f"| {names[key]} | {r['ce']:.4f} | {kl} | {r['tokens_per_s']:.0f} | "
                     f"{r['peak_mem_gib'] * 1024:.0f} MiB | {tt} |")
    return "\n".join(lines)


def read_metrics(path: str) -> dict:
    """{kind: {iteration: record}} from metrics.jsonl; a resumed run's later record for an iteration wins."""
    out = {}
    if os.path.exists(path):
        for line in open(path):
            rec = json.loads(line)
            out.setdefault(rec.get("kind"), {})[rec.get("iteration")] = rec
    return out


def plot_curves(out: str, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"offline": "tab:blue", "online": "tab:orange", "ce": "tab:green"}
    for mode, color in colors.items():
        m = read_metrics(os.path.join(out, f"student_{mode}", "metrics.jsonl"))
        train = sorted(m.get("train", {}).values(), key=lambda r: r["iteration"])
        ev = sorted(m.get("eval", {}).values(), key=lambda r: r["iteration"])
        if mode != "ce":
            axes[0].plot([r["iteration"] for r in train], [r["kl"] for r in train], color=color,
                         linestyle="--" if mode == "online" else "-", label=f"{mode}: KL to teacher top-K (train)")
            kb = [r for r in train if r.get("kl_bucket") is not None]  # issue 20: the monitor, a true KL (>= 0)
            if kb:
                axes[0].plot([r["iteration"] for r in kb], [r["kl_bucket"] for r in kb], color=color, linestyle=":",
                             label=f"{mode}: bucket-tail KL (>= 0, train)")
        axes[1].plot([r["iteration"] for r in train], [r["ce"] for r in train], color=color, alpha=0.5,
                     label=f"{mode}: train CE")
        axes[1].plot([r["iteration"] for r in ev], [r["ce"] for r in ev], "o-", color=color,
                     label=f"{mode}: held-out CE")
    axes[0].set(title="distillation loss: offline cache vs online teacher", xlabel="iteration", ylabel="nats/token")
    axes[1].set(title="cross-entropy", xlabel="iteration", ylabel="nats/token")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
