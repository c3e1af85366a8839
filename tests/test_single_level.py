"""Hierarchical all-reduce where one level of the world has a single member. Two "hosts" of one rank
each (2x1, ``-H localhost:1,127.0.0.1:1``), and one host of two ranks that sum within it through
Gloo (``HYBRIDSYNC_INTRA_NODE=horovod``): there every message would be one Horovod all-reduce over
the job, so it goes Horovod's ring way (``backends.make_backend``): the same parameters as the
strategy's ring twin, to the bit, and no hierarchical groups built. One host through shared memory
is another transport and stays hierarchical (the same parameters to rounding)."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import WORKERS, launcher_argv, run_job

WORLDS = {"2x1": ("localhost:1,127.0.0.1:1", "shm"), "1x2-gloo": ("localhost:2", "horovod"),
          "1x2-shm": ("localhost:2", "shm")}
CASES = ["per_variable", "sum", "predivide", "groups_partitions_fp16", "sparse_embedding"]
_cache: dict[str, dict] = {}


def results(world: str, tmp_path_factory) -> dict:
    if world not in _cache:
        hosts, intra_node = WORLDS[world]
        out = tmp_path_factory.mktemp(world) / "single_level.json"
        proc = run_job(launcher_argv("horovodrun", np=2, hosts=hosts) +
                       [sys.executable, str(WORKERS / "single_level.py"), str(out)], timeout=300,
                       env={"HYBRIDSYNC_INTRA_NODE": intra_node})
        assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:]
        _cache[world] = json.loads(out.read_text())
    return _cache[world]


@pytest.mark.parametrize("world", sorted(WORLDS))
@pytest.mark.multiprocess
def test_world_shape(world, tmp_path_factory):
    shape = results(world, tmp_path_factory)["_world"]
    assert (shape["local_size"], shape["cross_size"]) == ((1, 2) if world == "2x1" else (2, 1)), shape


@pytest.mark.parametrize("world", ["1x2-gloo", "2x1"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.multiprocess
def test_hierarchical_goes_the_ring_way(world, case, tmp_path_factory):
    result = results(world, tmp_path_factory)[case]
    assert result["moved"] > 1e-3, "training did not move the parameters; the comparison would be vacuous"
    assert result["max_abs_diff"] == 0.0, result
    assert result["hierarchical_groups"] == 0, result


@pytest.mark.parametrize("case", CASES)
@pytest.mark.multiprocess
def test_one_host_through_shared_memory_stays_hierarchical(case, tmp_path_factory):
    result = results("1x2-shm", tmp_path_factory)[case]
    assert result["moved"] > 1e-3 and result["hierarchical_groups"] == 1, result
    assert result["max_abs_diff"] <= (2e-3 if "fp16" in case else 1e-5), result
