"""How soon ``hybridsync-run`` returns once a job on the parameter-server route is over (2 ranks, 2 servers).

A ring-only job returns 0.2-0.3 s after its last rank is gone (horovodrun's own exit). On the PS
route, whenever a server outlived the ranks (its interpreter's shutdown took 1-3.5 s on a loaded
2-core host), the launcher asked the rendezvous whether any worker had joined them (importing
torch, connecting to a store that was closing) while they were exiting on their own anyway, then
tore torch down at its own exit: 2.7-8.3 s more at a job's end, normal or failed
(benchmarks/ps_exit.py; benchmarks/RESULTS.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import BIN, REPO, WORKERS
from hybridsync.run import procs

pytestmark = pytest.mark.multiprocess

BSP = {"version": 1, "default": {"route": "ps", "protocol": "bsp"}}
JOB_TIMEOUT_S = 150
EXIT_OVERHEAD_S = 2.0
"""What ``hybridsync-run`` may take after the job's last rank is gone: 0.2-0.5 s now at load 8-15
(horovodrun's own exit), 2.7-8.3 s before whenever a server outlived the ranks (about half the jobs;
0.3-0.5 s in the others): over twice the worst seen now, for a machine twice as slow."""


def run_watched(tmp_path: Path, name: str, command: list[str]) -> tuple[int, float, str]:
    """``hybridsync-run`` of ``command`` with 2 ranks and 2 servers under the BSP strategy: its status,
    the seconds from its last rank's end to its own return, and its output. Fails if any process of
    the job outlives it."""
    (tmp_path / "bsp.json").write_text(json.dumps(BSP))
    argv = [str(BIN / "hybridsync-run"), "--strategy", str(tmp_path / "bsp.json"), "--num-servers", "2",
            "-np", "2", "-H", "localhost:2", "--gloo", *command]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    with open(tmp_path / f"{name}.log", "w") as log:
        launcher = subprocess.Popen(argv, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    seen: dict[int, psutil.Process] = {}
    ranks_gone = None
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while launcher.poll() is None and time.monotonic() < deadline:
            try:
                seen.update((p.pid, p) for p in psutil.Process(launcher.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
            ranks = [p for p in seen.values() if _is_rank(p)]
            if ranks and ranks_gone is None and not any(_running(p) for p in ranks):
                ranks_gone = time.monotonic()
            time.sleep(0.05)
        returned = time.monotonic()
        assert launcher.poll() is not None, f"the job did not end within {JOB_TIMEOUT_S} s"
    finally:
        procs.stop(launcher, grace=5.0)
    output = (tmp_path / f"{name}.log").read_text()
    assert ranks_gone is not None, output[-4000:]
    left = [p.cmdline() for p in seen.values() if _running(p)]
    assert not left, f"processes outlived hybridsync-run: {left}"
    return launcher.returncode, returned - ranks_gone, output


_RANK_ENV: dict[int, bool] = {}


def _is_rank(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a rank (horovodrun gives each one ``HOROVOD_RANK``; servers get none)."""
    if proc.pid not in _RANK_ENV:
        try:
            _RANK_ENV[proc.pid] = "HOROVOD_RANK" in proc.environ() and "horovodrun" not in " ".join(proc.cmdline())
        except psutil.Error:
            return False
    return _RANK_ENV[proc.pid]


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_ps_job_that_ends_normally_returns_as_soon_as_its_ranks_are_gone(tmp_path):
    """Before: 2.7-8.3 s after the last rank at load 8-15 (when a server outlived the ranks); now
    0.2-0.3 s, as a ring-only job. The servers' own last lines are kept."""
    prefix = tmp_path / "calm"
    code, overhead, output = run_watched(tmp_path, "calm", [sys.executable, str(WORKERS / "fault_train.py"),
                                                            str(prefix), "--steps", "5", "--sleep", "0"])
    print(f"hybridsync-run returned {overhead:.2f} s after its last rank")
    assert code == 0, output[-4000:]
    assert all(Path(f"{prefix}.rank{r}.pt").exists() for r in range(2)), output[-4000:]
    for server in range(2):  # the servers' last lines are out before they exit
        assert f"server{server}: all 2 workers said goodbye" in output, output[-4000:]
    assert overhead < EXIT_OVERHEAD_S, f"hybridsync-run returned {overhead:.1f} s after its last rank"


def test_a_ps_job_whose_rank_raises_returns_as_soon_as_its_ranks_are_gone_with_their_errors(tmp_path):
    """Rank 1's code raises (``out_of_step.py user_error``); rank 0 fails in Horovod. Before: 5.1-6.5 s
    after the last rank at load 8-15 (when a server outlived the ranks); now 0.2-0.3 s. Each rank's own error is kept, and the launcher
    names the rank that failed first."""
    prefix = tmp_path / "raise"
    code, overhead, output = run_watched(tmp_path, "raise", [sys.executable, str(WORKERS / "out_of_step.py"),
                                                             "user_error", str(prefix)])
    print(f"hybridsync-run returned {overhead:.2f} s after its last rank")
    assert code != 0, output[-4000:]
    records = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(2)]
    assert [r["type"] for r in records] == ["HorovodInternalError", "UserCodeError"], records
    assert "exited with status 1, the first to fail" in output, output[-4000:]  # rank 1 or 0, whichever first
    assert overhead < EXIT_OVERHEAD_S, f"hybridsync-run returned {overhead:.1f} s after its last rank"
