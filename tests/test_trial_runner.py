"""The trial runner with real jobs (hybridsync-run -np 2 on this host): failures, kills, resume."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys

import psutil
import pytest

from conftest import BIN, REPO, run_job, wait_for
from hybridsync.trials.store import TrialStore

pytestmark = pytest.mark.multiprocess

HOROVOD = {"kind": "horovod", "strategy": None}
RING = {"kind": "ring", "strategy": {"version": 1, "default": {"route": "allreduce"}}}
MIXED = {"kind": "mixed", "strategy": {"version": 1, "default": {"route": "allreduce"},
                                       "variables": {"gmf_user.weight": {"route": "ps"}}}}
REFUSED = {"kind": "refused", "strategy": {"version": 1, "variables": {"no_such.weight": {"route": "ps"}}}}
CRASH = {"kind": "crash-me", "strategy": {"version": 1, "default": {"route": "allreduce", "compression": "fp16"}}}
HANG = {"kind": "hang-me", "strategy": {"version": 1, "default": {"route": "allreduce", "group": 0}}}


def write_inputs(tmp_path, candidates: list[dict]) -> tuple[str, str, str]:
    """Cluster spec (one host, 2 ranks, 1 server), candidates file and store URL."""
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes: 1\nworkers_per_node: 2\ninter_node_bandwidth: 1gbit\nservers_per_node: 1\n")
    strategies = tmp_path / "candidates.json"
    strategies.write_text(json.dumps(candidates))
    return str(spec), str(strategies), f"sqlite:///{tmp_path / 'trials.db'}"


def trials_argv(spec: str, strategies: str, store: str, tmp_path) -> list[str]:
    return [str(BIN / "hybridsync"), "trials", "run", "--model", "ncf", "--cluster", spec, "-H", "localhost:2",
            "--strategies", strategies, "--store", store, "--warmup", "1", "--steps", "3",
            "--trial-timeout", "25", "--workdir", str(tmp_path / "jobs" / "logs"),  # made by the run
            "--settle-s", "0"]  # no step time is compared: the 6 s settle of each job bought nothing here


def test_failed_trials_are_recorded_with_their_reason_and_the_run_goes_on(tmp_path):
    last = {"kind": "last", "strategy": {"version": 1, "default": {"route": "allreduce", "algorithm": "hierarchical"}}}
    spec, strategies, store = write_inputs(tmp_path, [HOROVOD, REFUSED, RING, CRASH, MIXED, HANG, last])
    proc = run_job(trials_argv(spec, strategies, store, tmp_path), timeout=400,
                   env={"HYBRIDSYNC_TRIAL_FAULT": "crash-me:crash,hang-me:hang"})
    assert proc.returncode == 0, proc.stdout[-5000:]
    with TrialStore(store) as trials:
        records = {r.kind: r for r in trials.trials()}
    assert set(records) == {"horovod", "refused", "ring", "crash-me", "mixed", "hang-me", "last"}
    for kind in ("horovod", "ring", "mixed", "last"):
        assert records[kind].status == "ok", records[kind].reason
        assert len(records[kind].step_times) == 4 and records[kind].median_s > 0
    assert records["refused"].status == "failed" and "no_such.weight" in records["refused"].reason
    assert records["crash-me"].status == "failed" and "9" in records["crash-me"].reason.rpartition("exit codes")[2]
    assert records["hang-me"].status == "failed" and "timed out" in records["hang-me"].reason
    jobs = {r.job for r in records.values()}
    assert len(jobs) == 3, "a new job after the crash and after the hang"
    assert "4 measured, 3 failed" in proc.stdout
    logs = tmp_path / "jobs" / "logs"
    assert "hybridsync.ps.server" in (logs / f"{records['mixed'].job}.log").read_text()
    assert "hybridsync.ps.server" not in (logs / f"{records['last'].job}.log").read_text(), \
        "a job whose strategies route nothing to a server starts none (they would wait out their join timeout)"


def _is_resource_tracker(pid: int) -> bool:
    try:
        return any("multiprocessing.resource_tracker" in part for part in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def test_a_killed_runner_loses_at_most_the_trial_in_flight_and_resumes(tmp_path):
    candidates = [HOROVOD] + [{"kind": f"ring-{i}", "strategy": {"version": 1, "default": {"route": "allreduce"},
                                                                 "variables": {"gmf_user.weight": {"partitions": i}}}}
                              for i in range(1, 7)]
    spec, strategies, store = write_inputs(tmp_path, candidates)
    argv = trials_argv(spec, strategies, store, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runner = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    db = tmp_path / "trials.db"
    try:
        def stored() -> int:
            if not db.exists():
                return 0
            try:
                with TrialStore(store) as trials:
                    return len(trials.trials())
            except sqlite3.Error:
                return 0
        wait_for(lambda: stored() >= 2, timeout=240, what="two trials stored")
    finally:
        # The runner and its job, which runs in sessions of its own; not horovodrun's resource
        # tracker: it exits by itself once they are gone, unlinking the named semaphores they
        # leave (killed too, it left ~10 /dev/shm/sem.mp-* files behind per run of this test).
        family = [runner.pid] + [p.pid for p in psutil.Process(runner.pid).children(recursive=True)]
        trackers = [pid for pid in family if _is_resource_tracker(pid)]
        for pid in family:
            if pid not in trackers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        runner.wait(timeout=10)
        psutil.wait_procs([psutil.Process(p) for p in family if psutil.pid_exists(p)], timeout=10)
    with sqlite3.connect(db) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with TrialStore(store) as trials:
        before = {r.fingerprint for r in trials.trials()}
    assert 2 <= len(before) < len(candidates)
    proc = run_job(argv, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert f"{len(before)} already in the store" in proc.stdout
    with TrialStore(store) as trials:
        records = trials.trials()
    assert sorted(r.kind for r in records) == sorted(c["kind"] for c in candidates)
    assert all(r.status == "ok" for r in records)
