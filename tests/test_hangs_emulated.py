"""Issue 23 on the emulated 2 x 2 cluster (4 ranks, 2 hosts, 1 Gbit/s uplinks, one PS server per host):
ranks out of step fail within seconds naming each other, and a killed ``hybridsync cluster run``
leaves no rank or server running.

Needs root; skips cleanly without it. Each job is bounded; the cluster's namespaces are removed
by pid-free prefix cleanup (``remove_leftovers``) whatever happens.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from conftest import BIN, REPO, WORKERS, emulated_marks, wait_for
from hybridsync.cluster.netns import NAMESPACE_PREFIX, namespace_pids, remove_leftovers
from hybridsync.run import procs

pytestmark = emulated_marks(300)  # a backstop; every process below has its own bound

SPEC = REPO / "horovodrun_configs" / "cluster_2x2_1gbit.yaml"
WORKER = WORKERS / "out_of_step.py"
JOB_TIMEOUT_S = 150
DETECTED_WITHIN_S = 20
GONE_WITHIN_S = 20


@pytest.fixture
def job_id():
    ident = uuid.uuid4().hex[:8]
    yield ident
    remove_leftovers(f"{NAMESPACE_PREFIX}{ident}-")


def cluster_run(job_id: str, command: list[str], *extra: str, env: dict | None = None) -> subprocess.Popen:
    argv = [str(BIN / "hybridsync"), "cluster", "run", str(SPEC), "--launcher", "gloo", "--job-id", job_id,
            "--timeout", str(JOB_TIMEOUT_S), *extra, "--", *command]
    return procs.start(argv, env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})},
                       cwd=str(REPO))


@pytest.mark.parametrize("case", ["skip_set_strategy", "freeze_after_build"])
def test_ranks_out_of_step_on_two_hosts_fail_within_seconds(case, job_id, tmp_path):
    prefix = tmp_path / case
    job = cluster_run(job_id, [sys.executable, str(WORKER), case, str(prefix)])
    try:
        output, _ = job.communicate(timeout=JOB_TIMEOUT_S + 30)
    finally:
        procs.stop(job)
    files = [Path(f"{prefix}.rank{r}.json") for r in range(4)]
    assert all(f.exists() for f in files), output[-6000:]
    records = [json.loads(f.read_text()) for f in files]
    (tmp_path / "records.json").write_text(json.dumps(records))
    for rank, record in enumerate(records):
        assert record["type"] == "RanksOutOfStepError", f"rank {rank}: {record}"
        assert record["seconds"] < DETECTED_WITHIN_S, f"rank {rank} failed {record['seconds']:.1f} s after"
        assert record["message"] == records[0]["message"]
    assert "rank 1 is in step" in records[0]["message"] or "rank 1 went on past step" in records[0]["message"]
    print(f"{case}: every rank failed {min(r['seconds'] for r in records):.1f}-"
          f"{max(r['seconds'] for r in records):.1f} s after going out of step")


def test_a_killed_cluster_launcher_leaves_no_rank_or_server(job_id, tmp_path):
    """``hybridsync cluster run`` SIGKILLed (no teardown runs) while 3 ranks wait for rank 0,
    which is busy elsewhere: every rank and server gets the parent-death signal and ends."""
    strategy = tmp_path / "s.json"
    strategy.write_text(json.dumps({"version": 1, "variables": {"fc2.bias": {"route": "ps"}}}))
    prefix = tmp_path / "elsewhere"
    job = cluster_run(job_id, [sys.executable, str(WORKER), "rank0_elsewhere", str(prefix)],
                      "--servers", f"{sys.executable} -m hybridsync.backends.ps.server",
                      env={"HYBRIDSYNC_STRATEGY": str(strategy)})
    namespaces = [f"{NAMESPACE_PREFIX}{job_id}-n{i}" for i in range(2)]
    try:
        files = [Path(f"{prefix}.rank{r}.ready") for r in range(4)]
        wait_for(lambda: all(f.exists() and f.read_text().endswith("}") for f in files), JOB_TIMEOUT_S,
                 "every rank ready")
        ranks = [json.loads(f.read_text())["pid"] for f in files]
        everything = sorted({pid for ns in namespaces for pid in namespace_pids(ns)})
        servers = [pid for pid in everything if "backends.ps.server" in " ".join(psutil.Process(pid).cmdline())]
        assert set(ranks) <= set(everything) and len(servers) == 2, (ranks, servers, everything)
        os.kill(job.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                                 for pid in ranks + servers), GONE_WITHIN_S, "every rank and server gone")
        print(f"ranks and servers gone {time.monotonic() - killed:.1f} s after the launcher's SIGKILL")
    finally:
        procs.stop(job, grace=1)
