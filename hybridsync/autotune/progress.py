"""What a user sees while an autotune runs: one bar over the trial budget, the phase it is in,
and one line per finished phase.

An autotune spends minutes in trial jobs that print nothing of their own; without this the
terminal showed only the search's sub-second bars and then silence until the verdict. The bar
counts distinct strategies measured against ``trial_budget`` (what the budget counts); controls,
rechecks, the confirmation and the runoff take time without new strategies, so the phase text says
which of them is running, with its own count.

In a log (stderr not a terminal: a cluster job's output file, a pipe) a bar is a stream of
carriage-return redraws, one per trial, that fold into one line thousands of characters long; there
the bar stays off and each phase's start is a line of its own, like its end.
"""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from hybridsync.progress import is_terminal


class AutotuneProgress:
    """A tqdm bar over ``budget`` strategies on ``stream`` (stderr) while entered (``with``), unless
    not ``enabled``; outside that it only counts, silently. ``bar``: draw the bar (default: when
    ``stream`` is a terminal), else write plain lines only."""

    def __init__(self, budget: int, *, enabled: bool = True, stream: TextIO | None = None,
                 bar: bool | None = None) -> None:
        self.budget, self.enabled, self.stream = budget, enabled, stream
        self.draw = bar
        self.bar: Any = None
        self.writing = False
        """Entered and enabled: lines are written (above the bar, or alone in a log)."""
        self.started = self.phase_started = time.monotonic()
        self.phase_name, self.done, self.expected, self.failed = "", 0, 0, 0

    def __enter__(self) -> "AutotuneProgress":
        stream = self.stream or sys.stderr
        self.writing = self.enabled
        if self.enabled and (self.draw if self.draw is not None else is_terminal(stream)):
            from tqdm import tqdm
            self.bar = tqdm(total=self.budget, desc="autotune", dynamic_ncols=True, file=stream,
                            mininterval=0,  # a redraw per trial: seconds apart
                            bar_format="{desc}: {n_fmt}/{total_fmt} strategies |{bar}| {elapsed}{postfix}")
        self.started = self.phase_started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.writing = False
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def phase(self, name: str, expected: int = 0) -> None:
        """Enters ``name`` (e.g. "round 2", "confirmation"), which will store ``expected`` trials."""
        self.phase_name, self.done, self.expected, self.failed = name, 0, expected, 0
        self.phase_started = time.monotonic()
        self._show()
        if self.writing and self.bar is None:
            self.line(f"{name}{f': {expected} trials' if expected else ''} ...")

    def trial(self, record: Any, *, new_strategy: bool = True) -> None:
        """One trial of the current phase stored; ``new_strategy``: it counts against the budget."""
        self.done += 1
        self.failed += record.status != "ok"
        self._show(refresh=not new_strategy)
        if new_strategy and self.bar is not None:
            self.bar.update()  # redraws, with the postfix just set

    @property
    def phase_s(self) -> float:
        """Seconds since the current phase began."""
        return time.monotonic() - self.phase_started

    def line(self, text: str) -> None:
        """A line above the bar (kept in the terminal and in logs), prefixed with the time so far."""
        if not self.writing:
            return
        text = f"autotune [{time.monotonic() - self.started:3.0f} s] {text}"
        if self.bar is not None:
            self.bar.write(text, file=self.bar.fp)
        else:
            print(text, file=self.stream or sys.stderr, flush=True)

    def _show(self, refresh: bool = True) -> None:
        if self.bar is None:
            return
        count = f" {self.done}/{self.expected} trials" if self.expected else ""
        failed = f", {self.failed} failed" if self.failed else ""
        self.bar.set_postfix_str(f"{self.phase_name}{count}{failed}", refresh=refresh)
