"""`megatron-kd demo --recover`: the recovery story on the demo's teacher, after the demo's own stages.

1. prune: the teacher loses every second transformer layer (4 -> 2; embedding, final norm and output layer kept)
2-4. the pruned model trains on the students' samples and steps (--student-iters) three ways: CE only, offline
   top-K KD from the demo's cache (the same cache the students used: no new teacher pass) and online KD
5. compare: held-out CE and KL(teacher || model) of the pruned model before training, after each way, and of the
   teacher; the share of the pruning's loss each way wins back. Written to recover.md / recover.json.

`--recover --quantize FORMAT` tells the other half of the story, quantization-aware distillation: stage 1 is
instead PTQ, the teacher fake-quantized by ModelOpt as FORMAT (quant.format) and calibrated on the first
--calib-samples of the students' training samples (ptq_FORMAT), and stages 2-4 train it from there with
quant.format=FORMAT: CE only (QAT), offline KD (QAD) from the demo's cache rebuilt with fp32 log-probs
(cache_fp32, once for every format: build_qad_cache says why) and online KD, both KD ways with kd.tail=bucket
(the teacher's mass beyond its top-K as one class: from a start this close to the teacher, the top-K-only
divergence would sharpen the model away from it). Written to recover_FORMAT.md / recover_FORMAT.json.
"""
import dataclasses
import json
import os
import re
import time

from ..recipe.targets import TargetSource

KEEP = "every second layer (0, 2, ...)"
WAYS = ("ce", "offline", "online")
NAMES = {"teacher": "teacher (reference)", "pruned": "pruned teacher, before training",
         "ce": "pruned + CE only", "offline": "pruned + offline top-K KD (the demo's cache)",
         "online": "pruned + online KD (teacher in memory)"}
QUANT_NAMES = {"teacher": "teacher (fp32, reference)", "pruned": "PTQ: teacher quantized + calibrated",
               "ce": "QAT: CE only", "offline": "QAD: offline top-K KD (fp32 cache, the demo's samples)",
               "online": "QAD: online top-K KD (teacher in memory)"}
CALIB_SAMPLES = 64
QAD_CACHE = "cache_fp32"  # offline QAD's cache (build_qad_cache)


def pruned_layers(num_layers: int) -> list:
    return list(range(0, num_layers, 2))


def prune(demo, out: str) -> dict:
    """The demo teacher without every second layer, saved as a weights-only checkpoint in `out`; returns the pruned
    model section (what train.pretrained and the recovery runs use)."""
    from ..checkpoint.store import latest_iteration, save_weights
    from ..models.builder import build_gpt
    from ..runtime.dist import distributed
    from ..training.evaluate import _load
    from ..data.datasets import load_tokenizer
    r = demo.student_recipe("online")
    keep = pruned_layers(r.teacher.num_layers)
    pruned = dataclasses.replace(r.teacher, num_layers=len(keep), load=None)
    model = {f.name: getattr(pruned, f.name) for f in dataclasses.fields(type(r.model))}
    if latest_iteration(out) is not None:
        return model
    vocab = load_tokenizer(r.data).vocab_size
    with distributed(r.parallel, r.train.seed, "cpu"):
        teacher = _load(r.teacher, os.path.join(demo.out, "teacher"), r, vocab)
        small = build_gpt(pruned, r.parallel, vocab, r.data.seq_length, "fp32")
        src = teacher.state_dict()
        state = {}
        for k in small.state_dict():
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)", k)
            state[k] = src[f"decoder.layers.{keep[int(m.group(1))]}.{m.group(2)}" if m else k]
        small.load_state_dict(state, strict=True)
        save_weights(out, 0, [small], {"recipe": {"model": model}, "pruned_from": os.path.join(demo.out, "teacher"),
                                       "kept_layers": keep})
    return model


