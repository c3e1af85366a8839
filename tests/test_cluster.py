"""The emulated multi-node cluster: spec validation, guaranteed teardown, shaped links, Horovod across hosts.

Tests that build namespaces need root and skip without it; every process they start is
bounded by a timeout and killed by pid. Each test checks ``leftovers(cluster.prefix)`` so
that clusters of tests running concurrently never interfere.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import IS_ROOT, wait_for
from hybridsync.cluster.spec import ClusterSpec, parse_bandwidth

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "tests" / "workers" / "probe.py"
needs_root = pytest.mark.skipif(not IS_ROOT, reason="network namespaces and tc need root and iproute2")
needs_horovod = pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="horovod not installed")


pytestmark = pytest.mark.timeout(180)  # a backstop; every process below has its own bound


def small_spec(**overrides) -> ClusterSpec:
    fields = {"nodes": 2, "workers_per_node": 2, "inter_node_bandwidth": "1gbit", **overrides}
    return ClusterSpec(**fields)


# -- spec -------------------------------------------------------------------------------------
@pytest.mark.unit
def test_spec_from_yaml_and_properties(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("cluster:\n  nodes: 3\n  workers_per_node: 2\n  inter_node_bandwidth: 10Gbit\n"
                    "  servers_per_node: 1\n")
    spec = ClusterSpec.from_yaml(path)
    assert (spec.num_workers, spec.num_servers) == (6, 3)
    assert spec.inter_node_bits_per_second == 10**10
    assert spec.node_ips == ("10.77.0.1", "10.77.0.2", "10.77.0.3")
    assert spec.horovod_hosts == "10.77.0.1:2,10.77.0.2:2,10.77.0.3:2"
    assert ClusterSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("path", sorted((REPO / "horovodrun_configs").glob("cluster_*.yaml")), ids=lambda p: p.name)
@pytest.mark.unit
def test_cluster_run_configs_load(path: Path) -> None:
    import yaml

    spec = ClusterSpec.from_yaml(path)
    assert spec.num_workers >= 2 and spec.inter_node_bits_per_second > 0
    if importlib.util.find_spec("horovod") is not None:  # horovodrun accepts the same file
        import argparse

        from horovod.runner.common.util import config_parser

        args = argparse.Namespace(use_gloo=False, use_mpi=False)
        config_parser.set_args_from_config(args, yaml.safe_load(path.read_text()), override_args=set())
        assert args.use_gloo


@pytest.mark.unit
def test_spec_reports_every_bad_field_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("nodes: 0\nworkers_per_node: 1.5\ninter_node_bandwidth: 1000\n"
                    "inter_node_latency_ms: -1\nservers_per_node: true\nbandwith: 1gbit\n")
    with pytest.raises(ValueError) as info:
        ClusterSpec.from_yaml(path)
    message = str(info.value)
    for culprit in ("bad.yaml", "nodes", "workers_per_node", "inter_node_bandwidth",
                    "inter_node_latency_ms", "servers_per_node", "unknown key 'bandwith' (known: nodes, workers_per_node, inter_node_bandwidth"):
        assert culprit in message


@pytest.mark.unit
def test_spec_missing_keys_and_direct_construction() -> None:
    with pytest.raises(ValueError, match="missing required key 'inter_node_bandwidth'"):
        ClusterSpec.from_dict({"nodes": 2, "workers_per_node": 1})
    with pytest.raises(ValueError, match="nodes"):
        ClusterSpec(nodes=-1, workers_per_node=1, inter_node_bandwidth="1gbit")
    with pytest.raises(TypeError):
        ClusterSpec(2, 1, "1gbit")  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize("text,bits", [("1gbit", 10**9), ("100mbit", 10**8), ("2.5Gbit", 25 * 10**8),
                                       ("500kbit", 5 * 10**5)])
@pytest.mark.unit
def test_parse_bandwidth(text: str, bits: int) -> None:
    assert parse_bandwidth(text) == bits


@pytest.mark.parametrize("text", ["1gbps", "fast", "1 gb", "", "0.1kbit"])
@pytest.mark.unit
def test_parse_bandwidth_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_bandwidth(text)


@pytest.mark.unit
def test_without_root_the_error_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridsync.cluster.netns import EmulatedCluster

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="requires root"):
        EmulatedCluster(small_spec()).up()


@pytest.mark.unit
def test_each_emulated_host_gets_its_share_of_the_cores() -> None:
    from hybridsync.cluster.netns import host_cpus

    assert [host_cpus(i, 2, [1, 0]) for i in range(2)] == [(0,), (1,)]
    assert [host_cpus(i, 4, [0, 1]) for i in range(4)] == [(0,), (1,), (0,), (1,)]  # more hosts than cores
    assert [host_cpus(i, 2, range(5)) for i in range(2)] == [(0, 1), (2, 3)]


@needs_root
@pytest.mark.emulated
def test_a_pinned_cluster_runs_each_hosts_processes_on_its_cores() -> None:
    from hybridsync.cluster.netns import EmulatedCluster

    with EmulatedCluster(small_spec(), pin_hosts=True) as cluster:
        for node in range(2):
            argv = [sys.executable, "-c",
                    "import os, socket; print(','.join(map(str, sorted(os.sched_getaffinity(0)))), socket.gethostname())"]
            expected = f"{','.join(map(str, cluster.cpus[node]))} n{node}"
            assert cluster.exec(node, argv, timeout=30).stdout.strip() == expected


# -- lifecycle --------------------------------------------------------------------------------
@needs_root
@pytest.mark.emulated
def test_teardown_leaves_nothing_and_kills_processes() -> None:
    from hybridsync.cluster.netns import EmulatedCluster, leftovers, list_namespaces

    with EmulatedCluster(small_spec()) as cluster:
        assert len(list_namespaces(cluster.prefix)) == 3  # two hosts and the switch
        sleepers = [cluster.run(i, ["sleep", "60"]) for i in range(2)]
        # A grandchild that is not in our bookkeeping must die too (it lives in our namespace).
        cluster.run(1, ["sh", "-c", "sleep 60 & wait"])
        assert cluster.exec(1, ["hostname"], timeout=10).stdout.strip() == "n1"
        assert leftovers(cluster.prefix)  # the namespaces are there while it is up
    assert leftovers(cluster.prefix) == []
    assert all(proc.poll() is not None for proc in sleepers)
    cluster.teardown()  # idempotent


@needs_root
@pytest.mark.emulated
def test_teardown_after_exception_inside_with() -> None:
    from hybridsync.cluster.netns import EmulatedCluster, leftovers

    cluster = EmulatedCluster(small_spec())
    with pytest.raises(RuntimeError, match="boom"):
        with cluster:
            cluster.run(0, ["sleep", "60"])
            raise RuntimeError("boom")
    assert leftovers(cluster.prefix) == []


@pytest.mark.multiprocess
def test_a_killed_job_leaves_no_zombie() -> None:
    """``Job.kill`` reaps what it killed: the cluster holds every ``Popen`` until its teardown,
    and a trial job's servers, killed at its end, stayed zombies that long."""
    from hybridsync.run.emulated import Job

    job = Job(processes=[subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(3)])
    job.kill()
    assert [proc.returncode for proc in job.processes] == [-signal.SIGTERM] * 3
    assert not any(os.path.exists(f"/proc/{proc.pid}") for proc in job.processes)


