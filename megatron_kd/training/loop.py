"""The training loop behind `megatron-kd train`: checks, data, models, Megatron DDP/optimizer, steps, checkpoints.

    run(recipe, save_dir)  ->  summary dict (on every rank; rank 0 also writes it to <save>/summary.json)

Everything that can be wrong with a recipe is checked before a model is built (recipe.checks, the
vocabulary, the cache). Resuming follows Megatron-LM: the latest checkpoint in train.load (default: train.save)
is loaded when there is one; a save directory that already holds another run's checkpoints is never reused.
"""
import dataclasses
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..checkpoint import store as ckpt
from ..data.datasets import (Mixture, build_datasets, check_cache, loader, samples_needed,
                             source_caches, with_cache)
from ..export.to_hf import export_at_end
from ..models.builder import build_model_chunks, wrap_float16
from ..optim.setup import build_optimizer, build_scheduler, set_model_hooks, wrap_ddp
from ..recipe.schema import KDConfig, Recipe, RecipeError, RunError
from ..recipe.targets import TargetSource
from ..runtime.dist import barrier, distributed, is_rank0, set_seed, use_cuda
from ..runtime.features import release_memory
from ..teacher.build import build_teacher_cache
from ..teacher.megatron import OnlineTeacher, build_teacher
from .metrics import Sink, forward_flops_per_step, peak_memory_gib, train_flops_per_step
from .schedule import forward_backward
from . import guards, resume, safety
from .preflight import preflight
from .step import KDStep


def recipe_dict(r: Recipe) -> dict:
    return dataclasses.asdict(r)


def run(r: Recipe, save: str) -> dict:
    """Train the student of recipe r, writing checkpoints and logs to `save`. Call on every rank."""
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    cuda = use_cuda(r.train.device)
    tok = preflight(r, world, cuda)
    load = r.train.load or save
    safety.check_save_dir(save)  # where the run writes first, then what it would resume from
    resume.check_against_save(r, save)
    from ..cache import CacheError
    with safety.save_lock(save, is_rank0()), distributed(r.parallel, r.train.seed, r.train.device) as cuda:
        try:
            summary = Trainer(r, save, load, tok, cuda).fit()
        except CacheError as e:  # met reading the cache (a corrupt shard): the reader's message names the fix
            raise RunError(f"kd.cache={r.kd.cache}: {e}") from None
        finally:
            release_memory()
    if r.train.export_hf and summary["iteration"] >= r.train.iters and is_rank0():
        summary["export_hf"] = export_at_end(save, r.train.export_hf)
    return summary


