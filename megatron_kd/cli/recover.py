"""`megatron-kd demo --recover`: the recovery story on the demo's teacher, after the demo's own stages.

1. prune: the teacher loses every second transformer layer (4 -> 2; embedding, final norm and output layer kept)
2-4. the pruned model trains on the students' samples and steps (--student-iters) three ways: CE only, offline
   top-K KD from the demo's cache (the same cache the students used: no new teacher pass) and online KD
5. compare: held-out CE and KL(teacher || model) of the pruned model before training, after each way, and of the
   teacher; the share of the pruning's loss each way wins back. Written to recover.md / recover.json.
"""
import dataclasses
import json
import os
import re
import time

KEEP = "every second layer (0, 2, ...)"
WAYS = ("ce", "offline", "online")
NAMES = {"teacher": "teacher (reference)", "pruned": "pruned teacher, before training",
         "ce": "pruned + CE only", "offline": "pruned + offline top-K KD (the demo's cache)",
         "online": "pruned + online KD (teacher in memory)"}


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


def overrides(demo, way: str, model: dict, iters: int, lr: float) -> list:
    """The `megatron-kd train` arguments of one recovery run: the students' data, samples and cache settings, the
    pruned architecture, its weights from the pruned checkpoint."""
    o = demo.common(f"recover_{way}", iters, lr) + [f"kd={way}", f"train.pretrained={demo.out}/pruned"]
    o += ["model=tiny_teacher"] + [f"model.num_layers={model['num_layers']}"]
    if way != "ce":
        o += [f"kd.top_k={demo.s.top_k}", f"teacher.load={os.path.join(demo.out, 'teacher')}"]
    if way == "offline":
        o += [f"kd.cache={demo.cache}", "kd.build_cache=false"]
    return o


def run(demo, lr: float) -> int:
    """The recovery stages; each run takes the students' samples and steps, which the demo's cache covers."""
    iters = demo.s.student_iters
    demo.say = lambda text: print(f"[demo recover] {text}", flush=True)
    t0 = time.time()
    stages = ["prune", *[f"recover_{w}" for w in WAYS], "recover_compare"]

    def say(i, text):
        print(f"[demo recover {i}/{len(stages)} {stages[i - 1]}] {text}", flush=True)
    say(1, f"the teacher without {KEEP} -> {demo.out}/pruned")
    t = time.time()
    model = prune(demo, os.path.join(demo.out, "pruned"))
    demo.finish("prune", demo.times.get("prune") or time.time() - t)
    for i, way in enumerate(WAYS, 2):
        say(i, f"{iters} steps, {fmt_elapsed(t0)} so far")
        rc = demo.stage_train(f"recover_{way}", overrides(demo, way, model, iters, lr))
        if rc:
            return rc
    say(5, f"held-out CE and KL(teacher || model) over {demo.s.eval_samples} validation samples")
    res = compare(demo, model, iters, lr)
    res["total_s"] = sum(demo.times.get(s) or 0.0 for s in stages[:-1])
    table = format_table(res)
    print("\n" + table + "\n", flush=True)
    with open(os.path.join(demo.out, "recover.md"), "w") as f:
        f.write(recover_md(res, table))
    with open(os.path.join(demo.out, "recover.json"), "w") as f:
        json.dump(res, f, indent=2)
    rec = res["recovered"]
    say(5, "share of the pruning's held-out CE gap won back: " + ", ".join(
        f"{w} {rec[w]['ce']:.0%}" for w in WAYS) + f"; {demo.out}/recover.md")
    return 0


def fmt_elapsed(t0: float) -> str:
    from ..report.runs import fmt_s
    return fmt_s(time.time() - t0)


def compare(demo, model: dict, iters: int, lr: float) -> dict:
    from ..recipe.schema import ModelConfig
    from ..training.evaluate import compare as score
    r = demo.student_recipe("online")
    m = ModelConfig(**model)
    students = {"pruned": (m, os.path.join(demo.out, "pruned"))}
    students.update({w: (m, os.path.join(demo.out, f"recover_{w}")) for w in WAYS})
    met = score(r, os.path.join(demo.out, "teacher"), students, demo.s.eval_samples,
                min(demo.s.micro_batch_size, demo.s.eval_samples))
    t, p = met["teacher"]["ce"], met["pruned"]
    recovered = {w: {"ce": (p["ce"] - met[w]["ce"]) / (p["ce"] - t), "kl": (p["kl"] - met[w]["kl"]) / p["kl"]}
                 for w in WAYS}
    summaries = {w: json.load(open(os.path.join(demo.out, f"recover_{w}", "summary.json"))) for w in WAYS}
    return {"rows": met, "recovered": recovered, "iters": iters, "lr": lr, "kept_layers": pruned_layers(
        r.teacher.num_layers), "teacher_layers": r.teacher.num_layers, "eval_samples": demo.s.eval_samples,
        "tokens_per_s": {w: summaries[w]["tokens_per_s"] for w in WAYS},
        "train_s": {w: demo.times.get(f"recover_{w}") for w in WAYS}, "prune_s": demo.times.get("prune"),
        "date": time.strftime("%Y-%m-%d", time.gmtime())}


def format_table(res: dict) -> str:
    rows, rec = res["rows"], res["recovered"]
    lines = ["| model | held-out CE | KL to teacher | CE gap won back | KL won back | training time |",
             "|---|---|---|---|---|---|"]
    for key in ("teacher", "pruned", *WAYS):
        r = rows[key]
        kl = "-" if "kl" not in r else f"{r['kl']:.4f}"
        got = rec.get(key)
        tt = res["train_s"].get(key)
        lines.append(f"| {NAMES[key]} | {r['ce']:.4f} | {kl} | {'-' if not got else format(got['ce'], '.0%')} | "
                     f"{'-' if not got else format(got['kl'], '.0%')} | {'-' if tt is None else f'{tt:.0f} s'} |")
    return "\n".join(lines)


def recover_md(res: dict, table: str) -> str:
    from ..report.runs import fmt_s, machine
    return (f"`megatron-kd demo --recover` on {res['date']}, {machine()}; recovery stages "
            f"{fmt_s(res['total_s'])}:\n\n{table}\n\n"
            f"The teacher ({res['teacher_layers']} layers) pruned to its layers {res['kept_layers']}, then "
            f"{res['iters']} steps at lr {res['lr']:g} each way on the students' training samples. Held-out: "
            f"{res['eval_samples']} validation samples; KL to the teacher's full distribution. CE gap won back: "
            "(pruned CE - CE) / (pruned CE - teacher CE); KL won back: (pruned KL - KL) / pruned KL.\n")
