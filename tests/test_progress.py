"""Progress of long work: a bar on a terminal, lines in a log (hybridsync.progress)."""
from __future__ import annotations

import io

import pytest

from hybridsync.progress import LogProgress, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.unit
def test_in_a_log_progress_is_lines_not_redraws(capsys):
    """Piped to a file, ``hybridsync trials run``'s tqdm bar was one carriage-return redraw per trial,
    folded into a single line; now a log gets a line at most every ``every_s`` seconds and at the end,
    and result lines go to stdout as tqdm's ``write`` puts them."""
    log = io.StringIO()
    with progress_bar(5, desc="trials", unit="trial", stream=log, every_s=3600) as bar:
        assert isinstance(bar, LogProgress)
        for _ in range(5):
            bar.set_postfix_str("best 12.0 ms")
            bar.update()
        bar.write("ncf on 2x2: 5 measured")
    assert "\r" not in log.getvalue()
    assert log.getvalue().splitlines() == ["trials: 5/5 trials, 0 s, best 12.0 ms"]  # only the end: 3600 s apart
    assert capsys.readouterr().out == "ncf on 2x2: 5 measured\n"
    log = io.StringIO()
    with progress_bar(3, desc="runs", unit="run", stream=log, every_s=0) as bar:
        bar.update(), bar.update(), bar.update()
    assert log.getvalue().splitlines() == [f"runs: {n}/3 runs, 0 s" for n in (1, 2, 3)]


@pytest.mark.unit
def test_on_a_terminal_progress_is_a_bar():
    terminal = Terminal()
    with progress_bar(4, desc="trials", unit="trial", stream=terminal) as bar:
        bar.update(4)
    assert "4/4" in terminal.getvalue() and "\r" in terminal.getvalue()
