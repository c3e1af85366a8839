"""4 ranks on 2 emulated hosts (network namespaces, shaped 1 Gbit/s uplinks): real multi-node runs.

- hierarchical all-reduce (alone, mixed with ring, and mixed with ring and PS through the
  optimizer) trains exactly like Horovod's ring all-reduce, with local_size 2 and
  cross_size 2 as the launcher announced, under Gloo and under mpirun;
- ring, hierarchical and parameter-server transports in flight in one step give true sums;
- hierarchical all-reduce of a 64 MiB message gives the exact sum on every rank, repeatedly
  (the size at which Horovod's Gloo reduce-scatter went wrong here), and of a float16 one;
- a job that fails mid-collective, with PS servers beside it, is stopped within seconds
  and the cluster leaves nothing behind;
- a job of hierarchical and PS variables prints nothing but its servers' lines (torch's store
  clients no longer warn that these DNS-less hosts' names cannot be found).

Needs root (namespaces, tc); skips cleanly without it. Every process is bounded by a
timeout and killed by pid (``Job.wait``, cluster teardown); each test checks
``leftovers(cluster.prefix)`` so concurrent clusters never interfere.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SERVER_LINES, emulated_marks, unexpected_lines, wait_for
from hybridsync.cluster.spec import ClusterSpec

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "tests" / "workers"
pytestmark = emulated_marks(180)  # a backstop; every process below has its own bound

SPEC = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="1gbit", servers_per_node=1)
EQUIVALENCE_CASES = ["default", "hierarchical", "hierarchical_mixed_with_ring", "ps_hierarchical_ring_mixed"]
JOB_TIMEOUT_S = 120.0


def _env(cluster, extra: dict | None = None) -> dict[str, str]:
    from hybridsync.run.emulated import ps_env
    # 300 kB keys: the mixed test's 1 MB PS message becomes 4 keys spread over both servers.
    return {**os.environ, **ps_env(cluster), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "BYTEPS_PARTITION_BYTES": "300000", **(extra or {})}


def _run_job(cluster, argv: list[str], log: Path, *, servers: bool = False, timeout: float = JOB_TIMEOUT_S) -> list[int]:
    """Runs ``argv`` on every slot (launch_gloo), PS servers beside it if asked; exit codes in rank order."""
    from hybridsync.run.emulated import launch_gloo, launch_servers

    env = _env(cluster)
    with open(log, "a") as out:
        server_job = (launch_servers(cluster, env=env, stdout=out, stderr=subprocess.STDOUT) if servers else None)
        job = launch_gloo(cluster, argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        codes = job.wait(timeout=timeout)
        if server_job is not None:
            server_codes = server_job.wait(timeout=30)
            assert server_codes == [0] * SPEC.num_servers or any(codes), (server_codes, log.read_text()[-3000:])
    return codes


@pytest.fixture(scope="module")
def equivalence_job(tmp_path_factory) -> tuple[dict, str]:
    """The equivalence cases' results, and everything the job and its servers printed."""
    from hybridsync.cluster.netns import EmulatedCluster, leftovers

    tmp = tmp_path_factory.mktemp("emulated_eq")
    out, log = tmp / "eq.json", tmp / "job.log"
    with EmulatedCluster(SPEC) as cluster:
        codes = _run_job(cluster, [sys.executable, str(WORKERS / "equivalence.py"), str(out), *EQUIVALENCE_CASES], log,
                         servers=True)
    assert leftovers(cluster.prefix) == []
    assert codes == [0] * SPEC.num_workers and out.exists(), log.read_text()[-4000:]
    return json.loads(out.read_text()), log.read_text()


@pytest.fixture(scope="module")
def equivalence(equivalence_job) -> dict:
    return equivalence_job[0]


def test_job_prints_nothing_but_the_servers_lines(equivalence_job) -> None:
    """Hierarchical groups and the PS rendezvous on hosts without DNS: the workers print nothing
    (no ``[c10d] The hostname of the client socket cannot be retrieved``, no deprecation)."""
    output = equivalence_job[1]
    assert unexpected_lines(output, SERVER_LINES) == [], output[-4000:]
    assert output.count("said goodbye") == SPEC.num_servers


def test_world_is_two_hosts_of_two(equivalence) -> None:
    # The namespaces of one machine share /dev/shm: hierarchical all-reduce uses it within a host.
    assert equivalence["_world"] == {"size": 4, "local_size": 2, "cross_size": 2, "intra_node": "shm"}


