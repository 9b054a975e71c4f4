"""Where a trainer step's time goes: named phases timed with CUDA events on a GPU (no host sync until
`read()`), with perf_counter on the CPU. The trainer times forward, log-prob, backward, proximal
forward and optimizer; `read()` adds "host": the step's wall time no phase covers (the device
idles while Python plans, packs and launches)."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PHASES = ("forward", "logprob", "backward", "proximal", "optimizer")


class PhaseTimer:
    """Accumulates phase spans over steps; `read()` returns seconds per phase and resets."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.spans: dict[str, list] = defaultdict(list)
        self.wall = 0.0

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def __call__(self, name: str):
        start = self._mark()
        try:
            yield
        finally:
            self.spans[name].append((start, self._mark()))

    @contextmanager
    def step(self):
        """Around a whole step: its wall time (synchronised on a GPU) is what "host" is taken from."""
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.wall += time.perf_counter() - t0

    def read(self) -> dict[str, float]:
        """Seconds per phase since the last read, with "host" = wall time of the steps minus the phases."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {name: 0.0 for name in PHASES}
        for name, spans in self.spans.items():
            out[name] = sum(_seconds(s, e) for s, e in spans)
        out["host"] = max(0.0, self.wall - sum(out.values()))
        self.spans.clear()
        self.wall = 0.0
        return out


def _seconds(start, end) -> float:
    return start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start
