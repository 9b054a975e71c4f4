"""Progress of a long plan on stderr: the search's phase and how far along it is.

Quiet for the first AFTER_S seconds (a plan of a small cluster prints nothing), then one line
rewritten in place at most every EVERY_S seconds; quiet altogether unless the stream is a
terminal (a log file or a pipe gets no carriage returns) or when the caller turns it off (--json).
"""

import sys
import time
from typing import TextIO

AFTER_S = 3.0  # plans shorter than this print nothing
EVERY_S = 0.5


class Progress:
    """Call with (phase, done, total) as the search goes; close() ends the line."""

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None, clock=time.monotonic):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.clock = clock
        self.start = clock()
        self.last = -EVERY_S
        self.shown = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = self.clock() - self.start
        if now < AFTER_S or now - self.last < EVERY_S:
            return
        self.last, self.shown = now, True
        part = f" {done:,}/{total:,}" if total else ""
        self.stream.write(f"\rplanning: {phase}{part} ({now:.0f} s)\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False


def quiet(phase: str, done: int, total: int) -> None:
    """The default: no progress."""