class Trainer:
    def __init__(self, r: Recipe, save: str, load: str, tok, cuda: bool):
        from megatron.core import parallel_state as ps
        self.r, self.save, self.load, self.tok, self.cuda = r, save, load, tok, cuda
        self.vocab = tok.vocab_size
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.world = dist.get_world_size()
        t = r.train
        self.num_micro = t.global_batch_size // (t.micro_batch_size * self.dp)
        self.train_n, self.valid_n = samples_needed(t, r.data)
        self.notes = []

        self.train_ds, self.valid_ds = build_datasets(r.data, tok, self.train_n, self.valid_n)
        self.train_set = self.train_ds
        self.targets = TargetSource.of(r.kd)
        if self.targets.reads_cache:
            self.train_set = self._offline_data()
        set_seed(t.seed)  # the student's init must not depend on what ran before (e.g. a cache build)
        self.chunks, self.config = build_model_chunks(r.model, r.parallel, self.vocab, r.data.seq_length,
                                                      t.precision)
        self.chunks = wrap_ddp(wrap_float16(self.chunks, self.config), self.config, r.parallel, cuda, t)
        self.optimizer = build_optimizer(self.chunks, t, r.parallel, cuda)
        self.scheduler = build_scheduler(self.optimizer, t)
        set_model_hooks(self.config, self.chunks, self.optimizer)
        self.teacher = self._online_teacher() if self.targets.teacher_each_step else None
        if cuda:  # every library has loaded by now: a second cuDNN would slow attention with no word of its own
            from ..runtime.te_compat import cudnn_clash
            clash = cudnn_clash()
            self.notes += [clash] if clash else []
        cp_group = ps.get_context_parallel_group()
        self.step_fn = KDStep(r.kd, self.vocab, self.teacher, split_report=r.kd.log_ce, cp_group=cp_group)
        eval_kd = r.kd if self.targets.teacher_each_step else KDConfig(mode="ce", impl=r.kd.impl,
                                                                        chunk_size=r.kd.chunk_size)
        self.eval_fn = KDStep(eval_kd, self.vocab, self.teacher, cp_group=cp_group)
        self.flops = train_flops_per_step(r.model, self.vocab, r.data.seq_length, t.global_batch_size)
        if self.teacher is not None:
            self.flops += forward_flops_per_step(r.teacher, self.vocab, r.data.seq_length, t.global_batch_size)

    # --- setup pieces ---------------------------------------------------------------------------------------

    def _offline_data(self):
        if isinstance(self.train_ds, Mixture):
            return self._mixture_data()
        from ..cache import CacheError, CacheReader
        r = self.r
        try:
            # build (or check) every time, so a finished cache from another teacher,
            # data or settings is refused naming both sides instead of being used; kd.teacher_id: declared teacher
            if self.targets.builds_cache:
                build_teacher_cache(r, self.tok, self.train_ds, self.train_n)
            reader = CacheReader(r.kd.cache, expected_teacher=r.kd.teacher_id)
        except CacheError as e:
            raise RecipeError(f"kd.cache={r.kd.cache}: {e}") from None
        self.notes += check_cache(reader, r.kd, r.data, self.train_ds, self.vocab, self.train_n)  # on every rank
        from megatron.core import parallel_state as ps
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return self.train_ds  # the loss, and so the cache rows, live on the last pipeline stage
        return with_cache(self.train_ds, reader, r.kd)

    def _mixture_data(self):
        """A blend of sources: each source has its own cache (kd.cache/<source name>) over its own samples, built
        (kd.build_cache) or checked like a single dataset's; the mixture reads sample i's rows from its source's."""
        from ..cache import CacheError, CacheReader
        from ..cache.reader import mixed_precision_note
        from megatron.core import parallel_state as ps
        r, mix, sets = self.r, self.train_ds, []
        teachers = {}
        for kd, source, name in zip(source_caches(r.kd, mix), mix.sources, mix.names):
            try:
                if TargetSource.of(kd).builds_cache:
                    build_teacher_cache(dataclasses.replace(r, kd=kd), self.tok, source, self.train_n)
                reader = CacheReader(kd.cache, expected_teacher=kd.teacher_id)
            except CacheError as e:
                raise RecipeError(f"kd.cache={kd.cache} (the mixture source {os.path.basename(kd.cache)}'s "
                                  f"cache): {e}") from None
            self.notes += check_cache(reader, kd, r.data, source, self.vocab, self.train_n)
            sets.append(with_cache(source, reader, kd))
            teachers[name] = reader.manifest.get("teacher")
        note = mixed_precision_note(teachers)
        self.notes += [note] if note else []
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return self.train_ds
        return mix.with_sources(sets)

    def _online_teacher(self):
        r = self.r
        model = wrap_float16([build_teacher(r, self.vocab)], self.config)[0]
        return OnlineTeacher(model, r.kd.top_k, self.vocab, r.kd.temperature, r.kd.chunk_size)

    def _resume(self):
        """(iteration, consumed samples) to start from."""
        start, consumed, notes = resume.load_state(self.r, self.load, self.chunks, self.optimizer, self.scheduler,
                                                   is_rank0())
        self.notes += notes
        return start, consumed

    # --- the loop -------------------------------------------------------------------------------------------

    def _quantize(self) -> None:
        """quant.format: the student (its pretrained weights loaded) quantized by ModelOpt and calibrated on the
        first quant.calib_samples training samples, forward only, through the same schedule as training (so
        TP ranks calibrate together). A student restored quantized (resume, or quantized train.pretrained)
        keeps its quantizers and their values."""
        from ..models import quant
        from ..models.builder import unwrap
        r, t = self.r, self.r.train
        model = unwrap(self.chunks[0])
        done = getattr(model, quant.FORMAT_KEY, None) if quant.is_quantized(model) else None
        if done is not None or r.quant.format == "none":
            if done is not None and r.quant.format not in ("none", done):
                raise RecipeError(f"quant.format={r.quant.format}: the student loaded from "
                                  f"{self.load if ckpt.latest_iteration(self.load) is not None else t.pretrained}"
                                  f" is already quantized as {done}; set quant.format={done} (or none)")
            return
        per_batch = t.global_batch_size
        n = -(-min(r.quant.calib_samples, self.train_n) // per_batch) * per_batch
        ce = KDStep(KDConfig(mode="ce", impl=r.kd.impl, chunk_size=r.kd.chunk_size), self.vocab,
                    split_report=False, cp_group=self.step_fn.cp_group)

        @torch.no_grad()
        def forward_loop(_):
            data = self._iterators(self.train_ds, n, 0)
            for _ in range(n // per_batch):
                forward_backward(ce, data, self.chunks, self.num_micro, r.data.seq_length, t.micro_batch_size,
                                 forward_only=True)
        t0 = time.perf_counter()
        quant.quantize(model, r.quant.format, forward_loop)
        self.notes.append(f"quantized the student as {r.quant.format} (ModelOpt: {len(quant.enabled_quantizers(model))}"
                          f" quantizers), calibrated on {n} training samples in {time.perf_counter() - t0:.1f} s")

    def fit(self) -> dict:
        r, t = self.r, self.r.train
        start, consumed = self._resume()
        self._quantize()
        rank0 = is_rank0()
        sink = Sink(self.save, t.iters, start, t.progress, t.tensorboard, rank0)
        for n in self.notes:
            sink.print(f"note: {n}")
        if start >= t.iters:
            sink.print(f"train.save={self.save}: already trained to iteration {start} of {t.iters}; nothing to do")
            sink.close()
            return self._summary(start, [], {}, sink=None)
        if start:
            sink.print(f"resuming from {self.load} at iteration {start} ({consumed} samples consumed)")
            sink.log({"kind": "resume", "iteration": start})
        data = self._iterators(self.train_set, self.train_n, consumed)
        times, last_eval, losses = [], {}, {}
        stop = t.stop_at or t.iters
        for it in range(start + 1, stop + 1):
            safety.stop_if_signalled()
            t0 = time.perf_counter()
            for c in self.chunks:
                c.zero_grad_buffer()
            self.optimizer.zero_grad()
            reports = forward_backward(self.step_fn, data, self.chunks, self.num_micro, r.data.seq_length,
                                       t.micro_batch_size)
            losses = reduce_reports(reports)
            skipped = guards.nonfinite_step(losses, self.chunks, t, it)  # raises under train.nonfinite=stop
            if skipped:
                ok, grad_norm = False, None
                sink.print(f"iteration {it}: {skipped}; update skipped (train.nonfinite=skip)")
            else:
                ok, grad_norm, _ = self.optimizer.step()
            if ok:
                self.scheduler.step(increment=1)
            consumed += t.global_batch_size
            dt = time.perf_counter() - t0
            times.append(dt)
            tokens = t.global_batch_size * r.data.seq_length
            rec = {"kind": "train", "iteration": it, "loss": losses.get("total"), "kl": losses.get("kl"),
                   "ce": losses.get("ce"), "kl_bucket": losses.get("kl_bucket"), "lr": self.optimizer.param_groups[0]["lr"],
                   "grad_norm": None if grad_norm is None else float(grad_norm), "step_s": dt,
                   "tokens_per_s": tokens / dt, "tflops_per_gpu": self.flops / dt / self.world / 1e12,
                   "peak_mem_gib": peak_memory_gib(self.cuda), "skipped": not ok}
            sink.progress(1, {"loss": f"{rec['loss']:.4f}", "tok/s": f"{rec['tokens_per_s']:.0f}",
                              "TFLOP/s": f"{rec['tflops_per_gpu']:.3g}", "mem": f"{rec['peak_mem_gib']:.2f}G"})
            if it % t.log_interval == 0 or it == stop:
                sink.log(rec)
                if sink.bar is None:
                    sink.print(_line(rec))
            if t.eval_interval and it % t.eval_interval == 0 and it < t.iters:
                last_eval = self.evaluate(it, sink)
            if t.save_interval and it % t.save_interval == 0 and it < stop:
                self._save(it, consumed)
        if t.save_at_end:
            self._save(stop, consumed)
        if stop == t.iters:
            last_eval = self.evaluate(stop, sink)
        sink.close()
        return self._summary(stop, times, last_eval, losses=losses, sink=sink)

    def _iterators(self, dataset, total: int, start: int):
        """One micro-batch iterator, or one per model chunk under virtual pipeline (each chunk's forward_step
        draws every micro-batch once, as in Megatron-LM)."""
        t = self.r.train
        its = [loader(dataset, total, start, t.micro_batch_size, self.dp_rank, self.dp, self.r.data.num_workers)
               for _ in self.chunks]
        return its[0] if len(its) == 1 else its

    def _save(self, it: int, consumed: int) -> None:
        common = {"consumed_samples": consumed, "recipe": recipe_dict(self.r),
                  "cache_teacher": resume.cache_teacher(self.r.kd)}
        guards.check_weights_finite(self.chunks, it)
        safety.check_free_space(self.save, safety.checkpoint_bytes(self.save, self.chunks, self.optimizer), it)
        safety.checkpoint_writer_ready()
        with safety.signals_deferred():
            try:
                ckpt.save_checkpoint(self.save, it, self.chunks, self.optimizer, self.scheduler, common)
            except BaseException as e:
                safety.remove_partial(self.save, it, is_rank0())
                raise safety.save_failed(e, self.save, it) from e

    @torch.no_grad()
    def evaluate(self, it: int, sink) -> dict:
        if self.valid_ds is None or len(self.valid_ds) == 0:
            return {}
        t = self.r.train
        per_batch = t.global_batch_size
        n = min(self.valid_n, len(self.valid_ds)) // per_batch * per_batch
        if n == 0:
            return {}
        for c in self.chunks:
            c.eval()
        data = self._iterators(self.valid_ds, n, 0)
        reports = []
        for _ in range(n // per_batch):
            reports += forward_backward(self.eval_fn, data, self.chunks, self.num_micro, self.r.data.seq_length,
                                        t.micro_batch_size, forward_only=True)
        for c in self.chunks:
            c.train()
        out = reduce_reports(reports)
        if "ce" in out and out.get("total") == out["ce"]:
            out.pop("total")  # CE-only evaluation: one number
        rec = {"kind": "eval", "iteration": it, **out}
        sink.log(rec)
        sink.print(f"eval @ {it}: " + ", ".join(f"{k} {v:.4f}" for k, v in out.items()))
        return out

    def _summary(self, it, times, last_eval, losses=None, sink=None) -> dict:
        steady = times[1:] or times
        step_s = statistics.median(steady) if steady else None
        t = self.r.train
        tokens = t.global_batch_size * self.r.data.seq_length
        s = {"iteration": it, "iters": t.iters, "mode": self.r.kd.mode, "loss": (losses or {}).get("total"),
             "kl": (losses or {}).get("kl"), "ce": (losses or {}).get("ce"),
             "eval": last_eval, "step_s": step_s, "tokens_per_s": tokens / step_s if step_s else None,
             "tflops_per_gpu": self.flops / step_s / self.world / 1e12 if step_s else None,
             "peak_mem_gib": peak_memory_gib(self.cuda), "world_size": self.world, "save": self.save,
             "device": "cuda" if self.cuda else "cpu"}
        if is_rank0() and sink is not None:
            path = os.path.join(self.save, "summary.json")
            with open(path + ".tmp", "w") as f:  # beside, then swapped in: a kill leaves no half-written summary
                json.dump(s, f, indent=2)
            os.replace(path + ".tmp", path)
        barrier()
        return s


def _line(rec: dict) -> str:
    parts = [f"iter {rec['iteration']}", f"loss {rec['loss']:.4f}"]
    for k in ("kl", "ce", "kl_bucket"):
        if rec.get(k) is not None:
            parts.append(f"{k} {rec[k]:.4f}")
    parts += [f"lr {rec['lr']:.2e}", f"{rec['tokens_per_s']:.0f} tok/s", f"{rec['tflops_per_gpu']:.3g} TFLOP/s",
              f"peak {rec['peak_mem_gib']:.2f} GiB"]
    return " | ".join(parts)


def reduce_reports(reports: list) -> dict:
    """Token-weighted means over micro-batches and ranks. Each report is counted once per model replica:
    only the last pipeline stage's TP rank 0 contributes, then one all-reduce over the world."""
    from megatron.core import parallel_state as ps
    names = ("total", "kl", "ce", "kl_bucket")
    buf = torch.zeros(2 * len(names), dtype=torch.float64)
    owner = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    if owner:
        for rep in reports:
            for i, n in enumerate(names):
                if n in rep:
                    buf[2 * i:2 * i + 2] += rep[n].detach().double().cpu()
    if dist.is_initialized():
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        b = buf.to(dev)
        dist.all_reduce(b)
        buf = b.cpu()
    return {n: float(buf[2 * i] / buf[2 * i + 1]) for i, n in enumerate(names) if buf[2 * i + 1] > 0}
