"""`megatron-kd demo`: the whole pipeline on a laptop CPU in a few minutes, on real English text.

    megatron-kd demo                    # 2 CPU cores: 3 minutes idle, 10 at load average 8; results in runs/demo
    megatron-kd demo --small            # CI size (2 CPU cores: about 1 minute idle, 6 at load average 8)
    megatron-kd demo --out DIR --overwrite
    megatron-kd demo --recover          # then prune the teacher and win it back three ways (cli/recover.py)
    megatron-kd demo --recover --quantize fp8   # or quantize it (PTQ) and win it back: QAT, QAD offline, online

Seven stages, each printed as [demo i/7 STAGE] with the time so far and an estimate of the rest:
1. data: tokenizes the documentation CPython ships (pydoc_data) with a byte-level BPE trained on it
   (megatron-kd data prepare)
2. teacher: trains a tiny teacher GPT (megatron-kd train, CE)
3. cache: builds the teacher's top-K cache over the students' training samples
4-6. students: distills a smaller student three ways on the same data and steps: offline (cache), online
   (teacher in memory), CE only (no teacher)
7. compare: held-out CE and KL to the teacher's full distribution; prints the table and writes results.md
   (the README's table), results.json and loss_curves.png

Each training stage is a `megatron-kd train` process (printed as it starts, so it can be rerun by hand);
peak memory is that process's. The offline row's time is cache build + training (the online row pays for
its teacher inside training). An interrupted demo resumes where it stopped and keeps the finished stages'
times (stage_times.json); a finished one is kept unless --overwrite.
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

from ..recipe.targets import MODES, TargetSource
from ..report.runs import fmt_s, machine, plot_curves

RESULTS = "results.json"
SETTINGS = "demo_settings.json"
TIMES = "stage_times.json"  # seconds per finished stage, kept across resumes
STAGES = ("data", "teacher", "cache", "student_offline", "student_online", "student_ce", "compare")
# Share of the default demo's time per stage (2 CPU cores, 2026-12-01; an idle machine's run), for the ETA
# before a stage's own time is known; teacher, cache and student stages scale with their steps.
SHARE = {"data": 0.02, "teacher": 0.45, "cache": 0.10, "student_offline": 0.13, "student_online": 0.19,
         "student_ce": 0.09, "compare": 0.02}


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


def _formats() -> str:
    """The quantization formats --quantize takes here, from the registry: the CPU ones, then those on a GPU."""
    from ..quant_formats import FORMATS
    cpu = [n for n, f in FORMATS.items() if n != "none" and not f.cuda_only]
    gpu = [n for n, f in FORMATS.items() if f.cuda_only]
    return ", ".join(cpu) + (f"; {', '.join(gpu)} on a GPU" if gpu else "")


def build_parser():
    d = Settings()
    p = argparse.ArgumentParser(prog="megatron-kd demo", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--small", action="store_true",
                   help=f"CI size: sequences of {SMALL['seq_length']}, {SMALL['teacher_iters']} teacher and "
                        f"{SMALL['student_iters']} student steps (2 CPU cores: about 1 minute idle, 6 at load 8)")
    p.add_argument("--overwrite", action="store_true", help="discard a previous demo's results in --out")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of progress bars")
    p.add_argument("--teacher-iters", type=int, default=None, metavar="N",
                   help=f"teacher training steps (default {d.teacher_iters})")
    p.add_argument("--student-iters", type=int, default=None, metavar="N",
                   help=f"steps of each of the three students (default {d.student_iters})")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help=f"teacher ids per position in the cache and online (default {d.top_k})")
    p.add_argument("--vocab-size", type=int, default=None, metavar="V",
                   help=f"size of the BPE vocabulary trained on the text (default {d.vocab_size})")
    p.add_argument("--seq-length", type=int, default=None, metavar="S",
                   help=f"tokens per training sample (default {d.seq_length})")
    p.add_argument("--recover", action="store_true",
                   help="after the demo (run now, or the finished one in --out): prune its teacher to half its "
                        "layers and train the pruned model with CE only, offline top-K KD and online KD, "
                        "each on the students' samples and steps; recover.md in --out")
    p.add_argument("--recover-lr", type=float, default=None, metavar="LR",
                   help=f"--recover: their peak learning rate (default {RECOVER_LR:g}; with --quantize "
                        f"{QUANT_LR:g})")
    p.add_argument("--quantize", default=None, metavar="FORMAT",
                   help="--recover from the teacher fake-quantized as FORMAT by NVIDIA ModelOpt (quant.format: "
                        f"{_formats()}) instead of pruned: PTQ, then QAT "
                        "(CE only), QAD offline (the demo's cache) and online; recover_FORMAT.md in --out")
    p.add_argument("--calib-samples", type=int, default=64, metavar="N",
                   help="--quantize: training samples the quantizers are calibrated on (default 64)")
    return p


RECOVER_LR = 1e-3  # the pruned model starts trained: a third of the students' rate
QUANT_LR = 1e-4    # the quantized teacher starts next to the teacher: small steps keep it there


def settings_from(args) -> Settings:
    s = Settings(**(SMALL if args.small else {}))
    for name in ("teacher_iters", "student_iters", "top_k", "vocab_size", "seq_length"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    return s


def main(argv=None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    # OpenMP threads that spin while waiting make small CPU steps many times slower whenever another process
    # wants the cores (the cache stage runs in this process: 17 s idle, 184-273 s on a shared 2-core machine
    # before this). libgomp reads it once, when torch loads, which has not happened yet here.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from ..runtime.quiet import quiet_megatron_warnings
    quiet_megatron_warnings()
    s = settings_from(args)
    out = os.path.abspath(args.out)
    problem = check_settings(Demo(out, s, progress=False)) or quantize_problem(args)
    if problem:
        print(f"megatron-kd demo: error: {problem}", file=sys.stderr)
        return 2
    finished = finished_demo(out, s)
    if not (args.recover and finished and not args.overwrite):
        try:
            prepare_out_dir(out, s, args.overwrite)
        except FileExistsError as e:
            print(f"megatron-kd demo: {e}", file=sys.stderr)
            return 2
    demo = Demo(out, s, progress=not args.no_progress)
    rc = 0 if args.recover and finished and not args.overwrite else demo.run()
    if rc or not args.recover:
        return rc
    from .recover import run as recover
    lr = args.recover_lr if args.recover_lr is not None else QUANT_LR if args.quantize else RECOVER_LR
    return recover(demo, lr, args.quantize, args.calib_samples)


def quantize_problem(args) -> str | None:
    """--quantize / --calib-samples checked before any stage runs (the demo runs on the CPU)."""
    if args.quantize is None:
        return None
    if not args.recover:
        return "--quantize FORMAT is a kind of --recover: add --recover"
    if args.calib_samples < 1:
        return f"--calib-samples={args.calib_samples} must be >= 1"
    from ..recipe.checks import quant_problem
    return quant_problem(args.quantize, cuda=False, key="--quantize")


def finished_demo(out: str, s: Settings) -> bool:
    """`out` holds a finished demo of these settings (its results.json and demo_settings.json)."""
    path = os.path.join(out, SETTINGS)
    return os.path.exists(os.path.join(out, RESULTS)) and os.path.exists(path) and \
        json.load(open(path)) == dataclasses.asdict(s)


BPE_MIN_VOCAB = 257  # data.corpus.train_tokenizer: the 256 byte ids and <|endoftext|>

# the recipe key each flag becomes, so a refusal names the flag the user typed
FLAG_KEYS = {"kd.top_k": "--top-k", "data.seq_length": "--seq-length", "data.vocab_size": "--vocab-size"}


def check_settings(demo) -> str | None:
    """The recipe checks of every training stage, before the first stage runs (a bad --top-k used to surface
    in the cache stage, minutes in); None when they pass."""
    from ..recipe.checks import check_recipe
    from ..recipe.compose import compose
    from ..recipe.schema import RecipeError, to_recipe
    s = demo.s
    if s.vocab_size < BPE_MIN_VOCAB:
        return (f"--vocab-size {s.vocab_size}: the byte-level BPE holds at least its {BPE_MIN_VOCAB} base ids (256 "
                f"bytes and <|endoftext|>); give --vocab-size >= {BPE_MIN_VOCAB} (default {Settings().vocab_size})")
    from ..rules import top_k_fits
    if s.top_k >= 1 and not top_k_fits(s.top_k, s.vocab_size):
        return (f"--top-k {s.top_k} exceeds the vocabulary (--vocab-size {s.vocab_size}); give --top-k <= "
                f"{s.vocab_size} (default {Settings().top_k})")
    stages = [("teacher", demo.teacher_overrides(), "--teacher-iters")] + \
        [(f"student_{m}", demo.student_overrides(m), "--student-iters") for m in MODES]
    for stage, overrides, iters_flag in stages:
        try:
            check_recipe(to_recipe(compose("tiny_cpu", recipe_overrides(overrides))), None, cuda=False)
        except RecipeError as e:
            key = str(e).split("=", 1)[0]
            flag = iters_flag if key == "train.iters" else FLAG_KEYS.get(key)
            return f"{flag}: {e}" if flag else f"the {stage} stage's recipe: {e}"
    return None


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
        self.times = load_times(out)  # earlier starts' stage times survive an interruption
        self.t0 = time.time()
        self.stage = None
        import importlib.util
        self.tensorboard = importlib.util.find_spec("tensorboard") is not None  # said once in run(), not per stage

    def say(self, text: str) -> None:
        tag = f"[demo {STAGES.index(self.stage) + 1}/{len(STAGES)} {self.stage}]" if self.stage else "[demo]"
        print(f"{tag} {text}", flush=True)

    def begin(self, stage: str) -> None:
        self.stage = stage
        left = eta_s(self.times, self.s, STAGES[STAGES.index(stage):])
        first = " (the default demo on 2 CPU cores: 3 minutes idle, 10 at load average 8; an estimate follows the " \
            "teacher)"
        eta = f", about {fmt_s(left)} left" if left is not None else first if stage == "data" else ""
        self.say(f"{fmt_s(time.time() - self.t0)} so far{eta}")

    def finish(self, stage: str, seconds: float) -> None:
        self.times[stage] = seconds
        with open(os.path.join(self.out, TIMES), "w") as f:
            json.dump(self.times, f, indent=2)

    # --- stages ------------------------------------------------------------------------------------------

    def run(self) -> int:
        if not self.tensorboard:
            self.say("TensorBoard logs off: tensorboard is not installed (pip install tensorboard to get them)")
        self.begin("data")
        self.stage_data()
        self.begin("teacher")
        rc = self.stage_train("teacher", self.teacher_overrides())
        if rc:
            return rc
        self.begin("cache")
        self.stage_cache()
        for mode in MODES:      # one student per target source
            self.begin(f"student_{mode}")
            rc = self.stage_train(f"student_{mode}", self.student_overrides(mode))
            if rc:
                return rc
        self.begin("compare")
        t = time.time()
        results = self.stage_compare()
        self.finish("compare", time.time() - t)
        results["stage_s"] = dict(self.times)
        results["total_s"] = sum(self.times.get(k) or 0.0 for k in STAGES)
        results["this_start_s"] = time.time() - self.t0
        self.report(results)
        return 0

    def stage_data(self) -> None:
        if os.path.exists(self.data_prefix + ".json"):
            self.say(f"{self.data_prefix}.bin present")
            return
        from ..data.corpus import prepare, pydoc_documents
        t = time.time()
        self.say("tokenizing pydoc_data (CPython's documentation) with a byte-level BPE of "
                 f"{self.s.vocab_size} ids  [megatron-kd data prepare --pydoc --output-prefix {self.data_prefix} "
                 f"--vocab-size {self.s.vocab_size}]")
        info = prepare(pydoc_documents(), self.data_prefix, vocab_size=self.s.vocab_size, tokenizer_out=self.tokenizer)
        self.finish("data", time.time() - t)
        self.say(f"{info['documents']} documents, {info['tokens']} tokens ({self.times['data']:.1f} s)")

    def common(self, stage: str, iters: int, lr: float) -> list:
        s = self.s
        d = os.path.join(self.out, stage)
        return ["--config-name", "tiny_cpu", "data=pydoc", f"data.path={self.data_prefix}",
                f"data.tokenizer={self.tokenizer}", f"data.seq_length={s.seq_length}", f"data.seed={s.seed}",
                f"train.iters={iters}", f"train.global_batch_size={s.global_batch_size}",
                f"train.micro_batch_size={s.micro_batch_size}", f"train.lr={short(lr)}",
                f"train.min_lr={short(lr / 10)}",
                f"train.lr_warmup_iters={max(1, iters // 20)}", f"train.eval_interval={s.eval_interval}",
                f"train.eval_iters={max(1, s.eval_samples // s.global_batch_size)}", "train.save_interval=null",
                f"train.log_interval={max(1, iters // 40)}", f"train.progress={str(self.progress).lower()}",
                f"train.seed={s.seed}", f"train.save={d}", f"hydra.run.dir={d}",
                f"train.tensorboard={str(self.tensorboard).lower()}"]

    def teacher_overrides(self) -> list:
        return self.common("teacher", self.s.teacher_iters, self.s.teacher_lr) + ["model=tiny_teacher", "kd=ce"]

    def student_recipe(self, mode: str):
        """The Recipe of the student stage `mode` (what `megatron-kd train` composes from its overrides)."""
        return self.recipe_of(self.student_overrides(mode))

    @staticmethod
    def recipe_of(argv: list):
        """The Recipe that `megatron-kd train ARGV` composes (ARGV as `common` and its callers build it)."""
        from ..recipe.compose import compose
        from ..recipe.schema import to_recipe
        return to_recipe(compose("tiny_cpu", recipe_overrides(argv)))

    def student_overrides(self, mode: str) -> list:
        o = self.common(f"student_{mode}", self.s.student_iters, self.s.student_lr) + [f"kd={mode}"]
        targets = TargetSource(mode)
        if targets.distills:
            o += [f"kd.top_k={self.s.top_k}", f"teacher.load={os.path.join(self.out, 'teacher')}"]
        if targets.reads_cache:
            o += [f"kd.cache={self.cache}", "kd.build_cache=false"]
        return o

    def stage_train(self, stage: str, overrides: list, log: str | None = None) -> int:
        """The `megatron-kd train` process of `stage` (kept when finished); its exit status. log: a file its
        output (stdout and stderr) is appended to instead of this process's output, so that stages run side by
        side do not interleave; a failure names it."""
        from ..checkpoint.store import latest_iteration
        iters = int(next(o.split("=", 1)[1] for o in overrides if o.startswith("train.iters=")))
        d = os.path.join(self.out, stage)
        if latest_iteration(d) == iters and os.path.exists(os.path.join(d, "summary.json")):
            self.say(f"already trained ({d})")
            return 0
        cmd = ["megatron-kd", "train", *overrides]
        self.say(f"$ {shlex.join(cmd)}" + (f"  > {log}" if log else ""))
        t = time.time()
        env = self.child_env()
        before = self.times.pop(f"{stage}_partial", 0.0)  # an interrupted start's share of this stage
        argv = [sys.executable, "-m", "megatron_kd", "train", *overrides]
        try:
            if log is None:
                rc = subprocess.call(argv, env=env)
            else:
                os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
                with open(log, "a") as f:
                    f.write(f"$ {shlex.join(cmd)}\n")
                    f.flush()
                    rc = subprocess.call(argv, env=env, stdout=f, stderr=subprocess.STDOUT)
        except KeyboardInterrupt:
            self.finish(f"{stage}_partial", before + time.time() - t)
            raise
        if rc:
            self.finish(f"{stage}_partial", before + time.time() - t)
            what = f"{stage} failed (exit {rc}); its output is in {log}" if log else f"failed (exit {rc})"
            self.say(f"{what}; rerun `{self.resume_command()}` to resume")
        else:
            self.finish(stage, before + time.time() - t)
        return rc

    def child_env(self) -> dict:
        """The environment of a stage's `megatron-kd train` process: without a launcher's variables (it makes its
        own single-process group), with sleeping OpenMP waiters (see main())."""
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                 "MASTER_PORT")}
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # sleeping waiters cost little on an idle machine
        return env

    def resume_command(self) -> str:
        return f"megatron-kd demo --out {self.out}"

    def stage_cache(self) -> None:
        from ..cache.format import is_finished
        if is_finished(self.cache):
            self.say(f"{self.cache} present")
            return
        from ..recipe.schema import to_recipe
        from ..recipe.compose import compose
        from ..teacher.build import build_cache_only
        t = time.time()
        self.say(f"teacher top-{self.s.top_k} over the students' {self.s.student_iters * self.s.global_batch_size}"
                 f" training samples -> {self.cache}")
        r = to_recipe(compose("tiny_cpu", recipe_overrides(self.student_overrides("offline"))))
        r.train.progress = self.progress
        m = build_cache_only(r)
        self.finish("cache", time.time() - t)
        self.say(f"{m['num_samples']} samples, {m['bytes_per_token']:.1f} bytes/token ({self.times['cache']:.1f} s)")

    def stage_compare(self) -> dict:
        from ..recipe.schema import to_recipe
        from ..training.evaluate import compare
        from ..recipe.compose import compose
        r = to_recipe(compose("tiny_cpu", recipe_overrides(self.student_overrides("online"))))
        students = {mode: (r.model, os.path.join(self.out, f"student_{mode}")) for mode in MODES}
        self.say(f"held-out CE and KL(teacher || student) over {self.s.eval_samples} validation samples")
        metrics = compare(r, os.path.join(self.out, "teacher"), students, self.s.eval_samples,
                          min(self.s.micro_batch_size, self.s.eval_samples))
        rows = {}
        for stage in ("teacher", "student_offline", "student_online", "student_ce"):
            summary = json.load(open(os.path.join(self.out, stage, "summary.json")))
            key = "teacher" if stage == "teacher" else stage.split("_", 1)[1]
            rows[key] = {**metrics[key], "tokens_per_s": summary["tokens_per_s"],
                         "peak_mem_gib": summary["peak_mem_gib"], "train_s": self.times.get(stage),
                         "iters": summary["iters"]}
        rows["offline"]["cache_s"] = self.times.get("cache")
        return {"settings": dataclasses.asdict(self.s), "rows": rows, "machine": machine(),
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
                "offline_beats_ce_on_kl": rows["offline"]["kl"] < rows["ce"]["kl"]}

    # --- outputs -----------------------------------------------------------------------------------------

    def report(self, results: dict) -> None:
        table = format_table(results)
        print("\n" + table + "\n", flush=True)
        png = os.path.join(self.out, "loss_curves.png")
        plot_curves(self.out, png, results["rows"])
        results["loss_curves"] = png
        with open(os.path.join(self.out, "results.md"), "w") as f:
            f.write(results_md(results, table))
        with open(os.path.join(self.out, RESULTS), "w") as f:
            json.dump(results, f, indent=2)
        rows = results["rows"]
        self.say("held-out " + "; ".join(f"{k} CE {rows[k]['ce']:.4f} KL {rows[k]['kl']:.4f}"
                                         for k in ("offline", "online", "ce")))
        verdict = "beats" if results["offline_beats_ce_on_kl"] else "does NOT beat"
        resumed = "" if abs(results["this_start_s"] - results["total_s"]) < 5 else \
            f" ({fmt_s(results['this_start_s'])} in this start)"
        self.say(f"offline top-{self.s.top_k} KD {verdict} CE-only on KL to the teacher; total "
                 f"{fmt_s(results['total_s'])}{resumed}; {png}, {os.path.join(self.out, 'results.md')}")


def load_times(out: str) -> dict:
    path = os.path.join(out, TIMES)
    return json.load(open(path)) if os.path.exists(path) else {}


def short(x: float) -> str:
    """A float as a person writes it in a command (lr / 10 is 0.00030000000000000003 in full)."""
    return f"{x:.10g}"


def expected_share(stage: str, s: Settings) -> float:
    """SHARE of the default run, scaled by this run's steps x sequence length where a stage is made of steps."""
    d = Settings()
    work = s.seq_length / d.seq_length
    if stage == "teacher":
        work *= s.teacher_iters / d.teacher_iters
    elif stage.startswith("student") or stage == "cache":
        work *= s.student_iters / d.student_iters
    else:
        work = 1.0
    return SHARE[stage] * work


