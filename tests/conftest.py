"""Shared helpers: launching real multi-process jobs with a hard time bound."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridsync.run.procs import run_bounded

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "tests" / "workers"
BIN = Path(sys.executable).parent


def launcher_argv(launcher: str, np: int = 2, hosts: str | None = None) -> list[str]:
    """The command prefix that starts ``np`` ranks with horovodrun (Gloo) or Debian's mpirun."""
    if launcher == "horovodrun":
        return [str(BIN / "horovodrun"), "-np", str(np), "-H", hosts or f"localhost:{np}", "--gloo"]
    if launcher == "mpirun":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np),
                "-x", "PATH", "-x", "PYTHONPATH"]
    raise ValueError(launcher)


def run_job(argv: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a multi-process job; fail the test (never hang) if it outlives ``timeout``."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        return run_bounded(argv, timeout=timeout, env=full_env, cwd=str(REPO))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"job did not finish within {timeout}s: {' '.join(argv)}\n{e.output}")


@pytest.fixture(params=["horovodrun", "mpirun"])
def launcher(request) -> str:
    return request.param
