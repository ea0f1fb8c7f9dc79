"""`megatron-kd cache build|verify|inspect`: the offline teacher top-K cache from the command line.

Teachers and datasets are named as `module:function` factories (called with the JSON --*-args as keyword
arguments) so any model or data pipeline plugs in; `--teacher hf:DIR` loads a local transformers model and
`--tokens FILE.npy` reads an int array [num_samples, seq_length + 1]. Under torchrun every rank runs the same
command; the teacher factory sets up Megatron's model parallel groups itself.
"""
import argparse
import json
import os
import sys


def _factory(spec: str):
    from ..teacher.spec import factory
    try:
        return factory(spec)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _json_arg(text: str, flag: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError as e:
        raise SystemExit(f"error: {flag} must be a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"error: {flag} must be a JSON object, e.g. '{{\"seed\": 0}}'")
    return value


def _teacher(args):
    from ..teacher.spec import make_teacher
    try:
        return make_teacher(args.teacher, _json_arg(args.teacher_args, "--teacher-args"))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    except ImportError as e:  # hf: needs transformers
        raise SystemExit(f"error: --teacher {args.teacher}: {e}") from None


def _dataset(args):
    if args.tokens:
        import numpy as np
        from ..cache.hashing import file_sha256
        try:
            data = np.load(args.tokens, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --tokens {args.tokens}: {getattr(e, 'strerror', None) or e}; give a .npy "
                             "file of an int array [num_samples, seq_length + 1]") from None
        if data.ndim != 2 or data.shape[1] < 2:
            raise SystemExit(f"error: {args.tokens} must hold an int array [num_samples, seq_length + 1], "
                             f"got shape {data.shape}")
        return data, args.dataset_id or f"npy:{file_sha256(args.tokens)[:16]}"
    if not args.dataset:
        raise SystemExit("error: pass --tokens FILE.npy or --dataset module:function")
    return _factory(args.dataset)(**_json_arg(args.dataset_args, "--dataset-args")), args.dataset_id


def cmd_build(args) -> int:
    from ..runtime.interrupt import run_interruptible
    return run_interruptible(lambda: _build(args), "finished shards are kept")


def _build(args) -> int:
    import torch
    from ..runtime.dist import init_process_group
    from ..teacher.build import build_cache
    init_process_group(torch.cuda.is_available(), launched_only=True)
    # the dataset's arguments first: loading a teacher is the slow part, and the one that may need a package
    dataset, dataset_id = _dataset(args)
    teacher = _teacher(args)
    m = build_cache(teacher, dataset, args.out, top_k=args.top_k, encoding=args.encoding,
                    temperature=args.temperature, num_samples=args.num_samples,
                    samples_per_shard=args.samples_per_shard, micro_batch_size=args.micro_batch_size,
                    chunk_size=args.chunk_size, teacher_id=args.teacher_id, tokenizer_id=args.tokenizer_id,
                    dataset_id=dataset_id, overwrite=args.overwrite, progress=not args.no_progress)
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"cache complete: {args.out}: {m['num_samples']} samples x {m['seq_length']} positions x "
              f"K={m['top_k']}, {m['encoding']}, {m['bytes_per_token']:.1f} bytes/token")
    return 0


def cmd_verify(args) -> int:
    from ..cache import verify_cache
    from ..cache.format import is_finished
    from ..cache.verify import FULL_CHECKS, QUICK_CHECKS
    problems = verify_cache(args.dir, checksums=not args.quick)
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    inner = os.path.join(args.dir, "cache")  # a demo or run directory holds its cache in cache/
    if problems and is_finished(inner):
        print(f"hint: {args.dir} holds a cache in cache/: megatron-kd cache verify {inner}", file=sys.stderr)
    if not problems:
        if args.quick:
            print(f"ok (quick): {args.dir}: checked {QUICK_CHECKS}. Shard contents were NOT read (a corrupt byte "
                  f"passes): run `megatron-kd cache verify {args.dir}` without --quick to checksum every shard")
        else:
            print(f"ok: {args.dir}: checked {FULL_CHECKS}")
    return 1 if problems else 0


def _fmt(info: dict) -> str:
    if not info["complete"]:
        return (f"{info['path']}: build not finished: {info['shards_done']} of {info['shards_total']} shards done "
                f"({info['num_samples']} samples, K={info['top_k']}, {info['encoding']}); rerun the build command")
    lines = [
        f"cache           {info['path']}",
        f"samples         {info['num_samples']} x {info['seq_length']} positions ({info['tokens']} tokens)",
        f"top-K           K={info['top_k']}, vocabulary {info['vocab_size']}, temperature {info['temperature']}",
        f"encoding        {info['encoding']}: {info['bytes_per_token']:.2f} bytes/token "
        f"({info['bytes_per_entry']:.3f} bytes/entry), {info['total_bytes'] / 2**20:.2f} MiB in {info['shards']} shards",
        f"kl error        mean {info['kl_error_mean']:.3g} nats/token, max {info['kl_error_max']:.3g} (vs fp32 top-K)",
        f"mass covered    mean {info['mean_mass_covered']:.4f}; quantiles (bin upper edge) "
        + ", ".join(f"{k}<={v:.2f}" for k, v in info["mass_covered_quantiles_upper_bound"].items()),
        "mass histogram  " + " ".join(f"{k}:{v}" for k, v in info["mass_covered_histogram"].items() if v),
        f"read speed      {info['read_samples_per_s']:.1f} samples/s, {info['read_tokens_per_s']:,.0f} tokens/s "
        "(one process, decode included)",
        f"teacher         {json.dumps(info['teacher'], sort_keys=True)}",
        f"tokenizer       {info['tokenizer']!r}; dataset {info['dataset']!r}",
    ]
    return "\n".join(lines)


def cmd_inspect(args) -> int:
    from ..cache import inspect_cache
    info = inspect_cache(args.dir, max_samples=args.max_samples)
    print(json.dumps(info, indent=1, sort_keys=True) if args.json else _fmt(info))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-kd cache", description="offline teacher top-K cache")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="run a teacher over a dataset and write (or resume) a cache")
    b.add_argument("--out", required=True, help="cache directory (a restart with the same command resumes it)")
    b.add_argument("--teacher", required=True, help="module:function returning a teacher, or hf:MODEL_DIR")
    b.add_argument("--teacher-args", default="{}", help="JSON keyword arguments for the teacher factory")
    b.add_argument("--tokens", help=".npy int array [num_samples, seq_length + 1]")
    b.add_argument("--dataset", help="module:function returning a token dataset (len and [i])")
    b.add_argument("--dataset-args", default="{}", help="JSON keyword arguments for the dataset factory")
    b.add_argument("--top-k", type=int, default=100)
    b.add_argument("--encoding", choices=["fp16", "compact"], default="fp16")
    b.add_argument("--temperature", type=float, default=1.0, help="capture temperature: softmax(logits / T)")
    b.add_argument("--num-samples", type=int, help="first N samples of the dataset (default: all)")
    b.add_argument("--samples-per-shard", type=int, help="default: about 256 MiB per shard")
    b.add_argument("--micro-batch-size", type=int, default=1)
    b.add_argument("--chunk-size", type=int, help="positions per logit chunk (default: about 2**26 logits)")
    b.add_argument("--teacher-id", help="teacher name to record instead of the teacher's own identity")
    b.add_argument("--tokenizer-id", default="", help="tokenizer identity to record (e.g. name@revision)")
    b.add_argument("--dataset-id", help="dataset identity to record (default: the dataset's description hash)")
    b.add_argument("--overwrite", action="store_true", help="delete a cache built with different settings")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(fn=cmd_build)
    v = sub.add_parser("verify", help="check completeness and checksums; exit 1 and name the bad shard on failure")
    v.add_argument("dir")
    v.add_argument("--quick", action="store_true",
                   help="manifest fields, settings, sizes and samples.idx only; shard contents are not read")
    v.set_defaults(fn=cmd_verify)
    i = sub.add_parser("inspect", help="samples, bytes/token, kl error, covered teacher mass, read speed")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true")
    i.add_argument("--max-samples", type=int, default=64, help="samples read to time the reader")
    i.set_defaults(fn=cmd_inspect)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from ..cache.errors import CacheError
    try:
        return args.fn(args)
    except CacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
