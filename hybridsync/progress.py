"""Progress of long work (trial runs, re-measurements, Sync-Switch tuning): a tqdm bar on a
terminal, and plain lines in a log.

Piped to a file (a cluster job's output, ``| tee``), a tqdm bar is a stream of carriage-return
redraws, one per trial, that fold into one line thousands of characters long, and a reader of the log
sees no progress at all. ``progress_bar`` gives a bar where stderr is a terminal; elsewhere an object
with the bar's interface (``update``, ``set_postfix_str``, ``write``) that writes a line at most every
``every_s`` seconds and one at the end. Result lines (``write``) go to stdout either way.
"""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

LOG_EVERY_S = 30.0
"""Seconds between two progress lines in a log: a few lines per minute of trials."""


class LogProgress:
    """Progress as lines: ``desc: n/total units, elapsed s[, postfix]``, written when ``update`` finds
    ``every_s`` seconds passed since the last line, and when the count reaches ``total``."""

    def __init__(self, total: int, *, desc: str, unit: str, stream: TextIO, every_s: float = LOG_EVERY_S) -> None:
        self.total, self.desc, self.unit, self.stream, self.every_s = total, desc, unit, stream, every_s
        self.n, self.postfix = 0, ""
        self.started = self.last_line = time.monotonic()

    def __enter__(self) -> "LogProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last_line >= self.every_s or self.n == self.total:
            self.last_line = now
            print(self.line(now), file=self.stream, flush=True)

    def set_postfix_str(self, postfix: str, refresh: bool = True) -> None:
        self.postfix = postfix

    def line(self, now: float) -> str:
        """The progress line at time ``now`` (``time.monotonic``)."""
        postfix = f", {self.postfix}" if self.postfix else ""
        return f"{self.desc}: {self.n}/{self.total} {self.unit}s, {now - self.started:.0f} s{postfix}"

    def write(self, text: str) -> None:
        """A result line, on stdout as tqdm's ``write`` puts it (progress lines go to ``stream``)."""
        print(text, flush=True)

    def close(self) -> None:
        """Nothing to clear: every line is already written."""


def progress_bar(total: int, *, desc: str, unit: str, stream: TextIO | None = None,
                 every_s: float = LOG_EVERY_S) -> Any:
    """A tqdm bar over ``total`` on ``stream`` (default stderr) if it is a terminal, else a
    ``LogProgress``; either is a context manager with ``update``, ``set_postfix_str`` and ``write``
    (whose lines go above the bar, or into the log)."""
    stream = stream or sys.stderr
    if is_terminal(stream):
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=stream)
    return LogProgress(total, desc=desc, unit=unit, stream=stream, every_s=every_s)


def is_terminal(stream: TextIO) -> bool:
    """``stream`` is a terminal (a file, a pipe or a test's capture is not)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
