"""Live tensor bytes on CPU: a stand-in for torch.cuda.max_memory_allocated in CPU tests and --smoke runs.

Every storage created under the mode (forward, autograd's backward on the calling thread, optimizer) is
counted from creation until CPython frees it (storage objects are preserved per C++ storage, so a weakref
finalizer fires exactly when the memory is released). Views and in-place results add nothing.
"""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveMemory(TorchDispatchMode):
    def __init__(self, existing=()):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live = set()
        self.track(existing)

    def track(self, tensors) -> None:
        """Count tensors created before the mode (parameters, inputs) as live."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        n = st.nbytes()
        key = st._cdata
        if n == 0 or key in self._live:
            return
        self._live.add(key)
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key, n)

    def _free(self, key, n) -> None:
        if key in self._live:
            self._live.discard(key)
            self.current -= n

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out
