"""Quantization-aware distillation (QAD) on one GPU: a teacher quantized after training (PTQ) and won back three
ways on the same samples and steps, in one process.

    python benchmarks/qad_nvfp4.py --out $OUT                       # NVFP4 on the GPU (the device run)
    python benchmarks/qad_nvfp4.py --out /tmp/q --tiny --format fp8 --device cpu   # the CPU smoke run

1. data: CPython's documentation (pydoc_data) tokenized with a byte-level BPE trained on it; held-out documents
   apart (megatron_kd.data.corpus)
2. teacher: a small GPT (plain torch: nn.Linear layers, so ModelOpt quantizes them as it does any linear) trained
   with CE in bf16 autocast
3. PTQ: a copy of the teacher fake-quantized as --format by ModelOpt (megatron_kd.models.quant), calibrated on
   --calib-samples training samples; its output layer (lm_head) stays unquantized
4. cache: the teacher's top-K log-probabilities over every training sample the recovery runs read, kept as fp16
   (the cache's fp16 encoding), made once
5. recovery, each from the PTQ model (restored from ModelOpt's state + state dict: the resume path) on the same
   samples and steps, through megatron_kd's topk_kl_loss (fused on CUDA): CE only (QAT), offline top-K KD from
   the cache (QAD), online top-K KD (teacher in memory)
6. held-out CE and KL(teacher || model) over the full vocabulary; a restore check (a QAD model saved and restored
   from ModelOpt's state gives the same logits)

Writes qad_<format>.json (and prints the table) in --out.
"""
import argparse
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = {  # the device run / the CPU smoke run
    "full": dict(vocab_size=4096, hidden=512, layers=8, heads=8, seq=256, batch=32, teacher_iters=800,
                 recover_iters=300, teacher_lr=1e-3, recover_lr=5e-5, top_k=32, eval_samples=256,
                 calib_samples=128, text_mb=8.0),
    "tiny": dict(vocab_size=512, hidden=128, layers=1, heads=4, seq=32, batch=4, teacher_iters=20,
                 recover_iters=4, teacher_lr=3e-3, recover_lr=1e-4, top_k=16, eval_samples=8, calib_samples=8,
                 text_mb=0.0),
}


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.fc1, self.fc2 = nn.Linear(h, 8 * h, bias=False), nn.Linear(4 * h, h, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        g, u = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(g) * u)


