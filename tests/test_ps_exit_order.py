"""The PS route's exit handlers: Horovod's shutdown runs before the PS client's farewell, and is
registered once per process however often a client joins (``backends/ps/route.py``)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.multiprocess

SCRIPT = """
import atexit
from hybridsync.backends.ps.route import shut_down_first
shutdown = lambda: print("shutdown", flush=True)  # Horovod's, for each client joined
shut_down_first(shutdown)
atexit.register(print, "farewell 1", flush=True)  # the first client's
shut_down_first(shutdown)
atexit.register(print, "farewell 2", flush=True)  # a client joined again after ps.shutdown()
shut_down_first(shutdown)
"""


def test_horovods_shutdown_runs_once_at_exit_and_before_every_farewell() -> None:
    """Before, each client joined registered ``hvd.shutdown`` once more: it ran once per join at exit."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:-1] == ["shutdown", "farewell 2", "farewell 1"], out.stdout
