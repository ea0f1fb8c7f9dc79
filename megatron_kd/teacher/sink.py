"""SampleSink: the host side of a cache build, off the teacher's critical path.

A micro-batch's top-K leaves the device on a copy stream into pinned host memory, is encoded on worker threads (numpy
releases the GIL in its sorts and array arithmetic; each sample in blocks of positions, in parallel) and is appended to
its shard in sample order by the builder's thread, while the device already runs the next micro-batch. Shards commit in
order, after their last sample: the bytes written are those of a build that encodes and writes each sample before
computing the next.
"""
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from ..cache.writer import encode_sample


def _workers() -> int:
    # Encoding a 32K-token sample takes about as long as the teacher's forward on a fast GPU (the compact
    # encoding longer): a few threads keep up; on a small CPU one thread still overlaps the device.
    return max(1, min(4, (os.cpu_count() or 2) // 2))


class SampleSink:
    def __init__(self, writer, *, workers: int | None = None):
        self.writer = writer
        self.encoding, self.seq = writer.encoding, int(writer.settings["seq_length"])
        n = workers or _workers()
        self.pool = ThreadPoolExecutor(n, thread_name_prefix="kd-encode")
        # Blocks of positions of one sample, encoded and checked in parallel: the sample after the teacher's last
        # micro-batch, which nothing overlaps, takes a fraction of one thread's time. A pool of its own, so a
        # sample's wait on its blocks never holds a thread its blocks need.
        self.blocks = ThreadPoolExecutor(n, thread_name_prefix="kd-encode-block")
        self.max_pending = 2 * n + 2  # samples held on the host at once
        # ("begin" | "sample" | "commit", shard, future or None), in order: a shard's temporary file is opened
        # after the previous shard's commit, so the disk goes through the states of a sequential build
        self.queue = deque()
        self.open = []        # shard writers begun and not committed: aborted on failure
        self.copy_stream = None

    def begin(self, j: int) -> "_Shard":
        shard = _Shard(j)
        self.queue.append(("begin", shard, None))
        return shard

    def put(self, shard, ids: torch.Tensor, logp: torch.Tensor, tokens: torch.Tensor, ready=None) -> None:
        """ids / logp [b, S, K] (complete on the current stream), tokens [b, S] on the host. ready: a CUDA event
        after which host ids / logp (pinned copies still being filled, PendingTopK.copy_to_host) are complete."""
        if ids.is_cuda:
            ids, logp, ready = self._to_host(ids.to(torch.int32), logp)  # ids < 2**31: half the copy
        for i in range(ids.shape[0]):
            fut = self.pool.submit(self._encode, ready, ids[i], logp[i], tokens[i])
            self.queue.append(("sample", shard, fut))
        self.drain(block=False)
        while sum(1 for q in self.queue if q[0] == "sample") > self.max_pending:
            self._pop()

    def commit(self, shard) -> None:
        """Commit the shard once every sample put before is appended."""
        self.queue.append(("commit", shard, None))
        self.drain(block=False)

    def _to_host(self, ids, logp):
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream()
        cur = torch.cuda.current_stream()
        self.copy_stream.wait_stream(cur)
        out = []
        with torch.cuda.stream(self.copy_stream):
            for t in (ids, logp):
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(self.copy_stream)  # the device tensor lives until the copy has read it
                out.append(h)
        ready = torch.cuda.Event()
        ready.record(self.copy_stream)
        return out[0], out[1], ready

    def _encode(self, ready, ids, logp, tokens):
        if ready is not None:
            ready.synchronize()
        return encode_sample(self.encoding, self.seq, ids.numpy(), logp.numpy(), tokens.numpy(), run=self._run)

    def _run(self, calls):
        return list(self.blocks.map(lambda f: f(), calls))

    def _pop(self) -> None:
        kind, shard, fut = self.queue.popleft()
        if kind == "begin":
            shard.sw = self.writer.begin_shard(shard.j)
            self.open.append(shard.sw)
        elif kind == "sample":
            shard.sw.append(fut.result())
        else:
            shard.sw.commit()
            self.open.remove(shard.sw)

    def drain(self, block: bool = True) -> None:
        """Begin, append and commit what is ready, in order; block=True: everything queued."""
        while self.queue and (block or self.queue[0][2] is None or self.queue[0][2].done()):
            self._pop()

    def close(self) -> None:
        try:
            self.drain(block=True)
        finally:
            self.pool.shutdown(wait=True)
            self.blocks.shutdown(wait=True)

    def abort(self) -> None:
        """Drop what is queued and delete every uncommitted shard's temporary file."""
        for _, _, fut in self.queue:
            if fut is not None:
                fut.cancel()
        self.queue.clear()
        self.pool.shutdown(wait=True)
        self.blocks.shutdown(wait=True)
        for sw in self.open:
            sw.abort()
        self.open.clear()


class _Shard:
    """A shard of the queue: its writer exists once the queue reaches its "begin"."""
    __slots__ = ("j", "sw")

    def __init__(self, j: int):
        self.j, self.sw = j, None
