"""Cache builds. build_cache: run any teacher over a token dataset's samples and write its top-K, resumably.
build_teacher_cache / build_cache_only: a recipe's teacher over the run's training samples (kd.build_cache, the demo).

Layout: shards are fixed ranges of sample indices; data-parallel rank r computes shards r, r + dp, ...;
within a TP group every rank runs the teacher and the vocab-parallel top-K, and TP rank 0 writes. A pipelined
teacher (teacher.pp_group, see pipeline.py) runs its stages on every rank of the pipeline; only the last stage's
ranks compute the top-K, and its TP rank 0 writes.
Global rank 0 holds the directory's lock for the whole build, writes settings.json before anyone computes (and
checks that the shards an earlier run finished were built from this dataset's tokens) and manifest.json after
everyone is done.
Micro-batches never cross a shard boundary, so a shard's bytes do not depend on where a previous run died.
Each micro-batch's forward and top-K are queued on the device before the previous micro-batch's result is taken and
handed to the sink (sink.py: copies, encoding, writes), so the host's work on one overlaps the device's on the next.
"""
import dataclasses
import errno
import hashlib
import os
import sys

import torch
import torch.distributed as dist

from ..parallel.comm import group_rank, group_size
from ..parallel.sample import start_sample, start_sample_from_hidden
from ..parallel.topk import start_topk, start_topk_from_hidden
from ..cache.dataset import split_sample
from ..cache.encoding import EncodingOptions
from ..cache.errors import CacheError
from ..cache.format import is_finished, make_settings
from ..cache.hashing import token_hash
from ..cache.reader import load_manifest
from ..cache.space import check_free_space
from ..cache.writer import CacheWriter
from ..data.datasets import build_datasets, dataset_id, load_tokenizer, samples_needed
from ..recipe.checks import check_model, check_recipe, check_vocab
from ..recipe.hf import resolve_hf
from ..recipe.schema import Recipe
from ..rules import DEFAULT_TOP_K, out_of_room
from ..runtime.dist import distributed, is_rank0, use_cuda
from ..runtime.features import release_memory
from .megatron import cache_teacher
from .progress import Progress
from .sink import SampleSink


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier():
    if _dist_on():
        dist.barrier()


def _data_parallel(tp_group, pp_group, dp_rank, dp_size):
    if dp_rank is not None and dp_size is not None:
        return int(dp_rank), int(dp_size)
    ps = sys.modules.get("megatron.core.parallel_state")  # only if a Megatron teacher already imported it
    if ps is not None and ps.model_parallel_is_initialized():
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if group_size(pp_group) > 1:
        raise CacheError("a pipelined teacher outside Megatron's parallel_state: pass dp_rank= and dp_size= "
                         "(this rank's data-parallel replica and their number)")
    if _dist_on():
        tp = group_size(tp_group)
        return dist.get_rank() // tp, dist.get_world_size() // tp
    return 0, 1


def _tokens(dataset, i) -> torch.Tensor:
    return split_sample(dataset[i])["tokens"].reshape(-1)


_TOPK_STREAMS = {}


def _topk_stream(x, tp_group):
    """The stream a micro-batch's top-K is queued on: a side stream on CUDA when it issues no collective
    (one rank per TP group), else None (the current stream).

    On the side stream the next micro-batch's forward, queued right behind it, does not wait for it: the host
    syncs inside that forward (MoE routing reads its token counts on the host) wait for the current stream only,
    and the top-K runs in the gaps the device has while the host queues a launch-bound forward. At TP > 1 the
    top-K's collectives stay on the current stream, as two streams issuing collectives on one communicator can
    deadlock."""
    if not x.is_cuda or group_size(tp_group) > 1:
        return None
    key = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if key not in _TOPK_STREAMS:
        _TOPK_STREAMS[key] = torch.cuda.Stream(device=key)
    return _TOPK_STREAMS[key]


