"""mkdocs hook: replaces ``<!-- cli-help: COMMAND... -->`` in a page by that command's ``--help``.

The command-line reference is generated from the parsers themselves, as the API reference is
from the docstrings, so it cannot drift from the code. Everything runs in the build's process
(``hybridsync-run``'s help reads horovodrun's parser; nothing is launched).
"""
from __future__ import annotations

import contextlib
import io
import re
from typing import Any

MARKER = re.compile(r"^<!-- cli-help: (?P<command>[^>]+?) -->$", re.MULTILINE)


def command_help(command: str) -> str:
    """The ``--help`` text of ``hybridsync ...``, ``hybridsync-run`` or ``hybridsync-server``."""
    program, *words = command.split()
    if program == "hybridsync-run":
        from hybridsync.run.launcher import usage
        return usage()
    if program == "hybridsync-server":
        from hybridsync.backends.ps.server import main
    elif program == "hybridsync":
        from hybridsync.cli import main
    else:
        raise ValueError(f"cli-help: unknown command {command!r}")
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        main([*words, "--help"])
    if not text.getvalue().strip():
        raise ValueError(f"cli-help: {command!r} printed no help")
    return text.getvalue().rstrip()


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Expands every marker into a fenced text block holding the command's help."""
    return MARKER.sub(lambda m: f"```text\n$ {m['command']} --help\n{command_help(m['command'])}\n```", markdown)
