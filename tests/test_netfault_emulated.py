"""The link between two emulated hosts cut mid-training, under the hierarchical route (4 ranks, 2 x 2).

- cut and left cut: every rank fails with ``PeerUnreachableError`` naming the rank and node it
  waited for and the route, within seconds, and the job ends within seconds of that error (before
  s26: every rank waited in the cross-node Gloo all-reduce without a word, past 90 s, Gloo's own
  bound being 600 s; before s27: the job ended ~22 s after the error, once Horovod's shutdown at
  exit had waited its own 30 s Gloo timeout on the cut link). The same for the PS route;
- cut for 5 s, then restored: the job trains on (an outage shorter than ``HYBRIDSYNC_PEER_TIMEOUT``
  is ridden out, as Horovod's ring rides it out);
- host 1's processes killed: host 0's ranks fail at once naming the ranks that are gone and the
  route (before: Gloo's ``Read error [10.77.0.2]:51329: Connection reset by peer``, no rank, no route);
- host 1's processes stopped (SIGSTOP: hung, while their host still answers): host 0's ranks fail
  naming the rank that hangs after ``HYBRIDSYNC_PEER_HUNG_TIMEOUT`` (before: a wait of up to 600 s,
  the beacon's connection being accepted by the stopped process's kernel).

benchmarks/netfault.py measures every route under these faults and a host killed. Needs root;
skips cleanly without it. Every job is bounded and killed by pid; the link is restored and the
cluster torn down whatever happens.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, WORKERS, emulated_marks, wait_for
from hybridsync.cluster.spec import ClusterSpec

pytestmark = emulated_marks(300)

SPEC = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="1gbit", servers_per_node=1)
START_TIMEOUT_S = 120
ERROR_WITHIN_S = 25  # HYBRIDSYNC_PEER_TIMEOUT's 10 s, the probes' start, and a loaded machine's slack
ENDS_WITHIN_S = 60  # Horovod's ring alone ends ~35 s after the cut (its 30 s Gloo timeout)
PROMPT_END_S = 6.0  # a rank that raised exits at once (measured: 0.1 s); before, ~22 s (Horovod's shutdown)


@pytest.fixture(scope="module")
def cluster():
    from hybridsync.cluster.netns import EmulatedCluster, leftovers
    with EmulatedCluster(SPEC) as built:
        yield built
    assert leftovers(built.prefix) == []


def _train(cluster, tmp_path: Path, env: dict[str, str] | None = None,
           default: dict | None = None):
    """4 ranks of ``fault_train.py`` (dense, every variable on ``default``'s route: hierarchical), until
    killed; its log."""
    from hybridsync.run.emulated import launch_gloo
    strategy = tmp_path / "strategy.json"
    strategy.write_text(json.dumps({"version": 1,
                                    "default": default or {"route": "allreduce", "algorithm": "hierarchical"}}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "HYBRIDSYNC_STRATEGY": str(strategy), **(env or {})}
    log = tmp_path / "job.log"
    with open(log, "a") as out:
        job = launch_gloo(cluster, [sys.executable, str(WORKERS / "fault_train.py"), str(tmp_path / "train"),
                                    "--dense", "--steps", "100000", "--sleep", "0.05"],
                          env=env, stdout=out, stderr=subprocess.STDOUT)
    return job, log


def _step(tmp_path: Path, rank: int = 0) -> int:
    try:
        return int((tmp_path / f"train.rank{rank}.step").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _wait_training(job, tmp_path: Path, log: Path, steps: int) -> None:
    wait_for(lambda: all(_step(tmp_path, r) >= steps for r in range(4))
             or any(p.poll() is not None for p in job.processes),
             START_TIMEOUT_S, f"every rank past step {steps}", poll_s=0.2)
    assert all(p.poll() is None for p in job.processes), log.read_text()[-4000:]


def _shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/hybridsync-*"))


def test_a_cut_link_fails_every_rank_naming_the_peer_within_seconds(cluster, tmp_path):
    shm_before = _shm_files()
    job, log = _train(cluster, tmp_path)
    try:
        _wait_training(job, tmp_path, log, 5)
        cluster.set_uplink(1, up=False)
        cut = time.monotonic()
        pattern = re.compile(r"PeerUnreachableError: hierarchical all-reduce across nodes \(rank (\d), node (\d)\): "
                             r"rank (\d) on node (\d) \(10\.77\.0\.\d\) has not answered for \d+ s")
        wait_for(lambda: pattern.search(log.read_text()) is not None, ERROR_WITHIN_S,
                 "a rank's PeerUnreachableError after the cut")
        first_error = time.monotonic() - cut
        codes = job.wait(timeout=ENDS_WITHIN_S)  # as horovodrun: the first failure stops the others
        ended = time.monotonic() - cut
    finally:
        job.kill()
        job.stop_helpers()
        cluster.set_uplink(1, up=True)
    named = {(int(m[1]), int(m[2]), int(m[3]), int(m[4])) for m in pattern.finditer(log.read_text())}
    assert any(codes) and named, (codes, log.read_text()[-4000:])
    # Each rank names its cross-node peer (same local rank, the other node).
    assert all(peer == (rank + 2) % 4 and peer_node == 1 - node for rank, node, peer, peer_node in named), named
    # The rank that raised ended at once, its traceback printed, its segments removed.
    assert ended - first_error < PROMPT_END_S, (first_error, ended, log.read_text()[-4000:])
    assert "Traceback (most recent call last)" in log.read_text()
    assert _shm_files() - shm_before == set()
    print(f"first PeerUnreachableError {first_error:.1f} s after the cut, job ended after {ended:.1f} s; "
          f"named: {sorted(named)}")


def test_a_cut_link_ends_a_ps_job_within_seconds_of_the_first_error(cluster, tmp_path):
    from hybridsync.run.emulated import launch_servers, ps_env
    env = ps_env(cluster)
    with open(tmp_path / "servers.log", "a") as out:
        servers = launch_servers(cluster, env={**os.environ, "PYTHONPATH": str(REPO), **env}, stdout=out,
                                 stderr=subprocess.STDOUT)
    job, log = _train(cluster, tmp_path, env, {"route": "ps"})
    try:
        _wait_training(job, tmp_path, log, 5)
        cluster.set_uplink(1, up=False)
        cut = time.monotonic()
        pattern = re.compile(r"PSServerError: parameter server server\d ")
        wait_for(lambda: pattern.search(log.read_text()) is not None, ERROR_WITHIN_S, "a rank's PSServerError")
        first_error = time.monotonic() - cut
        codes = job.wait(timeout=ENDS_WITHIN_S)
        ended = time.monotonic() - cut
        server_codes = servers.wait(timeout=30)
    finally:
        job.kill()
        job.stop_helpers()
        servers.kill()
        cluster.set_uplink(1, up=True)
    assert any(codes) and any(server_codes), (codes, server_codes)
    assert ended - first_error < PROMPT_END_S, (first_error, ended, log.read_text()[-4000:])
    print(f"first PSServerError {first_error:.1f} s after the cut, job ended after {ended:.1f} s")


def test_a_link_down_for_5_s_is_ridden_out(cluster, tmp_path):
    job, log = _train(cluster, tmp_path)
    try:
        _wait_training(job, tmp_path, log, 5)
        cluster.set_uplink(1, up=False)
        time.sleep(5.0)
        cluster.set_uplink(1, up=True)
        restored_at = _step(tmp_path)
        wait_for(lambda: _step(tmp_path) >= restored_at + 20 or any(p.poll() is not None for p in job.processes),
                 ENDS_WITHIN_S, "20 more steps after the link came back", poll_s=0.2)
        assert all(p.poll() is None for p in job.processes), log.read_text()[-4000:]
        assert "PeerUnreachableError" not in log.read_text()
    finally:
        cluster.set_uplink(1, up=True)
        job.kill()
        job.stop_helpers()


def test_a_hung_node_is_named_after_the_hung_timeout(cluster, tmp_path):
    from hybridsync.cluster.netns import namespace_pids
    job, log = _train(cluster, tmp_path, {"HYBRIDSYNC_PEER_HUNG_TIMEOUT": "4"})
    stopped: list[int] = []
    try:
        _wait_training(job, tmp_path, log, 5)
        stopped = namespace_pids(cluster.namespaces[1])
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        at = time.monotonic()
        pattern = re.compile(r"PeerUnreachableError: hierarchical all-reduce across nodes \(rank (\d), node 0\): "
                             r"rank (\d) on node 1 \(10\.77\.0\.2\) hangs: its host answers but its process has not")
        wait_for(lambda: pattern.search(log.read_text()) is not None, ERROR_WITHIN_S, "a rank naming the hung peer")
        named = time.monotonic() - at
        codes = job.wait(timeout=ENDS_WITHIN_S)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        job.kill()
        job.stop_helpers()
    assert any(codes), codes
    assert all(int(m[2]) == int(m[1]) + 2 for m in pattern.finditer(log.read_text())), log.read_text()[-3000:]
    print(f"named {named:.1f} s after host 1's processes were stopped")


def test_a_killed_node_is_named_at_once(cluster, tmp_path):
    from hybridsync.cluster.netns import kill_pids, namespace_pids
    job, log = _train(cluster, tmp_path)
    try:
        _wait_training(job, tmp_path, log, 5)
        kill_pids(namespace_pids(cluster.namespaces[1]), grace_s=0.0)
        killed = time.monotonic()
        pattern = re.compile(r"PeerUnreachableError: hierarchical all-reduce across nodes \(rank (\d), node 0\): "
                             r"rank (\d) on node 1 \(10\.77\.0\.2\) left the collective")
        wait_for(lambda: pattern.search(log.read_text()) is not None, 15, "host 0's ranks naming the ranks gone")
        named = time.monotonic() - killed
        codes = job.wait(timeout=30)
    finally:
        job.kill()
        job.stop_helpers()
    assert any(codes), codes
    assert all(int(m[2]) == int(m[1]) + 2 for m in pattern.finditer(log.read_text())), log.read_text()[-3000:]
    print(f"named {named:.1f} s after host 1's processes were killed")
