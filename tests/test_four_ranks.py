"""4 ranks on two "hosts" of one machine (horovodrun -H localhost:2,127.0.0.1:2): local_size 2,
cross_size 2, so hierarchical all-reduce really goes intra-node -> cross-node -> intra-node.

The job runs under ``hybridsync-run --num-servers 2`` so that one case mixes ring,
hierarchical and parameter-server messages in the same step."""
from __future__ import annotations

import json
import re
import sys
import time

import pytest

from conftest import BIN, WORKERS, horovodrun_args, launcher_argv, run_job
from hybridsync.backends.hierarchical.layout import NodeLayout, layout_from_environment

CASES = ["default", "merge_groups", "partitions", "sparse_embedding", "hierarchical",
         "hierarchical_sum_predivide", "hierarchical_mixed_with_ring", "mixed_groups_partitions_fp16",
         "ps_hierarchical_ring_mixed", "sparse_hierarchical", "sparse_ring_partitions_groups",
         "rows_ring_with_hierarchical", "rows_ps_sum_grouped"]
GLOO_INTRA_NODE_CASES = [c for c in CASES if "hierarchical" in c]
"""Run again with ``HYBRIDSYNC_INTRA_NODE=horovod``: the intra-node steps through Gloo, not shared memory."""
_cache: dict[str, dict] = {}


def results(tmp_path_factory, intra_node: str = "shm") -> dict:
    if intra_node not in _cache:
        out = tmp_path_factory.mktemp("four") / "eq.json"
        argv = [str(BIN / "hybridsync-run"), "--num-servers", "2",
                *horovodrun_args(np=4, hosts="localhost:2,127.0.0.1:2")]
        cases = CASES if intra_node == "shm" else GLOO_INTRA_NODE_CASES
        proc = run_job(argv + [sys.executable, str(WORKERS / "equivalence.py"), str(out), *cases], timeout=400,
                       env={"HYBRIDSYNC_INTRA_NODE": intra_node})
        assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:]
        _cache[intra_node] = json.loads(out.read_text())
    return _cache[intra_node]


@pytest.mark.parametrize("intra_node", ["shm", "horovod"])
@pytest.mark.multiprocess
def test_two_hosts_of_two(tmp_path_factory, intra_node):
    assert results(tmp_path_factory, intra_node)["_world"] == {"size": 4, "local_size": 2, "cross_size": 2,
                                                               "intra_node": intra_node}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.multiprocess
def test_hierarchical_and_ring_equal_horovod(case, tmp_path_factory):
    result = results(tmp_path_factory)[case]
    assert result["moved"] > 1e-3
    assert result["max_abs_diff"] <= result["tolerance"], result
    assert (result["ps_pushed_bytes"] > 0) == case.startswith(("ps_", "rows_ps")), result


@pytest.mark.parametrize("case", GLOO_INTRA_NODE_CASES)
@pytest.mark.multiprocess
def test_hierarchical_with_gloo_intra_node_equals_horovod(case, tmp_path_factory):
    result = results(tmp_path_factory, "horovod")[case]
    assert result["moved"] > 1e-3 and result["max_abs_diff"] <= result["tolerance"], result


@pytest.mark.multiprocess
def test_rank_leaving_during_shared_memory_step_ends_the_job_within_seconds():
    """A rank of a node exits (status 0, so horovodrun does not end the job for it) while its
    node peer waits for its input in shared memory: the peer fails with ``PeerExitedError``
    naming it, and the job ends in seconds, never hangs.

    Only the dead rank's node starts that step (tests/workers/collectives_worker.py), so
    nothing else can end the job first: Horovod's background loop only logs the closed
    connections ("Connection closed by peer") and does not stop a rank waiting outside it."""
    argv = launcher_argv("horovodrun", np=4, hosts="localhost:2,127.0.0.1:2")
    start = time.monotonic()
    proc = run_job(argv + [sys.executable, str(WORKERS / "collectives_worker.py"), "peer_dies"], timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and proc.stdout.count("first all-reduce done") == 4, proc.stdout[-4000:]
    assert re.search(r"\[0\]<stderr>:.*PeerExitedError: local rank 1 of this node \(pid \d+\) exited while",
                     proc.stdout), proc.stdout[-4000:]
    assert "Process 0 exit with status code 1." in proc.stdout, proc.stdout[-4000:]  # rank 0 ended the job
    assert elapsed < 60, elapsed


@pytest.mark.unit
def test_layout_from_launcher_environment():
    assert layout_from_environment({"HOROVOD_SIZE": "4", "HOROVOD_LOCAL_SIZE": "2"}) == NodeLayout(size=4, local_size=2)
    assert layout_from_environment({"OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}).num_nodes == 2
    assert layout_from_environment({"HOROVOD_SIZE": "5", "HOROVOD_LOCAL_SIZE": "2"}) is None  # not homogeneous
    assert layout_from_environment({}) is None
    layout = NodeLayout(size=6, local_size=3)
    assert layout.node_ranks() == [[0, 1, 2], [3, 4, 5]]
    assert layout.local_rank_peers() == [[0, 3], [1, 4], [2, 5]]
