"""A strategy that sends a sparse gradient at its full dense size says so once, on rank 0."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import BIN, run_job

WORKER = Path(__file__).resolve().parent / "workers" / "dense_warning.py"


def _warnings(strategy: dict) -> dict[int, list[str]]:
    """Per rank, the warnings of a 2-rank job's first two steps."""
    proc = run_job([str(BIN / "horovodrun"), "-np", "2", "--gloo", sys.executable, str(WORKER),
                    json.dumps({"version": 1, **strategy})], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    found = (re.match(r"\[(\d)\]<stdout>:(\[.*\])$", line) for line in proc.stdout.splitlines())
    return {int(m.group(1)): json.loads(m.group(2)) for m in found if m}


@pytest.mark.multiprocess
@pytest.mark.parametrize("config, dense", [
    ({"route": "allreduce", "partitions": 2}, True),   # a partitioned sparse gradient is made dense
    ({"route": "allreduce", "group": 1}, True),        # so is a merged one
    ({"route": "allreduce"}, False),                   # whole and alone on the ring: Horovod's sparse all-gather
])
def test_a_sparse_gradient_sent_dense_is_named_once(config, dense):
    """The job gave no sign that an embedding's gradient went at its full size every step (64 KB here,
    gigabytes for a recommender's table): ``hybridsync explain`` said so ahead, the job did not."""
    variables = {"0.weight": config, **({"2.bias": {"route": "allreduce", "group": 1}} if "group" in config else {})}
    caught = _warnings({"variables": variables})
    assert caught[1] == [], caught  # one warning per job, not per rank
    if dense:
        assert caught[0] == ["hybridsync: the strategy sends 1 sparse gradient(s) dense, at full size, every step: "
                          "0.weight (0.1 MB). Only a whole variable alone in its message on the ring, or any shape "
                          "on the parameter server, travels as the rows a step touched."], caught
    else:
        assert caught[0] == []
