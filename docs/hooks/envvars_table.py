"""mkdocs hook: replaces ``<!-- envvars -->`` in a page by tables of every environment variable
``hybridsync/envvars.py`` names, each with the docstring it has there.

That module is the one place that names them (code imports the names from it), so the reference
page is generated from it, as the command-line reference is from the parsers: it cannot drift.
"""
from __future__ import annotations

import ast
import inspect
import re
from typing import Any

MARKER = "<!-- envvars -->"
_SECTION = re.compile(r"^# --- (?P<title>.+?) -+$")


def variables() -> list[tuple[str, tuple[str, ...], str]]:
    """(section, variable names, docstring) of every name ``hybridsync.envvars`` binds to a variable
    name or a tuple of them, in the module's order. The section is the ``# --- ... ---`` comment
    above it; an int constant a docstring names in double backticks is replaced by its value."""
    from hybridsync import envvars
    source = inspect.getsource(envvars)
    lines, body = source.splitlines(), ast.parse(source).body
    rows, section = [], ""
    for index, node in enumerate(body):
        for line in lines[(body[index - 1].end_lineno if index else 0):node.lineno - 1]:
            if match := _SECTION.match(line):
                section = match["title"]
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
            continue
        value = getattr(envvars, node.targets[0].id)
        names = (value,) if isinstance(value, str) else value if isinstance(value, tuple) else ()
        if not names:
            continue
        following = body[index + 1] if index + 1 < len(body) else None
        doc = following.value.value if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) \
            else ""
        doc = re.sub(r"``([A-Z_]+)``", lambda m: str(getattr(envvars, m[1])) if isinstance(
            getattr(envvars, m[1], None), int) else m[0], doc)
        rows.append((section, names, " ".join(doc.split())))
    return rows


def table() -> str:
    """The Markdown: one table per section, a row per variable."""
    out, current = [], None
    for section, names, doc in variables():
        if section != current:
            out += ["", f"### {section[:1].upper()}{section[1:]}", "", "| variable | what it says |", "| --- | --- |"]
            current = section
        doc = doc.replace("``", "`").replace("|", "\\|")
        out.append(f"| {', '.join(f'`{name}`' for name in names)} | {doc} |")
    return "\n".join(out).lstrip() + "\n"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Expands the marker into the tables."""
    return markdown.replace(MARKER, table()) if MARKER in markdown else markdown
