"""4 ranks on two "hosts" of one machine (horovodrun -H localhost:2,127.0.0.1:2): local_size 2,
cross_size 2, so hierarchical all-reduce really goes intra-node -> cross-node -> intra-node.

The job runs under ``hybridsync-run --num-servers 2`` so that one case mixes ring,
hierarchical and parameter-server messages in the same step."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import BIN, WORKERS, launcher_argv, run_job
from hybridsync.topology import NodeLayout, layout_from_environment

CASES = ["default", "merge_groups", "partitions", "sparse_embedding", "hierarchical",
         "hierarchical_sum_predivide", "hierarchical_mixed_with_ring", "mixed_groups_partitions_fp16",
         "ps_hierarchical_ring_mixed"]
_cache: dict = {}


def results(tmp_path_factory) -> dict:
    if not _cache:
        out = tmp_path_factory.mktemp("four") / "eq.json"
        argv = [str(BIN / "hybridsync-run"), "--num-servers", "2",
                *launcher_argv("horovodrun", np=4, hosts="localhost:2,127.0.0.1:2")[1:]]
        proc = run_job(argv + [sys.executable, str(WORKERS / "equivalence.py"), str(out), *CASES], timeout=400)
        assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:]
        _cache.update(json.loads(out.read_text()))
    return _cache


def test_two_hosts_of_two(tmp_path_factory):
    assert results(tmp_path_factory)["_world"] == {"size": 4, "local_size": 2, "cross_size": 2}


@pytest.mark.parametrize("case", CASES)
def test_hierarchical_and_ring_equal_horovod(case, tmp_path_factory):
    result = results(tmp_path_factory)[case]
    assert result["moved"] > 1e-3
    assert result["max_abs_diff"] <= result["tolerance"], result
    assert (result["ps_pushed_bytes"] > 0) == case.startswith("ps_"), result


def test_layout_from_launcher_environment():
    assert layout_from_environment({"HOROVOD_SIZE": "4", "HOROVOD_LOCAL_SIZE": "2"}) == NodeLayout(size=4, local_size=2)
    assert layout_from_environment({"OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}).num_nodes == 2
    assert layout_from_environment({"HOROVOD_SIZE": "5", "HOROVOD_LOCAL_SIZE": "2"}) is None  # not homogeneous
    assert layout_from_environment({}) is None
    layout = NodeLayout(size=6, local_size=3)
    assert layout.node_ranks() == [[0, 1, 2], [3, 4, 5]]
    assert layout.local_rank_peers() == [[0, 3], [1, 4], [2, 5]]