def ptq(demo, out: str, fmt: str, calib_samples: int) -> dict:
    """The demo teacher fake-quantized as `fmt` and calibrated on the first `calib_samples` of the students'
    training samples, saved (with ModelOpt's state) as a weights-only checkpoint in `out`; returns its model
    section."""
    from ..checkpoint.store import latest_iteration, save_weights
    from ..data.datasets import build_datasets, load_tokenizer, loader
    from ..models import quant
    from ..runtime.dist import distributed
    from ..training.evaluate import _load
    r = demo.student_recipe("online")
    model = {f.name: getattr(r.teacher, f.name) for f in dataclasses.fields(type(r.model))}
    if latest_iteration(out) is not None:
        return model
    tok = load_tokenizer(r.data)
    with distributed(r.parallel, r.train.seed, "cpu"):
        train_ds, _ = build_datasets(r.data, tok, calib_samples, 0)
        m = _load(r.teacher, os.path.join(demo.out, "teacher"), r, tok.vocab_size)

        def forward_loop(gpt):
            for b in loader(train_ds, calib_samples, 0, min(demo.s.micro_batch_size, calib_samples), 0, 1):
                gpt(b["tokens"], b["position_ids"], None)
        quant.quantize(m, fmt, forward_loop)
        save_weights(out, 0, [m], {"recipe": {"model": model}, "quantized_from": os.path.join(demo.out, "teacher"),
                                   "calib_samples": calib_samples})
    return model


def overrides(demo, way: str, model: dict, iters: int, lr: float, fmt: str | None = None) -> list:
    """The `megatron-kd train` arguments of one recovery run: the students' data, samples and cache settings, the
    starting model's architecture, its weights from its checkpoint (pruned, or ptq_FMT with quant.format=FMT)."""
    start = "pruned" if fmt is None else f"ptq_{fmt}"
    o = demo.common(stage_name(way, fmt), iters, lr) + [f"kd={way}", f"train.pretrained={demo.out}/{start}"]
    o += ["model=tiny_teacher"] + [f"model.num_layers={model['num_layers']}"]
    targets = TargetSource(way)
    if fmt is not None:
        o += [f"quant.format={fmt}"] + (["kd.tail=bucket"] if targets.distills else [])
    if targets.distills:
        o += [f"kd.top_k={demo.s.top_k}", f"teacher.load={os.path.join(demo.out, 'teacher')}"]
    if targets.reads_cache:
        o += [f"kd.cache={demo.cache if fmt is None else qad_cache(demo)}", "kd.build_cache=false"]
    return o


def qad_cache(demo) -> str:
    return os.path.join(demo.out, QAD_CACHE)


def build_qad_cache(demo) -> dict | None:
    """The demo's cache again (the same samples, teacher and K) with fp32 log-probs, for every format's offline
    QAD; None when present. A quantized copy of the teacher sits within about 1e-3 nats of it, the order of the
    fp16 cache's rounding of the teacher's log-probs (2^-11 relative): trained from the fp16 cache, offline QAD
    ends a percent or more from online in KL, the rounding alone (online with its top-K rounded to fp16 gives
    the offline numbers to every digit)."""
    from ..cache.format import is_finished
    from ..teacher.build import build_cache_only
    path = qad_cache(demo)
    if is_finished(path):
        return None
    o = [x for x in demo.student_overrides("offline") if not x.startswith("kd.cache=")]
    r = demo.recipe_of(o + [f"kd.cache={path}", "kd.cache_encoding=fp32"])
    r.train.progress = demo.progress
    return build_cache_only(r)


def stage_name(way: str, fmt: str | None) -> str:
    return f"recover_{way}" if fmt is None else f"recover_{fmt}_{way}"


