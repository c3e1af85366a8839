"""A parameter server that dies or hangs under supervision is replaced, and training goes on
exactly: 2 supervised servers (``hybridsync-server --supervise``) + 2 workers on loopback.

The workers (``tests/workers/ps_scenarios.py``) check every BSP sum bitwise against the
server's own summation, or that the ASP servers hold every delta exactly once, while the
test kills (SIGKILL) or stops (SIGSTOP) server 1's process. Every process a test starts
is stopped by pid in the fixture's teardown (a supervisor and its server share a process
group).
"""
from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from conftest import wait_for
from test_ps import Job, job_factory  # noqa: F401 - the fixture is used by name

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


def server_process(job: Job, index: int, *, newer_than: int | None = None) -> psutil.Process:
    """Server ``index``'s current process (its supervisor's child)."""
    supervisor = psutil.Process(job.servers[index].pid)

    def child() -> psutil.Process | None:
        children = [c for c in supervisor.children() if c.pid != newer_than and c.is_running()]
        return children[0] if children else None
    wait_for(lambda: child() is not None, 30, f"server{index}'s process")
    return child()


def supervised(job_factory, scenario: str, monkeypatch, server_args: tuple = (), **env: str) -> Job:
    monkeypatch.setenv("PS_TEST_STEPS", env.pop("steps", "60"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    job = job_factory(scenario, supervise=True, server_args=("--join-timeout", "90", *server_args))
    job.wait_ready(timeout=90)
    return job


def finished_results(job: Job) -> list[dict]:
    logs = job.wait(job.workers, timeout=100)
    assert [w.returncode for w in job.workers] == [0, 0], logs
    server_logs = job.wait(job.servers, timeout=40)
    assert [s.returncode for s in job.servers] == [0, 0], server_logs
    results = [job.result(w) for w in range(2)]
    assert all("error" not in r for r in results), (results, logs, server_logs)
    return results, logs, server_logs


def test_bsp_sums_stay_exact_when_a_server_is_killed(job_factory, monkeypatch):
    job = supervised(job_factory, "recover_bsp", monkeypatch)
    victim = server_process(job, 1)
    killed_at = time.time()
    victim.send_signal(signal.SIGKILL)
    results, logs, server_logs = finished_results(job)
    for result in results:
        assert result["mismatches"] == [], result["mismatches"]
        recovery, = result["recoveries"]
        assert recovery["server"] == 1 and recovery["incarnation"] == 1, recovery
        assert recovery["seconds"] < 60, recovery
        assert recovery["keys"] > 0
    assert all("parameter server server1 is gone" in log and "replaced (incarnation 1): recovered in" in log
               for log in logs), logs
    assert "died (SIGKILL); starting replacement 1" in server_logs[1], server_logs[1]
    assert "every worker restored its keys" in server_logs[1], server_logs[1]
    assert min(r["recoveries"][0]["seconds"] for r in results) < time.time() - killed_at


def test_asp_servers_hold_every_delta_exactly_once_across_a_kill(job_factory, monkeypatch):
    job = supervised(job_factory, "recover_asp", monkeypatch, steps="40")
    server_process(job, 1).send_signal(signal.SIGKILL)
    results, _, _ = finished_results(job)
    for result in results:
        assert result["values"] == [result["expected"]], result
        assert [r["server"] for r in result["recoveries"]] == [1], result["recoveries"]


def test_a_hung_server_is_killed_and_replaced(job_factory, monkeypatch):
    """SIGSTOP: no connection breaks; the workers' pings time out (3 s here), a worker posts the
    verdict, the supervisor kills the stopped server and starts a replacement."""
    job = supervised(job_factory, "recover_bsp", monkeypatch, PS_TEST_PING_TIMEOUT="3")
    victim = server_process(job, 1)
    victim.send_signal(signal.SIGSTOP)
    try:
        results, logs, server_logs = finished_results(job)
    finally:
        if victim.is_running():
            victim.send_signal(signal.SIGKILL)
    for result in results:
        assert result["mismatches"] == []
        assert [r["server"] for r in result["recoveries"]] == [1], result["recoveries"]
    assert any("parameter server server1 stopped answering" in log for log in logs), logs
    assert "found server1 (pid" in server_logs[1] and "hung: killing it" in server_logs[1], server_logs[1]


def test_without_a_replacement_workers_fail_naming_the_server(job_factory, monkeypatch):
    """A supervisor that may not restart (``--max-restarts 0``): the workers wait the recovery
    timeout, then fail with an error naming the server, never hang."""
    job = supervised(job_factory, "recover_bsp", monkeypatch, server_args=("--max-restarts", "0"), steps="400")
    server_process(job, 1).send_signal(signal.SIGKILL)
    started = time.time()
    job.wait(job.workers, timeout=60)
    for w in range(2):
        result = job.result(w)
        assert result.get("error_type") == "PSServerError", result
        assert "server1" in result["error"] and "its supervisor gave up" in result["error"], result
        assert result["error_time"] - started < 30, result


def test_a_dead_worker_ends_the_supervised_servers(job_factory, monkeypatch):
    """A worker's death is not recoverable: the servers exit 1 naming it, their supervisors do not
    restart them, and no process of the job is left."""
    job = supervised(job_factory, "recover_bsp", monkeypatch, steps="400")
    servers = [server_process(job, i) for i in range(2)]
    os.kill(job.workers[1].pid, signal.SIGKILL)
    logs = job.wait(job.servers, timeout=60)
    assert [s.returncode for s in job.servers] == [1, 1], logs
    assert all("worker1" in log and "stopped answering" in log and "starting replacement" not in log
               for log in logs), logs
    job.wait(job.workers[:1], timeout=40)
    wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in servers), 10,
             "the servers' processes to end")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