class GPT(nn.Module):
    """Learned positions, pre-norm blocks with SwiGLU; forward gives the final hidden states (the loss takes the
    output layer's weight itself, as megatron_kd's KDHead does)."""

    def __init__(self, vocab: int, h: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

    def logits(self, tokens):
        return self.lm_head(self(tokens)).float()


def tokens_of(docs, tok) -> torch.Tensor:
    eod = tok.token_to_id("<|endoftext|>")
    ids = []
    for e in tok.encode_batch(docs):
        ids += e.ids + [eod]
    return torch.tensor(ids, dtype=torch.long)


def samples(stream: torch.Tensor, seq: int) -> torch.Tensor:
    n = (len(stream) - 1) // seq
    return torch.stack([stream[i * seq: i * seq + seq + 1] for i in range(n)])  # [n, seq + 1]


def stdlib_sources(mb: float) -> list:
    """The Python standard library's own .py files, sorted, up to `mb` MB of text: more English and code than
    pydoc_data alone, so the teacher does not memorize its data (a local source: nothing is downloaded)."""
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    out, size = [], 0
    for d, subdirs, files in sorted(os.walk(root)):
        subdirs[:] = sorted(x for x in subdirs if x not in ("site-packages", "test", "tests", "idlelib"))
        for f in sorted(files):
            if size >= mb * 1e6:
                return out
            if f.endswith(".py"):
                try:
                    text = open(os.path.join(d, f), encoding="utf-8").read()
                except (UnicodeDecodeError, OSError):
                    continue
                out.append(text)
                size += len(text)
    return out


def data(work: str, vocab: int, seq: int, text_mb: float):
    from tokenizers import Tokenizer
    from megatron_kd.data.corpus import pydoc_documents, train_tokenizer
    docs = pydoc_documents() + (stdlib_sources(text_mb) if text_mb else [])
    held = docs[::20]  # every 20th document held out
    train = [d for i, d in enumerate(docs) if i % 20]
    path = os.path.join(work, "tokenizer.json")
    train_tokenizer(train, vocab, path)
    tok = Tokenizer.from_file(path)
    return samples(tokens_of(train, tok), seq), samples(tokens_of(held, tok), seq), tok.get_vocab_size()


def autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def train(model, batches, lr: float, loss_fn, device, log_every: int = 50, tag: str = "") -> dict:
    """AdamW with warmup + cosine; batches: list of [b, seq + 1] token tensors (one per step)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0,
                            betas=(0.9, 0.95))
    n = len(batches)
    warm = max(1, n // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min((i + 1) / warm, 0.5 * (1 + math.cos(
        math.pi * min(i, n) / n)) * 0.9 + 0.1))
    model.train()
    t0 = time.perf_counter()
    losses = []
    for i, b in enumerate(batches):
        b = b.to(device, non_blocking=True)
        with autocast(device):
            loss = loss_fn(model, b, i)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()) if (i % log_every == 0 or i == n - 1) else None)
        if i % log_every == 0 or i == n - 1:
            print(f"  {tag} step {i + 1}/{n} loss {losses[-1]:.4f}", flush=True)
    sync(device)
    return {"train_s": time.perf_counter() - t0, "final_loss": losses[-1]}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def kd_loss(model, b, ids, logp, *, kl_weight, ce_weight):
    from megatron_kd.loss import topk_kl_loss
    hidden = model(b[:, :-1])
    # tail "bucket": the teacher's mass outside its top-K is one more class, so the loss is a true divergence
    # whose minimum is the teacher (without it the student over-sharpens onto the K ids); the output layer's
    # weight in the hidden states' dtype, as the bf16 model's forward uses it
    return topk_kl_loss(hidden, model.lm_head.weight.to(hidden.dtype), ids, logp, labels=b[:, 1:],
                        kl_weight=kl_weight, ce_weight=ce_weight, tail="bucket" if kl_weight else "none",
                        reduction="mean")


@torch.no_grad()
def teacher_topk(teacher, b, k: int):
    """The teacher's top-K ids and log-probabilities (fp32 log-softmax over the full vocabulary)."""
    with autocast(b.device):
        logits = teacher.logits(b[:, :-1])
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = logp.topk(k, dim=-1)
    return ids, vals


@torch.no_grad()
def evaluate(model, teacher, held, device, batch: int) -> dict:
    """Held-out CE and KL(teacher || model) over the full vocabulary, per token."""
    model.eval()
    ce = kl = 0.0
    n = 0
    for i in range(0, len(held), batch):
        b = held[i:i + batch].to(device)
        with autocast(device):
            s = model.logits(b[:, :-1])
            t = teacher.logits(b[:, :-1]) if teacher is not None else None
        ls = torch.log_softmax(s.float(), -1)
        ce += float(F.nll_loss(ls.flatten(0, 1), b[:, 1:].flatten(), reduction="sum"))
        if t is not None:
            lt = torch.log_softmax(t.float(), -1)
            kl += float((lt.exp() * (lt - ls)).sum())
        n += b[:, 1:].numel()
    model.train()
    return {"ce": ce / n, **({"kl": kl / n} if teacher is not None else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--format", default="nvfp4", help="quant.format: fp8 | int8 | int4_awq | w4a8_awq | nvfp4")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="the CPU smoke size")
    p.add_argument("--recover-iters", type=int, default=None)
    p.add_argument("--teacher-iters", type=int, default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    from megatron_kd.recipe.checks import quant_problem
    problem = quant_problem(args.format, device.type == "cuda", key="--format")
    if problem or args.format == "none":
        print(f"qad_nvfp4.py: error: {problem or '--format=none: nothing to quantize'}", file=sys.stderr)
        return 2
    from megatron_kd.models import quant
    cfg = dict(SIZES["tiny" if args.tiny else "full"])
    for k in ("recover_iters", "teacher_iters"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    os.makedirs(args.out, exist_ok=True)
    t_all = time.perf_counter()
    torch.manual_seed(1234)
    work = os.path.join(args.out, "work")
    os.makedirs(work, exist_ok=True)

    t = time.perf_counter()
    train_s, held, vocab = data(work, cfg["vocab_size"], cfg["seq"], cfg["text_mb"])
    held = held[:cfg["eval_samples"]]
    print(f"data: {len(train_s)} training and {len(held)} held-out samples of {cfg['seq']} tokens, vocab {vocab} "
          f"({time.perf_counter() - t:.1f} s)", flush=True)
    gen = torch.Generator().manual_seed(1234)

    def batches(n):
        return [train_s[torch.randint(len(train_s), (cfg["batch"],), generator=gen)] for _ in range(n)]

    def new_model():
        return GPT(vocab, cfg["hidden"], cfg["layers"], cfg["heads"], cfg["seq"]).to(device)

    # 2. teacher
    teacher = new_model()
    print(f"teacher: {sum(p.numel() for p in teacher.parameters()) / 1e6:.1f} M parameters", flush=True)
    tt = train(teacher, batches(cfg["teacher_iters"]), cfg["teacher_lr"],
               lambda m, b, i: F.cross_entropy(m.logits(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()), device,
               tag="teacher")
    teacher.eval().requires_grad_(False)
    rows = {"teacher": {**evaluate(teacher, None, held, device, cfg["batch"]), "train_s": tt["train_s"]}}

    # 3. PTQ: a copy of the teacher, quantized and calibrated on the run's own training samples
    student = new_model()
    student.load_state_dict(teacher.state_dict())
    calib = train_s[torch.randperm(len(train_s), generator=gen)[:cfg["calib_samples"]]]

    @torch.no_grad()
    def forward_loop(m):
        for i in range(0, len(calib), cfg["batch"]):
            with autocast(device):
                m(calib[i:i + cfg["batch"]].to(device)[:, :-1])
    t = time.perf_counter()
    quant.quantize(student, args.format, forward_loop)
    sync(device)
    calib_s = time.perf_counter() - t
    enabled = quant.enabled_quantizers(student)
    qbytes = quant.quantizer_bytes(student)
    ptq_state = {"modelopt": quant.quantizer_state(student),
                 "weights": {k: v.detach().clone() for k, v in student.state_dict().items()}}
    rows["ptq"] = {**evaluate(student, teacher, held, device, cfg["batch"]), "calib_s": calib_s}
    print(f"PTQ {args.format}: {len(enabled)} quantizers on; held-out CE {rows['ptq']['ce']:.4f} KL "
          f"{rows['ptq']['kl']:.5f} (teacher CE {rows['teacher']['ce']:.4f})", flush=True)
    del student

    # 4. the recovery runs' samples, and the teacher's fp16 top-K over them (the offline cache)
    steps = batches(cfg["recover_iters"])
    t = time.perf_counter()
    cache = []
    for b in steps:
        ids, logp = teacher_topk(teacher, b.to(device), cfg["top_k"])
        cache.append((ids.to(torch.int32), logp.to(torch.float16)))
    sync(device)
    cache_s = time.perf_counter() - t

    def from_ptq():
        m = new_model()
        quant.restore_quantizers(m, ptq_state["modelopt"])
        m.load_state_dict(ptq_state["weights"])
        return m.to(device)

    ways = {
        "qat_ce": lambda m, b, i: kd_loss(m, b, torch.empty(*b[:, 1:].shape, 0, dtype=torch.long, device=device),
                                          torch.empty(*b[:, 1:].shape, 0, device=device), kl_weight=0.0,
                                          ce_weight=1.0),
        "qad_offline": lambda m, b, i: kd_loss(m, b, cache[i][0].long(), cache[i][1].float(), kl_weight=1.0,
                                               ce_weight=0.0),
        "qad_online": lambda m, b, i: kd_loss(m, b, *teacher_topk(teacher, b, cfg["top_k"]), kl_weight=1.0,
                                              ce_weight=0.0),
    }
    restore_diff = None
    for way, fn in ways.items():
        m = from_ptq()
        if way == "qat_ce":  # the restored PTQ model is the PTQ model: the resume path reproduces it
            rows["ptq"]["restored_ce"] = evaluate(m, None, held, device, cfg["batch"])["ce"]
        r = train(m, steps, cfg["recover_lr"], fn, device, tag=way)
        rows[way] = {**evaluate(m, teacher, held, device, cfg["batch"]), **r}
        if way == "qad_offline":
            rows[way]["cache_s"] = cache_s
            again = new_model()
            quant.restore_quantizers(again, quant.quantizer_state(m))
            again.load_state_dict(m.state_dict())
            again.to(device).eval()
            m.eval()
            with torch.no_grad(), autocast(device):
                x = held[:cfg["batch"]].to(device)[:, :-1]
                restore_diff = float((again.logits(x) - m.logits(x)).abs().max())
        print(f"{way}: held-out CE {rows[way]['ce']:.4f} KL {rows[way]['kl']:.5f} ({r['train_s']:.1f} s)",
              flush=True)
        del m

    ptq_kl = rows["ptq"]["kl"]
    for way in ways:
        rows[way]["kl_won_back"] = (ptq_kl - rows[way]["kl"]) / ptq_kl
    off, on = rows["qad_offline"], rows["qad_online"]
    checks = {"qad_offline_within_0.5pct_of_online_ce": abs(off["ce"] - on["ce"]) <= 0.005 * on["ce"],
              "qad_offline_within_0.5pct_of_online_kl": abs(off["kl"] - on["kl"]) <= 0.005 * on["kl"],
              "qad_offline_beats_ce_only_on_kl": off["kl"] < rows["qat_ce"]["kl"],
              "restore_max_abs_logit_diff": restore_diff,
              "ptq_restored_ce_equals_ptq": abs(rows["ptq"]["restored_ce"] - rows["ptq"]["ce"]) < 1e-6}
    import modelopt
    result = {"format": args.format, "settings": cfg, "rows": rows, "checks": checks,
              "quantizers_enabled": len(enabled), "quantizer_bytes": qbytes, "total_s": time.perf_counter() - t_all,
              "env": {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or
                      "cpu", "torch": torch.__version__, "modelopt": modelopt.__version__,
                      "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%d", time.gmtime())}
    print("\n" + table(result) + "\n", flush=True)
    path = os.path.join(args.out, f"qad_{args.format}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{path}; {json.dumps(checks)}; {result['total_s']:.0f} s in all", flush=True)
    return 0


NAMES = {"teacher": "teacher (bf16, reference)", "ptq": "PTQ (quantized, calibrated, no training)",
         "qat_ce": "QAT: CE only", "qad_offline": "QAD: offline top-K KD (fp16 cache)",
         "qad_online": "QAD: online top-K KD (teacher in memory)"}


def table(res: dict) -> str:
    lines = [f"| {res['format']} | held-out CE | KL to teacher | KL won back | training time |", "|---|---|---|---|---|"]
    for k, name in NAMES.items():
        r = res["rows"][k]
        kl = f"{r['kl']:.5f}" if "kl" in r else "-"
        won = f"{r['kl_won_back']:.0%}" if "kl_won_back" in r else "-"
        tt = f"{r['train_s']:.1f} s" if "train_s" in r else f"{r.get('calib_s', 0):.1f} s calibration"
        lines.append(f"| {name} | {r['ce']:.4f} | {kl} | {won} | {tt} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
