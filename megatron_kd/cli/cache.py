"""`megatron-kd cache build|verify|inspect`: the offline teacher top-K cache from the command line.

The cache a recipe trains on: --recipe RECIPE and its Hydra overrides give both the teacher (teacher.load, or
teacher.hf_path; --teacher-hf DIR sets it) and the samples (the run's training samples of data.path):

    megatron-kd cache build --out CACHE --top-k 8 --recipe tiny_cpu --teacher-hf TEACHER_DIR \
        data.kind=indexed data.path=PREFIX data.tokenizer=TEACHER_DIR data.vocab_size=null train.iters=4

Otherwise teachers and datasets are named as `module:function` factories (called with the JSON --*-args as keyword
arguments) so any model or data pipeline plugs in; `--teacher hf:DIR` loads a local transformers model and
`--tokens FILE.npy` reads an int array [num_samples, seq_length + 1]. Under torchrun every rank runs the same
command; the teacher factory sets up Megatron's model parallel groups itself.
"""
import argparse
import json
import os
import sys

from ..rules import DEFAULT_TOP_K


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


RECIPE_HINT = ("--recipe RECIPE data.kind=indexed data.path=PREFIX data.tokenizer=TOKENIZER (the samples a `megatron-kd "
               "train` of that recipe reads; the recipe's teacher, or --teacher-hf DIR)")


def _recipe_overrides(args) -> list:
    return list(args.overrides) + ([f"teacher.hf_path={args.teacher_hf}"] if args.teacher_hf else [])


def _teacher(args):
    from ..teacher.spec import make_teacher
    if args.teacher is None:
        from ..teacher.factories import recipe_teacher
        try:
            return recipe_teacher(args.recipe, _recipe_overrides(args))
        except ValueError as e:
            raise SystemExit(f"error: --recipe {args.recipe}: {e}") from None
    try:
        return make_teacher(args.teacher, _json_arg(args.teacher_args, "--teacher-args"))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    except ImportError as e:  # hf: needs transformers
        raise SystemExit(f"error: --teacher {args.teacher}: {e}") from None