def eta_s(times: dict, s: Settings, remaining) -> float | None:
    """Seconds the remaining stages should take, at the pace of the stages already timed (data excluded: its
    time does not grow with the steps); None until one is."""
    timed = [k for k in STAGES if k not in remaining and times.get(k) and k != "data"]
    if not timed:
        return None
    pace = sum(times[k] for k in timed) / sum(expected_share(k, s) for k in timed)
    return pace * sum(expected_share(k, s) for k in remaining if not times.get(k))


def recipe_overrides(argv: list) -> list:
    """The recipe overrides of a `megatron-kd train` argument list (no --config-name, no hydra.*)."""
    return [a for a in argv[2:] if not a.startswith("hydra.")]


NAMES = {"teacher": "teacher (reference)", "offline": "student: offline top-K KD", "online":
         "student: online KD (teacher in memory)", "ce": "student: CE only"}


def format_table(results: dict) -> str:
    rows = results["rows"]
    head = "| model | held-out CE | KL to teacher | tokens/s | peak memory | time |"
    lines = [head, "|---|---|---|---|---|---|"]
    for key in ("teacher", "offline", "online", "ce"):
        r = rows[key]
        kl = "-" if "kl" not in r else f"{r['kl']:.4f}"
        tt = "-" if r.get("train_s") is None else f"{r['train_s']:.0f} s"
        if TargetSource(key).reads_cache and r.get("cache_s") is not None and r.get("train_s") is not None:
            tt = f"{r['cache_s']:.0f} s cache + {r['train_s']:.0f} s = {r['cache_s'] + r['train_s']:.0f} s"
        lines.append(f"| {NAMES[key]} | {r['ce']:.4f} | {kl} | {r['tokens_per_s']:.0f} | "
                     f"{r['peak_mem_gib'] * 1024:.0f} MiB | {tt} |")
    return "\n".join(lines)


def results_md(results: dict, table: str) -> str:
    """runs/demo/results.md: the README's demo table with its caption (the README pastes this file)."""
    s, r = results["settings"], results["rows"]
    small = "" if s == dataclasses.asdict(Settings()) else " (non-default settings: see results.json)"
    return (f"`megatron-kd demo`{small} on {results['date']}, {results['machine']}; "
            f"{fmt_s(results['total_s'])} in all:\n\n{table}\n\n"
            f"Held-out: {s['eval_samples']} validation samples; KL to the teacher's full distribution. tokens/s: "
            "median training step; peak memory: the stage's process (CPU resident set). Offline time: cache build "
            "+ training; online pays for its teacher inside training. Offline - online: "
            f"CE {r['offline']['ce'] - r['online']['ce']:+.6f}, KL {r['offline']['kl'] - r['online']['kl']:+.6f} "
            "(cached fp16 top-K vs the teacher's fp32 top-K each step).\n")