def _start_teacher_topk(teacher, tokens, k, temperature, chunk_size, tp_group, draws_of=None, to_host=False,
                        shards=None, rows=None):
    """Queue the teacher's forward and top-K of one micro-batch (PendingTopK); None on ranks of an earlier
    pipeline stage (their hidden states went to the next stage).
    draws_of: (sample indices of the micro-batch's rows, seed) for a sampled cache: k draws per position from the
    whole distribution (PendingSample) instead of the top-K, keyed by (seed, sample index, position, draw).
    to_host: queue the top-K's copy to the host right behind it (PendingTopK.copy_to_host), ahead of the next
    micro-batch's forward. shards: a dict kept across micro-batches, the VocabShard of each output layout: found
    once, the collective that sizes the vocabulary (a host sync at TP > 1) does not run per micro-batch.
    rows: the micro-batch's real samples, the first `rows` of tokens (the rest pad it to the size its
    expert-parallel peers run at, see _Lockstep); only they reach the top-K."""
    out = teacher(tokens)
    if out is None:
        return None
    if rows is not None and rows < tokens.shape[0]:
        out = _first_rows(out, rows)
        tokens = tokens[:rows]
    x = out.logits if out.logits is not None else out.hidden
    # draws stay on the current stream: their result is read there (PendingSample has no event to wait on)
    stream = _topk_stream(x, tp_group) if draws_of is None else None
    if stream is None:
        return _queue_topk(out, teacher, tokens, k, temperature, chunk_size, tp_group, draws_of, to_host, shards)
    stream.wait_stream(torch.cuda.current_stream(x.device))  # after the forward that made x
    for t in (x, out.weight):  # their memory is not handed to the next forward before the top-K has read them
        if t is not None and t.is_cuda:
            t.record_stream(stream)
    with torch.cuda.stream(stream):
        return _queue_topk(out, teacher, tokens, k, temperature, chunk_size, tp_group, draws_of, to_host, shards)


def _first_rows(out, rows: int):
    """The teacher's output for the first `rows` samples of its micro-batch."""
    return dataclasses.replace(out, hidden=None if out.hidden is None else out.hidden[:rows],
                               logits=None if out.logits is None else out.logits[:rows])


class _Lockstep:
    """Expert parallelism makes each forward of the teacher a collective over data-parallel ranks: a MoE layer
    exchanges its tokens with the ranks that hold the other experts (megatron-core's all-gather dispatcher
    gathers equal-sized blocks, the all-to-all one sends counts first). So every rank runs the same number of
    forwards, each of micro_batch_size samples: a short micro-batch is padded with copies of its last sample (their
    output is dropped), and a rank with no samples left runs forwards of `filler` (output dropped) until the
    rank with the most micro-batches is done. Without expert parallelism each rank simply runs its own."""

    def __init__(self, teacher, count: int, micro_batch_size: int, filler):
        self.on = bool(getattr(teacher, "expert_parallel", False)) and _dist_on()
        self.count, self.size = count, micro_batch_size
        if self.on:  # the most micro-batches any rank has (ranks of one TP group or pipeline have the same)
            n = torch.tensor([count], dtype=torch.int64, device=_collective_device())
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            self.count = int(n.item())
        self.filler = filler.reshape(1, -1).repeat(micro_batch_size, 1)

    def pad(self, tokens):
        """tokens [b, s] as the forward's input: padded to micro_batch_size rows when in lockstep."""
        b = tokens.shape[0]
        if not self.on or b == self.size:
            return tokens
        return torch.cat([tokens, tokens[-1:].repeat(self.size - b, 1)])

    def idle(self, teacher, done: int) -> None:
        """The forwards this rank owes its peers after its own `done` micro-batches; outputs dropped."""
        if self.on:
            for _ in range(done, self.count):
                teacher(self.filler)


def _collective_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _queue_topk(out, teacher, tokens, k, temperature, chunk_size, tp_group, draws_of, to_host, shards):
    """Queue the top-K (or the draws) of the teacher's output `out` for one micro-batch."""
    b, s = tokens.shape
    if draws_of is not None:
        first, seed = draws_of
        sample = torch.as_tensor(list(first), dtype=torch.int64).repeat_interleave(s)
        position = torch.arange(s, dtype=torch.int64).repeat(b)
        if out.logits is not None:
            return start_sample(out.logits.reshape(b * s, -1), k, sample, position, tp_group, out.vocab_start_index,
                                temperature, teacher.vocab_size, chunk_size, seed)
        return start_sample_from_hidden(out.hidden.reshape(b * s, -1), out.weight, k, sample, position, tp_group,
                                        chunk_size, temperature, out.vocab_start_index, teacher.vocab_size, seed)
    layout = (out.logits.shape[-1] if out.logits is not None else out.weight.shape[0], out.vocab_start_index)
    shard = None if shards is None else shards.get(layout)
    if out.logits is not None:
        pending = start_topk(out.logits.reshape(b * s, -1), k, tp_group, out.vocab_start_index, temperature,
                             teacher.vocab_size, chunk_size, shard=shard)
    else:
        pending = start_topk_from_hidden(out.hidden.reshape(b * s, -1), out.weight, k, tp_group, chunk_size,
                                         temperature, out.vocab_start_index, teacher.vocab_size, shard=shard)
    if shards is not None:
        shards[layout] = pending.shard
    return pending.copy_to_host() if to_host else pending