def _dataset(args):
    if args.tokens:
        import numpy as np
        from ..rules import file_sha256
        try:
            data = np.load(args.tokens, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            why = getattr(e, "strerror", None) or str(e).split(".")[0]
            raise SystemExit(f"error: --tokens {args.tokens} cannot be read as a .npy array ({why}); give a .npy "
                             "file of an int array [num_samples, seq_length + 1] (numpy.save)") from None
        if data.ndim != 2 or data.shape[1] < 2:
            raise SystemExit(f"error: --tokens {args.tokens} must hold an int array [num_samples, seq_length + 1], "
                             f"got shape {data.shape}")
        if not np.issubdtype(data.dtype, np.integer):
            raise SystemExit(f"error: --tokens {args.tokens} holds {data.dtype} values, not token ids; save an "
                             "integer array (e.g. numpy.save(path, tokens.astype(numpy.int64)))")
        return data, args.dataset_id or f"npy:{file_sha256(args.tokens)[:16]}"
    if not args.dataset:
        if args.recipe:
            from ..teacher.factories import recipe_dataset
            try:
                return recipe_dataset(args.recipe, _recipe_overrides(args)), args.dataset_id
            except ValueError as e:
                raise SystemExit(f"error: --recipe {args.recipe}: {e}") from None
        raise SystemExit(f"error: name the samples: {RECIPE_HINT}; or --tokens FILE.npy, or --dataset module:function")
    if ":" not in args.dataset:  # a path, e.g. the prefix `data prepare` wrote
        raise SystemExit(f"error: --dataset {args.dataset}: --dataset takes a `module:function` factory; for the "
                         f"samples of a prepared corpus use {RECIPE_HINT.replace('PREFIX', args.dataset)}")
    from ..teacher.spec import check_kwargs
    fn, kw = _factory(args.dataset), _json_arg(args.dataset_args, "--dataset-args")
    try:
        check_kwargs(fn, kw, "--dataset-args")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return fn(**kw), args.dataset_id


def _check_ids(data, vocab_size: int, flag: str) -> None:
    """Every token id of an in-memory or memory-mapped array in [0, vocab_size): an id outside is a gather out of
    bounds in the teacher (or, below the vocabulary's end, a wrong token), so it is refused before the build."""
    import numpy as np
    if not isinstance(data, np.ndarray) or not data.size:
        return
    lo, hi = int(data.min()), int(data.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise SystemExit(f"error: {flag} holds token id {bad}, outside the teacher's vocabulary [0, {vocab_size - 1}]; "
                         "tokenize with the teacher's tokenizer")


def _check_counts(args, top_k) -> None:
    """The counting flags and the temperature, before anything is loaded."""
    from ..rules import temperature_problem, top_k_fits
    if top_k is not None and not top_k_fits(top_k):
        raise SystemExit(f"error: --top-k {top_k} must be >= 1")
    for flag, v in (("--num-samples", args.num_samples),
                    ("--samples-per-shard", args.samples_per_shard), ("--micro-batch-size", args.micro_batch_size),
                    ("--chunk-size", args.chunk_size)):
        if v is not None and v < 1:
            raise SystemExit(f"error: {flag} {v} must be >= 1")
    problem = temperature_problem(args.temperature)
    if problem:
        raise SystemExit(f"error: --temperature {args.temperature} {problem} (1 = the teacher's own distribution)")


def cmd_build(args) -> int:
    from ..runtime.interrupt import run_interruptible
    return run_interruptible(lambda: _build(args), "finished shards are kept")


def _build(args) -> int:
    if (args.overrides or args.teacher_hf) and not args.recipe:
        raise SystemExit("error: KEY=VALUE overrides and --teacher-hf belong to a recipe: add --recipe RECIPE "
                         "(e.g. tiny_cpu)")
    if args.teacher is None and not args.recipe:
        raise SystemExit(f"error: name the teacher: --teacher SPEC, or {RECIPE_HINT}")
    import torch
    from ..runtime.dist import init_process_group
    from ..teacher.build import build_cache
    options = _encoding_args(args)
    top_k = _top_k_arg(args, options)
    options = options.replace(top_k=top_k)
    _check_counts(args, top_k)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise SystemExit(f"error: --out {args.out} is a file, not a cache directory; give a directory (made when "
                         "missing)")
    if args.dry_run:
        return _dry_run(args, options)
    if args.vocab_size is not None:
        raise SystemExit("error: --vocab-size only sizes a --dry-run (a build takes the teacher's own vocabulary): "
                         "add --dry-run, or drop --vocab-size")
    init_process_group(torch.cuda.is_available(), launched_only=True)
    # the dataset's arguments first: loading a teacher is the slow part, and the one that may need a package
    dataset, dataset_id = _dataset(args)
    teacher = _teacher(args)
    _check_vocab(args, dataset, top_k, teacher.vocab_size)
    m = build_cache(teacher, dataset, args.out, encoding=options, temperature=args.temperature,
                    num_samples=args.num_samples,
                    samples_per_shard=args.samples_per_shard, micro_batch_size=args.micro_batch_size,
                    chunk_size=args.chunk_size, teacher_id=args.teacher_id, tokenizer_id=args.tokenizer_id,
                    dataset_id=dataset_id, overwrite=args.overwrite, progress=not args.no_progress)
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        written = sum(s["bytes"] for s in m["shards"]) / (m["num_samples"] * m["seq_length"])
        kept = (f" (top-P {m['top_p']}: {m['stats']['kept_sum'] / max(1, m['stats']['tokens']):.1f} ids kept per "
                "position on average)" if m.get("top_p") is not None else "")
        if m.get("samples") is not None:
            kept = (f" ({m['samples']} draws per position: {m['stats']['kept_sum'] / max(1, m['stats']['tokens']):.1f} "
                    "distinct ids on average)")
        print(f"cache complete: {args.out}: {m['num_samples']} samples x {m['seq_length']} positions x "
              f"K={m['top_k']}, {m['encoding']}, {written:.1f} bytes/token{kept}")
    return 0


def _check_vocab(args, dataset, top_k, vocab_size: int) -> None:
    """--top-k and --tokens against the teacher's vocabulary."""
    from ..rules import top_k_fits
    if top_k is not None and not top_k_fits(top_k, vocab_size):
        raise SystemExit(f"error: --top-k {top_k} exceeds the teacher's vocabulary ({vocab_size} ids); "
                         f"give --top-k <= {vocab_size}")
    _check_ids(dataset if args.tokens else None, vocab_size, f"--tokens {args.tokens}")


def _existing_dir(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def _dry_run(args, options) -> int:
    """The settings the build would write and the disk they take, after the build's checks of its arguments, the
    samples and the recipe's teacher; the teacher is not built or run."""
    from ..cache.space import estimate_bytes
    from ..rules import free_space
    from ..teacher.build import cache_settings
    dataset, dataset_id = _dataset(args)
    if args.teacher is None:
        from ..teacher.factories import checked_recipe_teacher
        if args.vocab_size is not None:
            raise SystemExit("error: --vocab-size: the recipe's teacher has its tokenizer's vocabulary; drop "
                             "--vocab-size (it sizes a --dry-run of --teacher SPEC)")
        try:
            _, vocab_size = checked_recipe_teacher(args.recipe, _recipe_overrides(args))
        except ValueError as e:
            raise SystemExit(f"error: --recipe {args.recipe}: {e}") from None
    elif args.vocab_size is None:
        raise SystemExit(f"error: --dry-run does not load --teacher {args.teacher}: give its vocabulary size with "
                         "--vocab-size V (the number of ids its output layer scores)")
    elif args.vocab_size < 1:
        raise SystemExit(f"error: --vocab-size {args.vocab_size} must be >= 1")
    else:
        vocab_size = args.vocab_size
    _check_vocab(args, dataset, options.top_k, vocab_size)
    settings = cache_settings(vocab_size, dataset, encoding=options, temperature=args.temperature,
                              num_samples=args.num_samples, samples_per_shard=args.samples_per_shard,
                              micro_batch_size=args.micro_batch_size,
                              dataset_id=dataset_id or "not hashed by --dry-run")
    est = estimate_bytes(settings)
    what = {"topp": f", top-P {settings.get('top_p')}", "sampled": f", {settings.get('samples')} draws"}
    print(f"cache build --dry-run: {settings['num_samples']} samples x {settings['seq_length']} positions = "
          f"{est['tokens']:,} tokens; K={settings['top_k']}, encoding {settings['encoding']}"
          f"{what.get(settings['encoding'], '')}, vocabulary {vocab_size}")
    if est["variable"]:
        size = (f"between {est['low']:,} and {est['high']:,} bytes ({est['bytes_per_token_low']:.2f} to "
                f"{est['bytes_per_token_high']:.2f} bytes/token; the ids kept per position decide where)")
    else:
        size = f"{est['high']:,} bytes ({est['high'] / 2**30:.3f} GiB, {est['bytes_per_token_high']:.2f} bytes/token)"
    print(f"disk            {size} in {est['shards']} shard(s) and samples.idx, plus a few KiB of JSON per shard")
    where = _existing_dir(args.out)
    free, fits = free_space(where, est["high"])
    print(f"free space      {free / 2**30:.2f} GiB at {where}: " + ("fits" if fits else "does NOT fit"))
    print("nothing was built; drop --dry-run to run the teacher")
    return 0


def _encoding_args(args):
    """The EncodingOptions of --encoding and the encodings' own flags (--top-p, --min-k, --samples, --sample-seed),
    its encoding named: --top-p alone means the topp encoding, --samples alone the sampled one."""
    from ..cache.encoding import EncodingOptions
    options = EncodingOptions.from_args(args)
    encoding = options.name
    problem = options.problem()
    if problem == "needs_samples":
        raise SystemExit("error: --encoding sampled stores N draws per position: add --samples N (e.g. 16)")
    if problem == "not_sampled":
        raise SystemExit(f"error: --samples / --sample-seed need --encoding sampled (the {encoding} encoding stores "
                         "the teacher's top ids, not draws); drop --encoding, or drop --samples / --sample-seed")
    if problem == "needs_top_p":
        raise SystemExit("error: --encoding topp keeps the fewest ids holding a mass P: add --top-p P (e.g. 0.999)")
    if problem == "fixed_k":
        raise SystemExit(f"error: --top-p / --min-k need --encoding topp (the {encoding} encoding stores K ids at "
                         "every position); drop --encoding, or drop --top-p / --min-k")
    return options.replace(encoding=encoding)


def _top_k_arg(args, options):
    """--top-k (default DEFAULT_TOP_K); a sampled cache holds at most --samples ids per position, so it takes no --top-k."""
    if options.forced_top_k() is not None:
        if args.top_k is not None:
            raise SystemExit("error: --top-k does not apply to --samples (a sampled cache holds the distinct ids of N "
                             "draws per position, at most N): drop --top-k")
        return None
    return DEFAULT_TOP_K if args.top_k is None else args.top_k


def cmd_verify(args) -> int:
    from ..cache import verify_cache
    from ..cache.format import is_finished
    from ..cache.verify import FULL_CHECKS, QUICK_CHECKS, VARIABLE_CHECKS
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
            from ..cache.reader import load_manifest
            from ..cache.encoding import encoding_of
            extra = VARIABLE_CHECKS if encoding_of(load_manifest(args.dir)).variable else ""
            print(f"ok: {args.dir}: checked {FULL_CHECKS}{extra}")
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
        *_kept_lines(info),
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


def _kept_lines(info: dict) -> list:
    out = []
    if info.get("samples") is not None:
        q = info["kept_k_quantiles"]
        out += [f"sampled         N={info['samples']} draws per position (seed {info['sample_seed']}): distinct ids "
                f"mean {info['kept_k_mean']:.2f}, p10/p50/p90/p99 {q['p10']}/{q['p50']}/{q['p90']}/{q['p99']} "
                f"(bound: {info['bytes_per_token_max']:.2f} bytes/token); targets count/N, summing to 1",
                "distinct hist.  " + " ".join(f"{k}:{v}" for k, v in info["kept_k_histogram"].items())]
    if info.get("top_p") is not None:
        q = info["kept_k_quantiles"]
        out += [f"top-P           P={info['top_p']}, min_k={info['min_k']}: kept ids per position mean "
                f"{info['kept_k_mean']:.2f}, p10/p50/p90/p99 {q['p10']}/{q['p50']}/{q['p90']}/{q['p99']} "
                f"(bound: {info['bytes_per_token_max']:.2f} bytes/token)",
                f"dropped mass    mean {info['dropped_mass_mean']:.3g}, max {info['dropped_mass_max']:.3g} of the "
                f"top-K's; tail-none gradient error <= 2 x dropped mass (L1 over the logits, any student): mean "
                f"{info['grad_error_bound_mean']:.3g}",
                "kept histogram  " + " ".join(f"{k}:{v}" for k, v in info["kept_k_histogram"].items())]
    pv = info.get("top_p_preview")
    if pv:
        out.append(f"teacher         on {pv['positions']} positions: top-1 probability mean {pv['top1_prob_mean']:.4f}, "
                   f"top-K entropy mean {pv['topk_entropy_mean']:.4f} nats, top-K mass mean {pv['topk_mass_mean']:.4f}")
        for P, row in pv["per_top_p"].items():
            out.append(f"if --top-p {P:<7} kept ids mean {row['kept_k_mean']:.2f} (p90 {row['kept_k_quantiles']['p90']}),"
                       f" dropped mass mean {row['dropped_mass_mean']:.3g}, {row['bytes_per_token']:.2f} bytes/token")
    return out


def _top_ps(text):
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --top-p {text!r}: give numbers in (0, 1] separated by commas, e.g. 0.99,0.999")
    if not all(0 < v <= 1 for v in vals):
        raise SystemExit(f"error: --top-p {text!r}: every P must be in (0, 1], e.g. 0.99,0.999")
    return vals


def cmd_inspect(args) -> int:
    from ..cache import inspect_cache
    if args.min_k < 1:
        raise SystemExit(f"error: --min-k {args.min_k} must be >= 1")
    if args.max_samples < 1:
        raise SystemExit(f"error: --max-samples {args.max_samples} must be >= 1 (samples read to time the reader)")
    top_ps = _top_ps(args.top_p or "")
    from ..cache.format import is_finished
    if top_ps and is_finished(args.dir):  # a build in progress previews nothing
        from ..cache.reader import load_manifest
        k = load_manifest(args.dir)["top_k"]
        if args.min_k > k:
            raise SystemExit(f"error: --min-k {args.min_k} is above the K={k} ids per position {args.dir} holds, "
                             f"so the preview cannot keep that many; give --min-k between 1 and {k}")
    info = inspect_cache(args.dir, max_samples=args.max_samples, top_p=top_ps, min_k=args.min_k)
    print(json.dumps(info, indent=1, sort_keys=True) if args.json else _fmt(info))
    return 0


def parser() -> argparse.ArgumentParser:
    from ..cache.encoding import add_flags
    p = argparse.ArgumentParser(prog="megatron-kd cache", description="offline teacher top-K cache")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="run a teacher over a dataset and write (or resume) a cache")
    b.add_argument("--out", required=True, help="cache directory (a restart with the same command resumes it)")
    b.add_argument("--recipe", help="a recipe (name or .yaml): its teacher and its run's training samples, with the "
                                    "Hydra overrides given after the flags")
    b.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="with --recipe: Hydra overrides of the recipe")
    b.add_argument("--teacher-hf", metavar="DIR", help="with --recipe: a Hugging Face teacher folder (teacher.hf_path)")
    b.add_argument("--teacher", help="module:function returning a teacher, hf:MODEL_DIR or mkd:SAVE_DIR (default: "
                                     "the --recipe's teacher)")
    b.add_argument("--teacher-args", default="{}", help="JSON keyword arguments for the teacher factory")
    b.add_argument("--tokens", help=".npy int array [num_samples, seq_length + 1]")
    b.add_argument("--dataset", help="module:function returning a token dataset (len and [i])")
    b.add_argument("--dataset-args", default="{}", help="JSON keyword arguments for the dataset factory")
    b.add_argument("--top-k", type=int, default=None, help=f"default {DEFAULT_TOP_K}")
    add_flags(b)  # --encoding and each encoding's own (cache/encoding/)
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
    b.add_argument("--dry-run", action="store_true",
                   help="check the arguments, the samples and the recipe's teacher settings, print the cache's size "
                        "on disk and the free space at --out; build nothing (docs/choosing-a-cache.md)")
    b.add_argument("--vocab-size", type=int, default=None, metavar="V",
                   help="with --dry-run and --teacher SPEC: the teacher's vocabulary size (not loaded)")
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
    i.add_argument("--top-p", default=None, metavar="P[,P...]",
                   help="preview on those samples what --top-p P would keep: kept ids, dropped mass, bytes/token")
    i.add_argument("--min-k", type=int, default=1, help="with --top-p: the --min-k of the preview")
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
