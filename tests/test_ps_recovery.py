"""A parameter server that dies or hangs under supervision is replaced, and training goes on
exactly.

- 2 supervised servers (``hybridsync-server --supervise``) + 2 raw PS workers on loopback
  (``tests/workers/ps_scenarios.py``): every BSP sum is checked bitwise against the server's
  own summation, or the ASP servers must hold every delta exactly once, while the test kills
  (SIGKILL) or stops (SIGSTOP) server 1's process;
- whole 2-rank jobs under ``hybridsync-run`` (``tests/workers/fault_train.py``): a BSP job
  whose server is killed ends bitwise like an undisturbed one, an ASP job survives, and a
  dead worker ends the job with no process left.

Every process a test starts is stopped by pid in a fixture's teardown (a supervisor and its
server share a process group; hybridsync-run stops what it started).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import BIN, REPO, WORKERS, wait_for
from hybridsync.run.procs import stop
from test_ps import Job, job_factory  # noqa: F401 - the fixture is used by name

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


def server_process(job: Job, index: int) -> psutil.Process:
    """Server ``index``'s serving process: its supervisor's oldest child (the standby starts after it)."""
    supervisor = psutil.Process(job.servers[index].pid)

    def child() -> psutil.Process | None:
        children = sorted(supervisor.children(), key=lambda c: c.create_time())
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


# -- whole jobs under hybridsync-run (horovodrun, Gloo; servers supervised by the launcher) -----

BSP = {"version": 1, "default": {"route": "ps", "protocol": "bsp"}}
ASP = {"version": 1, "default": {"route": "ps", "protocol": "asp"}}


def start_job(tmp_path: Path, name: str, strategy: dict, steps: int = 60) -> tuple[subprocess.Popen, Path]:
    """``hybridsync-run`` of ``fault_train.py`` (2 ranks, 2 servers), its output in ``<name>.log``."""
    (tmp_path / f"{name}.json").write_text(json.dumps(strategy))
    argv = [str(BIN / "hybridsync-run"), "--strategy", str(tmp_path / f"{name}.json"), "--num-servers", "2",
            "--partition-bytes", "2000", "-np", "2", "-H", "localhost:2", "--gloo",
            sys.executable, str(WORKERS / "fault_train.py"), str(tmp_path / name), "--steps", str(steps)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(argv, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True), tmp_path / name


def steps_done(prefix: Path, rank: int) -> int:
    try:
        return int(Path(f"{prefix}.rank{rank}.step").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def serving(launcher: subprocess.Popen, index: int) -> psutil.Process:
    """Server ``index``'s serving process in ``launcher``'s job: its supervisor's oldest child
    (the supervisor's standby starts after it)."""
    def find() -> psutil.Process | None:
        for proc in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if "--supervise" in proc.cmdline() and proc.environ().get("DMLC_SERVER_ID") == str(index):
                    children = sorted(proc.children(), key=lambda c: c.create_time())
                    return children[0] if children else None
            except psutil.NoSuchProcess:
                continue
        return None
    wait_for(lambda: find() is not None, 60, f"server{index}'s process")
    return find()


def finish(launcher: subprocess.Popen, timeout: float) -> int:
    try:
        return launcher.wait(timeout=timeout)
    finally:
        if launcher.poll() is None:
            stop(launcher, grace=5.0)


@pytest.fixture
def jobs():
    started: list[subprocess.Popen] = []
    yield started
    for launcher in started:
        if launcher.poll() is None:
            stop(launcher, grace=5.0)


@pytest.mark.timeout(560)
def test_a_bsp_job_whose_server_is_killed_ends_bitwise_like_an_undisturbed_one(tmp_path, jobs):
    calm, calm_prefix = start_job(tmp_path, "calm", BSP)  # both at once: same load, half the wall time
    struck, prefix = start_job(tmp_path, "struck", BSP)
    jobs.extend([calm, struck])
    wait_for(lambda: steps_done(prefix, 0) >= 5 or struck.poll() is not None, 240, "5 steps of training")
    serving(struck, 1).send_signal(signal.SIGKILL)
    assert finish(struck, 240) == 0, (tmp_path / "struck.log").read_text()[-4000:]
    assert finish(calm, 60) == 0, (tmp_path / "calm.log").read_text()[-4000:]
    log = (tmp_path / "struck.log").read_text()
    for rank in range(2):
        final, undisturbed = torch.load(f"{prefix}.rank{rank}.pt"), torch.load(f"{calm_prefix}.rank{rank}.pt")
        assert all(torch.equal(final[name], undisturbed[name]) for name in final), rank
        recoveries = json.loads(Path(f"{prefix}.rank{rank}.json").read_text())["recoveries"]
        assert [(r["server"], r["incarnation"]) for r in recoveries] == [(1, 1)], recoveries
    assert "died (SIGKILL); starting replacement 1" in log and "replaced (incarnation 1): recovered in" in log, log


@pytest.mark.timeout(500)
def test_an_asp_job_survives_a_server_kill(tmp_path, jobs):
    struck, prefix = start_job(tmp_path, "asp", ASP)
    jobs.append(struck)
    wait_for(lambda: steps_done(prefix, 0) >= 5 or struck.poll() is not None, 240, "5 steps of training")
    serving(struck, 0).send_signal(signal.SIGKILL)  # server 0: also the one the supervisor hosts the store beside
    assert finish(struck, 240) == 0, (tmp_path / "asp.log").read_text()[-4000:]
    for rank in range(2):
        result = json.loads(Path(f"{prefix}.rank{rank}.json").read_text())
        assert [r["server"] for r in result["recoveries"]] == [0], result["recoveries"]
        assert result["losses"][-1] < result["losses"][0] / 2, result["losses"]


@pytest.mark.timeout(450)
def test_a_dead_worker_ends_the_whole_job_and_leaves_no_process(tmp_path, jobs):
    launcher, prefix = start_job(tmp_path, "dead", BSP, steps=400)
    jobs.append(launcher)
    wait_for(lambda: steps_done(prefix, 1) >= 3 or launcher.poll() is not None, 240, "3 steps of training")
    job = psutil.Process(launcher.pid).children(recursive=True)
    ranks = {p.environ().get("HOROVOD_RANK"): p for p in job
             if p.cmdline()[:2] == [sys.executable, str(WORKERS / "fault_train.py")] and "HOROVOD_RANK" in p.environ()}
    assert set(ranks) == {"0", "1"}, ranks
    killed_at = time.monotonic()
    ranks["1"].send_signal(signal.SIGKILL)
    wait_for(lambda: not psutil.wait_procs(list(ranks.values()), timeout=0)[1], 90, "both ranks gone")
    ranks_gone = time.monotonic()
    assert finish(launcher, 120) != 0
    took, after_ranks = time.monotonic() - killed_at, time.monotonic() - ranks_gone
    print(f"hybridsync-run returned {took:.1f} s after the kill, {after_ranks:.2f} s after the ranks were gone")
    gone = psutil.wait_procs(job, timeout=30)[1]
    assert not [p for p in gone if p.status() != psutil.STATUS_ZOMBIE], [p.cmdline() for p in gone]
    log = (tmp_path / "dead.log").read_text()
    assert "worker1 stopped answering" in log and "starting replacement" not in log, log[-4000:]
    assert took < 90, took
    # Before, the launcher asked the rendezvous about servers still noticing the dead worker, then tore
    # torch down at its exit: it returned 3.3-5.1 s after the ranks at load 8-16 (3.8 and 4.0 s in this
    # test); now 0.6-1.1 s, of which 0.7-0.9 s is the servers noticing the kill. Bound: 2.7x the worst now.
    assert after_ranks < 3.0, f"hybridsync-run returned {after_ranks:.1f} s after the job's ranks were gone"
