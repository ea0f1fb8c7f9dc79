"""Shared benchmark plumbing: synthetic teacher, timing, peak memory, environment record."""
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch


def synthetic_teacher(n, k, vocab, device, seed=0):
    """Sharp random teacher: unique ids per row, log-probs of a distribution with ~90% mass in the top-K."""
    g = torch.Generator(device=device).manual_seed(seed)
    base = torch.randint(0, vocab, (n, 1), generator=g, device=device)
    stride = 7919  # prime, so ids in a row are distinct for k < vocab
    ids = (base + torch.arange(k, device=device) * stride) % vocab
    x = torch.randn(n, k, generator=g, device=device).mul_(3.0).sort(dim=1, descending=True).values
    logp = torch.log_softmax(x, dim=1) + torch.log(torch.tensor(0.9, device=device))
    return ids.to(torch.int32), logp.float()


def measure(fn, reps=3, warmup=1):
    """Median ms and peak GiB of fn() (forward+backward), inputs included in the peak. On CPU (smoke runs)
    only the times: peak_gib is None."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    for _ in range(warmup):  # the first call also autotunes and compiles kernels
        fn()
    sync()
    gc.collect()
    base = None
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return dict(ms=statistics.median(times), ms_all=times, peak_gib=None if peak is None else peak / 2**30,
                above_inputs_gib=None if peak is None else (peak - base) / 2**30)


def gemm_floor(h, w):
    """The three bf16 GEMMs no output-layer loss can avoid: logits, input grad, weight grad."""
    def run():
        z = h.detach() @ w.detach().t()
        dh = z @ w.detach()
        dw = z.t() @ h.detach()
        del z, dh, dw
    return run


def liger(h, w, labels):
    """Liger-Kernel's fused linear cross-entropy (CE only: it takes no sparse teacher)."""
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    fn = LigerFusedLinearCrossEntropyLoss()

    def run():
        h.grad = w.grad = None
        fn(w, h, labels).backward()
    return run


def cce(h, w, labels):
    """Cut Cross-Entropy (CE only)."""
    from cut_cross_entropy import linear_cross_entropy

    def run():
        h.grad = w.grad = None
        linear_cross_entropy(h, w, labels).backward()
    return run


def environment():
    env = dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), torch=torch.__version__,
               python=platform.python_version(), host=platform.node())
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus"] = torch.cuda.device_count()
    for mod in ("triton", "liger_kernel", "cut_cross_entropy", "megatron.core", "transformers"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            env[mod] = getattr(m, "__version__", "present")
        except Exception:
            env[mod] = None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:  # only this tree's own repository (a copy nested in another checkout would report that one's HEAD)
        top = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True, cwd=root).strip()
        if os.path.realpath(top) != os.path.realpath(root):
            raise RuntimeError("not a git checkout of its own")
        env["git"] = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, cwd=root).strip()
        # the device gets a copy of the working tree whose HEAD may lag: say when the tree differs from it
        env["git_dirty"] = bool(subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                                        text=True, cwd=root).strip())
    except Exception:
        pass
    return env


def train_records(save_dir):
    """The `kind: train` records a run wrote to SAVE/metrics.jsonl, in order ([] before its first step)."""
    p = os.path.join(save_dir, "metrics.jsonl")
    if not os.path.exists(p):
        return []
    with open(p) as f:
        return [r for r in map(json.loads, f) if r.get("kind") == "train"]


def save(path, payload):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}")


def fresh_workdir(work: str, out: str, logs_name: str) -> str:
    """A multi-process benchmark's scratch dir, emptied, and its logs dir next to `out`; returns the logs dir."""
    import shutil
    logs = os.path.join(os.path.dirname(os.path.abspath(out)), logs_name)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.makedirs(logs, exist_ok=True)
    return logs


def run_child(script, name, argv, log_dir, *, torchrun: bool, timeout: float, port: int) -> dict:
    """One step of a multi-process benchmark: `python script --child NAME argv` (as one torchrun process when
    asked: Bridge's pretrain() and `megatron-kd train` own their process group), its output in log_dir/NAME.log.
    Returns {"rc": exit code or "timeout", "s": seconds}."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(port)]
                              if torchrun else []) + [os.path.abspath(script), "--child", name, *argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]))
    t0 = time.time()
    with open(os.path.join(log_dir, f"{name}.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"{os.path.splitext(os.path.basename(script))[0]}: {name}: rc={rc} in {time.time() - t0:.1f}s", flush=True)
    return {"rc": rc, "s": round(time.time() - t0, 1)}
