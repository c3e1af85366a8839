"""What every benchmark prints before its numbers: the command that reproduces them, when, and how
loaded the machine was (RESULTS.md quotes these lines; on a shared 2-core VM the load decides how
far a ratio can be trusted)."""
from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys


def uptime() -> str:
    """``uptime``'s line: the time, and the load averages over 1, 5 and 15 minutes."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def print_header() -> None:
    """Prints the command (from the current directory), the UTC date and ``uptime`` before the run."""
    print("command:", f"cd {shlex.quote(os.getcwd())} &&", shlex.join([sys.executable, *sys.argv]))
    print("date:", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    print("uptime before:", uptime(), flush=True)