def run(demo, lr: float, fmt: str | None = None, calib_samples: int = CALIB_SAMPLES) -> int:
    """The recovery stages; each run takes the students' samples and steps, which the demo's cache covers.
    fmt: recover from the teacher quantized as fmt (PTQ) instead of from the pruned teacher."""
    iters = demo.s.student_iters
    demo.say = lambda text: print(f"[demo recover] {text}", flush=True)
    t0 = time.time()
    first = "prune" if fmt is None else f"ptq_{fmt}"
    stages = [first, *([] if fmt is None else [QAD_CACHE]), *[stage_name(w, fmt) for w in WAYS], "recover_compare"]

    def say(i, text):
        print(f"[demo recover {i}/{len(stages)} {stages[i - 1]}] {text}", flush=True)
    t = time.time()
    if fmt is None:
        say(1, f"the teacher without {KEEP} -> {demo.out}/pruned")
        model = prune(demo, os.path.join(demo.out, "pruned"))
    else:
        say(1, f"the teacher quantized as {fmt} (ModelOpt), calibrated on {calib_samples} of the students' "
               f"training samples -> {demo.out}/{first}")
        model = ptq(demo, os.path.join(demo.out, first), fmt, calib_samples)
    demo.finish(first, demo.times.get(first) or time.time() - t)
    if fmt is not None:
        say(2, f"the teacher's top-{demo.s.top_k} over the students' samples with fp32 log-probs -> {qad_cache(demo)}")
        t = time.time()
        if build_qad_cache(demo) is not None:
            demo.finish(QAD_CACHE, time.time() - t)
    for i, way in enumerate(WAYS, len(stages) - len(WAYS)):
        say(i, f"{iters} steps, {fmt_elapsed(t0)} so far")
        rc = demo.stage_train(stage_name(way, fmt), overrides(demo, way, model, iters, lr, fmt))
        if rc:
            return rc
    last = len(stages)
    say(last, f"held-out CE and KL(teacher || model) over {demo.s.eval_samples} validation samples")
    res = compare(demo, model, iters, lr, fmt, calib_samples if fmt else None)
    res["total_s"] = sum(demo.times.get(s) or 0.0 for s in stages[:-1])
    res["qad_cache_s"] = demo.times.get(QAD_CACHE) if fmt else None
    table = format_table(res)
    print("\n" + table + "\n", flush=True)
    name = "recover" if fmt is None else f"recover_{fmt}"
    with open(os.path.join(demo.out, f"{name}.md"), "w") as f:
        f.write(recover_md(res, table))
    with open(os.path.join(demo.out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=2)
    rec = res["recovered"]
    what = "pruning's" if fmt is None else f"{fmt} quantization's"
    say(last, f"share of the {what} held-out CE gap won back: " + ", ".join(
        f"{w} {rec[w]['ce']:.0%}" for w in WAYS) + f"; KL won back: " + ", ".join(
        f"{w} {rec[w]['kl']:.0%}" for w in WAYS) + f"; {demo.out}/{name}.md")
    return 0


def fmt_elapsed(t0: float) -> str:
    from ..report.runs import fmt_s
    return fmt_s(time.time() - t0)


def compare(demo, model: dict, iters: int, lr: float, fmt: str | None = None, calib_samples=None) -> dict:
    from ..recipe.schema import ModelConfig
    from ..training.evaluate import compare as score
    r = demo.student_recipe("online")
    m = ModelConfig(**model)
    students = {"pruned": (m, os.path.join(demo.out, "pruned" if fmt is None else f"ptq_{fmt}"))}
    students.update({w: (m, os.path.join(demo.out, stage_name(w, fmt))) for w in WAYS})
    met = score(r, os.path.join(demo.out, "teacher"), students, demo.s.eval_samples,
                min(demo.s.micro_batch_size, demo.s.eval_samples))
    t, p = met["teacher"]["ce"], met["pruned"]
    recovered = {w: {"ce": (p["ce"] - met[w]["ce"]) / (p["ce"] - t), "kl": (p["kl"] - met[w]["kl"]) / p["kl"]}
                 for w in WAYS}
    summaries = {w: json.load(open(os.path.join(demo.out, stage_name(w, fmt), "summary.json"))) for w in WAYS}
    off, on = met["offline"], met["online"]
    return {"format": fmt, "rows": met,
        "offline_vs_online": {k: (off[k] - on[k]) / on[k] for k in ("ce", "kl")},
        "recovered": recovered, "iters": iters, "lr": lr, "calib_samples": calib_samples, "kept_layers": pruned_layers(
        r.teacher.num_layers), "teacher_layers": r.teacher.num_layers, "eval_samples": demo.s.eval_samples,
        "tokens_per_s": {w: summaries[w]["tokens_per_s"] for w in WAYS},
        "train_s": {w: demo.times.get(stage_name(w, fmt)) for w in WAYS},
        "prune_s": demo.times.get("prune" if fmt is None else f"ptq_{fmt}"),
        "top_k": demo.s.top_k, "date": time.strftime("%Y-%m-%d", time.gmtime())}


def qad_cache_time(res: dict) -> str:
    s = res.get("qad_cache_s")
    return "" if s is None else f", built in {s:.0f} s"


def format_table(res: dict) -> str:
    rows, rec = res["rows"], res["recovered"]
    names = NAMES if res.get("format") is None else {k: v.replace("quantized", f"quantized as {res['format']}")
                                                     for k, v in QUANT_NAMES.items()}
    lines = ["| model | held-out CE | KL to teacher | CE gap won back | KL won back | training time |",
             "|---|---|---|---|---|---|"]
    for key in ("teacher", "pruned", *WAYS):
        r = rows[key]
        kl = "-" if "kl" not in r else f"{r['kl']:.{4 if res.get('format') is None else 5}f}"  # QAD's KL is small
        got = rec.get(key)
        tt = res["train_s"].get(key)
        lines.append(f"| {names[key]} | {r['ce']:.4f} | {kl} | {'-' if not got else format(got['ce'], '.0%')} | "
                     f"{'-' if not got else format(got['kl'], '.0%')} | {'-' if tt is None else f'{tt:.0f} s'} |")
    return "\n".join(lines)


def recover_md(res: dict, table: str) -> str:
    from ..report.runs import fmt_s, machine
    if res.get("format") is not None:
        d = res["offline_vs_online"]
        return (f"`megatron-kd demo --recover --quantize {res['format']}` on {res['date']}, {machine()}; recovery "
                f"stages {fmt_s(res['total_s'])}:\n\n{table}\n\n"
                f"The teacher ({res['teacher_layers']} layers) fake-quantized as {res['format']} by ModelOpt (output "
                f"layer unquantized) and calibrated on {res['calib_samples']} of the students' training samples "
                f"(PTQ), then {res['iters']} steps at lr {res['lr']:g} each way on the students' training samples "
                f"(KD ways: kd.tail=bucket; offline from the demo's samples' teacher top-{res['top_k']} with fp32 "
                f"log-probs, {QAD_CACHE}{qad_cache_time(res)}). Held-out: "
                f"{res['eval_samples']} validation samples; KL to the teacher's full distribution. CE gap won back: "
                "(PTQ CE - CE) / (PTQ CE - teacher CE); KL won back: (PTQ KL - KL) / PTQ KL. Offline vs online: "
                f"CE {d['ce']:+.3%}, KL {d['kl']:+.3%}.\n")
    return (f"`megatron-kd demo --recover` on {res['date']}, {machine()}; recovery stages "
            f"{fmt_s(res['total_s'])}:\n\n{table}\n\n"
            f"The teacher ({res['teacher_layers']} layers) pruned to its layers {res['kept_layers']}, then "
            f"{res['iters']} steps at lr {res['lr']:g} each way on the students' training samples. Held-out: "
            f"{res['eval_samples']} validation samples; KL to the teacher's full distribution. CE gap won back: "
            "(pruned CE - CE) / (pruned CE - teacher CE); KL won back: (pruned KL - KL) / pruned KL.\n")