@needs_root
@pytest.mark.emulated
def test_failing_job_is_stopped_and_torn_down() -> None:
    from hybridsync.run.emulated import Job
    from hybridsync.cluster.netns import EmulatedCluster, leftovers

    with EmulatedCluster(small_spec()) as cluster:
        job = Job(processes=[cluster.run(0, ["sh", "-c", "exit 3"]), cluster.run(1, ["sleep", "60"])])
        start = time.monotonic()
        codes = job.wait(timeout=20)
        assert codes[0] == 3 and codes[1] != 0  # the survivor was terminated, not waited for
        assert time.monotonic() - start < 10
    assert leftovers(cluster.prefix) == []


@needs_root
@pytest.mark.emulated
def test_cli_run_torn_down_on_sigterm(tmp_path: Path) -> None:
    from hybridsync.cluster.netns import leftovers, list_namespaces, namespace_pids

    spec_path = tmp_path / "c.yaml"
    spec_path.write_text("nodes: 2\nworkers_per_node: 1\ninter_node_bandwidth: 1gbit\n")
    job_id = f"t{os.getpid() % 100000}"
    prefix = f"hs-{job_id}-"
    argv = [sys.executable, "-m", "hybridsync.run.cluster_cli", "run", str(spec_path), "--job-id", job_id,
            "--all-nodes", "--", "sleep", "60"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Up, and the job's command running on both hosts: only a teardown can end it now.
        wait_for(lambda: len(list_namespaces(prefix)) == 3
                 and all(namespace_pids(f"{prefix}n{i}") for i in range(2)), 20, "cluster up with the job running")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    assert leftovers(prefix) == []


@needs_root
@pytest.mark.emulated
def test_detached_cluster_removed_by_down() -> None:
    from hybridsync.run.cluster_cli import main
    from hybridsync.cluster.netns import EmulatedCluster, leftovers

    cluster = EmulatedCluster(small_spec()).up()
    cluster.run(0, ["sleep", "60"])
    cluster.detach()
    assert leftovers(cluster.prefix)
    assert main(["down", "--prefix", cluster.prefix]) == 0
    assert leftovers(cluster.prefix) == []


# -- shaping ----------------------------------------------------------------------------------
@needs_root
@pytest.mark.emulated
def test_shaped_link_delivers_its_rate_both_ways() -> None:
    from hybridsync.cluster.linkrate import measure_tcp_rate
    from hybridsync.cluster.netns import EmulatedCluster, leftovers

    spec = small_spec(inter_node_bandwidth="100mbit")
    with EmulatedCluster(spec) as cluster:
        forward = measure_tcp_rate(cluster, src=0, dst=1, nbytes=20_000_000, timeout=20)  # ~1.7 s
        backward = measure_tcp_rate(cluster, src=1, dst=0, nbytes=10_000_000, timeout=20)
    for result in (forward, backward):
        assert 0.9 <= result.bits_per_second / spec.inter_node_bits_per_second <= 1.1, result
    assert leftovers(cluster.prefix) == []


@needs_root
@pytest.mark.emulated
def test_latency_is_shaped_where_the_kernel_has_netem_and_a_clear_error_where_not() -> None:
    from hybridsync.cluster.netns import EmulatedCluster, leftovers, netem_available, sh

    cluster = EmulatedCluster(small_spec(inter_node_latency_ms=1.0))
    if netem_available():
        with cluster:
            uplink = sh(["tc", "-n", cluster.namespaces[0], "qdisc", "show", "dev", "eth0"])
        assert "netem" in uplink and "delay" in uplink, uplink
    else:
        with pytest.raises(RuntimeError, match="netem qdisc"):
            cluster.up()
    assert leftovers(cluster.prefix) == []


# -- Horovod across hosts ---------------------------------------------------------------------
def _check_probe_output(out_dir: Path, spec: ClusterSpec, log: str) -> None:
    """Every rank's record (``tests/workers/probe.py`` writes one file per rank): all ranks,
    the true sum, and each rank on the host and in the layout it should be."""
    records = sorted((json.loads(path.read_text()) for path in out_dir.glob("rank*.json")), key=lambda r: r["rank"])
    n = spec.num_workers
    assert [r["rank"] for r in records] == list(range(n)), log[-3000:]
    expected_sum = n * (n + 1) / 2
    for record in records:
        assert record["sum_min"] == record["sum_max"] == expected_sum
        assert (record["local_size"], record["cross_size"]) == (spec.workers_per_node, spec.nodes)
        assert record["host"] == f"n{record['cross_rank']}"
        assert record["cross_rank"] == record["rank"] // spec.workers_per_node


def _uplink_bytes(cluster, node: int) -> int:
    from hybridsync.cluster.netns import sh

    out = sh(["tc", "-s", "-n", cluster.namespaces[node], "qdisc", "show", "dev", "eth0"])
    return int(out.split("Sent ")[1].split()[0])


@needs_root
@needs_horovod
@pytest.mark.emulated
def test_gloo_allreduce_across_two_hosts(tmp_path: Path) -> None:
    from hybridsync.cluster.netns import EmulatedCluster, leftovers
    from hybridsync.run.emulated import launch_gloo

    spec = small_spec()
    log = tmp_path / "job.log"
    with open(log, "w") as out, EmulatedCluster(spec) as cluster:
        before = _uplink_bytes(cluster, 1)
        job = launch_gloo(cluster, [sys.executable, str(PROBE), str(tmp_path)], stdout=out, stderr=subprocess.STDOUT)
        codes = job.wait(timeout=90)
        assert codes == [0] * spec.num_workers, log.read_text()[-3000:]
        _check_probe_output(tmp_path, spec, log.read_text())
        assert _uplink_bytes(cluster, 1) - before > 4000  # the sum really crossed the shaped link
    assert leftovers(cluster.prefix) == []


@needs_root
@needs_horovod
@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
@pytest.mark.emulated
def test_one_launcher_places_ranks_on_both_hosts(launcher: str, tmp_path: Path) -> None:
    """mpirun and horovodrun, started once (on host 0), run every rank on its own host."""
    from hybridsync.cluster.netns import EmulatedCluster, leftovers
    from hybridsync.run import emulated

    if launcher == "mpirun" and shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed")
    spec = small_spec()
    log = tmp_path / "job.log"
    with open(log, "w") as out, EmulatedCluster(spec) as cluster:
        launch = getattr(emulated, f"launch_{launcher}")
        job = launch(cluster, [sys.executable, str(PROBE), str(tmp_path)], stdout=out, stderr=subprocess.STDOUT)
        codes = job.wait(timeout=120)
        assert codes == [0], log.read_text()[-3000:]
        _check_probe_output(tmp_path, spec, log.read_text())
    assert leftovers(cluster.prefix) == []


@needs_root
@pytest.mark.emulated
def test_cli_run_starts_servers_on_every_host(tmp_path: Path) -> None:
    from hybridsync.run.cluster_cli import main

    spec_path = tmp_path / "c.yaml"
    spec_path.write_text("nodes: 2\nworkers_per_node: 1\ninter_node_bandwidth: 1gbit\nservers_per_node: 2\n")
    marks = tmp_path / "marks"
    marks.mkdir()
    server = f"sh -c 'touch {marks}/$(hostname)-$DMLC_ROLE-$DMLC_SERVER_ID-$DMLC_NUM_SERVER; sleep 60'"
    # The job waits until all four servers have checked in, then leaves its own mark.
    job = (f"while [ $(ls {marks} | wc -l) -lt 4 ]; do sleep 0.1; done; "
           f"touch {marks}/$(hostname)-$DMLC_ROLE-$DMLC_PS_ROOT_URI-$DMLC_NUM_WORKER")
    assert main(["run", str(spec_path), "--servers", server, "--timeout", "20", "--", "sh", "-c", job]) == 0
    assert sorted(p.name for p in marks.iterdir()) == [
        "n0-server-0-4", "n0-server-1-4", "n0-worker-10.77.0.1-2", "n1-server-2-4", "n1-server-3-4"]


@pytest.mark.unit
def test_an_oversized_emulated_cluster_is_refused_before_anything_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridsync.cluster.netns import EmulatedCluster, check_fits_machine
    monkeypatch.delenv("HYBRIDSYNC_EMULATED_PROCESSES_PER_CORE", raising=False)
    big = ClusterSpec(nodes=40, workers_per_node=16, inter_node_bandwidth="1gbit")
    with pytest.raises(ValueError, match=r"640 processes \(40 nodes x \(16 workers \+ 0 servers\)\) on 2 cores is "
                                         r"over 8 per core.*HYBRIDSYNC_EMULATED_PROCESSES_PER_CORE"):
        check_fits_machine(big, cores=2)
    check_fits_machine(ClusterSpec(nodes=4, workers_per_node=4, inter_node_bandwidth="1gbit"), cores=2)  # 16: fits
    with pytest.raises(ValueError, match="per core"):  # the constructor checks, with this machine's cores
        EmulatedCluster(ClusterSpec(nodes=250, workers_per_node=1000, inter_node_bandwidth="1gbit"))
    monkeypatch.setenv("HYBRIDSYNC_EMULATED_PROCESSES_PER_CORE", "0")
    check_fits_machine(big, cores=2)  # no bound
    monkeypatch.setenv("HYBRIDSYNC_EMULATED_PROCESSES_PER_CORE", "400")
    check_fits_machine(big, cores=2)
    monkeypatch.setenv("HYBRIDSYNC_EMULATED_PROCESSES_PER_CORE", "many")
    with pytest.raises(ValueError, match="HYBRIDSYNC_EMULATED_PROCESSES_PER_CORE='many'"):
        check_fits_machine(big, cores=2)