@pytest.mark.parametrize("case", EQUIVALENCE_CASES)
def test_hierarchical_equals_ring_across_emulated_hosts(equivalence, case: str) -> None:
    result = equivalence[case]
    assert result["moved"] > 1e-3  # training really changed the parameters
    assert result["max_abs_diff"] <= result["tolerance"], result
    assert (result["ps_pushed_bytes"] > 0) == case.startswith("ps_"), result


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_hierarchical_equals_ring_under_mpirun(tmp_path: Path) -> None:
    """The same under Open MPI (Horovod's MPI controller, layout from OMPI_COMM_WORLD_LOCAL_SIZE)."""
    from hybridsync.run.emulated import launch_mpirun
    from hybridsync.cluster.netns import EmulatedCluster, leftovers

    cases = ["hierarchical", "hierarchical_mixed_with_ring"]
    out, log = tmp_path / "eq.json", tmp_path / "job.log"
    with open(log, "a") as stream, EmulatedCluster(SPEC) as cluster:
        job = launch_mpirun(cluster, [sys.executable, str(WORKERS / "equivalence.py"), str(out), *cases],
                            env=_env(cluster), stdout=stream, stderr=subprocess.STDOUT)
        codes = job.wait(timeout=JOB_TIMEOUT_S)
    assert leftovers(cluster.prefix) == []
    assert codes == [0] and out.exists(), log.read_text()[-4000:]
    result = json.loads(out.read_text())
    assert result["_world"] == {"size": 4, "local_size": 2, "cross_size": 2, "intra_node": "shm"}
    for case in cases:
        assert result[case]["moved"] > 1e-3 and result[case]["max_abs_diff"] <= result[case]["tolerance"], result


