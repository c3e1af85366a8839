"""The argument parser of ``hybridsync`` and ``hybridsync cluster``: argparse, with errors that name
what the user typed wrong first.

argparse checks required arguments before it reports unknown ones, so a mistyped flag (``hybridsync
--verbose``, ``hybridsync search --modle ncf ...``) was answered with "the following arguments are
required: subcommand" (an internal name) or a list of required flags, never with the typo. Here a
missing-arguments error becomes "unrecognized arguments: --verbose" when this parser's own arguments
hold an option it does not know, and a missing subcommand is named by its choices.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn, Sequence

REQUIRED = "the following arguments are required: "


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with the errors above; its subparsers are of the same class
    (argparse builds them with ``type(self)``)."""

    _arguments: list[str] = []

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self._arguments = list(sys.argv[1:] if args is None else args)  # a subparser gets its own slice
        return super().parse_known_args(self._arguments, namespace)

    def error(self, message: str) -> NoReturn:
        if message.startswith(REQUIRED):
            unknown = self.unknown_options(self._arguments)
            if unknown:
                message = f"unrecognized arguments: {' '.join(unknown)}"
            else:
                message = self._name_commands(message)
        super().error(message)

    def unknown_options(self, arguments: Sequence[str]) -> list[str]:
        """The words of ``arguments`` that look like options this parser has no flag for (before a
        ``--``; negative numbers are values)."""
        unknown = []
        for word in arguments:
            if word == "--":
                break
            if not word.startswith("-") or word == "-" or self._negative_number_matcher.match(word):
                continue
            flag = word.split("=", 1)[0]
            known: dict[str, Any] = self._option_string_actions
            short_with_value = len(flag) > 2 and not flag.startswith("--") and flag[:2] in known
            if not (flag in known or short_with_value or any(o.startswith(flag) for o in known if o.startswith("--"))):
                unknown.append(word)
        return unknown

    def _name_commands(self, message: str) -> str:
        """"required: trials_command" -> "choose a command: run, list, sweep"."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and action.dest in message[len(REQUIRED):].split(", "):
                return f"choose a command: {', '.join(action.choices)}"
        return message
