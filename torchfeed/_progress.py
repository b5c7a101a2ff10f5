"""A tiny progress display for the long-running tools (bench, tuner).

Owns one thing: telling a person at a terminal how far a run of N steps has
got.  On a TTY it redraws one line in place; anywhere else (CI logs, pipes,
files) it prints one plain line as each step starts, because carriage returns
turn a log into noise.  No dependency beyond the standard library.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

_BAR_WIDTH = 24


def _fmt_seconds(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    minutes, secs = divmod(seconds, 60)
    return f"{minutes}:{secs:02d}"


class Progress:
    """Progress over a known number of steps.

    Call :meth:`step` when a step starts (it names what is running, which is
    what a person wants to see when something is slow or stuck), and
    :meth:`close` at the end.  ``enabled=False`` makes every call a no-op.
    """

    def __init__(self, total: int, title: str, stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.total = max(1, int(total))
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = 0
        self._label = ""
        self._started = time.perf_counter()
        self._closed = False
        try:
            self._tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self._tty = False

    def step(self, label: str) -> None:
        """Mark the previous step finished (if any) and start one named ``label``."""
        if self._label:
            self.done = min(self.total, self.done + 1)
        self._label = label
        if not self.enabled:
            return
        if self._tty:
            self._draw()
        else:
            self._write(f"{self.title} [{self.done + 1}/{self.total}] {label}\n")

    def close(self) -> None:
        """Finish the last step and leave the terminal on a fresh line."""
        if self._closed:
            return
        self._closed = True
        if self._label:
            self.done = min(self.total, self.done + 1)
            self._label = ""
        if not self.enabled:
            return
        elapsed = _fmt_seconds(time.perf_counter() - self._started)
        if self._tty:
            self._draw(final=True)
            self._write("\n")
        else:
            self._write(f"{self.title} done: {self.done}/{self.total} steps in {elapsed}\n")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _draw(self, final: bool = False) -> None:
        elapsed = time.perf_counter() - self._started
        filled = int(_BAR_WIDTH * self.done / self.total)
        bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
        if final or self.done == 0:
            timing = _fmt_seconds(elapsed)
        else:
            # Mean step time so far is the only estimate we have; steps of one
            # run are alike enough for it to be useful.
            eta = elapsed / self.done * (self.total - self.done)
            timing = f"{_fmt_seconds(elapsed)} eta {_fmt_seconds(eta)}"
        label = "done" if final else self._label
        # \x1b[K clears what a longer previous label left on the line.
        self._write(f"\r\x1b[K{self.title} [{bar}] {self.done}/{self.total} {timing} {label}")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            # A closed or broken stderr must never fail the measurement itself.
            self.enabled = False
