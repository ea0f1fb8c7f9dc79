"""A progress bar with samples/s, tokens/s and ETA (tqdm), shown on one rank."""
import sys
import time


class Progress:
    def __init__(self, total_samples: int, seq_length: int, *, enabled: bool = True, scale: int = 1):
        """scale: ranks working alike (data parallel); rates are shown for all of them together."""
        self.seq, self.scale, self.bar = seq_length, max(1, scale), None
        self.t0, self.done = time.monotonic(), 0
        if enabled and total_samples:
            from tqdm import tqdm
            # tqdm's own rate is left out of the bar: it counts rank 0 only, the postfix's counts all ranks
            self.bar = tqdm(total=total_samples, unit="sample", file=sys.stderr, dynamic_ncols=True,
                            desc="teacher top-K" + (f" (rank 0 of {scale} DP ranks)" if scale > 1 else ""),
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is None:
            return
        dt = max(1e-9, time.monotonic() - self.t0)
        rate = self.done * self.scale / dt
        self.bar.set_postfix_str(f"{rate:.2f} samples/s, {rate * self.seq:,.0f} tokens/s (all ranks)", refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