def _teacher_topk(teacher, tokens, k, temperature, chunk_size, tp_group):
    """One micro-batch's top-K, waited for: (ids, log-probs) [b, s, K], or (None, None) on an earlier stage."""
    pending = _start_teacher_topk(teacher, tokens, k, temperature, chunk_size, tp_group)
    if pending is None:
        return None, None
    ids, lp = pending.result()
    return ids.reshape(*tokens.shape, -1), lp.reshape(*tokens.shape, -1)


def _broadcast_list(obj: list, group) -> list:
    """Rank 0's list on every rank of the group: all ranks of a TP group (and of a pipeline) must run the same
    shards, in the same order."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _teacher_identity(teacher, teacher_id):
    if teacher_id is None:
        return teacher.identity()
    if isinstance(teacher_id, str):
        return {"name": teacher_id}
    return dict(teacher_id)


def build_cache(teacher, dataset, out_dir, *, encoding: EncodingOptions | None = None, temperature: float = 1.0,
                num_samples: int | None = None, samples_per_shard: int | None = None, micro_batch_size: int = 1,
                chunk_size: int | None = None, teacher_id=None, tokenizer_id: str = "", dataset_id: str | None = None,
                overwrite: bool = False, progress: bool = True, tp_group=None, dp_rank: int | None = None,
                dp_size: int | None = None, settings_fix: str | None = None) -> dict:
    """Build (or finish) the cache in out_dir; returns the manifest. Call on every rank with the same arguments.

    teacher: a Teacher (megatron_kd.teacher.protocol: CallableTeacher, HFTeacher;
             megatron_kd.teacher.megatron: MegatronTeacher).
    dataset: len() + [i] -> Megatron GPT dict (tokens, labels, ...) or seq_length + 1 token ids.
    teacher_id: overrides teacher.identity() (a dict, or a string used as the name).
    encoding: EncodingOptions (cache/encoding/): the encoding (default "fp16", or "topp" / "sampled" when top_p /
    samples is given), top_k (default DEFAULT_TOP_K) and the encoding's own settings: with "topp", top_p and min_k
    keep per position the fewest of the top_k ids whose mass reaches top_p (at least min_k; cache/topp.py); with
    "sampled", samples draws per position from the teacher's whole distribution at the temperature
    (parallel/sample.py), stored as the distinct ids and their counts (top_k is then samples), seeded by sample_seed.
    settings_fix: the fix named when out_dir holds a cache of other settings (default: `cache build`'s flags).
    """
    tp_group = tp_group if tp_group is not None else getattr(teacher, "tp_group", None)
    pp_group = getattr(teacher, "pp_group", None)
    dp_rank, dp_size = _data_parallel(tp_group, pp_group, dp_rank, dp_size)
    writes = group_rank(tp_group) == 0 and getattr(teacher, "is_last_stage", True)
    is_root = not _dist_on() or dist.get_rank() == 0
    settings = cache_settings(teacher.vocab_size, dataset, encoding=encoding, temperature=temperature,
                              num_samples=num_samples, samples_per_shard=samples_per_shard,
                              micro_batch_size=micro_batch_size, teacher=_teacher_identity(teacher, teacher_id),
                              tokenizer_id=tokenizer_id, dataset_id=dataset_id)
    top_k, seq = settings["top_k"], settings["seq_length"]
    draw_seed = settings.get("sample_seed")  # only a sampled cache's settings hold one: it draws instead of the top-K

    writer = None
    try:
        if is_root:
            writer = CacheWriter(out_dir, settings, overwrite=overwrite, settings_fix=settings_fix)
            writer.check_tokens(lambda i: token_hash(_tokens(dataset, i)))
        _barrier()
        if writer is None:
            writer = CacheWriter(out_dir, settings, lock=False)
        _build(writer, teacher, dataset, seq, top_k, temperature, chunk_size, micro_batch_size, tp_group, pp_group,
               dp_rank, dp_size, writes, is_root, progress, draw_seed)
    except OSError as e:
        if not out_of_room(e):
            raise
        raise CacheError(f"no space left on the device of {out_dir} while writing the cache (finished shards are "
                         "kept); free space there, then rerun the same command: the build resumes") from None
    finally:
        if writer is not None:
            writer.close()
    return load_manifest(writer.path)


def cache_settings(vocab_size: int, dataset, *, encoding=None, temperature=1.0, num_samples=None,
                   samples_per_shard=None, micro_batch_size=1, teacher=None, tokenizer_id="", dataset_id=None) -> dict:
    """The settings (format.make_settings) of the cache build_cache writes for a teacher of vocab_size ids over
    dataset: every check of the arguments, nothing run. `cache build --dry-run` sizes the cache from these.
    dataset_id None: the dataset's own description hash, else a hash of its first num_samples samples' tokens."""
    n = len(dataset) if num_samples is None else int(num_samples)
    if n > len(dataset):
        raise CacheError(f"num_samples={n} but the dataset has only {len(dataset)} samples; lower --num-samples")
    if micro_batch_size < 1:
        raise CacheError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    seq = int(_tokens(dataset, 0).numel())
    if not dataset_id:
        dataset_id = str(getattr(dataset, "unique_description_hash", "") or "")
    if not dataset_id:  # nothing names the data: name it by its content, so other data is never taken for it
        dataset_id = content_id(dataset, n)
    return settings_for(vocab_size, seq, n, encoding=encoding, temperature=temperature,
                        samples_per_shard=samples_per_shard, teacher=teacher, tokenizer_id=tokenizer_id,
                        dataset_id=dataset_id)


def settings_for(vocab_size: int, seq_length: int, num_samples: int, *, encoding=None, temperature=1.0,
                 samples_per_shard=None, teacher=None, tokenizer_id="", dataset_id="") -> dict:
    """make_settings after build_cache's defaults: the encoding a given setting implies (--top-p, --samples), K as
    the encoding decides it (a sampled cache's draws), else DEFAULT_TOP_K. encoding: EncodingOptions (None: all
    defaults)."""
    options = encoding or EncodingOptions()
    top_k, forced = options.top_k, options.forced_top_k()
    if forced is not None:
        if top_k is not None and top_k != forced:
            raise CacheError(f"a sampled cache holds at most samples={options.get('samples')} ids per position; "
                             f"top_k={top_k} cannot differ (drop top_k / --top-k)")
        top_k = forced
    options = options.replace(encoding=options.name, top_k=DEFAULT_TOP_K if top_k is None else top_k)
    return make_settings(encoding=options, vocab_size=vocab_size, temperature=temperature, seq_length=seq_length,
                         num_samples=num_samples, teacher=teacher, tokenizer=tokenizer_id, dataset=dataset_id,
                         samples_per_shard=samples_per_shard)


def recipe_cache_args(kd) -> dict:
    """build_cache's settings keywords for a recipe's kd section (kd.cache_encoding, kd.top_k and each encoding's
    own kd.cache_KEY): what kd.build_cache builds, and what `megatron-kd plan` sizes on disk."""
    options = EncodingOptions.from_recipe(kd)
    if not options.get("samples"):  # a seed without draws seeds nothing
        options = EncodingOptions.of(options.encoding, **{k: v for k, v in options.given if k != "sample_seed"})
    return dict(encoding=options.replace(top_k=options.get("samples") or kd.top_k), temperature=kd.capture_temperature)


def content_id(dataset, n: int) -> str:
    """'content:' + a 64-bit hash of the first n samples' token hashes (the data a cache describes)."""
    h = hashlib.blake2b(digest_size=8)
    for i in range(n):
        h.update(token_hash(_tokens(dataset, i)).to_bytes(8, "little"))
    return f"content:{h.hexdigest()}"


def _build(writer, teacher, dataset, seq, top_k, temperature, chunk_size, micro_batch_size, tp_group, pp_group,
           dp_rank, dp_size, writes, is_root, progress, draw_seed=None) -> None:
    finished = is_finished(writer.path)  # and nothing pending: the writer checked
    check_free_space(writer, writer.pending_shards())  # every rank, the same list: one decision
    mine = [j for j in writer.pending_shards() if j % dp_size == dp_rank]
    mine = _broadcast_list(_broadcast_list(mine, tp_group), pp_group)  # stage 0's list on every stage
    _barrier()  # every rank has listed its shards before any rank writes one

    todo = sum(writer.shard_range(j)[1] - writer.shard_range(j)[0] for j in mine)
    bar = Progress(todo, seq, enabled=progress and is_root, scale=dp_size)
    sink = SampleSink(writer) if writes else None
    prev = None  # the micro-batch queued on the device before this one: handed to the sink while this one runs
    layouts = {}  # the output layer's VocabShard, found on the first micro-batch

    shard = None  # the sink's handle of the shard being handed off

    def hand_off(p):
        nonlocal shard
        pending, tokens, j, first, last = p
        if sink is not None and first:
            shard = sink.begin(j)  # queued after the previous shard's commit: its file opens after that commit
        if pending is not None:  # the last pipeline stage
            # waits for this micro-batch's top-K only (not for the next one's forward, queued before this call)
            ids, lp, ready = pending.host_result()
            if sink is not None:
                k = ids.shape[-1]
                sink.put(shard, ids.reshape(*tokens.shape, k), lp.reshape(*tokens.shape, k), tokens, ready)
        if sink is not None and last:
            sink.commit(shard)
        bar.update(tokens.shape[0])

    micro = [(j, a, min(stop, a + micro_batch_size)) for j in mine
             for first, stop in [writer.shard_range(j)] for a in range(first, stop, micro_batch_size)]
    lockstep = _Lockstep(teacher, len(micro), micro_batch_size, _tokens(dataset, 0))
    try:
        for j, a, b in micro:
            first, stop = writer.shard_range(j)
            tokens = torch.stack([_tokens(dataset, i) for i in range(a, b)])
            if tokens.shape[1] != seq:
                raise CacheError(f"sample {a} has {tokens.shape[1]} tokens, sample 0 has {seq}: the cache needs "
                                 "a dataset of fixed sequence length")
            draws_of = None if draw_seed is None else (range(a, b), draw_seed)
            cur = (_start_teacher_topk(teacher, lockstep.pad(tokens), top_k, temperature, chunk_size, tp_group,
                                       draws_of, to_host=sink is not None, shards=layouts, rows=b - a), tokens, j,
                   a == first, b == stop)
            if prev is not None:
                hand_off(prev)
            prev = cur
        if prev is not None:
            hand_off(prev)
        lockstep.idle(teacher, len(micro))
        if sink is not None:
            sink.close()
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    if hasattr(teacher, "flush"):
        teacher.flush()  # a pipeline stage's last sends
    bar.close()
    _barrier()
    if is_root and not finished:
        writer.finalize()
    _barrier()


def build_teacher_cache(r: Recipe, tok, train_ds, num_samples: int) -> dict:
    """kd.build_cache: run the recipe's teacher over the training samples and write kd.cache (resumable)."""
    from megatron.core import parallel_state as ps
    check_model(r.teacher, "teacher", r.parallel.tp)  # parallel.pp: recipe/checks (_check_kd), before any work
    if not r.teacher.hf_path and not r.teacher.load and is_rank0():
        print("note: teacher.load is null: the cache comes from a randomly initialized teacher (a pipeline "
              "check, not a distillation); set teacher.load to a trained teacher's save dir", flush=True)
    teacher = cache_teacher(r, tok.vocab_size)
    manifest = build_cache(teacher, train_ds, r.kd.cache, **recipe_cache_args(r.kd),
                           num_samples=num_samples,
                           micro_batch_size=r.train.micro_batch_size, chunk_size=r.kd.chunk_size,
                           tokenizer_id=getattr(tok, "sha", ""), dataset_id=dataset_id(train_ds),
                           progress=r.train.progress and is_rank0(), tp_group=ps.get_tensor_model_parallel_group(),
                           dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                           settings_fix="give these settings a kd.cache of their own, or rerun with the cache's "
                           "(kd.build_cache=false reads a finished cache as it is)")
    del teacher
    release_memory()
    return manifest


def build_cache_only(r: Recipe) -> dict:
    """The offline recipe's cache (kd.cache) from its teacher over the run's training samples; no training."""
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    cuda = use_cuda(r.train.device)
    resolve_hf(r, teacher=True)
    check_recipe(r, world, cuda)
    tok = load_tokenizer(r.data)
    check_vocab(tok.vocab_size, r.teacher, "teacher", r.parallel.tp)
    with distributed(r.parallel, r.train.seed, r.train.device):
        train_n, valid_n = samples_needed(r.train, r.data)
        train_ds, _ = build_datasets(r.data, tok, train_n, valid_n)
        return build_teacher_cache(r, tok, train_ds, train_n)