def test_ring_hierarchical_and_ps_transports_in_one_step(tmp_path: Path) -> None:
    """Backend level: the three transports' messages in flight together, results equal true sums.

    (The optimizer-level version is the ``ps_hierarchical_ring_mixed`` equivalence case.)
    """
    from hybridsync.cluster.netns import EmulatedCluster, leftovers

    out, log = tmp_path / "mixed.json", tmp_path / "job.log"
    with EmulatedCluster(SPEC) as cluster:
        codes = _run_job(cluster, [sys.executable, str(WORKERS / "collectives_worker.py"), "mixed", str(out)], log,
                         servers=True)
    assert leftovers(cluster.prefix) == []
    assert codes == [0] * SPEC.num_workers and out.exists(), log.read_text()[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == {"size": 4, "local_size": 2, "cross_size": 2}
    assert result["errors"] == pytest.approx({"ring": 0.0, "hier": 0.0, "ps": 0.0}, abs=1e-3), result
    assert all(load > 0 for load in result["ps_server_bytes"]), result  # both servers took keys
    assert result["uplink_tx_bytes"] > 0


def test_hierarchical_large_message_exact_on_every_rank(tmp_path: Path) -> None:
    """64 MiB float32 (and a float16 and a transposed message) x 3 reps through the same shared
    segments, distinct integer values per rank: exact sums.

    Horovod 0.28.1's Gloo reduce-scatter on the node's process set counted one contribution
    twice at this size on this cluster (benchmarks/RESULTS.md); this would have caught it.
    """
    from hybridsync.cluster.netns import EmulatedCluster, leftovers

    out, log = tmp_path / "large.json", tmp_path / "job.log"
    with EmulatedCluster(SPEC) as cluster:
        codes = _run_job(cluster, [sys.executable, str(WORKERS / "collectives_worker.py"), "large", str(out)], log)
    assert leftovers(cluster.prefix) == []
    assert codes == [0] * SPEC.num_workers and out.exists(), log.read_text()[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == {"size": 4, "local_size": 2, "cross_size": 2}
    assert result["numel"] * 4 >= 64 * 2**20
    assert result["wrong_per_rank"] == [{"float32": [0, 0, 0], "float16": [0, 0, 0], "strided": [0, 0, 0]}
                                        ] * SPEC.num_workers, result


def test_failing_job_with_servers_is_stopped_and_leaves_nothing(tmp_path: Path) -> None:
    from hybridsync.run.emulated import launch_gloo, launch_servers
    from hybridsync.cluster.netns import EmulatedCluster, leftovers, namespace_pids

    log = tmp_path / "job.log"
    with open(log, "a") as out, EmulatedCluster(SPEC) as cluster:
        env = _env(cluster)
        # Servers that will never see their workers join: only teardown can end them.
        servers = launch_servers(cluster, env=env, stdout=out, stderr=subprocess.STDOUT)
        job = launch_gloo(cluster, [sys.executable, str(WORKERS / "collectives_worker.py"), "fail"], env=env,
                          stdout=out, stderr=subprocess.STDOUT)
        start = time.monotonic()
        codes = job.wait(timeout=JOB_TIMEOUT_S)
        assert codes[3] == 3, (codes, log.read_text()[-3000:])
        assert all(code != 0 for code in codes), codes  # the blocked ranks were stopped, not waited for
        assert time.monotonic() - start < 60
        assert all(proc.poll() is None for proc in servers.processes)  # still up until teardown
        assert any(namespace_pids(name) for name in cluster.namespaces)
    assert leftovers(cluster.prefix) == []
    assert all(proc.poll() is not None for proc in [*servers.processes, *job.processes, *job.helpers])


def _listening(cluster, node: int, port: int) -> bool:
    """Whether something listens on TCP ``port`` on host ``node``."""
    listeners = cluster.exec(node, ["ss", "-Hltn", f"sport = :{port}"], timeout=10).stdout
    return bool(listeners.strip())


def test_exception_while_job_runs_tears_everything_down(tmp_path: Path) -> None:
    """Leaving the ``with`` block by an exception while ranks and servers run kills them all."""
    from hybridsync.run.emulated import DEFAULT_PS_ROOT_PORT, launch_gloo, launch_servers
    from hybridsync.cluster.netns import EmulatedCluster, leftovers

    cluster = EmulatedCluster(SPEC)
    log = tmp_path / "job.log"
    with open(log, "a") as out, pytest.raises(RuntimeError, match="interrupted"):
        with cluster:
            env = _env(cluster)
            servers = launch_servers(cluster, env=env, stdout=out, stderr=subprocess.STDOUT)
            job = launch_gloo(cluster, [sys.executable, str(WORKERS / "collectives_worker.py"), "mixed",
                                        str(tmp_path / "never.json")], env=env, stdout=out, stderr=subprocess.STDOUT)
            # Mid-job: server 0 serves the PS rendezvous on host 0 while every rank still runs.
            wait_for(lambda: _listening(cluster, 0, DEFAULT_PS_ROOT_PORT)
                     or any(proc.poll() is not None for proc in [*job.processes, *servers.processes]),
                     60, "PS rendezvous open on host 0", poll_s=0.2)
            assert all(proc.poll() is None for proc in [*job.processes, *servers.processes]), log.read_text()[-3000:]
            raise RuntimeError("interrupted")
    assert leftovers(cluster.prefix) == []
    assert all(proc.poll() is not None for proc in [*servers.processes, *job.processes, *job.helpers])


def test_a_dead_worker_ends_the_ps_servers_and_leaves_no_process(tmp_path: Path) -> None:
    """Issue 23: a rank SIGKILLed mid-training under the PS route (no elastic mode). The job's
    other ranks are stopped (as horovodrun does); the supervised servers notice, say which
    worker stopped answering and exit 1 on their own, unreplaced; then no process of the job
    is left on any host, before teardown."""
    import psutil
    from hybridsync.run.emulated import launch_gloo, launch_servers
    from hybridsync.cluster.netns import EmulatedCluster, leftovers, namespace_pids

    log = tmp_path / "job.log"
    (tmp_path / "bsp.json").write_text(json.dumps({"version": 1, "default": {"route": "ps", "protocol": "bsp"}}))
    with open(log, "a") as out, EmulatedCluster(SPEC) as cluster:
        env = _env(cluster, {"HYBRIDSYNC_STRATEGY": str(tmp_path / "bsp.json")})
        servers = launch_servers(cluster, env=env, stdout=out, stderr=subprocess.STDOUT)
        prefix = tmp_path / "train"
        job = launch_gloo(cluster, [sys.executable, str(WORKERS / "fault_train.py"), str(prefix), "--steps", "2000",
                                    "--sleep", "0.02"], env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: Path(f"{prefix}.rank3.step").exists() or any(p.poll() is not None for p in job.processes),
                 90, "rank 3 training", poll_s=0.2)
        psutil.Process(job.processes[3].pid).kill()  # the rank itself: `ip netns exec` and `sh` exec'ed into it
        killed_at = time.monotonic()
        codes = job.wait(timeout=60)
        assert codes[3] == -9 and all(code != 0 for code in codes), codes
        # Each server on its own (``Job.wait`` would stop the second once the first failed).
        wait_for(lambda: all(p.poll() is not None for p in servers.processes), 60, "the servers to exit")
        assert [p.returncode for p in servers.processes] == [1, 1], log.read_text()[-3000:]
        ended = time.monotonic() - killed_at
        text = log.read_text()
        assert "stopped answering" in text and "worker3" in text and "starting replacement" not in text, text[-3000:]
        assert ended < 60, ended
        wait_for(lambda: not any(namespace_pids(name) for name in cluster.namespaces), 15,
                 "every process on the emulated hosts to end")
    assert leftovers(cluster.prefix) == []
