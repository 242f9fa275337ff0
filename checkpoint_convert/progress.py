"""A one-line progress bar on stderr: tensors and bytes done, rate, ETA."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total_tensors: int, total_bytes: int, quiet: bool = False):
        self.label, self.total_tensors, self.total_bytes, self.quiet = label, total_tensors, total_bytes, quiet
        self.tensors = self.bytes = 0
        self.start = self._last = time.monotonic()

    def update(self, tensors: int, nbytes: int) -> None:
        self.tensors += tensors
        self.bytes += nbytes
        now = time.monotonic()
        if not self.quiet and now - self._last > 0.2:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.bytes / elapsed
        eta = (self.total_bytes - self.bytes) / rate if rate > 0 else 0.0
        print(
            f"\r{self.label}: {self.tensors}/{self.total_tensors} tensors, "
            f"{self.bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB, {rate / 1e6:.0f} MB/s, "
            f"ETA {int(eta) // 60}m{int(eta) % 60:02d}s",
            end="", file=sys.stderr, flush=True,
        )

    def close(self) -> None:
        if not self.quiet:
            self._draw(time.monotonic())
            print(file=sys.stderr, flush=True)
