"""Which rank's error ended a job: each rank notes its uncaught exception, the launcher names the cause.

When one rank raises, Horovod shuts the job down and every other rank fails in its next collective
with ``Horovod has been shut down``. Those ranks usually *exit* first: the rank that raised waits in
Horovod's shutdown at its exit. horovodrun names the first process to exit, so the one line that
ended a failed job (``rank 0 exited with status 1, the first to fail``) named a rank that had only
followed, and the user had to find the real error among the tracebacks above it.

``hybridsync.run.horovodrun`` gives the ranks a folder (``HYBRIDSYNC_FAILURE_NOTES``); importing
hybridsync in a rank with it set installs a ``sys.excepthook`` that writes the uncaught exception's
last line, when it was raised and whether it only follows another rank's failure (Horovod's
shutdown error, a rank of the node gone) into ``rank<N>.json`` there, then hands the exception to
the hook it replaced. ``first_failure`` reads the folder: the earliest error that is no follower
(else the earliest of all). A rank that exits with a status of its own (``sys.exit(3)``), one whose
script never imported hybridsync, or a rank on another host (the folder is this host's) notes
nothing; the launcher's line is then horovodrun's verdict, as before.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import types
from typing import Callable, Iterator

from hybridsync import envvars

FOLLOWER_ERRORS = ("HorovodInternalError", "PeerExitedError")
"""Exceptions a rank raises because *another* rank failed: Horovod shut the job down, or a rank of
this node left the hierarchical route's shared memory."""
SHUT_DOWN = "Horovod has been shut down"
"""What Horovod's collectives raise (``RuntimeError`` from its C++ side) once another rank failed."""

_previous_hook: Callable[..., object] | None = None


@dataclasses.dataclass(frozen=True)
class FailureNote:
    """One rank's uncaught exception: ``error`` is its last traceback line (``Type: message``)."""

    rank: int
    error: str
    raised_at: float
    follower: bool


def install() -> None:
    """Note this process's uncaught exception in ``$HYBRIDSYNC_FAILURE_NOTES`` (once; nothing when unset)."""
    global _previous_hook
    if _previous_hook is None and os.environ.get(envvars.FAILURE_NOTES):
        _previous_hook = sys.excepthook
        sys.excepthook = _note_and_report


def causes(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then the exception it was raised from (``raise ... from``) or while handling, and so on,
    each once (a chain may loop back)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        yield error
        seen.add(id(error))
        error = error.__cause__ or error.__context__


def is_follower(error: BaseException) -> bool:
    """Whether ``error`` (or one it was raised from or while handling) only follows another rank's failure."""
    return any(type(cause).__name__ in FOLLOWER_ERRORS or SHUT_DOWN in str(cause) for cause in causes(error))


def _note_and_report(kind: type[BaseException], error: BaseException, trace: types.TracebackType | None) -> None:
    """``sys.excepthook``: write the note (never failing the exit over it), then the hook it replaced."""
    try:
        _write_note(error)
    except Exception:  # noqa: BLE001 - a note is a courtesy: the traceback below is the report
        pass
    (_previous_hook or sys.__excepthook__)(kind, error, trace)


def _write_note(error: BaseException) -> None:
    rank = next((os.environ[name] for name in envvars.LAUNCHER_RANKS if os.environ.get(name, "").isdigit()), None)
    if rank is None:
        return
    message = str(error).strip().splitlines()
    line = type(error).__name__ + (f": {message[0][:300]}" if message else "")
    note = {"rank": int(rank), "error": line, "raised_at": time.time(), "follower": is_follower(error)}
    path = os.path.join(os.environ[envvars.FAILURE_NOTES], f"rank{rank}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(note, handle)
    os.replace(path + ".tmp", path)


def first_failure(directory: str) -> FailureNote | None:
    """The note of the error that ended the job: the earliest that follows no other rank's failure,
    else the earliest of all; ``None`` when no rank noted one (or the folder is unreadable)."""
    notes = []
    try:
        names = [name for name in os.listdir(directory) if name.endswith(".json")]
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as handle:
                notes.append(FailureNote(**json.load(handle)))
        except (OSError, ValueError, TypeError):
            continue
    if not notes:
        return None
    return min(notes, key=lambda note: (note.follower, note.raised_at))
